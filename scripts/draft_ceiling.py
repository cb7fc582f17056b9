#!/usr/bin/env python
"""How fast could any proposer built on this draft model be, at the costs a benchmark measured?

Reads a ``specdec bench`` report and, for each of its prompts, takes the target's greedy reply
(the report's ``hf target-only`` tokens) and asks the draft model for its own greedy guess of
every reply token given the true prefix (teacher-forced, one token per pass, with the draft
workers' loader, quantization and cache path). The round costs come from the service's own stats
in the same report: a target-only verify pass, the extra verify time per drafted token, draft
time per drafted token, and the per-round overhead with and without a draft.

From those it prices, per workload, decoding with the draft at a fixed K (a check of the cost
model against the report's ``service model K`` row), with each of the draft's confidence stops
(blocks of up to ``--max-k`` that end after a token the draft gave a probability below
``--token-stop``, or once the product of the block's probabilities is below ``--block-stop``;
the probabilities are the teacher-forced ones, also after a wrong guess, where the service's
draft would go on from its own token: only the cost of such a block is approximate), and an
oracle: a proposer that drafts exactly the run of tokens the draft gets right, so that no drafted
token is wasted and no run is cut short. No schedule of the draft's greedy proposals (any K, any
confidence stop) beats the oracle at these costs: it is the ceiling of the draft on this machine
(short of proposing other tokens than its first choice, or drafting beside the verify pass on
other hardware). Predicted
decoding rates are scaled to the report by its measured ``service target-only`` tokens/s
(prefill and timer noise cancel in the ratio), then compared with the report's best HF
speculative row.

    .venv/bin/python scripts/draft_ceiling.py docs/bench/qwen-2core.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from specdec.serving.logging import configure_logging
from specdec.tools.bench import HF_TARGET, SERVICE_METHODS, BenchConfig, tokenize_prompts

TARGET_ONLY = "service target-only"
MODEL_K = "service model K"


@dataclass(frozen=True)
class Costs:
    """Milliseconds, measured by the service: a round verifies ``1 + drafted`` tokens."""

    verify: float  # a target-only pass (one token)
    verify_per_draft: float  # what each drafted token adds to the verify pass
    draft_per_token: float
    overhead: float  # per round that drafted
    local_overhead: float  # per target-only round

    def round_ms(self, drafted: int) -> float:
        if drafted == 0:
            return self.verify + self.local_overhead
        return self.verify + (self.verify_per_draft + self.draft_per_token) * drafted + self.overhead


def measured_costs(runs: Sequence[dict[str, Any]]) -> Costs:
    """The costs from one workload's service runs (their stats) over the report's draft model (not
    the early-exit or other-tokenizer rows): sums over runs, not means of ratios. The draft's time
    per token counts model-drafted tokens only (lookup drafts cost none)."""
    own = {name for name, row in SERVICE_METHODS.items() if row.coordinator == "main"}
    plain = [r["stats"] for r in runs if r["method"] == TARGET_ONLY]
    drafted = [r["stats"] for r in runs if r["method"] in own and r["stats"]["proposed"] > 0]
    if not plain or not drafted:
        raise SystemExit("the report needs the 'service target-only' row and a row that drafted")
    verify = sum(s["verify_ms"] for s in plain) / sum(s["rounds"] for s in plain)
    extra = sum(s["verify_ms"] for s in drafted) - verify * sum(s["rounds"] for s in drafted)
    model_tokens = sum(s["proposed"] - s["lookup_proposed"] for s in drafted)
    return Costs(
        verify=verify,
        verify_per_draft=max(extra, 0.0) / sum(s["proposed"] for s in drafted),
        draft_per_token=sum(s["draft_ms"] for s in drafted) / max(model_tokens, 1),
        overhead=sum(s["overhead_ms"] for s in drafted) / sum(s["rounds"] for s in drafted),
        local_overhead=sum(s["overhead_ms"] for s in plain) / sum(s["rounds"] for s in plain),
    )


def stop_ms(guesses: Sequence[Guess], max_k: int, token: float, block: float, costs: Costs) -> float:
    """Decoding the reply with blocks of up to ``max_k`` model drafts (fewer only where the reply
    ends), each ended by the draft's confidence stops (``token``: after a guess below it;
    ``block``: once the product is below it; 0 = off, so both 0 is fixed K = ``max_k``)."""
    ms, i = 0.0, 0
    while i < len(guesses):
        length, product = 0, 1.0
        while length < min(max_k, len(guesses) - i - 1):
            probability = guesses[i + length].probability
            length, product = length + 1, product * probability
            if probability < token or product < block:
                break
        run = 0
        while run < length and guesses[i + run].right:
            run += 1
        ms += costs.round_ms(length)
        i += run + 1
    return ms


def oracle_ms(agree: Sequence[bool], costs: Costs) -> float:
    """Decoding the reply drafting exactly each run the draft gets right (none before a miss)."""
    ms, i = 0.0, 0
    while i < len(agree):
        run = 0
        while i + run + 1 < len(agree) and agree[i + run]:
            run += 1
        ms += costs.round_ms(run)
        i += run + 1
    return ms


class Guess(NamedTuple):
    """The draft's greedy guess of one reply token: whether it is the token, and its probability."""

    right: bool
    probability: float


def draft_guesses(draft: LoadedModel, prompt: Sequence[int], reply: Sequence[int]) -> list[Guess]:
    """The draft's greedy guess of each reply token given the true prefix. Through the draft
    workers' own cache path: the prompt in one pass, then one token per pass (a dynamically
    quantized draft scales activations per pass, so the pass shape matters)."""
    caches = SessionCaches(draft, max_sessions=1, idle_s=float("inf"))
    entry = caches.sync("ceiling", 0, 0)
    guesses: list[Guess] = []
    with torch.inference_mode():
        logits = caches.extend(entry, list(prompt), 1)[-1]
        for token in reply:
            probs = torch.softmax(logits.float(), dim=-1)
            guess = int(probs.argmax())
            guesses.append(Guess(guess == token, float(probs[guess])))
            if len(guesses) < len(reply):
                logits = caches.extend(entry, [token], 1)[-1]
    return guesses


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a `specdec bench` JSON report with hf target-only and service rows")
    parser.add_argument("--draft-model", default="", help="default: the report's draft model")
    parser.add_argument("--draft-quantize", default="", help="none | int8; default: the report's")
    parser.add_argument("--max-k", type=int, default=16, help="longest block with a stop (the server's max K)")
    parser.add_argument("--token-stop", type=float, default=0.4, help="the token stop priced (HF's default 0.4)")
    parser.add_argument("--block-stop", type=float, default=0.5, help="the block stop priced (the server's default)")
    args = parser.parse_args(argv)
    configure_logging("warning", "console")
    report = json.loads(args.report.read_text())
    config = report["config"]
    cfg = BenchConfig(
        model=config["model"],
        draft_model=args.draft_model or config["draft_model"],
        workloads={name: tuple(texts) for name, texts in config["workloads"].items()},
    )
    quantize = args.draft_quantize or config["draft_quantize"]
    draft = load_model(cfg.draft_model, LoadOptions(device="cpu", dtype="float32", quantize=quantize))
    k = int(config["k"])
    out = sys.stdout.write
    prompts = tokenize_prompts(cfg)
    for workload, summary in report["workloads"].items():
        runs = [r for r in report["runs"] if r["workload"] == workload]
        costs = measured_costs(runs)
        replies = {r["prompt"]: r["token_ids"] for r in runs if r["method"] == HF_TARGET and r["repeat"] == 0}
        here = [p for p in prompts if p.workload == workload and p.index in replies]
        guesses = [draft_guesses(draft, p.token_ids, replies[p.index]) for p in here]
        agree = [[g.right for g in reply] for reply in guesses]
        tokens = sum(len(a) for a in agree)
        plain = tokens * costs.round_ms(0)
        # predicted tokens/s scaled to the report: its measured target-only rate x (target-only ms / ms)
        reference = summary["methods"][TARGET_ONLY]["tokens_per_s"]["median"]
        oracle = "oracle (drafts exactly the runs the draft gets right)"
        rows = {
            TARGET_ONLY: (plain, TARGET_ONLY),
            f"model, fixed K = {k}": (sum(stop_ms(g, k, 0.0, 0.0, costs) for g in guesses), MODEL_K),
            f"model, token stop {args.token_stop}, up to {args.max_k}": (
                sum(stop_ms(g, args.max_k, args.token_stop, 0.0, costs) for g in guesses),
                "",
            ),
            f"model, block stop {args.block_stop}, up to {args.max_k}": (
                sum(stop_ms(g, args.max_k, 0.0, args.block_stop, costs) for g in guesses),
                "",
            ),
            oracle: (sum(oracle_ms(a, costs) for a in agree), ""),
        }
        out(f"== {workload} ==\n")
        guessed = sum(map(sum, agree))
        out(f"the draft guesses {guessed} of the target's {tokens} tokens (teacher-forced)\n")
        out(
            f"costs: verify {costs.verify:.1f} ms + {costs.verify_per_draft:.1f} ms per drafted token, draft "
            f"{costs.draft_per_token:.1f} ms per token, overhead {costs.overhead:.1f} ms per round "
            f"({costs.local_overhead:.1f} without a draft)\n"
        )
        out(f"{'tok/s':56} {'predicted':>9} {'measured':>9}\n")
        for name, (ms, row) in rows.items():
            seen = summary["methods"].get(row, {}).get("tokens_per_s", {}).get("median")
            out(f"{name:56} {reference * plain / ms:9.2f} {'' if seen is None else f'{seen:9.2f}'}\n")
        hf = [m for m in summary["methods"] if m.startswith("hf ") and m != HF_TARGET]
        if hf:
            best = max(hf, key=lambda m: summary["methods"][m]["tokens_per_s"]["median"])
            rate = summary["methods"][best]["tokens_per_s"]["median"]
            out(f"{'best HF speculative: ' + best:56} {'':9} {rate:9.2f}\n")
            out(f"oracle / best HF speculative: {reference * plain / rows[oracle][0] / rate:.2f}x\n")


if __name__ == "__main__":
    main()
