"""Times a draft's one-token step through the workers' cache path: the model's own forward against
the lean step (``specdec.runtime.lean``), interleaved in one process, and checks their logits are
equal bit for bit.

    .venv/bin/python scripts/draft_step.py ~/.cache/specdec-models/qwen2.5-coder-0.5b --quantize int8

Prints each run's median step (ms) both ways and the ratio, then the median ratio and its spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadOptions, load_model
from specdec.serving.logging import configure_logging


def _steps(caches: SessionCaches, context: int, steps: int, vocab: int) -> tuple[list[float], torch.Tensor]:
    """Milliseconds of each of ``steps`` one-token steps after a ``context``-token prefill, and their logits."""
    entry = caches.sync("step", 0, 0)
    caches.extend(entry, [(1000 + i) % vocab for i in range(context)], 1)
    times, logits = [], []
    for i in range(steps):
        started = time.perf_counter()
        logits.append(caches.extend(entry, [(2000 + i) % vocab], 1))
        times.append((time.perf_counter() - started) * 1000)
    caches.release("step")
    return times, torch.cat(logits)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a local model directory")
    parser.add_argument("--quantize", default="int8", help="none | int8 | int4 (the lean step needs fused layers)")
    parser.add_argument("--context", type=int, default=120, help="cached tokens before the steps")
    parser.add_argument("--steps", type=int, default=40, help="steps timed per run and way")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    configure_logging("warning", "console")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, LoadOptions(device="cpu", quantize=args.quantize, structured_output=False))
    caches = SessionCaches(loaded, 1, float("inf"))
    lean = caches.lean
    if lean is None:
        raise SystemExit(f"{args.model} gets no lean step (a fused int8 or int4 Llama or Qwen2 decoder only)")
    out = sys.stdout.write
    ratios = []
    for run in range(args.runs):
        caches.lean = None
        own, want = _steps(caches, args.context, args.steps, loaded.vocab_size)
        caches.lean = lean
        fast, got = _steps(caches, args.context, args.steps, loaded.vocab_size)
        if not torch.equal(got, want):
            raise SystemExit("the lean step's logits differ from the model's own")
        ratios.append(statistics.median(fast) / statistics.median(own))
        out(f"run {run}: model's forward {statistics.median(own):.2f} ms, lean {statistics.median(fast):.2f} ms, ")
        out(f"ratio {ratios[-1]:.3f}\n")
    out(f"lean / model's forward: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), ")
    out(f"{args.runs} runs of {args.steps} steps over {args.context} cached tokens, logits equal\n")


if __name__ == "__main__":
    main()
