"""`specdec bench`: one run, same prompts, same models, every way of decoding them.

Measures, greedy: HF ``generate`` target-only and HF assisted generation (``assistant_model``) in
this process, then our service (three processes on free ports) target-only, sequential and
pipelined (two coordinators over the same workers), each with fixed K and adaptive K, and a
concurrency sweep. Prints a table and writes JSON.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROMPTS = (
    "# Python function that returns the n-th Fibonacci number\ndef fibonacci(n):",
    "# A least-recently-used cache with O(1) get and put\nclass LRUCache:\n    def __init__(self, capacity):",
    'import numpy as np\n\n\ndef normalize(x):\n    """Scale each row of x to unit L2 norm."""',
    "-- SQL: the ten customers with the highest total order value\nSELECT",
    "The three most important ideas in distributed systems are",
)


@dataclass(frozen=True)
class BenchConfig:
    model: str
    draft_model: str
    draft_quantize: str = "none"
    k: int = 4
    max_new_tokens: int = 64
    prompts: tuple[str, ...] = PROMPTS
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    device: str = "cpu"
    out: Path = Path("bench-results/bench.json")
    skip_hf: bool = False


@dataclass
class Run:
    """One generation: method, prompt, tokens, wall seconds, the service's stats (if any)."""

    method: str
    prompt: int
    token_ids: list[int]
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)


# --- in-process Hugging Face baselines ---------------------------------------------------------


def hf_runs(cfg: BenchConfig, tick: Callable[[str], None]) -> list[Run]:
    """HF generate, target alone and with the draft as assistant_model (what users get without us),
    then assisted generation again with the target's Linear layers packed as our target worker
    packs them on a CPU: the like-for-like comparison of the two ways of speculating."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.runtime.modeling import quantize_int8, use_packed_linear

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    target = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(cfg.draft_model, dtype=torch.float32).eval()
    if cfg.draft_quantize == "int8":
        draft = quantize_int8(draft)
    runs: list[Run] = []

    def generate(model: Any, method: str, i: int, **extra: Any) -> None:
        tick(method)
        inputs = tokenizer(cfg.prompts[i], return_tensors="pt")
        started = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=cfg.max_new_tokens, do_sample=False, **extra)
        seconds = time.perf_counter() - started
        runs.append(Run(method, i, out[0, inputs["input_ids"].shape[1] :].tolist(), seconds))

    with torch.inference_mode():
        warm = tokenizer(cfg.prompts[0], return_tensors="pt")
        target.generate(**warm, max_new_tokens=4, do_sample=False)
        for i in range(len(cfg.prompts)):
            generate(target, "hf target-only", i)
            generate(target, "hf assisted", i, assistant_model=draft)
        if cfg.device == "cpu":
            use_packed_linear(target)
            target.generate(**warm, max_new_tokens=4, do_sample=False)
            for i in range(len(cfg.prompts)):
                generate(target, "hf assisted, packed target", i, assistant_model=draft)
    del target, draft
    gc.collect()
    return runs


# --- our service ---------------------------------------------------------------------------------


def _stats(reply: Any) -> dict[str, float]:
    s = reply.stats
    return {
        "rounds": s.rounds,
        "proposed": s.draft_tokens_proposed,
        "accepted": s.draft_tokens_accepted,
        "target_only_rounds": s.target_only_rounds,
        "pipelined_rounds": s.pipelined_rounds,
        "draft_ms": s.draft_ms,
        "verify_ms": s.verify_ms,
        "overhead_ms": s.overhead_ms,
        "mean_k": s.mean_k,
    }


@contextmanager
def service(cfg: BenchConfig, workdir: Path) -> Iterator[dict[str, str]]:
    """Target + draft workers and two coordinators (sequential, pipelined); yields their addresses."""
    from specdec.tools.launch import LocalCluster, spawn

    k = str(max(cfg.k, 1))
    common = ["--max-speculative-tokens", k, "--num-speculative-tokens", k, "--default-max-new-tokens", "1024"]
    cluster = LocalCluster(
        cfg.model, cfg.draft_model, workdir, worker_args=["--device", cfg.device],
        draft_args=["--quantize", cfg.draft_quantize], coordinator_args=[*common, "--speculation-mode", "sequential"],
        share_cpu=cfg.device == "cpu",
    )  # fmt: skip
    with cluster:
        args = list(cluster.processes["coordinator"].args)
        args[args.index("--speculation-mode") + 1] = "pipelined"
        pipelined = spawn("coordinator", args, workdir, name="coordinator-pipelined")
        try:
            pipelined.wait_ready(600)
            yield {"sequential": cluster.address, "pipelined": pipelined.address}
        finally:
            pipelined.stop()


def _request(cfg: BenchConfig, prompt: str, disable: bool = False, fixed: bool = True) -> Any:
    from specdec.v1 import common_pb2, coordinator_pb2

    return coordinator_pb2.GenerateRequest(
        prompt=prompt,
        sampling=common_pb2.SamplingParams(max_new_tokens=cfg.max_new_tokens, ignore_eos=False),
        speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=cfg.k, disable=disable, fixed=fixed),
    )


SERVICE_METHODS = {
    # method: (coordinator, disable speculation, fixed K)
    "service target-only": ("sequential", True, True),
    "service sequential K": ("sequential", False, True),
    "service sequential adaptive": ("sequential", False, False),
    "service pipelined K": ("pipelined", False, True),
    "service pipelined adaptive": ("pipelined", False, False),
}


def service_runs(cfg: BenchConfig, addresses: dict[str, str], tick: Callable[[str], None]) -> list[Run]:
    import grpc

    from specdec.v1 import coordinator_pb2_grpc

    runs: list[Run] = []
    channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}
    stubs = {name: coordinator_pb2_grpc.GenerationStub(channel) for name, channel in channels.items()}
    try:
        for stub in stubs.values():  # warm-up: connections, kernels, the cost model
            for disable in (True, False):
                stub.Generate(_request(cfg, cfg.prompts[0], disable=disable, fixed=False), timeout=900)
        for i, prompt in enumerate(cfg.prompts):
            for method, (coordinator, disable, fixed) in SERVICE_METHODS.items():
                tick(method)
                started = time.perf_counter()
                reply = stubs[coordinator].Generate(_request(cfg, prompt, disable, fixed), timeout=900)
                runs.append(Run(method, i, list(reply.token_ids), time.perf_counter() - started, _stats(reply)))
    finally:
        for channel in channels.values():
            channel.close()
    return runs


def concurrency_runs(cfg: BenchConfig, address: str, tick: Callable[[str], None]) -> dict[int, dict[str, float]]:
    """Aggregate tokens/s with N sessions generating at once (adaptive K, default mode)."""
    import grpc

    from specdec.v1 import coordinator_pb2_grpc

    sweep: dict[int, dict[str, float]] = {}
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for n in cfg.concurrency:
            tick(f"{n} sessions")
            prompts = [cfg.prompts[i % len(cfg.prompts)] for i in range(n)]
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                replies = list(pool.map(lambda p: stub.Generate(_request(cfg, p, fixed=False), timeout=1800), prompts))
            seconds = time.perf_counter() - started
            tokens = sum(len(r.token_ids) for r in replies)
            sweep[n] = {"sessions": n, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    return sweep


# --- summary -----------------------------------------------------------------------------------


def _alpha_from_mean_length(mean_length: float, k: int) -> float:
    """Per-token acceptance a with (1 - a^(k+1)) / (1 - a) = mean committed tokens per round."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        value = (1 - mid ** (k + 1)) / (1 - mid) if mid < 1 else k + 1
        low, high = (mid, high) if value < mean_length else (low, mid)
    return (low + high) / 2


def summarize(cfg: BenchConfig, runs: list[Run], sweep: dict[int, dict[str, float]]) -> dict[str, Any]:
    methods: dict[str, dict[str, float]] = {}
    for method in dict.fromkeys(r.method for r in runs):
        mine = [r for r in runs if r.method == method]
        tokens, seconds = sum(len(r.token_ids) for r in mine), sum(r.seconds for r in mine)
        row: dict[str, float] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        totals = {key: sum(r.stats.get(key, 0.0) for r in mine) for key in mine[0].stats}
        if totals:
            round_ms = totals["draft_ms"] + totals["verify_ms"] + totals["overhead_ms"]
            row |= {
                "acceptance_rate": totals["accepted"] / totals["proposed"] if totals["proposed"] else 0.0,
                "mean_accepted_length": tokens / totals["rounds"],
                "overhead_fraction": totals["overhead_ms"] / round_ms if round_ms else 0.0,
                "draft_ms_per_round": totals["draft_ms"] / totals["rounds"],
                "pipelined_rounds": totals["pipelined_rounds"],
                "target_only_rounds": totals["target_only_rounds"],
                "mean_k": sum(r.stats["mean_k"] * r.stats["rounds"] for r in mine) / totals["rounds"],
            }
        methods[method] = row
    return {"methods": methods, "concurrency": sweep, **_derived(cfg, runs, methods, sweep)}


def _rate(methods: dict[str, dict[str, float]], name: str) -> float:
    return methods.get(name, {}).get("tokens_per_s", float("nan"))


def _derived(
    cfg: BenchConfig, runs: list[Run], methods: dict[str, dict[str, float]], sweep: dict[int, dict[str, float]]
) -> dict[str, Any]:
    seq, pipe = "service sequential K", "service pipelined K"
    best = max(
        ("service sequential adaptive", "service pipelined adaptive", seq, pipe), key=lambda m: _rate(methods, m)
    )
    target_only = methods["service target-only"]
    seconds_per_token = target_only["seconds"] / target_only["tokens"]
    seq_row = methods[seq]
    alpha = _alpha_from_mean_length(seq_row["mean_accepted_length"], cfg.k)
    c = (seq_row["draft_ms_per_round"] / 1000 / cfg.k) / seconds_per_token
    per_prompt = []
    for i in range(len(cfg.prompts)):
        by = {r.method: r for r in runs if r.prompt == i}
        rate = {m: len(r.token_ids) / r.seconds for m, r in by.items()}
        per_prompt.append(rate["service sequential adaptive"] / rate["service target-only"])
    reference = {r.prompt: r.token_ids for r in runs if r.method == "hf target-only"}
    same_tokens = (
        {m: all(r.token_ids == reference[r.prompt] for r in runs if r.method == m) for m in methods}
        if reference
        else {}
    )
    ratios = {
        "pipelined / sequential": _rate(methods, pipe) / _rate(methods, seq),
        "best service / hf assisted": _rate(methods, best) / _rate(methods, "hf assisted"),
        "best service / hf assisted, packed target": _rate(methods, best)
        / _rate(methods, "hf assisted, packed target"),
        "best service / hf target-only": _rate(methods, best) / _rate(methods, "hf target-only"),
        "service target-only / hf target-only": _rate(methods, "service target-only")
        / _rate(methods, "hf target-only"),
        "best service / service target-only": _rate(methods, best) / _rate(methods, "service target-only"),
        "worst prompt: adaptive / target-only": min(per_prompt),
        f"{max(sweep)} sessions / 1 session (aggregate)": sweep[max(sweep)]["tokens_per_s"]
        / sweep[min(sweep)]["tokens_per_s"],
    }
    leviathan = {
        "alpha": alpha,
        "c": c,
        "k": cfg.k,
        "expected_speedup": (1 - alpha ** (cfg.k + 1)) / ((1 - alpha) * (cfg.k * c + 1)),
        "measured_speedup": _rate(methods, seq) / _rate(methods, "service target-only"),
    }
    return {
        "best_service_method": best,
        "ratios": ratios,
        "leviathan": leviathan,
        "per_prompt_adaptive_vs_target_only": per_prompt,
        "greedy_tokens_equal_hf": same_tokens,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'method':30} {'tok/s':>7} {'accept':>7} {'len':>5} {'K':>4} {'overhead':>9}"]
    for method, row in report["methods"].items():
        accept = f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "-"
        length = f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else "-"
        k = f"{row['mean_k']:.1f}" if "mean_k" in row else "-"
        overhead = f"{row['overhead_fraction']:.1%}" if "overhead_fraction" in row else "-"
        lines.append(f"{method:30} {row['tokens_per_s']:7.2f} {accept:>7} {length:>5} {k:>4} {overhead:>9}")
    lines.append("")
    for n, row in report["concurrency"].items():
        lines.append(f"{n} concurrent sessions: {row['tokens_per_s']:.2f} tok/s aggregate")
    lines.append("")
    for name, value in report["ratios"].items():
        lines.append(f"{name:40} {value:.2f}x")
    lev = report["leviathan"]
    lines.append(
        f"Leviathan expectation (a={lev['alpha']:.2f}, c={lev['c']:.3f}, K={lev['k']}): "
        f"{lev['expected_speedup']:.2f}x; measured sequential / target-only: {lev['measured_speedup']:.2f}x"
    )
    return "\n".join(lines)


def run(cfg: BenchConfig) -> dict[str, Any]:
    from tqdm import tqdm

    hf_methods = 0 if cfg.skip_hf else 3 if cfg.device == "cpu" else 2
    total = (hf_methods + len(SERVICE_METHODS)) * len(cfg.prompts) + len(cfg.concurrency)
    with tqdm(total=total, unit="run", desc="bench") as bar:

        def tick(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        runs = [] if cfg.skip_hf else hf_runs(cfg, tick)
        with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp, service(cfg, Path(tmp)) as addresses:
            runs += service_runs(cfg, addresses, tick)
            sweep = concurrency_runs(cfg, addresses["sequential"], tick)
    report = summarize(cfg, runs, sweep)
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    report["runs"] = [asdict(r) for r in runs]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2))
    return report


def parse_concurrency(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def prompts_from(path: Path | None) -> Sequence[str]:
    """Prompts from a file (separated by lines holding only '---'), or the built-in set."""
    if path is None:
        return PROMPTS
    return [p.strip("\n") for p in path.read_text().split("\n---\n") if p.strip()]
