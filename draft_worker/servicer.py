"""DraftWorker gRPC servicer: wire <-> domain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import grpc
import structlog

from draft_worker.engine import Block, DraftParams, Resync, lookahead_job, propose_job, translated_propose_job
from draft_worker.settings import DraftSettings
from specdec.runtime.modeling import LoadedModel
from specdec.runtime.processing import processing_from_proto
from specdec.runtime.proposals import encode_block, warp_from_proto
from specdec.runtime.scheduler import Job
from specdec.runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
from specdec.runtime.vocab import VocabBridge
from specdec.serving.errors import InvalidRequest
from specdec.serving.worker import WorkerCore
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = structlog.get_logger(__name__)

_END = object()


class Vocabulary:
    """The ids this draft speaks on the wire: its own, or the target's when its tokenizer
    differs (``bridge`` set; see specdec.runtime.vocab)."""

    def __init__(self) -> None:
        self.bridge: VocabBridge | None = None
        self.wire_tokenizer_hash = ""
        self.model_tokenizer_hash = ""

    def load(self, settings: DraftSettings, loaded: LoadedModel) -> None:
        """Runs at start-up (in the model thread, after the model); raises with what to fix."""
        self.model_tokenizer_hash = self.wire_tokenizer_hash = loaded.tokenizer_hash
        if not settings.target_tokenizer:
            return
        target = load_tokenizer(settings.target_tokenizer, settings.trust_remote_code)
        self.wire_tokenizer_hash = tokenizer_fingerprint(target)
        if self.wire_tokenizer_hash == self.model_tokenizer_hash:
            log.info("same_tokenizer_as_target", target_tokenizer=settings.target_tokenizer)
            return
        own = load_tokenizer(settings.model, settings.trust_remote_code)
        self.bridge = VocabBridge(own, target, loaded.vocab_size, settings.vocab_method)
        log.info(
            "vocab_translation",
            method=settings.vocab_method,
            shared_tokens=self.bridge.shared_tokens,
            target_tokens=self.bridge.target_size,
        )

    def describe(self, info: common_pb2.WorkerInfo) -> common_pb2.WorkerInfo:
        info.model_tokenizer_hash = self.model_tokenizer_hash
        if self.bridge is None:
            info.vocab_translation = common_pb2.VOCAB_TRANSLATION_SHARED
            return info
        info.tokenizer_hash = self.wire_tokenizer_hash
        info.vocab_size = self.bridge.target_size
        info.shared_vocab_tokens = self.bridge.shared_tokens
        info.vocab_translation = (
            common_pb2.VOCAB_TRANSLATION_TLI if self.bridge.method == "tli" else common_pb2.VOCAB_TRANSLATION_SLEM
        )
        return info


def _response(block: Block, round_id: int, lookahead: bool) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        round_id=round_id,
        cache_status=common_pb2.CACHE_STATUS_OK,
        draft=encode_block(list(block.samples)),
        cache_len=block.cache_len,
        compute_ms=block.compute_ms,
        lookahead=lookahead,
        base_len=block.start - len(block.assumed),
        assumed_token_ids=list(block.assumed),
        ends_unsure=block.ends_unsure,
        unsure_at=block.unsure_at,
    )


def _no_lookahead(round_id: int) -> draft_pb2.ProposeResponse:
    """The answer to a lookahead that could not be drafted: an empty lookahead block. Every
    request that asks for a lookahead gets one answer, so the coordinator never waits in vain."""
    return draft_pb2.ProposeResponse(round_id=round_id, cache_status=common_pb2.CACHE_STATUS_OK, lookahead=True)


class _ProposeStream:
    """One Propose stream: requests answered in order; lookahead blocks pushed unasked."""

    def __init__(
        self, core: WorkerCore, settings: DraftSettings, vocabulary: Vocabulary, outbox: asyncio.Queue[object]
    ) -> None:
        self._core = core
        self._settings = settings
        self._bridge = vocabulary.bridge
        self._wire_tokenizer_hash = vocabulary.wire_tokenizer_hash
        self._outbox = outbox
        self._session = ""
        self._params: DraftParams | None = None
        self._last: Block | None = None
        self._lookahead: asyncio.Task[None] | None = None

    async def serve(self, requests: AsyncIterator[draft_pb2.ProposeRequest]) -> None:
        try:
            async for request in requests:
                await self._handle(request)
        except Exception as exc:  # re-raised by the stream's generator
            self._outbox.put_nowait(exc)
        finally:
            await self.cancel_lookahead()
            self._outbox.put_nowait(_END)

    async def _handle(self, request: draft_pb2.ProposeRequest) -> None:
        if self._session and request.session_id != self._session:
            raise InvalidRequest("every message of a Propose stream must name the same session_id")
        self._session = request.session_id
        structlog.contextvars.bind_contextvars(session_id=self._session)
        # the vocabulary size may differ (a differently padded output layer): the tokenizer may not
        self._core.check_vocabulary(request.tokenizer_hash, 0, self._wire_tokenizer_hash)
        if request.adopt_lookahead:
            if self._last is None or not self._last.assumed:
                raise InvalidRequest("adopt_lookahead needs a lookahead block sent on this stream")
            self._start_lookahead(request.round_id)
            return
        await self.cancel_lookahead()
        block = await self._propose(request)
        if isinstance(block, Resync):
            response = draft_pb2.ProposeResponse(
                round_id=request.round_id, cache_status=common_pb2.CACHE_STATUS_RESYNC_REQUIRED, resync_from=block.start
            )
            self._outbox.put_nowait(response)
            return
        self._outbox.put_nowait(_response(block, request.round_id, lookahead=False))
        if request.lookahead:
            self._start_lookahead(request.round_id)

    async def _propose(self, request: draft_pb2.ProposeRequest) -> Block | Resync:
        k = request.num_tokens
        if not 0 < k <= self._settings.max_draft_tokens:
            raise InvalidRequest(f"num_tokens must be in [1, {self._settings.max_draft_tokens}], got {k}")
        if not 0.0 <= request.min_confidence < 1.0:  # NaN fails too
            raise InvalidRequest(f"min_confidence must be in [0, 1), got {request.min_confidence}")
        if not 0.0 <= request.min_block_confidence < 1.0:
            raise InvalidRequest(f"min_block_confidence must be in [0, 1), got {request.min_block_confidence}")
        core, bridge = self._core, self._bridge
        if bridge is None:
            core.check_request(request.session_id, request.sync, k - 1)
        else:  # the ids are the target's; the draft's own context is checked in its own tokens
            vocab = max(bridge.target_size, request.vocab_limit)  # the target model may have padded ids
            core.check_request(request.session_id, request.sync, 0, vocab, check_context=False)
        params = DraftParams(
            k,
            warp_from_proto(request.warp),
            request.seed,
            self._settings.proposal_top_n,
            request.vocab_limit,
            processing_from_proto(request.processing),
            request.min_confidence,
            request.min_block_confidence,
            self._settings.guess_tokens,
            request.report_stops_only,
        )
        # a translating draft does not mask (its tokens are not the grammar's); a grammar still
        # compiling is left out of this proposal (see prepare_grammar)
        grammar = params.processing.grammar
        if bridge is None and grammar and not await core.prepare_grammar(grammar):
            params = dataclasses.replace(params, processing=dataclasses.replace(params.processing, grammar=""))
        self._params = params
        sync = request.sync

        def job() -> Job[Block | Resync]:
            if bridge is None:
                return propose_job(core.caches, core.loaded, self._session, sync, params)
            return translated_propose_job(core.caches, core.loaded, bridge, self._session, sync, params)

        block = await core.run(self._session, job)
        self._count(block)
        self._last = block if isinstance(block, Block) else None
        return block

    def _start_lookahead(self, round_id: int) -> None:
        previous, params, core = self._last, self._params, self._core
        assert previous is not None and params is not None
        if self._bridge is not None or previous.cache_len + 2 + params.k - 1 > core.loaded.max_context_len:
            # no room for another block, or a draft of another vocabulary (it drafts from the
            # committed text only): say so
            self._outbox.put_nowait(_no_lookahead(round_id))
            return
        self._lookahead = asyncio.create_task(self._run_lookahead(previous, params, round_id))

    async def _run_lookahead(self, previous: Block, params: DraftParams, round_id: int) -> None:
        core = self._core
        try:
            block = await core.run(
                self._session, lambda: lookahead_job(core.caches, core.loaded, self._session, previous, params)
            )
        except Exception as exc:  # the stream fails with it
            self._outbox.put_nowait(exc)
            return
        self._count(block)
        if block is None:  # the cache moved on (evicted, released): an explicit "no lookahead"
            self._outbox.put_nowait(_no_lookahead(round_id))
            return
        self._last = block
        self._outbox.put_nowait(_response(block, round_id, lookahead=True))

    async def cancel_lookahead(self) -> None:
        if self._lookahead is not None and not self._lookahead.done():
            self._lookahead.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lookahead
        self._lookahead = None

    def _count(self, block: Block | Resync | None) -> None:
        metrics = self._core.metrics
        if not isinstance(block, Block):  # a resync, or a lookahead whose cache moved on
            metrics.resyncs.inc()
            return
        metrics.computed_tokens.inc(block.computed_tokens)
        metrics.compute_seconds.observe(block.compute_ms / 1000)
        metrics.guessed_tokens.inc(block.guessed)
        metrics.guesses_taken.inc(block.guesses_taken)


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    def __init__(self, core: WorkerCore, settings: DraftSettings, vocabulary: Vocabulary) -> None:
        self._core = core
        self._settings = settings
        self._vocabulary = vocabulary

    async def Info(
        self, request: draft_pb2.DraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftInfoResponse:
        info = self._vocabulary.describe(self._core.info())
        info.max_draft_tokens = self._settings.max_draft_tokens
        return draft_pb2.DraftInfoResponse(info=info)

    async def Propose(
        self, request_iterator: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeResponse]:
        outbox: asyncio.Queue[object] = asyncio.Queue()
        stream = _ProposeStream(self._core, self._settings, self._vocabulary, outbox)
        reader = asyncio.create_task(stream.serve(request_iterator))
        try:
            while (item := await outbox.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, draft_pb2.ProposeResponse)
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await stream.cancel_lookahead()

    async def ReleaseSession(
        self, request: draft_pb2.DraftReleaseSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftReleaseSessionResponse:
        return draft_pb2.DraftReleaseSessionResponse(existed=await self._core.release(request.session_id))
