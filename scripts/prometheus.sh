#!/usr/bin/env bash
# Makes sure Debian's prometheus (the server and promtool) is installed, for tests/prometheus.rs.
# The tests start their own server on a free loopback port; nothing runs here.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  echo "prometheus: installing Debian's prometheus"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package's service is not wanted: the tests run their own server.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    $SUDO systemctl stop prometheus || true
  fi
fi
echo "prometheus: $(prometheus --version 2>&1 | head -1)"
