#!/usr/bin/env bash
# Installs specdec into ./.venv (CPU torch), plus redis-server when it is missing and we are root.
# Usage: scripts/install.sh [extra,...]   e.g. scripts/install.sh dev,models
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PYTHON" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
# Pin torch first: an unpinned torch pulls a multi-GB CUDA build. Override with TORCH_SPEC.
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
if [ -n "$extras" ]; then .venv/bin/python -m pip install -q -e ".[$extras]"; else .venv/bin/python -m pip install -q -e .; fi
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "note: redis-server not found; the tests need it (apt-get install redis-server)" >&2
  fi
fi
