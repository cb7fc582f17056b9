"""OpenAI-compatible clients through a real gateway: the official ``openai`` SDK -> the Shepherd
Model Gateway (``smg``, a separate process) -> the coordinator's ``vllm.grpc.engine.VllmEngine``
service -> draft and target workers (tiny random models with the real Qwen2.5 tokenizer and chat
template). A second set of checks calls the engine service with a client compiled from
``smg-grpc-proto`` for what the gateway does not exercise."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import redis
from hypothesis import event, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coordinator.engine_api import _derived_seed
from coordinator.turn import render_chat
from specdec.runtime.tokenizer import tokenizer_fingerprint
from specdec.tools.launch import LocalCluster, worker_info
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import wait_for
from tests.conftest import CLUSTER_WORKER_ARGS
from tests.fuzz import (
    CHOICES,
    MIN_P,
    PENALTY,
    REPETITION_PENALTY,
    STOP_STRINGS,
    TEMPERATURE,
    TOP_P,
    biases,
    fill_any,
    known_by_length,
    sent_at_once,
    set_some,
    shares_a_session,
    stop_ids,
    streamed,
    within_limits,
)
from tests.helpers import RedisServer, free_ports, real_tokenizer
from tests.reference import greedy_continuation, reference_greedy
from tests.tiny_models import build_model, build_sliding

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@dataclass
class Gateway:
    cluster: LocalCluster
    client: openai.OpenAI
    model: str
    tokenizer: PreTrainedTokenizerBase
    log: Path


def _wait_for_models(client: openai.OpenAI, gateway: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert gateway.poll() is None, log.read_text()[-3000:]
        try:
            models = client.models.list().data
            if models:  # listed; serving once its tokenizer is registered too
                client.completions.create(model=models[0].id, prompt="hi", max_tokens=1)
                return models[0].id
        except openai.APIError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the gateway never served a model:\n{log.read_text()[-3000:]}")


NO_SPEC = ["--num-speculative-tokens", "0"]
COORDINATOR_ARGS = ["--served-model-name", "tiny-qwen", "--no-adaptive-k"]
FUZZ_EXAMPLES = 300  # requests-at-once examples of each end-to-end fuzz test here (alone: engine 43 s, chat 51 s)


@contextlib.contextmanager
def launch(
    root: Path,
    tokenizer: PreTrainedTokenizerBase,
    with_draft: bool,
    tokenizer_on_gateway_host: bool = True,
    windowed: bool = False,
    state_url: str = "memory://",
) -> Iterator[Gateway]:
    """Target (+ draft) + coordinator, and an ``smg`` gateway process in front of them. Without a
    tokenizer on the gateway's host (the files deleted once the services have loaded, no
    --model-path), the gateway must fetch it from the coordinator (GetTokenizer). ``windowed``:
    Mistral models whose attention is windowed (16 positions), served with --max-draft-tokens 4
    (their windowed layers keep 25 positions). ``state_url``: where the coordinator keeps its
    sessions."""
    if windowed:
        target = build_sliding(root / "target", "mistral", seed=3, tokenizer=tokenizer)
        draft = build_sliding(root / "draft", "mistral", seed=4, tokenizer=tokenizer)
    else:
        target = build_model(root / "target", seed=3, hidden=32, layers=2, vocab=len(tokenizer), tokenizer=tokenizer)
        draft = build_model(root / "draft", seed=4, hidden=32, layers=1, vocab=len(tokenizer), tokenizer=tokenizer)
    cluster = LocalCluster(
        str(target),
        str(draft) if with_draft else None,
        root / "run",
        worker_args=[*CLUSTER_WORKER_ARGS, *(["--max-draft-tokens", "4"] if windowed else [])],
        # without a draft worker: no speculation at all (not even lookup drafts), so the target
        # computes exactly the uncached prompt and one token per round
        coordinator_args=[*COORDINATOR_ARGS, "--state-url", state_url, *([] if with_draft else NO_SPEC)],
        startup_timeout_s=180,
    )
    with cluster:
        (port, metrics_port), log = free_ports(2), root / "gateway.log"
        command = [
            str(Path(sys.executable).with_name("smg")), "launch", "--backend", "vllm", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", f"grpc://{cluster.address}",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        ]  # fmt: skip
        if tokenizer_on_gateway_host:
            command += ["--model-path", str(target)]
        else:
            for path in [*target.glob("tokenizer*"), *target.glob("*.jinja"), *target.glob("special_tokens*")]:
                path.unlink()
        with log.open("wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
            model = _wait_for_models(client, process, log)
            if not tokenizer_on_gateway_host:
                assert "Fetching tokenizer from worker" in log.read_text()
            yield Gateway(cluster, client, model, tokenizer, log)
        finally:
            process.terminate()
            process.wait(timeout=30)


def _qwen_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory)


GATEWAY_STATE_DB = 2  # the Redis database of the gateway fixture's sessions (the other clusters' are apart)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Gateway]:
    """The gateway in front of a speculating service (target + draft), its sessions in a real
    redis-server."""
    root, state_url = tmp_path_factory.mktemp("gateway"), redis_server.database(GATEWAY_STATE_DB)
    with launch(root, _qwen_tokenizer(tmp_path_factory), with_draft=True, state_url=state_url) as gw:
        yield gw


def native(gw: Gateway, ids: list[int], **sampling: object) -> coordinator_pb2.GenerateResponse:
    """The native API's reply for the same tokens."""
    with grpc.insecure_channel(gw.cluster.address) as channel:
        request = coordinator_pb2.GenerateRequest(
            prompt_token_ids=common_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
        )
        return coordinator_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)


def chat_ids(gw: Gateway) -> list[int]:
    rendered = gw.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_the_gateway_serves_the_model_under_its_served_name(gateway: Gateway) -> None:
    assert gateway.model == "tiny-qwen"


def test_greedy_chat_equals_the_native_reply_for_the_same_tokens(gateway: Gateway) -> None:
    reply = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    expected = native(gateway, chat_ids(gateway), max_new_tokens=12, logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.message.content == expected.text and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(chat_ids(gateway))
    assert choice.logprobs is not None and choice.logprobs.content is not None
    got = [entry.logprob for entry in choice.logprobs.content]
    assert got == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_streaming_chat_and_completions_add_up_to_the_native_text(gateway: Gateway) -> None:
    stream = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == native(gateway, chat_ids(gateway), max_new_tokens=12).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    prompt = "def fibonacci(n):"
    ids = gateway.tokenizer(prompt)["input_ids"]
    completion = gateway.client.completions.create(model=gateway.model, prompt=prompt, max_tokens=10, temperature=0)
    assert completion.choices[0].text == native(gateway, ids, max_new_tokens=10).text
    streamed = gateway.client.completions.create(
        model=gateway.model, prompt=prompt, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text


def test_stop_strings_end_the_reply_at_the_engine(gateway: Gateway) -> None:
    """The engine stops at the stop string itself (not after max_tokens), as the native API does."""
    plain = native(gateway, chat_ids(gateway), max_new_tokens=40, ignore_eos=True).text
    stop = plain[len(plain) // 2 : len(plain) // 2 + 2]
    assert stop.strip(), plain
    reply = gateway.client.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=40, temperature=0, stop=[stop],  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = native(gateway, chat_ids(gateway), max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == expected.text
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected.token_ids) < 40


def test_a_request_without_max_tokens_runs_to_the_end_of_the_context(gateway: Gateway) -> None:
    """No max_tokens, a prompt leaving less room than the server's default: the reply fills the
    context (main answered 400, 'prompt + max_new_tokens exceeds the context length')."""
    prompt = " ".join(["word"] * 150)
    ids = gateway.tokenizer(prompt)["input_ids"]
    context = 256
    assert context - len(ids) < 255  # less room than the default max_new_tokens
    reply = gateway.client.completions.create(
        model=gateway.model, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.total_tokens == context
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text == native(gateway, ids, max_new_tokens=context - len(ids), ignore_eos=True).text


def test_seed_reproduces_and_n_gives_distinct_samples(gateway: Gateway) -> None:
    def sample(n: int) -> list[str]:
        reply = gateway.client.chat.completions.create(
            model=gateway.model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=1.0,
            seed=1234,
            n=n,  # type: ignore[arg-type]
        )
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.message.content or "" for c in reply.choices]

    first, again, pair = sample(1), sample(1), sample(2)
    assert first == again  # fixed K (--adaptive-k false): one seed, one completion
    assert pair[0] == first[0] and pair[0] != pair[1]  # index 0 keeps the seed; index 1 derives its own
    expected = native(gateway, chat_ids(gateway), max_new_tokens=8, temperature=1.0, seed=1234)
    assert first[0] == expected.text


# compact JSON (llguidance's x-guidance option): a random model left free to add whitespace adds
# it until max_tokens
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.mark.parametrize("text", ["\uf900", "A\u030a"])
def test_a_choice_of_text_the_tokenizer_normalizes_is_the_reply(gateway: Gateway, text: str) -> None:
    """A choice whose text is not in the NFC form Qwen2.5's tokenizer normalizes to (a CJK
    compatibility ideograph, a letter and a combining ring) is the reply, byte for byte, sampled
    or not; before, the first step allowed only the normalized text's first token, the next one
    found the reply off the constraint and the request failed INTERNAL (found by the chat fuzz
    test)."""
    for temperature in (0.0, 1.0):
        sampling = common_pb2.SamplingParams(max_new_tokens=8, temperature=temperature, seed=1)
        sampling.structured_output.choice.values.append(text)
        request = coordinator_pb2.GenerateRequest(prompt="Answer:", sampling=sampling)
        with grpc.insecure_channel(gateway.cluster.address) as channel:
            reply = coordinator_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        assert reply.text == text
        assert gateway.tokenizer.decode(list(reply.token_ids), skip_special_tokens=True) == text


def test_structured_outputs_through_the_gateway(gateway: Gateway) -> None:
    """response_format json_schema and json_object on chat completions and an SGLang-style
    ``ebnf`` on completions reach the engine, which constrains the reply: greedy, each equals the native
    API's reply for the same tokens and constraint, and follows it."""
    reply = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
    )
    content = reply.choices[0].message.content or ""
    assert reply.choices[0].finish_reason == "stop" and json.loads(content)["answer"] in ("yes", "no")
    constraint = common_pb2.StructuredOutput(json_schema=json.dumps(ANSWER_SCHEMA))
    assert content == native(gateway, chat_ids(gateway), max_new_tokens=16, structured_output=constraint).text
    reply = gateway.client.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "json_object"}
    )
    content = reply.choices[0].message.content or ""
    assert content.startswith("{")  # a JSON object so far (tiny random models seldom close one in 8 tokens)
    assert not native(gateway, chat_ids(gateway), max_new_tokens=8).text.startswith("{")  # the constraint did it
    constraint = common_pb2.StructuredOutput(json_object=True)
    assert content == native(gateway, chat_ids(gateway), max_new_tokens=8, structured_output=constraint).text
    grammar = 'root ::= "id-" [0-9] [0-9]'
    completion = gateway.client.completions.create(
        model=gateway.model, prompt="hello", max_tokens=8, temperature=0, extra_body={"ebnf": grammar}
    )
    text = completion.choices[0].text
    assert re.fullmatch(r"id-[0-9][0-9]", text) and completion.choices[0].finish_reason == "stop"
    ids = gateway.tokenizer("hello")["input_ids"]
    assert text == native(gateway, ids, max_new_tokens=8, structured_output={"grammar": grammar}).text


def _cached_sessions(gw: Gateway) -> tuple[int, int]:
    return (
        worker_info(gw.cluster.processes["target-0"].address, "target").active_sessions,
        worker_info(gw.cluster.processes["draft"].address, "draft").active_sessions,
    )


def _freed_within_a_second(gw: Gateway, kept: tuple[int, int], since: str) -> None:
    """Waits until the workers hold ``kept`` caches (target, draft) again, at most 1 s; a failure
    names the counts seen and when (each poll asks both workers)."""
    began, seen = time.monotonic(), []
    while (held := _cached_sessions(gw)) != kept:
        seen.append((round(time.monotonic() - began, 3), held))
        assert time.monotonic() - began < 1.0, f"caches not freed within 1 s of {since}: kept {kept}, seen {seen}"
        time.sleep(0.02)


def test_a_client_disconnect_frees_the_caches_within_a_second(gateway: Gateway) -> None:
    kept = _cached_sessions(gateway)  # finished requests' caches, kept for prefix reuse
    stream = gateway.client.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=200, temperature=0, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert _cached_sessions(gateway) != kept  # this request's caches
    stream.close()
    _freed_within_a_second(gateway, kept, "the disconnect")


def test_a_full_state_store_is_a_429_at_the_gateway(gateway: Gateway, redis_server: RedisServer) -> None:
    """Redis at its maxmemory: the engine refuses the request RESOURCE_EXHAUSTED (the state store is
    full, see State), which smg 1.13.0 answers as HTTP 429 (rate_limit_error, the message passed on),
    and as an error event in a stream; once Redis has room the same request is served."""
    client = gateway.client.with_options(max_retries=0)
    ask = functools.partial(
        client.chat.completions.create, model=gateway.model, messages=MESSAGES, max_tokens=4, temperature=0
    )
    admin = redis.Redis.from_url(redis_server.url)
    try:
        admin.config_set("maxmemory", 1)
        with pytest.raises(openai.RateLimitError) as refused:
            ask()
        assert refused.value.status_code == 429 and "state store is full" in refused.value.message
        with pytest.raises(openai.APIError, match="state store is full"):
            for _ in ask(stream=True):
                pass
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    assert ask().choices[0].message.content


@pytest.fixture
def engine_stub(gateway: Gateway) -> Iterator[vllm_grpc.VllmEngineStub]:
    with grpc.insecure_channel(gateway.cluster.address) as channel:
        yield vllm_grpc.VllmEngineStub(channel)


def test_engine_info_rpcs(engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway) -> None:
    assert engine_stub.HealthCheck(vllm_pb2.HealthCheckRequest(), timeout=10).healthy
    info = engine_stub.GetModelInfo(vllm_pb2.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == "tiny-qwen" and info.is_generation
    assert info.vocab_size == len(gateway.tokenizer) and info.max_context_length == 256
    assert list(info.eos_token_ids) == [gateway.tokenizer.eos_token_id]
    server = engine_stub.GetServerInfo(vllm_pb2.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "specdec" and server.max_num_seqs > 0
    # a grammar applies from the first generated token (there is no reasoning parser to wait for)
    assert server.constrained_decoding_start == "first_token" and not server.engine_reasoning_parser
    loads = engine_stub.GetLoads(vllm_pb2.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == server.max_num_seqs
    chunks = list(engine_stub.GetTokenizer(smg_common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    unpacked = Path(gateway.log.parent / "unpacked-tokenizer")
    zipfile.ZipFile(io.BytesIO(data)).extractall(unpacked)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(unpacked)) == tokenizer_fingerprint(gateway.tokenizer)
    with pytest.raises(grpc.RpcError) as error:
        engine_stub.Embed(vllm_pb2.EmbedRequest(request_id="e"), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as error:
        list(engine_stub.SubscribeKvEvents(smg_common_pb2.SubscribeKvEventsRequest(), timeout=10))
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _engine_request(ids: list[int], request_id: str, **params: object) -> vllm_pb2.GenerateRequest:
    return vllm_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_pb2.TokenizedInput(input_ids=ids),
        sampling_params=vllm_pb2.SamplingParams(**params),  # type: ignore[arg-type]
    )


def test_a_reply_s_id_finds_its_request_s_log_lines(engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway) -> None:
    """The coordinator logs an engine request's lines with the gateway's request id, which is the
    `id` of the OpenAI reply (smg sends no x-request-id), and sends that id back in the call's
    initial metadata; a caller's x-request-id comes first, and a body id that is no valid header
    value gets one made up, for both."""
    reply = gateway.client.chat.completions.create(
        model=gateway.model,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,  # type: ignore[arg-type]
    )
    ids = chat_ids(gateway)
    header = engine_stub.Generate(
        _engine_request(ids, "in-the-body", temperature=0.0, max_tokens=3),
        timeout=60,
        metadata=(("x-request-id", "in-the-header"),),
    )
    body = engine_stub.Generate(_engine_request(ids, "body-only", temperature=0.0, max_tokens=3), timeout=60)
    odd = engine_stub.Generate(_engine_request(ids, "not a header value", temperature=0.0, max_tokens=3), timeout=60)
    sent_back = []
    for call in (header, body, odd):
        assert list(call)[-1].HasField("complete")
        sent_back.append(dict(call.initial_metadata())["x-request-id"])
    assert sent_back[:2] == ["in-the-header", "body-only"] and re.fullmatch("[0-9a-f]{32}", sent_back[2])
    log = gateway.cluster.processes["coordinator"]

    def ended() -> list[str]:
        events = (json.loads(line) for line in log.log_tail(3000).splitlines() if line.startswith("{"))
        return [e.get("request_id", "") for e in events if e["event"] == "turn_ended"]

    wait_for(lambda: sent_back[2] in ended(), 10)
    assert reply.id.startswith("chatcmpl-") and ended().count(reply.id) == 1
    assert [ended().count(sent) for sent in sent_back] == [1, 1, 1]
    assert "in-the-body" not in ended() and "not a header value" not in ended()


def test_engine_generate_n_and_prompt_logprobs(engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway) -> None:
    """Non-streaming: one GenerateComplete per index with all tokens; temperature 0 -> greedy."""
    ids = chat_ids(gateway)
    request = _engine_request(ids, "n2", temperature=0.0, max_tokens=6, n=2, prompt_logprobs=1, logprobs=0)
    replies = list(engine_stub.Generate(request, timeout=60))
    completes = sorted((r.complete for r in replies), key=lambda c: c.index)
    expected = native(gateway, ids, max_new_tokens=6, prompt_logprobs=1)
    assert [c.index for c in completes] == [0, 1] and all(not r.HasField("chunk") for r in replies)
    for complete in completes:
        assert list(complete.output_ids) == list(expected.token_ids) and complete.finish_reason == "length"
        assert len(complete.output_logprobs.token_logprobs) == 6
        assert list(complete.input_logprobs.token_ids) == ids
        assert not complete.input_logprobs.token_logprobs[0].HasField("value")
        values = [v.value for v in complete.input_logprobs.token_logprobs[1:]]
        assert values == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]], abs=1e-5)


def test_engine_n_completions_compute_the_prompt_once(engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway) -> None:
    """n = 4 over a 200-token prompt: the target computes the prompt once (the other completions
    start from completion 0's caches once its first round is done), and every completion is still
    the target's own: greedy ones equal the native reply, sampled ones the native request with
    that completion's seed."""
    ids = [1000 + (i * 37) % 5000 for i in range(200)]
    target = gateway.cluster.processes["target-0"].address
    before = worker_info(target, "target").prefill_tokens_total
    greedy = list(engine_stub.Generate(_engine_request(ids, "n4", temperature=0.0, max_tokens=6, n=4), timeout=60))
    computed = worker_info(target, "target").prefill_tokens_total - before
    expected = list(native(gateway, ids, max_new_tokens=6).token_ids)
    assert [list(r.complete.output_ids) for r in greedy] == [expected] * 4
    assert computed < 2 * len(ids), f"the target computed {computed} tokens for 4 completions of {len(ids)}"
    ids = [i + 1 for i in ids]  # a prompt none of the above cached
    sampled = list(engine_stub.Generate(_engine_request(ids, "n3", max_tokens=6, n=3, seed=7), timeout=60))
    for reply in sampled:
        seed = _derived_seed(7, reply.complete.index)
        alone = native(gateway, ids, max_new_tokens=6, temperature=1.0, seed=seed)
        assert list(reply.complete.output_ids) == list(alone.token_ids), reply.complete.index


def test_engine_abort_cancels_a_running_request(engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway) -> None:
    kept = _cached_sessions(gateway)
    request = _engine_request(chat_ids(gateway), "to-abort", max_tokens=200, ignore_eos=True)
    request.stream = True
    stream = engine_stub.Generate(request, timeout=60)
    first = next(stream)
    assert first.HasField("chunk")
    engine_stub.Abort(vllm_pb2.AbortRequest(request_ids=["to-abort"]), timeout=10)
    rest = list(stream)
    tokens = sum(len(r.chunk.token_ids) for r in [first, *rest] if r.HasField("chunk"))
    # a request that ended before the Abort came would end "length" with all 200 tokens
    outcome = f"the stream ended {rest[-1].complete.finish_reason!r} after {tokens} tokens in {len(rest) + 1} messages"
    assert rest[-1].complete.finish_reason == "abort" and tokens < 200, outcome
    _freed_within_a_second(gateway, kept, "the abort")


def test_engine_constraints_map_to_the_native_ones(engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway) -> None:
    """The engine protocol's choice (smg drops vLLM's `guided_choice`) and json_object, sent straight to the
    engine, constrain the reply as the native API's do."""
    ids = chat_ids(gateway)
    choice = vllm_pb2.ChoiceConstraint(choices=["yes", "no", "maybe so"])
    for params, native_constraint in (
        ({"choice": choice}, {"choice": {"values": list(choice.choices)}}),
        ({"json_object": True}, {"json_object": True}),
    ):
        request = _engine_request(ids, "constrained", temperature=0.0, max_tokens=12, **params)
        complete = list(engine_stub.Generate(request, timeout=60))[-1].complete
        expected = native(gateway, ids, max_new_tokens=12, structured_output=native_constraint)
        assert list(complete.output_ids) == list(expected.token_ids)
        if "choice" in params:
            assert complete.finish_reason == "stop" and expected.text in choice.choices


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"structural_tag": "{}"}, "structured output (structural_tag) is not supported"),
        ({"regex": "a(b"}, "regex is not valid"),
        ({"json_schema": "[1]"}, "json_schema must be a JSON object"),
        ({"json_object": True, "ignore_eos": True}, "cannot be combined with ignore_eos"),
        ({"logprobs": -1}, "logprobs = -1 (all) is not supported"),
        ({"n": 17}, "n must be in [1, 16]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be in"),
        ({"max_tokens": 100_000}, "max_tokens must be in [1, 255], got 100000"),
        ({"max_tokens": 255}, "prompt (3) + max_tokens (255) = 258 tokens exceeds the context length 256"),
        ({"max_tokens": 5, "min_tokens": 6}, "min_tokens (6) must not exceed max_tokens (5)"),
        ({"logprobs": 25}, "logprobs must be in [0, 20], got 25"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"logit_bias": {1_000_000: 1.0}}, "logit_bias contains token id 1000000"),
    ],
)
def test_engine_rejects_what_it_cannot_honour(
    engine_stub: vllm_grpc.VllmEngineStub, params: dict[str, object], message: str
) -> None:
    """With the reason, in the engine protocol's (and the OpenAI API's) field names."""
    with pytest.raises(grpc.RpcError) as error:
        list(engine_stub.Generate(_engine_request([1, 2, 3], "bad", **params), timeout=30))
    details = error.value.details() or ""
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in details
    assert "sampling." not in details and "max_new_tokens" not in details and "top_logprobs" not in details


def test_engine_skip_special_tokens_false_keeps_their_text_for_stop_strings(
    engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway
) -> None:
    """The engine protocol's skip_special_tokens, as vLLM's engine takes it: false (also left out,
    proto3's default) keeps special tokens' text in what stop strings are matched against, true
    leaves it out. smg sends true for chat completions and for completions unless the client asks
    for false (probed). A logit bias makes every token Qwen's `<|fim_middle|>`; before, the field
    was ignored and the false request ran on to max_tokens."""
    special = gateway.tokenizer.convert_tokens_to_ids("<|fim_middle|>")
    stop = ["<|fim_middle|><|fim_middle|>"]

    def reply(skip: bool) -> vllm_pb2.GenerateComplete:
        request = _engine_request(
            chat_ids(gateway), f"skip-{skip}", temperature=0.0, max_tokens=6, stop=stop, skip_special_tokens=skip,
            logit_bias={special: 100.0}, ignore_eos=True,
        )  # fmt: skip
        return list(engine_stub.Generate(request, timeout=60))[-1].complete

    kept, skipped = reply(False), reply(True)
    assert list(kept.output_ids) == [special] * 2 and kept.finish_reason == "stop"
    assert list(skipped.output_ids) == [special] * 6 and skipped.finish_reason == "length"


@pytest.mark.parametrize("top_k", [2**31, 2**32 - 1])
def test_engine_top_k_past_any_vocabulary_filters_nothing(engine_stub: vllm_grpc.VllmEngineStub, top_k: int) -> None:
    """The engine protocol's top_k is unsigned and the native one a signed 32-bit field: a top_k
    of 2^31 or more (more than any vocabulary holds, so no filter; 2^32 - 1 is vLLM's -1, "off",
    sent unsigned) failed the request INTERNAL, a ValueError building the native request (found
    by a random run against the engine API). It samples as top_k 0 does: the same seeded tokens."""

    def tokens(k: int) -> list[int]:
        request = _engine_request([1, 2, 3], f"top-k-{k}", temperature=1.0, seed=7, max_tokens=8, top_k=k)
        return list(list(engine_stub.Generate(request, timeout=60))[-1].complete.output_ids)

    assert tokens(top_k) == tokens(0)


def test_engine_text_input_is_tokenized_within_the_prompt_limit(
    engine_stub: vllm_grpc.VllmEngineStub, gateway: Gateway
) -> None:
    """`text` input gives the reply of its tokens; text over the prompt character limit is refused before
    it is tokenized (main tokenized it, seconds on the event loop, then refused it as too long)."""
    prompt = "def fibonacci(n):"
    params = vllm_pb2.SamplingParams(temperature=0.0, max_tokens=6)
    reply = list(engine_stub.Generate(vllm_pb2.GenerateRequest(request_id="t", text=prompt, sampling_params=params)))
    ids = gateway.tokenizer(prompt)["input_ids"]
    assert list(reply[-1].complete.output_ids) == list(native(gateway, ids, max_new_tokens=6).token_ids)
    huge = vllm_pb2.GenerateRequest(request_id="huge", text="a" * 1_000_001, sampling_params=params)
    with pytest.raises(grpc.RpcError) as error:
        list(engine_stub.Generate(huge, timeout=30))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the limit is 1000000" in error.value.details()


def test_a_five_turn_chat_reuses_the_cached_conversation(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The gateway resends the whole conversation each turn; prefix reuse finds the previous
    turn's cache, so turns 2-5 report cached tokens (at least the previous prompt, in whole
    blocks of 16) and the target computes only the rest: the uncached prompt tail and one token per
    later round (a service without speculation, so no drafts are computed). This gateway has no tokenizer
    files: it fetched the tokenizer and chat template from the coordinator (GetTokenizer)."""
    root = tmp_path_factory.mktemp("gateway-target-only")
    tokenizer = _qwen_tokenizer(tmp_path_factory)
    with launch(root, tokenizer, with_draft=False, tokenizer_on_gateway_host=False) as gw:
        target = gw.cluster.processes["target-0"].address
        conversation: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
        previous_prompt = 0
        for turn in range(5):
            conversation.append({"role": "user", "content": f"Question number {turn + 1}?"})
            before = worker_info(target, "target").prefill_tokens_total
            reply = gw.client.chat.completions.create(
                model=gw.model,
                messages=conversation,
                max_tokens=6,
                temperature=0,  # type: ignore[arg-type]
            )
            computed = worker_info(target, "target").prefill_tokens_total - before
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            assert computed == usage.prompt_tokens - cached + usage.completion_tokens - 1
            if turn:
                assert cached >= previous_prompt // 16 * 16 > 0, (turn, cached, previous_prompt)
            else:
                assert cached == 0
            previous_prompt = usage.prompt_tokens
            conversation.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def test_a_regenerated_reply_on_a_windowed_model_finds_its_prompt_cached(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A model whose attention is windowed (Mistral, 16 positions, its windowed layers keeping 25
    with --max-draft-tokens 4) through the gateway: the same messages sent again after a 60-token
    reply (a regenerated reply) find their prompt cached in whole blocks, 16 of its 21 tokens, from
    the copy of the windowed layers at the prompt's end (the cache's end is 60 tokens further, past
    the margin), and give the same reply; before, every regenerated reply computed its prompt
    again (cached 0). The next turn, with that reply cut to its first half (an edited reply), finds
    a prefix that ends in the reply, past the margin and the copy: it starts from the copy, all 21
    prompt tokens cached (0 before), and its reply is HF's greedy one for its rendered tokens."""
    tokenizer = _qwen_tokenizer(tmp_path_factory)
    root = tmp_path_factory.mktemp("gateway-windowed")
    with launch(root, tokenizer, with_draft=True, windowed=True) as gw:
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say a lot."}]
        replies = [
            gw.client.chat.completions.create(model=gw.model, messages=messages, max_tokens=60, temperature=0)  # type: ignore[arg-type]
            for _ in range(3)
        ]
        text = replies[0].choices[0].message.content or ""
        half = {"role": "assistant", "content": text[: len(text) // 2]}
        edited = [*messages, half, {"role": "user", "content": "Go on."}]
        turn = gw.client.chat.completions.create(model=gw.model, messages=edited, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    first, *again = replies
    assert first.usage is not None and first.usage.completion_tokens == 60
    assert first.usage.prompt_tokens == 21
    for reply in again:
        assert reply.choices[0].message.content == first.choices[0].message.content
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens == 16
    rendered = tokenizer.apply_chat_template(edited, add_generation_prompt=True, tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    expected = reference_greedy(str(root / "target"), tuple(ids), 8)
    assert turn.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert turn.usage is not None and turn.usage.prompt_tokens == len(ids) and turn.usage.prompt_tokens_details
    assert turn.usage.prompt_tokens_details.cached_tokens == 21


def test_what_the_gateway_does_before_the_engine(gateway: Gateway) -> None:
    """smg's own behaviour the README describes (so a gateway upgrade that changes it shows here):
    SGLang-style constraints reach the engine (a malformed one gets its 400); vLLM's
    `guided_choice` is dropped by the gateway (an unconstrained reply); `/v1/completions` answers
    no logprobs although the engine computed them, chat completions carry them; `n` above 10 and
    values outside the OpenAI API's ranges are its own 400s (the engine takes `n` up to 16)."""
    constrained = gateway.client.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=3, extra_body={"regex": "(yes|no)"}
    )
    assert constrained.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as error:
        gateway.client.chat.completions.create(
            model=gateway.model, messages=MESSAGES, max_tokens=3, extra_body={"regex": "(yes|no"}
        )
    assert "regex is not valid" in str(error.value)
    unconstrained = gateway.client.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=3, temperature=0, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert unconstrained.choices[0].message.content not in ("yes", "no")
    completion = gateway.client.completions.create(
        model=gateway.model, prompt="hello", max_tokens=2, temperature=0, logprobs=2
    )
    assert completion.choices[0].logprobs is None
    chat = gateway.client.chat.completions.create(
        model=gateway.model, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True, top_logprobs=2
    )
    assert chat.choices[0].logprobs is not None and len(chat.choices[0].logprobs.content) == 2
    for refused in (
        {"n": 11}, {"stop": list("abcde")}, {"top_logprobs": 21, "logprobs": True}, {"temperature": 3.0},
        {"frequency_penalty": 3.0},
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as error:
            gateway.client.chat.completions.create(model=gateway.model, messages=MESSAGES, max_tokens=2, **refused)
        assert next(iter(refused)) in str(error.value) and "Single stream failed" not in str(error.value), refused


def test_fields_the_gateway_drops_before_the_engine(gateway: Gateway) -> None:
    """smg 1.13.0 does not pass `logit_bias`, `include_stop_str_in_output` or, on chat completions,
    `min_tokens` and SGLang's top-level `json_schema` to a vLLM engine (nor `prompt_logprobs`,
    which no OpenAI reply carries): the reply is what the request without them gives, where the
    native API with them gives another. The README says so (it said `json_schema` reached the
    engine on both endpoints); a gateway that starts passing them fails this test."""
    client, model, ids = gateway.client, gateway.model, chat_ids(gateway)
    plain = native(gateway, ids, max_new_tokens=8, ignore_eos=True)
    first = plain.token_ids[0]

    def chat(**extra: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            **extra,  # type: ignore[arg-type]
        )

    banned = native(gateway, ids, max_new_tokens=8, ignore_eos=True, logit_bias={first: -100.0})
    assert banned.token_ids[0] != first  # the engine honours a bias it receives
    bias = {str(first): -100}
    for reply in (
        chat(logit_bias=bias, extra_body={"ignore_eos": True}),
        chat(extra_body={"ignore_eos": True, "logit_bias": bias}),
    ):
        assert reply.choices[0].message.content == plain.text

    held = native(gateway, ids, max_new_tokens=8, stop_token_ids=[first], min_tokens=3)
    assert len(held.token_ids) > 1  # the engine holds the stop token back for min_tokens
    reply = chat(extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert not reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 1  # min_tokens never arrived: stopped at once

    stop = plain.text[len(plain.text) // 2 :][:2]
    assert stop.strip(), plain.text
    kept = native(gateway, ids, max_new_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text.endswith(stop)
    reply = chat(stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == kept.text[: -len(stop)]

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    constraint = common_pb2.StructuredOutput(json_schema=schema)
    free = chat().choices[0].message.content
    constrained = native(gateway, ids, max_new_tokens=8, structured_output=constraint)
    assert constrained.text.lstrip().startswith("{") and constrained.text != free  # the engine honours it
    assert chat(extra_body={"json_schema": schema}).choices[0].message.content == free
    completion = client.completions.create(
        model=model, prompt="hi", max_tokens=8, temperature=0, extra_body={"json_schema": schema}
    )
    assert completion.choices[0].text.lstrip().startswith("{")  # passed on by /v1/completions


def _engine_params_within_limits(draw: st.DrawFn, p: vllm_pb2.SamplingParams, vocab: int) -> None:
    """Each of the engine's sampling parameters, in about two requests of five, at a value the
    service takes, edges included (vLLM's top_k -1 as the unsigned field carries it, min_p 1,
    penalties and biases at their largest, n up to 3, truncation to the last tokens; a choice
    without ignore_eos or min_tokens)."""
    fields: dict[str, Callable[[], object]] = {
        "temperature": lambda: setattr(p, "temperature", draw(TEMPERATURE)),
        "top_p": lambda: setattr(p, "top_p", draw(TOP_P)),
        "top_k": lambda: setattr(p, "top_k", draw(st.sampled_from([0, 1, 2**32 - 1]) | st.integers(0, 300))),
        "min_p": lambda: setattr(p, "min_p", draw(MIN_P)),
        "frequency_penalty": lambda: setattr(p, "frequency_penalty", draw(PENALTY)),
        "presence_penalty": lambda: setattr(p, "presence_penalty", draw(PENALTY)),
        "repetition_penalty": lambda: setattr(p, "repetition_penalty", draw(REPETITION_PENALTY)),
        "min_tokens": lambda: setattr(p, "min_tokens", draw(st.integers(0, p.max_tokens))),
        "stop": lambda: p.stop.extend(draw(STOP_STRINGS)),
        "stop_token_ids": lambda: p.stop_token_ids.extend(draw(stop_ids(vocab))),
        "skip_special_tokens": lambda: setattr(p, "skip_special_tokens", draw(st.booleans())),
        "spaces_between_special_tokens": lambda: setattr(p, "spaces_between_special_tokens", draw(st.booleans())),
        "ignore_eos": lambda: setattr(p, "ignore_eos", True),
        "n": lambda: setattr(p, "n", draw(st.integers(1, 3))),
        "logprobs": lambda: setattr(p, "logprobs", draw(st.integers(0, 20))),
        "prompt_logprobs": lambda: setattr(p, "prompt_logprobs", draw(st.integers(0, 20))),
        "seed": lambda: setattr(p, "seed", draw(st.integers(-(2**31), 2**31 - 1))),
        "include_stop_str_in_output": lambda: setattr(p, "include_stop_str_in_output", True),
        "logit_bias": lambda: p.logit_bias.update(draw(biases(vocab))),
        "truncate_prompt_tokens": lambda: setattr(p, "truncate_prompt_tokens", draw(st.sampled_from([-1, 1, 2, 8]))),
        "choice": lambda: p.choice.choices.extend(draw(CHOICES)),
    }
    set_some(draw, fields)
    if p.HasField("choice"):  # it decides where the reply ends: the service refuses these with it
        p.ignore_eos, p.min_tokens = False, 0


def _any_engine_request(draw: st.DrawFn, vocab: int) -> vllm_pb2.GenerateRequest:
    """Token ids or text, then either the sampling parameters within the limits or up to 4
    fields each of the request and its sampling parameters at any value of their type (NaN and
    infinite floats, the largest integers, multimodal and KV-transfer fields); at most 8 tokens."""
    request = vllm_pb2.GenerateRequest(request_id=f"fuzz-{draw(st.integers(0, 2**63))}")
    if draw(st.booleans()):
        request.tokenized.input_ids.extend(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8)))
    else:
        request.text = draw(st.text(min_size=1, max_size=40))
    request.sampling_params.max_tokens = draw(st.integers(1, 8))  # a few tokens keep the run short
    if draw(st.booleans()):
        fill_any(draw, request, keep=frozenset({"request_id", "tokenized", "text", "sampling_params"}))
        fill_any(draw, request.sampling_params, keep=frozenset({"max_tokens"}))
    else:
        _engine_params_within_limits(draw, request.sampling_params, vocab)
    return request


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.data())
def test_any_engine_requests_through_the_running_service_are_served_or_refused_as_the_caller_s_error(
    gateway: Gateway, redis_server: RedisServer, data: st.DataObject
) -> None:
    """What any gateway could send to the engine API (``_any_engine_request``), one to three
    requests at once, through the running coordinator, draft and target (a real tokenizer with a
    chat template), one in five streamed and cancelled after its first reply (as a gateway whose
    client went away): each is served or refused with a client error that says what was wrong; no
    process exits, the draft's failures never grow, and no request leaves a session in Redis.
    (A cancelled request streams: a request with ``stream`` false has one reply, at its end, so its
    cancel would come only then: up to 40 rounds of a draft and target whose distributions are
    nearly flat over 151,936 ids, 55 s for one such request on the quiet host, past the deadline
    on a busy one.)"""
    vocab = len(gateway.tokenizer)
    requests = [_any_engine_request(data.draw, vocab) for _ in range(data.draw(st.integers(1, 3)))]
    cancels = [data.draw(st.integers(0, 4)) == 0 for _ in requests]  # one in five cancelled mid-stream
    for request, cancel in zip(requests, cancels, strict=True):
        if cancel:  # long enough to be cancelled before its end, mostly
            request.sampling_params.max_tokens = data.draw(st.integers(8, 40))
            request.stream = True
    with grpc.insecure_channel(gateway.cluster.address) as channel:
        stub = vllm_grpc.VllmEngineStub(channel)
        calls = streamed(stub.Generate, requests, cancels)
        state = redis_server.database(GATEWAY_STATE_DB)
        for outcome in sent_at_once(gateway.cluster, calls, requests, False, False, state, cancels):
            event(outcome)


_CHAT_TEXT = st.text(max_size=20) | st.sampled_from(["", "<|im_start|>", "<|im_end|>\n", "{{ x }}", "{% if %}", "\x00"])


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.data())
def test_any_chat_messages_through_the_running_service_are_served_or_refused_as_the_client_s_error(
    gateway: Gateway, redis_server: RedisServer, data: st.DataObject
) -> None:
    """Chat requests of any messages (any role, text that looks like the template's own markers
    or Jinja) rendered by a real chat template (Qwen2.5's), one to three at once, as new chats or
    turns of two shared sessions, with any sampling and speculation features within their
    limits, streamed, one in five cancelled by the client after its first round: each is served
    or refused with a client error; no process exits, the draft's failures never grow, a session
    is in Redis as its turns left it (one that only refused or cancelled turns named keeps its
    conversation and tokens as they were, unless a cancelled turn had finished) and free, and its
    next turn gives target-only greedy decoding's tokens after its stored conversation rendered
    with the next message (``sent_at_once``)."""
    vocab = len(gateway.tokenizer)
    requests, cancels = [], []
    for _ in range(data.draw(st.integers(1, 3))):
        request = coordinator_pb2.GenerateRequest(session_id=data.draw(st.sampled_from(["", "chat-1", "chat-2"])))
        roles = st.sampled_from(["system", "user", "assistant", "tool"]) | st.text(min_size=1, max_size=8)
        for role in data.draw(st.lists(roles, min_size=1, max_size=4)):
            request.messages.add(role=role, content=data.draw(_CHAT_TEXT))
        request.sampling.max_new_tokens = data.draw(st.integers(1, 8))
        within_limits(data.draw, request, vocab)
        cancels.append(data.draw(st.integers(0, 4)) == 0)  # one in five cancelled mid-stream
        if cancels[-1]:
            known_by_length(data.draw, request)
        requests.append(request)
    with grpc.insecure_channel(gateway.cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        calls = streamed(stub.GenerateStream, requests, cancels)
        state = redis_server.database(GATEWAY_STATE_DB)
        greedy = functools.partial(greedy_continuation, gateway.cluster.target_model)
        render = functools.partial(render_chat, gateway.tokenizer)
        outcomes = sent_at_once(
            gateway.cluster, calls, requests, shares_a_session(requests), True, state, cancels, greedy, render
        )
        for outcome in outcomes:
            event(outcome)
