#!/usr/bin/env bash
# The GPU run recorded in the README (Benchmark, On a GPU): run from the repository root on a
# machine with a CUDA GPU, PyTorch and transformers, with the other Python dependencies in .whl/
# (wheels; see README) and SRC (default .gpu-models) holding target/ and draft/ folders of
# config.json and tokenizer files. Results go to OUT (default bench-results/gpu). The defaults are
# the recorded run's (sized for a 15-minute lease); NEW, PROMPTS, REPEATS, CONC, METHODS ('|'
# between names as in the table) and the LIMIT_* seconds raise them; SKIP_PASSES=1 skips passes.py,
# SKIP_F32=1 the float32 bench, SKIP_BF16=1 the bfloat16 one; BATCHING=1 adds docs/bench/batching.py
# in bfloat16 (target-only, BATCH_SESSIONS requests at once, --batch-wait-ms 0 against 5).
set -uo pipefail
SRC=${SRC:-.gpu-models}
OUT=${OUT:-bench-results/gpu}
MODELS=${MODELS:-/tmp/gpu-models}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  # a minimal package record, so that GetInfo reports the version (it says "unknown" without one)
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
  mkdir -p "/tmp/site/specdec-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: specdec\nVersion: %s\n' "$version" > "/tmp/site/specdec-$version.dist-info/METADATA"
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi -L 2>/dev/null; lscpu | grep -E "^Model name|^CPU\(s\)|^Flags" | cut -c1-200
step() { local limit=$1; shift; local t0=$SECONDS; echo "== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "== rc=$? in $((SECONDS - t0))s"; }
[ -e "$MODELS/draft/model.safetensors" ] || step 100 "$PY" docs/bench/gpu/random_models.py "$SRC" "$MODELS"
[ -n "${SKIP_PASSES:-}" ] || step 100 "$PY" docs/bench/gpu/passes.py "$MODELS/target" "$OUT/passes.json" --device "$DEVICE" --draft "$MODELS/draft"
BENCH=("$PY" -m specdec bench --model "$MODELS/target" --draft-model "$MODELS/draft" --device "$DEVICE" --no-plots
       --max-new-tokens "${NEW:-64}" --max-prompts "${PROMPTS:-1}")
METHODS=${METHODS:-hf target-only|service target-only|service ngram K|service default (hybrid, adaptive)}
IFS='|' read -r -a names <<< "$METHODS"
for name in "${names[@]}"; do BENCH+=(--method "$name"); done
# float32: greedy token identity of every row against HF target-only on this device
[ -n "${SKIP_F32:-}" ] || step "${LIMIT_F32:-110}" "${BENCH[@]}" --dtype float32 --repeats 1 --concurrency '' --out "$OUT/bench-float32.json"
# bfloat16 (the GPU default): costs, and the concurrency sweep
[ -n "${SKIP_BF16:-}" ] || step "${LIMIT_BF16:-115}" "${BENCH[@]}" --dtype bfloat16 --repeats "${REPEATS:-1}" --concurrency "${CONC:-1,8}" \
  --out "$OUT/bench-bfloat16.json"
# the batch wait: concurrent target-only sessions sharing passes, with and without it
[ -z "${BATCHING:-}" ] || step "${LIMIT_BATCHING:-150}" "$PY" docs/bench/batching.py "$MODELS/target" "$MODELS/draft" \
  --device "$DEVICE" --dtype bfloat16 --sessions "${BATCH_SESSIONS:-1,2,4,16}" --repeats "${REPEATS:-3}" \
  --out "$OUT/batching.json"
