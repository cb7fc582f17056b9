#!/usr/bin/env python
"""Can draft and target overlap on one CPU host? Times their forward passes alone and side by side.

Pipelining hides the draft's work behind the target's verify pass only if the two can run at the
same time without slowing each other down. This measures, with the real models and the workers'
own loader, a verify pass of K+1 tokens and a one-token draft step on a cached context:
both alone with all cores, both alone with a share of the cores, both at once each with its share
(split), and both at once with the target on all cores beside the draft on its share
(oversubscribed). From those it prints the round time of sequential speculation (draft K tokens,
then verify, all cores each) against pipelined speculation (max of the two, run side by side),
split, oversubscribed, and with the draft on separate hardware. OMP_WAIT_POLICY and the like are
passed on to the timed processes.

    .venv/bin/python scripts/profile_cpu_split.py \\
        --model ~/.cache/specdec-models/qwen2.5-coder-1.5b \\
        --draft-model ~/.cache/specdec-models/qwen2.5-coder-0.5b --draft-quantize int8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

import torch

from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadOptions, load_model
from specdec.serving.logging import configure_logging


def _serve(conn: Connection, model_id: str, quantize: str, tokens: int, context: int) -> None:
    """Child process: loads one model, then times ``tokens``-token passes on request, through the
    workers' own cache path (extend by the block, keep its logits, roll back)."""
    configure_logging("warning", "console")
    loaded = load_model(model_id, LoadOptions(device="cpu", quantize=quantize))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.vocab_size, (context,), generator=generator).tolist()
    block = torch.randint(0, loaded.vocab_size, (tokens,), generator=generator).tolist()
    caches = SessionCaches(loaded, max_sessions=1, idle_s=float("inf"))
    entry = caches.sync("profile", 0, 0)
    caches.extend(entry, prompt, 1)

    def one_pass() -> None:
        caches.extend(entry, block, tokens)
        entry.truncate(context)

    conn.send("ready")
    while (request := conn.recv()) is not None:
        threads, seconds, start_at = request
        torch.set_num_threads(threads)
        one_pass()  # warm-up at this thread count
        time.sleep(max(0.0, start_at - time.time()))
        began, passes = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            one_pass()
            passes += 1
        conn.send((time.perf_counter() - began) / passes)


def _measure(conns: dict[str, Connection], threads: dict[str, int], seconds: float) -> dict[str, float]:
    """Times the named models at once (each with its thread count); seconds per pass."""
    start_at = time.time() + 1.0
    for name, count in threads.items():
        conns[name].send((count, seconds, start_at))
    return {name: conns[name].recv() for name in threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target model directory")
    parser.add_argument("--draft-model", required=True, help="draft model directory")
    parser.add_argument("--draft-quantize", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="K (the verify pass is K+1 tokens)")
    parser.add_argument("--context", type=int, default=120, help="cached tokens before the timed passes")
    parser.add_argument("--seconds", type=float, default=15.0, help="timing window per measurement")
    args = parser.parse_args()
    k = args.num_speculative_tokens
    cores = os.cpu_count() or 1
    if cores < 2:
        sys.exit("this host has one core: there is nothing to split")
    split = {"target": cores - cores // 2, "draft": cores // 2}

    ctx = mp.get_context("spawn")
    conns: dict[str, Connection] = {}
    procs: list[mp.process.BaseProcess] = []
    for name, model_id, quantize, tokens in (
        ("target", args.model, "none", k + 1),
        ("draft", args.draft_model, args.draft_quantize, 1),
    ):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, model_id, quantize, tokens, args.context))
        proc.start()
        conns[name] = parent
        procs.append(proc)
    for conn in conns.values():
        conn.recv()

    full = {**_measure(conns, {"target": cores}, args.seconds), **_measure(conns, {"draft": cores}, args.seconds)}
    alone = {
        **_measure(conns, {"target": split["target"]}, args.seconds),
        **_measure(conns, {"draft": split["draft"]}, args.seconds),
    }
    together = _measure(conns, split, args.seconds)
    crowded = _measure(conns, {"target": cores, "draft": split["draft"]}, args.seconds)
    for conn in conns.values():
        conn.send(None)
    for proc in procs:
        proc.join()

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:8.1f} ms"

    out = sys.stdout.write
    out(f"cores: {cores}; split: target {split['target']}, draft {split['draft']} threads\n")
    out(f"{'pass':<28}{'all cores, alone':>18}{'split, alone':>18}{'split, side by side':>22}{'oversubscribed':>18}\n")
    for name, label in (("target", f"target verify ({k + 1} tokens)"), ("draft", "draft step (1 token)")):
        row = f"{ms(full[name]):>18}{ms(alone[name]):>18}{ms(together[name]):>22}{ms(crowded[name]):>18}"
        out(f"{label:<28}{row}\n")
    sequential = k * full["draft"] + full["target"]
    overlapped = max(k * together["draft"], together["target"])
    oversubscribed = max(k * crowded["draft"], crowded["target"])
    separate = max(k * full["draft"], full["target"])
    out(f"{f'sequential round (K={k}, all cores each):':<48}{ms(sequential)}\n")
    for label, round_time in (
        ("split cores side by side", overlapped),
        ("oversubscribed", oversubscribed),
        ("draft on separate hardware", separate),
    ):
        out(f"{f'pipelined round, {label}:':<48}{ms(round_time)}  -> {sequential / round_time:.2f}x\n")
    out("(pipelined ratios are upper bounds: every block drafted ahead assumed to be used)\n")


if __name__ == "__main__":
    main()
