"""Request validation: every rejection names the field and what is allowed."""

from __future__ import annotations

import math

import pytest

from coordinator.validation import Limits, parse_request
from specdec.serving.errors import InvalidRequest, RequestTooLarge
from specdec.v1 import common_pb2, coordinator_pb2

LIMITS = Limits(
    vocab_size=100,
    max_context_len=64,
    eos_token_ids=frozenset({2}),
    default_max_new_tokens=16,
    default_k=4,
    max_k=8,
    max_prompt_chars=1000,
)


def req(**kwargs: object) -> coordinator_pb2.GenerateRequest:
    base: dict[str, object] = {"prompt_token_ids": common_pb2.TokenIds(ids=[1, 2, 3])}
    base.update(kwargs)
    return coordinator_pb2.GenerateRequest(**base)  # type: ignore[arg-type]


def test_oversized_prompt_is_resource_exhausted() -> None:
    with pytest.raises(RequestTooLarge, match="prompt has 1001 characters; the limit is 1000"):
        parse_request(coordinator_pb2.GenerateRequest(prompt="x" * 1001), LIMITS)


def test_defaults() -> None:
    turn = parse_request(req(), LIMITS)
    assert turn.prompt_ids == (1, 2, 3) and turn.prompt_text is None
    assert turn.max_new_tokens == 16 and turn.k == 4 and turn.warp.greedy
    assert turn.stop_ids == {2} and turn.session_id == "" and 0 <= turn.seed < 2**63


def test_ignore_eos_and_stop_ids() -> None:
    turn = parse_request(req(sampling=common_pb2.SamplingParams(ignore_eos=True, stop_token_ids=[7, 9])), LIMITS)
    assert turn.stop_ids == {7, 9}


def test_speculation_params() -> None:
    assert parse_request(req(speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=8)), LIMITS).k == 8
    assert parse_request(req(speculation=coordinator_pb2.SpeculationParams(disable=True)), LIMITS).k == 0


def test_seed_is_kept() -> None:
    assert parse_request(req(sampling=common_pb2.SamplingParams(seed=5)), LIMITS).seed == 5


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (coordinator_pb2.GenerateRequest(), "prompt is empty"),
        (coordinator_pb2.GenerateRequest(prompt=""), "prompt is empty"),
        (req(prompt_token_ids=common_pb2.TokenIds(ids=[])), "prompt is empty"),
        (req(prompt_token_ids=common_pb2.TokenIds(ids=[1, 100])), "prompt_token_ids contains token id 100"),
        (req(prompt_token_ids=common_pb2.TokenIds(ids=[1] * 64)), "context length is 64"),
        (req(sampling=common_pb2.SamplingParams(max_new_tokens=0)), r"max_new_tokens must be in \[1, 63\]"),
        (req(sampling=common_pb2.SamplingParams(max_new_tokens=64)), r"max_new_tokens must be in \[1, 63\]"),
        (req(sampling=common_pb2.SamplingParams(temperature=-0.5)), "temperature must be a finite number"),
        (req(sampling=common_pb2.SamplingParams(temperature=math.nan)), "temperature must be a finite number"),
        (req(sampling=common_pb2.SamplingParams(temperature=math.inf)), "temperature must be a finite number"),
        (req(sampling=common_pb2.SamplingParams(top_k=-1)), "top_k must be >= 0"),
        (req(sampling=common_pb2.SamplingParams(top_p=0.0)), r"top_p must be in \(0, 1\]"),
        (req(sampling=common_pb2.SamplingParams(top_p=1.01)), r"top_p must be in \(0, 1\]"),
        (req(sampling=common_pb2.SamplingParams(stop_token_ids=[500])), "stop_token_ids contains token id 500"),
        (
            req(speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=9)),
            "num_speculative_tokens must be <= 8",
        ),
        (req(session_id="bad id with spaces"), "session_id must be"),
        (req(session_id="chat\n"), "session_id must be"),
        (req(session_id="a" * 129), "session_id must be"),
        (req(require_existing_session=True), "require_existing_session needs a session_id"),
    ],
)
def test_invalid_requests(request_: coordinator_pb2.GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_request(request_, LIMITS)
