"""Grouped-query attention without a copy of the keys per query head, and over a long cache
without reading them once per query head (``specdec.runtime.attention``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.runtime import attention
from specdec.runtime.attention import LONG_KEYS, grouped_sdpa_forward
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from tests.tiny_models import FAMILIES, TinyModels, build_family, build_model, build_sliding

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


def _passes_over_a_cache(
    loaded: LoadedModel, prompt: list[int], second: int
) -> tuple[list[torch.Tensor], list[int], list[tuple[int, int]]]:
    """Two sessions, one of ``prompt`` and one of SEQ's first ``second`` tokens, then a decoding
    step and a 5-token verify block on the first and a batched pass of both (4 and 2 tokens; the
    block and the batched pass with a mask): their logits, the key/value head copies those passes
    made and their kernel calls' heads."""
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60)
    a, b = caches.sync("a", 0, 0), caches.sync("b", 0, 0)
    caches.extend(a, prompt, 1)
    caches.extend(b, SEQ[:second], 1)
    more = [(5 * i + 1) % 250 for i in range(10)]
    with _counting_repeats() as copies, _kernel_heads() as calls:
        step = caches.extend(a, more[:1], 1)
        block = caches.extend(a, more[1:6], 5)
        both = caches.extend_many([(a, more[6:10], 4), (b, SEQ[second : second + 2], 2)])
    return [step, block, *both], copies, calls


def _same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(one, other) for one, other in zip(got, want, strict=True))


def test_passes_over_a_cache_read_the_grouped_heads_without_copying_them(tiny_models: TinyModels) -> None:
    """The tiny target has 4 query heads and 2 key/value heads: a verify block over a cache and a
    batched pass of two sessions (both with an attention mask) copied each layer's keys and values
    per query head before; the worker's model runs them without such a copy, with the same logits
    as transformers' own attention."""
    loaded = load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.model.config.num_key_value_heads < loaded.model.config.num_attention_heads
    ours, copied, _ = _passes_over_a_cache(loaded, SEQ[:30], 20)
    with _transformers_sdpa():
        theirs, _, _ = _passes_over_a_cache(loaded, SEQ[:30], 20)
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

    ours, copied, _ = _passes_over_a_cache(loaded, SEQ[:24], 13)
    with _transformers_sdpa():
        theirs, _, _ = _passes_over_a_cache(loaded, SEQ[:24], 13)
    assert copied == []
    assert _same_logits(ours, theirs)


@contextmanager
def _kernel_heads() -> Iterator[list[tuple[int, int]]]:
    """Records, while open, the query and key/value heads of every ``scaled_dot_product_attention``
    call: equal where a key/value head's query heads were stacked as its rows."""
    calls: list[tuple[int, int]] = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def recording(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append((query.shape[1], key.shape[1]))
        return kernel(query, key, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recording):
        yield calls


@pytest.mark.parametrize(
    ("batch", "rows", "heads", "kv_heads", "dim", "kind"),
    [
        (1, 1, 12, 2, 16, "none"),  # a decoding step: no mask
        (1, 1, 14, 2, 8, "bool"),
        (1, 5, 12, 2, 16, "bool"),  # a verify block
        (3, 4, 4, 2, 8, "float"),  # a batched pass
        (2, 9, 14, 2, 8, "window"),  # a draft's guesses, a windowed layer
        (2, 3, 6, 3, 24, "per head"),
    ],
)
def test_a_short_pass_over_a_long_cache_reads_each_key_value_head_once(
    batch: int, rows: int, heads: int, kv_heads: int, dim: int, kind: str
) -> None:
    """Over LONG_KEYS keys or more, a pass of a few rows gives the kernel each key/value head's
    query heads stacked as rows of that head (one call, as many query heads as key/value heads:
    the keys read once, not once per query head), and computes what transformers' ``sdpa``
    computes, within float32 rounding; every mask kind, a mask per head, a row that sees nothing
    (zeros, as the kernel gives). Before, the kernel got every query head (12 against 2 here)."""
    torch.manual_seed(rows * heads + dim)
    length = LONG_KEYS + 37
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    query = torch.randn(batch, heads, rows, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = None if kind == "none" else _mask(batch, rows, length, "bool" if kind == "per head" else kind)
    if kind == "per head":  # each query head its own positions, and one row of one head sees none
        mask = mask.expand(-1, heads, -1, -1).clone()
        mask[:, 1, :, 100:] = False
        mask[-1, -1, -1, :] = False
    with _kernel_heads() as calls:
        got, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert calls == [(kv_heads, kv_heads)]
    assert got.shape == want.shape == (batch, rows, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if kind == "per head":
        assert not got[-1, -1, -1].any()


def test_a_long_prefill_chunk_and_a_short_cache_keep_their_kernels() -> None:
    """A pass of more stacked rows than PACKED_ROWS (a prefill chunk) and a pass over fewer than
    LONG_KEYS keys are not stacked: the first reads grouped heads in place, the second too, bit for
    bit as transformers' ``sdpa``."""
    module = SimpleNamespace(num_key_value_groups=6, is_causal=True)
    for rows, length in [(attention.PACKED_ROWS // 6 + 1, LONG_KEYS + 40), (5, LONG_KEYS - 1)]:
        query = torch.randn(1, 12, rows, 16)
        key, value = torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
        mask = _mask(1, rows, length, "bool")
        with _kernel_heads() as calls:
            got, _ = grouped_sdpa_forward(module, query, key, value, mask)
        assert calls == [(12, 2)]
        assert torch.equal(got, sdpa_attention_forward(module, query, key, value, mask)[0])


def test_decoding_over_a_long_cache_stacks_query_heads_with_transformers_logits(tmp_path: Path) -> None:
    """A Llama of 4 query and 2 key/value heads with a cache past LONG_KEYS: a decoding step, a
    verify block and a batched pass with a short session each give the kernel stacked heads
    (2 calls of 2 heads a layer and pass where the kernel got 4 query heads before), and the
    logits of transformers' own attention within float32 rounding, with the same argmax."""
    path = build_model(tmp_path / "long", seed=3, hidden=32, layers=2, vocab=259, init_range=0.2, context=4096)
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    prompt = [(11 * i + 5) % 250 for i in range(LONG_KEYS + 20)]
    ours, _, calls = _passes_over_a_cache(loaded, prompt, 40)
    with _transformers_sdpa():
        theirs, _, their_calls = _passes_over_a_cache(loaded, prompt, 40)
    assert calls == [(2, 2)] * 6 and [heads for heads, _ in their_calls] == [4] * 6
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", [*SDPA_FAMILIES, "mistral", "gemma3", "llama4"])
def test_every_family_stacks_query_heads_over_a_long_cache(tmp_path: Path, arch: str) -> None:
    """The stacked heads on every family the workers load (LONG_KEYS lowered to 16, so the tiny
    models' caches count as long): a verify block and a batched pass give transformers' logits
    within float32 rounding, and where a family groups its query heads the kernel saw them stacked."""
    path = build_family(tmp_path / arch, arch) if arch in FAMILIES else build_sliding(tmp_path / arch, arch, seed=0)
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    with mock.patch.object(attention, "LONG_KEYS", 16):
        ours, _, calls = _passes_over_a_cache(loaded, SEQ[:24], 13)
    with _transformers_sdpa():
        theirs, _, _ = _passes_over_a_cache(loaded, SEQ[:24], 13)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    config = loaded.model.config.get_text_config()
    if (getattr(config, "num_key_value_heads", None) or 0) < (getattr(config, "num_attention_heads", None) or 0):
        assert calls and all(query_heads == kv_heads for query_heads, kv_heads in calls)
