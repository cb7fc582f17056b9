#!/usr/bin/env python
"""How well does the draft's block stop do under sampling, and would another signal do better?

Reads a sampled ``specdec bench`` report (its ``config.temperature`` above 0) and replays the
replies one service row committed (default: the headline row; each a draw from the target's own
distribution, the rows being exact). Along each reply, teacher-forced, through the workers' loaders
and cache paths: the draft's proposal q at every position, as the draft worker proposes under the
report's warp (the top ``--top-n`` of its warped distribution, renormalised), one token per pass;
``--trials`` draws x from q per position; and the target's warped distribution p (one pass over the
prompt and the reply), which keeps x with probability min(1, p(x) / q(x)). A block then runs as the
draft worker runs it: it ends after the token that takes the product of the block's signals below
the threshold, or at ``--max-k``, and the round commits the accepted run and one more token.

Signals: the probability of the drawn token in q (what the draft worker multiplies: the
service's rule), the draft's top probability at the position, their geometric mean, and the
position's true acceptance rate, the sum over tokens of min(p, q) (no draft knows it: it bounds what
any signal computed from the draft alone could do).

Prints, per workload: first a check of the replay against the run on the same replies (rounds,
drafted and accepted tokens predicted with the service's rule at the threshold the report's costs
set, ``coordinator.adaptive.block_stop_for``, beside what the row measured: the row's rounds also
hold its first round, lookup rounds and the controller's probes); how many replayed turns the
controller's own check would switch the stop off in; tokens/s with the controller itself planning
each round (``controlled``: its K, and the stop kept or switched off by its check, brought back by
the draft's reports of where it would have ended whole blocks or, as before those reports, off for
the rest of the turn); then tokens/s for fixed K and for each signal at each threshold. All are
priced at the report's costs (``draft_ceiling.measured_costs``) and scaled to its measured
``service target-only`` rate as ``draft_ceiling.py`` scales. A position keeps the committed
reply's prefix, also after a draw the draft would have followed elsewhere.

    .venv/bin/python scripts/sampled_stop.py docs/bench/sampled/amd-t10-0b50a42.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from draft_ceiling import TARGET_ONLY, Costs, forced_logits, measured_costs

from coordinator.adaptive import KController, StepCosts, block_stop_for
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from specdec.runtime.sampling import Warp, sample_draft_token, warped_probs
from specdec.serving.logging import configure_logging
from specdec.tools.bench import tokenize_prompts
from specdec.tools.bench_config import HEADLINE, BenchConfig


@dataclass
class Positions:
    """One reply's positions: per position and trial, the drawn token's probability in q and
    the chance the target keeps it; per position, q's top probability and the true acceptance."""

    drawn: np.ndarray  # [L, trials]
    keep: np.ndarray  # [L, trials]
    top: np.ndarray  # [L]
    acceptance: np.ndarray  # [L]


Signal = Callable[[Positions, int, int], float]  # (positions, position, trial) -> factor

SERVICE = "drawn token's probability (the service's)"
SIGNALS: dict[str, Signal] = {
    SERVICE: lambda p, i, t: float(p.drawn[i, t]),
    "top probability": lambda p, i, t: float(p.top[i]),
    "geometric mean of the two": lambda p, i, t: math.sqrt(float(p.drawn[i, t]) * float(p.top[i])),
    "true acceptance (known to no draft)": lambda p, i, t: float(p.acceptance[i]),
}


@dataclass
class Tally:
    """Sums over a replay's trials (divide by ``trials`` for one reply's)."""

    rounds: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0
    ms: float = 0.0
    trials: int = 0
    unstopped: float = 0.0  # ``controlled``: model rounds drafted with the stop switched off

    def add(self, drafted: int, accepted: int, costs: Costs) -> None:
        """One round: ``drafted`` drafts, the first ``accepted`` of them kept."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.ms += costs.round_ms(drafted)


Round = Callable[[int, int, int, bool], None]  # (trial, drafted, kept, the signal ended the block)


def uniforms(positions: Positions, seed: int) -> np.ndarray:
    """One uniform per trial and position [trials, L]: a draft is kept where its draw is below
    its chance (the same draws for every way of drafting the reply)."""
    length, trials = positions.drawn.shape
    return np.random.default_rng(seed).random((trials, length))


def kept_run(positions: Positions, draws: np.ndarray, trial: int, start: int, drafted: int) -> int:
    """How many of ``drafted`` drafts from position ``start`` the target keeps before its first
    rejection, in ``trial`` (``draws``: ``uniforms``)."""
    run = 0
    while run < drafted and draws[trial, start + run] < positions.keep[start + run, trial]:
        run += 1
    return run


def replay(
    positions: Positions,
    costs: Costs,
    max_k: int,
    signal: Signal | None,
    threshold: float,
    seed: int = 0,
    each_round: Round | None = None,
) -> Tally:
    """Decodes the reply once per trial: blocks of up to ``max_k`` drafts (fewer where the reply
    ends) that end after the token taking the product of ``signal`` below ``threshold`` (none:
    fixed K = ``max_k``), each draft kept with its trial's chance (one uniform per position and
    trial, the same for every signal), the round committing the kept run and one more token;
    ``each_round`` is told of every round."""
    length, trials = positions.drawn.shape
    draws = uniforms(positions, seed)
    tally = Tally(trials=trials)
    for trial in range(trials):
        i = 0
        while i < length:
            n, product, ended = 0, 1.0, False
            while n < min(max_k, length - i - 1):
                n += 1
                if signal is not None:
                    product *= signal(positions, i + n - 1, trial)
                    if product < threshold:
                        ended = True
                        break
            run = kept_run(positions, draws, trial, i, n)
            if each_round is not None:
                each_round(trial, n, run, ended)
            tally.add(n, run, costs)
            i += run + 1
    return tally


def step_costs(costs: Costs, max_k: int) -> StepCosts:
    """A coordinator's measured costs (``StepCosts``) set to a report's: every verify width up to
    ``max_k`` + 1, the draft's step and both overheads."""
    shared = StepCosts()
    for width in range(1, max_k + 2):
        shared.observe_verify(width, costs.verify + costs.verify_per_draft * (width - 1))
    shared.observe_draft(1, costs.draft_per_token)
    shared.observe_overhead(costs.overhead, drafted=True)
    shared.observe_overhead(costs.local_overhead, drafted=False)
    return shared


def controlled(
    positions: Positions, costs: Costs, shared: StepCosts, max_k: int, reports: bool, seed: int = 0
) -> Tally:
    """Decodes the reply once per trial as an adaptive turn of the service does, with a
    ``KController`` of the turn on the workload's ``shared`` costs (``step_costs``): each round its
    plan (target-only or a model block of its K; no lookup drafts here), the block stop at the
    threshold the costs set applied while the controller keeps it (``stopping``), else whole
    blocks of its K, the controller told where the stop would have ended them (``reports``: the
    draft's ``unsure_at``) or not (as before the draft reported it). The draws and the target's
    choices are ``replay``'s (the same uniforms)."""
    length, trials = positions.drawn.shape
    draws = uniforms(positions, seed)
    tally = Tally(trials=trials)
    for trial in range(trials):
        controller = KController(max_k, shared, confidence_stop=True, block_stop=0.5, block_from_costs=True)
        i = 0
        while i < length:
            plan = controller.plan(min(max_k, length - i - 1))
            stopping, threshold = controller.stopping, controller.block_threshold
            n, product, at = 0, 1.0, 0
            while n < plan.k:
                n += 1
                product *= float(positions.drawn[i + n - 1, trial])
                at = at or (n if product < threshold else 0)
                if stopping and at:
                    break
            run = kept_run(positions, draws, trial, i, n)
            ended = stopping and at == n > 0
            reported = at if reports and not stopping else 0
            controller.observe(n, run, asked=plan.k, ends_unsure=ended, unsure_at=reported)
            tally.add(n, run, costs)
            tally.unstopped += n > 0 and not stopping
            i += run + 1
    return tally


class StopCheck:
    """Feeds each replayed turn's rounds to a ``KController`` with the confidence stop (one per
    turn; the turns of a workload share one ``StepCosts``, as a coordinator's sessions do) and
    records the turns whose check (``confidence_stop_pays``) would switch the stop off, and after
    how many rounds. The replay itself goes on with the stop, as a check that comes back would."""

    def __init__(self, max_k: int, threshold: float) -> None:
        self.max_k, self.threshold = max_k, threshold
        self.shared = StepCosts()
        self.turns: dict[tuple[int, int], KController] = {}  # (reply, trial) -> its controller
        self.rounds: Counter[tuple[int, int]] = Counter()
        self.switched: dict[tuple[int, int], int] = {}  # (reply, trial) -> rounds before the switch

    def for_reply(self, reply: int) -> Round:
        """The ``each_round`` of one reply's replay."""

        def observe(trial: int, drafted: int, kept: int, ended: bool) -> None:
            key = (reply, trial)
            if key not in self.turns:
                self.turns[key] = KController(self.max_k, self.shared, confidence_stop=True, block_stop=self.threshold)
            self.rounds[key] += 1
            if drafted and key not in self.switched:
                self.turns[key].observe(drafted, kept, asked=self.max_k, ends_unsure=ended)
                if not self.turns[key].confidence_stop_pays:
                    self.switched[key] = self.rounds[key]

        return observe


def draft_side(
    draft: LoadedModel, prompt: Sequence[int], reply: Sequence[int], warp: Warp, top_n: int, trials: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per position (``draft_ceiling.forced_logits``): the trials' drawn tokens [L, trials] and
    their probabilities in q, q's top probability, and q itself (ids, probabilities) for the
    target's side."""
    generator = torch.Generator().manual_seed(seed)
    tokens, drawn, top, proposals = [], [], [], []
    for logits in forced_logits(draft, prompt, reply):
        sample = sample_draft_token(logits.float(), warp, top_n, generator)
        ids = sample.ids if sample.ids is not None else torch.arange(sample.probs.shape[0])
        probs = sample.probs.float()
        picks = torch.multinomial(probs, trials, replacement=True, generator=generator)
        tokens.append(ids[picks].numpy())
        drawn.append(probs[picks].numpy())
        top.append(float(probs.max()))
        proposals.append((ids, probs))
    return np.stack(tokens), np.stack(drawn), np.array(top), proposals


def target_side(
    target: LoadedModel,
    prompt: Sequence[int],
    reply: Sequence[int],
    warp: Warp,
    tokens: np.ndarray,
    drawn: np.ndarray,
    proposals: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[np.ndarray, np.ndarray]:
    """The chance the target keeps each drawn token [L, trials], and each position's true
    acceptance (the sum of min(p, q)), from one pass over the prompt and the reply."""
    caches = SessionCaches(target, max_sessions=1, idle_s=float("inf"))
    entry = caches.sync("replay", 0, 0)
    with torch.inference_mode():
        logits = caches.extend(entry, [*prompt, *reply[:-1]], len(reply))
    caches.release("replay")
    p = warped_probs(logits.float(), warp)
    keep = np.minimum(1.0, p.gather(1, torch.from_numpy(tokens).long()).numpy() / drawn)
    acceptance = np.array([float(torch.minimum(p[j, ids], probs).sum()) for j, (ids, probs) in enumerate(proposals)])
    return keep, acceptance


def price(
    out: Callable[[str], object],
    workload: str,
    here: Sequence[tuple[dict[str, Any], Positions]],
    costs: Costs,
    reference: float,
    thresholds: Sequence[float],
    args: argparse.Namespace,
) -> None:
    """Prints one workload's check against the run and its rates (the module's note)."""
    rule = block_stop_for(costs.draft_per_token + costs.verify_per_draft, costs.verify + costs.overhead)
    tokens = sum(len(run["token_ids"]) for run, _ in here)
    plain = costs.target_only_ms(tokens, len(here))
    start = costs.drafting_prefill_ms(len(here))
    mean_acceptance = float(np.mean(np.concatenate([pos.acceptance for _, pos in here])))
    out(f"== {workload}: {len(here)} replies of {args.method!r}, {tokens} tokens; ")
    out(f"mean acceptance per position {mean_acceptance:.3f}; the costs' block stop {rule:.2f} ==\n")
    check = StopCheck(args.max_k, rule)
    got = [
        replay(pos, costs, args.max_k, SIGNALS[SERVICE], rule, args.seed, check.for_reply(n))
        for n, (_, pos) in enumerate(here)
    ]
    predicted = [sum(getattr(t, key) / t.trials for t in got) for key in ("rounds", "drafted", "accepted")]
    measured = [sum(run["stats"][key] for run, _ in here) for key in ("rounds", "proposed", "accepted")]
    out("rounds / drafted / accepted: predicted " + " / ".join(f"{v:.0f}" for v in predicted))
    out("; measured " + " / ".join(str(v) for v in measured) + "\n")
    after = sorted(check.switched.values())
    out(f"the controller's check of the stop would switch it off in {len(after)} of {len(check.turns)} turns")
    out(f" (after {after[len(after) // 2]} rounds in the median)\n" if after else "\n")
    for reports, how in ((False, "off for the turn once switched off"), (True, "back with the draft's reports")):
        shared = step_costs(costs, args.max_k)
        turns = [controlled(pos, costs, shared, args.max_k, reports, args.seed) for _, pos in here]
        ms, rounds = sum(t.ms / t.trials for t in turns), sum(t.rounds for t in turns)
        out(f"the controller's own plans, the stop {how}: {reference * plain / (start + ms):.2f} tok/s, ")
        out(f"{sum(t.unstopped for t in turns) / rounds:.1%} of rounds drafted without the stop\n")

    def rate(signal: Signal | None, threshold: float, max_k: int) -> float:
        ms = sum(replay(pos, costs, max_k, signal, threshold, args.seed).ms / args.trials for _, pos in here)
        return reference * plain / (start + ms)

    out("tok/s, fixed K: " + ", ".join(f"K = {k} {rate(None, 0.0, k):.2f}" for k in range(2, 7)) + "\n")
    columns = [*thresholds, rule]
    out(f"{'tok/s, block stop at':44}" + "".join(f"{t:>7.2f}" for t in columns) + "  (the last: the costs')\n")
    for name, signal in SIGNALS.items():
        out(f"{name:44}" + "".join(f"{rate(signal, t, args.max_k):7.2f}" for t in columns) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a sampled `specdec bench` JSON report")
    parser.add_argument("--method", default=HEADLINE, help="the service row whose replies are replayed")
    parser.add_argument("--top-n", type=int, default=64, help="the draft worker's --proposal-top-n")
    parser.add_argument("--max-k", type=int, default=16, help="longest block (the server's max K)")
    parser.add_argument("--trials", type=int, default=200, help="draws per position")
    parser.add_argument("--thresholds", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7", help="comma-separated block stops")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configure_logging("warning", "console")
    report = json.loads(args.report.read_text())
    config = report["config"]
    thresholds = [float(t) for t in args.thresholds.split(",")]
    cfg = BenchConfig(
        model=config["model"],
        draft_model=config["draft_model"],
        workloads={name: tuple(texts) for name, texts in config["workloads"].items()},
        **{key: config[key] for key in ("temperature", "top_p", "top_k", "min_p") if key in config},
    )
    if cfg.greedy:
        raise SystemExit("the report is greedy: sampled_stop.py replays sampled runs (bench --temperature)")
    warp = cfg.warp()
    prompts = {(p.workload, p.index): p.token_ids for p in tokenize_prompts(cfg)}
    runs = [r for r in report["runs"] if r["method"] == args.method and r["token_ids"]]
    if not runs:
        raise SystemExit(f"the report has no replies of {args.method!r}")
    draft = load_model(cfg.draft_model, LoadOptions(device="cpu", dtype="float32", quantize=config["draft_quantize"]))
    sides = []
    for n, run in enumerate(runs):
        prompt = prompts[(run["workload"], run["prompt"])]
        sides.append(draft_side(draft, prompt, run["token_ids"], warp, args.top_n, args.trials, args.seed + n))
    del draft
    target = load_model(cfg.model, LoadOptions(device="cpu", dtype="float32"))
    replies: list[tuple[dict[str, Any], Positions]] = []
    for run, (tokens, drawn, top, proposals) in zip(runs, sides, strict=True):
        prompt = prompts[(run["workload"], run["prompt"])]
        keep, acceptance = target_side(target, prompt, run["token_ids"], warp, tokens, drawn, proposals)
        replies.append((run, Positions(drawn, keep, top, acceptance)))
    del target
    out = sys.stdout.write
    for workload, summary in report["workloads"].items():
        here = [(run, pos) for run, pos in replies if run["workload"] == workload]
        if here:
            costs = measured_costs([r for r in report["runs"] if r["workload"] == workload])
            reference = summary["methods"][TARGET_ONLY]["tokens_per_s"]["median"]
            price(out, workload, here, costs, reference, thresholds, args)


if __name__ == "__main__":
    main()
