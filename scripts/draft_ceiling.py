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
confidence stop) beats the oracle at these costs: it is the ceiling of the draft's first choices
on this machine (short of drafting beside the verify pass on other hardware). One row goes
beyond first choices: a small tree (SpecInfer's, Medusa's and EAGLE's token trees, reduced to
leaves) that adds the draft's second choice as a leaf beside each block token the draft gave a
probability below ``--leaf-below``; a leaf costs a verify row, and where the block's first miss
has a leaf that is the target's token, the round also commits the leaf and the target's token
after it. With ``--block-stops`` each listed block stop is priced too, and so is the best of them
for each prompt, chosen in hindsight: the most a threshold that adapts to the prompt could gain.
Predicted decoding rates are scaled to the report by its measured ``service target-only``
tokens/s (timer noise cancels in the ratio), then compared with the report's best HF speculative
row. Where the report gives each request's first round apart (it also computes the prompt), the
rounds are priced without it and each request's prefill is added to every row (the draft's to the
rows that draft); in older reports the prefill is spread over the measured rounds and drafted
tokens (see ``measured_costs``). With ``--per-prompt`` each prompt is also priced alone, beside
what the report measured on it for the default and the best HF speculative row: which prompts a
schedule loses on, and how far from the oracle it is there.

With ``--prompts FILE`` (prompts separated by lines holding only '---', as ``specdec bench
--prompts`` reads them) the replies priced are instead the target's greedy replies to those
prompts (``--max-new-tokens`` each, through the target worker's loader and cache path), at the
costs of each of the report's workloads (its rounds' costs; not its prompts' prefills): prompts
other than the report's, so that a stop or a threshold is not chosen on the prompts it is then
measured on.

    .venv/bin/python scripts/draft_ceiling.py docs/bench/qwen-2core.json
    .venv/bin/python scripts/draft_ceiling.py docs/bench/fair/amd-11c70ed.json --per-prompt
    .venv/bin/python scripts/draft_ceiling.py docs/bench/fair/hf-adaptive.json \
      --prompts docs/bench/complete-16.txt --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from specdec.serving.logging import configure_logging
from specdec.tools.bench import SERVICE_METHODS, tokenize_prompts
from specdec.tools.bench_config import HEADLINE, HF_TARGET, BenchConfig, Run, workloads_from
from specdec.tools.bench_report import prompt_rate

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
    prefill: float = 0.0  # per request: what the target's first round costs beyond a target-only pass
    draft_prefill: float = 0.0  # per request that drafts: the draft's first call beyond its drafted tokens

    def round_ms(self, drafted: int) -> float:
        if drafted == 0:
            return self.verify + self.local_overhead
        return self.verify + (self.verify_per_draft + self.draft_per_token) * drafted + self.overhead

    def target_only_ms(self, tokens: int, requests: int) -> float:
        """``requests`` replies of ``tokens`` in all, target-only: a round a token, each request's prefill."""
        return tokens * self.round_ms(0) + requests * self.prefill

    def drafting_prefill_ms(self, requests: int) -> float:
        """What a row that drafts pays beyond its rounds: each request's prefill on both models."""
        return requests * (self.prefill + self.draft_prefill)


def measured_costs(runs: Sequence[dict[str, Any]]) -> Costs:
    """The costs from one workload's service runs (their stats) over the report's draft model (not
    the early-exit or other-tokenizer rows): sums over runs, not means of ratios. The draft's time
    per token counts model-drafted tokens only (lookup drafts cost none).

    A request's first round also computes its prompt on both workers. Where the report has it apart
    (the stats' ``first_round_*``, written since the coordinator reports ``stats.first_round``), the
    costs per round and per drafted token come from the other rounds, and what the first round
    costs beyond them is the request's prefill (``prefill``, ``draft_prefill``). Older reports
    lack it: there the prefill is spread over the target-only row's rounds and the drafting rows'
    drafted tokens, small with short prompts, but with long ones (``edit``) a drafted token is
    overcharged, and schedules that verify more rows than the measured rows are priced too slow."""
    own = {name for name, row in SERVICE_METHODS.items() if row.coordinator == "main"}
    plain = [r["stats"] for r in runs if r["method"] == TARGET_ONLY]
    drafted = [r["stats"] for r in runs if r["method"] in own and r["stats"]["proposed"] > 0]
    if not plain or not drafted:
        raise SystemExit("the report needs the 'service target-only' row and a row that drafted")
    overhead = sum(s["overhead_ms"] for s in drafted) / sum(s["rounds"] for s in drafted)
    local_overhead = sum(s["overhead_ms"] for s in plain) / sum(s["rounds"] for s in plain)
    # rounds and totals without each request's first round where the report has it, else all of them
    apart = int(all("first_round_verify_ms" in s for s in plain + drafted))

    def first(s: dict[str, Any], key: str) -> float:
        return s[f"first_round_{key}"] if apart else 0.0

    def later(s: dict[str, Any], key: str) -> float:
        return s[key] - first(s, key)

    def first_model_tokens(s: dict[str, Any]) -> float:
        return first(s, "proposed") - first(s, "lookup_proposed")

    verify = sum(later(s, "verify_ms") for s in plain) / max(sum(s["rounds"] - apart for s in plain), 1)
    extra = sum(later(s, "verify_ms") for s in drafted) - verify * sum(s["rounds"] - apart for s in drafted)
    model_tokens = sum(s["proposed"] - s["lookup_proposed"] - first_model_tokens(s) for s in drafted)
    draft_per_token = sum(later(s, "draft_ms") for s in drafted) / max(model_tokens, 1)
    return Costs(
        verify=verify,
        verify_per_draft=max(extra, 0.0) / max(sum(later(s, "proposed") for s in drafted), 1),
        draft_per_token=draft_per_token,
        overhead=overhead,
        local_overhead=local_overhead,
        prefill=max(sum(first(s, "verify_ms") - verify for s in plain) / len(plain), 0.0),
        draft_prefill=max(
            sum(first(s, "draft_ms") - draft_per_token * first_model_tokens(s) for s in drafted) / len(drafted),
            0.0,
        ),
    )


def stop_ms(
    guesses: Sequence[Guess], max_k: int, token: float, block: float, costs: Costs, leaf_below: float = 0.0
) -> float:
    """Decoding the reply with blocks of up to ``max_k`` model drafts (fewer only where the reply
    ends), each ended by the draft's confidence stops (``token``: after a guess below it;
    ``block``: once the product is below it; 0 = off, so both 0 is fixed K = ``max_k``). With
    ``leaf_below`` > 0 each block token guessed with a probability below it gets the draft's
    second choice as a leaf (one more verify row); a leaf that is the target's token where the
    block first misses is committed with the target's token after it."""
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
        leaves = sum(1 for g in guesses[i : i + length] if g.probability < leaf_below)
        ms += costs.round_ms(length) + costs.verify_per_draft * leaves
        miss = guesses[i + run] if run < length else None
        leaf_taken = miss is not None and miss.probability < leaf_below and miss.runner_up
        i += run + (2 if leaf_taken and i + run + 1 < len(guesses) else 1)
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
    """The draft's greedy guess of one reply token: whether it is the token, and its probability;
    whether the draft's second choice is the token."""

    right: bool
    probability: float
    runner_up: bool = False


def forced_logits(draft: LoadedModel, prompt: Sequence[int], reply: Sequence[int]) -> Iterator[torch.Tensor]:
    """The draft's logits [V] before each reply token given the true prefix. Through the draft
    workers' own cache path: the prompt in one pass, then one token per pass (a dynamically
    quantized draft scales activations per pass, so the pass shape matters)."""
    caches = SessionCaches(draft, max_sessions=1, idle_s=float("inf"))
    entry = caches.sync("forced", 0, 0)
    with torch.inference_mode():
        logits = caches.extend(entry, list(prompt), 1)[-1]
        for j, token in enumerate(reply):
            yield logits
            if j + 1 < len(reply):
                logits = caches.extend(entry, [token], 1)[-1]
    caches.release("forced")


def draft_guesses(draft: LoadedModel, prompt: Sequence[int], reply: Sequence[int]) -> list[Guess]:
    """The draft's greedy guess of each reply token given the true prefix (``forced_logits``)."""
    guesses: list[Guess] = []
    for logits, token in zip(forced_logits(draft, prompt, reply), reply, strict=True):
        probs = torch.softmax(logits.float(), dim=-1)
        top, ids = probs.topk(2)
        guesses.append(Guess(int(ids[0]) == token, float(top[0]), int(ids[1]) == token))
    return guesses


def target_replies(target: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy reply to each prompt (``max_new_tokens`` >= 1, fewer where it ends with
    its EOS), through the target worker's cache path."""
    caches = SessionCaches(target, max_sessions=1, idle_s=float("inf"))
    replies = []
    with torch.inference_mode():
        for n, prompt in enumerate(prompts):
            entry = caches.sync(f"reply-{n}", 0, 0)
            logits = caches.extend(entry, list(prompt), 1)[-1]
            reply: list[int] = []
            while True:
                reply.append(int(logits.argmax()))
                if reply[-1] in target.eos_token_ids or len(reply) >= max_new_tokens:
                    break
                logits = caches.extend(entry, reply[-1:], 1)[-1]
            caches.release(f"reply-{n}")
            replies.append(reply)
    return replies


def price(
    out: Callable[[str], object],
    guesses: Sequence[Sequence[Guess]],
    costs: Costs,
    reference: float,
    measured: dict[str, Any],
    k: int,
    args: argparse.Namespace,
) -> float:
    """Prints the predicted (and, where the report has the row, measured) tokens/s of each way to
    draft; returns the oracle's."""
    agree = [[g.right for g in reply] for reply in guesses]
    tokens = sum(len(a) for a in agree)
    # each request's prefill: the target's in every row, the draft's in the rows that draft
    plain = costs.target_only_ms(tokens, len(guesses))
    start = costs.drafting_prefill_ms(len(guesses))
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
        f"tree: block stop {args.block_stop} + 2nd choice below {args.leaf_below}": (
            sum(stop_ms(g, args.max_k, 0.0, args.block_stop, costs, args.leaf_below) for g in guesses),
            "",
        ),
    }
    if args.block_stops:
        sweep = {t: [stop_ms(g, args.max_k, 0.0, t, costs) for g in guesses] for t in args.block_stops}
        for t, ms in sweep.items():
            rows.setdefault(f"model, block stop {t}, up to {args.max_k}", (sum(ms), ""))
        best = sum(min(column) for column in zip(*sweep.values(), strict=True))
        rows[f"block stop, the best of {len(sweep)} for each prompt"] = (best, "")
    rows[oracle] = (sum(oracle_ms(a, costs) for a in agree), "")
    # every row but target-only drafts: it pays the draft's prefill as well as the target's
    rows = {name: (ms if name == TARGET_ONLY else start + ms, row) for name, (ms, row) in rows.items()}
    guessed = sum(map(sum, agree))
    second = sum(g.runner_up for reply in guesses for g in reply)
    out(f"the draft guesses {guessed} of the target's {tokens} tokens (teacher-forced); ")
    out(f"its second choice {second} of the {tokens - guessed} others\n")
    out(
        f"costs: verify {costs.verify:.1f} ms + {costs.verify_per_draft:.1f} ms per drafted token, draft "
        f"{costs.draft_per_token:.1f} ms per token, overhead {costs.overhead:.1f} ms per round "
        f"({costs.local_overhead:.1f} without a draft)"
    )
    if costs.prefill or costs.draft_prefill:
        out(f"; per request, prefill {costs.prefill:.1f} ms and the draft's {costs.draft_prefill:.1f} ms")
    out("\n")
    out(f"{'tok/s':56} {'predicted':>9} {'measured':>9}\n")
    for name, (ms, row) in rows.items():
        seen = measured.get(row, {}).get("tokens_per_s", {}).get("median")
        out(f"{name:56} {reference * plain / ms:9.2f} {'' if seen is None else f'{seen:9.2f}'}\n")
    return reference * plain / rows[oracle][0]


def price_each(
    out: Callable[[str], object],
    prompts: Sequence[int],
    guesses: Sequence[Sequence[Guess]],
    costs: Costs,
    reference: float,
    runs: Sequence[Run],
    best_hf: str | None,
    args: argparse.Namespace,
) -> None:
    """``--per-prompt``: each prompt's reply priced alone (its own prefill, scaled to the report as
    the workload's rows are), beside what the report measured on that prompt for the default and
    for the best HF speculative row: which prompts a schedule loses on, and what it leaves there."""
    out(
        f"per prompt, tok/s: predicted block stop {args.block_stop} / token stop {args.token_stop} / oracle; "
        f"measured {HEADLINE}{f' / {best_hf}' if best_hf else ''} (median of repeats)\n"
    )
    start = costs.drafting_prefill_ms(1)
    for prompt, reply in zip(prompts, guesses, strict=True):
        plain = costs.target_only_ms(len(reply), 1)
        predicted = [
            stop_ms(reply, args.max_k, 0.0, args.block_stop, costs),
            stop_ms(reply, args.max_k, args.token_stop, 0.0, costs),
            oracle_ms([g.right for g in reply], costs),
        ]
        measured = [prompt_rate(runs, m, prompt) for m in (HEADLINE, best_hf) if m]
        out(
            f"prompt {prompt}: the draft guesses {sum(g.right for g in reply)} of {len(reply)}; predicted "
            + " / ".join(f"{reference * plain / (start + ms):.2f}" for ms in predicted)
            + "; measured "
            + " / ".join("-" if rate is None else f"{rate:.2f}" for rate in measured)
            + "\n"
        )


def _thresholds(text: str) -> tuple[float, ...]:
    """``--block-stops``: comma-separated thresholds in [0, 1)."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(0.0 <= value < 1.0 for value in values):
        raise argparse.ArgumentTypeError(f"each block stop must be in [0, 1), got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a `specdec bench` JSON report with hf target-only and service rows")
    parser.add_argument("--draft-model", default="", help="default: the report's draft model")
    parser.add_argument("--draft-quantize", default="", help="none | int8; default: the report's")
    parser.add_argument("--max-k", type=int, default=16, help="longest block with a stop (the server's max K)")
    parser.add_argument("--token-stop", type=float, default=0.4, help="the token stop priced (HF's default 0.4)")
    parser.add_argument("--block-stop", type=float, default=0.5, help="the block stop priced (the server's default)")
    parser.add_argument(
        "--leaf-below", type=float, default=0.7, help="the tree row: a second-choice leaf beside drafts below this"
    )
    parser.add_argument(
        "--block-stops",
        type=_thresholds,
        default=(),
        help="also price each of these block stops (comma-separated), and the best of them chosen for each prompt "
        "in hindsight: how much a threshold that adapts to the prompt could gain at most",
    )
    parser.add_argument("--prompts", type=Path, help="price the target's replies to these prompts instead")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="with --prompts: the length of each reply")
    parser.add_argument(
        "--per-prompt",
        action="store_true",
        help="also price each of the report's prompts alone, beside the default's and the best HF row's measured "
        "rate on it (not with --prompts: those prompts have no measured rows)",
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.per_prompt and args.prompts is not None:
        parser.error("--per-prompt prices the report's own prompts; it cannot be used with --prompts")
    configure_logging("warning", "console")
    report = json.loads(args.report.read_text())
    config = report["config"]
    cfg = BenchConfig(
        model=config["model"],
        draft_model=args.draft_model or config["draft_model"],
        workloads={name: tuple(texts) for name, texts in config["workloads"].items()},
    )
    quantize = args.draft_quantize or config["draft_quantize"]
    k = int(config["k"])
    out = sys.stdout.write
    if args.prompts is not None:
        try:
            cfg = replace(cfg, workloads=workloads_from(args.prompts))
        except ValueError as e:
            raise SystemExit(str(e)) from None
        prompts = [p.token_ids for p in tokenize_prompts(cfg)]
        target = load_model(cfg.model, LoadOptions(device="cpu", dtype="float32"))
        replies = target_replies(target, prompts, args.max_new_tokens)
        del target
        draft = load_model(cfg.draft_model, LoadOptions(device="cpu", dtype="float32", quantize=quantize))
        guesses = [draft_guesses(draft, p, r) for p, r in zip(prompts, replies, strict=True)]
        for workload, summary in report["workloads"].items():
            # decoding costs only: these prompts' prefills are not the report's
            costs = measured_costs([r for r in report["runs"] if r["workload"] == workload])
            costs = replace(costs, prefill=0.0, draft_prefill=0.0)
            reference = summary["methods"][TARGET_ONLY]["tokens_per_s"]["median"]
            out(f"== {len(prompts)} prompts of {args.prompts} at the costs of {workload} ==\n")
            price(out, guesses, costs, reference, {}, k, args)
        return
    draft = load_model(cfg.draft_model, LoadOptions(device="cpu", dtype="float32", quantize=quantize))
    prompts_of = tokenize_prompts(cfg)
    for workload, summary in report["workloads"].items():
        runs = [r for r in report["runs"] if r["workload"] == workload]
        costs = measured_costs(runs)
        replies_of = {r["prompt"]: r["token_ids"] for r in runs if r["method"] == HF_TARGET and r["repeat"] == 0}
        here = [p for p in prompts_of if p.workload == workload and p.index in replies_of]
        guesses = [draft_guesses(draft, p.token_ids, replies_of[p.index]) for p in here]
        # predicted tokens/s scaled to the report: its measured target-only rate x (target-only ms / ms)
        reference = summary["methods"][TARGET_ONLY]["tokens_per_s"]["median"]
        out(f"== {workload} ==\n")
        oracle = price(out, guesses, costs, reference, summary["methods"], k, args)
        hf = [m for m in summary["methods"] if m.startswith("hf ") and m != HF_TARGET]
        best = max(hf, key=lambda m: summary["methods"][m]["tokens_per_s"]["median"]) if hf else None
        if best is not None:
            rate = summary["methods"][best]["tokens_per_s"]["median"]
            out(f"{'best HF speculative: ' + best:56} {'':9} {rate:9.2f}\n")
            out(f"oracle / best HF speculative: {oracle / rate:.2f}x\n")
        if args.per_prompt:
            price_each(out, [p.index for p in here], guesses, costs, reference, [Run(**r) for r in runs], best, args)


if __name__ == "__main__":
    main()
