"""A turn's view of the session's caches in the workers, and the calls that use them.

The coordinator tracks, per worker, how many committed tokens that worker's cache holds. Each
call sends the committed prefix as (base_len, prefix hash, tail); a worker that cannot prove it
holds the prefix answers RESYNC_REQUIRED and is sent everything (base_len 0), or the tokens after
a shorter prefix it says it can start from (``resync_from``: a windowed model's copy at a prompt's
end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from coordinator.adaptive import MODEL, NGRAM, NO_STOP, PREFILL_MIN_TOKENS, ConfidenceStop, StepCosts
from coordinator.workers import (
    NO_GRAMMAR_REPLICA,
    DraftClient,
    DraftPool,
    DraftStream,
    GrammarsRefused,
    TargetClient,
    TargetPool,
    WorkerCallFailed,
    keep_running,
    place,
)
from specdec.runtime.logprobs import LogprobsAsk
from specdec.runtime.processing import NO_PROCESSING, Processing, processing_to_proto
from specdec.runtime.proposals import warp_to_proto
from specdec.runtime.sampling import Warp
from specdec.runtime.tokens import PrefixHashes, common_prefix_len
from specdec.serving.errors import DeadlineExceeded, SpecdecError, WorkerFailed, WorkerTimedOut, WorkerUnavailable
from specdec.serving.metrics import CoordinatorMetrics
from specdec.state import CacheLocation, PrefixLocation
from specdec.v1 import common_pb2, draft_pb2, target_pb2

log = structlog.get_logger(__name__)
T = TypeVar("T")

# How often a turn waiting for the draft's block checks whether it should stop waiting (``give_up``).
GIVE_UP_POLL_S = 0.05


class _GaveUp(Exception):
    """The turn stopped waiting for the draft's block (``propose``'s ``give_up`` said so)."""


async def _unless(work: Coroutine[Any, Any, T], give_up: Callable[[], bool]) -> T:
    """``work``'s result, unless ``give_up`` (asked every GIVE_UP_POLL_S) says to stop waiting
    first: then ``work`` is cancelled and _GaveUp raised."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            if give_up():
                raise _GaveUp
            await asyncio.wait({task}, timeout=GIVE_UP_POLL_S)
        return task.result()
    finally:
        if not task.done():  # given up, or this coroutine was cancelled itself
            task.cancel()


_VERIFY_RETRY_PAUSE_S = 0.1
# A call that must compute a prefix of at least PREFILL_MIN_TOKENS first gets this many times its
# measured cost on top of its timeout (a long prompt's attention costs more per token than the
# shorter ones measured); fewer tokens are a round's work, which the timeout itself covers.
_PREFILL_MARGIN = 4


@dataclass(frozen=True)
class Decoding:
    """How a turn samples (both workers get it with every call), and where the draft model ends a
    block early (speed only)."""

    warp: Warp
    seed: int
    processing: Processing = NO_PROCESSING
    stop: ConfidenceStop = NO_STOP


@dataclass
class Proposal:
    """A draft block: drafted after ``start`` committed tokens; the draft's cache length after it;
    the draft's model time and the tokens it ran for the block; whether it was drafted ahead; who
    drafted it (``model``: the draft worker, ``ngram``: a lookup in the coordinator)."""

    block: common_pb2.DraftBlock
    cache_len: int
    start: int
    compute_ms: float
    computed: int
    pipelined: bool = False
    method: str = MODEL
    ends_unsure: bool = False  # the draft reached a confidence stop at the block's last token
    # where in the block the draft drafted (1 = its first token) a stop, applied or reported, was
    # first reached; 0 = nowhere (KController.observe sets aside one past the block it was given)
    unsure_at: int = 0


def lookup_proposal(token_ids: list[int], start: int) -> Proposal:
    """A lookup draft: one-hot proposals (each token had probability 1 under the proposer)."""
    block = common_pb2.DraftBlock(token_ids=token_ids, kind=common_pb2.PROPOSAL_KIND_ONE_HOT)
    return Proposal(block, cache_len=0, start=start, compute_ms=0.0, computed=0, method=NGRAM)


def _draft_holds(proposal: Proposal, committed: list[int]) -> int:
    """The committed tokens the draft's cache holds after drafting ``proposal``: those it was
    drafted after, then the drafts it kept in its cache as far as the committed tokens agree."""
    in_cache = list(proposal.block.token_ids[: proposal.cache_len - proposal.start])
    return proposal.start + common_prefix_len(in_cache, committed[proposal.start :])


def _prefill_ms(costs: StepCosts | None, prefill: int, context: int, draft: bool = False) -> float:
    """The expected milliseconds of the ``prefill`` tokens a call must compute first (leaving
    ``context`` tokens in the cache); 0 for a round's few tokens or before any rate is known."""
    if prefill < PREFILL_MIN_TOKENS or costs is None:
        return 0.0
    return costs.prefill_ms(prefill, context, draft) or 0.0


def _allowance(
    costs: StepCosts | None, prefill: int, context: int, draft: bool = False, ahead_ms: float = 0.0
) -> float:
    """Seconds a call gets on top of its timeout for its prefill and, since the worker computes
    long prompts one after another, for the prefills sent to the replica ahead of it."""
    expected_ms = _prefill_ms(costs, prefill, context, draft)
    return _PREFILL_MARGIN * (expected_ms + ahead_ms) / 1000 if expected_ms else 0.0


def _first(block: common_pb2.DraftBlock, k: int) -> common_pb2.DraftBlock:
    """The first ``k`` drafts of a block (still a valid proposal: each came from its own row of q)."""
    if len(block.token_ids) <= k:
        return block
    return common_pb2.DraftBlock(token_ids=block.token_ids[:k], kind=block.kind, proposals=block.proposals[:k])


@dataclass
class SyncCounters:
    """What the calls did besides their job (reported in SpeculationStats)."""

    target_passes: int = 0
    resyncs: int = 0


def prefix_sync(
    committed: list[int],
    cached: int,
    source: str = "",
    hashes: PrefixHashes | None = None,
    prompt_len: int = 0,
    shared_len: int = 0,
) -> common_pb2.PrefixSync:
    """The prefix sync for a worker holding ``cached`` committed tokens (the tail >= 1 token),
    possibly in the cache of session ``source`` (prefix reuse); ``hashes``: kept over the turn's
    committed tokens (which a turn only appends to), so a round hashes only what it added;
    ``prompt_len``: where the turn's prompt ends, ``shared_len``: where a prefix of it that other
    requests share ends (the worker keeps its cache reachable at both)."""
    base = min(cached, len(committed) - 1)
    return common_pb2.PrefixSync(
        base_len=base,
        prefix_hash=(hashes or PrefixHashes()).of(committed, base),
        tail_token_ids=committed[base:],
        source_session_id=source if base else "",
        prompt_len=prompt_len,
        shared_len=shared_len,
    )


class WorkerSession:
    """One turn's handle on a session's draft and target caches."""

    def __init__(
        self,
        session_id: str,
        targets: TargetPool,
        drafts: DraftPool | None,
        metrics: CoordinatorMetrics,
        worker_timeout_s: float,
        deadline: float | None,
        pipelined: bool = False,
        costs: StepCosts | None = None,
        constrained: bool = False,
        coordinator_id: str = "",
    ) -> None:
        """``deadline``: the caller's deadline (event-loop time), None for none; ``costs``: the
        measured model costs (a call that prefills gets the time its tokens are expected to take);
        ``constrained``: the turn has a structured-output grammar, so only target replicas that
        apply grammars verify it; ``coordinator_id``: this coordinator's (``LoadLimit``'s), sent
        with each verify beside its turns on the replica called (the reply's count of all
        coordinators' requests on that replica is kept for ``target_requests``); empty: neither
        is sent."""
        self.session_id = session_id
        self.constrained = constrained
        self._targets = targets
        self._drafts = drafts
        self._target: TargetClient | None = None  # the target replica holding target_len of the session
        self._draft: DraftClient | None = None  # the draft replica the session drafts on (holds draft_len)
        self._holding = True  # counted in its replicas' turns until ``unbind``
        self._pipelined = pipelined
        self._last: Proposal | None = None
        self._lookahead_round: int | None = None
        # a long prefix sent to the draft without waiting for it (``draft_behind``): its block, or
        # why the draft failed it
        self._catch_up: asyncio.Task[Proposal | WorkerCallFailed] | None = None
        # the committed tokens it sends, and the wall-clock time by which the draft has them or
        # has given up (its call's time limit)
        self._catch_up_len, self._catch_up_by = 0, 0.0
        # the wall-clock time by which the draft has computed what an earlier turn of the session
        # sent it without waiting (CacheLocation.ready_by): calls wait behind it until then
        self._draft_ready_by = 0.0
        self._metrics = metrics
        self._worker_timeout_s = worker_timeout_s
        self._costs = costs
        self._coordinator_id = coordinator_id
        # requests of all coordinators on a target replica, from its last verify reply: (address, count)
        self._reported: tuple[str, int] = ("", 0)
        self._deadline = deadline
        self._stream: DraftStream | None = None
        self._draft_refused = False  # the draft failed one of this turn's requests: target-only for the rest
        self.gave_up = False  # the last ``propose`` stopped waiting for the draft (its ``give_up``)
        self.counters = SyncCounters()
        self.target_len = 0
        self.draft_len = 0
        # prefix reuse: the other session whose caches hold target_len / draft_len of our tokens
        self._target_source = self._draft_source = ""
        # the longest prefix of the prompt found cached for other sessions (prefix reuse): after a
        # resync, the worker is asked to keep a copy of its windowed layers there for the next request
        self.shared_len = 0
        self._target_hashes, self._draft_hashes = PrefixHashes(), PrefixHashes()  # of the turn's committed tokens

    def _caller_left(self) -> float:
        """Seconds until the caller's deadline (inf without one)."""
        if self._deadline is None:
            return float("inf")
        return self._deadline - asyncio.get_running_loop().time()

    def time_left(self, prefill: int = 0, context: int = 0, ahead_ms: float = 0.0) -> float:
        """A call's time limit: --worker-timeout-s, plus _PREFILL_MARGIN times the expected time of
        the ``prefill`` tokens the target must compute first, up to ``context`` tokens, and of the
        prefills ahead of it (a long prompt on a slow target is not a hung worker), capped by the
        caller's deadline."""
        allowance = _allowance(self._costs, prefill, context, ahead_ms=ahead_ms)
        return max(min(self._worker_timeout_s + allowance, self._caller_left()), 0.001)

    @property
    def target_address(self) -> str | None:
        return self._target.address if self._target is not None else None

    @property
    def target_requests(self) -> int:
        """Requests generating on the session's target replica: this coordinator's turns there and
        the others' as the replica last counted them to any of its turns (``TargetClient.requests``)
        or, when more, all coordinators' as its last verify reply to this session counted them (0
        before the turn has a replica)."""
        if self._target is None:
            return 0
        address, reported = self._reported
        return max(self._target.requests, reported if address == self._target.address else 0)

    def _bind(self, old: TargetClient | DraftClient | None, new: TargetClient | DraftClient) -> None:
        """Moves this turn's count in the replicas' turns from ``old`` to ``new``."""
        if self._holding and new is not old:
            if old is not None:
                self._count(old, -1)
            self._count(new, 1)

    def _count(self, replica: TargetClient | DraftClient, step: int) -> None:
        replica.turns += step
        self._metrics.replica_turns.labels(replica.role, replica.address).inc(step)

    def _set_target(self, replica: TargetClient) -> None:
        self._bind(self._target, replica)
        self._target = replica

    def _set_draft(self, replica: DraftClient) -> None:
        self._bind(self._draft, replica)
        self._draft = replica

    def unbind(self) -> None:
        """The turn is over: no longer counted in its replicas' turns."""
        for replica in (self._target, self._draft):
            if self._holding and replica is not None:
                self._count(replica, -1)
        self._holding = False

    def restore(self, target: CacheLocation | None, draft: CacheLocation | None) -> None:
        """Adopts the cache locations recorded in the session state."""
        if target is not None and (replica := self._targets.get(target.address)):
            self._set_target(replica)
            self.target_len, self._target_source = target.length, target.source
        if draft is not None and self._drafts is not None and (other := self._drafts.get(draft.address)):
            self._set_draft(other)
            self.draft_len, self._draft_source = draft.length, draft.source
            self._draft_ready_by = draft.ready_by

    def place(self, found: Sequence[tuple[PrefixLocation, int]]) -> None:
        """Chooses the target and draft replicas of a session with nothing of its own cached, by
        ``place``: where the longest prefix of its prompt is cached unless that replica is clearly
        busier (``found``: other sessions' caches holding the first ``length`` committed tokens,
        prefix reuse); the workers check a prefix's hash and copy the cache, or ask to resync."""
        targets: dict[str, tuple[int, str]] = {}
        drafts: dict[str, tuple[int, str]] = {}
        for location, length in found:
            for cached, where in ((targets, location.target), (drafts, location.draft)):
                if where is not None and min(length, where.length) > cached.get(where.address, (0, ""))[0]:
                    cached[where.address] = (min(length, where.length), where.source or location.cache_id)
        target = place(self._target_replicas(), self.session_id, {a: n for a, (n, _) in targets.items()})
        if target is not None:
            self._set_target(target)
            self.target_len, self._target_source = targets.get(target.address, (0, ""))
        if self._drafts is not None:
            draft = place(self._drafts.replicas, self.session_id, {a: n for a, (n, _) in drafts.items()})
            if draft is not None:
                self._set_draft(draft)
                self.draft_len, self._draft_source = drafts.get(draft.address, (0, ""))

    def _target_replicas(self, order: Sequence[TargetClient] | None = None) -> list[TargetClient]:
        """The target replicas (in ``order``, else the pool's) that may verify this turn: those
        known to apply grammars when it is constrained, else all."""
        replicas = self._targets.replicas if order is None else order
        return [r for r in replicas if r.grammars or not self.constrained]

    def locations(self) -> tuple[CacheLocation | None, CacheLocation | None]:
        """Cache locations to record with a commit (and for later requests to start from): a
        worker that has not run since the session found a prefix in another one's cache holds
        nothing of it, so its location names that cache (a request whose draft never ran)."""
        target = CacheLocation(self._target.address, self.target_len, self._target_source) if self._target else None
        draft = None
        if self._draft is not None:
            # what the draft is computing counts as held: a turn that ends meanwhile leaves it
            # to finish (``close_stream``); a claim the draft turns out not to hold costs a resync.
            # Else what an earlier turn left it computing, until a call of this turn is answered
            # (a turn that never calls the draft keeps it for the next)
            length, ready_by = (
                (self._catch_up_len, self._catch_up_by) if self.catching_up else (self.draft_len, self._draft_ready_by)
            )
            draft = CacheLocation(self._draft.address, length, self._draft_source, ready_by)
        return target, draft

    def forget_caches(self) -> None:
        self.target_len = self.draft_len = 0
        self._target_source = self._draft_source = ""

    @property
    def draft_usable(self) -> bool:
        return self._drafts is not None and self._drafts.usable and not self._draft_refused

    def _choose_draft(self) -> DraftClient | None:
        """The replica to draft on: the session's own while it is up, else one that ``place``
        picks among those up (its draft cache is then rebuilt there)."""
        assert self._drafts is not None
        if self._draft is not None and self._draft.usable:
            return self._draft
        chosen = place(self._drafts.replicas, self.session_id, {})
        if chosen is not None:
            self._set_draft(chosen)
            self.draft_len, self._draft_source, self._draft_ready_by = 0, "", 0.0
        return chosen

    def _open_stream(self) -> bool:
        """Opens the turn's draft stream if it has none; False when no draft replica is up."""
        if self._stream is None:
            draft = self._choose_draft()
            if draft is None:
                return False  # every replica went down since the round asked
            self._stream = draft.open_stream()
        return True

    def draft_behind(self, committed: list[int], decoding: Decoding, round_id: int) -> bool:
        """Whether this round goes without the draft model because the draft is computing a long
        prefix of the session that it was sent without waiting (a prompt, a resync). Pipelined
        only (the draft on other hardware than the target): when the draft must compute at least
        PREFILL_MIN_TOKENS tokens, expected (with the prefills sent to it ahead) to take longer than
        a target-only round, the prefix is sent (with a one-token block, which is not used) and
        the rounds decode without the draft until it has answered; then it drafts from there.
        Waiting instead held every such round, a turn's first reply included, for the draft's
        whole prefill."""
        pending = self._catch_up
        if pending is not None and (not pending.done() or not self._caught_up(pending.result(), committed)):
            return True  # still computing, or it failed (the next round's plan sees the draft out of use)
        tail = self._draft_lacks(committed)
        # a call now would also wait for what an earlier turn left the draft computing
        behind = self._outlasts_a_round(tail, len(committed)) or (self._pipelined and self._draft_waits_s() > 0)
        if not behind or not self._open_stream():
            return False
        self._send_prefix(committed, decoding, round_id)
        return True

    @property
    def catching_up(self) -> bool:
        """Whether a prefix sent to the draft without waiting has not been answered yet."""
        return self._catch_up is not None and not self._catch_up.done()

    def _draft_lacks(self, committed: list[int]) -> int:
        """The committed tokens a call must send the draft (at least the last)."""
        return len(committed) - min(self.draft_len, len(committed) - 1)

    def _draft_waits_s(self) -> float:
        """How much longer the draft may compute what an earlier turn of the session sent it
        without waiting (until it has answered this turn once)."""
        return max(self._draft_ready_by - time.time(), 0.0)

    def _outlasts_a_round(self, tail: int, context: int) -> bool:
        """Whether the draft, computing ``tail`` committed tokens it lacks (of ``context``) and the
        prefills queued ahead of them, is expected to take longer than a target-only round, in a
        pipelined turn (the draft on other hardware: the rounds can go on meanwhile)."""
        if not self._pipelined or self._costs is None:
            return False
        prefill, step = _prefill_ms(self._costs, tail, context, draft=True), self._costs.verify_ms(1)
        if not prefill or step is None:  # a round's few tokens, or no rate known yet
            return False
        ahead = self._draft.prefills.ahead_ms if self._draft is not None else 0.0
        return prefill + ahead > step + self._costs.overhead_ms(drafted=False)

    def _send_prefix(self, committed: list[int], decoding: Decoding, round_id: int, resend: bool = False) -> None:
        """Sends the committed tokens the draft lacks without waiting (``resend``: it asked for
        them again); ``draft_behind`` takes the answer."""

        prefix = list(committed)  # the turn appends to its list meanwhile
        assert self._draft is not None
        limit_s = self._draft_patience_s(self._draft_lacks(prefix), len(prefix), self._draft.prefills.ahead_ms)

        async def send() -> Proposal | WorkerCallFailed:
            try:
                block = await self._request_block(
                    prefix, 1, decoding, round_id, lookahead=False, resend=resend, for_later=True
                )
            except WorkerCallFailed as exc:
                return exc
            assert block is not None  # only a call with catch_up defers
            return block

        self._catch_up = asyncio.create_task(send())
        self._catch_up_len, self._catch_up_by = len(prefix), time.time() + limit_s

    def _caught_up(self, answer: Proposal | WorkerCallFailed, committed: list[int]) -> bool:
        """Takes the draft's answer to a prefix sent without waiting: whether the draft holds the
        prefix (and its one drafted token, if the target committed that one too), else it failed."""
        self._catch_up = None
        if isinstance(answer, WorkerCallFailed):
            self._draft_failed(answer)
            return False
        self.draft_len = _draft_holds(answer, committed)
        self._time_prefill(answer)
        return True

    def _time_prefill(self, answer: Proposal) -> None:
        """A prefix sent without waiting was computed: its pass is the draft's prefill rate."""
        if self._costs is not None:
            self._costs.observe_prefill(answer.computed, answer.compute_ms, draft=True)

    async def propose(
        self,
        committed: list[int],
        k: int,
        decoding: Decoding,
        round_id: int,
        catch_up: bool = False,
        give_up: Callable[[], bool] | None = None,
    ) -> Proposal | None:
        """K draft tokens, or None when the draft failed (the round then decodes target-only).

        Pipelined: if the previous block was fully accepted and the draft's guess of the target's
        next token was right, the block drafted ahead is used at once. With ``catch_up``, a draft
        that asks for more of the committed tokens again (its cache was freed) than it computes
        in a target-only round is sent them without waiting (``draft_behind``), and this round
        goes without it (None; ``catching_up`` tells that from a failure).

        ``give_up`` is asked every GIVE_UP_POLL_S while the block is awaited: once it says so, the
        draft's call is cancelled (its job dropped, nothing of the draft's blamed) and None comes
        back at once, with ``gave_up`` set (a request that would now wait on the draft's prefills
        while the load limit says decode target-only).
        """
        self.gave_up = False
        try:
            if not self._open_stream():
                return None
            proposal = await self._adopt_lookahead(committed, k, round_id) if self._pipelined else None
            if proposal is None:
                proposal = await self._request_block(
                    committed, k, decoding, round_id, catch_up=catch_up, give_up=give_up
                )
            if proposal is None:
                self._send_prefix(committed, decoding, round_id, resend=True)
                return None
        except WorkerCallFailed as exc:
            return self._draft_failed(exc)
        except _GaveUp:
            self.gave_up = True
            self._drop_stream()
            return None
        self._last = proposal
        return proposal

    def _draft_patience_s(self, prefill: int = 0, context: int = 0, ahead_ms: float = 0.0) -> float:
        """How long the draft may take: its patience, plus the allowance for ``prefill`` tokens it
        must compute first, up to ``context``, the prefills ahead of them and what an earlier turn
        left it computing (a long prompt is not a hung draft)."""
        assert self._draft is not None
        allowance = _allowance(self._costs, prefill, context, draft=True, ahead_ms=ahead_ms) + self._draft_waits_s()
        return self._draft.patience_s + allowance

    def _draft_timeout(
        self, prefill: int = 0, context: int = 0, ahead_ms: float = 0.0, for_later: bool = False
    ) -> tuple[float, bool]:
        """How long to wait for the draft (``_draft_patience_s``), and whether that is the
        caller's deadline talking; ``for_later``: a call for the session's later turns (a prefix
        sent without waiting), which the caller's deadline does not bound."""
        patience, left = self._draft_patience_s(prefill, context, ahead_ms), self._caller_left()
        return (max(left, 0.001), True) if left < patience and not for_later else (patience, False)

    async def _send(self, request: draft_pb2.ProposeRequest, for_later: bool = False) -> None:
        assert self._stream is not None
        await self._stream.send(request, *self._draft_timeout(for_later=for_later))

    async def _read(
        self,
        wanted: Callable[[draft_pb2.ProposeResponse], bool],
        prefill: int = 0,
        context: int = 0,
        ahead_ms: float = 0.0,
        for_later: bool = False,
        give_up: Callable[[], bool] | None = None,
    ) -> draft_pb2.ProposeResponse:
        """The next reply that ``wanted`` accepts; late replies of earlier rounds are dropped.
        Raises _GaveUp once ``give_up`` says so (asked every GIVE_UP_POLL_S)."""
        assert self._stream is not None
        while True:
            receiving = self._stream.receive(*self._draft_timeout(prefill, context, ahead_ms, for_later))
            reply = await (receiving if give_up is None else _unless(receiving, give_up))
            if wanted(reply):
                return reply
            log.debug("stale_draft_reply", round_id=reply.round_id, lookahead=reply.lookahead)

    async def _adopt_lookahead(self, committed: list[int], k: int, round_id: int) -> Proposal | None:
        last, expected_round = self._last, self._lookahead_round
        if last is None or expected_round is None:
            return None
        drafted = list(last.block.token_ids)
        if len(committed) != last.start + len(drafted) + 1 or committed[last.start : -1] != drafted:
            return None  # not fully accepted: the block drafted ahead is useless
        self._lookahead_round = None
        reply = await self._read(lambda r: r.lookahead and r.round_id == expected_round)
        if (
            not reply.draft.token_ids
            or reply.base_len != last.start
            or list(reply.assumed_token_ids) != committed[last.start :]
        ):
            return None  # the draft guessed the target's token wrong
        await self._send(draft_pb2.ProposeRequest(session_id=self.session_id, round_id=round_id, adopt_lookahead=True))
        self._lookahead_round = round_id
        computed = len(reply.draft.token_ids) + 1  # the previous block's last draft, the guess, the rest
        block = _first(reply.draft, k)
        whole = len(block.token_ids) == len(reply.draft.token_ids)
        return Proposal(
            block, reply.cache_len, len(committed), reply.compute_ms, computed, True,
            ends_unsure=reply.ends_unsure and whole, unsure_at=reply.unsure_at,
        )  # fmt: skip

    async def _request_block(
        self,
        committed: list[int],
        k: int,
        decoding: Decoding,
        round_id: int,
        lookahead: bool | None = None,
        resend: bool = False,
        catch_up: bool = False,
        for_later: bool = False,
        give_up: Callable[[], bool] | None = None,
    ) -> Proposal | None:
        """``lookahead``: whether the draft drafts the next block ahead (default: when pipelined);
        ``resend``: the draft asked for these tokens again; ``catch_up``: None instead of resending
        a prefix that outlasts a target-only round (``draft_len`` is then where the draft can start);
        ``for_later``: a prefix sent without waiting, which a finished turn may leave the draft to
        finish for the session's later turns (``close_stream``): the caller's deadline does not
        bound it (the turn does not wait for it; a turn that fails cancels it)."""
        assert self._stream is not None and self._draft is not None
        ahead = self._pipelined if lookahead is None else lookahead
        self._lookahead_round = None
        cached, source = self.draft_len, self._draft_source
        self._draft_source = ""
        for attempt in range(3):  # the prefix, a shorter one the worker can start from, all of it
            shared = self.shared_len if attempt or resend else 0  # a resync: a copy where the found prefix ends
            sync = prefix_sync(committed, cached, source, self._draft_hashes, decoding.processing.reply_start, shared)
            request = draft_pb2.ProposeRequest(
                session_id=self.session_id, round_id=round_id, sync=sync, num_tokens=k,
                warp=warp_to_proto(decoding.warp), seed=decoding.seed, lookahead=ahead,
                vocab_limit=self._draft.vocab_limit, tokenizer_hash=self._draft.tokenizer_hash,
                processing=processing_to_proto(decoding.processing),
                min_confidence=decoding.stop.token, min_block_confidence=decoding.stop.block,
                report_stops_only=decoding.stop.report_only,
            )  # fmt: skip
            sent, tail, prefills = time.monotonic(), len(sync.tail_token_ids), self._draft.prefills
            ahead_ms = prefills.ahead_ms
            with prefills.holding(_prefill_ms(self._costs, tail, len(committed), draft=True)):
                await self._send(request, for_later)
                reply = await self._read(
                    lambda r: not r.lookahead and r.round_id == round_id,
                    prefill=tail,
                    context=len(committed),
                    ahead_ms=ahead_ms,
                    for_later=for_later,
                    give_up=give_up,
                )
            assert self._draft is not None
            # a prefill's time says nothing about how busy the draft is, nor the time of a call
            # that may have waited for what an earlier turn left the draft computing (the draft
            # has answered it: no call waits for that any more)
            if tail < PREFILL_MIN_TOKENS and not self._draft_ready_by:
                self._draft.observe_latency(time.monotonic() - sent)
            self._draft_ready_by = 0.0
            if reply.cache_status == common_pb2.CACHE_STATUS_OK:
                got = len(reply.draft.token_ids)
                # a translating draft may send fewer (none, even); with a confidence stop, 1 to k
                fewer = self._draft.translates or (got > 0 and decoding.stop.on)
                if got > k or (got < k and not fewer):
                    raise WorkerCallFailed(f"asked for {k} tokens, got {got}")
                self._lookahead_round = round_id if ahead else None
                computed = len(sync.tail_token_ids) + max(got, 1) - 1
                return Proposal(
                    reply.draft, reply.cache_len, len(committed), reply.compute_ms, computed,
                    ends_unsure=reply.ends_unsure, unsure_at=reply.unsure_at,
                )  # fmt: skip
            start = self._resynced("draft", sync.base_len, reply.resync_from)
            cached = start if not attempt else 0  # the last try always from 0, which cannot fail
            source = source if cached else ""
            if catch_up and self._outlasts_a_round(len(committed) - cached, len(committed)):
                self.draft_len, self._draft_source = cached, source
                return None
        raise WorkerCallFailed("cache resync did not take")

    def _draft_failed(self, exc: WorkerCallFailed) -> None:
        """The round goes target-only. A draft that is unreachable or hung is skipped by every
        session for --draft-retry-s; one that failed only this request is skipped by this turn."""
        assert self._draft is not None
        if exc.worker_fault:
            self._metrics.draft_failures.inc()
            self._draft.mark_failed(str(exc))
        else:  # only this request: a deadline its caller set tells nothing of the draft
            if not exc.caller_deadline:
                self._metrics.draft_request_errors.inc()
                log.warning("draft_request_failed", reason=str(exc))
            self._draft_refused = True
        self._drop_stream()

    def _drop_stream(self) -> None:
        """Cancels the turn's draft stream (``close_stream``) and forgets what the draft holds of the
        session (it drops the job it was computing): a later round opens another and sends the
        draft all of it."""
        self.close_stream()
        self.draft_len = 0
        self._last = self._lookahead_round = None

    def _resynced(self, role: str, sent: int, start: int) -> int:
        """Counts a resync of the prefix ``sent``; the length to resend from: ``start`` where the
        worker can start there (a shorter prefix), else 0."""
        self.counters.resyncs += 1
        self._metrics.cache_resyncs.labels(role).inc()
        start = start if start < sent else 0  # a worker's answer is trusted to shorten, never to lengthen
        log.info("cache_resync", role=role, base_len=sent, resend_from=start)
        return start

    async def verify(
        self, committed: list[int], block: common_pb2.DraftBlock, decoding: Decoding, ask: LogprobsAsk | None = None
    ) -> tuple[target_pb2.VerifyResponse, int]:
        """The verdict on ``block`` and the committed tokens the target reused from its cache.

        Tries the session's replica first, then the others (re-prefilled there); after a short
        pause one more pass, which rides out a transient connection reset. Verify is safe to
        repeat: the worker crops to base_len and the round's randomness depends on the position.
        """
        ask = ask or LogprobsAsk()
        first = next(iter(self._target_replicas(self._targets.candidates(self.session_id, self.target_address))), None)
        budget = self.time_left(
            prefill=len(committed) - min(self.target_len, len(committed)),
            context=len(committed),
            ahead_ms=first.prefills.ahead_ms if first is not None else 0.0,
        )
        last_error: SpecdecError = WorkerUnavailable("no target worker answered in time; retry later")
        if first is None and self.constrained:
            last_error = GrammarsRefused(NO_GRAMMAR_REPLICA)
        if self._caller_left() <= budget:  # the caller's deadline is the limit here
            last_error = DeadlineExceeded("the request's deadline expired during verification")
        loop = asyncio.get_running_loop()
        budget_end = loop.time() + budget  # one budget for the step, retries included
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(_VERIFY_RETRY_PAUSE_S)
            for replica in self._target_replicas(self._targets.candidates(self.session_id, self.target_address)):
                remaining = budget_end - loop.time()
                if remaining <= _VERIFY_RETRY_PAUSE_S:
                    raise last_error
                own = replica is self._target
                cached, source = (self.target_len, self._target_source) if own else (0, "")
                try:
                    reply, reused = await self._verify_on(
                        replica, committed, block, decoding, ask, cached, remaining, source
                    )
                except GrammarsRefused as exc:  # it serves, but not this turn: no failover counted, not tripped
                    log.warning(
                        "target_applies_no_grammars", address=replica.address, effect="constrained turns go elsewhere"
                    )
                    replica.grammars = False
                    last_error = exc
                    continue
                except WorkerTimedOut as exc:
                    if self._caller_left() <= remaining:  # the caller's deadline, not the replica, ran out
                        raise DeadlineExceeded("the request's deadline expired during verification") from exc
                    replica.breaker.trip()
                    self._metrics.target_failovers.inc()
                    last_error = exc
                    continue
                except WorkerUnavailable as exc:
                    replica.breaker.trip()
                    self._metrics.target_failovers.inc()
                    last_error = exc
                    continue
                self._set_target(replica)
                return reply, reused
        raise last_error

    async def _verify_on(
        self,
        replica: TargetClient,
        committed: list[int],
        block: common_pb2.DraftBlock,
        decoding: Decoding,
        ask: LogprobsAsk,
        cached: int,
        timeout_s: float,
        source: str = "",
    ) -> tuple[target_pb2.VerifyResponse, int]:
        if ask.prompt_count:  # the prompt's positions must be computed again to be scored
            cached = min(cached, max(len(committed) - ask.prompt_count - 1, 0))
        for attempt in range(3):  # the prefix, a shorter one the worker can start from, all of it
            if min(self.target_len, len(committed)) - cached >= PREFILL_MIN_TOKENS:
                # the session's cached prefix, computed again (on another replica, or after the
                # worker freed the cache): its time there, not what is left of the step's
                again = self.time_left(len(committed) - cached, len(committed), replica.prefills.ahead_ms)
                timeout_s = max(timeout_s, again)
            shared = self.shared_len if attempt else 0  # a resync: a copy where the found prefix ends
            sync = prefix_sync(committed, cached, source, self._target_hashes, decoding.processing.reply_start, shared)
            takes = replica.info.max_draft_tokens
            if takes and len(block.token_ids) > takes:  # its first tokens: a shorter proposal, as exact
                block = common_pb2.DraftBlock(
                    token_ids=block.token_ids[:takes], kind=block.kind, proposals=block.proposals[:takes]
                )
            request = target_pb2.VerifyRequest(
                session_id=self.session_id, sync=sync, draft=block, warp=warp_to_proto(decoding.warp),
                seed=decoding.seed, processing=processing_to_proto(decoding.processing), logprobs=ask.tokens,
                top_logprobs=ask.top, prompt_logprobs_count=ask.prompt_count, prompt_top_logprobs=ask.prompt_top,
            )  # fmt: skip
            if self._coordinator_id:
                # this turn is among them also on the call that moves it to this replica, before
                # it is counted in the replica's turns (once the call succeeds)
                joining = self._holding and replica is not self._target
                request.coordinator_id = self._coordinator_id
                request.coordinator_requests = replica.turns + int(joining)
            with replica.prefills.holding(_prefill_ms(self._costs, len(sync.tail_token_ids), len(committed))):
                reply = await replica.verify(request, timeout_s)
            self._target_source = ""  # the worker has its own copy now, or refused the source
            if reply.cache_status == common_pb2.CACHE_STATUS_OK:
                self.counters.target_passes += 1
                self._reported = (replica.address, reply.service_requests)
                if decoding.processing.grammar and not reply.constrained:  # a worker older than grammars
                    raise GrammarsRefused(NO_GRAMMAR_REPLICA)
                if not 0 < len(reply.token_ids) <= len(block.token_ids) + 1 or (
                    ask.tokens and len(reply.logprobs) != len(reply.token_ids)
                ):
                    raise WorkerFailed("the target worker returned a malformed verdict")
                return reply, sync.base_len
            start = self._resynced("target", sync.base_len, reply.resync_from)
            cached = start if not attempt else 0  # the last try always from 0, which cannot fail
            source = source if cached else ""
        raise WorkerFailed("the target worker could not rebuild the session cache")

    def advance(self, committed: list[int], proposal: Proposal | None, target_cache_len: int) -> None:
        """Updates the cache views after a round committed its tokens (``proposal``: the round's
        block), taking the draft's answer to a prefix sent without waiting if it has come: the
        round's commit then records what the draft holds (or its failure trips the breaker) even
        if the turn does not ask the draft again (its last round, rounds without the model)."""
        self.target_len = min(target_cache_len, len(committed))
        if proposal is not None and proposal.method == MODEL:
            self.draft_len = _draft_holds(proposal, committed)
        elif self._catch_up is not None and self._catch_up.done():
            self._caught_up(self._catch_up.result(), committed)

    def skip_draft(self) -> None:
        """This round does not use the draft model: a block it drafts ahead is of no use."""
        self._last = None

    def close_stream(
        self,
        finished: bool = False,
        keep: bool = False,
        held: Callable[[CacheLocation], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        """Ends the turn's draft stream: closed cleanly after a turn that finished, else cancelled
        (with a prefix sent without waiting that the draft has not answered). With ``keep`` (a
        finished turn whose caches stay for later requests), the draft is left to finish such a
        prefix, as the turn's commits said it holds it (``locations``): its answer is read in the
        background (within the call's time limit, which the caller's deadline does not bound),
        then the stream closed and ``held`` called with the location the commits recorded (the
        session state then says the draft holds it: the next turn need not wait for it); a
        failure trips the breaker as in a turn. Cancelled, the draft would stop it and drop it,
        and a chat whose turns each ended before the draft had the history would have it
        computed every turn. A replica is left at most ``max_finishing`` such prefixes at once,
        each counted until the draft answers (not while the state records it); beyond that the
        prefix is cancelled (the next turn's claim then costs a resync)."""
        draft = self._draft
        if keep and finished and self.catching_up and self._stream is not None and draft is not None:
            if draft.finishing < draft.max_finishing:
                draft.finishing += 1
                self._metrics.draft_prefixes_finishing.inc()
                claimed = self.locations()[1]
                task = keep_running(self._finish_catch_up())

                def done(task: asyncio.Task[bool]) -> None:
                    draft.finishing -= 1
                    self._metrics.draft_prefixes_finishing.dec()
                    # the store's write comes after the count is given back: a store out of reach
                    # does not hold a place of the draft's
                    answered = not task.cancelled() and task.exception() is None and task.result()
                    if answered and held is not None and claimed is not None:
                        keep_running(held(claimed))

                task.add_done_callback(done)
                return
            log.info(
                "draft_prefix_cancelled",
                address=draft.address,
                reason="the replica computes --max-concurrent-requests prefixes that finished turns left it",
            )
        if self._catch_up is not None:
            self._catch_up.cancel()
            self._catch_up = None
        if self._stream is not None:
            if finished:
                self._stream.close()
            else:
                self._stream.cancel()
            self._stream = None

    async def _finish_catch_up(self) -> bool:
        """Reads the draft's answer to the prefix a finished turn left it computing, times its
        prefill and ends the stream: whether the draft holds the prefix (else it took the failure)."""
        assert self._catch_up is not None
        try:
            answer = await self._catch_up
        except BaseException:  # cancelled: the stream goes with it
            self._catch_up = None
            self.close_stream()
            raise
        self._catch_up = None
        if isinstance(answer, WorkerCallFailed):
            self._draft_failed(answer)
            return False
        self._time_prefill(answer)
        self.close_stream(finished=True)
        return True

    async def release(self, timeout_s: float) -> None:
        """Frees the session's caches in the workers (best effort)."""
        calls = [r.release(self.session_id, timeout_s) for r in self._targets.replicas if r.breaker.up]
        if self._drafts is not None:
            calls += [r.release(self.session_id, timeout_s) for r in self._drafts.replicas if r.usable]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("cache_release_failed", error=str(result))
