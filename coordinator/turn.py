"""One request ("turn") in a session: draft -> verify -> commit rounds until a stop condition.

The coordinator is the only writer of session state: it passes the committed prefix to each
worker as (base_len, prefix hash, tail) and records how much of it each worker's cache holds.
A turn is atomic for the session: if it does not finish, the session is rolled back to where
the turn started (an explicit, versioned rollback) and the workers' caches are freed.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
from transformers import PreTrainedTokenizerBase

from coordinator.text import IncrementalDetokenizer
from coordinator.validation import Limits, TurnRequest
from coordinator.workers import DraftClient, DraftStream, TargetClient, WorkerCallFailed
from specdec.errors import InvalidRequest, SpecdecError, WorkerUnavailable
from specdec.state import CacheLocation, Commit, StateStore
from specdec.tokens import common_prefix_len, prefix_hash
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.worker import warp_to_proto

log = structlog.get_logger(__name__)


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass
class TurnStats:
    """Counters of one turn (SpeculationStats and Usage on the wire)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    target_passes: int = 0
    target_only_rounds: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_resyncs: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.completion_tokens / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class RoundOutput:
    """Tokens committed by one round, their text, and the finish reason on the last round."""

    token_ids: list[int]
    text: str
    finish: Finish | None


@dataclass
class TurnDeps:
    """What a turn needs from the coordinator."""

    store: StateStore
    target: TargetClient
    draft: DraftClient | None
    tokenizer: PreTrainedTokenizerBase
    limits: Limits
    worker_timeout_s: float
    cleanup_timeout_s: float = 2.0


@dataclass
class _Draft:
    block: common_pb2.DraftBlock
    cache_len: int


@dataclass
class Turn:
    deps: TurnDeps
    request: TurnRequest
    deadline: float | None
    session_id: str = ""
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    stats: TurnStats = field(default_factory=TurnStats)
    _committed: list[int] = field(default_factory=list)
    _version: int = 0
    _start_len: int = 0
    _target_len: int = 0
    _draft_len: int = 0
    _generated: int = 0
    _round: int = 0
    _stream: DraftStream | None = None
    _detok: IncrementalDetokenizer | None = None

    def __post_init__(self) -> None:
        self.session_id = self.request.session_id or f"oneshot-{self.owner}"

    @property
    def one_shot(self) -> bool:
        return not self.request.session_id

    async def rounds(self) -> AsyncIterator[RoundOutput]:
        """Runs the turn, yielding each round's committed tokens."""
        finished = False
        with structlog.contextvars.bound_contextvars(session_id=self.session_id):
            await self._begin()
            try:
                while not finished:
                    out = await self._run_round()
                    finished = out.finish is not None
                    yield out
            finally:
                await asyncio.shield(self._end(finished))

    async def _begin(self) -> None:
        store = self.deps.store
        record = await store.acquire(self.session_id, self.owner, create=not self.request.require_existing)
        try:
            prompt = self._prompt_ids(new_session=not record.tokens)
            self._check_context(len(record.tokens), len(prompt))
            warp = self.request.warp
            sampling = {
                "temperature": warp.temperature,
                "top_k": warp.top_k,
                "top_p": warp.top_p,
                "seed": self.request.seed,
            }
            commit = Commit(record.version, f"{self.owner}:prompt", prompt, sampling=sampling)
            self._version = (await store.commit(self.session_id, self.owner, commit)).version
        except BaseException:
            await asyncio.shield(self._abandon(new_session=not record.tokens))
            raise
        self._start_len = len(record.tokens)
        self._committed = [*record.tokens, *prompt]
        self._target_len = self._cached_len(record.target, self.deps.target.address)
        self._draft_len = self._cached_len(record.draft, self.deps.draft.address if self.deps.draft else None)
        self._detok = IncrementalDetokenizer(self.deps.tokenizer, self._committed)
        self.stats.prompt_tokens = len(prompt)

    async def _abandon(self, new_session: bool) -> None:
        """Undoes a failed start: the lease is given back, a session created for nothing deleted."""
        try:
            if new_session:
                await self.deps.store.delete(self.session_id)
            else:
                await self.deps.store.release(self.session_id, self.owner)
        except SpecdecError as exc:
            log.warning("session_cleanup_failed", error=str(exc))

    def _prompt_ids(self, new_session: bool) -> list[int]:
        if self.request.prompt_ids is not None:
            return list(self.request.prompt_ids)
        ids = self.deps.tokenizer(self.request.prompt_text, add_special_tokens=new_session)["input_ids"]
        if not ids:
            raise InvalidRequest("the prompt text produced no tokens")
        return list(ids)

    def _check_context(self, history: int, prompt: int) -> None:
        total = history + prompt + self.request.max_new_tokens
        limit = self.deps.limits.max_context_len
        if total > limit:
            raise InvalidRequest(
                f"session history ({history}) + prompt ({prompt}) + max_new_tokens ({self.request.max_new_tokens}) "
                f"= {total} tokens exceeds the context length {limit}; shorten the prompt or lower max_new_tokens"
            )

    @staticmethod
    def _cached_len(location: CacheLocation | None, address: str | None) -> int:
        return location.length if location is not None and location.address == address else 0

    def _timeout(self) -> float:
        timeout = self.deps.worker_timeout_s
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - asyncio.get_running_loop().time())
        return max(timeout, 0.001)

    def _k(self) -> int:
        draft = self.deps.draft
        remaining = self.request.max_new_tokens - self._generated
        if draft is None or not draft.usable:
            return 0
        return min(self.request.k, remaining - 1)

    async def _run_round(self) -> RoundOutput:
        self._round += 1
        k = self._k()
        draft = await self._propose(k) if k > 0 else None
        verdict = await self._verify(draft.block if draft else common_pb2.DraftBlock())
        start = len(self._committed)
        tokens, finish = self._cut(list(verdict.token_ids))
        self._committed += tokens
        self._generated += len(tokens)
        self._target_len = min(verdict.cache_len, len(self._committed))
        if draft is not None:
            drafted_in_cache = list(draft.block.token_ids[: draft.cache_len - start])
            self._draft_len = start + common_prefix_len(drafted_in_cache, tokens)
        await self._commit(tokens)
        self._count(draft, verdict, len(tokens))
        assert self._detok is not None
        text = self._detok.push(tokens)
        if finish is not None:
            text += self._detok.flush()
        return RoundOutput(token_ids=tokens, text=text, finish=finish)

    def _cut(self, tokens: list[int]) -> tuple[list[int], Finish | None]:
        """Cuts a round's tokens at the first stop token or at max_new_tokens."""
        tokens = tokens[: self.request.max_new_tokens - self._generated]
        for i, token in enumerate(tokens):
            if token in self.request.stop_ids:
                return tokens[: i + 1], Finish.STOP
        if self._generated + len(tokens) >= self.request.max_new_tokens:
            return tokens, Finish.LENGTH
        return tokens, None

    def _count(self, draft: _Draft | None, verdict: target_pb2.VerifyResponse, committed: int) -> None:
        s = self.stats
        s.rounds += 1
        s.completion_tokens += committed
        if draft is None:
            s.target_only_rounds += 1
        else:
            s.proposed += len(draft.block.token_ids)
            s.accepted += verdict.num_accepted

    def _sync_fields(self, cached: int) -> tuple[int, int, list[int]]:
        base = min(cached, len(self._committed) - 1)
        return base, prefix_hash(self._committed[:base]), self._committed[base:]

    async def _propose(self, k: int) -> _Draft | None:
        draft = self.deps.draft
        assert draft is not None
        if self._stream is None:
            self._stream = draft.open_stream()
        cached = self._draft_len
        for _ in range(2):
            base, base_hash, tail = self._sync_fields(cached)
            request = draft_pb2.ProposeRequest(
                session_id=self.session_id,
                round_id=self._round,
                base_len=base,
                prefix_hash=base_hash,
                tail_token_ids=tail,
                num_tokens=k,
                warp=warp_to_proto(self.request.warp),
                seed=self.request.seed,
            )
            try:
                reply = await self._stream.propose(request, self._timeout())
            except WorkerCallFailed as exc:
                return self._draft_failed(str(exc))
            if reply.round_id != self._round:
                return self._draft_failed(f"reply for round {reply.round_id} in round {self._round}")
            if reply.cache_status == common_pb2.CACHE_STATUS_OK:
                if len(reply.draft.token_ids) != k:
                    return self._draft_failed(f"asked for {k} tokens, got {len(reply.draft.token_ids)}")
                return _Draft(reply.draft, reply.cache_len)
            self.stats.cache_resyncs += 1
            cached = 0
        return self._draft_failed("cache resync did not take")

    def _draft_failed(self, reason: str) -> None:
        assert self.deps.draft is not None
        self.deps.draft.mark_failed(reason)
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        self._draft_len = 0

    async def _verify(self, block: common_pb2.DraftBlock) -> target_pb2.VerifyResponse:
        cached = self._target_len
        for _ in range(2):
            base, base_hash, tail = self._sync_fields(cached)
            request = target_pb2.VerifyRequest(
                session_id=self.session_id,
                base_len=base,
                prefix_hash=base_hash,
                tail_token_ids=tail,
                draft=block,
                warp=warp_to_proto(self.request.warp),
                seed=self.request.seed,
            )
            reply = await self.deps.target.verify(request, self._timeout())
            if reply.cache_status == common_pb2.CACHE_STATUS_OK:
                self.stats.target_passes += 1
                if self._round == 1:
                    self.stats.cached_tokens = base
                if not 0 < len(reply.token_ids) <= len(block.token_ids) + 1:
                    raise WorkerUnavailable("the target worker returned a malformed verdict")
                return reply
            log.info("target_resync", base_len=base)
            self.stats.cache_resyncs += 1
            cached = 0
        raise WorkerUnavailable("the target worker could not rebuild the session cache")

    def _locations(self) -> tuple[CacheLocation, CacheLocation | None]:
        target = CacheLocation(self.deps.target.address, self.deps.target.info.instance_id, self._target_len)
        draft = self.deps.draft
        return target, CacheLocation(draft.address, draft.info.instance_id, self._draft_len) if draft else None

    async def _commit(self, tokens: list[int]) -> None:
        target, draft = self._locations()
        commit = Commit(self._version, f"{self.owner}:{self._round}", tokens, target=target, draft=draft)
        self._version = (await self.deps.store.commit(self.session_id, self.owner, commit)).version

    async def _end(self, finished: bool) -> None:
        """Releases the session; an unfinished turn is rolled back and the worker caches freed."""
        if self._stream is not None:
            self._stream.cancel()
        store = self.deps.store
        try:
            if self.one_shot:
                await store.delete(self.session_id)
            elif not finished:
                self._target_len = self._draft_len = 0
                target, draft = self._locations()
                rollback = Commit(
                    self._version, f"{self.owner}:rollback", truncate_to=self._start_len, target=target, draft=draft
                )
                await store.commit(self.session_id, self.owner, rollback)
            await store.release(self.session_id, self.owner)
        except SpecdecError as exc:
            log.warning("session_cleanup_failed", error=str(exc))
        if self.one_shot or not finished:
            await self._free_worker_caches()

    async def _free_worker_caches(self) -> None:
        timeout = self.deps.cleanup_timeout_s
        calls = [self.deps.target.release(self.session_id, timeout)]
        if self.deps.draft is not None:
            calls.append(self.deps.draft.release(self.session_id, timeout))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("cache_release_failed", error=str(result))
