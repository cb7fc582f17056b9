"""One request ("turn") in a session: draft -> verify -> commit rounds until a stop condition.

The coordinator is the only writer of session state. A turn is atomic for the session: if it
does not finish (error, cancellation), the session is rolled back to where the turn started
(an explicit, versioned rollback) and the workers' caches are freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
from transformers import PreTrainedTokenizerBase

from coordinator.adaptive import (
    MODEL,
    NGRAM,
    REPLY,
    TARGET_ONLY,
    KController,
    LoadLimit,
    Plan,
    StepCosts,
    lookup_key,
    lookup_score,
)
from coordinator.text import ReplyText
from coordinator.validation import Limits, TurnRequest
from coordinator.worker_session import Decoding, Proposal, WorkerSession, lookup_proposal
from coordinator.workers import DraftPool, TargetPool
from specdec.runtime.logprobs import LogprobsAsk
from specdec.runtime.lookup import NO_DRAFT, LookupDraft, NgramIndex, ReplyIndex, lookup_draft
from specdec.runtime.tokens import block_hashes, common_prefix_len
from specdec.serving.errors import InvalidRequest, SessionGone, SpecdecError, StateUnavailable
from specdec.serving.metrics import CoordinatorMetrics
from specdec.serving.security import caller_identity
from specdec.state import CacheLocation, Commit, CommitResult, PrefixLocation, SessionRecord, StateStore
from specdec.v1 import common_pb2, target_pb2

log = structlog.get_logger(__name__)
T = TypeVar("T")


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass
class FirstRound:
    """A turn's first round, which also computes the prompt's uncached tokens (its part of TurnStats)."""

    draft_ms: float = 0.0
    verify_ms: float = 0.0
    proposed: int = 0
    lookup_proposed: int = 0


@dataclass
class TurnStats:
    """Counters of one turn (SpeculationStats and Usage on the wire)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    target_only_rounds: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    pipelined_rounds: int = 0
    lookup_rounds: int = 0
    lookup_proposed: int = 0
    lookup_accepted: int = 0
    reply_lookup_rounds: int = 0  # lookup rounds drafted from the reply index (other requests' replies)
    reply_lookup_accepted: int = 0
    draft_catch_up_rounds: int = 0  # rounds without the draft model while it computed a prefix sent unawaited
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    k_total: int = 0
    block_stop_total: float = 0.0  # the block stops the draft model was asked for, over block_stop_rounds
    block_stop_rounds: int = 0  # rounds whose block the draft model drafted with a block stop
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    overhead_ms: float = 0.0
    first_round: FirstRound = field(default_factory=FirstRound)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.completion_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        return self.k_total / self.rounds if self.rounds else 0.0

    @property
    def mean_block_stop(self) -> float:
        return self.block_stop_total / self.block_stop_rounds if self.block_stop_rounds else 0.0


@dataclass(frozen=True)
class RoundOutput:
    """Tokens committed by one round, their text, and the finish reason on the last round; with
    logprobs asked for, one entry per token (and the prompt's on the first round)."""

    token_ids: list[int]
    text: str
    finish: Finish | None
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


CLEANUP_TIMEOUT_S = 2.0  # freeing a session's worker caches is best effort: a hung worker gets this long


def cut_off_cleanup_s(state_retry_s: float) -> float:
    """How long a stopping coordinator gives the turns it cut off (past --grace-period-s) to roll
    back before their calls end: the state store's retry budget (a store that answers takes
    milliseconds) and the workers' cache release. Each call ends UNAVAILABLE once its turn is
    rolled back, so a client that retries finds its session as the turn before left it."""
    return state_retry_s + CLEANUP_TIMEOUT_S


@dataclass
class TurnDeps:
    """What a turn needs from the coordinator."""

    store: StateStore
    targets: TargetPool
    drafts: DraftPool | None  # the draft replicas (None: no draft model has joined)
    tokenizer: PreTrainedTokenizerBase
    limits: Limits
    metrics: CoordinatorMetrics
    worker_timeout_s: float
    state_retry_s: float
    costs: StepCosts = field(default_factory=StepCosts)
    pipelined: bool = False
    adaptive_k: bool = True
    probe_every: int = 32
    cleanup_timeout_s: float = CLEANUP_TIMEOUT_S
    lease_s: float = 90.0
    prefix_block: int = 0  # prefix reuse in blocks of this many tokens; 0 = off
    prefix_ttl_s: float = 900.0  # how long a prefix record is kept: as long as a worker keeps an unused cache
    ngram: tuple[int, int] = (2, 5)  # suffix lengths a lookup draft matches (n_min, n_max)
    replies: ReplyIndex | None = None  # recent replies of all sessions, by caller (None = off)
    load_limit: LoadLimit = field(default_factory=LoadLimit)  # speculation off above this many requests


@dataclass
class Turn:
    deps: TurnDeps
    request: TurnRequest
    deadline: float | None
    session_id: str = ""
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    stats: TurnStats = field(default_factory=TurnStats)
    workers: WorkerSession = field(init=False)
    controller: KController = field(init=False)
    _committed: list[int] = field(default_factory=list)
    _version: int = 0
    _kept: int = 0  # committed tokens the turn kept (a chat re-render may replace a tail)
    _replaced: list[int] = field(default_factory=list)  # the tail it replaced (restored on rollback)
    _chat_before: str = ""  # the conversation when the turn began (restored on rollback)
    _chat: list[dict[str, str]] | None = None  # the conversation with this turn's messages (chat turns)
    _decoding: Decoding | None = None
    _index: NgramIndex | None = None  # the committed tokens' n-grams (lookup drafts)
    _scope: str = ""  # the caller's identity: the reply index's scope
    _reason: str | None = None  # why the reply ended (the finished_requests label), once it has
    _reply_start: int = 0  # where this turn's reply begins in the committed tokens
    _generated: int = 0
    _round: int = 0
    _reply: ReplyText | None = None
    stop_token_id: int | None = None  # the stop or EOS token that ended the reply, if one did
    _acquiring: bool = False  # the lease was asked for (it may be ours even if the call was cut short)
    _dirty: bool = False  # this turn may have changed the session: roll back unless it finishes
    _created: bool = False
    _born: float | None = None  # the session's creation time: every commit names it (Commit.created_at)
    _renewal: asyncio.Task[None] | None = None
    prefix_donor: Turn | None = None  # a running turn of the same prompt whose caches this one starts from

    def __post_init__(self) -> None:
        self.session_id = self.request.session_id or f"oneshot-{self.owner}"
        d = self.deps
        self.workers = WorkerSession(
            self.session_id, d.targets, d.drafts, d.metrics, d.worker_timeout_s, self.deadline, d.pipelined, d.costs,
            constrained=bool(self.request.processing.grammar), coordinator_id=d.load_limit.coordinator_id,
        )  # fmt: skip
        self.controller = KController(
            self.request.k,
            d.costs,
            d.pipelined,
            d.probe_every,
            confidence_stop=self.request.draft_stop.on,
            block_stop=self.request.draft_stop.block,
            block_from_costs=self.request.draft_stop.block_from_costs,
        )

    @property
    def adaptive(self) -> bool:
        """Whether the controller picks each round's proposer and K (and keeps or drops the
        draft's confidence stop)."""
        return self.deps.adaptive_k and not self.request.fixed_k

    @property
    def one_shot(self) -> bool:
        return not self.request.session_id

    async def rounds(self) -> AsyncIterator[RoundOutput]:
        """Runs the turn, yielding each round's committed tokens.

        Whatever ends it (the last round, an error, a cancellation at any await, the lease
        request included), ``_end`` runs: an unfinished turn is rolled back and the lease released.
        A cancellation that a library call swallowed (grpc.aio returns a call's reply when the
        cancel arrives just as the reply does; Python 3.11's ``wait_for`` likewise) is still
        counted by the task: the next round does not start.
        """
        finished, began = False, time.monotonic()
        with structlog.contextvars.bound_contextvars(session_id=self.session_id):
            try:
                await self._begin()
                while not finished:
                    _stop_if_cancelled()
                    out = await self._run_round()
                    finished = out.finish is not None
                    yield out
            finally:
                self._log_end(finished, time.monotonic() - began)
                await asyncio.shield(self._end(finished))

    def _log_end(self, finished: bool, seconds: float) -> None:
        """One line per turn (what a request cost; never its text): finished, or rolled back (its
        error, if any, is the RPC's own line)."""
        stats = self.stats
        log.info(
            "turn_ended", finished=finished, reason=self._reason, prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens, cached_tokens=stats.cached_tokens, rounds=stats.rounds,
            acceptance_rate=round(stats.acceptance_rate, 3), seconds=round(seconds, 3),
            **({"caller": self._scope} if self._scope else {}),
        )  # fmt: skip

    async def _begin(self) -> None:
        store = self.deps.store
        self._acquiring = True  # from here on, _end releases the lease (a no-op if we never got it)
        caller = None if self.one_shot else caller_identity.get()  # named sessions count against its limit
        create = not self.request.require_existing
        record = await store.acquire(self.session_id, self.owner, create=create, caller=caller)
        self._version, self._chat_before, self._born = record.version, record.chat, record.created_at
        self._created = record.version == 0  # a session this turn made: an unfinished turn deletes it
        self._renewal = asyncio.create_task(self._renew_lease())
        if self.request.messages is not None:
            kept, prompt = await self._chat_prompt(record)
        else:
            if record.chat:
                raise InvalidRequest("this session is a chat: continue it with `messages`, not a prompt")
            kept, prompt = len(record.tokens), await self._prompt_ids(new_session=not record.tokens)
        self._kept, self._replaced = kept, record.tokens[kept:]
        self._check_context(kept, len(prompt))
        self._dirty = True  # the prompt commit may apply even if we never see its reply
        chat = None if self._chat is None else json.dumps(self._chat)
        truncate = kept if self._replaced else None
        opening = Commit(
            record.version, f"{self.owner}:prompt", prompt, truncate_to=truncate, chat=chat, opens_turn=True,
            created_at=self._born,
        )  # fmt: skip
        await self._commit(opening)
        self._committed = [*record.tokens[:kept], *prompt]
        self.workers.restore(_upto(record.target, kept), _upto(record.draft, kept))
        if not kept and self.deps.prefix_block:  # nothing of this session cached: a shared prefix may be
            await self._reuse_prefix()
        elif not kept:  # the replicas to start on
            self.workers.place([])
        req = self.request
        stops = (req.stop_strings, req.include_stop_str, req.min_tokens, req.skip_special)
        self._reply = ReplyText(self.deps.tokenizer, self._committed, *stops)
        if req.k and req.method != MODEL:
            self._index = NgramIndex(*self.deps.ngram, self._committed)
        self._scope, self._reply_start = caller_identity.get(), len(self._committed)
        processing = dataclasses.replace(req.processing, reply_start=len(self._committed))
        self._decoding = Decoding(req.warp, req.seed, processing, req.draft_stop)
        self.stats.prompt_tokens = len(prompt)

    def _prefix_keys(self, tokens: list[int], target: str) -> list[str]:
        """Block chain hashes of ``tokens`` cached on the target replica at ``target``, salted with
        the caller's identity (a caller never finds another caller's prefixes) and the replica (each
        replica's caches are recorded apart, so a prefix cached on several is found on each)."""
        return block_hashes(tokens, self.deps.prefix_block, salt=json.dumps([caller_identity.get(), target]))

    async def _reuse_prefix(self) -> None:
        """Starts from the longest cached prefix of the prompt that some earlier request left in
        the workers (found in the state store, so any coordinator replica finds it), or from the
        ``prefix_donor``'s caches (the other completions of an ``n`` > 1 request)."""
        donor = self.prefix_donor
        if donor is not None and donor._committed[: len(self._committed)] == self._committed:
            target, draft = donor.workers.locations()
            if target is not None:  # all but the last token: that one is always sent (the tail)
                self.workers.place([(PrefixLocation(donor.session_id, target, draft), len(self._committed) - 1)])
                return
        tokens = self._committed[:-1]  # the last token is always sent (the tail)
        replicas = [r.address for r in self.deps.targets.replicas if r.breaker.up]
        try:
            hits = await asyncio.gather(*(self.deps.store.find_prefix(self._prefix_keys(tokens, a)) for a in replicas))
        except SpecdecError as exc:  # reuse is an optimisation: go on without it
            log.warning("prefix_lookup_failed", error=str(exc))
            hits = []
        block = self.deps.prefix_block
        found = [(location, (index + 1) * block) for index, location in filter(None, hits)]
        self.workers.place(found)
        self.workers.shared_len = max((length for _, length in found), default=0)

    async def _record_prefix(self) -> None:
        """Records where the finished turn's tokens are cached, for later requests to start from."""
        target, draft = self.workers.locations()
        if target is None:
            return
        try:
            keys = self._prefix_keys(self._committed[: target.length], target.address)
            location = PrefixLocation(self.session_id, target, draft)
            await self.deps.store.put_prefixes(keys, location, self.deps.prefix_ttl_s)
        except SpecdecError as exc:
            log.warning("prefix_record_failed", error=str(exc))

    async def _renew_lease(self) -> None:
        """Keeps the lease while the turn runs (a long prefill commits nothing for a while). Once
        the session is closed (or made again) or its lease taken, renewing ends: the turn's next
        commit ends the turn, saying which."""
        every = self.deps.lease_s / 3
        while True:
            await asyncio.sleep(every)
            try:
                if not await self.deps.store.renew(self.session_id, self.owner, self._born):
                    log.warning("session_lease_lost")
                    return
            except SessionGone:  # CloseSession during the turn: nothing an operator must see
                log.info("session_gone_during_turn")
                return
            except SpecdecError as exc:
                log.warning("session_lease_renewal_failed", error=str(exc))

    async def _chat_prompt(self, record: SessionRecord) -> tuple[int, list[int]]:
        """The tokens of the whole conversation (the stored one + the new messages) rendered with
        the chat template: (committed tokens kept, tokens to append). Usually everything committed
        is kept; a reply whose tokens differ from its text's tokenization (or a template that
        renders past turns differently) replaces the committed tail from the first difference.
        Rendering and tokenizing run in a thread: a long conversation takes seconds, and the event
        loop serves every other request meanwhile."""
        if record.tokens and not record.chat:
            raise InvalidRequest("this session was started with a prompt: continue it with `prompt`, not `messages`")
        assert self.request.messages is not None
        history: list[dict[str, str]] = json.loads(record.chat) if record.chat else []
        self._chat = [*history, *({"role": role, "content": content} for role, content in self.request.messages)]
        ids = await asyncio.to_thread(render_chat, self.deps.tokenizer, self._chat)
        kept = common_prefix_len(record.tokens, ids)
        if kept == len(ids):
            raise InvalidRequest("the new messages add no tokens to the conversation")
        return kept, ids[kept:]

    async def _prompt_ids(self, new_session: bool) -> list[int]:
        """The prompt's tokens; text is tokenized in a thread (a 1,000,000-character prompt takes
        seconds, and the event loop serves every other request meanwhile)."""
        if self.request.prompt_ids is not None:
            return list(self.request.prompt_ids)
        ids = await asyncio.to_thread(tokenize, self.deps.tokenizer, self.request.prompt_text, new_session)
        if not ids:
            raise InvalidRequest("the prompt text produced no tokens")
        return ids

    def _check_context(self, history: int, prompt: int) -> None:
        """Checks that the reply fits in the context. A default max_new_tokens (the caller left it
        unset) is cut to the room left, as vLLM does for an unset max_tokens; one the caller set
        must fit as it is."""
        req, limit = self.request, self.deps.limits.max_context_len
        room = limit - history - prompt
        if req.max_new_tokens <= room:
            return
        if req.max_new_tokens_set:
            raise InvalidRequest(
                f"session history ({history}) + prompt ({prompt}) + max_new_tokens ({req.max_new_tokens}) "
                f"= {history + prompt + req.max_new_tokens} tokens exceeds the context length {limit}; "
                "shorten the prompt or lower max_new_tokens"
            )
        if room < max(1, req.min_tokens):
            raise InvalidRequest(
                f"session history ({history}) + prompt ({prompt}) tokens leave no room for a reply"
                f"{f' of min_tokens ({req.min_tokens})' if req.min_tokens else ''} in the context length "
                f"{limit}; shorten the prompt{' or lower min_tokens' if req.min_tokens else ''}"
            )
        self.request = dataclasses.replace(req, max_new_tokens=room)

    def _plan(self) -> tuple[Plan, LookupDraft]:
        """This round's proposer and K, and the lookup draft on offer (if the method uses one)."""
        req, limits = self.request, self.deps.limits
        budget = req.max_new_tokens - self._generated - 1
        if req.k <= 0 or budget <= 0:
            return TARGET_ONLY, NO_DRAFT
        # the requests of every coordinator on the session's target replica; fixed K keeps its K
        # (its seed replays)
        if self.adaptive and self._over_load_limit():
            self.deps.metrics.load_target_only_rounds.inc()
            return TARGET_ONLY, NO_DRAFT
        found = NO_DRAFT
        if self._index is not None:
            k = min(limits.lookup_max_tokens, budget)
            # fixed K drafts from the session's own tokens only: what other requests replied must
            # not change what a seed replays (rejection sampling's tokens depend on the proposal)
            replies = self.deps.replies if self.adaptive else None
            found = lookup_draft(self._index, replies, self._scope, self._committed, k)
        lookup = found.token_ids
        model = 0
        if req.method != NGRAM and self.workers.draft_usable:
            # The draft runs the committed tokens + K - 1 drafts: it cannot draft past its own context.
            model = max(min(req.k, budget, limits.draft_context_len - len(self._committed) + 1), 0)
        if self.adaptive:
            return self.controller.plan(model, len(lookup), _source(found)), found
        if lookup:  # fixed K: the lookup draft whenever it matches (it costs nothing to make)
            return Plan(NGRAM, len(lookup)), found
        return (Plan(MODEL, model) if model else TARGET_ONLY), found

    def _over_load_limit(self) -> bool:
        """Whether more requests than --speculation-max-requests are generating on the session's
        target replica (those of every coordinator on it)."""
        return self.deps.load_limit.exceeded(self.workers.target_requests)

    async def _run_round(self) -> RoundOutput:
        self._round += 1
        (plan, found), loop, decoding = self._plan(), asyncio.get_running_loop(), self._decoding
        lookup, source = found.token_ids, _source(found)
        assert decoding is not None
        if plan.method == MODEL and self.adaptive and self.workers.draft_behind(self._committed, decoding, self._round):
            plan = self.controller.plan(0, len(lookup), source)  # the best without the draft model meanwhile
            self._count_catch_up()
        began = loop.time()
        proposal: Proposal | None = None
        gave_up = False
        if plan.method == NGRAM:
            proposal = lookup_proposal(lookup[: plan.k], len(self._committed))
            self.workers.skip_draft()
        elif plan.k > 0:
            if decoding.stop.on and self.adaptive:  # the stops, as set from the costs, or only reported
                stop = decoding.stop
                if stop.block_from_costs:
                    stop = dataclasses.replace(stop, block=self.controller.block_threshold)
                if not self.controller.stopping:
                    stop = dataclasses.replace(stop, report_only=True)
                decoding = dataclasses.replace(decoding, stop=stop)
            # requests that come while it waits for the draft (a burst's, placed one by one) may
            # pass the load limit: the round then stops waiting and decodes target-only
            give_up = self._over_load_limit if self.adaptive and self.deps.load_limit.max_requests else None
            proposal = await self.workers.propose(
                self._committed, plan.k, decoding, self._round, self.adaptive, give_up
            )  # fmt: skip
            gave_up = self.workers.gave_up
            if gave_up:
                self.deps.metrics.load_target_only_rounds.inc()
            applied = not decoding.stop.report_only
            if proposal is not None and proposal.method == MODEL and decoding.stop.block > 0 and applied:
                self.stats.block_stop_total += decoding.stop.block
                self.stats.block_stop_rounds += 1
            if proposal is None and self.workers.catching_up:  # it asked for a long prefix again: sent unawaited
                self._count_catch_up()
        drafted = loop.time()
        block = proposal.block if proposal else common_pb2.DraftBlock()
        verdict, reused = await self.workers.verify(self._committed, block, decoding, self._logprobs_ask())
        if self._round == 1:
            self.stats.cached_tokens = reused
        tokens, finish = self._cut(list(verdict.token_ids))
        assert self._reply is not None
        # a stop string can end the reply inside the block; a stop token's text is shown only on request
        shown = tokens[:-1] if finish is Finish.STOP and not self.request.include_stop_str else tokens
        taken = self._reply.push(shown)
        if self._reply.matched is not None:
            tokens, finish = tokens[:taken], Finish.STOP
        elif finish is Finish.STOP:
            self.stop_token_id = tokens[-1]
        self._committed += tokens
        self._generated += len(tokens)
        if self._index is not None:
            self._index.extend(tokens)
        self.workers.advance(self._committed, proposal, verdict.cache_len)
        target, draft = self.workers.locations()
        text = self._reply.take(final=finish is not None)
        chat = None
        if finish is not None and self._chat is not None:  # the reply joins the conversation
            chat = json.dumps([*self._chat, {"role": "assistant", "content": self._reply.text}])
        step = f"{self.owner}:{self._round}"
        closes = finish is not None
        commit = Commit(
            self._version, step, tokens, target=target, draft=draft, chat=chat, closes_turn=closes,
            created_at=self._born,
        )  # fmt: skip
        await self._commit(commit)
        self._account(
            proposal, plan.k, verdict, len(tokens), (drafted - began) * 1000, (loop.time() - began) * 1000, source,
            waited=gave_up,
        )  # fmt: skip
        if lookup and plan.method != NGRAM and self.adaptive:  # what the unused lookup would have got
            self.controller.observe(*lookup_score(lookup, tokens), source)
        if finish is not None and self.deps.replies is not None:  # later requests may give this reply again
            self._remember_reply(self.deps.replies)
        if finish is not None:
            self._reason = self._finish_reason(finish, tokens)
            self.deps.metrics.finished_requests.labels(self._reason).inc()
        return RoundOutput(
            token_ids=tokens,
            text=text,
            finish=finish,
            logprobs=list(verdict.logprobs[: len(tokens)]),
            prompt_logprobs=list(verdict.prompt_logprobs),
        )

    def _count_catch_up(self) -> None:
        """A round without the draft model while it computes a prefix sent without waiting."""
        self.stats.draft_catch_up_rounds += 1
        self.deps.metrics.draft_catch_up_rounds.inc()

    def _logprobs_ask(self) -> LogprobsAsk:
        req = self.request
        prompt = req.prompt_logprobs is not None and self._round == 1
        return LogprobsAsk(
            tokens=req.logprobs,
            top=req.top_logprobs,
            prompt_count=self.stats.prompt_tokens if prompt else 0,
            prompt_top=req.prompt_logprobs or 0,
        )

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self._reply.matched if self._reply is not None else None

    def _finish_reason(self, finish: Finish, tokens: list[int]) -> str:
        """The metric label of why the reply ended: ``eos``, ``stop_token``, ``stop_string`` or ``length``."""
        if finish is Finish.LENGTH:
            return "length"
        if self.stop_string is not None:
            return "stop_string"
        return "eos" if tokens[-1] in self.deps.limits.eos_token_ids else "stop_token"

    def _cut(self, tokens: list[int]) -> tuple[list[int], Finish | None]:
        """Cuts a round's tokens at the first stop token or at max_new_tokens."""
        tokens = tokens[: self.request.max_new_tokens - self._generated]
        for i, token in enumerate(tokens):
            # before min_tokens the workers never produce a stop token (they ban them)
            if token in self.request.stop_ids and self._generated + i >= self.request.min_tokens:
                return tokens[: i + 1], Finish.STOP
        if self._generated + len(tokens) >= self.request.max_new_tokens:
            return tokens, Finish.LENGTH
        return tokens, None

    def _account(
        self,
        proposal: Proposal | None,
        asked: int,
        verdict: target_pb2.VerifyResponse,
        committed: int,
        draft_ms: float,
        round_ms: float,
        draft_source: str,
        waited: bool = False,
    ) -> None:
        """Stats, metrics, the cost model and the acceptance estimate after a round (``asked``: the
        block length the round's plan asked for; ``draft_source``: a lookup draft's ``lookup_key``;
        ``waited``: the round waited ``draft_ms`` for a block it then gave up, which is no overhead)."""
        s, m = self.stats, self.deps.metrics
        k = len(proposal.block.token_ids) if proposal else 0
        method = proposal.method if proposal else "none"
        drafting = draft_ms if waited else min(draft_ms, proposal.compute_ms if proposal else 0.0)
        overhead = round_ms - verdict.compute_ms - drafting
        if s.rounds == 0:
            s.first_round = FirstRound(draft_ms, verdict.compute_ms, k, k if method == NGRAM else 0)
        s.rounds += 1
        s.completion_tokens += committed
        s.k_total += k
        s.draft_ms += draft_ms
        s.verify_ms += verdict.compute_ms
        s.overhead_ms += overhead
        m.record_round(k, verdict.num_accepted, draft_ms, verdict.compute_ms, overhead, committed, method)
        if verdict.computed_tokens == k + 1:  # steady state (no prefill in the pass): a clean cost sample
            self.deps.costs.observe_verify(k + 1, verdict.compute_ms)
            self.deps.costs.observe_overhead(overhead, drafted=method == MODEL)
        elif verdict.computed_tokens > k + 1:  # a prefix too: what a prefill costs (later calls' time limits)
            self.deps.costs.observe_prefill(verdict.computed_tokens, verdict.compute_ms)
        if proposal is None:
            s.target_only_rounds += 1
            return
        s.proposed += k
        s.accepted += verdict.num_accepted
        s.pipelined_rounds += proposal.pipelined
        if len(s.proposed_by_position) < k:
            grow = k - len(s.proposed_by_position)
            s.proposed_by_position += [0] * grow
            s.accepted_by_position += [0] * grow
        for position in range(k):
            s.proposed_by_position[position] += 1
            s.accepted_by_position[position] += position < verdict.num_accepted
        source = draft_source if method == NGRAM else method
        self.controller.observe(k, verdict.num_accepted, source, asked, proposal.ends_unsure, proposal.unsure_at)
        if method == NGRAM:
            s.lookup_rounds += 1
            s.lookup_proposed += k
            s.lookup_accepted += verdict.num_accepted
            if source == REPLY:
                s.reply_lookup_rounds += 1
                s.reply_lookup_accepted += verdict.num_accepted
                m.reply_lookup_rounds.inc()
                m.reply_lookup_tokens_accepted.inc(verdict.num_accepted)
        elif proposal.computed <= k + 1:  # no prefill in the draft's work either
            self.deps.costs.observe_draft(proposal.computed, proposal.compute_ms)
        else:
            self.deps.costs.observe_prefill(proposal.computed, proposal.compute_ms, draft=True)

    def _remember_reply(self, replies: ReplyIndex) -> None:
        """Adds the finished reply (after its context's last tokens) to the reply index."""
        start, n_max = self._reply_start, self.deps.ngram[1]
        replies.add(self._scope, self._committed[max(start - n_max, 0) : start], self._committed[start:])
        self.deps.metrics.reply_index_tokens.set(replies.tokens)

    async def _commit(self, commit: Commit) -> CommitResult:
        """Commits with retries while the store is unreachable (safe: a step applies once)."""
        result = await self._retrying_state(
            lambda: self.deps.store.commit(self.session_id, self.owner, commit),
            min(self.deps.state_retry_s, self.workers.time_left()),
            commit.step_id,
        )
        self._version = result.version
        return result

    async def _retrying_state(self, call: Callable[[], Awaitable[T]], budget_s: float, what: str) -> T:
        """``call()``, retried with backoff for ``budget_s`` while the store is unreachable."""
        loop = asyncio.get_running_loop()
        delay, budget = 0.05, loop.time() + budget_s
        while True:
            try:
                return await call()
            except StateUnavailable:
                if loop.time() + delay >= budget:
                    raise
                log.warning("state_retry", step=what, delay_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _end(self, finished: bool) -> None:
        """Rolls an unfinished turn back, releases the lease, frees worker caches: on every exit
        path, each step on its own (one failing never skips the next). The state calls get
        --state-retry-s of their own: the caller may be gone, the session must not stay locked."""
        if self._renewal is not None:
            self._renewal.cancel()
        # the session's next turn goes on from it
        self.workers.close_stream(finished, keep=not self.one_shot, held=self._draft_held)
        self.workers.unbind()
        store, budget = self.deps.store, self.deps.state_retry_s
        if self._acquiring:
            steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
            if not finished and self._dirty and not self.one_shot and not self._created:
                steps.append(("rollback", self._rollback))
            # a session this turn made and did not finish (or a one-shot's) goes, unless another
            # request holds it by now (it was closed meanwhile and made again under its id)
            drop = self.one_shot or (self._created and not finished)
            steps.append(("release", lambda: store.release(self.session_id, self.owner, delete=drop)))
            for name, step in steps:
                try:
                    await self._retrying_state(step, budget, name)
                except SessionGone:  # closed (CloseSession) or expired meanwhile: nothing is left to undo
                    log.info("session_gone_before_cleanup", step=name)
                except SpecdecError as exc:
                    log.warning("session_cleanup_failed", step=name, error=str(exc))
        if finished and self.deps.prefix_block:
            await self._record_prefix()  # a one-shot request's caches stay for reuse (LRU-bounded)
        elif self.one_shot or not finished:
            await self.workers.release(self.deps.cleanup_timeout_s)

    async def _draft_held(self, claimed: CacheLocation) -> None:
        """The draft has computed the prefix this turn left it (recorded as ``claimed``): the
        session state says so, if no later turn recorded another location meanwhile (a turn
        that finds it still waiting only goes without the draft a round longer)."""
        try:
            await self.deps.store.mark_draft_ready(self.session_id, claimed)
        except SpecdecError as exc:
            log.warning("draft_ready_not_recorded", error=str(exc))

    async def _rollback(self) -> CommitResult:
        """The session back to where this turn found it; the owner's commit, whatever the version."""
        self.workers.forget_caches()
        target, draft = self.workers.locations()
        commit = Commit(
            None, f"{self.owner}:rollback", self._replaced, self._kept, target, draft, chat=self._chat_before,
            closes_turn=True, created_at=self._born,
        )  # fmt: skip
        return await self.deps.store.commit(self.session_id, self.owner, commit)


def _source(lookup: LookupDraft) -> str:
    """The acceptance counts a lookup draft is judged by (see ``lookup_key``)."""
    return lookup_key(lookup.match_len, lookup.from_replies)


def _stop_if_cancelled() -> None:
    """Raises CancelledError where the running task was asked to stop and the request was lost."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _upto(location: CacheLocation | None, length: int) -> CacheLocation | None:
    """A cache location cut to the first ``length`` committed tokens."""
    return None if location is None else dataclasses.replace(location, length=min(location.length, length))


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str | None, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids (the fast tokenizers let other threads run while they work)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's tokens with the chat template and its generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "the target model's tokenizer has no chat template: "
            "send `prompt` or `prompt_token_ids` instead of `messages`"
        )
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own checks (roles, order) raise from inside Jinja
        raise InvalidRequest(f"the chat template could not render these messages: {exc}") from exc
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]
