"""Request validation: every rejection names the field and what is allowed."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from coordinator.adaptive import NO_STOP, ConfidenceStop
from coordinator.engine_api import VllmEngineServicer
from coordinator.validation import Limits, parse_request
from specdec.serving.errors import InvalidRequest, RequestTooLarge, Unsupported
from specdec.v1 import common_pb2, coordinator_pb2
from tests.fuzz import fill_any
from tests.tiny_models import build_tokenizer

LIMITS = Limits(
    vocab_size=100,
    max_context_len=64,
    eos_token_ids=frozenset({2}),
    default_max_new_tokens=16,
    default_k=4,
    max_k=8,
    max_prompt_chars=1000,
)

BYTES = build_tokenizer()  # the tiny models' tokenizer (the engine API's text input)

S = common_pb2.SamplingParams


def req(**kwargs: object) -> coordinator_pb2.GenerateRequest:
    base: dict[str, object] = {"prompt_token_ids": common_pb2.TokenIds(ids=[1, 2, 3])}
    base.update(kwargs)
    return coordinator_pb2.GenerateRequest(**base)  # type: ignore[arg-type]


def test_oversized_prompt_is_resource_exhausted() -> None:
    with pytest.raises(RequestTooLarge, match="prompt has 1001 characters; the limit is 1000"):
        parse_request(coordinator_pb2.GenerateRequest(prompt="x" * 1001), LIMITS)


def test_oversized_messages_are_resource_exhausted_roles_included() -> None:
    """A role is rendered and tokenized like the content, so it counts toward the limit too (a
    message's role could otherwise fill the whole 8 MiB message)."""
    message = coordinator_pb2.ChatMessage
    with pytest.raises(RequestTooLarge, match="the messages have 1001 characters"):
        parse_request(coordinator_pb2.GenerateRequest(messages=[message(role="user", content="x" * 997)]), LIMITS)
    with pytest.raises(RequestTooLarge, match="the messages have 1002 characters"):
        parse_request(coordinator_pb2.GenerateRequest(messages=[message(role="u" * 1001, content="x")]), LIMITS)
    parse_request(coordinator_pb2.GenerateRequest(messages=[message(role="user", content="x" * 996)]), LIMITS)


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


def test_confidence_stops_default_to_the_server_s_unless_k_is_fixed() -> None:
    limits = dataclasses.replace(LIMITS, draft_confidence=0.6, draft_block_confidence=0.5)
    spec = coordinator_pb2.SpeculationParams
    assert parse_request(req(), limits).draft_stop == ConfidenceStop(pytest.approx(0.6), 0.5)
    assert parse_request(req(speculation=spec(fixed=True)), limits).draft_stop == NO_STOP  # exactly K
    fixed_with_stop = parse_request(req(speculation=spec(fixed=True, draft_confidence=0.3)), limits).draft_stop
    assert fixed_with_stop == ConfidenceStop(pytest.approx(0.3), 0.0)
    fixed_with_block_stop = spec(fixed=True, draft_block_confidence=0.25)
    assert parse_request(req(speculation=fixed_with_block_stop), limits).draft_stop == ConfidenceStop(0.0, 0.25)
    each_its_own = parse_request(req(speculation=spec(draft_confidence=0.0)), limits).draft_stop
    assert each_its_own == ConfidenceStop(0.0, 0.5)  # the one the request leaves unset stays the server's
    both_off = spec(draft_confidence=0.0, draft_block_confidence=0.0)
    assert parse_request(req(speculation=both_off), limits).draft_stop == NO_STOP


def test_only_the_server_s_block_stop_follows_the_costs() -> None:
    """With ``draft_block_confidence_from_costs`` a request that leaves its block stop unset gets
    the server's, set from the costs; one that sets its own (0.5 included) gets exactly that, and a
    fixed-K request and a server whose stop is 0 get none."""
    limits = dataclasses.replace(LIMITS, draft_block_confidence=0.5, draft_block_confidence_from_costs=True)
    spec = coordinator_pb2.SpeculationParams
    assert parse_request(req(), limits).draft_stop == ConfidenceStop(0.0, 0.5, block_from_costs=True)
    assert parse_request(req(speculation=spec(draft_confidence=0.3)), limits).draft_stop.block_from_costs
    own = parse_request(req(speculation=spec(draft_block_confidence=0.5)), limits).draft_stop
    assert own == ConfidenceStop(0.0, 0.5)
    assert parse_request(req(speculation=spec(fixed=True)), limits).draft_stop == NO_STOP
    off = dataclasses.replace(limits, draft_block_confidence=0.0)
    assert parse_request(req(), off).draft_stop == NO_STOP
    assert parse_request(req(), dataclasses.replace(limits, draft_block_confidence_from_costs=False)).draft_stop == (
        ConfidenceStop(0.0, 0.5)
    )


def test_with_a_confidence_stop_an_adaptive_request_without_k_drafts_up_to_the_largest_k() -> None:
    """A stop ends the blocks; K only caps them (HF's assisted generation: up to 20 tokens
    until its 0.4 threshold). A K the request sets, fixed K and a request without a stop keep
    the server's default K."""
    spec = coordinator_pb2.SpeculationParams
    for limits in (
        dataclasses.replace(LIMITS, draft_confidence=0.4),
        dataclasses.replace(LIMITS, draft_block_confidence=0.5),
    ):
        assert parse_request(req(), limits).k == 8  # max_k
        assert parse_request(req(speculation=spec(num_speculative_tokens=3)), limits).k == 3
        assert parse_request(req(speculation=spec(fixed=True)), limits).k == 4  # default_k, no stop
        assert parse_request(req(speculation=spec(fixed=True, draft_confidence=0.5)), limits).k == 4
        stops_off = spec(draft_confidence=0.0, draft_block_confidence=0.0)
        assert parse_request(req(speculation=stops_off), limits).k == 4
        assert parse_request(req(speculation=spec(disable=True)), limits).k == 0
        no_speculation = dataclasses.replace(limits, default_k=0)  # --num-speculative-tokens 0
        assert parse_request(req(), no_speculation).k == 0
        assert parse_request(req(speculation=spec(num_speculative_tokens=2)), no_speculation).k == 2
    assert parse_request(req(speculation=spec(draft_confidence=0.7)), LIMITS).k == 8
    assert parse_request(req(speculation=spec(draft_block_confidence=0.7)), LIMITS).k == 8
    assert parse_request(req(), LIMITS).k == 4  # a server without a stop


@pytest.mark.parametrize("field", ["draft_confidence", "draft_block_confidence"])
@pytest.mark.parametrize("value", [-0.1, 1.0, 2.0, math.nan])
def test_confidence_stop_outside_0_1_is_invalid(field: str, value: float) -> None:
    speculation = coordinator_pb2.SpeculationParams(**{field: value})
    with pytest.raises(InvalidRequest, match=rf"speculation.{field} must be in \[0, 1\)"):
        parse_request(req(speculation=speculation), LIMITS)


def test_seed_is_kept() -> None:
    assert parse_request(req(sampling=common_pb2.SamplingParams(seed=5)), LIMITS).seed == 5


def test_min_tokens_may_ban_all_but_one_token() -> None:
    """Every id but one a stop id (EOS included): the one left can be sampled, so it is accepted."""
    turn = parse_request(req(sampling=S(min_tokens=2, stop_token_ids=list(range(1, 100)))), LIMITS)
    assert turn.min_tokens == 2 and len(turn.processing.banned_until_min) == 99
    everything = parse_request(req(sampling=S(min_tokens=0, stop_token_ids=list(range(100)))), LIMITS)
    assert len(everything.stop_ids) == 100  # no min_tokens: every id may end the reply


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
        (req(sampling=S(repetition_penalty=0.0)), r"repetition_penalty must be in \[0.01, 100\]"),
        (req(sampling=S(repetition_penalty=-1.0)), r"repetition_penalty must be in \[0.01, 100\]"),
        (req(sampling=S(repetition_penalty=math.nan)), r"repetition_penalty must be in \[0.01, 100\]"),
        (req(sampling=S(repetition_penalty=2.0**-149)), r"repetition_penalty must be in \[0.01, 100\]"),
        (req(sampling=S(presence_penalty=2.5)), r"presence_penalty must be in \[-2, 2\]"),
        (req(sampling=S(frequency_penalty=-math.inf)), r"frequency_penalty must be in \[-2, 2\]"),
        (req(sampling=S(frequency_penalty=math.nan)), r"frequency_penalty must be in \[-2, 2\]"),
        (req(sampling=S(min_p=1.5)), r"min_p must be in \[0, 1\]"),
        (req(sampling=S(min_p=math.nan)), r"min_p must be in \[0, 1\]"),
        (req(sampling=S(logit_bias={3: 101.0})), r"logit_bias\[3\] must be in \[-100, 100\]"),
        (req(sampling=S(logit_bias={3: math.nan})), r"logit_bias\[3\] must be in \[-100, 100\]"),
        (req(sampling=S(logit_bias={100: 1.0})), "logit_bias contains token id 100"),
        (req(sampling=S(logit_bias=dict.fromkeys(range(1025), 1.0))), "logit_bias has 1025 entries; at most 1024"),
        (req(sampling=S(logprobs=True, top_logprobs=21)), r"top_logprobs must be in \[0, 20\]"),
        (req(sampling=S(top_logprobs=2)), "top_logprobs needs sampling.logprobs"),
        (req(sampling=S(prompt_logprobs=21)), r"prompt_logprobs must be in \[0, 20\]"),
        (req(sampling=S(max_new_tokens=4, min_tokens=5)), r"min_tokens \(5\) must not exceed max_new_tokens \(4\)"),
        (
            req(sampling=S(min_tokens=1, stop_token_ids=[i for i in range(100) if i != 2])),
            "min_tokens would ban every token",
        ),
        (req(sampling=S(stop=["x"] * 17)), "sampling.stop has 17 strings; at most 16"),
        (req(sampling=S(stop=["x" * 257])), "1 to 256 characters"),
        (req(messages=[coordinator_pb2.ChatMessage(role="user", content="hi")]), "either `messages` or a prompt"),
        (
            coordinator_pb2.GenerateRequest(messages=[coordinator_pb2.ChatMessage(role="", content="hi")]),
            r"messages\[0\].role is empty",
        ),
    ],
)
def test_invalid_requests(request_: coordinator_pb2.GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_request(request_, LIMITS)


def test_sampling_features_are_parsed() -> None:
    sampling = S(
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.5, min_p=0.1, logit_bias={4: -100.0, 9: 3.0},
        min_tokens=3, logprobs=True, top_logprobs=20, prompt_logprobs=0, stop_token_ids=[7],
    )  # fmt: skip
    turn = parse_request(req(sampling=sampling), LIMITS)
    p = turn.processing
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == pytest.approx((1.3, 0.5, -0.5))
    assert p.logit_bias == ((4, -100.0), (9, 3.0)) and p.min_tokens == 3 and p.banned_until_min == (2, 7)
    assert turn.warp.min_p == pytest.approx(0.1) and turn.min_tokens == 3
    assert turn.logprobs and turn.top_logprobs == 20 and turn.prompt_logprobs == 0
    plain = parse_request(req(), LIMITS)
    assert not plain.processing.active and plain.prompt_logprobs is None and not plain.logprobs


def test_chat_messages_are_an_input() -> None:
    messages = [
        coordinator_pb2.ChatMessage(role="system", content="be brief"),
        coordinator_pb2.ChatMessage(role="user"),
    ]
    turn = parse_request(coordinator_pb2.GenerateRequest(messages=messages), LIMITS)
    assert turn.messages == (("system", "be brief"), ("user", "")) and turn.prompt_ids is None


@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_any_request_is_parsed_or_refused_as_the_client_s_error(data: st.DataObject) -> None:
    """Any request a client can send (its input one of the three kinds or any fields at all, and
    up to 4 fields each of its sampling and speculation parameters set to any value of their type:
    NaN and infinite floats, the largest integers, unknown enum values, nested messages and maps)
    either parses to a request within the server's limits or is refused with a client error that
    says what was wrong: never another exception (an INTERNAL error for the client)."""
    request = coordinator_pb2.GenerateRequest()
    kind = data.draw(st.sampled_from(["ids", "text", "messages", "any"]))
    if kind == "ids":
        request.prompt_token_ids.ids.extend(data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=8)))
    elif kind == "text":
        request.prompt = data.draw(st.text(min_size=1, max_size=40))
    elif kind == "messages":
        for role in data.draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=3)):
            request.messages.add(role=role, content=data.draw(st.text(max_size=20)))
    else:
        fill_any(data.draw, request)
    fill_any(data.draw, request.sampling)
    fill_any(data.draw, request.speculation)
    for limits in (LIMITS, dataclasses.replace(LIMITS, structured_output=True, draft_context_len=32)):
        try:
            parsed = parse_request(request, limits)
        except (InvalidRequest, RequestTooLarge, Unsupported) as refused:
            assert str(refused)
            continue
        assert 1 <= parsed.max_new_tokens <= limits.max_context_len


class _Parsed(Exception):
    """Raised by the stand-in engine once every completion of an engine-API request is parsed."""


@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_any_engine_api_request_is_parsed_or_refused_as_the_client_s_error(data: st.DataObject) -> None:
    """Any request a gateway can send to the engine API (``vllm.grpc.engine.VllmEngine.Generate``:
    token ids, text, or any of its fields at all, and up to 4 of its sampling parameters at any
    value of their types) goes through the servicer's own checks and conversion to the native
    request, up to where its completions would start: each completion's request parses within the
    limits, or the call is refused with a client error that names no native field (the engine
    caller never saw those names): never another exception (an INTERNAL error for the gateway)."""
    request = vllm_pb2.GenerateRequest(request_id="r")
    kind = data.draw(st.sampled_from(["ids", "text", "any"]))
    if kind == "ids":
        request.tokenized.input_ids.extend(data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=8)))
    elif kind == "text":
        request.text = data.draw(st.text(min_size=1, max_size=40))
    else:
        fill_any(data.draw, request)
    fill_any(data.draw, request.sampling_params)
    parsed: list[Any] = []
    n = request.sampling_params.n or 1

    def new_turn(turn_request: Any, _deadline: float | None) -> SimpleNamespace:
        parsed.append(turn_request)
        if len(parsed) == n:
            raise _Parsed
        return SimpleNamespace(request=turn_request)

    for limits in (LIMITS, dataclasses.replace(LIMITS, structured_output=True, draft_context_len=32)):
        engine = SimpleNamespace(
            limits=limits,
            settings=SimpleNamespace(max_message_bytes=8 << 20),
            deps=SimpleNamespace(tokenizer=BYTES),
            new_turn=new_turn,
        )
        parsed.clear()
        context = SimpleNamespace(time_remaining=lambda: None, invocation_metadata=lambda: ())

        async def call(engine: SimpleNamespace = engine, context: SimpleNamespace = context) -> None:
            async for _ in VllmEngineServicer(engine).Generate(request, context):  # type: ignore[arg-type]
                pass

        try:
            asyncio.run(call())
        except _Parsed:
            assert len(parsed) == n and all(1 <= p.max_new_tokens <= limits.max_context_len for p in parsed)
            continue
        except (InvalidRequest, RequestTooLarge, Unsupported) as refused:
            message = str(refused)
            assert message and "sampling." not in message and "max_new_tokens" not in message, message
            continue
        raise AssertionError("the request neither started nor was refused")


def test_get_info_says_unknown_version_when_specdec_runs_from_a_tree_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A coordinator started from a source tree on PYTHONPATH (no package metadata) once failed its
    start-up on GetInfo's version; it reports "unknown" instead."""
    from coordinator.engine import server_info
    from coordinator.settings import CoordinatorSettings

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    target = common_pb2.WorkerInfo(model_id="t")
    info = server_info(CoordinatorSettings(target_addresses=["t:1"]), LIMITS, target, None, False, False)
    assert info.server_version == "unknown"
    assert info.target_model_id == "t"
