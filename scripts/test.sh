#!/usr/bin/env bash
# Installs everything the tests need and runs lint, the stub check and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
scripts/install_deploy_tools.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m specdec.tools.protogen --check
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
