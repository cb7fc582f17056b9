"""`specdec bench`'s report: each row's median and spread over the repeats, the ratios and the
greedy identity check, the load limit the concurrency sweep advises, the table and the plots."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.tools.bench_config import (
    HEADLINE,
    HF_TARGET,
    NO_GUESS,
    NO_STOP,
    OF_TARGET,
    REPLY_INDEX,
    SERVICE_TARGET,
    TOKEN_STOP,
    VOCAB_DEFAULT,
    VOCAB_MODEL_K,
    BenchConfig,
    Run,
)


def load_limit_advice(sweep: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """What the sweep says of the coordinator's ``--speculation-max-requests`` on this host: the
    most requests at once at which the default made at least target-only's tokens/s (medians)
    below the first count at which it made less (the crossover lies between the two counts), or
    no limit where it never made less; None without a sweep."""
    if not sweep:
        return None
    ratios = {n: sweep[n]["default" + OF_TARGET] for n in sorted(sweep)}
    counts = list(ratios)
    swept = ", ".join(f"{n}: {x:.2f}x" for n, x in ratios.items())
    lost = [n for n in counts if ratios[n] < 1.0]
    if not lost:
        return {
            "speculation_max_requests": 0,
            "advice": f"the default made at least target-only's tokens/s at every count swept ({swept}): "
            f"leave --speculation-max-requests off (0), or sweep more than {counts[-1]} requests at once",
        }
    first = lost[0]
    if first == counts[0]:
        return {
            "speculation_max_requests": None,
            "advice": f"the default made less than target-only from the fewest requests swept on ({swept}): "
            + (
                "speculation does not pay on this host even alone (check the draft's acceptance)"
                if first == 1
                else f"sweep fewer than {first} requests at once to find where it stops paying"
            ),
        }
    limit = counts[counts.index(first) - 1]
    won_again = [n for n in counts if n > first and ratios[n] >= 1.0]
    again = (
        f"; it made at least target-only's again at {', '.join(map(str, won_again))}: repeat the sweep, "
        "the rows may differ by less than the host's spread"
        if won_again
        else ""
    )
    return {
        "speculation_max_requests": limit,
        "advice": f"the default made at least target-only's tokens/s up to {limit} requests at once and less "
        f"at {first} ({swept}): --speculation-max-requests {limit} on the coordinator (speculation stops "
        f"paying between {limit} and {first}){again}",
    }


def _rate(runs: Sequence[Run]) -> float:
    return sum(len(r.token_ids) for r in runs) / sum(r.seconds for r in runs)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _method_row(mine: Sequence[Run]) -> dict[str, Any]:
    """Tokens/s of each repeat (that repeat's tokens over its seconds, all prompts), median and
    spread; the service's counters summed over all runs."""
    repeats = sorted({r.repeat for r in mine})
    row: dict[str, Any] = {"tokens_per_s": spread([_rate([r for r in mine if r.repeat == i]) for i in repeats])}
    row["repeats"] = len(repeats)
    if not mine[0].stats:
        return row
    total = {key: sum(r.stats[key] for r in mine) for key in mine[0].stats if not key.endswith("by_position")}
    rounds = max(total["rounds"], 1)
    round_ms = total["draft_ms"] + total["verify_ms"] + total["overhead_ms"]
    width = max(len(r.stats["proposed_by_position"]) for r in mine)
    by_position = [
        (
            sum(r.stats["accepted_by_position"][i] for r in mine if i < len(r.stats["accepted_by_position"])),
            sum(r.stats["proposed_by_position"][i] for r in mine if i < len(r.stats["proposed_by_position"])),
        )
        for i in range(width)
    ]
    row |= {
        "acceptance_rate": total["accepted"] / total["proposed"] if total["proposed"] else 0.0,
        "mean_accepted_length": sum(len(r.token_ids) for r in mine) / rounds,
        "mean_k": sum(r.stats["mean_k"] * r.stats["rounds"] for r in mine) / rounds,
        "draft_ms_per_round": total["draft_ms"] / rounds,
        "verify_ms_per_round": total["verify_ms"] / rounds,
        "overhead_ms_per_round": total["overhead_ms"] / rounds,
        "overhead_fraction": total["overhead_ms"] / round_ms if round_ms else 0.0,
        "target_only_round_share": total["target_only_rounds"] / rounds,
        "lookup_round_share": total["lookup_rounds"] / rounds,
        "lookup_acceptance": total["lookup_accepted"] / total["lookup_proposed"] if total["lookup_proposed"] else 0.0,
        "reply_lookup_round_share": total["reply_lookup_rounds"] / rounds,
        "acceptance_by_position": [a / p if p else None for a, p in by_position],  # None: never proposed
    }
    return row


def summarize(cfg: BenchConfig, runs: list[Run], sweep: dict[int, dict[str, Any]]) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for workload in dict.fromkeys(r.workload for r in runs):
        here = [r for r in runs if r.workload == workload]
        methods = {m: _method_row([r for r in here if r.method == m]) for m in dict.fromkeys(r.method for r in here)}
        workloads[workload] = {"methods": methods, **_derived(here, methods, cfg.greedy)}
    advice = load_limit_advice(sweep)
    return {"workloads": workloads, "concurrency": sweep, **({"load_limit_advice": advice} if advice else {})}


def median(methods: dict[str, Any], name: str) -> float:
    return methods[name]["tokens_per_s"]["median"]


def prompt_rate(runs: Sequence[Run], method: str, prompt: int) -> float | None:
    """``method``'s tokens/s on one prompt: the median over its repeats of each run's tokens over
    its seconds (None: the row never ran that prompt)."""
    rates = [len(r.token_ids) / r.seconds for r in runs if r.method == method and r.prompt == prompt]
    return statistics.median(rates) if rates else None


def _per_prompt(runs: list[Run], method: str, baseline: str) -> dict[int, float]:
    """``method``'s tokens/s over ``baseline``'s on each prompt both rows ran (medians over the repeats)."""
    ratios = {}
    for prompt in sorted({r.prompt for r in runs}):
        mine, theirs = prompt_rate(runs, method, prompt), prompt_rate(runs, baseline, prompt)
        if mine is not None and theirs is not None:
            ratios[prompt] = mine / theirs
    return ratios


def _identical(runs: list[Run], methods: dict[str, Any]) -> dict[str, Any]:
    """Whether each row's tokens, every prompt and repeat, are HF target-only's (the service's
    target-only where the run has no HF rows): greedy runs only."""
    reference_method = HF_TARGET if HF_TARGET in methods else SERVICE_TARGET
    reference = {r.prompt: r.token_ids for r in runs if r.method == reference_method and r.repeat == 0}
    identical = {m: all(r.token_ids == reference[r.prompt] for r in runs if r.method == m) for m in methods}
    return {"reference": reference_method, **identical}


def _derived(runs: list[Run], methods: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """Ratios of the headline (the default) to the baselines, per prompt, and, for a greedy run,
    token identity (sampled rows draw differently: each is a sample of the target's distribution,
    which the production-path tests check)."""
    hf_spec = [m for m in methods if m.startswith("hf ") and m != HF_TARGET]
    best_hf = max(hf_spec, key=lambda m: median(methods, m)) if hf_spec else None
    baseline = SERVICE_TARGET
    per_prompt = _per_prompt(runs, HEADLINE, baseline) if HEADLINE in methods and baseline in methods else {}
    ratios: dict[str, float] = {}

    def ratio(name: str, method: str, over: str) -> None:  # only between rows this run has
        if method in methods and over in methods:
            ratios[name] = median(methods, method) / median(methods, over)

    ratio("default / hf target-only", HEADLINE, HF_TARGET)
    ratio("default / service target-only", HEADLINE, baseline)
    ratio("service target-only / hf target-only", baseline, HF_TARGET)
    if per_prompt:
        ratios["worst prompt: default / service target-only"] = min(per_prompt.values())
    for method in methods:  # each adaptive draft's default against target-only, on its worst prompt too
        if method.startswith("service cross-") and method.endswith(" default") and baseline in methods:
            name = method.removeprefix("service ")
            ratio(f"{name} / {baseline}", method, baseline)
            ratio(f"{name} / default (same-family draft)", method, HEADLINE)
            ratios[f"worst prompt: {name} / {baseline}"] = min(_per_prompt(runs, method, baseline).values())
    ratio("default / without the confidence stop", HEADLINE, NO_STOP)
    ratio("default / with the token stop", HEADLINE, TOKEN_STOP)
    ratio("default / without guessing", HEADLINE, NO_GUESS)
    ratio("default with the draft vocabulary / default", VOCAB_DEFAULT, HEADLINE)
    ratio("model K with the draft vocabulary / model K", VOCAB_MODEL_K, "service model K")
    ratio("default with the reply index / default", REPLY_INDEX, HEADLINE)
    against_hf = _per_prompt(runs, HEADLINE, best_hf) if best_hf is not None and HEADLINE in methods else {}
    if best_hf is not None:
        ratio(f"default / best HF speculative ({best_hf})", HEADLINE, best_hf)
        if against_hf:
            ratios[f"worst prompt: default / best HF speculative ({best_hf})"] = min(against_hf.values())
        ratio(f"default with the draft vocabulary / best HF speculative ({best_hf})", VOCAB_DEFAULT, best_hf)
        ratio(f"default with the reply index / best HF speculative ({best_hf})", REPLY_INDEX, best_hf)
    return {
        "ratios": ratios,
        "best_hf_speculative": best_hf,
        "per_prompt_default_vs_target_only": per_prompt,
        "per_prompt_default_vs_best_hf": against_hf,
        **({"greedy_tokens_identical": _identical(runs, methods)} if greedy else {}),
    }


def format_table(report: dict[str, Any]) -> str:
    lines: list[str] = []
    config = report.get("config", {})
    if "temperature" in config and not any("greedy_tokens_identical" in w for w in report["workloads"].values()):
        warp = ", ".join(f"{name} {config[name]}" for name in ("temperature", "top_p", "top_k", "min_p"))
        lines.append(f"sampled ({warp}; each run seeded): no token identity column, which greedy runs have")
    for workload, data in report["workloads"].items():
        lines.append(f"== {workload} ==")
        lines.append(
            f"{'method':36} {'tok/s':>7} {'min':>6} {'max':>6} {'accept':>7} {'len':>5} {'K':>4} "
            f"{'lookup':>7} {'ms/round d+v+o':>16} {'same':>5}"
        )
        same = data.get("greedy_tokens_identical", {})  # none for a sampled run
        for method, row in data["methods"].items():
            rate = row["tokens_per_s"]
            extra = "      -     -    -       -                -"
            if "acceptance_rate" in row:
                parts = (row["draft_ms_per_round"], row["verify_ms_per_round"], row["overhead_ms_per_round"])
                split = "+".join(f"{ms:.0f}" for ms in parts)
                extra = (
                    f"{row['acceptance_rate']:7.2f} {row['mean_accepted_length']:5.2f} {row['mean_k']:4.1f} "
                    f"{row['lookup_round_share']:7.0%} {split:>16}"
                )
            lines.append(
                f"{method:36} {rate['median']:7.2f} {rate['min']:6.2f} {rate['max']:6.2f} {extra} "
                f"{'-' if method not in same else 'yes' if same[method] else 'NO':>5}"
            )
        for name, value in data["ratios"].items():
            lines.append(f"  {name:60} {value:.2f}x")
        against = {
            SERVICE_TARGET: "per_prompt_default_vs_target_only",
            data["best_hf_speculative"]: "per_prompt_default_vs_best_hf",
        }
        for over, key in against.items():
            if data.get(key):
                each = ", ".join(f"{prompt}: {x:.2f}x" for prompt, x in data[key].items())
                lines.append(f"  per prompt, default / {over}: {each}")
        lines.append("")
    for n, row in report["concurrency"].items():
        rates = []
        for method, spec in row["methods"].items():
            r = spec["tokens_per_s"]
            rates.append(f"{method.removeprefix('service ')} {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
        ratios = ", ".join(
            f"{key.removesuffix(OF_TARGET)} {x:.2f}x" for key, x in row.items() if key.endswith(OF_TARGET)
        )
        lines.append(f"{n} concurrent requests, tok/s aggregate: {', '.join(rates)}; of target-only: {ratios}")
    if "load_limit_advice" in report:
        lines.append(f"load limit: {report['load_limit_advice']['advice']}")
    return "\n".join(lines)


def _bars(rates: Sequence[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    """Medians and their min-max error bars (below, above) of tokens/s spreads."""
    below = [r["median"] - r["min"] for r in rates]
    return [r["median"] for r in rates], [below, [r["max"] - r["median"] for r in rates]]


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """tokens/s by method and workload (median, min-max bars), acceptance by draft position,
    aggregate tokens/s by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    workloads = list(report["workloads"])
    methods = list(dict.fromkeys(m for w in workloads for m in report["workloads"][w]["methods"]))
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(methods) * len(workloads) + 1.5))
    height = 0.8 / len(workloads)
    for j, workload in enumerate(workloads):
        rows = report["workloads"][workload]["methods"]
        ys = [i + j * height for i, m in enumerate(methods) if m in rows]
        med, err = _bars([rows[m]["tokens_per_s"] for m in methods if m in rows])
        ax.barh(ys, med, height=height, xerr=err, capsize=2, label=workload)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(methods))], methods)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median of repeats; bars: min-max)")
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "tokens_per_s.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for method, row in report["workloads"][workload]["methods"].items():
            points = [(i + 1, a) for i, a in enumerate(row.get("acceptance_by_position") or []) if a is not None]
            if points and "target-only" not in method:
                ax.plot(*zip(*points, strict=True), marker="o", label=method.removeprefix("service "))
        ax.set_title(workload)
        ax.set_xlabel("draft position in the block")
        ax.set_ylabel("P(accepted | proposed)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "acceptance_by_position.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    sweep = report["concurrency"]
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ns = sorted(int(n) for n in sweep)
        rows = [sweep[n if n in sweep else str(n)]["methods"] for n in ns]
        for method in rows[0]:
            med, err = _bars([row[method]["tokens_per_s"] for row in rows])
            ax.errorbar(ns, med, yerr=err, marker="o", capsize=2, label=method.removeprefix("service "))
        ax.legend(fontsize=7)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_xticks(ns)
        fig.tight_layout()
        written.append(out_dir / "concurrency.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
