#!/usr/bin/env bash
# RabbitMQ 4.0 (Debian 13's rabbitmq-server, on Erlang 27) beside the machine's 3.10 broker, in a
# root of its own made from Debian's packages (../shared/RABBITMQ-4.md says how and what it measured).
#
#   start    make the root if missing (about 2 minutes, then cached), start the node, wait for it
#   stop     stop the node and unmount /proc, /dev, /sys from the root (the root stays, cached)
#   env      shell exports that point the broker tests at it
#   ctl ...  rabbitmqctl of that node
#
# AMQP 127.0.0.1:5673, management 127.0.0.1:15673, rabbitmq_prometheus 127.0.0.1:15693 (the
# host's 15692 is the 3.10 broker's), distribution 25673, node rabbit4@localhost, guest/guest,
# plugins rabbitmq_management, rabbitmq_event_exchange and rabbitmq_prometheus.
set -euo pipefail

ROOT="${QUEUEGUARD_RABBITMQ4_ROOT:-$HOME/.cache/queueguard/rabbitmq4-root}"
AMQP_PORT=5673
MGMT_PORT=15673
PROMETHEUS_PORT=15693
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

fail() {
  echo "rabbitmq4: $*" >&2
  exit 1
}

in_root() { $SUDO chroot "$ROOT" env HOME=/var/lib/rabbitmq "$@"; }

make_root() {
  if ! command -v debootstrap >/dev/null 2>&1; then
    echo "rabbitmq4: installing Debian's debootstrap"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  echo "rabbitmq4: making $ROOT from Debian 13's packages (about 2 minutes, once)"
  local tmp="$ROOT.partial"
  $SUDO rm -rf "$tmp"
  mkdir -p "$(dirname "$ROOT")"
  $SUDO debootstrap --variant=minbase --include=rabbitmq-server trixie "$tmp" \
    http://deb.debian.org/debian >"$(dirname "$ROOT")/debootstrap.log" 2>&1 \
    || fail "debootstrap failed; see $(dirname "$ROOT")/debootstrap.log"
  # Only a finished root is kept: an interrupted debootstrap starts over next time.
  $SUDO mv "$tmp" "$ROOT"
}

# Writes the node's configuration; says (exit 0) when it changed, so a running node restarts to
# read it. Written on every start, so a root cached by an older version of this script is brought
# up to date.
configure() {
  local etc="$ROOT/etc/rabbitmq" conf env plugins changed=1
  conf="listeners.tcp.default = 127.0.0.1:$AMQP_PORT
management.tcp.port = $MGMT_PORT
management.tcp.ip = 127.0.0.1
prometheus.tcp.port = $PROMETHEUS_PORT
prometheus.tcp.ip = 127.0.0.1
loopback_users = none"
  env=$'NODENAME=rabbit4@localhost\nDIST_PORT=25673'
  plugins='[rabbitmq_management,rabbitmq_event_exchange,rabbitmq_prometheus].'
  $SUDO mkdir -p "$etc"
  write() {
    if [ "$($SUDO cat "$etc/$1" 2>/dev/null)" != "$2" ]; then
      printf '%s\n' "$2" | $SUDO tee "$etc/$1" >/dev/null
      changed=0
    fi
  }
  write rabbitmq.conf "$conf"
  write rabbitmq-env.conf "$env"
  write enabled_plugins "$plugins"
  return $changed
}

mount_root() {
  local m
  for m in proc dev sys; do
    mountpoint -q "$ROOT/$m" || $SUDO mount --bind "/$m" "$ROOT/$m"
  done
}

answers() {
  curl -fsS -u guest:guest "http://127.0.0.1:$MGMT_PORT/api/overview" >/dev/null 2>&1 \
    && (exec 3<>"/dev/tcp/127.0.0.1/$AMQP_PORT") 2>/dev/null \
    && curl -fsS "http://127.0.0.1:$PROMETHEUS_PORT/metrics/detailed?family=identity_info" >/dev/null 2>&1
}

start() {
  [ -x "$ROOT/usr/sbin/rabbitmq-server" ] || make_root
  mount_root
  if configure && in_root rabbitmqctl -q status >/dev/null 2>&1; then
    echo "rabbitmq4: configuration changed, restarting"
    in_root rabbitmqctl -q stop >/dev/null
  fi
  if ! answers; then
    # `-detached` returns before the node has registered: the loop below waits for it.
    if ! in_root rabbitmqctl -q status >/dev/null 2>&1; then
      echo "rabbitmq4: starting"
      in_root rabbitmq-server -detached
    fi
  fi
  for _ in $(seq 1 120); do
    if answers; then
      echo "rabbitmq4: up ($(curl -fsS -u guest:guest "http://127.0.0.1:$MGMT_PORT/api/overview" \
        | sed -E 's/.*"rabbitmq_version":"([^"]+)".*/\1/'))"
      return 0
    fi
    sleep 1
  done
  fail "not answering on $AMQP_PORT, $MGMT_PORT and $PROMETHEUS_PORT after 120 s"
}

# Stops the node and unmounts what `start` bound into the root, so that removing the root
# (rm -rf) can never reach the machine's own /dev, /proc or /sys.
stop() {
  [ -d "$ROOT" ] || return 0
  if mountpoint -q "$ROOT/proc"; then
    in_root rabbitmqctl -q stop >/dev/null 2>&1 || true
  fi
  local m
  for m in sys dev proc; do
    if mountpoint -q "$ROOT/$m"; then $SUDO umount "$ROOT/$m" || $SUDO umount -l "$ROOT/$m"; fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  ctl)
    shift
    in_root rabbitmqctl "$@"
    ;;
  env)
    echo "export QUEUEGUARD_TEST_RABBITMQCTL='$(cd "$(dirname "$0")" && pwd)/rabbitmq4.sh ctl'"
    echo "export QUEUEGUARD_TEST_BROKER=amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2F"
    echo "export QUEUEGUARD_TEST_MANAGEMENT=http://127.0.0.1:$MGMT_PORT"
    echo "export QUEUEGUARD_TEST_PROMETHEUS=http://127.0.0.1:$PROMETHEUS_PORT"
    ;;
  *) echo "usage: $0 start | stop | env | ctl ARGS..." >&2; exit 2 ;;
esac
