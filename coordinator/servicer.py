"""Generation gRPC servicer: wire <-> domain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

import grpc

from coordinator.engine import Engine
from coordinator.turn import Finish, RoundOutput, Turn
from coordinator.validation import Limits, parse_request_off_loop
from specdec.serving.errors import ReplyTooLarge
from specdec.serving.security import caller_identity, scoped_session_id
from specdec.serving.session_ids import check_session_id
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

_FINISH = {Finish.STOP: coordinator_pb2.FINISH_REASON_STOP, Finish.LENGTH: coordinator_pb2.FINISH_REASON_LENGTH}


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


def _usage(turn: Turn) -> coordinator_pb2.Usage:
    s = turn.stats
    return coordinator_pb2.Usage(
        prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, cached_tokens=s.cached_tokens
    )


def _stats(turn: Turn) -> coordinator_pb2.SpeculationStats:
    s, counters = turn.stats, turn.workers.counters
    return coordinator_pb2.SpeculationStats(
        rounds=s.rounds,
        draft_tokens_proposed=s.proposed,
        draft_tokens_accepted=s.accepted,
        target_forward_passes=counters.target_passes,
        acceptance_rate=s.acceptance_rate,
        mean_accepted_length=s.mean_accepted_length,
        target_only_rounds=s.target_only_rounds,
        cache_resyncs=counters.resyncs,
        pipelined_rounds=s.pipelined_rounds,
        draft_ms=s.draft_ms,
        verify_ms=s.verify_ms,
        overhead_ms=s.overhead_ms,
        mean_k=s.mean_k,
        mean_block_stop=s.mean_block_stop,
        lookup_rounds=s.lookup_rounds,
        lookup_tokens_proposed=s.lookup_proposed,
        lookup_tokens_accepted=s.lookup_accepted,
        reply_lookup_rounds=s.reply_lookup_rounds,
        reply_lookup_tokens_accepted=s.reply_lookup_accepted,
        draft_catch_up_rounds=s.draft_catch_up_rounds,
        first_round=coordinator_pb2.FirstRound(
            draft_ms=s.first_round.draft_ms,
            verify_ms=s.first_round.verify_ms,
            draft_tokens_proposed=s.first_round.proposed,
            lookup_tokens_proposed=s.first_round.lookup_proposed,
        ),
        proposed_by_position=s.proposed_by_position,
        accepted_by_position=s.accepted_by_position,
    )


def _set_matched_stop(
    message: coordinator_pb2.GenerateResponse | coordinator_pb2.GenerateStreamResponse, turn: Turn
) -> None:
    """Which stop ended the reply: the stop string, else the stop/EOS token id."""
    if turn.stop_string is not None:
        message.stop_string = turn.stop_string
    elif turn.stop_token_id is not None:
        message.stop_token_id = turn.stop_token_id


_REPLY_OVERHEAD = 4096  # usage, stats, seed, stop, field tags: well under this
_TEXT_PER_TOKEN = 64  # bytes of text one token may add to a reply, allowed for (generously)


def _entry_bytes(entries: Sequence[common_pb2.TokenLogprob]) -> int:
    return sum(entry.ByteSize() + 4 for entry in entries)  # + its tag and length in the reply


def round_bytes(out: RoundOutput) -> int:
    """What one round adds to a unary reply."""
    text = len(out.text.encode())
    return _entry_bytes(out.logprobs) + _entry_bytes(out.prompt_logprobs) + 5 * len(out.token_ids) + text


def _round_reserve(turn: Turn, limits: Limits) -> int:
    """At most what one more round can add to a unary reply: its tokens, their text and entries."""
    tokens = max(limits.max_k, limits.lookup_max_tokens) + 1
    entry = 0
    if turn.request.logprobs:
        widest = common_pb2.TopLogprob(token_id=limits.vocab_size - 1, logprob=-1.0)
        sample = common_pb2.TokenLogprob(
            token_id=limits.vocab_size - 1, logprob=-1.0, top=[widest] * turn.request.top_logprobs
        )
        entry = sample.ByteSize() + 4
    return tokens * (entry + 5 + _TEXT_PER_TOKEN) + _REPLY_OVERHEAD


def reply_room(turn: Turn, engine: Engine) -> int:
    """How large a unary reply may grow (by round_bytes) and still have room for one more round
    under the coordinator's message limit."""
    return engine.settings.max_message_bytes - _round_reserve(turn, engine.limits)


def reply_too_large(engine: Engine, streaming: str) -> ReplyTooLarge:
    """The error of a unary reply past reply_room; ``streaming``: how this API streams instead."""
    return ReplyTooLarge(
        f"the reply would be larger than the coordinator's message limit ({engine.settings.max_message_bytes:,} "
        f"bytes, --max-message-bytes): use {streaming} (a message per round), ask for fewer top_logprobs or "
        "tokens, or raise the limit"
    )


class GenerationServicer(coordinator_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def _turn(self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Turn:
        parsed = await parse_request_off_loop(request, self._engine.limits)
        if parsed.session_id:  # the caller's own namespace: other callers' sessions are invisible
            parsed = dataclasses.replace(parsed, session_id=scoped_session_id(caller_identity.get(), parsed.session_id))
        return self._engine.new_turn(parsed, _deadline(context))

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GenerateResponse:
        turn = await self._turn(request, context)
        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        prompt_logprobs: list[common_pb2.TokenLogprob] = []
        finish = None
        # One message carries every round: past what leaves room for one more round under the
        # message limit, the turn ends unfinished (rolled back) rather than finishing into a reply
        # that cannot be sent.
        room = reply_room(turn, self._engine)
        size = 0
        async with self._engine.admitted(), contextlib.aclosing(turn.rounds()) as rounds:
            async for out in rounds:
                token_ids += out.token_ids
                text.append(out.text)
                logprobs += out.logprobs
                prompt_logprobs += out.prompt_logprobs
                finish = out.finish
                size += round_bytes(out)
                if finish is None and size > room:
                    raise reply_too_large(self._engine, "GenerateStream")
        reply = coordinator_pb2.GenerateResponse(
            session_id=request.session_id,
            token_ids=token_ids,
            text="".join(text),
            finish_reason=_FINISH[finish] if finish else coordinator_pb2.FINISH_REASON_UNSPECIFIED,
            usage=_usage(turn),
            stats=_stats(turn),
            seed=turn.request.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        _set_matched_stop(reply, turn)
        return reply

    async def GenerateStream(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        turn = await self._turn(request, context)
        # closed explicitly: a stream ended at a yield (its client stopped reading) rolls the turn back now
        async with self._engine.admitted(), contextlib.aclosing(turn.rounds()) as rounds:
            async for out in rounds:
                message = coordinator_pb2.GenerateStreamResponse(
                    session_id=request.session_id,
                    token_ids=out.token_ids,
                    text=out.text,
                    logprobs=out.logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                )
                if out.finish is not None:
                    message.finish_reason = _FINISH[out.finish]
                    message.usage.CopyFrom(_usage(turn))
                    message.stats.CopyFrom(_stats(turn))
                    message.seed = turn.request.seed
                    _set_matched_stop(message, turn)
                yield message

    async def CloseSession(
        self, request: coordinator_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CloseSessionResponse:
        check_session_id(request.session_id)
        session_id = scoped_session_id(caller_identity.get(), request.session_id)
        return coordinator_pb2.CloseSessionResponse(existed=await self._engine.close_session(session_id))

    async def GetInfo(
        self, request: coordinator_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetInfoResponse:
        return self._engine.info
