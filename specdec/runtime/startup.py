"""What a worker measures and checks of its loaded model at start-up: the prefill rates its time
limits use, the KV bytes a token takes and the automatic token budget, and whether the lean
one-token step gives the model's own logits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from transformers import DynamicCache

from specdec.runtime.cachelayers import (
    WindowedLayer,
    cache_argument,
    copied,
    layer_bytes,
    logit_rows_argument,
    new_cache,
)
from specdec.runtime.lean import LeanStep
from specdec.runtime.modeling import LoadedModel

log = structlog.get_logger(__name__)


CACHE_MEMORY_SHARE = 0.5  # of the memory free after loading, what an automatic token budget may fill


LEAN_CHECK_TOKENS = 8  # the cache a lean step is checked on at start-up holds all but the last
LEAN_OFF = "one-token steps run the model's forward; report the transformers version"


def checked_lean_step(loaded: LoadedModel) -> LeanStep | None:
    """The model's lean step (``LeanStep.of``) if a step of it on a short cache gives the logits the
    model's own forward gives there bit for bit, else None. The step re-states transformers' decoder
    in fewer operators: a transformers release whose decoder does more, or names its parts otherwise,
    would make it propose worse drafts (never wrong tokens: the target decides) or fail, so such a
    model runs its forward instead, logged (``lean_step_differs``) rather than slower or down for no
    visible reason."""
    model = loaded.model
    ids = [(7 * i + 3) % loaded.vocab_size for i in range(LEAN_CHECK_TOKENS)]
    try:
        lean = LeanStep.of(model)
        if lean is None:
            return None
        cache = new_cache(model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids[:-1]]), **cache_argument(model, cache), **logit_rows_argument(model, 1))
            got = lean(copied(loaded, cache, 1, None), ids[-1])
            last = torch.tensor([ids[-1:]])
            want = model(input_ids=last, **cache_argument(model, cache), **logit_rows_argument(model, 1)).logits
    except Exception as exc:  # an optional path: whatever it trips on, the model's own forward runs
        log.warning("lean_step_differs", error=f"{type(exc).__name__}: {exc}", detail=LEAN_OFF)
        return None
    want = want[0, -1:].float()
    if torch.equal(got, want):
        return lean
    log.warning("lean_step_differs", largest_logit_difference=float((got - want).abs().max()), detail=LEAN_OFF)
    return None


def _two_token_cache(loaded: LoadedModel, cache: DynamicCache) -> DynamicCache:
    """``cache`` after a 2-token pass of the model: what each of its layers keeps per token."""
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([[0, 1]], device=loaded.device), **cache_argument(loaded.model, cache))
    return cache


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """The KV-cache bytes one token takes in this model (measured on a 2-token pass)."""
    cache = _two_token_cache(loaded, new_cache(loaded.model.config))
    return max(1, sum(layer_bytes(layer) for layer in cache.layers) // 2)


PREFILL_PROBE_TOKENS = 256  # the start-up passes that prefill_rates times
PREFILL_CONTEXT_PROBE_TOKENS = 2048  # the cache the second of them runs over
PREFILL_PROBE_TRIES = 4  # pairs of the two passes timed at most, while the second is no slower


@dataclass(frozen=True)
class PrefillRates:
    """What a prefill pass costs: milliseconds per token on an empty cache, and milliseconds per
    token more for every 1,000 tokens before it (attention reads them all)."""

    per_token_ms: float
    per_1k_context_ms: float


def prefill_rates(loaded: LoadedModel, margin: int | None = None, warmed: bool = False) -> PrefillRates:
    """Times a pass of PREFILL_PROBE_TOKENS tokens (fewer if the context is shorter) on an empty
    cache, after a short pass that takes the one-time costs of a first forward pass (none where
    ``warmed``: SessionCaches.warm_up's passes took them), and the same
    pass over a cache of PREFILL_CONTEXT_PROBE_TOKENS tokens (its keys and values copies of the
    first pass's: a pass's cost is not the values'; windowed layers keeping what a session's keep
    with the rollback ``margin``), where the context has room for it (else the rate is 0). The
    context rate is the difference of the two: while the second comes out no slower (another
    process slowed the first; services start side by side), the pair is timed again, up to
    PREFILL_PROBE_TRIES pairs, and the fastest time of each pass counts. The caches are dropped."""
    tokens = max(1, min(PREFILL_PROBE_TOKENS, loaded.max_context_len - 1))
    ids = torch.zeros(1, tokens, dtype=torch.long, device=loaded.device)  # a pass's cost is not the ids'
    copies = min(PREFILL_CONTEXT_PROBE_TOKENS, loaded.max_context_len - 1 - tokens) // tokens
    with torch.inference_mode():
        if not warmed:
            _timed_pass(loaded, ids[:, : min(tokens, 8)], new_cache(loaded.model.config))
        first = new_cache(loaded.model.config)
        short = _timed_pass(loaded, ids, first)
        if copies < 1:
            return PrefillRates(short * 1000 / tokens, 0.0)
        try:
            longer = copied(loaded, first, copies, margin)
            long = _timed_pass(loaded, ids, longer)
            for _ in range(PREFILL_PROBE_TRIES - 1):
                if long > short:
                    break
                short = min(short, _timed_pass(loaded, ids, new_cache(loaded.model.config)))
                long = min(long, _timed_pass(loaded, ids, copied(loaded, first, copies, margin)))
        except Exception as exc:  # a cache this copy does not fit: time limits go by the first rate
            log.warning("prefill_context_not_timed", error=repr(exc))
            return PrefillRates(short * 1000 / tokens, 0.0)
    if long <= short:
        log.warning("prefill_context_rate_not_measured", pairs_timed=PREFILL_PROBE_TRIES, short_s=short, long_s=long)
    per_1k = max(long - short, 0.0) * 1000 / tokens * 1000 / (copies * tokens)
    return PrefillRates(short * 1000 / tokens, per_1k)


def _timed_pass(loaded: LoadedModel, ids: torch.Tensor, cache: DynamicCache) -> float:
    """Seconds one forward pass of ``ids`` over ``cache`` takes (the device's work included)."""
    return timed(
        loaded,
        lambda: loaded.model(
            input_ids=ids, **logit_rows_argument(loaded.model, 1), **cache_argument(loaded.model, cache)
        ),
    )


def timed(loaded: LoadedModel, work: Callable[[], object]) -> float:
    """Seconds ``work`` takes on ``loaded``'s device, the device's queued work included (a GPU's
    passes return before they run)."""
    started = time.perf_counter()
    work()
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    return time.perf_counter() - started


def free_memory_bytes(device: torch.device) -> int:
    """Memory free now on ``device``: the GPU's free memory, else the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_token_budget(loaded: LoadedModel) -> int:
    """A cached-token budget that fills at most CACHE_MEMORY_SHARE of the memory free now."""
    return max(1, int(free_memory_bytes(loaded.device) * CACHE_MEMORY_SHARE) // kv_bytes_per_token(loaded))


def windowed_share(loaded: LoadedModel, margin: int | None) -> tuple[int, float]:
    """The positions a windowed layer keeps at most with ``margin``, and the share of a token's
    KV memory its model's windowed layers take (measured on a 2-token pass); 0 for a model
    without them or when they keep every position."""
    cache = new_cache(loaded.model.config, margin)
    limits = [layer.limit for layer in cache.layers if isinstance(layer, WindowedLayer)]
    if margin is None or not limits:
        return 0, 0.0
    sizes = [(isinstance(layer, WindowedLayer), layer_bytes(layer)) for layer in _two_token_cache(loaded, cache).layers]
    return max(limits), sum(size for windowed, size in sizes if windowed) / max(1, sum(size for _, size in sizes))
