"""The workers' RPCs on any request: served, or refused as the caller's error; the worker serves on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from draft_worker.servicer import DraftServicer, Vocabulary
from draft_worker.settings import DraftSettings
from specdec.serving.errors import SpecdecError
from specdec.serving.server import ServerControl
from specdec.serving.worker import WorkerCore
from specdec.v1 import common_pb2, draft_pb2, target_pb2
from target_worker.load import UINT32_MAX
from target_worker.servicer import TargetServicer
from target_worker.settings import TargetSettings
from tests.fuzz import fill_any
from tests.tiny_models import TinyModels

T = TypeVar("T")

# What a caller's bad request may be answered with: its own error, never INTERNAL (a worker fault)
CALLER_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,  # another vocabulary
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
IDENTITY = frozenset({"session_id", "tokenizer_hash", "vocab_size"})


class _Worker:
    """A worker's servicer over a loaded tiny model, its event loop in a thread of its own (the
    worker's asyncio objects stay on one loop across hypothesis examples), set up as
    ``specdec serve target`` / ``draft`` set theirs up."""

    def __init__(self, role: str, model: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.control = ServerControl()
        options: dict[str, Any] = {"model": model, "device": "cpu", "max_draft_tokens": 8, "warm_up_widths": 0}
        worker_settings = TargetSettings(**options) if role == "target" else DraftSettings(**options)
        self.core = WorkerCore(worker_settings, self.control, CollectorRegistry())
        self.run(self.core.load())
        if isinstance(worker_settings, TargetSettings):
            self.servicer: Any = TargetServicer(self.core, worker_settings)
        else:
            vocabulary = Vocabulary()
            self.run(self.core.scheduler.call(vocabulary.load, worker_settings, self.core.loaded))
            self.servicer = DraftServicer(self.core, worker_settings, vocabulary)
        self.info = self.core.info()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)

    def close(self) -> None:
        self.core.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def target(tiny_models: TinyModels) -> Iterator[_Worker]:
    worker = _Worker("target", str(tiny_models.target))
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def draft(tiny_models: TinyModels) -> Iterator[_Worker]:
    worker = _Worker("draft", str(tiny_models.other))
    yield worker
    worker.close()


def _served_or_refused(worker: _Worker, send: Callable[[], Sequence[Any]]) -> None:
    """``send``'s replies are proposals or verdicts (OK) or resyncs, or it raises the caller's error
    saying what was wrong; either way the worker has not asked to stop."""
    try:
        replies = send()
    except SpecdecError as refused:
        assert refused.code in CALLER_ERRORS and str(refused), (refused.code, str(refused))
    else:
        served = (common_pb2.CACHE_STATUS_OK, common_pb2.CACHE_STATUS_RESYNC_REQUIRED)
        assert all(reply.cache_status in served for reply in replies)
    assert not worker.control.stop_requested.is_set()


def _verify(worker: _Worker, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
    return worker.run(worker.servicer.Verify(request, SimpleNamespace()))  # type: ignore[arg-type]


def _plain_block(session_id: str, **fields: Any) -> target_pb2.VerifyRequest:
    """A well-formed greedy Verify: two draft tokens after three committed ones."""
    request = target_pb2.VerifyRequest(session_id=session_id, warp=common_pb2.WarpParams(temperature=0.0), **fields)
    request.sync.tail_token_ids.extend([5, 6, 7])
    request.draft.kind = common_pb2.PROPOSAL_KIND_ONE_HOT
    request.draft.token_ids.extend([8, 9])
    return request


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_verify_request_is_served_or_refused_as_the_caller_s_error(target: _Worker, data: st.DataObject) -> None:
    """Any Verify request (a block after a few committed tokens, as the coordinator sends, with up
    to 4 fields each of the request, its prefix sync, its block, its warping and its logits
    processing set to any value of their types: ids past the vocabulary, NaN probabilities and
    temperatures, unknown proposal kinds, the largest counts) is verified or refused with the
    caller's error saying what was wrong: never INTERNAL, never a model fault that stops the
    worker; and the worker still verifies a plain block afterwards."""
    vocab = target.info.vocab_size
    request = target_pb2.VerifyRequest(
        session_id=data.draw(st.sampled_from(["a", "b", "c"])),
        tokenizer_hash=target.info.tokenizer_hash,
        vocab_size=vocab,
    )
    request.sync.tail_token_ids.extend(data.draw(st.lists(st.integers(0, vocab + 1), min_size=1, max_size=6)))
    request.draft.kind = common_pb2.PROPOSAL_KIND_ONE_HOT
    request.draft.token_ids.extend(data.draw(st.lists(st.integers(0, vocab + 1), max_size=4)))
    # the session and vocabulary fields as the coordinator sends them, in most requests: any
    # other value is refused before the rest is read
    fill_any(data.draw, request, keep=IDENTITY if data.draw(st.integers(0, 4)) else frozenset())
    for message in (request.sync, request.draft, request.warp, request.processing):
        fill_any(data.draw, message)
    _served_or_refused(target, lambda: [_verify(target, request)])
    assert _verify(target, _plain_block("plain")).cache_status == common_pb2.CACHE_STATUS_OK


def test_coordinator_counts_past_a_reply_s_range_do_not_break_the_worker_s_replies(target: _Worker) -> None:
    """Found by the Verify fuzz test above (flaky, as reports go quiet): one coordinator reporting
    the largest uint32 count and another any count made the sum of their counts, which every reply
    carries (service_requests, uint32), fail to serialize: INTERNAL for every caller. Now the
    reply says the largest count it can carry."""
    huge = _plain_block("counts-huge", coordinator_id="huge", coordinator_requests=UINT32_MAX)
    assert _verify(target, huge).service_requests == UINT32_MAX
    reply = _verify(target, _plain_block("counts-small", coordinator_id="small", coordinator_requests=5))
    assert reply.cache_status == common_pb2.CACHE_STATUS_OK and reply.service_requests == UINT32_MAX


async def _one(request: draft_pb2.ProposeRequest) -> AsyncIterator[draft_pb2.ProposeRequest]:
    yield request


def _propose(worker: _Worker, request: draft_pb2.ProposeRequest) -> list[draft_pb2.ProposeResponse]:
    async def replies() -> list[draft_pb2.ProposeResponse]:
        return [reply async for reply in worker.servicer.Propose(_one(request), SimpleNamespace())]

    return worker.run(replies())


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_propose_request_is_served_or_refused_as_the_caller_s_error(draft: _Worker, data: st.DataObject) -> None:
    """Any Propose request (a block of 1-4 tokens after a few committed tokens, as the coordinator
    asks, with up to 4 fields each of the request, its prefix sync, its warping and its logits
    processing set to any value of their types) gets its proposal or a resync, or ends the stream
    with the caller's error saying what was wrong: never INTERNAL, never a model fault that stops
    the worker; and the worker still drafts a plain block afterwards."""
    vocab = draft.info.vocab_size
    request = draft_pb2.ProposeRequest(
        session_id=data.draw(st.sampled_from(["a", "b", "c"])), num_tokens=data.draw(st.integers(1, 4))
    )
    request.sync.tail_token_ids.extend(data.draw(st.lists(st.integers(0, vocab + 1), min_size=1, max_size=6)))
    fill_any(data.draw, request, keep=frozenset({"session_id"}) if data.draw(st.integers(0, 4)) else frozenset())
    for message in (request.sync, request.warp, request.processing):
        fill_any(data.draw, message)
    _served_or_refused(draft, lambda: _propose(draft, request))
    plain = draft_pb2.ProposeRequest(session_id="plain", num_tokens=3, warp=common_pb2.WarpParams(temperature=0.0))
    plain.sync.tail_token_ids.extend([5, 6, 7])
    (reply,) = _propose(draft, plain)
    assert reply.cache_status == common_pb2.CACHE_STATUS_OK and len(reply.draft.token_ids) == 3


def test_a_propose_with_its_stops_only_reported_answers_k_tokens_and_where_they_would_end(draft: _Worker) -> None:
    """Through the draft's servicer (the messages a coordinator sends and reads): with
    ``report_stops_only`` the block holds ``num_tokens`` tokens, the tokens drafted without the
    stops, ``ends_unsure`` is false and ``unsure_at`` is the length of the block the stops would
    have drafted; the stops applied report the same position at their block's end."""

    def propose(session: str, **stops: Any) -> draft_pb2.ProposeResponse:
        request = draft_pb2.ProposeRequest(
            session_id=session, num_tokens=8, warp=common_pb2.WarpParams(temperature=0.0), **stops
        )
        request.sync.tail_token_ids.extend([5, 6, 7])
        (reply,) = _propose(draft, request)
        assert reply.cache_status == common_pb2.CACHE_STATUS_OK
        return reply

    plain = propose("stops-plain")
    applied = propose("stops-applied", min_block_confidence=0.5)
    reported = propose("stops-reported", min_block_confidence=0.5, report_stops_only=True)
    assert 0 < len(applied.draft.token_ids) < 8 and applied.ends_unsure  # the tiny draft is unsure early
    assert applied.unsure_at == len(applied.draft.token_ids)
    assert list(reported.draft.token_ids) == list(plain.draft.token_ids) and len(plain.draft.token_ids) == 8
    assert not reported.ends_unsure and reported.unsure_at == applied.unsure_at
    assert plain.unsure_at == 0
