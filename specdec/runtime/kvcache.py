"""Per-session KV caches of one model, rolled back with crop.

Not thread-safe: a worker calls it from its single model thread only.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

from specdec.runtime.cachelayers import (
    RoomLayer,
    WindowedCopy,
    WindowedLayer,
    WindowedRoom,
    cache_argument,
    held_positions,
    keeping,
    logit_rows_argument,
    new_cache,
    owning,
    sharing,
)
from specdec.runtime.grammar import GrammarState
from specdec.runtime.lookup import GuessIndex
from specdec.runtime.modeling import LoadedModel, decoder_of
from specdec.runtime.processing import TokenCounts
from specdec.runtime.startup import checked_lean_step, timed, windowed_share
from specdec.runtime.tokens import PrefixHashes
from specdec.runtime.vocab import TextMirror

log = structlog.get_logger(__name__)

LOGIT_CHUNK_ROWS = 128  # earlier rows (a prompt's, for its log-probabilities) scored per output-layer call


@dataclass(frozen=True)
class EarlierLogits:
    """The logits of the ``rows`` positions before a pass's last ``num_logits``, handed to
    ``consume`` up to LOGIT_CHUNK_ROWS rows at a time, in order: a long prompt's logits (prompt
    log-probabilities; 1.1 GiB for 2,000 tokens of a 151,936-id vocabulary) never exist all at once."""

    rows: int
    consume: Callable[[torch.Tensor], None]


CACHE_MEMORY_SHARE = 0.5  # of the memory free after loading, what an automatic token budget may fill


WARM_UP_PREFIX_TOKENS = 8  # the cache SessionCaches.warm_up's passes run over
WARM_UP_SLOW_PASS_S = 0.1  # a one-token pass this slow: warm_up times it again before the others
WARM_UP_FIRST_PASS_RATIO = 1.1  # a first pass within this of the second: no one-time costs to take


class ResyncRequired(Exception):
    """The worker's cache does not hold the committed prefix: the caller must resend it from
    ``start`` (the length of a shorter prefix it still holds and can start from, else 0)."""

    def __init__(self, session_id: str, start: int = 0) -> None:
        super().__init__(session_id)
        self.start = start


@dataclass
class SessionCache:
    """Token ids in the KV cache, and the cache itself (always the same length); for a draft of
    another vocabulary, also the session's committed target ids and their text (``mirror``); for a
    draft that guesses ahead, an n-gram index of a prefix of ``tokens`` (``guesses``)."""

    tokens: list[int]
    cache: DynamicCache
    last_used: float = field(default_factory=time.monotonic)
    mirror: TextMirror | None = None
    guesses: GuessIndex | None = None
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # of ``tokens``, kept up to date below
    counts: TokenCounts = field(default_factory=TokenCounts)  # of ``tokens``, for penalties; likewise
    grammar: GrammarState | None = None  # the structured-output matcher (None: the model has no grammar masks)
    prompt_len: int = 0  # where the turn's prompt ends (0: not said): ``prompt_end`` is taken there
    prompt_end: WindowedCopy | None = None
    prompt_end_freed: int = 0  # the prompt_len whose copy the budget freed: none is taken again for it
    shared_len: int = 0  # where a prefix other requests share ends (0: not said): ``shared`` is taken there
    shared: WindowedCopy | None = None
    shared_freed: int = 0  # likewise for shared_len
    counted_by: _Entries | None = field(default=None, repr=False, compare=False)  # the map whose budget counts it

    @property
    def copies(self) -> list[WindowedCopy]:
        """Its copies of the windowed layers."""
        return [kept for kept in (self.prompt_end, self.shared) if kept is not None]

    def _within_margin(self, length: int, after: int = 0) -> bool:
        """Whether its windowed layers can be cut back to ``length`` tokens (once a pass has added
        ``after`` more)."""
        excess = len(self.tokens) + after - length
        windowed = [layer for layer in self.cache.layers if isinstance(layer, WindowedLayer)]
        return excess <= 0 or all(layer.can_cut(excess, after) for layer in windowed)

    def reaches(self, length: int) -> bool:
        """Whether the cache can be cut back to its first ``length`` tokens: a windowed layer keeps
        only its window and a margin before it (``WindowedLayer``), and each of its copies
        (``copies``) as much before its own length."""
        return self._within_margin(length) or any(kept.reaches(length) for kept in self.copies)

    def restart(self, length: int) -> int:
        """Where a caller asking for the first ``length`` tokens (held, but not reached) can start
        instead: the longest of its copies no longer than them (0: nowhere)."""
        starts = [min(length, kept.length) for kept in self.copies if kept.reaches(min(length, kept.length))]
        return max(starts, default=0)

    def truncate(self, length: int) -> None:
        """Rolls back to the first ``length`` tokens (an index of more of them is dropped)."""
        excess = len(self.tokens) - length
        if excess > 0:
            restored: dict[int, WindowedLayer] = {}
            if not self._within_margin(length):  # its windowed layers from a copy (``reaches`` said so)
                restored = next((kept.layers for kept in self.copies if kept.reaches(length)), {})
            for index, layer in enumerate(self.cache.layers):
                if index in restored:
                    layer = self.cache.layers[index] = copy.copy(restored[index])
                    layer.crop(length - layer.length)
                else:
                    layer.crop(-excess)
            self.counts.cut(self.tokens, length)
            del self.tokens[length:]
            self.hashes.cut(length)
            # a copy's keys after ``length`` may be of tokens replaced
            if self.prompt_end is not None and self.prompt_end.length > length:
                self.prompt_end = self.prompt_end.cut(length)
            if self.shared is not None and self.shared.length > length:
                self.shared = self.shared.cut(length)
            self._changed()
        if self.guesses is not None and len(self.guesses) > length:
            self.guesses = None

    def grow(self, token_ids: Sequence[int]) -> None:
        """Records the tokens a pass has just added to the cache (and takes the copies they bring
        within reach: ``keep_copies``)."""
        self.tokens.extend(token_ids)
        self.keep_copies()

    def _changed(self) -> None:
        """Tells the map whose budget counts this cache that its tokens or copies changed."""
        if self.counted_by is not None:
            self.counted_by.recount(self)

    def keep_copies(self) -> None:
        """Copies the windowed layers once the cache holds the prompt, unless a copy holds all of
        it but its last token (a request never finds that one cached: it is always sent); a copy
        of another session's cache, for a prompt the same as its own, shares that one's. Likewise
        once it holds the shared prefix (``shared_wanted``), cut back to it."""
        wanted, end = self.prompt_len, self.prompt_end
        if (
            wanted
            and wanted != self.prompt_end_freed
            and len(self.tokens) >= wanted
            and (end is None or end.length < wanted - 1)
            and self._within_margin(wanted - 1)  # else a copy would not reach it either
        ):
            self.prompt_end = WindowedCopy.of(self.cache, len(self.tokens))
        if self.shared_wanted() and len(self.tokens) >= self.shared_len and self._within_margin(self.shared_len):
            self.shared = WindowedCopy.of(self.cache, len(self.tokens), upto=self.shared_len)
        self._changed()

    def shared_stop(self, tokens: int, num_logits: int) -> int:
        """Where a pass of ``tokens`` more (keeping the last ``num_logits`` rows' logits) stops
        first, so that the copy at the shared prefix's end is taken there: the tokens before the
        stop (0: no stop). It stops only where the whole pass would leave no copy: one that ends
        within the margin after the prefix keeps a copy cut back to it, and a stop costs a pass."""
        head = self.shared_len - len(self.tokens) if self.shared_wanted() else 0
        if not 0 < head <= tokens - max(num_logits, 1) or self._within_margin(self.shared_len, tokens):
            return 0
        return head

    def shared_wanted(self) -> bool:
        """Whether a copy at the shared prefix's end is still to be taken: one is asked for, not
        freed for it, and no copy reaches it."""
        wanted = self.shared_len
        return bool(wanted) and wanted != self.shared_freed and not any(kept.reaches(wanted) for kept in self.copies)

    def free_copies(self) -> None:
        """Frees its copies (for the budget); none is taken again for this prompt or shared prefix."""
        self.prompt_end, self.prompt_end_freed = None, self.prompt_len
        self.shared, self.shared_freed = None, self.shared_len
        self._changed()


class _Entries(OrderedDict[str, SessionCache]):
    """SessionCaches' map of session id -> SessionCache, with the budget's count of what they hold
    (``tokens``) kept as caches come, go and change, so that a pass checks the budget without
    summing every session's cache (20 ms a pass with 20,000 sessions). A cache counts for
    ``own(cache)`` and its copies of windowed layers for ``copied(copy)``, each copy's memory once
    however many caches hold it (a copy cut back from another is a view of its memory). A cache
    tells the map whenever its tokens or copies change (``SessionCache.grow``, ``truncate``,
    ``keep_copies``, ``free_copies`` call ``recount``). Only the model thread changes it; other
    threads may read ``tokens``."""

    def __init__(self, own: Callable[[SessionCache], int], copied: Callable[[WindowedCopy], int]) -> None:
        super().__init__()
        self._own, self._copied = own, copied
        self.tokens = 0
        self._counted: dict[int, tuple[SessionCache, int, tuple[WindowedCopy, ...]]] = {}
        self._holders: Counter[int] = Counter()  # copies' memory -> caches holding it
        self._memory: dict[int, int] = {}  # copies' memory -> what it counts for

    def __setitem__(self, session_id: str, entry: SessionCache) -> None:
        old = self.get(session_id)
        if old is not None:
            self._forget(old)
        super().__setitem__(session_id, entry)
        entry.counted_by = self
        self._add(entry)

    def __delitem__(self, session_id: str) -> None:
        entry = self[session_id]
        super().__delitem__(session_id)
        self._forget(entry)

    def pop(self, session_id: str, *default: Any) -> Any:
        entry = super().pop(session_id, *default)
        if isinstance(entry, SessionCache) and entry.counted_by is self:
            self._forget(entry)
        return entry

    def popitem(self, last: bool = True) -> tuple[str, SessionCache]:
        session_id, entry = super().popitem(last)
        self._forget(entry)
        return session_id, entry

    def clear(self) -> None:
        while self:
            self.popitem()

    @property
    def holds_copies(self) -> bool:
        return bool(self._holders)

    def recount(self, entry: SessionCache) -> None:
        """Counts ``entry`` as it is now (nothing if the map no longer holds it)."""
        if id(entry) in self._counted:
            self._remove(entry)
            self._add(entry)

    def _forget(self, entry: SessionCache) -> None:
        self._remove(entry)
        entry.counted_by = None

    def _add(self, entry: SessionCache) -> None:
        own, copies = self._own(entry), tuple(entry.copies)
        self._counted[id(entry)] = entry, own, copies
        self.tokens += own
        for kept in copies:
            self._holders[kept.memory] += 1
            if self._holders[kept.memory] == 1:
                self._memory[kept.memory] = self._copied(kept)
                self.tokens += self._memory[kept.memory]

    def _remove(self, entry: SessionCache) -> None:
        counted = self._counted.pop(id(entry), None)
        if counted is None:
            return
        _, own, copies = counted
        self.tokens -= own
        for kept in copies:
            self._holders[kept.memory] -= 1
            if not self._holders[kept.memory]:
                del self._holders[kept.memory]
                self.tokens -= self._memory.pop(kept.memory)


class SessionCaches:
    """LRU-bounded map of session id -> SessionCache for one model: at most ``max_sessions``
    caches and, when ``max_tokens`` is set, at most that many cached tokens in all (the least
    recently used caches go first; the ones a pass has just extended stay, so one session longer
    than the budget still runs, alone).

    With a ``margin``, a windowed attention layer keeps its window and that many positions before
    it (``WindowedLayer``): a cut back deeper than that is a resync, unless it goes back to where
    the session's prompt ends or to where a prefix that other requests share ends (both told by
    ``sync``), where the cache keeps a copy of them (``WindowedCopy``); a resync to a length after
    a copy starts from it. A token counts then for the share of its memory that is kept: beyond a
    layer's window and margin, only its whole layers'; the copies count too."""

    def __init__(
        self, loaded: LoadedModel, max_sessions: int, idle_s: float, max_tokens: int = 0, margin: int | None = None
    ) -> None:
        self._loaded = loaded
        self._max_sessions = max_sessions
        self.max_tokens = max_tokens  # 0 = no limit
        self._margin = margin
        self._windowed = windowed_share(loaded, margin)
        self._idle_s = idle_s
        self._entries = _Entries(self._own, self._copied)
        self.prefill_tokens_total = 0
        self.reused_tokens_total = 0  # tokens taken from another session's cache (prefix reuse)
        self._head_apart: bool | None = None  # whether the output layer runs apart from the decoder
        self.lean = checked_lean_step(loaded)  # one-token steps without the model's own forward (a fused draft)
        self.evicted_for_tokens = 0  # caches freed to stay within max_tokens

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    @property
    def cached_tokens(self) -> int:
        """Tokens held by all the caches, a token beyond a windowed layer's window and margin
        counting for its whole layers' share of a token's memory, and their copies of the windowed
        layers, each once however many caches share it (a copy cut back from another, a view of
        its memory, counts with it: all of that memory, while either is held). Kept as the caches
        change (``_Entries``); safe to read from another thread (the metrics server)."""
        return self._entries.tokens

    def _own(self, entry: SessionCache) -> int:
        """What a cache counts for without its copies (at most: a cut-back windowed layer keeps fewer)."""
        limit, share = self._windowed
        length = len(entry.tokens)
        return length - int(share * max(0, length - limit))

    def _copied(self, kept: WindowedCopy) -> int:
        """What a copy of the windowed layers counts for."""
        return int(self._windowed[1] * kept.positions)

    def sync(
        self,
        session_id: str,
        base_len: int,
        base_hash: int,
        source: str = "",
        prompt_len: int = 0,
        shared_len: int = 0,
    ) -> SessionCache:
        """The session's cache cut back to ``base_len`` committed tokens.

        ``base_len == 0`` always succeeds (a fresh cache). Otherwise the cache must hold at least
        ``base_len`` tokens whose hash is ``base_hash``; failing that, a copy of the ``source``
        session's cache does if that one holds them (prefix reuse); else ResyncRequired, saying
        where the caller can start instead when either holds them but can no longer be cut back
        so far (``SessionCache.restart``: the session's own cache is then kept for it).
        ``prompt_len``: where the turn's prompt ends (0: not said); with windowed layers that
        keep a margin, the cache keeps a copy of them there once a pass has run it (``WindowedCopy``).
        ``shared_len``: where a prefix of the prompt that other requests share ends (0: not said):
        likewise, a pass that would run past it stopping there first (``extend``).
        """
        self.evict_idle()
        entry = self._entries.get(session_id)
        if base_len == 0:
            entry = self._new_entry([], new_cache(self._loaded.model.config, self._margin))
            self._entries[session_id] = entry
            self._evict_over_capacity()
        elif _holds(entry, base_len, base_hash):
            assert entry is not None
            entry.truncate(base_len)
        elif source and source != session_id and _holds(donor := self._entries.get(source), base_len, base_hash):
            assert donor is not None
            entry = self._new_entry(list(donor.tokens), sharing(donor.cache))
            entry.prompt_end, entry.shared = donor.prompt_end, donor.shared
            entry.truncate(base_len)
            owning(entry.cache)  # copies only the prefix's keys and values, not all of the donor's
            self._entries[session_id] = entry
            self.reused_tokens_total += base_len
            self._evict_over_capacity()
        else:  # a cut the cache cannot make: perhaps one it can, to a shorter length
            own = _restart(entry, base_len, base_hash)
            donor = _restart(self._entries.get(source), base_len, base_hash) if source and source != session_id else 0
            if not own:
                self._entries.pop(session_id, None)
            raise ResyncRequired(session_id, max(own, donor))
        if self._windowed[0]:
            entry.prompt_len = prompt_len or entry.prompt_len
            near_end = entry.prompt_len and 0 <= entry.prompt_len - shared_len <= (self._margin or 0) // 2
            if shared_len and not near_end:  # (the copy at the prompt's end reaches that far back)
                entry.shared_len = shared_len
            entry.keep_copies()  # where the cache already holds what they ask for: a pass only adds to it
        entry.last_used = time.monotonic()
        self._entries.move_to_end(session_id)
        return entry

    def _new_entry(self, tokens: list[int], cache: DynamicCache) -> SessionCache:
        masks = self._loaded.grammar
        return SessionCache(tokens=tokens, cache=cache, grammar=None if masks is None else GrammarState(masks))

    def get(self, session_id: str) -> SessionCache | None:
        """The session's cache as it is (None when there is none), marked as used."""
        self.evict_idle()
        entry = self._entries.get(session_id)
        if entry is not None:
            entry.last_used = time.monotonic()
            self._entries.move_to_end(session_id)
        return entry

    def extend(
        self, entry: SessionCache, token_ids: Sequence[int], num_logits: int, earlier: EarlierLogits | None = None
    ) -> torch.Tensor:
        """Runs ``token_ids`` through the model on top of the cache.

        Returns float32 logits [num_logits, V] for the last ``num_logits`` positions (none: a
        part of a prefill that a later pass goes on from); with ``earlier``, the rows before those
        go to ``earlier.consume`` a chunk at a time (the model's output layer run on the decoder's
        final hidden states of a chunk of them).
        """
        if not token_ids:
            raise ValueError("extend needs at least one token")
        rows = earlier.rows if earlier is not None else 0
        if num_logits + rows > len(token_ids):
            raise ValueError(f"{num_logits} + {rows} logit rows asked of a {len(token_ids)}-token pass")
        head = 0 if rows else entry.shared_stop(len(token_ids), num_logits)
        if head:
            self.extend(entry, token_ids[:head], 0)  # stops where the shared prefix ends, for its copy
            return self.extend(entry, token_ids[head:], num_logits)
        if self.lean is not None and len(token_ids) == 1 and num_logits == 1 and not rows:
            with torch.inference_mode():
                logits = self.lean(entry.cache, token_ids[0])
            self._extended(entry, token_ids)
            return logits
        apart = bool(rows) and self._output_layer_runs_apart()
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._loaded.device)
        hidden: list[torch.Tensor] = []
        kept = num_logits + (0 if apart else rows)
        with torch.inference_mode(), _final_hidden(self._loaded.model, hidden, on=apart):
            out = self._loaded.model(
                input_ids=ids,
                **cache_argument(self._loaded.model, entry.cache),
                **logit_rows_argument(self._loaded.model, max(kept, 1)),  # 0 would keep every row's
            )
        self._extended(entry, token_ids)
        width = out.logits.shape[1]  # rows kept: the earlier ones, then the last num_logits
        logits = out.logits[0, width - num_logits :].float()
        if earlier is not None and rows:
            if apart:
                states = hidden[-1][0, len(token_ids) - num_logits - rows : len(token_ids) - num_logits]
                chunks = (
                    _output_layer(self._loaded.model, states[i : i + LOGIT_CHUNK_ROWS])
                    for i in range(0, rows, LOGIT_CHUNK_ROWS)
                )
            else:
                every = out.logits[0, width - num_logits - rows : width - num_logits]
                chunks = (every[i : i + LOGIT_CHUNK_ROWS].float() for i in range(0, rows, LOGIT_CHUNK_ROWS))
            for chunk in chunks:
                earlier.consume(chunk)
        return logits

    def _extended(self, entry: SessionCache, token_ids: Sequence[int]) -> None:
        """Bookkeeping after a pass of ``token_ids`` on ``entry``'s cache."""
        entry.grow(token_ids)
        self.prefill_tokens_total += len(token_ids)
        self._evict_over_tokens((entry,))

    def _output_layer_runs_apart(self) -> bool:
        """Whether the model's output layer (with whatever it does after it: logit soft-capping,
        scaling) can run on decoder hidden states alone, checked once on a 3-token pass: logits
        from the hidden states of a pass that keeps one row's logits (as ``extend`` runs it; a
        decoder may then keep only that row's states, as Gemma-4's does) equal to the model's own
        of every row. A model where they do not gets its earlier rows' logits from its own forward
        pass, all at once (the memory they take)."""
        if self._head_apart is None:
            model, hidden = self._loaded.model, []
            ids = torch.tensor([[0, 1, 2]], dtype=torch.long, device=self._loaded.device)
            try:
                with torch.inference_mode():
                    with _final_hidden(model, hidden, on=True):
                        model(input_ids=ids, use_cache=False, **logit_rows_argument(model, 1))
                    whole = model(input_ids=ids, use_cache=False).logits[0].float()
                    apart = _output_layer(model, hidden[-1][0])
                self._head_apart = bool(
                    whole.shape == apart.shape and torch.allclose(whole, apart, rtol=1e-4, atol=1e-5)
                )
            except Exception as exc:  # a model whose forward pass the hooks below do not fit
                log.warning("output_layer_check_failed", error=repr(exc))
                self._head_apart = False
            if not self._head_apart:
                log.warning("earlier_logits_at_once", reason="the output layer does not run apart from the decoder")
        return self._head_apart

    def extend_many(self, ops: Sequence[tuple[SessionCache, Sequence[int], int]]) -> list[torch.Tensor]:
        """``extend`` for several sessions in ONE forward pass; returns each one's logits.

        Past caches are left-padded to the longest and new tokens right-padded; the attention
        mask hides the padding and each row gets its own positions. The new keys/values are then
        appended to each session's own cache. A row whose pass would leave no copy where its shared
        prefix ends (``SessionCache.shared_stop``) first runs up to there, in a pass of such rows
        before this one.
        """
        if len(ops) == 1:
            entry, token_ids, num_logits = ops[0]
            return [self.extend(entry, token_ids, num_logits)]
        stops = [entry.shared_stop(len(ids), num_logits) for entry, ids, num_logits in ops]
        if any(stops):
            self.extend_many([(entry, ids[:stop], 0) for (entry, ids, _), stop in zip(ops, stops, strict=True) if stop])
            ops = [(entry, ids[stop:], num_logits) for (entry, ids, num_logits), stop in zip(ops, stops, strict=True)]
        batch = _Batch.build(ops, self._loaded)
        with torch.inference_mode():
            out = self._loaded.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                **cache_argument(self._loaded.model, batch.cache),
            )
        results = []
        for row, (entry, token_ids, num_logits) in enumerate(ops):
            batch.scatter_new_kv(row, entry, len(token_ids))
            entry.grow(token_ids)
            self.prefill_tokens_total += len(token_ids)
            results.append(out.logits[row, len(token_ids) - num_logits : len(token_ids)].float())
        self._evict_over_tokens([entry for entry, _, _ in ops])
        return results

    def release(self, session_id: str) -> bool:
        """Frees a session's cache; False when there was none."""
        return self._entries.pop(session_id, None) is not None

    def warm_up(self, widths: int) -> int:
        """Runs one pass of every width from 1 to ``widths`` (fewer if the context is shorter) over
        a short cache, each keeping its rows of logits as a verify pass does, then frees the cache
        and leaves ``prefill_tokens_total`` as it was; returns the widest width run. A model's
        first pass of a width pays one-time costs (kernels chosen and buffers made for its shapes:
        on CPU the tiny test model's first took 4.5-6 ms, the later ones 2.2 ms), and the
        coordinator times target-only decoding only by rounds that decode target-only (with a good
        draft, one in its life): a session's pass of a width should not be that width's first.
        Those costs do not grow with the model: where a one-token pass takes WARM_UP_SLOW_PASS_S
        or more, it is run a second time, and if the first cost no more than
        WARM_UP_FIRST_PASS_RATIO times the second, no other width is run (Qwen2.5-Coder 1.5B on a
        CPU: ~300 ms a pass, the first no dearer, 17 passes 6.5-7.4 s of its start-up). Only width
        1 is timed twice; on the 2-core AMX host no other width's first pass was dearer either:
        the 1.5B in packed bfloat16 153-166 ms against 152-158 for the next two passes of widths
        2-9, the int8 0.5B draft within 3 ms of the faster of its next two for widths 1-9 and 16.
        Before the worker serves (no session yet)."""
        widths = min(widths, self._loaded.max_context_len - 1 - WARM_UP_PREFIX_TOKENS)
        if widths < 1:
            return 0
        counted, session = self.prefill_tokens_total, "\0warm-up"
        try:
            entry = self.sync(session, 0, 0)
            self.extend(entry, [0] * WARM_UP_PREFIX_TOKENS, 1)  # a pass's cost is not the ids'
            for width in range(1, widths + 1):
                first = self._timed_width(entry, width)
                if width == 1 and first >= WARM_UP_SLOW_PASS_S:
                    again = self._timed_width(entry, width)
                    if first <= again * WARM_UP_FIRST_PASS_RATIO:
                        log.info(
                            "warm_up_cut_short", first_pass_ms=round(first * 1000, 1), again_ms=round(again * 1000, 1)
                        )
                        return 1
        finally:
            self.release(session)
            self.prefill_tokens_total = counted
        return widths

    def _timed_width(self, entry: SessionCache, width: int) -> float:
        """Seconds a warm-up pass of ``width`` tokens over ``entry`` takes (the device's work
        included); the cache is cut back to the warm-up prefix after it."""
        took = timed(self._loaded, lambda: self.extend(entry, [0] * width, width))
        entry.truncate(WARM_UP_PREFIX_TOKENS)
        return took

    def evict_idle(self) -> None:
        """Frees caches unused for longer than the idle limit."""
        cutoff = time.monotonic() - self._idle_s
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.last_used >= cutoff:
                break
            del self._entries[oldest_id]

    def _evict_over_capacity(self) -> None:
        while len(self._entries) > self._max_sessions:
            self._entries.popitem(last=False)

    def _evict_over_tokens(self, keep: Sequence[SessionCache]) -> None:
        """Frees the least recently used caches, other than ``keep``, while over ``max_tokens``:
        first their copies of windowed layers (a session's whole cache serves its next turn; such a
        copy only a request of the same prompt or shared prefix), then the caches."""
        if not self.max_tokens or self.cached_tokens <= self.max_tokens:
            return
        copied = 0
        if self._entries.holds_copies:
            for entry in self._entries.values():
                if self.cached_tokens <= self.max_tokens:
                    break
                if entry.copies and not any(entry is kept for kept in keep):
                    entry.free_copies()
                    copied += 1
        if copied:
            log.info("windowed_copies_freed_for_tokens", sessions=copied, max_cache_tokens=self.max_tokens)
        freed = []
        while self.cached_tokens > self.max_tokens:
            victim = next((sid for sid, entry in self._entries.items() if not any(entry is k for k in keep)), None)
            if victim is None:
                break
            del self._entries[victim]
            freed.append(victim)
        if freed:
            self.evicted_for_tokens += len(freed)
            log.info("caches_freed_for_tokens", sessions=len(freed), max_cache_tokens=self.max_tokens,
                     freed_total=self.evicted_for_tokens)  # fmt: skip


def _holds(entry: SessionCache | None, length: int, expected_hash: int) -> bool:
    """Whether ``entry`` holds ``length`` tokens whose hash is ``expected_hash``, and can be cut back to them."""
    return _has(entry, length, expected_hash) and entry is not None and entry.reaches(length)


def _restart(entry: SessionCache | None, length: int, expected_hash: int) -> int:
    """Where a sync to ``length`` tokens that ``entry`` holds (``expected_hash``) but cannot be cut
    back to can start from instead (``SessionCache.restart``; 0: nowhere)."""
    return entry.restart(length) if _has(entry, length, expected_hash) and entry is not None else 0


def _has(entry: SessionCache | None, length: int, expected_hash: int) -> bool:
    """Whether ``entry`` holds at least ``length`` tokens, the first of which hash to ``expected_hash``."""
    return entry is not None and len(entry.tokens) >= length and entry.hashes.of(entry.tokens, length) == expected_hash


@dataclass
class _Batch:
    """Padded inputs and a combined cache for one batched forward pass."""

    input_ids: torch.Tensor  # [B, M]
    attention_mask: torch.Tensor  # [B, P + M]
    position_ids: torch.Tensor  # [B, M]
    cache: DynamicCache  # past of every row, left-padded to P
    past: int  # P

    @classmethod
    def build(cls, ops: Sequence[tuple[SessionCache, Sequence[int], int]], loaded: LoadedModel) -> _Batch:
        device = loaded.device
        past_lens = [len(entry.tokens) for entry, _, _ in ops]
        new_lens = [len(tokens) for _, tokens, _ in ops]
        past, width = max(past_lens), max(new_lens)
        input_ids = torch.zeros(len(ops), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(ops), past + width, dtype=torch.long, device=device)
        for row, (_, tokens, _) in enumerate(ops):
            input_ids[row, : new_lens[row]] = torch.tensor(list(tokens), dtype=torch.long, device=device)
            mask[row, past - past_lens[row] : past + new_lens[row]] = 1
        positions = torch.tensor(past_lens, device=device)[:, None] + torch.arange(width, device=device)[None, :]
        cache = new_cache(loaded.model.config)
        if past:
            template = next(entry.cache for entry, _, _ in ops if entry.tokens)
            for layer, kept in keeping(template):
                windowed = isinstance(kept, WindowedLayer)
                # a windowed layer's rows end at the same position, the last before the pass: each
                # row keeps its own number of positions, the padding before them masked (or out of its window)
                length = max(held_positions(entry.cache, layer) for entry, _, _ in ops) if windowed else past
                room = WindowedRoom(kept.window) if windowed else RoomLayer()
                room.fill([entry.cache for entry, _, _ in ops], layer, length, width, kept)
                if windowed:
                    room.length = past
                cache.layers[layer] = room
        return cls(input_ids, mask, positions, cache, past)

    def scatter_new_kv(self, row: int, entry: SessionCache, count: int) -> None:
        """Appends this row's new keys/values to the session's own cache."""
        for layer, combined in keeping(self.cache):
            start = combined.keys.shape[2] - self.input_ids.shape[1]  # the pass's first position
            keys = combined.keys[row : row + 1, :, start : start + count]
            values = combined.values[row : row + 1, :, start : start + count]
            entry.cache.update(keys, values, layer)  # (every layer copies them into memory of its own)


@contextmanager
def _final_hidden(model: Any, into: list[torch.Tensor], on: bool) -> Iterator[None]:
    """While open (and ``on``), every forward pass of ``model``'s decoder appends its final hidden
    states [B, T, H] to ``into``."""
    if not on:
        yield
        return

    def keep(_module: torch.nn.Module, _args: object, output: Any) -> None:
        into.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder_of(model).register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class _StandInOutput(BaseModelOutputWithPast):
    """The decoder's output as ``_output_layer`` stands in for it: the hidden states, and None for
    whatever else the model reads of it (router logits, cross attentions, shared KV states)."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _output_layer(model: Any, states: torch.Tensor) -> torch.Tensor:
    """float32 logits [R, V] of final hidden states [R, H]: the model's own forward pass with its
    decoder standing in as ``states``, so what the model does after its output layer applies too."""
    decoder = decoder_of(model)
    ran: list[bool] = []

    def stand_in(*_args: object, **_kwargs: object) -> BaseModelOutputWithPast:
        ran.append(True)
        return _StandInOutput(last_hidden_state=states[None])

    decoder.forward = stand_in
    try:
        ids = torch.zeros((1, states.shape[0]), dtype=torch.long, device=states.device)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        del decoder.forward  # the class's own forward again
    if not ran:
        raise RuntimeError("the model's forward pass does not call its decoder")
    return logits
