"""Grouped-query attention without a copy of the keys per query head (``specdec.runtime.attention``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.runtime.attention import grouped_sdpa_forward
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from tests.tiny_models import FAMILIES, TinyModels, build_family, build_sliding

SEQ = [(7 * i + 3) % 250 for i in range(60)]


@contextmanager
def _counting_repeats() -> Iterator[list[int]]:
    """Counts, while open, the copies of key/value heads per query head that transformers'
    ``sdpa`` makes (``repeat_kv``)."""
    copies: list[int] = []
    original = sdpa_attention.repeat_kv

    def counting(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        copies.append(n_rep)
        return original(hidden, n_rep)

    sdpa_attention.repeat_kv = counting
    try:
        yield copies
    finally:
        sdpa_attention.repeat_kv = original


def _passes_over_a_cache(loaded: LoadedModel, first: int, second: int) -> tuple[list[torch.Tensor], list[int]]:
    """Two sessions of ``first`` and ``second`` prompt tokens, then a 5-token verify block on the
    first and a batched pass of both (4 and 2 tokens; passes over a cache, with a mask): their
    logits, and the key/value head copies those two passes made."""
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60)
    a, b = caches.sync("a", 0, 0), caches.sync("b", 0, 0)
    caches.extend(a, SEQ[:first], 1)
    caches.extend(b, SEQ[:second], 1)
    with _counting_repeats() as copies:
        block = caches.extend(a, SEQ[first : first + 5], 5)
        both = caches.extend_many([(a, SEQ[first + 5 : first + 9], 4), (b, SEQ[second : second + 2], 2)])
    return [block, *both], copies


def _same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(one, other) for one, other in zip(got, want, strict=True))


def test_passes_over_a_cache_read_the_grouped_heads_without_copying_them(tiny_models: TinyModels) -> None:
    """The tiny target has 4 query heads and 2 key/value heads: a verify block over a cache and a
    batched pass of two sessions (both with an attention mask) copied each layer's keys and values
    per query head before; the worker's model runs them without such a copy, with the same logits
    as transformers' own attention."""
    loaded = load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.model.config.num_key_value_heads < loaded.model.config.num_attention_heads
    ours, copied = _passes_over_a_cache(loaded, 30, 20)
    with _transformers_sdpa():
        theirs, _ = _passes_over_a_cache(loaded, 30, 20)
    assert copied == []
    assert _same_logits(ours, theirs)


@contextmanager
def _transformers_sdpa() -> Iterator[None]:
    """transformers' own ``sdpa`` attention while open."""
    ours = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface.register("sdpa", sdpa_attention_forward)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", ours)


def _mask(batch: int, rows: int, length: int, kind: str) -> torch.Tensor:
    """A mask of ``rows`` queries at the end of ``length`` positions: causal, the first row's
    first 5 positions padding, and with ``kind`` "window" only the last 8 positions of each row
    seen; bool or (``kind`` "float") additive."""
    seen = torch.ones(batch, 1, rows, length, dtype=torch.bool).tril(length - rows)
    seen[0, :, :, :5] = False
    if kind == "window":
        seen &= torch.ones(rows, length, dtype=torch.bool).triu(length - rows - 7)
    if kind == "float":
        return torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    return seen


@pytest.mark.parametrize(
    ("batch", "rows", "length", "heads", "kv_heads", "dim"),
    [(1, 5, 40, 12, 2, 16), (3, 4, 33, 4, 2, 8), (2, 17, 60, 14, 2, 8), (1, 2, 9, 8, 1, 32), (2, 3, 30, 6, 3, 24)],
)
@pytest.mark.parametrize("kind", ["bool", "float", "window"])
def test_grouped_attention_computes_what_transformers_sdpa_computes(
    batch: int, rows: int, length: int, heads: int, kv_heads: int, dim: int, kind: str
) -> None:
    torch.manual_seed(rows * length + heads)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    query = torch.randn(batch, heads, rows, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = _mask(batch, rows, length, kind)
    got, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (batch, rows, heads, dim)
    assert torch.equal(got, want)


SDPA_FAMILIES = [family for family in FAMILIES if family not in ("GptOssConfig", "BloomConfig")]  # eager only


@pytest.mark.parametrize("arch", [*SDPA_FAMILIES, "mistral", "gemma3", "llama4"])
def test_every_family_decodes_the_same_logits_with_grouped_attention(tmp_path: Path, arch: str) -> None:
    """A verify block after a prompt, and a batched pass of two sessions of different lengths,
    give bit-equal logits with and without the grouped path, on every family the workers load
    (windowed ones among them), and no family's passes copy key/value heads any more."""
    path = build_family(tmp_path / arch, arch) if arch in FAMILIES else build_sliding(tmp_path / arch, arch, seed=0)
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))

    ours, copied = _passes_over_a_cache(loaded, 24, 13)
    with _transformers_sdpa():
        theirs, _ = _passes_over_a_cache(loaded, 24, 13)
    assert copied == []
    assert _same_logits(ours, theirs)
