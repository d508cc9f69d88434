#!/usr/bin/env bash
# Makes sure RabbitMQ answers on 127.0.0.1:5672 (guest/guest) with the management (15672),
# event exchange and prometheus (15692) plugins enabled: installs Debian's package if missing,
# starts it if stopped.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
PLUGINS="rabbitmq_management rabbitmq_event_exchange rabbitmq_prometheus"

if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "rabbitmq: installing Debian's rabbitmq-server"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
fi

if ! $SUDO rabbitmqctl -q status >/dev/null 2>&1; then
  echo "rabbitmq: starting"
  $SUDO rabbitmq-plugins enable --offline $PLUGINS >/dev/null
  $SUDO rabbitmq-server -detached
fi
$SUDO rabbitmqctl -q --timeout 120 await_startup
# Online enable is a no-op when the plugins already run.
$SUDO rabbitmq-plugins -q enable $PLUGINS >/dev/null

for _ in $(seq 1 120); do
  if curl -fsS -u guest:guest http://127.0.0.1:15672/api/overview >/dev/null 2>&1 \
    && (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
    echo "rabbitmq: up ($(curl -fsS -u guest:guest http://127.0.0.1:15672/api/overview | sed -E 's/.*"rabbitmq_version":"([^"]+)".*/\1/'))"
    exit 0
  fi
  sleep 1
done
echo "rabbitmq: not answering on 5672 and 15672 after 120 s" >&2
exit 1
