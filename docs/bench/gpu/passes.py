"""What one forward pass of the target costs by the rows it computes, and whether a several-row
verify pass picks the same greedy tokens as one-token passes, on this machine's device.

Usage: python passes.py MODEL_DIR OUT_JSON [--device cuda] [--draft DRAFT_DIR]  (specdec importable: run.sh)
For float32 and bfloat16: a 256-token prompt is prefilled, then each row count's pass (the rows
after the prompt) is timed (median of 15 after 3 warm-ups, the cache cut back after each); then
64 greedy tokens by one-token passes, and the same positions scored by 9-row passes: positions
whose argmax differs, and the smallest gap between a position's two best logits. With --draft,
the draft's one-token pass on the device and on the CPU (float32, all cores).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specdec.runtime.cachelayers import cache_argument

ROWS = (1, 2, 3, 5, 9, 17, 33, 65)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cut(cache: Any, n: int) -> None:
    """Cut the cache back to its first n tokens (a negative crop: every transformers 5.x takes it)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def _timed(fn: Any, device: torch.device, repeats: int = 15, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


@torch.inference_mode()
def pass_costs(
    model: Any, device: torch.device, prompt: torch.Tensor, rows_list: tuple[int, ...] = ROWS
) -> dict[int, float]:
    cache = DynamicCache(config=model.config)
    model(prompt, **cache_argument(model, cache))
    n = prompt.shape[1]
    costs = {}
    for rows in rows_list:
        ids = torch.randint(0, model.config.vocab_size, (1, rows), device=device)

        def step(ids: torch.Tensor = ids) -> None:
            model(ids, **cache_argument(model, cache))
            _cut(cache, n)

        costs[rows] = round(_timed(step, device), 3)
    return costs


@torch.inference_mode()
def argmax_identity(model: Any, prompt: torch.Tensor, new: int = 64, block: int = 9) -> dict[str, Any]:
    cache = DynamicCache(config=model.config)
    out = model(prompt, **cache_argument(model, cache))
    logits = [out.logits[0, -1].float()]
    tokens = [int(logits[0].argmax())]
    for _ in range(new - 1):
        out = model(torch.tensor([[tokens[-1]]], device=prompt.device), **cache_argument(model, cache))
        logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
    n = prompt.shape[1]
    _cut(cache, n)
    differ, gaps, max_abs = 0, [], 0.0
    # block rows: the last committed token then block - 1 of the greedy tokens, as a verify pass
    for start in range(0, new - 1, block - 1):
        last = int(prompt[0, -1]) if start == 0 else tokens[start - 1]
        rows = [last, *tokens[start : min(start + block - 1, new - 1)]]
        _cut(cache, n - 1 + start)
        out = model(torch.tensor([rows], device=prompt.device), **cache_argument(model, cache))
        for j in range(len(rows)):
            one = logits[start + j]
            several = out.logits[0, j].float()
            differ += int(several.argmax()) != int(one.argmax())
            top = one.topk(2).values
            gaps.append(float(top[0] - top[1]))
            max_abs = max(max_abs, float((several - one).abs().max()))
    return {"positions": len(gaps), "argmax_differs": differ, "min_top2_gap": min(gaps), "max_abs_logit_diff": max_abs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--draft", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        prompt = torch.randint(0, model.config.vocab_size, (1, 256), device=device)
        name = str(dtype).removeprefix("torch.")
        report[name] = {
            "pass_ms_by_rows": pass_costs(model, device, prompt),
            "verify_9_vs_one": argmax_identity(model, prompt),
        }
        sys.stdout.write(f"{name} {json.dumps(report[name])}\n")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.draft:
        for where, dtype in ((device, torch.bfloat16), (torch.device("cpu"), torch.float32)):
            model = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(where).eval()
            prompt = torch.randint(0, model.config.vocab_size, (1, 256), device=where)
            key = f"draft {where.type} {str(dtype).removeprefix('torch.')}"
            costs = pass_costs(model, where, prompt, (1, 5))
            report[key] = {"pass_ms_by_rows": costs, "threads": torch.get_num_threads()}
            sys.stdout.write(f"{key} {json.dumps(report[key])}\n")
            del model
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
