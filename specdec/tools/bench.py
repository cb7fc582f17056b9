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
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    from specdec.runtime.sampling import Warp

COMPLETE_PROMPTS = (
    "# Python function that returns the n-th Fibonacci number\ndef fibonacci(n):",
    "# A least-recently-used cache with O(1) get and put\nclass LRUCache:\n    def __init__(self, capacity):",
    'import numpy as np\n\n\ndef normalize(x):\n    """Scale each row of x to unit L2 norm."""',
)

_INVENTORY = """class Inventory:
    def __init__(self):
        self.items = {}
        self.history = []

    def add(self, name, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count
        self.history.append(("add", name, count))

    def remove(self, name, count):
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} left")
        self.items[name] = have - count
        if self.items[name] == 0:
            del self.items[name]
        self.history.append(("remove", name, count))

    def total(self):
        return sum(self.items.values())

    def most_common(self, n):
        ranked = sorted(self.items.items(), key=lambda kv: kv[1], reverse=True)
        return ranked[:n]
"""

_PARSER = """def parse_config(path):
    settings = {}
    section = None
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1].strip()
                settings.setdefault(section, {})
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key = value")
            key, value = (part.strip() for part in line.split("=", 1))
            if section is None:
                raise ValueError(f"line {number}: {key} is outside any section")
            settings[section][key] = value
    return settings


def get_int(settings, section, key, default=0):
    value = settings.get(section, {}).get(key)
    if value is None:
        return default
    return int(value)
"""

_STATS = """def mean(values):
    total = 0
    count = 0
    for v in values:
        total += v
        count += 1
    return total / count


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / (len(values) - 1)


def summary(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        median = ordered[middle]
    else:
        median = (ordered[middle - 1] + ordered[middle]) / 2
    return {"mean": mean(values), "median": median, "variance": variance(values)}
"""

EDIT_PROMPTS = (
    f"Add type hints to every method of this class. Change nothing else.\n\n```python\n{_INVENTORY}```",
    f"Rename the variable `settings` to `config` everywhere in this code. Change nothing else.\n\n"
    f"```python\n{_PARSER}```",
    f"Add a one-line docstring to each function. Change nothing else.\n\n```python\n{_STATS}```",
)

WORKLOADS: dict[str, tuple[str, ...]] = {"complete": COMPLETE_PROMPTS, "edit": EDIT_PROMPTS}
T = TypeVar("T")
CHAT_WORKLOADS = frozenset({"edit"})  # sent through the chat template (instructions to an instruct model)
HEADLINE = "service default (hybrid, adaptive)"
HF_TARGET = "hf target-only"
SERVICE_TARGET = "service target-only"
HF_DEFAULT = "hf assisted default"
_REFERENCES = (HF_TARGET, SERVICE_TARGET)


MAX_K = 16  # the bench's coordinators take blocks up to this long (--max-speculative-tokens)


@dataclass(frozen=True)
class BenchConfig:
    model: str
    draft_model: str
    draft_quantize: str = "none"
    k: int = 4
    max_new_tokens: int = 64
    workloads: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(WORKLOADS))
    repeats: int = 3
    concurrency: tuple[int, ...] = (1, 2, 4)
    device: str = "cpu"
    dtype: str = "auto"  # the target's, on both sides (HF's rows and the service's); a quantized draft stays float32
    early_exit_layers: int = 0  # the early-exit rows keep this many of the target's layers; 0 = no such rows
    cross_draft_model: str = ""  # a draft with another tokenizer: TLI and SLEM rows ("" = no such rows)
    draft_vocab: str = ""  # a `specdec draft-vocab` file: rows whose draft scores only its tokens ("" = none)
    reply_index_tokens: int = 0  # rows whose lookups also match earlier replies (--reply-index-tokens); 0 = none
    # the concurrency sweep's row of the default through a coordinator that stops speculating above
    # this many requests (its --speculation-max-requests); 0 = no such row
    speculation_max_requests: int = 0
    methods: tuple[str, ...] = ()  # run only these rows (names as in the table); () = all
    prompt_lookup_tokens: int = 10  # HF prompt lookup's prompt_lookup_num_tokens
    # sampling of every row, HF's and the service's (a temperature below the service's greedy limit,
    # 0 included, decodes greedily and checks token identity; sampled rows are seeded per run)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    out: Path = Path("bench-results/bench.json")
    skip_hf: bool = False
    plots: bool = True

    def warp(self) -> Warp:
        """The run's warp as the service reads it (``Warp`` checks it: ValueError naming the field)."""
        from specdec.runtime.sampling import Warp

        return Warp(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def greedy(self) -> bool:
        return self.warp().greedy


@dataclass(frozen=True)
class Prompt:
    workload: str
    index: int
    token_ids: tuple[int, ...]


@dataclass
class Run:
    """One generation: method, workload and prompt, repeat, tokens, wall seconds, the service's stats."""

    method: str
    workload: str
    prompt: int
    repeat: int
    token_ids: list[int]
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)


def run_seed(prompt: Prompt, repeat: int) -> int:
    """A sampled run's seed: its own for each workload, prompt and repeat, the same for every row
    (HF's ``torch.manual_seed`` and the service's ``sampling.seed``; the two draw differently, so
    their tokens differ, each being a sample of the target's distribution). Repeat -1 is the warm-up."""
    return 1 + (repeat + 1) * 1_000_003 + prompt.index * 1_009 + sum(map(ord, prompt.workload))


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


# --- in-process Hugging Face baselines ---------------------------------------------------------


def _chosen(cfg: BenchConfig, methods: dict[str, T]) -> dict[str, T]:
    """The rows ``--method`` names (all without it), always with the target-only rows: every row's
    tokens are checked against them and the ratios divide by them."""
    return {m: spec for m, spec in methods.items() if not cfg.methods or m in cfg.methods or m in _REFERENCES}


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


# --- our service ---------------------------------------------------------------------------------


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


NO_STOP = "service default without the confidence stop"
TOKEN_STOP = "service default with the token stop"
VOCAB_MODEL_K = "service model K, draft vocabulary"
VOCAB_DEFAULT = "service default, draft vocabulary"
REPLY_INDEX = "service default, reply index"
NO_GUESS = "service default without guessing"
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


LOAD_LIMIT = "load-limit"  # the coordinator of the sweep's row with --speculation-max-requests
OF_TARGET = f" / {SERVICE_TARGET}"  # a sweep row's ratio to target-only: "<row> / service target-only"


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
        rows = {method: {"tokens_per_s": _spread(rates[n, method])} for method in methods}
        sweep[n] = {"sessions": n, "methods": rows}
        for method in methods[:-1]:
            name = "default" if method == HEADLINE else method.removeprefix("service ")
            sweep[n][name + OF_TARGET] = _median(rows, method) / _median(rows, SERVICE_TARGET)
    return sweep


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


# --- summary -----------------------------------------------------------------------------------


def _rate(runs: Sequence[Run]) -> float:
    return sum(len(r.token_ids) for r in runs) / sum(r.seconds for r in runs)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _method_row(mine: Sequence[Run]) -> dict[str, Any]:
    """Tokens/s of each repeat (that repeat's tokens over its seconds, all prompts), median and
    spread; the service's counters summed over all runs."""
    repeats = sorted({r.repeat for r in mine})
    row: dict[str, Any] = {"tokens_per_s": _spread([_rate([r for r in mine if r.repeat == i]) for i in repeats])}
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


def _median(methods: dict[str, Any], name: str) -> float:
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
    best_hf = max(hf_spec, key=lambda m: _median(methods, m)) if hf_spec else None
    baseline = SERVICE_TARGET
    per_prompt = _per_prompt(runs, HEADLINE, baseline) if HEADLINE in methods and baseline in methods else {}
    ratios: dict[str, float] = {}

    def ratio(name: str, method: str, over: str) -> None:  # only between rows this run has
        if method in methods and over in methods:
            ratios[name] = _median(methods, method) / _median(methods, over)

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


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``--concurrency``'s request counts ('' = none); raises ValueError for anything else."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part)
    except ValueError:
        counts = (0,)
    if any(count < 1 for count in counts):
        raise ValueError(f"--concurrency takes request counts of at least 1 such as 1,2,4, got {text!r}")
    return counts


def workloads_from(path: Path | None, max_prompts: int = 0) -> dict[str, tuple[str, ...]]:
    """The built-in workloads, or one workload ``file`` of the prompts in a file (separated by
    lines holding only '---'); ``max_prompts`` > 0 keeps the first that many of each. Raises
    ValueError for a file that cannot be read or holds no prompt."""
    if max_prompts < 0:
        raise ValueError(f"--max-prompts must be at least 0 (0 = all), got {max_prompts}")
    if path is None:
        workloads = dict(WORKLOADS)
    else:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompts {path}: {e}") from None
        workloads = {"file": tuple(p.strip("\n") for p in text.split("\n---\n") if p.strip())}
        if not workloads["file"]:
            raise ValueError(f"--prompts {path} holds no prompts (separate prompts with lines holding only '---')")
    return {name: prompts[: max_prompts or None] for name, prompts in workloads.items()}
