#!/usr/bin/env bash
# A 3-node RabbitMQ cluster (qa, qb, qc @localhost) on loopback ports, beside the machine's own
# rabbit@localhost (5672/15672), which this never stops, reconfigures or talks to.
#
#   start             the three nodes up and clustered (quick no-op when they already are)
#   stop              stop the three nodes and remove their directories
#   start-node X      start node X again (it rejoins by itself: its mnesia dir is kept)
#   stop-node X       stop node X gracefully
#   kill-node X       kill -9 node X's Erlang VM
#   env               shell exports for the tests
#
# Node i (qa=1, qb=2, qc=3): AMQP 127.0.0.1:570i, management 127.0.0.1:1570i, Erlang dist 2570i.
# Each node lives in ${QUEUEGUARD_CLUSTER_DIR:-/tmp/queueguard-cluster}/X, with its environment in
# X/env.sh and its log in X/log. The recipe and what the cluster does: ../shared/RABBITMQ-CLUSTER.md.
set -euo pipefail

NODES=(qa qb qc)
BASE="${QUEUEGUARD_CLUSTER_DIR:-/tmp/queueguard-cluster}"
# Node names and ports are machine-wide, so one lock for every checkout and base dir.
LOCK=/tmp/queueguard-cluster.lock
RABBIT_BIN=/usr/lib/rabbitmq/bin
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  echo "usage: $0 start | stop | start-node X | stop-node X | kill-node X | env   (X: ${NODES[*]})" >&2
  exit 2
}

fail() {
  echo "rabbitmq cluster: $*" >&2
  exit 1
}

index_of() {
  case "$1" in
    qa) echo 1 ;;
    qb) echo 2 ;;
    qc) echo 3 ;;
    *) echo "rabbitmq cluster: unknown node '$1' (one of ${NODES[*]})" >&2; usage ;;
  esac
}
amqp_port() { echo "570$(index_of "$1")"; }
mgmt_port() { echo "1570$(index_of "$1")"; }
dist_port() { echo "2570$(index_of "$1")"; }

# fd 9 holds the lock: close it for everything that may leave a daemon behind (the node's VM, an
# epmd started by a CLI call), or the lock would live as long as that daemon.
ctl() { rabbitmqctl "$@" 9>&-; }
diag() { rabbitmq-diagnostics "$@" 9>&-; }

# The node's VM: a live beam.smp whose environment names the node. The node name is not on the
# command line (3.10 passes it in RABBITMQ_NODENAME), so `pgrep -f X@localhost` cannot find it.
is_node_vm() {
  [ -n "$1" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = beam.smp ] \
    && tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | grep -qx "RABBITMQ_NODENAME=$2@localhost"
}

node_pid() {
  local x=$1 pid
  pid="$(tr -dc 0-9 2>/dev/null <"$BASE/$x/$x.pid" || true)"
  if is_node_vm "$pid" "$x"; then echo "$pid"; return 0; fi
  # No pid file yet (early boot), or the node runs from another base dir.
  for pid in $(pgrep -x beam.smp || true); do
    if is_node_vm "$pid" "$x"; then echo "$pid"; return 0; fi
  done
  return 1
}

# A zombie counts as gone: it holds no port, and PID 1 here (not an init) reaps it only a second
# or more later.
alive() { [ -e "/proc/$1" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

wait_gone() { # pid seconds
  local deadline=$((SECONDS + $2))
  while alive "$1" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.05; done
  ! alive "$1"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

mgmt_answers() { # node
  curl -fsS -m 5 -u guest:guest "http://127.0.0.1:$(mgmt_port "$1")/api/overview?columns=node" 2>/dev/null \
    | grep -q "\"node\":\"$1@localhost\""
}

log_tail() {
  local log="$BASE/$1/log/$1@localhost.log"
  [ -f "$log" ] && { echo "--- last lines of $log:"; tail -n 20 "$log"; } >&2
  local boot="$BASE/$1/log/startup.log"
  [ -s "$boot" ] && { echo "--- $boot:"; tail -n 20 "$boot"; } >&2
  return 0
}

# Up = every node's management API and AMQP port answer, and qa sees all three running. HTTP only,
# so an idempotent `start` costs well under a second.
cluster_up() {
  local x nodes
  for x in "${NODES[@]}"; do
    [ -f "$BASE/$x/env.sh" ] && mgmt_answers "$x" && port_open "$(amqp_port "$x")" || return 1
  done
  nodes="$(curl -fsS -m 5 -u guest:guest "http://127.0.0.1:$(mgmt_port qa)/api/nodes?columns=name,running" 2>/dev/null)" \
    || return 1
  for x in "${NODES[@]}"; do
    grep -q "{\"name\":\"$x@localhost\",\"running\":true}" <<<"$nodes" || return 1
  done
}

running_nodes() { # as qa's cluster_status lists them, comma-separated
  diag -n qa@localhost -q cluster_status --formatter json 2>/dev/null \
    | grep -o '"running_nodes":\[[^]]*\]' | grep -o '[a-z0-9_-]*@[a-z0-9_.-]*' | paste -sd, -
}

write_node() { # node: a fresh directory with its config and environment
  local x=$1 d="$BASE/$1"
  rm -rf "$d"
  mkdir -p "$d/mnesia" "$d/log"
  cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$(amqp_port "$x")
management.tcp.port = $(mgmt_port "$x")
management.tcp.ip = 127.0.0.1
EOF
  echo '[rabbitmq_management,rabbitmq_event_exchange].' >"$d/enabled_plugins"
  # Its own env file: Debian's /etc/rabbitmq/rabbitmq-env.conf hard-codes NODENAME=rabbit@localhost.
  cat >"$d/rabbitmq-env.conf" <<'EOF'
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
  {
    echo "# Environment of RabbitMQ node $x@localhost, written by scripts/rabbitmq-cluster.sh."
    printf 'export RABBITMQ_CONF_ENV_FILE=%q\n' "$d/rabbitmq-env.conf"
    printf 'export RABBITMQ_NODENAME=%q\n' "$x@localhost"
    printf 'export RABBITMQ_NODE_PORT=%q\n' "$(amqp_port "$x")"
    printf 'export RABBITMQ_DIST_PORT=%q\n' "$(dist_port "$x")"
    printf 'export RABBITMQ_MNESIA_BASE=%q\n' "$d/mnesia"
    printf 'export RABBITMQ_LOG_BASE=%q\n' "$d/log"
    printf 'export RABBITMQ_ENABLED_PLUGINS_FILE=%q\n' "$d/enabled_plugins"
    printf 'export RABBITMQ_CONFIG_FILE=%q\n' "$d/rabbitmq.conf"
    # Not there on purpose: keeps a future /etc/rabbitmq/advanced.config away from these nodes.
    printf 'export RABBITMQ_ADVANCED_CONFIG_FILE=%q\n' "$d/advanced.config"
    printf 'export RABBITMQ_PID_FILE=%q\n' "$d/$x.pid"
  } >"$d/env.sh"
  chown -R rabbitmq: "$d"
}

launch() { # node: start its VM detached, as the rabbitmq user (its Erlang cookie is the machine's)
  local x=$1 d="$BASE/$1"
  [ -f "$d/env.sh" ] || fail "$d/env.sh is missing; run '$0 start' first"
  rm -f "$d/$x.pid"
  # env -i: nothing from the caller's environment (RABBITMQ_*, ERL_*) reaches the node. No fd of
  # ours stays open in the daemon either, or a caller reading our output would never see EOF.
  (cd "$d" && su rabbitmq -s /bin/sh -c \
    "exec env -i HOME=\"\$HOME\" PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 /bin/sh -c '. ./env.sh && exec $RABBIT_BIN/rabbitmq-server -detached'" \
    </dev/null >>"$d/log/startup.log" 2>&1 9>&-) \
    || { log_tail "$x"; fail "$x@localhost did not start"; }
}

await_node() { # node seconds: the node's app is up
  local x=$1 start=$SECONDS deadline=$((SECONDS + $2))
  until ctl -n "$x@localhost" -q --timeout 10 await_startup >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log_tail "$x"; fail "$x@localhost not started after $2 s"
    fi
    # The VM gone (a bad config, a port taken) will not come back: say so now, not at the deadline.
    if [ $((SECONDS - start)) -ge 5 ] && ! node_pid "$x" >/dev/null; then
      log_tail "$x"; fail "$x@localhost exited while starting"
    fi
    sleep 1
  done
}

await_mgmt() { # node seconds
  local deadline=$((SECONDS + $2))
  until mgmt_answers "$1" && port_open "$(amqp_port "$1")"; do
    [ "$SECONDS" -lt "$deadline" ] || { log_tail "$1"; fail "$1@localhost not answering on $(amqp_port "$1") and $(mgmt_port "$1") after $2 s"; }
    sleep 0.5
  done
}

halt_node() { # node [quiet]: graceful stop, kill -9 if the VM lingers; a node already down is fine
  local x=$1 pid
  pid="$(node_pid "$x" || true)"
  [ -n "$pid" ] || return 0
  timeout 90 rabbitmqctl -n "$x@localhost" -q stop --idempotent </dev/null >/dev/null 2>&1 9>&- || true
  if ! wait_gone "$pid" 30; then
    echo "rabbitmq cluster: $x@localhost (pid $pid) still there after stop, killing it" >&2
    kill -9 "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || fail "$x@localhost (pid $pid) does not go away"
  fi
  [ -n "${2:-}" ] || echo "rabbitmq cluster: $x@localhost stopped"
}

up_line() {
  local x line=""
  for x in "${NODES[@]}"; do line+="${line:+, }$x $(amqp_port "$x")"; done
  echo "$line"
}

halt_all() { # the nodes at once: each stop takes seconds
  local x pids=() rc=0
  for x in "${NODES[@]}"; do halt_node "$x" "${1:-}" & pids+=($!); done
  for x in "${pids[@]}"; do wait "$x" || rc=1; done
  return "$rc"
}

cmd_start() {
  if cluster_up; then
    echo "rabbitmq cluster: already up ($(up_line))"
    return 0
  fi
  local x t0=$SECONDS
  echo "rabbitmq cluster: (re)creating ${NODES[*]} under $BASE"
  halt_all quiet || fail "could not stop the old nodes"
  local p
  for x in "${NODES[@]}"; do
    for p in "$(amqp_port "$x")" "$(mgmt_port "$x")" "$(dist_port "$x")"; do
      if port_open "$p"; then
        fail "port $p is taken: $(ss -ltnpH "sport = :$p" 2>/dev/null | head -n 1)"
      fi
    done
  done
  mkdir -p "$BASE"
  chmod 755 "$BASE"
  for x in "${NODES[@]}"; do
    write_node "$x"
    # The rabbitmq user must reach the directory (a base under /root would not do).
    su rabbitmq -s /bin/sh -c "test -w $(printf %q "$BASE/$x")" 9>&- \
      || fail "the rabbitmq user cannot write $BASE/$x; set QUEUEGUARD_CLUSTER_DIR elsewhere"
  done
  for x in "${NODES[@]}"; do launch "$x"; done
  for x in "${NODES[@]}"; do await_node "$x" 120; done
  # The CLI logs errors about the joining node's tables while it joins: noise unless it fails.
  for x in "${NODES[@]:1}"; do
    { ctl -n "$x@localhost" -q stop_app \
      && ctl -n "$x@localhost" -q join_cluster qa@localhost \
      && ctl -n "$x@localhost" -q start_app; } >"$BASE/$x/log/join.log" 2>&1 \
      || { cat "$BASE/$x/log/join.log" >&2; log_tail "$x"; fail "$x@localhost could not join qa@localhost"; }
  done
  for x in "${NODES[@]}"; do await_node "$x" 60; done
  local deadline=$((SECONDS + 60)) running
  until running="$(running_nodes || true)"; [ "$(tr , '\n' <<<"$running" | grep -c .)" -eq "${#NODES[@]}" ]; do
    [ "$SECONDS" -lt "$deadline" ] || fail "qa@localhost lists running nodes '$running', not ${NODES[*]}"
    sleep 1
  done
  for x in "${NODES[@]}"; do await_mgmt "$x" 60; done
  echo "rabbitmq cluster: up ($(up_line)) in $((SECONDS - t0)) s"
}

cmd_stop() {
  local x
  halt_all || fail "could not stop every node; $BASE kept"
  # Only our node directories: QUEUEGUARD_CLUSTER_DIR may point somewhere that holds other things.
  for x in "${NODES[@]}"; do rm -rf "${BASE:?}/$x"; done
  rmdir "$BASE" 2>/dev/null || true
  echo "rabbitmq cluster: down"
}

cmd_start_node() {
  local x=$1 t0=$SECONDS
  index_of "$x" >/dev/null
  [ -f "$BASE/$x/env.sh" ] || fail "no $BASE/$x/env.sh; run '$0 start' first"
  if node_pid "$x" >/dev/null; then
    echo "rabbitmq cluster: $x@localhost already running"
  else
    launch "$x"
  fi
  await_node "$x" 120
  await_mgmt "$x" 60
  echo "rabbitmq cluster: $x@localhost up (AMQP $(amqp_port "$x"), management $(mgmt_port "$x")) in $((SECONDS - t0)) s"
}

cmd_stop_node() {
  index_of "$1" >/dev/null
  if node_pid "$1" >/dev/null; then halt_node "$1"; else echo "rabbitmq cluster: $1@localhost already down"; fi
}

cmd_kill_node() {
  local x=$1 pid
  index_of "$x" >/dev/null
  pid="$(node_pid "$x")" || fail "$x@localhost is not running"
  kill -9 "$pid"
  wait_gone "$pid" 10 || fail "$x@localhost (pid $pid) survived kill -9"
  echo "rabbitmq cluster: $x@localhost killed (pid $pid)"
}

cmd_env() {
  local x addrs=() mgmt=()
  for x in "${NODES[@]}"; do
    addrs+=("127.0.0.1:$(amqp_port "$x")")
    mgmt+=("http://127.0.0.1:$(mgmt_port "$x")")
  done
  local IFS=,
  echo "export QUEUEGUARD_CLUSTER_ADDRESSES=${addrs[*]}"
  echo "export QUEUEGUARD_CLUSTER_MANAGEMENT=${mgmt[*]}"
}

[ $# -ge 1 ] || usage
case "$1" in
  env) cmd_env; exit 0 ;;
  start | stop) [ $# -eq 1 ] || usage ;;
  start-node | stop-node | kill-node) [ $# -eq 2 ] || usage ;;
  *) usage ;;
esac

# Root, for su to the rabbitmq user and for signalling its processes.
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || fail "needs root (or sudo)"
  exec sudo env QUEUEGUARD_CLUSTER_DIR="$BASE" "$0" "$@"
fi
case "$BASE" in
  /*/*) ;;
  *) fail "QUEUEGUARD_CLUSTER_DIR must be an absolute path below /, not '$BASE'" ;;
esac
if ! command -v rabbitmq-server >/dev/null 2>&1 || [ ! -x "$RABBIT_BIN/rabbitmq-server" ]; then
  "$HERE/rabbitmq.sh"
fi
[ -x "$RABBIT_BIN/rabbitmq-server" ] || fail "no $RABBIT_BIN/rabbitmq-server (Debian's rabbitmq-server package)"

exec 9>"$LOCK"
flock -w 600 9 || fail "another $0 held $LOCK for 600 s"

case "$1" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  start-node) cmd_start_node "$2" ;;
  stop-node) cmd_stop_node "$2" ;;
  kill-node) cmd_kill_node "$2" ;;
esac
