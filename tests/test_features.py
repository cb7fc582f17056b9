"""Request features through the real service (three processes): penalties, min_p, logit_bias and
min_tokens token-identical to HF ``generate`` with the same processors; logprobs equal to a plain
forward pass of the target; chat messages rendered with real chat templates (Qwen2.5, SmolLM2)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessorList

from specdec.runtime.grammar import grammar_of
from specdec.runtime.processing import Processing
from specdec.tools.launch import LocalCluster
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import HUGE_TEXT, loop_stall_during, metric, wait_for
from tests.conftest import CLUSTER_COORDINATOR_ARGS, CLUSTER_WORKER_ARGS
from tests.helpers import RedisServer, real_tokenizer
from tests.reference import AsLogitsProcessor, coordinator_stub, make_request, read_session
from tests.spec_oracle import Processor, reference_grammar, reference_processing
from tests.tiny_models import TinyModels, build_model

PROMPTS = [[5, 17, 99, 3, 5, 17], [200, 1, 42, 42, 7, 130, 64, 11, 250, 0]]
MAX_NEW = 20


@pytest.fixture(params=["pipelined", "sequential"])
def stub(request: pytest.FixtureRequest) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    """A target + sometimes-right draft service, in either speculation mode."""
    yield from coordinator_stub(request.getfixturevalue(f"cluster_{request.param}"))


@cache
def _model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(
    model_dir: str, prompt: list[int], processing: Processing, stop_ids: list[int], mask: Processor | None = None
) -> list[int]:
    """Greedy HF ``generate`` (no assistant) with the same processing (and ``mask``, a
    structured-output reference), stopping at EOS / stop ids."""
    model = _model(model_dir)
    config = GenerationConfig(
        max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stop_ids, pad_token_id=model.config.pad_token_id
    )
    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([AsLogitsProcessor(reference_processing(processing, len(prompt)))])
    if mask is not None:
        processors.append(AsLogitsProcessor(mask))
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), generation_config=config, logits_processor=processors
    )
    return out[0, len(prompt) :].tolist()


def _sampling(processing: Processing, **extra: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_new_tokens=MAX_NEW,
        repetition_penalty=processing.repetition_penalty,
        presence_penalty=processing.presence_penalty,
        frequency_penalty=processing.frequency_penalty,
        logit_bias=dict(processing.logit_bias),
        min_tokens=processing.min_tokens,
        **extra,  # type: ignore[arg-type]
    )


PROCESSINGS = {
    "repetition": Processing(repetition_penalty=1.5),
    "presence-frequency": Processing(presence_penalty=1.2, frequency_penalty=0.8),
    "all": Processing(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.5, logit_bias=((42, 4.0),)),
}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", list(PROCESSINGS))
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_greedy_processing_equals_hf_generate(
    stub: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels, prompt: list[int], name: str, k: int
) -> None:
    processing = PROCESSINGS[name]
    eos = _model(str(tiny_models.target)).config.eos_token_id
    expected = hf_greedy(str(tiny_models.target), prompt, processing, [eos])
    request = make_request(prompt, k=k, max_new=MAX_NEW)
    request.sampling.CopyFrom(_sampling(processing))
    reply = stub.Generate(request, timeout=120)
    assert list(reply.token_ids) == expected
    assert list(reply.token_ids) != hf_greedy(str(tiny_models.target), prompt, Processing(), [eos]), "no effect"


@pytest.mark.parametrize("k", [1, 4])
def test_min_tokens_and_logit_bias_greedy_equal_hf_generate(
    stub: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels, k: int
) -> None:
    """A stop token the plain reply produces at once is banned until min_tokens; a -100 bias
    bans another token outright; min_p changes nothing under greedy decoding."""
    prompt, target = PROMPTS[0], str(tiny_models.target)
    eos = _model(target).config.eos_token_id
    plain = hf_greedy(target, prompt, Processing(), [eos])
    stop, avoided = plain[0], plain[2]
    processing = Processing(
        logit_bias=((avoided, -100.0),), reply_start=len(prompt), min_tokens=5, banned_until_min=(eos, stop)
    )
    expected = hf_greedy(target, prompt, processing, [eos, stop])
    request = make_request(prompt, k=k, max_new=MAX_NEW)
    request.sampling.CopyFrom(_sampling(processing, stop_token_ids=[stop], min_p=0.5))
    reply = stub.Generate(request, timeout=120)
    assert list(reply.token_ids) == expected
    assert len(reply.token_ids) >= 5 and avoided not in reply.token_ids and stop not in reply.token_ids[:4]
    if reply.finish_reason == coordinator_pb2.FINISH_REASON_STOP:
        assert reply.stop_token_id == reply.token_ids[-1]


CONSTRAINTS = {
    "json_schema": common_pb2.StructuredOutput(
        json_schema=json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                "required": ["ok", "n"],
            }
        )
    ),
    "json_object": common_pb2.StructuredOutput(json_object=True),
    "regex": common_pb2.StructuredOutput(regex=r"[a-c]{2,4}-[0-9]{1,3}"),
    "grammar": common_pb2.StructuredOutput(grammar='root ::= "x" [0-9]+ ("," [0-9]+)* "."'),  # GBNF
    "choice": common_pb2.StructuredOutput(choice=common_pb2.Choices(values=["yes", "no", "maybe so"])),
}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_structured_output_greedy_equals_hf_generate(
    stub: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels, name: str, k: int
) -> None:
    """Each kind of constraint: the reply is token-identical to HF ``generate`` masked by a fresh
    matcher at every step (tests/spec_oracle.py), differs from the unconstrained reply, and
    where it ended by itself its text is in the constraint's language."""
    target, prompt = str(tiny_models.target), PROMPTS[1]
    eos = _model(target).config.eos_token_id
    constraint = CONSTRAINTS[name]
    grammar = grammar_of(constraint)
    reference = reference_grammar(grammar, target, _model(target).config.vocab_size, [eos], len(prompt))
    expected = hf_greedy(target, prompt, Processing(), [eos], reference)
    request = make_request(prompt, k=k, max_new=MAX_NEW)
    request.sampling.structured_output.CopyFrom(constraint)
    reply = stub.Generate(request, timeout=120)
    assert list(reply.token_ids) == expected
    assert list(reply.token_ids) != hf_greedy(target, prompt, Processing(), [eos]), "no effect"
    if reply.finish_reason == coordinator_pb2.FINISH_REASON_STOP:
        assert reply.stop_token_id == eos
        if name == "choice":
            assert reply.text in constraint.choice.values
        elif name == "regex":
            assert re.fullmatch(constraint.regex, reply.text)
        elif name.startswith("json"):
            assert isinstance(json.loads(reply.text), dict)


def test_structured_output_mistakes_are_invalid_argument(cluster_same: LocalCluster) -> None:
    """A malformed constraint, or one combined with what would break it, is refused before any
    worker is called, saying what is wrong."""
    cases = {
        "is not valid JSON": common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(json_schema="{")),
        "is not valid": common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(regex="a(b")),
        "is empty": common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(grammar=" ")),
        "non-empty strings": common_pb2.SamplingParams(
            structured_output=common_pb2.StructuredOutput(choice=common_pb2.Choices(values=[]))
        ),
        "holds no constraint": common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput()),
        "ignore_eos": common_pb2.SamplingParams(
            ignore_eos=True, structured_output=common_pb2.StructuredOutput(json_object=True)
        ),
        "min_tokens": common_pb2.SamplingParams(
            max_new_tokens=8, min_tokens=2, structured_output=common_pb2.StructuredOutput(json_object=True)
        ),
    }
    with grpc.insecure_channel(cluster_same.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=30)
        assert "sampling.structured_output" in info.features
        for expected, sampling in cases.items():
            ids = common_pb2.TokenIds(ids=[5, 6])
            request = coordinator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(request, timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "structured_output" in error.value.details() and expected in error.value.details()


def test_a_large_schema_does_not_stall_other_requests(cluster_same: LocalCluster) -> None:
    """A constraint is compiled and checked off the coordinator's event loop: while a schema of
    3,000 properties is (a few hundred ms), other calls are answered. The request then fails
    (its prompt and reply do not fit the context), so that only the check's time is measured."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    constraint = common_pb2.StructuredOutput(json_schema=json.dumps(schema))
    sampling = common_pb2.SamplingParams(max_new_tokens=100, structured_output=constraint)
    ids = common_pb2.TokenIds(ids=[5] * 200)  # + 100 new tokens > the 256-token context
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
    took, worst, error = loop_stall_during(cluster_same.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "context length" in (error.details() or "")
    assert took > 0.15  # long enough that a stalled event loop would show
    assert worst < took / 3, (worst, took)


def test_a_grammar_past_its_work_limits_is_the_request_s_invalid_argument(
    cluster_same: LocalCluster, tiny_models: TinyModels
) -> None:
    """A schema of 3,000 optional properties checks and compiles, but its parse outgrows
    llguidance's per-step limits once the reply is `{"p1`: the client gets INVALID_ARGUMENT with
    the reason (main: INTERNAL "the target worker failed"), and the next request is served."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.target))
    forced = {tokenizer(ch)["input_ids"][0]: 30.0 for ch in '{"p1'}  # the reply starts {"p1
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    constraint = common_pb2.StructuredOutput(json_schema=json.dumps(schema))
    sampling = common_pb2.SamplingParams(max_new_tokens=12, logit_bias=forced, structured_output=constraint)
    with grpc.insecure_channel(cluster_same.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(coordinator_pb2.GenerateRequest(prompt="hi", sampling=sampling), timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert "the structured-output constraint failed" in (error.value.details() or "")
        assert "max is 2000" in (error.value.details() or "")
        reply = stub.Generate(make_request([5, 6, 7], max_new=4), timeout=60)
        assert len(reply.token_ids) == 4


def test_a_grammar_that_cannot_go_on_is_the_request_s_invalid_argument_saying_why(cluster_same: LocalCluster) -> None:
    """A grammar no reply can begin is refused before any worker sees it; one that can begin but
    not go on (`x` is defined only through itself) fails once the reply is "a", saying so (both
    said only llguidance's "NoExtensionBias" before, the first after both workers had failed)."""
    never = common_pb2.StructuredOutput(grammar='start: start "a"')
    stuck = common_pb2.StructuredOutput(grammar='start: "a" x\nx: x "b"')
    with grpc.insecure_channel(cluster_same.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for constraint, message in ((never, "matches no string"), (stuck, "allows no token after the reply so far")):
            sampling = common_pb2.SamplingParams(max_new_tokens=8, structured_output=constraint)
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(coordinator_pb2.GenerateRequest(prompt="hi", sampling=sampling), timeout=60)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
            assert message in (error.value.details() or ""), error.value.details()
            assert "fix the constraint" in (error.value.details() or "")
        reply = stub.Generate(make_request([5, 6, 7], max_new=4), timeout=60)
        assert len(reply.token_ids) == 4


def test_a_draft_s_first_constrained_request_does_not_time_it_out(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A worker built llguidance's tokenizer on its first constrained request (1.4 s for Qwen2.5's
    151,936 ids on the CI host, holding Python's GIL throughout): the draft's proposal waited for
    it, so the coordinator gave up on the draft (a draft_unavailable warning, and speculation off
    for every session for --draft-retry-s; found by a random run through the gateway with the
    default 2 s timeout on a loaded host; here the timeout is 1 s). It is now built when the
    worker loads, and a draft does not wait long for a grammar still compiling. The reply is that
    of target-only decoding with the mask, and the draft's masked proposals are accepted."""
    tokenizer = real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory)
    target = build_model(tmp_path / "target", seed=3, hidden=32, layers=2, vocab=len(tokenizer), tokenizer=tokenizer)
    cluster = LocalCluster(
        str(target),
        str(target),  # a draft identical to the target: every masked proposal is accepted
        tmp_path / "run",
        worker_args=CLUSTER_WORKER_ARGS,
        coordinator_args=[*CLUSTER_COORDINATOR_ARGS, "--draft-timeout-s", "1", "--no-adaptive-k"],
        startup_timeout_s=180,
    )
    constraint = common_pb2.StructuredOutput(json_object=True)
    prompt = PROMPTS[1]
    with cluster, grpc.insecure_channel(cluster.address) as channel:
        request = make_request(prompt, k=4, max_new=MAX_NEW)
        request.sampling.structured_output.CopyFrom(constraint)
        client = coordinator_pb2_grpc.GenerationStub(channel)
        reply = client.Generate(request, timeout=120)
        # without adaptive K no controller sets the block stop from the costs: GetInfo says so
        from_costs = client.GetInfo(coordinator_pb2.GetInfoRequest()).draft_block_confidence_from_costs
        failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
        log = cluster.processes["coordinator"].log_tail(1_000_000)
    assert failures == 0 and "draft_unavailable" not in log, log
    assert not from_costs
    stats = reply.stats
    assert stats.target_only_rounds == 0, stats
    assert stats.draft_tokens_accepted > 0, stats  # masked proposals once the draft's grammar was ready
    model = _model(str(target))
    eos = model.config.eos_token_id
    mask = reference_grammar(grammar_of(constraint), str(target), model.config.vocab_size, [eos], len(prompt))
    assert list(reply.token_ids) == hf_greedy(str(target), prompt, Processing(), [eos], mask)


def _forward_logprobs(model_dir: str, sequence: list[int]) -> torch.Tensor:
    """log-softmax of one plain forward pass over ``sequence``: row j scores token j + 1."""
    with torch.inference_mode():
        logits = _model(model_dir)(torch.tensor([sequence])).logits[0].float()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_logprobs_equal_a_plain_forward_pass(
    stub: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels, temperature: float, k: int
) -> None:
    """Every generated token (accepted drafts and the target's own alike) and every prompt token:
    the log-probability and the top alternatives of a forward pass over the final sequence, within
    1e-4; the stream carries one entry per token of each message."""
    prompt = PROMPTS[1]
    request = make_request(prompt, k=k, max_new=MAX_NEW, ignore_eos=True)
    request.sampling.temperature = temperature
    request.sampling.seed = 11
    request.sampling.logprobs, request.sampling.top_logprobs, request.sampling.prompt_logprobs = True, 3, 2
    reply = stub.Generate(request, timeout=120)
    tokens = list(reply.token_ids)
    assert reply.stats.draft_tokens_accepted > 0  # drafted tokens are among those scored
    logp = _forward_logprobs(str(tiny_models.target), [*prompt, *tokens])
    assert [e.token_id for e in reply.logprobs] == tokens
    for i, entry in enumerate(reply.logprobs):
        row = logp[len(prompt) + i - 1]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t.token_id for t in entry.top] == torch.topk(row, 3).indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=1e-4)
    assert [e.token_id for e in reply.prompt_logprobs] == prompt
    assert not reply.prompt_logprobs[0].HasField("logprob") and not reply.prompt_logprobs[0].top
    for j, entry in enumerate(reply.prompt_logprobs[1:], 1):
        assert entry.logprob == pytest.approx(float(logp[j - 1, prompt[j]]), abs=1e-4)
        assert len(entry.top) == 2
    chunks = list(stub.GenerateStream(request, timeout=120))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [e.token_id for c in chunks for e in c.logprobs] == tokens
    assert [e.token_id for e in chunks[0].prompt_logprobs] == prompt and not any(c.prompt_logprobs for c in chunks[1:])


def test_prompt_logprobs_of_a_continued_session_score_the_new_prompt(
    stub: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels, request: pytest.FixtureRequest
) -> None:
    session = f"lp-{request.node.callspec.id}"
    first = stub.Generate(make_request(PROMPTS[0], max_new=6, session_id=session, ignore_eos=True), timeout=120)
    follow = make_request([7, 8, 9], max_new=4, session_id=session, ignore_eos=True)
    follow.sampling.prompt_logprobs = 0
    reply = stub.Generate(follow, timeout=120)
    history = [*PROMPTS[0], *first.token_ids]
    logp = _forward_logprobs(str(tiny_models.target), [*history, 7, 8, 9])
    assert [e.token_id for e in reply.prompt_logprobs] == [7, 8, 9]
    for j, entry in enumerate(reply.prompt_logprobs):
        position = len(history) + j
        assert entry.logprob == pytest.approx(float(logp[position - 1, [7, 8, 9][j]]), abs=1e-4)


# Chat: tiny random models carrying real tokenizers and chat templates.


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "smollm2-135m"])
def chat_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[tuple[LocalCluster, str]]:
    """Target + draft (two random models with the real tokenizer) + coordinator on Redis."""
    tokenizer = real_tokenizer(request.param, tmp_path_factory)
    root = tmp_path_factory.mktemp(f"chat-{request.param}")
    target = build_model(root / "target", seed=3, hidden=32, layers=2, vocab=len(tokenizer), tokenizer=tokenizer)
    draft = build_model(root / "draft", seed=4, hidden=32, layers=1, vocab=len(tokenizer), tokenizer=tokenizer)
    cluster = LocalCluster(
        str(target),
        str(draft),
        root / "run",
        worker_args=CLUSTER_WORKER_ARGS,
        coordinator_args=[*CLUSTER_COORDINATOR_ARGS, "--state-url", redis_server.url],
        startup_timeout_s=180,
    )
    with cluster:
        yield cluster, str(target)


def _chat(messages: list[tuple[str, str]], session: str = "", **sampling: object) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        session_id=session,
        messages=[coordinator_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        sampling=common_pb2.SamplingParams(**{"max_new_tokens": 8, **sampling}),  # type: ignore[arg-type]
        speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=3, fixed=True),
    )


def test_a_chat_session_holds_the_tokens_of_the_whole_conversation_rendered_at_once(
    chat_cluster: tuple[LocalCluster, str], redis_server: RedisServer
) -> None:
    """Three turns, each sending only its new messages: after every turn the session's tokens are
    the template's rendering of the whole conversation (the replies as assistant messages) plus
    the reply; the reply is HF greedy on that rendering; turns 2-3 reuse the cache."""
    cluster, target = chat_cluster
    tokenizer = AutoTokenizer.from_pretrained(target)
    session = f"chat-{Path(target).parent.name}"
    turns = [[("system", "You answer briefly."), ("user", "Name a prime number.")], [("user", "And another?")],
             [("user", "Thanks! Größer? 🙂")]]  # fmt: skip
    previous_prompt = 0
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for number, new in enumerate(turns):
            before = read_session(redis_server.url, session) if number else None
            reply = stub.Generate(_chat(new, session), timeout=120)
            record = read_session(redis_server.url, session)
            conversation = json.loads(record.chat)
            prompt = list(tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=True))
            if isinstance(prompt, dict) or not isinstance(prompt[0], int):
                prompt = list(tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True)["input_ids"])
            assert record.tokens == [*prompt, *reply.token_ids]
            assert conversation[-1] == {"role": "assistant", "content": reply.text}
            assert [m["content"] for m in conversation[-1 - len(new) : -1]] == [c for _, c in new]
            config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id)
            ids = torch.tensor([prompt])
            out = _model(target).generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            expected = out[0, len(prompt) :].tolist()
            assert list(reply.token_ids) == expected
            if before is not None:  # the earlier prompts are kept (the replies too where they re-render alike)
                kept = len(prompt) - reply.usage.prompt_tokens
                assert record.tokens[:kept] == before.tokens[:kept] and kept >= previous_prompt
                assert reply.usage.cached_tokens > 0
            previous_prompt = len(prompt)


def test_chat_mistakes_are_invalid_argument(chat_cluster: tuple[LocalCluster, str], cluster_same: LocalCluster) -> None:
    cluster, target = chat_cluster
    name = Path(target).parent.name
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request([5, 6, 7], max_new=2, session_id=f"plain-then-chat-{name}"), timeout=60)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(_chat([("user", "hi")], f"plain-then-chat-{name}"), timeout=60)
        assert (
            error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "started with a prompt" in error.value.details()
        )
        stub.Generate(_chat([("user", "hi")], f"chat-then-plain-{name}"), timeout=60)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(make_request([5, 6], max_new=2, session_id=f"chat-then-plain-{name}"), timeout=60)
        assert (
            error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "continue it with `messages`" in error.value.details()
        )
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10)
        assert info.chat_template and "messages" in info.features
    with grpc.insecure_channel(cluster_same.address) as channel:  # the byte tokenizer has no template
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(_chat([("user", "hi")]), timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in error.value.details()
        assert not stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10).chat_template


def test_a_huge_chat_message_does_not_stall_other_requests(chat_cluster: tuple[LocalCluster, str]) -> None:
    """The chat template is rendered and tokenized off the coordinator's event loop: while a
    1,000,000-character message is, other calls are answered (before, they all waited for it)."""
    cluster, _ = chat_cluster
    took, worst, error = loop_stall_during(cluster.address, _chat([("user", HUGE_TEXT[4:])]))  # + the role
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "context length" in (error.details() or "")
    assert took > 0.5  # long enough that a stalled event loop would show
    assert worst < took / 4, (worst, took)


def test_a_cancelled_chat_turn_restores_the_tokens_and_the_conversation(
    chat_cluster: tuple[LocalCluster, str], redis_server: RedisServer
) -> None:
    """A turn whose re-rendering replaced the committed tail, cancelled mid-stream: the session is
    back to its tokens and conversation before the turn, and the next turn works."""
    cluster, target = chat_cluster
    session = f"chat-cancel-{Path(target).parent.name}"
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(_chat([("user", "Hello there")], session), timeout=120)
        before = read_session(redis_server.url, session)
        stream = stub.GenerateStream(_chat([("user", "More?")], session, max_new_tokens=64, ignore_eos=True))
        next(stream)
        stream.cancel()
        wait_for(lambda: read_session(redis_server.url, session).owner == "", 10, 0.05)
        after = read_session(redis_server.url, session)
        assert (after.tokens, after.chat) == (before.tokens, before.chat)
        reply = stub.Generate(_chat([("user", "More?")], session), timeout=120)
        assert len(json.loads(read_session(redis_server.url, session).chat)) == len(json.loads(before.chat)) + 2
        assert reply.finish_reason != coordinator_pb2.FINISH_REASON_UNSPECIFIED
