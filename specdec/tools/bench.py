"""`specdec bench`: one run, the same prompts and models, every way of decoding them.

Workloads are reported separately: ``complete`` (continue a code or text prompt) and ``edit``
(rewrite 20-40 lines of code given in the prompt with a small change; the output copies much of
its input), or the prompts of ``--prompts FILE``. Baselines run in this process on the same
device and dtype: HF ``generate`` target-only with the same packed CPU kernel as our target
worker (so the kernel is not counted as speculation), HF assisted generation with K matched to
ours (constant K, no confidence cut) and with its defaults, and HF prompt lookup. Then our
service (three or more processes on free ports): target-only, the draft model, n-gram lookup,
the hybrid (lookup where it matches, the model elsewhere) and an early-exit draft, each with
fixed K and adaptive K; the headline row is the server's default (the hybrid, adaptive), also
run over a draft worker that does not guess ahead (``--guess-tokens 0``, its own process). With
``--reply-index-tokens`` the default also runs through a coordinator whose lookups match earlier
replies (each repeat as another caller, so it never sees the same prompt's earlier reply). Every
method runs ``repeats`` times over each workload (interleaved: one repeat of every HF method, one
of every service row, then the next; a host whose speed drifts moves both sides alike); the
report has the median and the spread, greedy token identity against HF target-only,
per-position acceptance, a concurrency sweep (the default against target-only decoding, N
requests at once, also ``repeats`` times) and PNG plots.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from specdec.tools.bench_config import (
    CHAT_WORKLOADS,
    HEADLINE,
    HF_DEFAULT,
    HF_TARGET,
    LOAD_LIMIT,
    MAX_K,
    NO_GUESS,
    NO_STOP,
    OF_TARGET,
    REFERENCES,
    REPLY_INDEX,
    SERVICE_TARGET,
    TOKEN_STOP,
    VOCAB_DEFAULT,
    VOCAB_MODEL_K,
    BenchConfig,
    Prompt,
    Run,
    run_seed,
)
from specdec.tools.bench_report import median, spread, summarize, write_plots

T = TypeVar("T")


def hf_sampling(cfg: BenchConfig) -> dict[str, Any]:
    """HF ``generate``'s sampling options for the run's warp, each given (HF's own defaults, such
    as top-k 50, would otherwise apply to what the service runs without)."""
    if cfg.greedy:
        return {"do_sample": False}
    return {
        "do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
        "min_p": cfg.min_p or None,
    }  # fmt: skip


def tokenize_prompts(cfg: BenchConfig) -> list[Prompt]:
    """Every workload's prompts as token ids (the same ids go to HF and to the service); an
    instruction workload goes through the target's chat template."""
    from specdec.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    prompts = []
    for workload, texts in cfg.workloads.items():
        for i, text in enumerate(texts):
            if workload in CHAT_WORKLOADS and getattr(tokenizer, "chat_template", None):
                rendered = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
                ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
            else:
                ids = tokenizer(text)["input_ids"]
            prompts.append(Prompt(workload, i, tuple(int(t) for t in ids)))
    return prompts


def _chosen(cfg: BenchConfig, methods: dict[str, T]) -> dict[str, T]:
    """The rows ``--method`` names (all without it), always with the target-only rows: every row's
    tokens are checked against them and the ratios divide by them."""
    return {m: spec for m, spec in methods.items() if not cfg.methods or m in cfg.methods or m in REFERENCES}


def hf_methods(cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    """HF rows: method -> generate() options (``assistant`` = the assistant's generation config)."""
    every: dict[str, dict[str, Any]] = {
        HF_TARGET: {},
        f"hf assisted K={cfg.k}": {
            "assistant": {
                "num_assistant_tokens": cfg.k,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
        },
        HF_DEFAULT: {"assistant": {}},
        "hf prompt lookup": {"prompt_lookup_num_tokens": cfg.prompt_lookup_tokens},
    }
    return _chosen(cfg, every)


def hf_runs(
    cfg: BenchConfig, prompts: Sequence[Prompt], tick: Callable[[str], None], dtypes: dict[str, str]
) -> Iterator[list[Run]]:
    """HF generate on this device, one repeat of every method over the prompts per item: the
    target's Linear layers packed as our target worker packs them on a CPU (same kernel on both
    sides) and its attention run as our workers run it there (``use_grouped_attention``), the
    draft quantized as our draft worker's (its projections not fused: transformers' own modules
    run it, the worker's fusion is counted on the service's side). Records the models' dtypes in
    ``dtypes`` ("hf target", "hf draft")."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.runtime.attention import use_grouped_attention
    from specdec.runtime.devices import resolve_device, resolve_dtype
    from specdec.runtime.modeling import packed_by_default, release_freed_memory, use_packed_linear
    from specdec.runtime.quantize import quantize_int4, quantize_int8
    from specdec.runtime.tokenizer import check_source

    device = resolve_device(cfg.device)
    target_dtype, draft_dtype = (resolve_dtype(spec, device) for spec in worker_dtypes(cfg))
    check_source(cfg.model)
    check_source(cfg.draft_model)
    target = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=target_dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(cfg.draft_model, dtype=draft_dtype).to(device).eval()
    if cfg.draft_quantize == "int8":
        draft = quantize_int8(draft)
    elif cfg.draft_quantize == "int4":
        quantize_int4(draft)
    if device.type == "cpu":
        if packed_by_default(device, target_dtype):
            use_packed_linear(target)
        use_grouped_attention()  # the attention path our workers' CPU passes take
    release_freed_memory()  # the fp32 draft the quantized copy replaced: the service's workers need the room
    dtypes["hf target"], dtypes["hf draft"] = (str(model.dtype).removeprefix("torch.") for model in (target, draft))
    defaults = draft.generation_config
    methods = hf_methods(cfg)
    sampling = hf_sampling(cfg)
    with torch.inference_mode():
        target.generate(torch.tensor([prompts[0].token_ids], device=device), max_new_tokens=4, **sampling)
    for repeat in range(cfg.repeats):
        runs: list[Run] = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt.token_ids], device=device)
                for method, options in methods.items():
                    tick(method)
                    extra = {k: v for k, v in options.items() if k != "assistant"}
                    if "assistant" in options:
                        config = defaults.__class__.from_dict(defaults.to_dict())
                        config.update(**options["assistant"])
                        draft.generation_config = config
                        extra["assistant_model"] = draft
                    if not cfg.greedy:
                        torch.manual_seed(run_seed(prompt, repeat))
                    started = time.perf_counter()
                    out = target.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                        **sampling, **extra,
                    )  # fmt: skip
                    seconds = time.perf_counter() - started
                    tokens = out[0, ids.shape[1] :].tolist()
                    runs.append(Run(method, prompt.workload, prompt.index, repeat, tokens, seconds))
        yield runs
    del target, draft
    gc.collect()


class ServiceRow(NamedTuple):
    """How a service row asks: which coordinator, draft method, whether speculation is off, fixed
    K; ``confidence`` and ``block_confidence`` override the server's confidence stops of the draft.
    A fixed-K row asks for the run's K; an adaptive row for none, so the server's default applies,
    as for a user who sets none."""

    coordinator: str
    method: str
    disable: bool
    fixed: bool
    confidence: float | None = None
    block_confidence: float | None = None


SERVICE_METHODS: dict[str, ServiceRow] = {
    SERVICE_TARGET: ServiceRow("main", "default", True, True),
    "service model K": ServiceRow("main", "model", False, True),
    "service model adaptive": ServiceRow("main", "model", False, False),
    "service ngram K": ServiceRow("main", "ngram", False, True),
    "service ngram adaptive": ServiceRow("main", "ngram", False, False),
    "service hybrid K": ServiceRow("main", "hybrid", False, True),
    HEADLINE: ServiceRow("main", "default", False, False),
    # the default before the draft's confidence stops was: blocks of up to the run's K, no stop
    NO_STOP: ServiceRow("main", "default", False, False, confidence=0.0, block_confidence=0.0),
    # the default before the block stop: HF's per-token confidence threshold, 0.4
    TOKEN_STOP: ServiceRow("main", "default", False, False, confidence=0.4, block_confidence=0.0),
    # the default before the draft worker guessed ahead: its own draft worker with --guess-tokens 0
    NO_GUESS: ServiceRow("no-guess", "default", False, False),
    # the same draft model scoring only the tokens of a --draft-vocab file
    VOCAB_MODEL_K: ServiceRow("draft-vocab", "model", False, True),
    VOCAB_DEFAULT: ServiceRow("draft-vocab", "default", False, False),
    # the same workers, through a coordinator whose lookups also match earlier replies (a fresh scope per repeat)
    REPLY_INDEX: ServiceRow("reply-index", "default", False, False),
    "service early-exit K": ServiceRow("early-exit", "model", False, True),
    "service early-exit adaptive": ServiceRow("early-exit", "model", False, False),
    # a draft with another tokenizer (--cross-draft-model), translated by TLI or SLEM
    "service cross-tli model K": ServiceRow("cross-tli", "model", False, True),
    "service cross-tli default": ServiceRow("cross-tli", "default", False, False),
    "service cross-slem model K": ServiceRow("cross-slem", "model", False, True),
    "service cross-slem default": ServiceRow("cross-slem", "default", False, False),
}


# What starts an extra coordinator (the cross-tokenizer ones: --cross-draft-model).
_COORDINATOR_FLAGS = {
    "early-exit": "--early-exit-layers N (the target's layers the draft keeps)",
    "draft-vocab": "--draft-vocab FILE (make one with `specdec draft-vocab`)",
    "reply-index": "--reply-index-tokens N (the reply index's size)",
}


def _extra_drafts(cfg: BenchConfig) -> dict[str, list[str]]:
    """Coordinators besides ``main``, each over its own draft worker (args) and the same target."""
    extra = {"no-guess": ["--model", cfg.draft_model, "--guess-tokens", "0"]}
    if cfg.early_exit_layers:
        extra["early-exit"] = ["--model", cfg.model, "--draft-layers", str(cfg.early_exit_layers)]
    if cfg.draft_vocab:
        extra["draft-vocab"] = ["--model", cfg.draft_model, "--draft-vocab", cfg.draft_vocab]
    if cfg.cross_draft_model:
        for method in ("tli", "slem"):
            extra[f"cross-{method}"] = [
                "--model", cfg.cross_draft_model, "--target-tokenizer", cfg.model, "--vocab-method", method,
            ]  # fmt: skip
    return extra


def service_methods(cfg: BenchConfig) -> dict[str, ServiceRow]:
    extra = [*_extra_drafts(cfg), *(["reply-index"] if cfg.reply_index_tokens else [])]
    return _chosen(cfg, {m: spec for m, spec in SERVICE_METHODS.items() if spec.coordinator in ("main", *extra)})


def _reply_caller(repeat: int) -> tuple[str, str]:
    """The identity and token the reply-index rows send in ``repeat`` (-1: the warm-up). Each
    repeat is another caller, so its lookups see only its own earlier replies, never the same
    prompt's reply from the repeat before."""
    identity = f"repeat-{repeat}" if repeat >= 0 else "warm-up"
    return identity, f"specdec-bench-{identity}-token"


def _metadata(coordinator: str, repeat: int) -> list[tuple[str, str]] | None:
    """What a request to ``coordinator`` sends besides itself: the reply-index one needs a caller."""
    if coordinator != "reply-index":
        return None
    return [("authorization", f"Bearer {_reply_caller(repeat)[1]}")]


def hf_assisted_default_adapts() -> bool:
    """Whether HF's assisted generation adapts its draft confidence threshold to each request:
    it fits one to the draft's probabilities and what the target took (a ROC curve) only where
    scikit-learn imports, and keeps the fixed 0.4 otherwise."""
    from transformers import utils

    return bool(utils.is_sklearn_available())


def check_methods(cfg: BenchConfig) -> None:
    """Every ``--method`` names a row this run has, and the HF rows run as HF would; raises
    ValueError saying what to change."""
    every = replace(cfg, methods=())
    hf = hf_methods(every)
    if not cfg.skip_hf and HF_DEFAULT in hf_methods(cfg) and not hf_assisted_default_adapts():
        raise ValueError(
            f"row '{HF_DEFAULT}' needs scikit-learn: without it HF's assisted generation keeps a fixed "
            "confidence threshold instead of adapting it to each request, a weaker baseline than HF's "
            "default; install it (pip install 'specdec[bench]') or leave the row out with --method"
        )
    rows = [*({} if cfg.skip_hf else hf), *service_methods(every)]
    for name in cfg.methods:
        if name in rows:
            continue
        spec = SERVICE_METHODS.get(name)
        if spec is not None:  # a row of a coordinator this run's flags do not start
            needs = _COORDINATOR_FLAGS.get(spec.coordinator, "--cross-draft-model (a draft with another tokenizer)")
            raise ValueError(f"row '{name}' needs {needs}")
        if name in hf:
            raise ValueError(f"row '{name}' is an HF baseline: drop --skip-hf to run it")
        known = "; ".join(f"'{row}'" for row in rows)
        raise ValueError(f"no row named '{name}' in this run; --method takes one of: {known}")


def worker_dtypes(cfg: BenchConfig) -> tuple[str, str]:
    """The target's and the draft's ``--dtype``, the same for HF's rows and the service's: the
    run's, except that a quantized (int8 or int4) draft is quantized from float32."""
    from specdec.runtime.quantize import quantized_from

    return cfg.dtype, quantized_from(cfg.dtype, cfg.draft_quantize)


def check_numbers(cfg: BenchConfig) -> None:
    """Every count, the device and the dtype can be run with; raises ValueError naming the flag."""
    from specdec.runtime.devices import DTYPES, resolve_device

    bounds = {
        "--repeats": (cfg.repeats, 1, ""),
        "--max-new-tokens": (cfg.max_new_tokens, 1, ""),
        "--early-exit-layers": (cfg.early_exit_layers, 0, " (0 = no such rows)"),
        "--reply-index-tokens": (cfg.reply_index_tokens, 0, " (0 = no such row)"),
        "--speculation-max-requests": (cfg.speculation_max_requests, 0, " (0 = no such row)"),
    }
    for flag, (value, least, meaning) in bounds.items():
        if value < least:
            raise ValueError(f"{flag} must be at least {least}{meaning}, got {value}")
    if not 1 <= cfg.k <= MAX_K:
        raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_K}], got {cfg.k}")
    try:
        resolve_device(cfg.device)
    except ValueError as e:
        raise ValueError(f"--device {e}") from None
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    try:  # the service's own check of a warp: its messages start with the field's name
        cfg.warp()
    except ValueError as e:
        raise ValueError("--" + str(e).replace("_", "-", 1)) from None


def check_config(cfg: BenchConfig) -> None:
    """The run can start: its rows, numbers and paths (see each check); raises ValueError saying
    what to change, before anything loads."""
    check_methods(cfg)
    check_numbers(cfg)
    check_paths(cfg)


def check_paths(cfg: BenchConfig) -> None:
    """Every model, the draft vocabulary and the report's place can be used; raises ValueError
    naming the flag, before anything loads (a bad --out would otherwise fail after the whole run)."""
    from specdec.runtime.tokenizer import check_source
    from specdec.tools.paths import check_output_file

    models = {"--model": cfg.model, "--draft-model": cfg.draft_model, "--cross-draft-model": cfg.cross_draft_model}
    for flag, source in models.items():
        if source:
            try:
                check_source(source)
            except ValueError as e:
                raise ValueError(f"{flag} {e}") from None
    if cfg.draft_vocab:
        try:
            with open(cfg.draft_vocab, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ValueError(f"cannot read --draft-vocab {cfg.draft_vocab}: {e}") from None
    check_output_file(cfg.out, "--out", " (the JSON report; the plots go beside it)")


class ServiceExited(RuntimeError):
    """A service process of the benchmark exited while it ran: its rows measured something else."""


@contextmanager
def service(cfg: BenchConfig, workdir: Path, dtypes: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Target + draft workers and the coordinator with default settings (K = cfg.k); for the
    early-exit and cross-tokenizer rows also their draft workers, each with a coordinator over it
    and the same target (only those some chosen row uses). Yields the coordinators' addresses;
    records in ``dtypes`` the ones the main workers report ("service target", "service draft")."""
    from specdec.tools.launch import LocalCluster, ServiceProcess, spawn, worker_info

    k = str(cfg.k)
    # Prefix reuse off: every row sends the same prompts, and a row that found the prompt cached by
    # the row before it would skip the prefill that HF's generate (and a new prompt) pays.
    common = ["--max-speculative-tokens", str(MAX_K), "--num-speculative-tokens", k, "--default-max-new-tokens", "1024",
              "--prefix-block-tokens", "0"]  # fmt: skip
    target_dtype, draft_dtype = worker_dtypes(cfg)
    cluster = LocalCluster(
        cfg.model, cfg.draft_model, workdir, worker_args=["--device", cfg.device],
        draft_args=["--dtype", draft_dtype, "--quantize", cfg.draft_quantize], coordinator_args=common,
        share_cpu=cfg.device == "cpu", replica_args={"target-0": ["--dtype", target_dtype]},
    )  # fmt: skip
    used = {spec.coordinator for spec in service_methods(cfg).values()}
    with cluster, ExitStack() as extra:
        processes = dict(cluster.processes)
        if dtypes is not None:
            dtypes["service target"] = worker_info(processes["target-0"].address, "target", timeout_s=30).dtype
            dtypes["service draft"] = worker_info(processes["draft"].address, "draft", timeout_s=30).dtype
        lock = ["--cpu-lock-file", str(workdir / "cpu.lock")] if cfg.device == "cpu" else []

        def start(role: str, args: list[str], name: str) -> ServiceProcess:
            process = spawn(role, args, workdir, name=name)
            extra.callback(process.stop)
            processes[name] = process
            return process

        # The coordinators start without waiting for one another (each needs only its workers);
        # the drafts load one after the other, so that only one model is being loaded at a time.
        coordinators: dict[str, ServiceProcess] = {}
        if "reply-index" in used:  # the main workers, another coordinator: lookups also match earlier replies
            tokens = workdir / "reply-index-tokens"
            tokens.write_text("".join(f"{who}:{token}\n" for who, token in map(_reply_caller, range(-1, cfg.repeats))))
            args = [*cluster.processes["coordinator"].args, "--reply-index-tokens", str(cfg.reply_index_tokens),
                    "--auth-tokens-file", str(tokens)]  # fmt: skip
            coordinators["reply-index"] = start("coordinator", args, "coordinator-reply-index")
        if limited_row(cfg) in sweep_methods(cfg):  # the main workers, another coordinator: speculation off above N
            limit = ["--speculation-max-requests", str(cfg.speculation_max_requests)]
            args = [*cluster.processes["coordinator"].args, *limit]
            coordinators[LOAD_LIMIT] = start("coordinator", args, f"coordinator-{LOAD_LIMIT}")
        for name, model_args in _extra_drafts(cfg).items():
            if name not in used:
                continue
            draft_args = [*model_args, "--device", cfg.device, "--dtype", draft_dtype, "--quantize", cfg.draft_quantize]
            draft_args += lock
            draft = start("draft", draft_args, f"draft-{name}")
            draft.wait_ready(900)
            args = list(cluster.processes["coordinator"].args)
            args[args.index("--draft-addresses") + 1] = draft.address
            coordinators[name] = start("coordinator", args, f"coordinator-{name}")
        addresses = {"main": cluster.address}
        for name, coordinator in coordinators.items():
            coordinator.wait_ready(900)
            addresses[name] = coordinator.address
        yield addresses
        # A worker that died mid-run (out of memory, say) leaves its rows decoding target-only or
        # failing over: numbers, but not of the method the row names.
        dead = {name: p.proc.returncode for name, p in processes.items() if p.proc.poll() is not None}
        if dead:
            raise ServiceExited(
                f"service processes exited during the benchmark: {dead} (exit code -9 is usually the "
                "out-of-memory killer: free memory or run fewer rows); the report was not written"
            )


_METHOD_ENUM = {"default": 0, "model": 1, "ngram": 2, "hybrid": 3}


def _request(cfg: BenchConfig, prompt: Prompt, row: ServiceRow, repeat: int = -1) -> Any:
    """The request of ``row`` for ``prompt`` in ``repeat`` (-1: a warm-up), sampled as the run asks."""
    from specdec.v1 import common_pb2, coordinator_pb2

    speculation = coordinator_pb2.SpeculationParams(
        num_speculative_tokens=cfg.k if row.fixed else 0,
        disable=row.disable,
        fixed=row.fixed,
        method=_METHOD_ENUM[row.method],
    )
    if row.confidence is not None:
        speculation.draft_confidence = row.confidence
    if row.block_confidence is not None:
        speculation.draft_block_confidence = row.block_confidence
    sampling = common_pb2.SamplingParams(max_new_tokens=cfg.max_new_tokens)
    if not cfg.greedy:
        sampling.temperature, sampling.top_k, sampling.min_p = cfg.temperature, cfg.top_k, cfg.min_p
        sampling.top_p, sampling.seed = cfg.top_p, run_seed(prompt, repeat)
    return coordinator_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=prompt.token_ids), sampling=sampling, speculation=speculation
    )


def _stats(reply: Any) -> dict[str, Any]:
    s = reply.stats
    return {
        "cached_tokens": reply.usage.cached_tokens,
        "rounds": s.rounds,
        "proposed": s.draft_tokens_proposed,
        "accepted": s.draft_tokens_accepted,
        "target_only_rounds": s.target_only_rounds,
        "lookup_rounds": s.lookup_rounds,
        "lookup_proposed": s.lookup_tokens_proposed,
        "lookup_accepted": s.lookup_tokens_accepted,
        "reply_lookup_rounds": s.reply_lookup_rounds,
        "reply_lookup_accepted": s.reply_lookup_tokens_accepted,
        "draft_ms": s.draft_ms,
        "verify_ms": s.verify_ms,
        "overhead_ms": s.overhead_ms,
        "mean_k": s.mean_k,
        "mean_block_stop": s.mean_block_stop,  # the draft's block stop, as the costs set it by default
        # the turn's first round, which also computes the prompt (scripts/draft_ceiling.py takes it apart)
        "first_round_draft_ms": s.first_round.draft_ms,
        "first_round_verify_ms": s.first_round.verify_ms,
        "first_round_proposed": s.first_round.draft_tokens_proposed,
        "first_round_lookup_proposed": s.first_round.lookup_tokens_proposed,
        "proposed_by_position": list(s.proposed_by_position),
        "accepted_by_position": list(s.accepted_by_position),
    }


def service_runs(
    cfg: BenchConfig, prompts: Sequence[Prompt], addresses: dict[str, str], tick: Callable[[str], None]
) -> Iterator[list[Run]]:
    """The service's rows through their coordinators, one repeat of every row over the prompts per item."""
    import grpc

    from specdec.v1 import coordinator_pb2_grpc

    methods = service_methods(cfg)
    channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}
    stubs = {name: coordinator_pb2_grpc.GenerationStub(channel) for name, channel in channels.items()}
    try:
        for name, stub in stubs.items():  # warm-up: connections, kernels, the cost model
            for row in methods.values():
                if row.disable or (row.coordinator == name and not row.fixed):
                    stub.Generate(_request(cfg, prompts[0], row), timeout=1800, metadata=_metadata(name, -1))
        for repeat in range(cfg.repeats):
            runs: list[Run] = []
            for prompt in prompts:
                for method, row in methods.items():
                    tick(method)
                    started = time.perf_counter()
                    request, caller = _request(cfg, prompt, row, repeat), _metadata(row.coordinator, repeat)
                    reply = stubs[row.coordinator].Generate(request, timeout=1800, metadata=caller)
                    seconds = time.perf_counter() - started
                    tokens = list(reply.token_ids)
                    runs.append(Run(method, prompt.workload, prompt.index, repeat, tokens, seconds, _stats(reply)))
            yield runs
    finally:
        for channel in channels.values():
            channel.close()


def limited_row(cfg: BenchConfig) -> str:
    """The sweep's row of the default through the coordinator with --speculation-max-requests."""
    return f"service default, speculation-max-requests {cfg.speculation_max_requests}"


def sweep_methods(cfg: BenchConfig) -> tuple[str, ...]:
    """The concurrency sweep's rows: is speculating worth it under load, and with the load limit?"""
    limited = (limited_row(cfg),) if cfg.speculation_max_requests and cfg.concurrency else ()
    return (HEADLINE, *limited, SERVICE_TARGET)


def concurrency_runs(
    cfg: BenchConfig, prompts: Sequence[Prompt], addresses: dict[str, str], tick: Callable[[str], None]
) -> dict[int, dict[str, Any]]:
    """Aggregate tokens/s with N one-shot requests at once, for the default (also through the
    coordinator with --speculation-max-requests, if the run has it) and for target-only decoding
    (the same prompts), each ``cfg.repeats`` times, interleaved: median, spread and each row's
    ratio to target-only."""
    import grpc

    from specdec.v1 import coordinator_pb2_grpc

    rates: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
    limited, methods = limited_row(cfg), sweep_methods(cfg)
    with ExitStack() as stack:
        stubs = {
            name: coordinator_pb2_grpc.GenerationStub(stack.enter_context(grpc.insecure_channel(addresses[name])))
            for name in ("main", *([LOAD_LIMIT] if limited in methods else []))
        }
        for repeat in range(cfg.repeats):
            for n in cfg.concurrency:
                batch = [prompts[i % len(prompts)] for i in range(n)]
                for method in methods:
                    tick(f"{n} sessions, {method}")
                    stub = stubs[LOAD_LIMIT if method == limited else "main"]
                    row = SERVICE_METHODS[HEADLINE if method == limited else method]
                    # a prompt sent twice at once is sampled with two seeds
                    requests = [_request(cfg, p, row, repeat * n + i) for i, p in enumerate(batch)]
                    started = time.perf_counter()
                    with ThreadPoolExecutor(max_workers=n) as pool:
                        replies = list(pool.map(lambda r, stub=stub: stub.Generate(r, timeout=3600), requests))
                    seconds = time.perf_counter() - started
                    rates[n, method].append(sum(len(r.token_ids) for r in replies) / seconds)
    sweep: dict[int, dict[str, Any]] = {}
    for n in cfg.concurrency:
        rows = {method: {"tokens_per_s": spread(rates[n, method])} for method in methods}
        sweep[n] = {"sessions": n, "methods": rows}
        for method in methods[:-1]:
            name = "default" if method == HEADLINE else method.removeprefix("service ")
            sweep[n][name + OF_TARGET] = median(rows, method) / median(rows, SERVICE_TARGET)
    return sweep


def interleave(*sources: Iterator[T]) -> Iterator[T]:
    """One item of each source in turn, until all are exhausted (a source that ends drops out)."""
    live = list(sources)
    while live:
        for source in list(live):
            try:
                yield next(source)
            except StopIteration:
                live.remove(source)


def run(cfg: BenchConfig) -> dict[str, Any]:
    from tqdm import tqdm

    check_config(cfg)
    prompts = tokenize_prompts(cfg)
    per_repeat = len(prompts) * ((0 if cfg.skip_hf else len(hf_methods(cfg))) + len(service_methods(cfg)))
    sweep_runs = len(cfg.concurrency) * len(sweep_methods(cfg)) * cfg.repeats
    with tqdm(total=per_repeat * cfg.repeats + sweep_runs, unit="run", desc="bench") as bar:

        def tick(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        runs: list[Run] = []
        dtypes: dict[str, str] = {}  # what each side's models run in, as loaded (not as asked)
        with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp, service(cfg, Path(tmp), dtypes) as addresses:
            # one repeat of the HF rows, then one of the service's, and so on: a machine whose speed
            # drifts during the run (a shared host) moves both sides alike
            hf = iter(()) if cfg.skip_hf or not hf_methods(cfg) else hf_runs(cfg, prompts, tick, dtypes)
            for batch in interleave(hf, service_runs(cfg, prompts, addresses, tick)):
                runs += batch
            sweep = concurrency_runs(cfg, prompts, addresses, tick)
    report = summarize(cfg, runs, sweep)
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    report["prompt_tokens"] = {f"{p.workload}/{p.index}": len(p.token_ids) for p in prompts}
    report["dtypes"] = dtypes
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    if not cfg.skip_hf:
        import transformers

        adapts = hf_assisted_default_adapts()
        report["hf"] = {"transformers": transformers.__version__, "assisted_default_adapts_threshold": adapts}
    report["runs"] = [asdict(r) for r in runs]
    cfg.out.write_text(json.dumps(report, indent=2))  # check_config made its directory
    if cfg.plots:
        report["plots"] = [str(p) for p in write_plots(report, cfg.out.parent)]
    return report
