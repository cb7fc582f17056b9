"""`specdec bench`'s configuration, workloads and row names, shared by its runs and its report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
CHAT_WORKLOADS = frozenset({"edit"})  # sent through the chat template (instructions to an instruct model)
HEADLINE = "service default (hybrid, adaptive)"
HF_TARGET = "hf target-only"
SERVICE_TARGET = "service target-only"
HF_DEFAULT = "hf assisted default"
REFERENCES = (HF_TARGET, SERVICE_TARGET)
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


NO_STOP = "service default without the confidence stop"
TOKEN_STOP = "service default with the token stop"
VOCAB_MODEL_K = "service model K, draft vocabulary"
VOCAB_DEFAULT = "service default, draft vocabulary"
REPLY_INDEX = "service default, reply index"
NO_GUESS = "service default without guessing"
LOAD_LIMIT = "load-limit"  # the coordinator of the sweep's row with --speculation-max-requests
OF_TARGET = f" / {SERVICE_TARGET}"  # a sweep row's ratio to target-only: "<row> / service target-only"


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
