#!/usr/bin/env bash
# Installs the Debian packages the test suite drives for real, only those missing. Needs root (CI is root).
set -euo pipefail
need=()
command -v git >/dev/null || need+=(git)
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v sqlite3 >/dev/null || need+=(sqlite3)
command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -eq 0 ]; then
  echo "system deps present" >&2
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages: ${need[*]} (run as root, or install them)" >&2
  exit 1
fi
echo "installing: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
