"""DraftWorker gRPC servicer: wire <-> domain."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from draft_worker.engine import DraftEngine
from draft_worker.settings import DraftSettings
from specdec.errors import InvalidRequest
from specdec.proposals import encode_block
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.worker import WorkerCore, warp_from_proto


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    def __init__(self, core: WorkerCore, settings: DraftSettings) -> None:
        self._core = core
        self._engine = DraftEngine(core, settings.proposal_top_n)
        self._settings = settings

    async def Info(
        self, request: draft_pb2.DraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftInfoResponse:
        return draft_pb2.DraftInfoResponse(info=self._core.info())

    async def Propose(
        self, request_iterator: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeResponse]:
        session_id = ""
        async for request in request_iterator:
            if session_id and request.session_id != session_id:
                raise InvalidRequest("every message of a Propose stream must name the same session_id")
            session_id = request.session_id
            structlog.contextvars.bind_contextvars(session_id=session_id)
            yield await self._propose(request)

    async def _propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        k = request.num_tokens
        if not 0 < k <= self._settings.max_draft_tokens:
            raise InvalidRequest(f"num_tokens must be in [1, {self._settings.max_draft_tokens}], got {k}")
        self._core.check_request(request.session_id, request.base_len, request.tail_token_ids, k - 1)
        result = await self._core.compute(
            self._engine.propose,
            request.session_id,
            request.base_len,
            request.prefix_hash,
            list(request.tail_token_ids),
            k,
            warp_from_proto(request.warp),
            request.seed,
        )
        if result.resync:
            return draft_pb2.ProposeResponse(
                round_id=request.round_id, cache_status=common_pb2.CACHE_STATUS_RESYNC_REQUIRED
            )
        return draft_pb2.ProposeResponse(
            round_id=request.round_id,
            cache_status=common_pb2.CACHE_STATUS_OK,
            draft=encode_block(list(result.samples)),
            cache_len=result.cache_len,
            compute_ms=result.compute_ms,
        )

    async def ReleaseSession(
        self, request: draft_pb2.DraftReleaseSessionRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftReleaseSessionResponse:
        return draft_pb2.DraftReleaseSessionResponse(existed=await self._core.release(request.session_id))
