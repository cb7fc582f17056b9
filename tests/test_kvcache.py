"""Per-session KV caches: crop to the committed prefix, refuse a prefix they do not hold."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache

from draft_worker.engine import Block, DraftParams, Resync, translated_propose_job
from specdec.runtime import cachelayers, kvcache, startup
from specdec.runtime import tokens as tokens_module
from specdec.runtime.cachelayers import WindowedCopy, cache_argument
from specdec.runtime.kvcache import EarlierLogits, ResyncRequired, SessionCache, SessionCaches
from specdec.runtime.modeling import LoadedModel, LoadOptions, load_model
from specdec.runtime.sampling import Warp
from specdec.runtime.scheduler import Extend, split_step
from specdec.runtime.startup import kv_bytes_per_token
from specdec.runtime.tokens import PrefixHashes, common_prefix_len, prefix_hash
from specdec.runtime.vocab import VocabBridge
from specdec.v1 import common_pb2
from tests.helpers import run_steps
from tests.tiny_models import (
    FAMILIES,
    TinyModels,
    build_family,
    build_gemma3_with_vision,
    build_plain_forward,
    build_sliding,
    build_tokenizer,
)


@pytest.fixture(scope="module")
def loaded(tiny_models: TinyModels) -> LoadedModel:
    return load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float32"))


def full_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor([ids])).logits[0].float()


def test_extend_crop_and_reuse_match_a_full_forward(loaded: LoadedModel) -> None:
    caches = SessionCaches(loaded, max_sessions=4, idle_s=60)
    seq = [5, 9, 13, 200, 7, 7, 1, 40]
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, seq[:6], 1)
    entry = caches.sync("s", 4, prefix_hash(seq[:4]))  # roll back two tokens
    assert entry.tokens == seq[:4] and entry.cache.get_seq_length() == 4
    logits = caches.extend(entry, seq[4:], 4)
    torch.testing.assert_close(logits, full_logits(loaded, seq)[-4:], atol=1e-4, rtol=1e-4)
    assert caches.prefill_tokens_total == 10


def _earlier_rows(loaded: LoadedModel) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A 10-token sequence extended by its last 8 with 2 logit rows and the 6 before them as
    earlier rows: (the chunks handed over, the last rows, a plain forward pass's logits)."""
    seq = [5, 9, 13, 200, 7, 7, 1, 40, 3, 11]
    caches = SessionCaches(loaded, max_sessions=4, idle_s=60)
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, seq[:2], 1)
    chunks: list[torch.Tensor] = []
    last = caches.extend(entry, seq[2:], 2, EarlierLogits(6, chunks.append))
    assert entry.tokens == seq
    return chunks, last, full_logits(loaded, seq)


@pytest.mark.parametrize("arch", ["llama", "gemma2 (soft-capped logits)"])
def test_earlier_rows_come_a_chunk_at_a_time_as_the_model_scores_them(
    tmp_path: Path, tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """The rows before a pass's last logits (a prompt's, for its log-probabilities) come in chunks
    of LOGIT_CHUNK_ROWS, equal to the model's own logits of those positions: also for Gemma 2,
    whose forward pass soft-caps the output layer's logits (here at 0.05, so the cap shows)."""
    monkeypatch.setattr(kvcache, "LOGIT_CHUNK_ROWS", 4)
    gemma = arch.startswith("gemma2")
    path = build_sliding(tmp_path / "gemma2", "gemma2", seed=0) if gemma else tiny_models.target
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    if gemma:
        loaded.model.config.final_logit_softcapping = 0.05
    calls: list[int] = []
    apart = kvcache._output_layer
    monkeypatch.setattr(
        kvcache, "_output_layer", lambda model, states: calls.append(len(states)) or apart(model, states)
    )
    chunks, last, full = _earlier_rows(loaded)
    assert calls == [3, 4, 2]  # the first-use check's 3 rows, then the chunks from hidden states
    assert [c.shape[0] for c in chunks] == [4, 2]
    torch.testing.assert_close(torch.cat(chunks), full[-8:-2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, full[-2:], atol=1e-5, rtol=1e-5)
    if gemma:  # the cap is in play: without it these logits are larger
        loaded.model.config.final_logit_softcapping = None
        assert float(full.abs().max()) <= 0.05 < float(full_logits(loaded, [5, 9, 13, 200, 7, 7, 1, 40]).abs().max())


def test_earlier_rows_of_a_model_whose_output_layer_cannot_run_apart(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where logits computed from the decoder's hidden states differ from the model's own (the
    check on first use), the earlier rows come from the model's own pass, still in chunks."""
    monkeypatch.setattr(kvcache, "LOGIT_CHUNK_ROWS", 4)
    monkeypatch.setattr(kvcache, "_output_layer", lambda model, states: torch.zeros(states.shape[0], 259))
    chunks, last, full = _earlier_rows(loaded)
    assert [c.shape[0] for c in chunks] == [4, 2]
    torch.testing.assert_close(torch.cat(chunks), full[-8:-2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last, full[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("apart", [True, False], ids=["rows from hidden states", "rows from the model's pass"])
@pytest.mark.parametrize(
    ("chunk", "passes"), [(1, [1] * 6 + [2]), (3, [3, 3, 2]), (4, [4, 4]), (7, [6, 2]), (8, [8]), (0, [8])]
)
def test_a_step_run_in_chunks_gives_the_rows_of_one_pass(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, apart: bool, chunk: int, passes: list[int]
) -> None:
    """Chunked prefill: the passes ``split_step`` cuts a step into (the earlier rows falling into
    any of them, the last logits into the last, never cut) give the rows one pass gives, in order."""
    if not apart:  # the first-use check finds the output layer does not run apart
        monkeypatch.setattr(kvcache, "_output_layer", lambda model, states: torch.zeros(states.shape[0], 259))
    seq = [5, 9, 13, 200, 7, 7, 1, 40, 3, 11]
    caches = SessionCaches(loaded, max_sessions=4, idle_s=60)
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, seq[:2], 1)
    chunks: list[torch.Tensor] = []
    step: Extend | None = Extend(entry, seq[2:], 2, None, EarlierLogits(6, chunks.append))
    ran = []
    while step is not None:
        head, step = split_step(step, chunk)
        ran.append(len(head.token_ids))
        last = caches.extend(head.entry, head.token_ids, head.num_logits, head.earlier)
    assert entry.tokens == seq
    assert ran == passes
    full = full_logits(loaded, seq)
    torch.testing.assert_close(torch.cat(chunks), full[-8:-2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last, full[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gemma4"])
def test_start_up_times_a_prefill_and_what_its_context_adds(tmp_path: Path, tiny_models: TinyModels, arch: str) -> None:
    """The second timed pass runs over a cache of copied keys and values, also for models whose
    attention is windowed (without a margin their caches keep every position, whose keys the pass
    reads, masked or not) and for Gemma-4, whose last layers keep none (they read earlier layers');
    a context too short for it leaves the context rate at 0. The passes are real; their times are
    given (main read the clock: a tiny model's 2,048-token context adds less than a busy host's
    noise: in a CI run the fastest of four pairs was 43 ms over the longer cache, 50 ms over none,
    and the rate warning failed this test)."""
    path = tiny_models.target if arch == "llama" else build_sliding(tmp_path / arch, arch, seed=0)
    loaded = dataclasses.replace(
        load_model(str(path), LoadOptions(device="cpu", dtype="float32")), max_context_len=4096
    )
    real = startup._timed_pass
    held: list[list[int]] = []  # per pass: the positions each layer that keeps any holds before it

    def timed(loaded: LoadedModel, ids: torch.Tensor, cache: DynamicCache) -> float:
        held.append([layer.keys.shape[-2] for _, layer in cachelayers.keeping(cache)])
        real(loaded, ids, cache)
        return {0: 0.001, 1: 0.010}.get(len(held) - 1, 0.012)  # warm-up, empty cache, longer cache

    with mock.patch.object(startup, "_timed_pass", timed), mock.patch.object(startup.log, "warning") as warning:
        rates = startup.prefill_rates(loaded)
    warning.assert_not_called()  # neither a copy that failed nor a rate not measured
    tokens, copies = startup.PREFILL_PROBE_TOKENS, startup.PREFILL_CONTEXT_PROBE_TOKENS // startup.PREFILL_PROBE_TOKENS
    assert [len(layers) > 0 for layers in held] == [False, False, True]
    assert set(held[2]) == {copies * tokens}  # every keeping layer, windowed ones too
    if arch == "gemma4":
        assert len(held[2]) < loaded.model.config.get_text_config().num_hidden_layers
    assert rates.per_token_ms == pytest.approx(0.010 * 1000 / tokens)
    assert rates.per_1k_context_ms == pytest.approx(0.002 * 1000 / tokens * 1000 / (copies * tokens))
    short = startup.prefill_rates(dataclasses.replace(loaded, max_context_len=300))
    assert short.per_token_ms > 0 and short.per_1k_context_ms == 0


def test_a_context_rate_timed_under_contention_is_timed_again(loaded: LoadedModel) -> None:
    """The context rate is the difference of two passes' times; when another process slows the
    first pass (several services start at once on a host), the longer cache's pass can come out
    no slower and the rate 0, so a long prompt got only the time of a short one's tokens (main:
    0 here; a CI run's worker reported 0). Such a pair is timed again, and the fastest of each
    pass counts; a rate that never shows is 0, with a warning."""
    loaded = dataclasses.replace(loaded, max_context_len=4096)  # room for 8 copies of 256 tokens
    real = startup._timed_pass

    def timed(seconds: list[float]) -> mock.Mock:  # real passes, the times given
        times = iter(seconds)
        return mock.Mock(side_effect=lambda *args: (real(*args), next(times))[1])

    # the warm-up pass, then (short, long) pairs: the first short pass was slowed
    fake = timed([0.001, 0.010, 0.008, 0.005, 0.0075])
    with mock.patch.object(startup, "_timed_pass", fake), mock.patch.object(startup.log, "warning") as warning:
        rates = startup.prefill_rates(loaded)
    assert fake.call_count == 5
    warning.assert_not_called()
    assert rates.per_token_ms == pytest.approx(0.005 * 1000 / 256)
    assert rates.per_1k_context_ms == pytest.approx(0.0025 * 1000 / 256 * 1000 / (8 * 256))
    pairs = [0.004, 0.004] * startup.PREFILL_PROBE_TRIES  # no pass over the longer cache is slower
    fake = timed([0.001, *pairs])
    with mock.patch.object(startup, "_timed_pass", fake), mock.patch.object(startup.log, "warning") as warning:
        rates = startup.prefill_rates(loaded)
    assert fake.call_count == 1 + len(pairs)
    assert rates.per_1k_context_ms == 0
    assert warning.call_args.args[0] == "prefill_context_rate_not_measured"


def test_a_token_budget_frees_the_least_recently_used_caches(loaded: LoadedModel) -> None:
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, max_tokens=10)
    for session in "abc":
        caches.extend(caches.sync(session, 0, 0), [5, 6, 7, 8], 1)
    assert "a" not in caches and caches.cached_tokens == 8  # 12 tokens: the oldest went
    caches.get("b")  # used: "c" is now the least recently used
    caches.extend(caches.sync("d", 0, 0), [1] * 6, 1)
    assert sorted(caches._entries) == ["b", "d"] and caches.cached_tokens == 10
    caches.extend(caches.sync("e", 0, 0), list(range(20)), 1)  # longer than the budget: runs, alone
    assert list(caches._entries) == ["e"] and caches.evicted_for_tokens == 4
    with pytest.raises(ResyncRequired):  # a freed session's next step re-sends its tokens
        caches.sync("b", 4, prefix_hash([5, 6, 7, 8]))
    first, second = caches.sync("f", 0, 0), caches.sync("g", 0, 0)
    caches.extend_many([(first, [1] * 6, 1), (second, [2] * 6, 1)])  # one pass: neither goes
    assert sorted(caches._entries) == ["f", "g"] and caches.cached_tokens == 12


def test_a_pass_counts_only_the_caches_it_changes(loaded: LoadedModel) -> None:
    """With a token budget every pass checks the caches' count against it. The count was summed
    over every session's cache on each pass: with 2,000 idle sessions (an operator's
    ``--max-sessions`` in the thousands) each pass read all 2,000, 20 ms a pass at 20,000 (one-off
    timing). Now the count follows the caches as they change: a pass reads the caches it runs."""
    caches = SessionCaches(loaded, max_sessions=5_000, idle_s=600, max_tokens=1_000_000)
    caches._entries.update((str(i), SessionCache(tokens=[1, 2, 3], cache=DynamicCache())) for i in range(2_000))
    reads: Counter[int] = Counter()
    copies = SessionCache.copies

    def counted(entry: SessionCache) -> list[Any]:
        reads[id(entry)] += 1
        return copies.fget(entry)

    with mock.patch.object(SessionCache, "copies", property(counted)):
        first = caches.sync("s", 0, 0)
        caches.extend(first, [5, 6, 7], 1)
        caches.extend_many([(caches.sync("s", 3, prefix_hash([5, 6, 7])), [8], 1), (caches.sync("t", 0, 0), [9, 9], 1)])
    assert set(reads) <= {id(first), id(caches.get("t"))}, f"{len(reads)} caches read"
    assert caches.cached_tokens == 2_000 * 3 + 4 + 2


def test_cached_tokens_can_be_read_while_the_model_thread_changes_the_caches(loaded: LoadedModel) -> None:
    """The metrics server reads the cached-token gauge from its own thread while the model thread
    adds and frees caches: the read never fails with "mutated during iteration"."""
    caches = SessionCaches(loaded, max_sessions=50_000, idle_s=60)
    caches._entries.update((str(i), SessionCache(tokens=[1, 2, 3], cache=DynamicCache())) for i in range(20_000))
    stop = threading.Event()

    def churn() -> None:  # what sync and release do to the map, as fast as possible
        i = 0
        while not stop.is_set():
            caches._entries.pop(str(i), None)
            caches._entries[str(i)] = SessionCache(tokens=[1], cache=DynamicCache())
            i = (i + 1) % 20_000

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        readings = [caches.cached_tokens for _ in range(300)]
    finally:
        stop.set()
        thread.join()
    assert all(19_999 <= tokens <= 60_000 for tokens in readings)  # one entry may be between pop and insert


def test_resync_required_for_unknown_short_or_different_prefix(loaded: LoadedModel) -> None:
    caches = SessionCaches(loaded, max_sessions=4, idle_s=60)
    with pytest.raises(ResyncRequired):
        caches.sync("unknown", 3, prefix_hash([1, 2, 3]))
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, [1, 2, 3], 1)
    with pytest.raises(ResyncRequired):
        caches.sync("s", 4, prefix_hash([1, 2, 3, 4]))
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, [1, 2, 3], 1)
    with pytest.raises(ResyncRequired):
        caches.sync("s", 3, prefix_hash([1, 2, 4]))
    assert len(caches) == 0  # a mismatching cache is dropped


def test_a_prefix_cut_and_grown_again_differently_is_not_taken_for_the_old_one(loaded: LoadedModel) -> None:
    """The worker keeps the hash state of a session's tokens between calls (PrefixHashes): a cut
    must invalidate it, so a cache rolled back and regrown with other tokens never passes for the
    prefix it held before, and the new one does."""
    caches = SessionCaches(loaded, max_sessions=4, idle_s=60)
    old = [5, 9, 13, 200, 7, 7, 1, 40]
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, old, 1)
    assert caches.sync("s", 8, prefix_hash(old)).tokens == old  # the state now covers all 8
    entry = caches.sync("s", 4, prefix_hash(old[:4]))  # rolled back to 4
    new = [*old[:4], 3, 3, 3, 3]
    caches.extend(entry, new[4:], 1)
    assert caches.sync("s", 8, prefix_hash(new)).tokens == new
    with pytest.raises(ResyncRequired):
        caches.sync("s", 8, prefix_hash(old))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "cut", "read", "new list"]), st.integers(0, 40)), max_size=40))
def test_prefix_hashes_equal_the_hash_of_the_prefix(operations: list[tuple[str, int]]) -> None:
    """PrefixHashes (kept state, a checkpoint every few tokens) equals prefix_hash of the prefix
    asked for, whatever the appends, reported cuts, shorter reads and new lists before."""
    hashes, tokens = PrefixHashes(), [1]
    with mock.patch.object(tokens_module, "_CHECKPOINT_TOKENS", 4):  # checkpoints within these lengths
        _apply(hashes, tokens, operations)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30), st.booleans())
def test_common_prefix_len_is_the_first_difference(a: list[int], b: list[int], as_tuple: bool) -> None:
    """Compared a chunk at a time (chunks of 4 here, so that these lengths span several), whatever
    the sequence types: the index of the first difference, else the shorter length."""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    with mock.patch.object(tokens_module, "_COMPARE_CHUNK", 4):
        assert common_prefix_len(a, tuple(b) if as_tuple else b) == first


def _apply(hashes: PrefixHashes, tokens: list[int], operations: list[tuple[str, int]]) -> None:
    for operation, n in operations:
        if operation == "append":
            tokens.extend(range(n * 7, n * 8))
        elif operation == "cut":
            del tokens[min(n, len(tokens)) :]
            hashes.cut(min(n, len(tokens)))
        elif operation == "new list":
            tokens = [*tokens, n]
        length = min(n, len(tokens))
        assert hashes.of(tokens, length) == prefix_hash(tokens[:length])


def test_least_recently_used_and_idle_sessions_are_evicted(loaded: LoadedModel) -> None:
    caches = SessionCaches(loaded, max_sessions=2, idle_s=60)
    for sid in ("a", "b", "c"):
        caches.extend(caches.sync(sid, 0, 0), [1, 2], 1)
    assert len(caches) == 2
    with pytest.raises(ResyncRequired):
        caches.sync("a", 2, prefix_hash([1, 2]))
    idle = SessionCaches(loaded, max_sessions=2, idle_s=0.0)
    idle.extend(idle.sync("x", 0, 0), [1], 1)
    idle.evict_idle()
    assert len(idle) == 0
    assert caches.release("b") and not caches.release("b")


def test_batched_extend_matches_separate_extends(loaded: LoadedModel) -> None:
    """Sessions of different past and new lengths (one with nothing cached) in one forward pass give
    the logits and caches that separate passes give."""
    plans = [([5, 9, 13, 200, 7], [7, 1, 40]), ([3], [9]), ([], [8, 8, 2, 100, 4, 6]), ([11, 12], [13, 14])]
    separate, batched = SessionCaches(loaded, 8, 60), SessionCaches(loaded, 8, 60)
    expected, ops = [], []
    for i, (past, new) in enumerate(plans):
        a, b = separate.sync(f"s{i}", 0, 0), batched.sync(f"s{i}", 0, 0)
        if past:
            separate.extend(a, past, 1)
            batched.extend(b, past, 1)
        expected.append(separate.extend(a, new, len(new)))
        ops.append((b, new, len(new)))
    got = batched.extend_many(ops)
    for i, (past, new) in enumerate(plans):
        torch.testing.assert_close(got[i], expected[i], atol=1e-4, rtol=1e-4)
        assert torch.equal(got[i].argmax(-1), expected[i].argmax(-1))
        entry = batched._entries[f"s{i}"]
        assert entry.tokens == [*past, *new] and entry.cache.get_seq_length() == len(past) + len(new)
    # the caches carry on correctly: one more token for every session, batched again
    more = batched.extend_many([(batched._entries[f"s{i}"], [42], 1) for i in range(len(plans))])
    for i, (past, new) in enumerate(plans):
        full = full_logits(loaded, [*past, *new, 42])[-1]
        torch.testing.assert_close(more[i][0], full, atol=1e-4, rtol=1e-4)


class _PositionsConcatenated(TorchFunctionMode):
    """Counts the positions of keys and values that ``torch.cat`` and ``F.pad`` write along the
    positions' dimension of [batch, heads, positions, head size] tensors (a cache growing or
    padded; rotary embeddings' concatenations along the head size are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        along_positions = (func is torch.cat and dim in (2, -2)) or (
            func is torch.nn.functional.pad and len(args[1]) >= 4 and any(args[1][2:4])
        )
        if along_positions and isinstance(out, torch.Tensor) and out.dim() == 4:
            self.positions += out.shape[0] * out.shape[2]
        return out


def test_a_batched_pass_reads_each_sessions_cache_from_one_copy(loaded: LoadedModel) -> None:
    """A batched pass copies each session's keys and values once, into memory with room for the
    pass's new ones (left-padded to the longest), and the pass writes its new keys and values into
    that room; each session's cache then takes its new positions into the room after its own
    (``RoomLayer``). Nothing is concatenated: before, the sessions' caches were padded,
    concatenated into the batch, concatenated again by the pass, and each session's own cache
    concatenated with its new positions (here 505 positions of each layer's keys and values
    written so; a batched pass of 4 sessions of 2,000 tokens of the 1.5B target spent 73-149 ms
    of 745-790 in such copies)."""
    caches = SessionCaches(loaded, 8, 60)
    plans = [(SEQ[:50], [7, 1, 40]), (SEQ[:30], [9]), (SEQ[:10], [8, 2])]
    ops = []
    for name, (past, new) in zip("abc", plans, strict=True):
        entry = caches.sync(name, 0, 0)
        caches.extend(entry, past, 1)
        ops.append((entry, new, len(new)))
    with _PositionsConcatenated() as counted:
        got = caches.extend_many(ops)
    assert counted.positions == 0
    for (past, new), logits in zip(plans, got, strict=True):
        torch.testing.assert_close(logits, full_logits(loaded, [*past, *new])[-len(new) :], atol=1e-4, rtol=1e-4)


def test_a_sessions_cache_grows_in_the_room_after_it(loaded: LoadedModel) -> None:
    """A session's whole-attention layers keep room after their keys and values: after a prompt of
    1,000 tokens, 40 rounds of a verify block of 5 tokens, 3 of them cut back, then a decoding
    step, write into it, and the layers move to new memory (a sixteenth more than they hold) only
    as they fill it, at most 3 times here where every one of the 80 passes made a new copy of the
    whole cache before; they hold at most an eighth more than their positions, and the passes give
    a full pass's logits."""
    caches = SessionCaches(loaded, 8, 60)
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, [(13 * i + 7) % 250 for i in range(1000)], 1)
    layer = entry.cache.layers[0]
    places = {layer.keys.data_ptr()}
    for round_ in range(40):
        logits = caches.extend(entry, [(round_ * 5 + j) % 250 for j in range(5)], 5)
        if round_ % 10 == 0:
            torch.testing.assert_close(logits, full_logits(loaded, entry.tokens)[-5:], atol=1e-4, rtol=1e-4)
        places.add(layer.keys.data_ptr())
        entry.truncate(len(entry.tokens) - 3)
        caches.extend(entry, [round_ + 3], 1)
        places.add(layer.keys.data_ptr())
        positions = layer.keys.shape[2]
        per_position = layer.keys[0, :, :1].numel() * layer.keys.element_size()
        assert positions <= layer.keys.untyped_storage().nbytes() // per_position <= positions * 9 // 8
    expected = full_logits(loaded, [*entry.tokens, 9])[-1]
    torch.testing.assert_close(caches.extend(entry, [9], 1)[0], expected, atol=1e-4, rtol=1e-4)
    assert len(places) <= 4


def test_a_copy_of_a_cache_layer_and_the_layer_never_write_into_what_the_other_sees() -> None:
    """Prefix reuse copies a cache's layers (``copy.copy``) before it cuts them back: the copy and
    the layer see the same memory until one of them grows. Cut back and grown, each in its
    own way, neither changes what the other holds (the room after a layer's keys is its own, not
    its copy's too)."""
    layer = cachelayers.RoomLayer()
    layer.update(torch.arange(32.0).view(1, 2, 8, 2), -torch.arange(32.0).view(1, 2, 8, 2))
    layer.update(torch.full((1, 2, 1, 2), 100.0), torch.full((1, 2, 1, 2), -100.0))
    twin = copy.copy(layer)
    before = layer.keys.clone(), layer.values.clone()
    twin.crop(-4)
    twin.update(torch.full((1, 2, 3, 2), 7.0), torch.full((1, 2, 3, 2), -7.0))
    assert torch.equal(layer.keys, before[0]) and torch.equal(layer.values, before[1])
    seen = twin.keys.clone()
    layer.crop(-2)
    layer.update(torch.full((1, 2, 2, 2), 5.0), torch.full((1, 2, 2, 2), -5.0))
    assert torch.equal(twin.keys, seen)
    assert torch.equal(layer.keys[:, :, :7], before[0][:, :, :7]) and bool((layer.keys[:, :, 7:] == 5.0).all())


def _positions_held(layers: Iterable[Any]) -> set[tuple[int, bool]]:
    """For each layer's keys and values: the positions they see, and whether their memory holds
    those only (a view holds all of the memory it was cut from)."""
    return {
        (held.shape[-2], held.untyped_storage().nbytes() == held.numel() * held.element_size())
        for layer in layers
        for held in (layer.keys, layer.values)
    }


def test_a_session_starts_from_a_copy_of_another_sessions_prefix(loaded: LoadedModel) -> None:
    """Prefix reuse: the copy holds the donor's first tokens (checked by hash), and the memory of
    those only (it copied all of the donor's, 8 positions for 5 here, 30,000 for a system prompt's
    500 beside a long conversation), continues to the same logits as a full forward pass, and
    leaves the donor untouched."""
    caches = SessionCaches(loaded, max_sessions=4, idle_s=60)
    donor_seq, seq = [5, 9, 13, 200, 7, 7, 1, 40], [5, 9, 13, 200, 7, 88, 3]
    donor = caches.sync("donor", 0, 0)
    caches.extend(donor, donor_seq, 1)
    with pytest.raises(ResyncRequired):  # the donor does not hold this prefix
        caches.sync("new", 5, prefix_hash([5, 9, 13, 200, 8]), source="donor")
    entry = caches.sync("new", 5, prefix_hash(seq[:5]), source="donor")
    assert entry.tokens == seq[:5] and caches.reused_tokens_total == 5
    assert _positions_held(entry.cache.layers) == {(5, True)}
    logits = caches.extend(entry, seq[5:], 2)
    torch.testing.assert_close(logits, full_logits(loaded, seq)[-2:], atol=1e-4, rtol=1e-4)
    assert caches.sync("donor", 8, prefix_hash(donor_seq)).tokens == donor_seq
    assert caches.extend(caches.sync("donor", 8, prefix_hash(donor_seq)), [2], 1).shape[0] == 1


SEQ = torch.randint(3, 250, (60,), generator=torch.Generator().manual_seed(0)).tolist()


def _cut_back_copied_and_batched(loaded: LoadedModel, head_apart: bool = True) -> torch.Tensor:
    """Runs SEQ through session caches cut back 10 tokens at 40 (past a 16-position window),
    copied for another session's prefix and run in one batched pass with rows that differ in
    length before the pass and in it, and scores a prompt's earlier rows (``head_apart``: with the
    output layer run apart from the decoder, a chunk at a time; else from the pass's own logits:
    Gemma-4's decoder keeps only the states of the rows whose logits a pass keeps); asserts each
    gives a full pass's logits and returns the full pass's logits of SEQ's first 55 tokens."""
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60)
    caches.extend(caches.sync("s", 0, 0), SEQ[:40], 1)
    entry = caches.sync("s", 30, prefix_hash(SEQ[:30]))
    assert entry.cache.get_seq_length() == 30
    logits = caches.extend(entry, SEQ[30:50], 20)
    full = full_logits(loaded, SEQ[:55])
    torch.testing.assert_close(logits, full[30:50], atol=1e-4, rtol=1e-4)
    copied = caches.sync("t", 22, prefix_hash(SEQ[:22]), source="s")
    caches.extend(copied, [7, 7], 1)
    both = caches.extend_many([(caches.sync("s", 50, prefix_hash(SEQ[:50])), SEQ[50:55], 5), (copied, [9], 1)])
    torch.testing.assert_close(both[0], full[50:55], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[1], full_logits(loaded, [*SEQ[:22], 7, 7, 9])[-1:], atol=1e-4, rtol=1e-4)
    assert copied.tokens == [*SEQ[:22], 7, 7, 9]
    rows: list[torch.Tensor] = []  # a prompt's earlier rows, from the decoder's hidden states a chunk at a time
    caches.extend(caches.sync("p", 0, 0), SEQ[:20], 1, EarlierLogits(10, rows.append))
    assert caches._output_layer_runs_apart() == head_apart
    torch.testing.assert_close(torch.cat(rows), full[9:19], atol=1e-4, rtol=1e-4)
    return full


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "phi3", "llama4", "gemma4"])
def test_a_windowed_models_caches_are_cut_back_copied_and_batched_past_its_window(tmp_path: Path, arch: str) -> None:
    """A model whose attention is windowed (16 positions here, or Llama-4's chunks of 16; 256 in
    its context) is loaded with its whole context, and its session caches keep every position:
    cut back past the window, copied for another session's prefix and run in one batched pass,
    they give the logits of a full forward pass, in which the window is applied (the same weights
    without it differ from position 16 on)."""
    path = build_sliding(tmp_path / arch, arch, seed=0)
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.max_context_len == 256
    full = _cut_back_copied_and_batched(loaded, head_apart=arch != "gemma4")
    for window in ("sliding_window", "attention_chunk_size"):  # the masks read them on every pass
        if getattr(loaded.model.config, window, None):
            setattr(loaded.model.config, window, 1000)
    unwindowed = full_logits(loaded, SEQ[:55])
    torch.testing.assert_close(unwindowed[:16], full[:16])
    assert float((unwindowed[16:] - full[16:]).abs().amax(-1).min()) > 1e-3


def _windowed_positions(entry: SessionCache) -> list[int]:
    """The positions each windowed layer of ``entry``'s cache keeps."""
    return [layer.keys.shape[2] for layer in entry.cache.layers if getattr(layer, "is_sliding", False)]


SLIDING = ["mistral", "gemma2", "gemma3", "phi3", "llama4", "gemma4"]  # build_sliding's architectures
WINDOWED_FAMILIES = ["Starcoder2Config", "GptOssConfig", "Cohere2Config", "Exaone4Config", "Gemma3nTextConfig"]


WINDOWED = [*SLIDING, *WINDOWED_FAMILIES, "gemma3-with-vision"]


def _windowed_model(tmp_path: Path, arch: str) -> LoadedModel:
    """A tiny model of one of WINDOWED's architectures, loaded."""
    if arch in SLIDING:
        path = build_sliding(tmp_path / arch, arch, seed=0)
    elif arch in WINDOWED_FAMILIES:
        path = build_family(tmp_path / arch, arch)
    else:
        path = build_gemma3_with_vision(tmp_path / arch)
    return load_model(str(path), LoadOptions(device="cpu", dtype="float32"))


@pytest.mark.parametrize("arch", WINDOWED)
def test_a_windowed_layer_keeps_its_window_and_a_margin_to_cut_back(tmp_path: Path, arch: str) -> None:
    """With a rollback margin (6 positions here), a windowed layer keeps only what its next queries
    can see (the window's 15 positions before them) and the margin: at most 21 positions however
    long the session, through a decode past the window that cuts back up to 6 tokens every round,
    each round's logits those of a full pass. A batched pass of rows whose windowed layers keep
    different numbers of positions gives every row's full-pass logits too. A cut deeper than the
    margin (a turn rolled back, a prefix of another session far behind its end) is a resync, and
    the budget counts a windowed layer's memory only for the positions it can keep."""
    loaded = _windowed_model(tmp_path, arch)
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, margin=6)
    rng = torch.Generator().manual_seed(1)
    entry, kept = caches.sync("s", 0, 0), list(SEQ[:4])
    caches.extend(entry, kept, 1)
    while len(kept) < 55:  # a block of 1-6 tokens, of which the first 0-6 stay (the rest is cut back)
        block = torch.randint(3, 250, (int(torch.randint(1, 7, (1,), generator=rng)),), generator=rng).tolist()
        logits = caches.extend(entry, block, len(block))
        torch.testing.assert_close(logits, full_logits(loaded, [*kept, *block])[-len(block) :], atol=1e-4, rtol=1e-4)
        assert max(_windowed_positions(entry)) <= 21
        kept += block[: int(torch.randint(0, len(block) + 1, (1,), generator=rng))]
        entry = caches.sync("s", len(kept), prefix_hash(kept))
    assert entry.cache.get_seq_length() == len(kept) and _windowed_positions(entry)
    assert min(_windowed_positions(entry)) >= 15  # the window before the next query, at least
    held = caches.cached_tokens
    # all layers windowed: 21; Gemma-4's whole layers' keys are 64 times wider (head dim 512 to 8),
    # so its windowed layers take 1.5% of a token's memory, under one token for this session
    windowed_only = all(getattr(layer, "is_sliding", False) for layer in entry.cache.layers if layer.keys is not None)
    assert held == 21 if windowed_only else (held < len(kept) or arch == "gemma4")
    short = caches.sync("t", 0, 0)
    caches.extend(short, SEQ[:5], 1)
    both = caches.extend_many([(entry, SEQ[50:53], 3), (short, [9, 8], 2)])
    torch.testing.assert_close(both[0], full_logits(loaded, [*kept, *SEQ[50:53]])[-3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[1], full_logits(loaded, [*SEQ[:5], 9, 8])[-2:], atol=1e-4, rtol=1e-4)
    kept += SEQ[50:53]
    caches.extend(caches.sync("s", len(kept), prefix_hash(kept)), SEQ[53:59], 1)  # 6 more: 21 kept
    assert _windowed_positions(entry) == [21] * len(_windowed_positions(entry))
    assert entry.reaches(len(kept)) and not entry.reaches(len(kept) - 1)  # 6 back is the margin, 7 beyond it
    entry = caches.sync("s", len(kept), prefix_hash(kept))  # its next query sees all 15 before it, the first kept
    torch.testing.assert_close(caches.extend(entry, [7], 1), full_logits(loaded, [*kept, 7])[-1:], atol=1e-4, rtol=1e-4)
    kept.append(7)
    with pytest.raises(ResyncRequired):  # another session's prefix 10 tokens behind that cache's end
        caches.sync("u", len(kept) - 10, prefix_hash(kept[:-10]), source="s")
    with pytest.raises(ResyncRequired):  # the session itself rolled back 10 tokens
        caches.sync("s", len(kept) - 10, prefix_hash(kept[:-10]))
    assert "s" not in caches and "u" not in caches
    copy = caches.sync("u", 5, prefix_hash(SEQ[:5]), source="t")  # a short cache keeps every position
    torch.testing.assert_close(caches.extend(copy, [7], 1), full_logits(loaded, [*SEQ[:5], 7])[-1:])


def test_a_windowed_models_budget_counts_what_its_caches_keep(tmp_path: Path) -> None:
    """Every layer windowed (Mistral), a rollback margin of 6: a cache of 40 tokens keeps 21
    positions and counts 21 against a 70-token budget, and holds the memory of those 21 only (it
    held all 40 after its one pass of them: the kept keys were a view of the pass's). Three fit; a
    batched pass that starts two more frees the two least recently used (before: freeing one was
    counted as 40 and left the caches at 84)."""
    loaded = load_model(
        str(build_sliding(tmp_path / "m", "mistral", seed=0)), LoadOptions(device="cpu", dtype="float32")
    )
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, max_tokens=70, margin=6)
    for name in ("a", "b", "c"):
        entry = caches.sync(name, 0, 0)
        caches.extend(entry, SEQ[:40], 1)
        assert _positions_held(entry.cache.layers) == {(21, True)}
    assert caches.cached_tokens == 63 and caches.evicted_for_tokens == 0
    caches.extend_many([(caches.sync(name, 0, 0), SEQ[:30], 1) for name in ("d", "e")])
    assert [name for name in "abcde" if name in caches] == ["c", "d", "e"] and caches.cached_tokens == 63


@pytest.mark.parametrize("arch", SLIDING)
def test_a_windowed_models_context_rate_is_timed_over_the_positions_its_sessions_keep(
    tmp_path: Path, arch: str
) -> None:
    """With a rollback margin (6 here, a 16-position window), the context pass's windowed layers
    hold what a session's keep after 2,048 tokens, 21 positions, not all 2,048 (which overstated
    what a long prompt costs a windowed model); the whole layers hold every position."""
    path = build_sliding(tmp_path / arch, arch, seed=0)
    loaded = dataclasses.replace(
        load_model(str(path), LoadOptions(device="cpu", dtype="float32")), max_context_len=4096
    )
    real, held = startup._timed_pass, []

    def recording(loaded: LoadedModel, ids: torch.Tensor, cache: DynamicCache) -> float:
        held.append(sorted({(layer.is_sliding, layer.keys.shape[2]) for _, layer in cachelayers.keeping(cache)}))
        return real(loaded, ids, cache)

    with mock.patch.object(startup, "_timed_pass", recording), mock.patch.object(startup.log, "warning") as warning:
        rates = startup.prefill_rates(loaded, margin=6)
    assert rates.per_token_ms > 0 and not any(
        call.args[0] == "prefill_context_not_timed" for call in warning.mock_calls
    )
    assert held[1] == []  # an empty cache, then the longer one
    assert (True, 21) in held[2] and all(positions == 2048 for sliding, positions in held[2] if not sliding)


def _storage(end: WindowedCopy | None, layer: int) -> int:
    """Where the keys of one layer of a copy of windowed layers are held."""
    assert end is not None
    return end.layers[layer].keys.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", WINDOWED)
def test_a_windowed_sessions_prompt_end_stays_reachable(tmp_path: Path, arch: str) -> None:
    """A session told where its prompt ends (30 tokens) keeps a copy of its windowed layers there
    once its first pass has run it (and a block after it: 33 tokens, the last 23 kept with a margin
    of 8); decoded 18 tokens further, past its margin, the cache still serves, each with a full
    pass's logits: another session of the same prompt from a copy cut back 4 tokens before its end
    (a regenerated reply, prefix reuse), and the session itself cut back to its prompt (its reply
    replaced). The copy reaches as far back as its margin does, and counts in the budget; another
    completion of the prompt (a copy of all of it but its last token) shares it, copying none. Once
    the session's own tokens after a cut differ, the copy does not serve them: a prefix that ends
    after the cut is a resync (keys of the replaced tokens would give other logits)."""
    loaded = _windowed_model(tmp_path, arch)
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, margin=8)
    prompt, drafts = SEQ[:30], [7, 8, 9]
    entry = caches.sync("a", 0, 0, prompt_len=30)
    caches.extend(entry, [*prompt, *drafts], 4)  # the first verify pass: the prompt and a block
    entry = caches.sync("a", 32, prefix_hash([*prompt, 7, 8]), prompt_len=30)  # two drafts taken
    kept = [*prompt, 7, 8]
    for start in range(32, 60, 5):  # decoding on, each block of 5 cut back 2
        block = SEQ[start : start + 5]
        caches.extend(entry, block, 1)
        kept += block[:3]
        entry = caches.sync("a", len(kept), prefix_hash(kept), prompt_len=30)
    # the copy's first position is 10: a query at 25 sees 10 to 24, one at 24 needs 9
    assert entry.reaches(25) and not entry.reaches(24)
    windowed_only = all(getattr(layer, "is_sliding", False) for layer in entry.cache.layers if layer.keys is not None)
    if windowed_only:  # 23 kept positions (the window's 15 and the margin), and the copy's 23 (taken at 33)
        assert caches.cached_tokens == 46
    again = caches.sync("b", 26, prefix_hash(prompt[:26]), source="a", prompt_len=30)
    logits = caches.extend(again, [*prompt[26:], 5, 6], 3)
    torch.testing.assert_close(logits, full_logits(loaded, [*prompt, 5, 6])[-3:], atol=1e-4, rtol=1e-4)
    assert caches.reused_tokens_total == 26
    entry = caches.sync("a", 30, prefix_hash(prompt), prompt_len=30)  # the reply replaced
    logits = caches.extend(entry, [9, 9, 4], 3)
    torch.testing.assert_close(logits, full_logits(loaded, [*prompt, 9, 9, 4])[-3:], atol=1e-4, rtol=1e-4)
    for token in SEQ[40:55]:  # on past the margin again
        caches.extend(entry, [token], 1)
    other = caches.sync("d", 29, prefix_hash(prompt[:29]), source="a", prompt_len=30)  # another completion
    logits = caches.extend(other, [prompt[29], 3], 2)
    torch.testing.assert_close(logits, full_logits(loaded, [*prompt, 3])[-2:], atol=1e-4, rtol=1e-4)
    assert other.prompt_end is not None and other.prompt_end.length == 29  # the session's copy, not another
    assert all(_storage(other.prompt_end, i) == _storage(entry.prompt_end, i) for i in other.prompt_end.layers)
    with pytest.raises(ResyncRequired):  # 32 tokens: the copy holds keys of 7, 8 after the prompt, not 9, 9
        caches.sync("c", 32, prefix_hash([*prompt, 9, 9]), source="a", prompt_len=32)
    reused = caches.sync("c", 30, prefix_hash(prompt), source="a", prompt_len=32)
    logits = caches.extend(reused, [9, 9, 1], 1)
    torch.testing.assert_close(logits, full_logits(loaded, [*prompt, 9, 9, 1])[-1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", SLIDING)
def test_a_cut_past_the_margin_after_the_prompt_starts_again_from_its_copy(tmp_path: Path, arch: str) -> None:
    """A cut behind a windowed layer's margin to a length after the prompt's end (a replaced chat
    reply whose first tokens stay; another session's prompt that repeats part of a reply, found in
    whole blocks) cannot start from the cache, but can from its copy at the prompt's end: the
    resync says so (``start``, the copy's length: the caller sends the tokens from there), the
    session's own cache is kept for it, and starting there gives a full pass's logits. The copy
    never answers for tokens it does not hold (another prefix, one shorter than it reaches)."""
    loaded = _windowed_model(tmp_path, arch)
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, margin=8)
    prompt = SEQ[:30]
    entry = caches.sync("a", 0, 0, prompt_len=30)
    caches.extend(entry, [*prompt, 7, 8, 9], 4)  # the first verify pass: the prompt and a block
    kept = [*prompt, 7, 8]
    entry = caches.sync("a", 32, prefix_hash(kept), prompt_len=30)  # two drafts taken: a copy of 32
    for start in range(32, 60, 5):  # decoding on past the margin, each block of 5 cut back 2
        caches.extend(entry, SEQ[start : start + 5], 1)
        kept += SEQ[start : start + 3]
        entry = caches.sync("a", len(kept), prefix_hash(kept), prompt_len=30)
    assert len(kept) == 50 and not entry.reaches(40)
    with pytest.raises(ResyncRequired) as resync:  # a prompt repeating 8 tokens of a's reply
        caches.sync("b", 40, prefix_hash(kept[:40]), source="a", prompt_len=44)
    assert resync.value.start == 32 and "b" not in caches
    other = caches.sync("b", 32, prefix_hash(kept[:32]), source="a", prompt_len=44)
    logits = caches.extend(other, [*kept[32:40], 4, 5, 6, 7], 3)
    torch.testing.assert_close(logits, full_logits(loaded, [*kept[:40], 4, 5, 6, 7])[-3:], atol=1e-4, rtol=1e-4)
    assert caches.reused_tokens_total == 32
    for length, tokens in ((40, [*kept[:39], 1]), (10, kept[:10])):  # other tokens; before the copy's reach
        with pytest.raises(ResyncRequired) as resync:
            caches.sync("c", length, prefix_hash(tokens), source="a")
        assert resync.value.start == 0
    with pytest.raises(ResyncRequired) as resync:  # a's reply replaced after its first 10 tokens
        caches.sync("a", 40, prefix_hash(kept[:40]), prompt_len=30)
    assert resync.value.start == 32 and "a" in caches
    entry = caches.sync("a", 32, prefix_hash(kept[:32]), prompt_len=30)
    logits = caches.extend(entry, [*kept[32:40], 9, 9], 2)
    torch.testing.assert_close(logits, full_logits(loaded, [*kept[:40], 9, 9])[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", SLIDING)
def test_where_a_prefix_other_requests_share_ends_a_copy_of_the_windowed_layers_is_kept(
    tmp_path: Path, arch: str
) -> None:
    """A prefix that other requests share (a system prompt, a document), followed by more of the
    prompt than the margin (8 here): the second request finds it in the first one's cache, which
    can no longer be cut back to it (a resync from 0). Told where it ends (``shared_len``), that
    request's pass stops there and its cache keeps a copy of the windowed layers there, beside the
    one at its prompt's end; a third request starts from it (full-pass logits, the copy shared, not
    taken again), as does a prefix that ends between the two copies; the budget counts both. Its
    tokens replaced from before the copy, the copy is cut back with them (then taken again)."""
    loaded = _windowed_model(tmp_path, arch)
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, margin=8)
    shared, second = SEQ[:24], SEQ[30:56]
    caches.extend(caches.sync("a", 0, 0, prompt_len=50), [*shared, *SEQ[24:50]], 1)
    with pytest.raises(ResyncRequired) as resync:  # 26 tokens behind a's end, before its prompt's end
        caches.sync("b", 24, prefix_hash(shared), source="a", prompt_len=50, shared_len=24)
    assert resync.value.start == 0
    b = caches.sync("b", 0, 0, prompt_len=50, shared_len=24)
    logits = caches.extend(b, [*shared, *second], 2)
    torch.testing.assert_close(logits, full_logits(loaded, [*shared, *second])[-2:], atol=1e-4, rtol=1e-4)
    assert b.shared is not None and b.shared.length == 24 and b.prompt_end is not None
    for token in SEQ[:20]:  # decoding on, past the margin
        caches.extend(b, [token], 1)
    windowed_only = all(getattr(layer, "is_sliding", False) for layer in b.cache.layers if layer.keys is not None)
    if windowed_only:  # 23 positions kept (the window's 15 and the margin), and as many in each copy
        assert caches.cached_tokens == 2 * 23 + 3 * 23  # a's cache and copy at its prompt's end; b's and both
    c = caches.sync("c", 24, prefix_hash(shared), source="b", prompt_len=40, shared_len=24)
    logits = caches.extend(c, SEQ[40:56], 3)
    torch.testing.assert_close(logits, full_logits(loaded, [*shared, *SEQ[40:56]])[-3:], atol=1e-4, rtol=1e-4)
    assert caches.reused_tokens_total == 24 and c.shared is b.shared
    with pytest.raises(ResyncRequired) as resync:  # 30 tokens: after the shared copy, before the prompt's end
        caches.sync("d", 30, prefix_hash([*shared, *second][:30]), source="b")
    assert resync.value.start == 24
    b = caches.sync("b", 20, prefix_hash(shared[:20]))  # b's tokens replaced from 20 (the shared copy reaches it)
    caches.extend(b, [9] * 30, 1)  # past the margin: a copy at 24 again, of the new tokens
    replaced = [*shared[:20], *[9] * 30]
    e = caches.sync("e", 24, prefix_hash(replaced[:24]), source="b")
    torch.testing.assert_close(caches.extend(e, [5, 6], 2), full_logits(loaded, [*replaced[:24], 5, 6])[-2:])


@contextlib.contextmanager
def _passes(loaded: LoadedModel) -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the token ids of each forward pass run meanwhile."""
    shapes: list[tuple[int, ...]] = []
    hook = loaded.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        yield shapes
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_copy_at_a_shared_prefix_is_taken_only_where_no_other_copy_reaches_it(tmp_path: Path, arch: str) -> None:
    """Margin 8. A shared prefix within half the margin before the prompt's end (27 of 30) takes no
    copy, nor a stop: the copy at the prompt's end reaches it, and a request sharing it starts
    there once the session has decoded past the margin. A pass stops at a shared prefix only where
    it would run past the margin after it: a session's pass alone that ends within the margin (24
    of a 30-token pass) keeps a copy cut back to it from the one pass (it used to stop there: a
    pass more, a decoding step's cost for a short one); in a batched pass (``extend_many``)
    likewise, holding only that copy's memory, and a row that ends past it (10 of 40) runs its
    first 10 tokens in a pass before the batched one and keeps a copy there, which a request
    sharing that prefix starts from. (A batched pass stopped
    for none: at 16 requests at once, each a 24-token prompt and a block of 4 drafts past a
    16-position window and a margin of 10, 278 of 300 requests for the same prompt found none of
    it cached; one at a time, 2 of 60.)"""
    loaded = _windowed_model(tmp_path, arch)
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, margin=8)
    a = caches.sync("a", 0, 0, prompt_len=30, shared_len=27)
    caches.extend(a, SEQ[:30], 1)
    assert a.shared_len == 0 and a.shared is None and a.prompt_end is not None and a.prompt_end.length == 30
    assert caches.prefill_tokens_total == 30  # one pass, not stopped at 27
    g = caches.sync("g", 0, 0, prompt_len=40, shared_len=24)
    with _passes(loaded) as passes:
        caches.extend(g, SEQ[:30], 1)
    assert passes == [(1, 30)] and g.shared is not None and g.shared.length == 24
    c = caches.sync("c", 0, 0, prompt_len=40, shared_len=24)
    d = caches.sync("d", 0, 0, prompt_len=40, shared_len=10)
    with _passes(loaded) as passes:
        logits = caches.extend_many([(c, SEQ[:30], 1), (d, SEQ[:40], 1)])
    assert passes == [(1, 10), (2, 30)]  # d's shared prefix alone, then both rows
    torch.testing.assert_close(logits[0], full_logits(loaded, SEQ[:30])[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], full_logits(loaded, SEQ[:40])[-1:], atol=1e-4, rtol=1e-4)
    assert c.shared is not None and c.shared.length == 24 and c.prompt_end is None
    assert d.shared is not None and d.shared.length == 10 and d.prompt_end is not None and d.prompt_end.length == 40
    # only what it keeps: not the 6 positions after it as well
    assert all(only for _, only in _positions_held(c.shared.layers.values()))
    caches.extend(c, SEQ[30:40], 1)
    assert c.shared is not None and c.prompt_end is not None and c.prompt_end.length == 40
    for token in SEQ[40:60]:  # each session decoding on, past the margin
        for entry in (a, c, d):
            caches.extend(entry, [token], 1)
    b = caches.sync("b", 27, prefix_hash(SEQ[:27]), source="a")
    torch.testing.assert_close(
        caches.extend(b, [7, 8], 2), full_logits(loaded, [*SEQ[:27], 7, 8])[-2:], atol=1e-4, rtol=1e-4
    )
    e = caches.sync("e", 24, prefix_hash(SEQ[:24]), source="c")
    torch.testing.assert_close(
        caches.extend(e, [7, 8], 2), full_logits(loaded, [*SEQ[:24], 7, 8])[-2:], atol=1e-4, rtol=1e-4
    )
    f = caches.sync("f", 10, prefix_hash(SEQ[:10]), source="d")
    torch.testing.assert_close(
        caches.extend(f, [7, 8], 2), full_logits(loaded, [*SEQ[:10], 7, 8])[-2:], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("budget", [170, 140])
def test_a_copy_that_several_caches_share_is_counted_once(tmp_path: Path, budget: int) -> None:
    """Every layer windowed (Mistral), margin 8 (23 positions a layer keeps): a request that starts
    from another session's copy at a shared prefix shares that copy, as do all the requests after it
    that share the prefix (a system prompt). The budget counted it once for each holder: three
    caches holding 161 positions counted 184, and a budget of 170 freed the oldest one's copy; one
    of 140 freed the next one's copies too. Counted once, the first frees nothing and the second
    only the oldest one's copy (its cache's own, no other holds it)."""
    loaded = load_model(
        str(build_sliding(tmp_path / "m", "mistral", seed=0)), LoadOptions(device="cpu", dtype="float32")
    )
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, max_tokens=budget, margin=8)
    a = caches.sync("a", 0, 0, prompt_len=50)
    caches.extend(a, SEQ[:50], 1)  # its cache (23) and its copy at the prompt's end (23)
    b = caches.sync("b", 0, 0, prompt_len=50, shared_len=24)
    caches.extend(b, SEQ[:50], 1)  # its cache, its copy at the prompt's end and one at the shared prefix
    c = caches.sync("c", 24, prefix_hash(SEQ[:24]), source="b", prompt_len=40, shared_len=24)
    assert c.shared is b.shared
    with mock.patch.object(kvcache.log, "info") as info:
        caches.extend(c, SEQ[30:46], 1)  # its cache, its copy at the prompt's end and b's shared copy
    assert caches.cached_tokens == (161 if budget == 170 else 161 - 23)
    assert b.shared is not None and b.prompt_end is not None and c.shared is b.shared and c.prompt_end is not None
    assert (a.prompt_end is None) == (budget == 140)
    assert info.call_count == (budget == 140)


def _views_of_one_copy(tmp_path: Path, budget: int) -> tuple[SessionCaches, list[int]]:
    """Every layer windowed (Mistral), margin 8 (23 positions a layer keeps): session "a" with its
    copy at the prompt's end (taken at 33 tokens, then cut back to 32), and two other completions of
    the prompt, "d" and "e", whose copies are views of it cut back to 29."""
    loaded = load_model(
        str(build_sliding(tmp_path / "m", "mistral", seed=0)), LoadOptions(device="cpu", dtype="float32")
    )
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, max_tokens=budget, margin=8)
    prompt = SEQ[:30]
    a = caches.sync("a", 0, 0, prompt_len=30)
    caches.extend(a, [*prompt, 7, 8, 9], 4)  # its copy at the prompt's end taken at 33 tokens: 23 positions
    a = caches.sync("a", 32, prefix_hash([*prompt, 7, 8]), prompt_len=30)
    assert a.prompt_end is not None and a.prompt_end.length == 32
    assert caches.cached_tokens == 23 + 23
    for name in ("d", "e"):  # other completions: their caches (23 each) and views of a's copy
        other = caches.sync(name, 29, prefix_hash(prompt[:29]), source="a", prompt_len=30)
        caches.extend(other, [prompt[29], 3], 2)
        assert other.prompt_end is not None and other.prompt_end.length == 29
    return caches, prompt


def test_copies_that_share_their_memory_count_it_once(tmp_path: Path) -> None:
    """A copy cut back (the block after the prompt cut back; other completions of the prompt; a
    session's tokens replaced from before its copy) is a view of the copy it came from: no memory
    of its own, and the memory of all of that copy's positions held while any view is. The budget
    counted each view apart by the positions it sees, and nothing for the memory a view kept once
    the copy's other holders were gone. It counts the memory: once, all of it."""
    caches, prompt = _views_of_one_copy(tmp_path, 0)
    assert caches.cached_tokens == 3 * 23 + 23
    caches.release("a")
    assert caches.cached_tokens == 2 * 23 + 23
    d = caches.sync("d", 31, prefix_hash([*prompt, 3]), prompt_len=30)
    caches.extend(d, SEQ[40:60], 1)  # decoding on, past the margin
    d = caches.sync("d", 28, prefix_hash(prompt[:28]), prompt_len=30)  # its tokens replaced from 28
    assert d.prompt_end is not None and d.prompt_end.length == 28
    caches.release("e")
    assert caches.cached_tokens == 23 + 23  # d's cache, and the 23 positions its view still holds


def test_over_its_budget_letting_go_of_a_copy_that_views_still_hold_frees_nothing(tmp_path: Path) -> None:
    """A budget of 90 and 92 held (three caches, and one copy that the other two completions' views
    share): letting go of the oldest session's copy, or of the next one's view, frees no memory
    while the newest one's view holds it, so the oldest session's cache goes (69 left). Counted by
    the copies themselves, letting go of the first copy counted as 22 freed, and nothing else went
    while all of the memory stayed."""
    caches, _ = _views_of_one_copy(tmp_path, 90)
    d, e = caches.get("d"), caches.get("e")
    assert "a" not in caches and caches.evicted_for_tokens == 1 and caches.cached_tokens == 69
    assert d is not None and d.prompt_end is None and e is not None and e.prompt_end is not None


def test_over_its_budget_a_windowed_model_frees_copies_at_prompt_ends_before_caches(tmp_path: Path) -> None:
    """Every layer windowed (Mistral), a margin of 6: a 40-token session that ran its prompt in its
    first pass counts 21 positions and 21 of its copy at the prompt's end. Three fit a budget of
    130; a fourth, one more than fits, frees the copies of the two least recently used (a
    session's whole cache serves its next turn; a copy only a regenerated reply), not their
    caches (a log line says how many), and a session whose copy was freed takes none again for
    that prompt."""
    loaded = load_model(
        str(build_sliding(tmp_path / "m", "mistral", seed=0)), LoadOptions(device="cpu", dtype="float32")
    )
    caches = SessionCaches(loaded, max_sessions=8, idle_s=60, max_tokens=130, margin=6)
    for name in ("a", "b", "c"):
        caches.extend(caches.sync(name, 0, 0, prompt_len=40), SEQ[:40], 1)
    assert caches.cached_tokens == 3 * 42
    with mock.patch.object(kvcache.log, "info") as info:
        caches.extend(caches.sync("d", 0, 0, prompt_len=30), SEQ[:30], 1)
    info.assert_called_once_with("windowed_copies_freed_for_tokens", sessions=2, max_cache_tokens=130)
    entries = {name: caches.get(name) for name in "abcd"}
    assert all(entries.values()) and caches.cached_tokens == 2 * 21 + 2 * 42 and caches.evicted_for_tokens == 0
    assert [name for name, entry in entries.items() if entry and entry.prompt_end] == ["c", "d"]
    a = caches.sync("a", 40, prefix_hash(SEQ[:40]), prompt_len=40)
    caches.extend(a, [7], 1)
    assert a.prompt_end is None


@dataclasses.dataclass
class _Call:
    """One session's part of a random round: what it asks for and the cache the worker synced."""

    session: str
    entry: SessionCache
    tokens: list[int]
    base_len: int
    num_logits: int


def _random_call(caches: SessionCaches, rng: random.Random, held: dict[str, list[int]], session: str) -> _Call:
    """A random request on ``session``, synced as a caller would: the next round (a cut of up to 5
    rejected tokens, a block), an earlier message edited (a cut anywhere, up to 30 new tokens), or a
    new request starting with part of a prefix other requests share and naming a session whose
    tokens it starts with as the source; a resync answered from where it says, else from 0."""
    system = [(7 * i) % 240 + 3 for i in range(40)]  # a prefix many requests share
    have, kind = held.get(session, []), rng.random()
    source, base_len = "", 0
    if have and kind < 0.55:
        base_len = rng.randint(max(0, len(have) - 5) if kind < 0.4 else 0, len(have))
        tokens = have[:base_len] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 6 if kind < 0.4 else 30))]
    else:
        tokens = system[: rng.randint(0, 40)] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 40))]
        donors = [name for name in held if name != session]
        if donors and rng.random() < 0.7:
            source = rng.choice(donors)
            base_len = min(common_prefix_len(held[source], tokens), len(tokens) - 1)
            base_len = base_len // 4 * 4 or base_len  # found in whole blocks
    base_len = min(base_len, len(tokens) - 1)
    prompt_len = len(tokens) if rng.random() < 0.7 else 0
    shared_len = base_len if source and rng.random() < 0.5 else 0
    for attempt in range(3):  # as the coordinator does: the prefix, where the resync says, all of it
        try:
            hashed = prefix_hash(tokens[:base_len])
            entry = caches.sync(session, base_len, hashed, source if base_len else "", prompt_len, shared_len)
            break
        except ResyncRequired as resync:
            assert resync.start < base_len
            base_len = resync.start if not attempt else 0
    assert entry.tokens == tokens[:base_len]
    return _Call(session, entry, tokens, base_len, rng.randint(1, min(4, len(tokens) - base_len)))


def _held_bytes(caches: SessionCaches) -> int:
    """The memory that the caches' keys and values and their copies hold: each tensor's whole
    storage (a view holds all of it), each storage once."""
    storages = {}
    for entry in caches._entries.values():
        layers = [layer for layer in entry.cache.layers if layer.keys is not None]  # (KV sharing: none)
        layers += [layer for kept in entry.copies for layer in kept.layers.values()]
        for held in (tensor.untyped_storage() for layer in layers for tensor in (layer.keys, layer.values)):
            storages[held.data_ptr()] = held.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize(
    ("arch", "seed"),
    [(arch, seed) for arch in WINDOWED for seed in range(8 if arch in ("mistral", "gemma3") else 2)],
)
def test_whatever_a_windowed_cache_takes_it_answers_with_a_full_passs_logits(
    tmp_path: Path, arch: str, seed: int
) -> None:
    """80 random rounds over 5 sessions of a windowed model (every layer windowed, or Gemma-3's
    mix, 8 seeds each; the other windowed families, KV sharing among them, 2 each; margin 8),
    each 1 to 3 sessions' requests (``_random_call``: next rounds, edited messages, new requests
    sharing a prefix with another session's, sessions freed now and then) run alone or in one
    batched pass, with a budget of 0 (none), 150 or 300 tokens and at most 5 sessions: every sync
    the caches take answers, from the session's cache, another's or a copy of the windowed layers,
    with the logits of a full pass over the request's tokens; and the caches hold no more memory
    than they count (``cached_tokens``), give or take an eighth (a windowed layer keeps a view of
    its last pass's keys when that pass ran at most an eighth of its kept positions more).
    Power (planted by hand): a windowed layer that says it can be cut one position further failed
    10 of the 16 Mistral and Gemma-3 cases; copies at a prompt's end not cut back with the tokens
    they hold replaced 4, those at a shared prefix 1. Before windowed layers copied their kept
    keys out of a pass that ran more than that eighth past them, up to 1.47 times the count was
    held (all 16 failed)."""
    _random_rounds(_windowed_model(tmp_path, arch), seed)


@pytest.mark.parametrize(
    ("family", "seed"), [(family, seed) for family in ("LlamaConfig", "Qwen2Config") for seed in range(3)]
)
def test_whatever_a_cache_growing_in_its_room_takes_it_answers_with_a_full_passs_logits(
    tmp_path: Path, family: str, seed: int
) -> None:
    """The same random rounds over a model of whole-attention layers only, whose caches grow in the
    room after them (``RoomLayer``): copied for another session's prefix, cut back, batched and
    freed over the budget, every sync answers with a full pass's logits, and the memory held
    stays within an eighth of the count."""
    _random_rounds(load_model(str(build_family(tmp_path / family, family)), LoadOptions(device="cpu")), seed)


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "LlamaConfig"])
def test_the_budgets_count_follows_caches_cut_back_between_passes(tmp_path: Path, arch: str) -> None:
    """The random rounds, each followed by cuts as a target makes after a verify (up to 5 rejected
    tokens, the cache cut back with no pass after it) on every session now and then: after each
    cut the count is still the caches' sum, as after each pass (a cut that did not tell the count,
    planted by hand, failed all 3 here; the random rounds alone, which run a pass after every cut,
    passed)."""
    loaded = (
        _windowed_model(tmp_path, arch)
        if arch in SLIDING
        else load_model(str(build_family(tmp_path / arch, arch)), LoadOptions(device="cpu"))
    )
    _random_rounds(loaded, 0, cuts=random.Random(1))


def _counted(caches: SessionCaches) -> int:
    """The budget's count summed over every cache now: each one's tokens (``_own``) and the memory
    of its copies of windowed layers, each memory once however many caches hold it."""
    entries = list(caches._entries.values())
    copies = {kept.memory: kept for entry in entries for kept in entry.copies}
    return sum(caches._own(entry) for entry in entries) + sum(caches._copied(kept) for kept in copies.values())


def _random_rounds(loaded: LoadedModel, seed: int, cuts: random.Random | None = None) -> None:
    """80 random rounds (``_random_call``) over 5 sessions of ``loaded`` (margin 8, a budget of 0,
    150 or 300 tokens): each round's logits are a full pass's, the memory held (``_held_bytes``)
    is within an eighth of ``cached_tokens``, and that count, kept as the caches change, is their
    sum (``_counted``). With ``cuts``, after each round each session's cache is cut back by up to 5
    tokens half the time (where it can be), the count checked after each cut (and the memory not:
    a cache cut back keeps its memory until its next pass)."""
    rng = random.Random(seed)
    caches = SessionCaches(loaded, max_sessions=5, idle_s=600, max_tokens=rng.choice([0, 150, 300]), margin=8)
    held: dict[str, list[int]] = {}  # each session's tokens, as its caller last left them
    token_bytes = kv_bytes_per_token(loaded)
    for round_ in range(80):
        if rng.random() < 0.08:
            held.pop(name := rng.choice("abcde"), None)
            caches.release(name)
            assert caches.cached_tokens == _counted(caches), f"round {round_}"
            continue
        calls = [_random_call(caches, rng, held, name) for name in rng.sample("abcde", rng.choice([1, 1, 2, 3]))]
        calls = [call for call in calls if caches.get(call.session) is call.entry]  # not freed by the next sync
        steps = [(call.entry, call.tokens[call.base_len :], call.num_logits) for call in calls]
        results = caches.extend_many(steps) if len(steps) > 1 else [caches.extend(*step) for step in steps]
        for call, logits in zip(calls, results, strict=True):
            expected = full_logits(loaded, call.tokens)[-call.num_logits :]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"round {round_}, {call}")
            held[call.session] = list(call.entry.tokens)
        held = {name: tokens for name, tokens in held.items() if name in caches}
        if not cuts:  # (a cache cut back keeps its memory until its next pass)
            assert _held_bytes(caches) <= caches.cached_tokens * token_bytes * 9 / 8, f"round {round_}"
        assert caches.cached_tokens == _counted(caches), f"round {round_}"
        for name in sorted(held) if cuts else ():
            entry = caches._entries[name]
            length = cuts.randint(max(0, len(entry.tokens) - 5), len(entry.tokens))
            if cuts.random() < 0.5 and entry.reaches(length):
                entry.truncate(length)
                held[name] = list(entry.tokens)
                assert caches.cached_tokens == _counted(caches), f"round {round_}, a cut of {name} to {length}"


@pytest.mark.parametrize("method", ["tli", "slem"])
def test_a_translated_draft_whose_windowed_cache_cannot_be_cut_back_so_far_resyncs(tmp_path: Path, method: str) -> None:
    """A draft of another tokenizer cuts its cache back to the tokens it shares with the committed
    text's own tokenization. Where its windowed layers cannot be cut back that far (their margin, 2
    positions here, is behind them), the job answers resync (from 0) and frees the cache, as when its
    mirror no longer holds the prefix; the next request, from the start, drafts again."""
    tokenizer = build_tokenizer()
    path = build_sliding(tmp_path / "draft", "mistral", seed=0)
    draft = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    text = tokenizer.encode("the quick brown fox jumps over the lazy dog, then sleeps", add_special_tokens=False)
    bridge = VocabBridge(tokenizer, tokenizer, draft.vocab_size, method)
    caches, params = SessionCaches(draft, max_sessions=4, idle_s=60, margin=2), DraftParams(3, Warp(), seed=0, top_n=0)

    def drive(base: int) -> Block | Resync:
        sync = common_pb2.PrefixSync(base_len=base, prefix_hash=prefix_hash(text[:base]), tail_token_ids=text[base:40])
        return run_steps(translated_propose_job(caches, draft, bridge, "s", sync, params), caches)[0]

    assert isinstance(drive(0), Block) and len(caches._entries["s"].tokens) >= 40
    caches.extend(caches._entries["s"], [7] * 6, 1)  # its cache 6 tokens past what the text holds
    assert drive(30) == Resync() and "s" not in caches  # before: ValueError from the windowed layer's cut
    assert isinstance(drive(0), Block)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_model_familys_caches_are_cut_back_copied_and_batched(tmp_path: Path, family: str) -> None:
    """Model families whose attention, positions or layers differ (learned and ALiBi positions,
    partial rotary, latent attention, routed experts, layers without positions, attention sinks,
    sliding windows), loaded as the workers load them (the packed CPU kernel): their whole context
    is served, and their session caches, cut back, copied and batched, give a full pass's logits."""
    loaded = load_model(str(build_family(tmp_path / family, family)), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.max_context_len == 256
    _cut_back_copied_and_batched(loaded, head_apart=family != "Gemma4TextConfig")


def test_a_model_that_also_takes_images_is_served_as_its_text_decoder(tmp_path: Path) -> None:
    """Gemma-3 4B and larger come as Gemma3ForConditionalGeneration, whose config keeps the text
    model's fields in ``text_config``: the worker reads its EOS ids, context and layers there, and
    its caches are cut back, copied and batched like any other (before: load failed on
    "'Gemma3Config' object has no attribute 'eos_token_id'"). Its early-exit draft keeps the first
    text layer."""
    path = build_gemma3_with_vision(tmp_path / "gemma3")
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    assert type(loaded.model).__name__ == "Gemma3ForConditionalGeneration"
    assert loaded.max_context_len == 256 and loaded.eos_token_ids == (build_tokenizer().eos_token_id,)
    _cut_back_copied_and_batched(loaded)
    draft = load_model(str(path), LoadOptions(device="cpu", dtype="float32", layers=1))
    assert len(draft.model.get_decoder().layers) == 1 and draft.model.config.get_text_config().num_hidden_layers == 1


def test_a_model_whose_forward_takes_no_logits_to_keep_is_served(tmp_path: Path, tiny_models: TinyModels) -> None:
    """Model code shipped with a model may predate transformers' ``logits_to_keep`` (its forward
    takes neither it nor ``**kwargs``): the worker's passes leave it out and take the rows they
    need from every row's logits, so the start-up probe, a pass with a prompt's earlier rows and
    a batched pass give what the same weights give (before: start-up failed on "forward() got an
    unexpected keyword argument 'logits_to_keep'")."""
    path = build_plain_forward(tiny_models.target, tmp_path / "plain")
    loaded = load_model(str(path), LoadOptions(device="cpu", dtype="float32", trust_remote_code=True))
    assert type(loaded.model).__name__ == "PlainLlamaForCausalLM"
    assert startup.prefill_rates(loaded).per_token_ms > 0
    same = load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float32"))
    caches, rows = SessionCaches(loaded, max_sessions=4, idle_s=60), []
    entry = caches.sync("s", 0, 0)
    last = caches.extend(entry, SEQ[:20], 2, EarlierLogits(5, rows.append))
    full = full_logits(same, SEQ[:20])
    torch.testing.assert_close(last, full[-2:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(rows), full[13:18], atol=1e-4, rtol=1e-4)
    other = caches.sync("t", 0, 0)
    caches.extend(other, SEQ[:3], 1)
    both = caches.extend_many([(entry, SEQ[20:22], 2), (other, [9], 1)])
    torch.testing.assert_close(both[0], full_logits(same, SEQ[:22])[-2:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[1], full_logits(same, [*SEQ[:3], 9])[-1:], atol=1e-4, rtol=1e-4)


def test_the_cache_goes_by_the_keyword_the_model_takes(loaded: LoadedModel) -> None:
    """transformers 5 models take ``cache`` (``past_key_values`` warns there, and goes in 5.40);
    transformers 4 models and model code shipped with a model take ``past_key_values``."""

    class Shipped(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None, use_cache: bool = False) -> None:
            return None

    cache = DynamicCache(config=loaded.model.config)
    assert cache_argument(loaded.model, cache) == {"cache": cache, "use_cache": True}
    assert cache_argument(Shipped(), cache) == {"past_key_values": cache, "use_cache": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning on the way
        loaded.model(input_ids=torch.tensor([[1, 2]]), **cache_argument(loaded.model, cache))
    assert cache.get_seq_length() == 2
