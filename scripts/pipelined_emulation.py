#!/usr/bin/env python
"""Pipelined rounds with the draft on hardware of its own, emulated on one host with sleeps.

The suite's tiny target sleeps ``--target-pass-ms`` a forward pass (a deployed target's verify);
its draft is the same model with its output layer noised and sharpened (it agrees on about 71% of
the target's greedy tokens and is about as often right as it is sure) and sleeps
``--draft-step-ms`` a pass (a draft step). Sleeps leave the host's cores free, so the two
workers overlap as on separate machines. One target, one draft and a coordinator
(``--speculation-mode pipelined``, K up to ``--max-k``) run as local processes; each arm sends the
same greedy prompts one at a time, the arms interleaved over ``--repeats``; every arm's replies
must be the same tokens. Prints tokens/s per arm (median, min-max) and what its rounds did, as
JSON. Run from the repository root (it imports ``tests``)::

    .venv/bin/python scripts/pipelined_emulation.py --draft-step-ms 12 \\
        --arms default,target-only,fixed2s0.9

Arms: ``default`` (the request a user sends: adaptive K, the server's stops), ``target-only``,
``fixed<K>`` (the model drafts exactly K a round), ``fixed<K>s<T>`` (and ends a block once its
odds fall below T: ``draft_block_confidence``), ``adaptive<K>`` (adaptive, K at most K),
``stop<T>`` (the default with the block stop at T).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.tools.launch import LocalCluster
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.tiny_models import build_model, build_sharp, build_stalling, build_tokenizer


def build_pair(root: Path, target_pass_ms: float, draft_step_ms: float) -> tuple[Path, Path]:
    """The sleeping target and draft, saved under ``root``."""
    base = build_model(root / "base", seed=0, hidden=64, layers=2, vocab=len(build_tokenizer()), init_range=0.2)
    sharp = build_sharp(base, root / "sharp")
    target = build_stalling(base, root / "target", stall_call=0, stall_s=0.0, pass_s=target_pass_ms / 1000)
    draft = build_stalling(sharp, root / "draft", stall_call=0, stall_s=0.0, pass_s=draft_step_ms / 1000)
    return target, draft


def arm_request(arm: str, prompt: list[int], max_new_tokens: int) -> coordinator_pb2.GenerateRequest:
    """A greedy request of ``prompt`` as ``arm`` sends it (the module's doc lists the arms)."""
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=prompt))
    request.sampling.max_new_tokens = max_new_tokens
    request.sampling.ignore_eos = True
    speculation = request.speculation
    if arm == "target-only":
        speculation.disable = True
    elif fixed := re.fullmatch(r"fixed(\d+)(?:s(0\.\d+))?", arm):
        speculation.fixed = True
        speculation.num_speculative_tokens = int(fixed[1])
        speculation.method = coordinator_pb2.DRAFT_METHOD_MODEL
        if fixed[2]:
            speculation.draft_block_confidence = float(fixed[2])
    elif adaptive := re.fullmatch(r"adaptive(\d+)", arm):
        speculation.num_speculative_tokens = int(adaptive[1])
    elif stop := re.fullmatch(r"stop(0\.\d+)", arm):
        speculation.draft_block_confidence = float(stop[1])
    elif arm != "default":
        raise ValueError(f"unknown arm {arm!r}: default, target-only, fixed<K>[s<T>], adaptive<K>, stop<T> (0 < T < 1)")
    return request


@dataclass
class Arm:
    """An arm's tokens/s per repeat and its replies' stats, summed."""

    rates: list[float] = field(default_factory=list)
    rounds: int = 0
    target_only_rounds: int = 0
    pipelined_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    block_stops: list[float] = field(default_factory=list)

    def add(self, stats: coordinator_pb2.SpeculationStats) -> None:
        self.rounds += stats.rounds
        self.target_only_rounds += stats.target_only_rounds
        self.pipelined_rounds += stats.pipelined_rounds
        self.proposed += stats.draft_tokens_proposed
        self.accepted += stats.draft_tokens_accepted
        self.block_stops.append(stats.mean_block_stop)

    def summary(self) -> dict[str, object]:
        return {
            "tokens_per_s": round(statistics.median(self.rates), 2),
            "min": round(min(self.rates), 2),
            "max": round(max(self.rates), 2),
            "rounds": self.rounds,
            "target_only_rounds": self.target_only_rounds,
            "pipelined_rounds": self.pipelined_rounds,
            "draft_tokens_accepted": self.accepted,
            "draft_tokens_proposed": self.proposed,
            "mean_block_stop": round(statistics.mean(self.block_stops), 3),
        }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, object]]:
    """Every arm over every prompt, ``args.repeats`` times interleaved; the summaries by arm."""
    target, draft = build_pair(workdir / "models", args.target_pass_ms, args.draft_step_ms)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 12))] for _ in range(args.prompts)]
    arms = {name: Arm() for name in args.arms.split(",")}
    replies: dict[int, list[int]] = {}
    coordinator = [
        "--speculation-mode",
        args.mode,
        "--max-speculative-tokens",
        str(args.max_k),
        "--state-url",
        "memory://",
    ]
    cluster = LocalCluster(
        str(target),
        str(draft),
        workdir / "cluster",
        worker_args=["--device", "cpu", "--torch-threads", "1", "--trust-remote-code"],
        coordinator_args=coordinator,
        startup_timeout_s=300,
    )
    (workdir / "cluster").mkdir()
    with cluster, grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for prompt in prompts[:2]:  # the first requests measure the costs
            stub.Generate(arm_request("default", prompt, args.max_new_tokens))
        for _ in range(args.repeats):
            for name, arm in arms.items():
                tokens, began = 0, time.monotonic()
                for i, prompt in enumerate(prompts):
                    reply = stub.Generate(arm_request(name, prompt, args.max_new_tokens))
                    if replies.setdefault(i, list(reply.token_ids)) != list(reply.token_ids):
                        raise SystemExit(f"arm {name}: prompt {i}'s reply differs from the other arms'")
                    tokens += len(reply.token_ids)
                    arm.add(reply.stats)
                arm.rates.append(tokens / (time.monotonic() - began))
    return {name: arm.summary() for name, arm in arms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-pass-ms", type=float, default=25.0)
    parser.add_argument("--draft-step-ms", type=float, default=12.0)
    parser.add_argument("--arms", default="default,target-only,fixed2s0.9")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--mode", choices=["pipelined", "sequential"], default="pipelined")
    parser.add_argument("--seed", type=int, default=7, help="the prompts' random token ids")
    args = parser.parse_args()
    for arm in args.arms.split(","):
        try:
            arm_request(arm, [1], 1)
        except ValueError as exc:
            parser.error(str(exc))
    with tempfile.TemporaryDirectory() as workdir:
        json.dump(run(args, Path(workdir)), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
