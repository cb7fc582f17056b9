"""Drafting: autoregressive proposals from the small model, with the distributions they came from.

``propose_job`` drafts K tokens after a committed prefix. ``lookahead_job`` (pipelining) drafts
the block after one it already proposed, assuming that block is fully accepted and followed by
the draft's own guess of the target's next token. Each draft token is sampled with the generator
of its absolute position (specdec.runtime.sampling.position_generator), so a lookahead block that is used
is exactly the block a fresh request at that prefix would have produced.

``translated_propose_job`` is the same for a draft whose tokenizer differs from the target's
(specdec.runtime.vocab): it keeps the session's committed target ids and text beside the cache,
drafts in its own vocabulary and proposes in the target's.

Guessing ahead (``DraftParams.guess_tokens``; the idea of Ouroboros' phrase drafts and of
lookahead decoding, applied to the draft model): a pass also runs the tokens that followed the
latest earlier occurrence of the session's last n tokens in its committed tokens; while the
draft draws exactly those, it needs no further pass. Every token is still drawn from the draft's
distribution at its position and sent with it, so the output stays exactly the target's; the
block is the one a pass per token drafts, up to the numerics of a wider pass (a dynamically
quantised int8 draft scales its activations per pass, so a near tie may go the other way). A
draft of another vocabulary does not guess (its cache is cut back to re-tokenised text every
round, which would rebuild the index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from specdec.runtime.grammar import constrain
from specdec.runtime.kvcache import ResyncRequired, SessionCache, SessionCaches
from specdec.runtime.lookup import GuessIndex
from specdec.runtime.modeling import LoadedModel
from specdec.runtime.processing import NO_PROCESSING, Processing, process_logits
from specdec.runtime.sampling import DraftSample, Warp, position_generator, proposal_probability, sample_draft_token
from specdec.runtime.scheduler import ComputeMeter, Extend, Job
from specdec.runtime.tokens import common_prefix_len
from specdec.runtime.vocab import TextMirror, VocabBridge
from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class DraftParams:
    """How to sample a block (shared by a stream's requests)."""

    k: int
    warp: Warp
    seed: int
    top_n: int
    vocab_limit: int = 0  # propose only ids below this (the target's vocabulary size); 0 = all
    processing: Processing = NO_PROCESSING  # the target's penalties / bias / min_tokens
    min_confidence: float = 0.0  # end the block after a token proposed with a lower probability
    min_block_confidence: float = 0.0  # end it once the product of its tokens' probabilities is lower
    guess_tokens: int = 0  # guess up to this many tokens ahead per pass from the session's n-grams; 0 = off
    report_stops_only: bool = False  # the stops only say where they would end the block (``Block.unsure_at``)


@dataclass(frozen=True)
class Block:
    """A drafted block.

    ``start``: committed length it was drafted after; ``assumed``: for a lookahead block, the tokens
    assumed between the previous block's start and ``start`` (empty otherwise). ``cache_len`` and
    ``cache_hash`` describe the draft's cache afterwards (it holds everything but the last draft).
    """

    samples: tuple[DraftSample, ...]
    start: int
    assumed: tuple[int, ...]
    cache_len: int
    cache_hash: int
    compute_ms: float
    ends_unsure: bool = False  # a confidence stop was reached at the last token
    unsure_at: int = 0  # the first sample (1 = the first) at which a confidence stop was reached; 0 = none
    computed_tokens: int = 0  # tokens run through the model for it (guesses included)
    guessed: int = 0  # guessed tokens run (see _draft_block)
    guesses_taken: int = 0  # draft tokens whose pass a right guess saved

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.samples]


@dataclass(frozen=True)
class Resync:
    """The cache did not hold the committed prefix: the caller resends it from ``start`` tokens
    (a shorter prefix the cache can still start from; 0: all of it)."""

    start: int = 0


@dataclass(frozen=True)
class Drafted:
    """What ``_draft_block`` drew: the samples, whether a confidence stop was reached at the last
    one, how many guessed tokens its passes ran and the samples (their indexes) whose pass a right
    guess saved (each drawn from the row computed for the guess); ``unsure_at``: the first sample
    (1 = the first) at which a stop was reached, 0 = none."""

    samples: list[DraftSample]
    unsure: bool
    guessed: int = 0
    taken: tuple[int, ...] = ()
    unsure_at: int = 0


Shape = Callable[[SessionCache, torch.Tensor, DraftParams, int], torch.Tensor]

GUESS_NGRAM = (2, 4)  # sizes of the n-grams a guess ahead is looked up by (the longest that occurs wins)
# A guessed row is run while its chance of being used is at least this: on the 2-core CPU host an
# int8 0.5B draft pass of 1 token took 37 ms, of 2 43 ms and of 9 60 ms (about 3 ms a row after
# the second): a row used saves a pass, so rows used less than ~1 time in 10 cost more than they save.
GUESS_MIN_USE = 0.1


def _draft_block(
    entry: SessionCache,
    feed: list[int],
    params: DraftParams,
    start: int,
    device: torch.device,
    meter: ComputeMeter,
    shape: Shape | None = None,
) -> Generator[Extend, torch.Tensor, Drafted]:
    """Runs ``feed`` (the tokens the cache lacks) and samples up to ``params.k`` tokens after
    it, the first at position ``start`` of the session (its generator's position). ``shape``
    turns a position's logits into those sampled from (default: the target's processing). With
    ``params.min_confidence`` the block ends after the first token proposed with a lower
    probability; with ``params.min_block_confidence``, after the token that takes the product of
    the block's proposal probabilities (the draft's estimate of the chance that the target keeps
    the whole block) below it. The block's length then depends on the draft alone (never on the
    target), so every proposed token is verified as usual and the output distribution is
    unchanged. With ``params.report_stops_only`` the block runs to ``params.k`` and the stops only
    record where they would have ended it (``Drafted.unsure_at``).

    With ``params.guess_tokens`` and an n-gram index on ``entry`` (``entry.guesses``), each pass
    also runs a guess of the tokens the draft will sample next: what followed the latest earlier
    occurrence of the session's last tokens. Where the draft's sample equals the guess, the
    distribution of the next position is already computed and a pass is saved; at the first
    difference the guesses after it are cut from the cache. Every token is still sampled from the
    draft's own distribution at its position, with its position's generator, so the block is the
    one drafting a token per pass gives (the guess only decides how many positions a pass
    computes; see the module doc for numerics). How many guessed tokens a pass runs follows the
    session's rate of right guesses (``GuessIndex.rows``), which every draw updates. The cache
    then holds everything up to the block's last token, without it."""
    shape = shape or _processed
    samples: list[DraftSample] = []
    unsure, unsure_at, block_probability = False, 0, 1.0
    base = len(entry.tokens) + len(feed)  # the cache's length at the block's first token
    offers = [(0, _guess(entry, feed, params.guess_tokens, params.k - 1))]  # (first sample, guess)
    guesses = _worth_running(entry, offers[-1][1])
    guessed, taken = len(guesses), []
    rows = list((yield Extend(entry, [*feed, *guesses], 1 + len(guesses), meter)))
    for i in range(params.k):
        generator = None if params.warp.greedy else position_generator(params.seed, start + i, "draft", device)
        shaped = shape(entry, rows.pop(0), params, base + i)
        sample = sample_draft_token(shaped, params.warp, params.top_n, generator)
        samples.append(sample)
        if params.min_confidence > 0 or params.min_block_confidence > 0:
            probability = proposal_probability(sample, shaped, params.warp)
            block_probability *= probability
            unsure = probability < params.min_confidence or block_probability < params.min_block_confidence
            unsure_at = unsure_at or (i + 1 if unsure else 0)
            unsure = unsure and not params.report_stops_only
        if i + 1 == params.k or unsure:
            break
        if guesses and guesses[0] == sample.token_id:
            guesses.pop(0)  # the guess was this token: the next position's logits are in `rows`
            taken.append(i + 1)
            continue
        entry.truncate(base + i)  # the guesses from here on were wrong
        offers.append((i + 1, _guess(entry, [sample.token_id], params.guess_tokens, params.k - i - 2)))
        guesses = _worth_running(entry, offers[-1][1])
        guessed += len(guesses)
        rows = list((yield Extend(entry, [sample.token_id, *guesses], 1 + len(guesses), meter)))
    entry.truncate(base + len(samples) - 1)
    if entry.guesses is not None:
        drawn = [s.token_id for s in samples]
        for (first, guess), (after, _) in zip(offers, [*offers[1:], (len(drawn), [])], strict=True):
            entry.guesses.score(guess, drawn[first:after])
    return Drafted(samples, unsure, guessed, tuple(taken), unsure_at)


def _guess(entry: SessionCache, feed: list[int], limit: int, room: int) -> list[int]:
    """Up to ``min(limit, room)`` tokens guessed to follow ``entry.tokens + feed``, from the
    session's n-gram index (none without one)."""
    if entry.guesses is None or min(limit, room) <= 0:
        return []
    suffix = [*entry.tokens[len(entry.tokens) - GUESS_NGRAM[1] :], *feed]
    return entry.guesses.ngrams.continuation(suffix, min(limit, room))


def _worth_running(entry: SessionCache, guess: list[int]) -> list[int]:
    """The first tokens of ``guess`` the session's rate of right guesses makes worth running."""
    return guess[: entry.guesses.rows(len(guess))] if entry.guesses is not None else []


def _index_committed(entry: SessionCache, tail: list[int], params: DraftParams) -> None:
    """When the draft guesses ahead, makes ``entry.guesses`` an n-gram index of the committed
    tokens: those in the cache (just synced to the committed prefix) and the ``tail`` after them.
    An index left longer than the cache (a job cancelled before its first pass) is dropped by the
    next sync's truncate."""
    if not params.guess_tokens:
        return
    if entry.guesses is None:
        entry.guesses = GuessIndex(*GUESS_NGRAM, min_use=GUESS_MIN_USE)
    entry.guesses.ngrams.extend(entry.tokens[len(entry.guesses) :])
    entry.guesses.ngrams.extend(tail)


def _processed(entry: SessionCache, logits: torch.Tensor, params: DraftParams, position: int) -> torch.Tensor:
    """The logits of the token at ``position`` (after ``entry.tokens[:position]``) processed as
    the target will process them, restricted to the ids the target can verify."""
    p = params.processing
    rows = process_logits(logits[None], entry.tokens, position, p, entry.counts)
    rows = constrain(rows, entry.grammar, entry.tokens, position, p.grammar, p.reply_start, strict=False)
    return _proposable(rows[0], params)


def _proposable(logits: torch.Tensor, params: DraftParams) -> torch.Tensor:
    """The logits of the ids the target can verify: a draft whose output layer is padded to more
    rows than the target's proposes none of the extra ones (its proposal is then a distribution
    over the target's ids, so exactness holds; a shorter draft vocabulary needs nothing: the ids it
    lacks simply get probability 0)."""
    return logits[: params.vocab_limit] if 0 < params.vocab_limit < logits.shape[-1] else logits


def _finish(entry: SessionCache, drafted: Drafted, start: int, assumed: Sequence[int], meter: ComputeMeter) -> Block:
    return Block(
        samples=tuple(drafted.samples),
        start=start,
        assumed=tuple(assumed),
        cache_len=len(entry.tokens),
        cache_hash=entry.hashes.of(entry.tokens, len(entry.tokens)),
        compute_ms=meter.ms,
        ends_unsure=drafted.unsure,
        unsure_at=drafted.unsure_at,
        computed_tokens=meter.tokens,
        guessed=drafted.guessed,
        guesses_taken=len(drafted.taken),
    )


def propose_job(
    caches: SessionCaches,
    loaded: LoadedModel,
    session_id: str,
    sync: common_pb2.PrefixSync,
    params: DraftParams,
) -> Job[Block | Resync]:
    """K draft tokens after the committed prefix ``sync`` describes, or where to resend it from."""
    meter = ComputeMeter()
    try:
        entry = caches.sync(
            session_id, sync.base_len, sync.prefix_hash, sync.source_session_id, sync.prompt_len, sync.shared_len
        )
    except ResyncRequired as exc:
        return Resync(exc.start)
    feed, start = list(sync.tail_token_ids), sync.base_len + len(sync.tail_token_ids)
    _index_committed(entry, feed, params)
    drafted = yield from _draft_block(entry, feed, params, start, loaded.device, meter)
    return _finish(entry, drafted, start, (), meter)


def lookahead_job(
    caches: SessionCaches, loaded: LoadedModel, session_id: str, previous: Block, params: DraftParams
) -> Job[Block | None]:
    """The block after ``previous`` + the draft's guess of the next token; None if the cache moved on."""
    meter = ComputeMeter()
    try:
        entry = caches.sync(session_id, previous.cache_len, previous.cache_hash)
    except ResyncRequired:
        return None
    last = previous.samples[-1].token_id
    guess_logits = (yield Extend(entry, [last], 1, meter))[-1]
    guess = int(_processed(entry, guess_logits, params, len(entry.tokens)).argmax())  # any warp keeps it
    assumed = (*previous.token_ids, guess)
    start = previous.start + len(assumed)
    drafted = yield from _draft_block(entry, [guess], params, start, loaded.device, meter)
    return _finish(entry, drafted, start, assumed, meter)


def translated_propose_job(
    caches: SessionCaches,
    loaded: LoadedModel,
    bridge: VocabBridge,
    session_id: str,
    sync: common_pb2.PrefixSync,
    params: DraftParams,
) -> Job[Block | Resync]:
    """Up to K proposals in the target's ids after the committed prefix ``sync`` describes (in
    target ids), from a draft of another vocabulary, or where to resend it from (always 0).

    The session's mirror turns the committed ids into text and the text into the draft's own
    tokens; the cache keeps what it shares with them (after a partly accepted block, the draft
    tokens of the accepted text) and runs the rest. TLI samples only draft tokens that are
    also target tokens and sends their distribution in target ids; SLEM drafts greedily in its
    own vocabulary and sends the target's tokenization of the drafted text, one-hot. The target's
    history-dependent processing (penalties, bias, min_tokens) is not applied here (it is defined
    on target ids); it only costs acceptance, never exactness. A block may hold fewer than K
    tokens (SLEM's text may tokenize shorter; none while the text ends inside a character).
    """
    meter = ComputeMeter()
    start = sync.base_len + len(sync.tail_token_ids)
    if sync.base_len == 0:
        entry = caches.sync(session_id, 0, 0)
        mirror = entry.mirror = TextMirror(bridge)
    else:
        held = caches.get(session_id)
        if held is None or held.mirror is None or not held.mirror.holds(sync.base_len, sync.prefix_hash):
            caches.release(session_id)
            return Resync()
        entry, mirror = held, held.mirror
    mirror.update(sync.base_len, sync.tail_token_ids)
    wanted = mirror.draft_ids
    if not wanted or (bridge.method == "slem" and mirror.pending):
        return Block((), start, (), start, 0, meter.ms)
    if len(wanted) + params.k > loaded.max_context_len:
        raise InvalidRequest(
            f"the session's text is {len(wanted)} tokens for the draft model, whose context is "
            f"{loaded.max_context_len}: it cannot draft {params.k} more"
        )
    keep = min(common_prefix_len(entry.tokens, wanted), len(wanted) - 1)
    if not entry.reaches(keep):  # a windowed layer's cache cannot be cut back that far
        caches.release(session_id)
        return Resync()
    entry.truncate(keep)
    feed, own = wanted[keep:], dataclasses.replace(params, guess_tokens=0)  # no guesses: see the module doc
    if bridge.method == "slem":
        greedy = dataclasses.replace(own, warp=Warp())
        drafted = yield from _draft_block(entry, feed, greedy, start, loaded.device, meter, _unshaped)
        proposed = mirror.slem_targets([s.token_id for s in drafted.samples], params.k)
        samples = tuple(DraftSample(token_id=t) for t in proposed)
        drafted = dataclasses.replace(drafted, unsure_at=0)  # its positions are the draft's tokens, not these
    else:
        barred = ~bridge.proposable(params.vocab_limit, loaded.device)

        def intersect(_: SessionCache, row: torch.Tensor, __: DraftParams, ___: int) -> torch.Tensor:
            return row.masked_fill(barred, float("-inf"))

        drafted = yield from _draft_block(entry, feed, own, start, loaded.device, meter, intersect)
        samples = tuple(_in_target_ids(s, bridge.id_map(loaded.device)) for s in drafted.samples)
    return Block(
        samples, start, (), cache_len=start, cache_hash=0, compute_ms=meter.ms, ends_unsure=drafted.unsure,
        unsure_at=drafted.unsure_at, computed_tokens=meter.tokens,
    )  # fmt: skip


def _unshaped(_: SessionCache, logits: torch.Tensor, __: DraftParams, ___: int) -> torch.Tensor:
    return logits


def _in_target_ids(sample: DraftSample, draft_to_target: torch.Tensor) -> DraftSample:
    """A TLI draft sample in target ids: the proposal keeps its probabilities (all on draft ids
    that are target tokens); the ids with probability 0 are left out."""
    token = int(draft_to_target[sample.token_id])
    if sample.probs is None:
        return DraftSample(token_id=token)
    probs = sample.probs
    ids = sample.ids if sample.ids is not None else torch.arange(probs.shape[0], device=probs.device)
    nonzero = probs > 0
    return DraftSample(token_id=token, ids=draft_to_target[ids[nonzero]], probs=probs[nonzero])
