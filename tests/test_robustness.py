"""No request can hurt the service: extreme but type-valid values, one session's trouble, worker survival.

Every test runs the real processes (coordinator, draft and target workers) on loopback.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from specdec.tools.launch import LocalCluster, worker_info
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import fault_cluster, metric, wait_for
from tests.fuzz import (
    SMALLEST_FLOAT32,
    cancelled_after_its_first_round,
    fill_any,
    known_by_length,
    sent_at_once,
    shares_a_session,
    within_limits,
)
from tests.helpers import RedisServer
from tests.netproxy import ProxyRoutes
from tests.reference import greedy_continuation, make_request, reference_greedy
from tests.spec_oracle import PASS_P, Enumerator, chi_square_pvalue, rejects
from tests.test_combinations import FIRST, SAMPLES, SampledMix, sample_mix, sampled_request
from tests.tiny_models import (
    TinyModels,
    build_dearer_target,
    build_gemma3_with_vision,
    build_model,
    build_plain_forward,
    build_resized,
    build_sliding,
    build_tokenizer,
)

PROMPT = [5, 17, 99, 3]
FUZZ_EXAMPLES = 800  # requests-at-once examples of the end-to-end fuzz test (54-60 s by itself on the CI host)
U32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38
EVERY_ID = list(range(len(build_tokenizer())))  # the tiny models' whole vocabulary


def _sampled(**sampling: object) -> coordinator_pb2.GenerateRequest:
    return make_request(PROMPT, k=4, max_new=8, **sampling)


def _confident(value: float, field: str = "draft_confidence", **sampling: object) -> coordinator_pb2.GenerateRequest:
    request = make_request(PROMPT, k=8, max_new=8, fixed=False, **sampling)
    setattr(request.speculation, field, value)
    return request


EXTREME = [
    ("temperature 1e-40", _sampled(temperature=1e-40, seed=1)),
    ("temperature 1e-30, top_k 1", _sampled(temperature=1e-30, top_k=1, seed=1)),
    ("temperature 1e-6", _sampled(temperature=1e-6, seed=1)),
    ("temperature 1e-5", _sampled(temperature=1e-5, seed=1)),
    ("temperature 1e-4", _sampled(temperature=1e-4, seed=1)),
    ("temperature float32 max", _sampled(temperature=FLOAT32_MAX, seed=1)),
    ("top_p smallest float", _sampled(temperature=1.0, top_p=SMALLEST_FLOAT32, seed=2)),
    ("top_p just below 1", _sampled(temperature=1.0, top_p=0.99999994, seed=2)),
    ("top_k 2^31-1", _sampled(temperature=0.7, top_k=2**31 - 1, seed=3)),
    ("seed 2^64-1", _sampled(temperature=1.0, seed=2**64 - 1)),
    ("seed 0", _sampled(temperature=1.0, seed=0)),
    ("100k stop ids", _sampled(temperature=1.0, seed=4, stop_token_ids=[i % 250 + 3 for i in range(100_000)])),
    ("tiny temperature, tiny top_p", _sampled(temperature=1e-3, top_p=SMALLEST_FLOAT32, seed=5)),
    ("max_new_tokens 2^32-1", make_request(PROMPT, max_new=U32_MAX)),
    ("K 2^32-1", make_request(PROMPT, k=U32_MAX)),
    ("token id 2^32-1", make_request([U32_MAX])),
    ("stop id 2^32-1", _sampled(stop_token_ids=[U32_MAX])),
    ("every id a stop id, min_tokens 3", make_request(PROMPT, max_new=6, stop_token_ids=EVERY_ID, min_tokens=3)),
    (
        "every id a stop id, min_tokens 3, sampled",
        _sampled(temperature=1.0, seed=7, stop_token_ids=EVERY_ID, min_tokens=3),
    ),
    ("session id with a newline", make_request(PROMPT, session_id="chat\n")),
    ("session id of 129 characters", make_request(PROMPT, session_id="a" * 129)),
    ("draft confidence NaN", _confident(float("nan"))),
    ("draft confidence 1", _confident(1.0)),
    ("draft confidence float32 max", _confident(FLOAT32_MAX)),
    ("draft confidence just below 1, sampled", _confident(0.99999994, temperature=1.0, seed=6)),
    ("draft confidence smallest float", _confident(SMALLEST_FLOAT32, temperature=1.0, seed=6)),
    ("draft block confidence NaN", _confident(float("nan"), "draft_block_confidence")),
    ("draft block confidence 1", _confident(1.0, "draft_block_confidence")),
    (
        "draft block confidence just below 1, sampled",
        _confident(0.99999994, "draft_block_confidence", temperature=1.0, seed=6),
    ),
    (
        "draft block confidence smallest float",
        _confident(SMALLEST_FLOAT32, "draft_block_confidence", temperature=1.0, seed=6),
    ),
]


def _pids(cluster: LocalCluster) -> dict[str, int]:
    return {name: p.proc.pid for name, p in cluster.processes.items() if p.proc.poll() is None}


ROBUST_STATE_DB = 1  # the Redis database of the robust cluster's sessions (the other clusters' are apart)


@pytest.fixture(scope="module")
def robust_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels, redis_server: RedisServer
) -> Iterator[LocalCluster]:
    """A pipelined cluster with a sometimes-right draft (both workers sample on every request),
    its sessions in a real redis-server."""
    workdir = Path(tmp_path_factory.mktemp("robust"))
    with fault_cluster(
        workdir,
        tiny_models.target,
        tiny_models.noisy,
        state_url=redis_server.database(ROBUST_STATE_DB),
        coordinator_args=["--speculation-mode", "pipelined"],
    ) as cluster:
        yield cluster


def test_extreme_sampling_values_never_end_a_worker(robust_cluster: LocalCluster, tiny_models: TinyModels) -> None:
    """Every extreme but type-valid value gets OK or INVALID_ARGUMENT; no process exits; a normal
    request afterwards gives the same tokens as before."""
    before = _pids(robust_cluster)
    assert set(before) == {"target-0", "draft", "coordinator"}
    normal = make_request(PROMPT, k=4, max_new=16, ignore_eos=True)
    with grpc.insecure_channel(robust_cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        first = list(stub.Generate(normal, timeout=30).token_ids)
        outcomes = {}
        for name, request in EXTREME:
            try:
                stub.Generate(request, timeout=30)
                outcomes[name] = "OK"
            except grpc.RpcError as exc:
                outcomes[name] = exc.code().name
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, exc.code(), exc.details())
                assert "Traceback" not in (exc.details() or "")
            assert _pids(robust_cluster) == before, f"a process exited after {name!r}"
            assert metric(robust_cluster, "coordinator", "specdec_draft_failures_total") == 0, name
        after = list(stub.Generate(normal, timeout=30).token_ids)
    assert first == after == reference_greedy(str(tiny_models.target), tuple(PROMPT), 16, ignore_eos=True)
    assert outcomes["temperature 1e-40"] == "OK" and outcomes["seed 2^64-1"] == "OK"
    assert outcomes["session id with a newline"] == "INVALID_ARGUMENT"
    # min_tokens would ban every token: nothing could be sampled, so the request is refused
    assert outcomes["every id a stop id, min_tokens 3"] == "INVALID_ARGUMENT"
    assert outcomes["every id a stop id, min_tokens 3, sampled"] == "INVALID_ARGUMENT"
    assert outcomes["draft confidence NaN"] == outcomes["draft confidence 1"] == "INVALID_ARGUMENT"
    assert outcomes["draft confidence just below 1, sampled"] == "OK"
    assert outcomes["draft block confidence NaN"] == outcomes["draft block confidence 1"] == "INVALID_ARGUMENT"
    assert outcomes["draft block confidence just below 1, sampled"] == "OK"


def test_tiny_temperatures_decode_greedily(robust_cluster: LocalCluster, tiny_models: TinyModels) -> None:
    """Below the documented epsilon (1e-5) a temperature means greedy: the target's greedy tokens."""
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 12, ignore_eos=True)
    with grpc.insecure_channel(robust_cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for temperature in (1e-40, 1e-20, 9.9e-6):
            reply = stub.Generate(make_request(PROMPT, max_new=12, temperature=temperature, ignore_eos=True))
            assert list(reply.token_ids) == expected, temperature


def test_close_session_validates_the_id(robust_cluster: LocalCluster) -> None:
    with grpc.insecure_channel(robust_cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for bad in ("chat\n", "a" * 129, "with space", "x/y"):
            with pytest.raises(grpc.RpcError) as err:
                stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "session_id must be" in err.value.details()
        assert not stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="never-used")).existed


def _ordinary_turns(stub: coordinator_pb2_grpc.GenerationStub, expected: list[int], count: int) -> list[object]:
    """An ordinary session's turns (a draft equal to the target, fixed K = 4, 40 tokens = 8 full
    rounds): every round must be speculative and every draft accepted."""
    stats = []
    for _ in range(count):
        reply = stub.Generate(make_request(PROMPT, k=4, max_new=40, ignore_eos=True), timeout=60)
        assert list(reply.token_ids) == expected
        stats.append(reply.stats)
    return stats


def test_one_sessions_trouble_does_not_switch_speculation_off_for_others(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Pipelined; a session at the context limit (its lookahead has no room) and 2x --max-sessions
    sessions churning through the draft's cache (lookaheads find their cache evicted), while an
    ordinary session keeps every draft accepted and never decodes target-only."""
    from concurrent.futures import ThreadPoolExecutor

    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 40, ignore_eos=True)
    args = ["--speculation-mode", "pipelined", "--draft-retry-s", "30"]
    with (
        fault_cluster(
            tmp_path, tiny_models.target, tiny_models.same, coordinator_args=args, draft_args=["--max-sessions", "4"]
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        edge_prompt = [7 + i % 200 for i in range(249)]  # 249 + 7 = the 256-token context

        def at_the_limit(_: int) -> None:
            reply = stub.Generate(make_request(edge_prompt, k=4, max_new=7, ignore_eos=True), timeout=60)
            assert list(reply.token_ids) == reference_greedy(
                str(tiny_models.target), tuple(edge_prompt), 7, ignore_eos=True
            )

        def churn(i: int) -> None:
            prompt = [(i * 37 + j) % 250 + 3 for j in range(6)]
            stub.Generate(make_request(prompt, k=3, max_new=30, session_id=f"churn-{i}", ignore_eos=True), timeout=60)

        with ThreadPoolExecutor(max_workers=10) as pool:
            background = [pool.submit(at_the_limit, i) for i in range(3)]
            background += [pool.submit(churn, i) for i in range(8)]
            during = _ordinary_turns(stub, expected, 3)
            for job in background:
                job.result()
        after = _ordinary_turns(stub, expected, 1)
        failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
    for stats in [*during, *after]:
        assert stats.target_only_rounds == 0 and stats.acceptance_rate == 1.0
        assert stats.rounds == 8
    assert failures == 0
    fault_report["session at the context limit + 2x --max-sessions churning (pipelined)"] = {
        "ordinary_session_target_only_rounds": 0,
        "ordinary_session_acceptance": 1.0,
        "draft_breaker_trips": 0,
    }


def test_a_draft_refusing_one_request_does_not_trip_the_breaker(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """The draft is restarted with --max-draft-tokens 2 after the coordinator learned 8 from it,
    so it refuses blocks over 2 (INVALID_ARGUMENT): a request asking for K = 4 decodes target-only
    (same tokens), and the next request with K = 2 speculates at once."""
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 12, ignore_eos=True)
    with (
        fault_cluster(tmp_path, tiny_models.target, tiny_models.same) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        draft = cluster.processes["draft"]
        draft.args = [*draft.args, "--max-draft-tokens", "2"]
        draft.restart()
        small = make_request(PROMPT, k=2, max_new=12, ignore_eos=True)
        wait_for(lambda: stub.Generate(small, timeout=30).stats.target_only_rounds == 0, 15, 0.2)  # reconnected
        failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
        request_errors = metric(cluster, "coordinator", "specdec_draft_request_errors_total")
        refused = stub.Generate(make_request(PROMPT, k=4, max_new=12, ignore_eos=True), timeout=30)
        accepted = stub.Generate(small, timeout=30)
        failures = metric(cluster, "coordinator", "specdec_draft_failures_total") - failures
        request_errors = metric(cluster, "coordinator", "specdec_draft_request_errors_total") - request_errors
    assert list(refused.token_ids) == list(accepted.token_ids) == expected
    assert refused.stats.target_only_rounds == refused.stats.rounds
    assert accepted.stats.target_only_rounds == 0 and accepted.stats.acceptance_rate == 1.0
    assert failures == 0 and request_errors == 1
    fault_report["draft refuses one request (INVALID_ARGUMENT)"] = {
        "that_turn": "target-only, identical output",
        "next_request_speculative": True,
        "draft_breaker_trips": 0,
    }


def test_the_callers_deadline_during_verification_does_not_fail_over(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """Slow links to two target replicas and a caller whose deadline runs out mid-verification:
    DEADLINE_EXCEEDED for that caller; no replica is marked down, no session moves."""
    with (
        fault_cluster(tmp_path, tiny_models.target, None, targets=2, route=routes(0.15)) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(PROMPT, max_new=2), timeout=30)
        codes = set()
        for timeout in (0.25, 0.4, 0.55, 0.7, 0.85):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(make_request(PROMPT, max_new=100, ignore_eos=True), timeout=timeout)
            codes.add(err.value.code().name)
        time.sleep(0.5)
        failovers = metric(cluster, "coordinator", "specdec_target_failovers_total")
    assert codes == {"DEADLINE_EXCEEDED"}
    assert failovers == 0
    fault_report["caller's deadline expires during verification (2 replicas)"] = {
        "client_code": "DEADLINE_EXCEEDED",
        "replicas_marked_down": 0,
    }


@pytest.mark.parametrize("direction", ["draft pads more rows", "target pads more rows"])
def test_same_tokenizer_different_padded_vocabularies(tmp_path: Path, tiny_models: TinyModels, direction: str) -> None:
    """Qwen2.5-0.5B (151,936 logit rows) drafting for Qwen2.5-7B (152,064) in miniature: the pair
    is accepted, greedy output equals the target's, sampling is served (sparse and dense proposals),
    and a draft whose padded rows it would like to propose never proposes them."""
    if direction == "draft pads more rows":
        target = tiny_models.target
        draft = build_resized(tiny_models.target, tmp_path / "draft-300", 300, extra_scale=4.0)
    else:
        target = build_resized(tiny_models.target, tmp_path / "target-300", 300)
        draft = tiny_models.noisy
    prompt = [5, 17, 99, 3]
    expected = reference_greedy(str(target), tuple(prompt), 24, ignore_eos=True)
    for top_n in ("64", "0"):  # sparse, then dense proposals
        with (
            fault_cluster(tmp_path / f"run-{top_n}", target, draft, draft_args=["--proposal-top-n", top_n]) as cluster,
            grpc.insecure_channel(cluster.address) as channel,
        ):
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            greedy = stub.Generate(make_request(prompt, k=4, max_new=24, ignore_eos=True), timeout=60)
            sampled = [
                stub.Generate(make_request(prompt, k=4, max_new=24, temperature=1.0, seed=s), timeout=60)
                for s in range(5)
            ]
            failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
            errors = metric(cluster, "coordinator", "specdec_draft_request_errors_total")
        assert list(greedy.token_ids) == expected
        assert greedy.stats.draft_tokens_proposed > 0
        if direction == "draft pads more rows":
            assert greedy.stats.draft_tokens_accepted > 0  # the draft is the target under its padding
        assert all(reply.stats.draft_tokens_proposed > 0 for reply in sampled)
        # A padded id the target itself generates cannot be fed to a smaller draft: that turn
        # goes on target-only (a request error, never a breaker trip); ids below 259 never do.
        # A padded id that ends the reply is never sent to the draft.
        padded_ids_generated = sum(max(reply.token_ids[:-1], default=0) >= 259 for reply in sampled)
        assert failures == 0 and errors == padded_ids_generated


def test_a_model_whose_forward_takes_no_logits_to_keep_is_served(tmp_path: Path, tiny_models: TinyModels) -> None:
    """Model code shipped with a model (--trust-remote-code) whose forward pass predates
    ``logits_to_keep`` serves as target and draft: greedy replies, three at once (batched), equal the
    same weights' HF greedy, and prompt log-probabilities those of a full pass (before: both
    workers failed start-up on "unexpected keyword argument 'logits_to_keep'")."""
    target = build_plain_forward(tiny_models.target, tmp_path / "target")
    draft = build_plain_forward(tiny_models.noisy, tmp_path / "draft")
    prompts = [[5, 17, 99, 3], list(range(20, 40)), [9] * 7]
    with (
        fault_cluster(tmp_path / "run", target, draft, worker_args=["--trust-remote-code"]) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        replies = list(pool.map(lambda p: stub.Generate(make_request(p, max_new=24, ignore_eos=True)), prompts))
        scored = stub.Generate(make_request(prompts[1], max_new=1, prompt_logprobs=0), timeout=60)
    for prompt, reply in zip(prompts, replies, strict=True):
        assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), 24, ignore_eos=True)
        assert reply.stats.draft_tokens_accepted > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_models.target)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompts[1]])).logits[0].float(), -1)
    expected = [float(logprobs[i - 1, t]) for i, t in enumerate(prompts[1]) if i]
    assert [entry.logprob for entry in scored.prompt_logprobs[1:]] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "phi3", "llama4", "gemma4", "gemma3-with-vision"])
def test_sliding_window_models_are_served_past_their_window(tmp_path: Path, arch: str) -> None:
    """A model whose attention is windowed (16 positions here) is served up to its whole context
    (256): the workers' windowed layers keep the window and a rollback margin before it (10
    positions with --max-draft-tokens 4), and a copy of them at the prompt's end; the attention
    mask applies the window, and drafts rejected past the window are cut back like any others.
    Replies sent at once, the same prompt again (a regenerated reply: its cached prefix 16 tokens
    of the 20, 44 behind its cache's end, found at the copy by both workers), a multi-turn session
    and a prompt that repeats a reply's first tokens (its cached prefix of 32 tokens, 28 behind
    their cache's end and after the copy: each worker asks to start from the copy instead, the
    prompt's 20 tokens and the drafts the first round took; on 30fa666 a resync from 0), all past
    the window and with rollbacks, equal HF's target-only greedy (whose cache keeps the window); a
    request past the context gets INVALID_ARGUMENT. Gemma-4's last layers
    read earlier layers' keys and values: before, the replies' batched pass ended its target
    worker. A Gemma-3 checkpoint that also takes images is served as its text decoder."""
    if arch == "gemma3-with-vision":
        target = build_gemma3_with_vision(tmp_path / "target", seed=0)
        draft = build_gemma3_with_vision(tmp_path / "draft", seed=1)
    else:
        target = build_sliding(tmp_path / "target", arch, seed=0)
        draft = build_sliding(tmp_path / "draft", arch, seed=1)  # unrelated: most drafts are rejected
    prompts = [[5, 17, 99, 3], list(range(20, 40)), [9] * 7]
    with (
        fault_cluster(tmp_path / "run", target, draft, worker_args=["--max-draft-tokens", "4"]) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        assert worker_info(cluster.processes["target-0"].address, "target").max_context_len == 256
        replies = list(
            pool.map(lambda p: stub.Generate(make_request(p, k=4, max_new=40, ignore_eos=True), timeout=120), prompts)
        )
        cached = metric(cluster, "target-0", "specdec_worker_cached_tokens")  # the three replies' caches
        draft_reused = [worker_info(cluster.processes["draft"].address, "draft").reused_tokens_total]
        regenerated = stub.Generate(make_request(prompts[1], k=4, max_new=40, ignore_eos=True), timeout=120)
        draft_reused.append(worker_info(cluster.processes["draft"].address, "draft").reused_tokens_total)
        again = [*prompts[1], *replies[1].token_ids[:14], 1]  # its first 32 tokens cached, 28 before their end
        reused = stub.Generate(make_request(again, k=4, max_new=20, ignore_eos=True), timeout=120)
        draft_reused.append(worker_info(cluster.processes["draft"].address, "draft").reused_tokens_total)
        session = [
            stub.Generate(make_request([p], k=3, max_new=16, session_id="w", ignore_eos=True)) for p in (7, 8, 9)
        ]
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(make_request(prompts[0], k=4, max_new=253), timeout=60)
        pids_alive = all(p.proc.poll() is None for p in cluster.processes.values())
    for prompt, reply in zip(prompts, replies, strict=True):
        assert list(reply.token_ids) == reference_greedy(str(target), tuple(prompt), 40, ignore_eos=True)
        assert reply.stats.draft_tokens_proposed > reply.stats.draft_tokens_accepted  # rollbacks happened
    if arch in ("mistral", "phi3"):  # every layer windowed: 25 positions of each reply's 44-60 kept,
        # and of its copy at the prompt's end, the prompt's 4, 20 and 7 and the drafts its first round took
        assert 3 * 25 + 31 <= cached <= 3 * 25 + 31 + 3 * 4
    assert list(regenerated.token_ids) == list(replies[1].token_ids) and regenerated.usage.cached_tokens == 16
    assert draft_reused[1] - draft_reused[0] == 16  # the draft's cache too
    assert list(reused.token_ids) == reference_greedy(str(target), tuple(again), 20, ignore_eos=True)
    assert 20 <= reused.usage.cached_tokens <= 24 and reused.stats.cache_resyncs >= 1  # the target asked once
    assert draft_reused[2] - draft_reused[1] >= 20  # the draft's copy, or as much of its own shorter cache
    history: list[int] = []
    for p, turn in zip((7, 8, 9), session, strict=True):
        history.append(p)
        assert list(turn.token_ids) == reference_greedy(str(target), tuple(history), 16, ignore_eos=True)
        history += list(turn.token_ids)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context length 256" in err.value.details()
    assert pids_alive


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_requests_sharing_a_prefix_on_a_windowed_model_start_from_a_copy_where_it_ends(
    tmp_path: Path, arch: str
) -> None:
    """Requests whose prompts share their first 48 tokens (a system prompt) and then differ for 40
    more, past the margin (10 with --max-draft-tokens 4), on a windowed model (every layer on
    Mistral, a mix on Gemma-3): the second finds the shared prefix in the first one's caches, too
    far behind their ends (a resync from 0), and its caches keep a copy of the windowed layers where
    the shared prefix ends; the third and fourth start there in both workers (48 tokens cached,
    0 before); every reply is HF's target-only greedy one."""
    target = build_sliding(tmp_path / "target", arch, seed=0)
    draft = build_sliding(tmp_path / "draft", arch, seed=1)
    prompts = [[*range(60, 108), *[(7 * i + 11 * j) % 200 + 3 for j in range(40)]] for i in range(4)]
    with (
        fault_cluster(tmp_path / "run", target, draft, worker_args=["--max-draft-tokens", "4"]) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        replies, reused = [], []
        for prompt in prompts:
            replies.append(stub.Generate(make_request(prompt, k=4, max_new=12, ignore_eos=True), timeout=120))
            reused.append(worker_info(cluster.processes["draft"].address, "draft").reused_tokens_total)
    for prompt, reply in zip(prompts, replies, strict=True):
        assert list(reply.token_ids) == reference_greedy(str(target), tuple(prompt), 12, ignore_eos=True)
    assert [reply.usage.cached_tokens for reply in replies] == [0, 0, 48, 48]
    assert reused == [0, 0, 48, 96]  # the draft worker's reused tokens after each request


@pytest.mark.slow
@pytest.mark.parametrize("copy", ["prompt_end", "shared_prefix"])
def test_a_windowed_model_samples_its_exact_distribution_past_its_window(tmp_path: Path, copy: str) -> None:
    """Sampled requests whose prompt is past a 16-position window, on Gemma-3's mix of windowed and
    whole layers with an unrelated draft (nearly every draft rejected: the caches are cut back past
    the window every round, their windowed layers keeping 25 positions with --max-draft-tokens 4),
    each request but the first few starting from an earlier one's cache cut back past the margin,
    from a copy of its windowed layers: a 20-token prompt, its cache cut back from its end (28
    tokens) to 16, from the copy at the prompt's end; or a 44-token prompt, its cache (48: replies
    of 4 tokens, a round each, are enough here) cut back to its first 32 tokens, before the copy at
    the prompt's end can reach (44), from the copy where that prefix ends, which the first request
    to resync on it took (told ``shared_len``) and every request copying a cache holding it shares.
    The first three tokens follow the target's exact distribution (chi-square against plain forward
    passes), and reject the distribution of the same weights without the window, which a cache or
    mask that let the window lapse would give. (The first case keeps its 8-token replies: with a
    21-token prompt and 6 new tokens, a restored copy cut back one position too far passed unseen;
    with a 24-token prompt and 4, a ninth of the requests found no copy that reached 16.)"""
    target = build_sliding(tmp_path / "target", "gemma3", seed=0)
    draft = build_sliding(tmp_path / "draft", "gemma3", seed=1)
    prompt, cut, new = (tuple(range(30, 50)), 16, 8) if copy == "prompt_end" else (tuple(range(30, 74)), 32, 4)
    mix = SampledMix(
        "",
        prompt=prompt,
        sampling={
            "max_new_tokens": new,
            "temperature": 0.1,
            "top_k": 5,
            "ignore_eos": True,
            "repetition_penalty": 1.2,
        },
        speculation={"num_speculative_tokens": 4, "fixed": True},
        bug="",
        shown=(),
    )
    with (
        fault_cluster(tmp_path / "run", target, draft, worker_args=["--max-draft-tokens", "4"]) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        sampled, sent = sample_mix(coordinator_pb2_grpc.GenerationStub(channel), mix, "windowed")
        proposed = metric(cluster, "coordinator", "specdec_proposer_tokens_proposed_total", 'proposer="model"')
        reused = worker_info(cluster.processes["target-0"].address, "target").reused_tokens_total
    assert reused > cut * SAMPLES * 0.9  # nearly every request from an earlier one's copy
    sampling = sampled_request(mix, 0).sampling
    exact, unwindowed = Enumerator(str(target), FIRST), Enumerator(str(target), FIRST)
    unwindowed.model.config.sliding_window = 1000  # its masks read it on every pass
    assert sent == mix.prompt and proposed > 2 * SAMPLES  # drafts in most rounds, nearly all rejected
    assert chi_square_pvalue(sampled.counts, exact.distribution(mix.prompt, sampling), SAMPLES) > PASS_P
    assert rejects(sampled.counts, unwindowed.distribution(mix.prompt, sampling))


def test_a_draft_with_a_shorter_context_drafts_up_to_it(tmp_path: Path, tiny_models: TinyModels) -> None:
    """The target's own weights with a 32-token context as the draft: every round before the
    draft's context is speculative (all drafts accepted), the rounds past it decode target-only,
    the output is the target's and the draft never gets a request it must refuse."""
    draft = build_model(tmp_path / "short", seed=0, hidden=64, layers=2, vocab=259, init_range=0.2, context=32)
    prompt = [7 + i for i in range(20)]
    with (
        fault_cluster(tmp_path / "run", tiny_models.target, draft) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        reply = coordinator_pb2_grpc.GenerationStub(channel).Generate(
            make_request(prompt, k=4, max_new=30, ignore_eos=True), timeout=60
        )
        errors = metric(cluster, "coordinator", "specdec_draft_request_errors_total")
        failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), 30, ignore_eos=True)
    stats = reply.stats
    assert stats.acceptance_rate == 1.0 and stats.draft_tokens_proposed > 0
    # The draft never runs past its 32 positions: the last speculative round starts at most at 32
    # committed tokens with one draft (33 - 32 = 1) and ends at most at 34; the rest is target-only.
    assert stats.target_only_rounds >= 30 - (34 - len(prompt)) and stats.rounds > stats.target_only_rounds
    assert errors == 0 and failures == 0


def test_workers_with_smaller_blocks_than_the_coordinator_s_k_still_speculate(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    """Workers started with --max-draft-tokens 4 under a coordinator whose --max-speculative-tokens
    is 8. Main did not know the workers' limit: every block over 4 was refused, so every round of
    the default request and of a `fixed` K = 8 request decoded target-only, with no error (40 of
    40 rounds). Now the workers report their limit and the coordinator's K stops there.

    The default request drafts a block of exactly the workers' 4, none longer, no block is
    refused (a refusal is a draft request error and turns the rest of the turn target-only), and
    most of its rounds speculate. The target's passes take 12 ms more, as a target costs several
    times its draft: with the target's own weights as the draft a drafted token cost about what a
    target pass did (6 ms against 5.5), a near tie that a loaded CI host tipped to target-only in
    28 of 33 rounds (tokens identical)."""
    prompt = [5, 6, 7, 8]
    expected = reference_greedy(str(tiny_models.target), tuple(prompt), 40, ignore_eos=True)
    target = build_dearer_target(tiny_models.target, tmp_path / "target")
    small_blocks = ["--max-draft-tokens", "4", "--trust-remote-code"]
    with (
        fault_cluster(tmp_path / "run", target, tiny_models.same, worker_args=small_blocks) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10)
        assert info.max_speculative_tokens == 4 and info.default_speculative_tokens <= 4
        assert info.lookup_max_tokens <= 4
        default = stub.Generate(make_request(prompt, k=0, max_new=40, fixed=False, ignore_eos=True), timeout=60)
        fixed = stub.Generate(make_request(prompt, k=4, max_new=40, ignore_eos=True), timeout=60)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(make_request(prompt, k=8, max_new=40), timeout=60)
        errors = metric(cluster, "coordinator", "specdec_draft_request_errors_total")
    assert list(default.token_ids) == expected and list(fixed.token_ids) == expected
    blocks = list(default.stats.proposed_by_position)  # rounds that drafted at least i + 1 tokens
    assert len(blocks) == 4 and blocks[3] > 0, default.stats
    assert default.stats.target_only_rounds < default.stats.rounds // 2, default.stats
    assert len(fixed.stats.proposed_by_position) == 4 and fixed.stats.target_only_rounds == 0
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "<= 4" in (error.value.details() or "")
    assert errors == 0


def _peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_prompt_logprobs_of_a_long_prompt_never_hold_all_its_logits(tmp_path: Path) -> None:
    """Qwen2.5's 151,936-id vocabulary in a tiny model: prompt log-probabilities of 2,000 prompt
    tokens are 1.1 GiB of float32 logits at once (a 32k-token prompt would be 18.5 GiB: a worker killed
    for memory, or on a GPU an out-of-memory error that ends the worker). The target scores them a
    chunk at a time: its peak memory grows by far less than the logits, the values equal a plain
    forward pass, and the reply is the target's own."""
    vocab = 151_936
    target = build_model(tmp_path / "wide", seed=0, hidden=32, layers=1, vocab=vocab, init_range=0.2, context=4096)
    prompt = [3 + (i * 37) % 256 for i in range(2000)]
    logits_mb = len(prompt) * vocab * 4 / 2**20
    with (
        fault_cluster(tmp_path / "run", target, target) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        pid = cluster.processes["target-0"].proc.pid
        warm = make_request(prompt[:50], k=4, max_new=8, ignore_eos=True, prompt_logprobs=1)
        stub.Generate(warm, timeout=60)  # the allocator's and the model's own first-use growth
        before = _peak_rss_mb(pid)
        reply = stub.Generate(make_request(prompt, k=4, max_new=8, ignore_eos=True, prompt_logprobs=1), timeout=120)
        grown = _peak_rss_mb(pid) - before
    assert grown < logits_mb / 2, f"the target's peak memory grew {grown:.0f} MiB for {logits_mb:.0f} MiB of logits"
    assert list(reply.token_ids) == reference_greedy(str(target), tuple(prompt), 8, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
        rows = hidden[:-1]  # the last prompt position scores the first reply token
        chunks = [torch.log_softmax(model.lm_head(rows[i : i + 500]), dim=-1) for i in range(0, len(rows), 500)]
    assert [e.token_id for e in reply.prompt_logprobs] == prompt
    for start, logp in zip(range(0, len(rows), 500), chunks, strict=True):  # row j - 1 scores prompt token j
        for row in range(logp.shape[0]):
            entry = reply.prompt_logprobs[start + row + 1]
            assert entry.logprob == pytest.approx(float(logp[row, prompt[start + row + 1]]), abs=1e-4)
            assert entry.top[0].token_id == int(logp[row].argmax())


LONG_PROMPT = [3 + (i * 37) % 500 for i in range(12_000)]  # about 2 s to compute on the models below


def _long_context_models(
    tmp_path: Path, target_hidden: int = 128, draft_hidden: int = 32, draft_layers: int = 1
) -> tuple[Path, Path]:
    """A 4-layer target and a draft with a 16,384-token context, whose cost attention dominates
    on long prompts (their seconds stand for a real model's minutes)."""
    target = build_model(tmp_path / "target", seed=0, hidden=target_hidden, layers=4, vocab=512, context=16384)
    draft = build_model(tmp_path / "draft", seed=1, hidden=draft_hidden, layers=draft_layers, vocab=512, context=16384)
    return target, draft


@pytest.mark.alone
def test_a_long_prompt_does_not_hold_up_the_other_sessions(tmp_path: Path) -> None:
    """A prompt's prefill runs in chunks between the other sessions' steps (chunked prefill, as
    vLLM and SGLang do): a 12,000-token prompt took one forward pass of about 2 s on this model,
    during which every other session's stream stood still (main: one gap as long as the prefill;
    with --worker-timeout-s 1 the stream's waiting call failed UNAVAILABLE). Now the stream goes
    on while the prompt is computed, and both replies are the target's own."""
    target, draft = _long_context_models(tmp_path)
    short_prompt = [9, 10, 11]
    with (
        fault_cluster(tmp_path / "run", target, draft) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(PROMPT, k=2, max_new=4, ignore_eos=True), timeout=60)  # first-use costs
        arrivals: list[float] = []
        streamed: list[int] = []
        stream = stub.GenerateStream(make_request(short_prompt, k=2, max_new=10_000, ignore_eos=True), timeout=120)
        future, began, done = None, 0.0, []
        for message in stream:
            arrivals.append(time.perf_counter())
            streamed += message.token_ids
            if len(arrivals) == 5:  # the stream is under way: the long prompt arrives
                future = stub.Generate.future(make_request(LONG_PROMPT, k=2, max_new=4, ignore_eos=True), timeout=120)
                began = time.perf_counter()
                future.add_done_callback(lambda _: done.append(time.perf_counter()))
            if done and arrivals[-1] > done[0] + 0.1:  # and it went on after the reply
                stream.cancel()
                break
        assert future is not None
        reply = future.result()
    took = done[0] - began
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b > began and a < done[0]]
    assert took > 0.5, f"the long prompt took {took:.2f} s: too little to show a stall"
    assert max(gaps) < took / 4, f"the stream stood still {max(gaps):.2f} s during the {took:.2f} s long request"
    assert streamed == reference_greedy(str(target), tuple(short_prompt), len(streamed), ignore_eos=True)
    assert list(reply.token_ids) == reference_greedy(str(target), tuple(LONG_PROMPT), 4, ignore_eos=True)


def _drafted(prompt: list[int], max_new: int = 2, session_id: str = "") -> coordinator_pb2.GenerateRequest:
    """A request whose every round is drafted by the draft model (no lookup draft)."""
    request = make_request(prompt, k=2, max_new=max_new, session_id=session_id, ignore_eos=True)
    request.speculation.method = coordinator_pb2.DRAFT_METHOD_MODEL
    return request


@pytest.mark.alone
def test_a_long_prompt_gets_the_time_its_attention_takes(tmp_path: Path) -> None:
    """A call that prefills gets, on top of --worker-timeout-s, time for its tokens; a token's
    cost grows with the tokens before it (attention), so the rate of a short prompt timed at
    start-up is far too low for a long one: here a 12,000-token prompt's tokens cost several
    times a 256-token prompt's, and the call ran out of time, tripping the target replica and
    the draft (main: UNAVAILABLE, every retry the same). The workers also time a pass over a
    longer cache at start-up, and the time a prefill gets grows with its context."""
    target, draft = _long_context_models(tmp_path, draft_hidden=128, draft_layers=4)
    with (
        fault_cluster(tmp_path / "run", target, draft, coordinator_args=["--worker-timeout-s", "1"]) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        reply = stub.Generate(_drafted(LONG_PROMPT, max_new=4), timeout=120)
        tripped = {
            "target": metric(cluster, "coordinator", "specdec_target_failovers_total"),
            "draft": metric(cluster, "coordinator", "specdec_draft_failures_total"),
        }
        infos = [worker_info(cluster.processes[role].address, role) for role in ("target-0", "draft")]
    assert list(reply.token_ids) == reference_greedy(str(target), tuple(LONG_PROMPT), 4, ignore_eos=True)
    assert tripped == {"target": 0, "draft": 0}
    assert reply.stats.draft_tokens_proposed >= 2  # the draft model drafted (after computing the prompt)
    assert all(info.prefill_ms_per_token_per_1k_context > 0 for info in infos)


@pytest.mark.alone
def test_long_prompts_sent_at_once_wait_their_turn_without_failing(tmp_path: Path) -> None:
    """A worker computes long prompts one after another, so the last of several sent at once
    waits for all the others' prefills before its own: its call's time limit counts the prefills
    this coordinator has sent that replica ahead of it (main: 6 prompts of 8,000 tokens at once
    with --worker-timeout-s 1 ended 2 of them UNAVAILABLE and tripped the target twice)."""
    target, draft = _long_context_models(tmp_path, draft_hidden=128, draft_layers=4)
    prompts = [[3 + (i * 37 + j) % 500 for i in range(8_000)] for j in range(6)]
    with (
        fault_cluster(tmp_path / "run", target, draft, coordinator_args=["--worker-timeout-s", "1"]) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        futures = [stub.Generate.future(_drafted(prompt), timeout=120) for prompt in prompts]
        replies = [future.result() for future in futures]
        tripped = {
            "target": metric(cluster, "coordinator", "specdec_target_failovers_total"),
            "draft": metric(cluster, "coordinator", "specdec_draft_failures_total"),
        }
    assert tripped == {"target": 0, "draft": 0}
    for prompt, reply in zip(prompts, replies, strict=True):
        assert list(reply.token_ids) == reference_greedy(str(target), tuple(prompt), 2, ignore_eos=True)
        assert reply.stats.draft_tokens_proposed >= 1  # the draft model drafted (the last token has no room to)


@pytest.mark.alone
def test_a_long_session_moved_to_another_target_replica_gets_the_time_to_compute_it_again(tmp_path: Path) -> None:
    """A session whose target replica dies is computed again on another replica; the call that
    does it gets the time its whole context takes there, not the time left from a step that had
    nothing to compute (main: the 12,000-token session's next turn got UNAVAILABLE with
    --worker-timeout-s 1, and the surviving replica was tripped: every other session's verify
    turned away too)."""
    target, draft = _long_context_models(tmp_path)
    with (
        fault_cluster(
            tmp_path / "run", target, draft, targets=2, coordinator_args=["--worker-timeout-s", "1"]
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        first = stub.Generate(_drafted(LONG_PROMPT, max_new=2, session_id="long"), timeout=120)
        replicas = [cluster.processes["target-0"], cluster.processes["target-1"]]
        holder = max(replicas, key=lambda r: worker_info(r.address, "target").prefill_tokens_total)
        holder.proc.kill()
        holder.proc.wait(10)
        second = stub.Generate(_drafted([6, 8], max_new=2, session_id="long"), timeout=120)
        failovers = metric(cluster, "coordinator", "specdec_target_failovers_total")
        other = stub.Generate(make_request(PROMPT, k=2, max_new=4, ignore_eos=True), timeout=60)
    history = (*LONG_PROMPT, *first.token_ids, 6, 8)
    assert list(second.token_ids) == reference_greedy(str(target), history, 2, ignore_eos=True)
    assert failovers == 1  # the dead replica only: the survivor was not tripped
    assert list(other.token_ids) == reference_greedy(str(target), tuple(PROMPT), 4, ignore_eos=True)


@pytest.mark.alone
def test_a_long_session_whose_cache_was_freed_gets_the_time_to_compute_it_again(tmp_path: Path) -> None:
    """A worker frees a cache nobody used for --session-idle-s (or for its token budget); the
    session's next turn has it computed again from the committed tokens, and that call gets the
    time its whole context takes (main: the 12,000-token session's next turn got UNAVAILABLE with
    --worker-timeout-s 1, the replica tripped by the resync's timeout)."""
    target, draft = _long_context_models(tmp_path)
    with (
        fault_cluster(
            tmp_path / "run",
            target,
            draft,
            coordinator_args=["--worker-timeout-s", "1"],
            worker_args=["--session-idle-s", "2"],
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        first = stub.Generate(_drafted(LONG_PROMPT, max_new=2, session_id="long"), timeout=120)
        time.sleep(2.5)  # the workers free the idle caches at their next call
        second = stub.Generate(_drafted([6, 8], max_new=2, session_id="long"), timeout=120)
        failovers = metric(cluster, "coordinator", "specdec_target_failovers_total")
    history = (*LONG_PROMPT, *first.token_ids, 6, 8)
    assert list(second.token_ids) == reference_greedy(str(target), history, 2, ignore_eos=True)
    assert second.stats.cache_resyncs >= 1 and failovers == 0


@pytest.mark.alone
def test_a_long_session_does_not_pad_every_batched_row_to_its_length(tmp_path: Path) -> None:
    """A batched pass pads each row's cache to its longest row's. A session with 12,000 tokens
    cached decoding beside 12 short requests had every one of their rows padded to 12,000
    positions: the target's peak memory grew by about 12 copies of the long cache (main; a
    30,000-token session beside 16 requests of the 1.5B target would be 25.6 GiB). The long row now
    takes a pass of its own (or with a few rows), and the replies are the target's own."""
    target, draft = _long_context_models(tmp_path, target_hidden=256)
    cache_mb = len(LONG_PROMPT) * 4 * 2 * 2 * 64 * 4 / 2**20  # layers x (keys, values) x KV heads x dims x fp32
    short = [[5 + j, 9, 7 + j, 11] for j in range(12)]
    with (
        fault_cluster(tmp_path / "run", target, draft) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(LONG_PROMPT, k=2, max_new=1, session_id="long", ignore_eos=True), timeout=120)
        warm = [stub.Generate.future(make_request(p, k=2, max_new=8, ignore_eos=True), timeout=60) for p in short]
        [future.result() for future in warm]  # the allocator's growth for batches of short rows
        pid = cluster.processes["target-0"].proc.pid
        before = _peak_rss_mb(pid)
        futures = [stub.Generate.future(make_request(p, k=2, max_new=48, ignore_eos=True), timeout=120) for p in short]
        on = stub.Generate(make_request([6, 8], k=2, max_new=24, session_id="long", ignore_eos=True), timeout=120)
        replies = [future.result() for future in futures]
        grown = _peak_rss_mb(pid) - before
    assert grown < 3 * cache_mb, f"the target's peak memory grew {grown:.0f} MiB beside a {cache_mb:.0f} MiB cache"
    for prompt, reply in zip(short, replies, strict=True):
        assert list(reply.token_ids) == reference_greedy(str(target), tuple(prompt), 48, ignore_eos=True)
    assert len(on.token_ids) == 24


def test_the_kv_caches_stay_within_their_token_budget(tmp_path: Path, tiny_models: TinyModels) -> None:
    """Many sessions with long histories cannot grow the workers' KV caches without bound (each
    one-shot request and session leaves its cache for reuse): past --max-cache-tokens the least
    recently used caches are freed, and a session whose cache went re-sends its tokens and goes on
    with the target's own output. Without the flag the budget is set from the memory free at load."""
    prompts = [[3 + (i * 11 + j * 5) % 250 for j in range(24)] for i in range(4)]
    with (
        fault_cluster(
            tmp_path / "run", tiny_models.target, tiny_models.same, worker_args=["--max-cache-tokens", "64"]
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        replies, held = [], []
        for i, prompt in enumerate(prompts):
            replies.append(stub.Generate(make_request(prompt, k=4, max_new=8, session_id=f"s{i}", ignore_eos=True)))
            held.append({role: metric(cluster, role, "specdec_worker_cached_tokens") for role in ("target-0", "draft")})
        again = stub.Generate(make_request([9, 10], k=4, max_new=8, session_id="s0", ignore_eos=True), timeout=60)
        budgets = {role: metric(cluster, role, "specdec_worker_cache_budget_tokens") for role in ("target-0", "draft")}
        resyncs = metric(cluster, "target-0", "specdec_worker_cache_resyncs_total")
    assert budgets == {"target-0": 64, "draft": 64}
    assert all(tokens <= 64 for step in held for tokens in step.values()), held
    for prompt, reply in zip(prompts, replies, strict=True):
        assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), 8, ignore_eos=True)
    history = (*prompts[0], *replies[0].token_ids, 9, 10)
    assert list(again.token_ids) == reference_greedy(str(tiny_models.target), history, 8, ignore_eos=True)
    assert resyncs >= 1  # s0's cache had been freed for the later sessions


def test_the_automatic_kv_budget_is_half_the_free_memory(robust_cluster: LocalCluster) -> None:
    """A tiny Llama's token (2 layers x keys and values x 2 KV heads x 16 dims x 4 bytes = 512 bytes)
    against the host's available memory: millions of tokens, far from 0 and from unbounded."""
    budget = metric(robust_cluster, "target-0", "specdec_worker_cache_budget_tokens")
    available = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    assert 0.25 * available / 512 < budget < 1.0 * available / 512


@pytest.mark.parametrize("port_flag", ["--port", "--health-port", "--local-port", "--metrics-port"])
def test_a_port_another_service_holds_stops_start_up(tmp_path: Path, tiny_models: TinyModels, port_flag: str) -> None:
    """A second service told to use a port the first one serves on fails to start and says so.
    gRPC servers bind with SO_REUSEPORT unless told not to, so the second one would share the port:
    the kernel would hand it some of the first one's connections (another worker's KV caches,
    another process answering its health probes), and nobody would be told."""
    from specdec.tools.launch import LaunchError, spawn

    ports = ["--health-port", "0", "--local-port", "0"]
    args = ["--model", str(tiny_models.target), "--device", "cpu", "--torch-threads", "1"]
    first = spawn("target", [*args, *ports], tmp_path, name="first")
    try:
        first.wait_ready(60)
        held = {"--port": first.port, "--health-port": first.health_port, "--local-port": first.local_port,
                "--metrics-port": first.metrics_port}[port_flag]  # fmt: skip
        assert held > 0
        second_ports = [*ports, port_flag, str(held)] if port_flag != "--port" else ports
        second = spawn("target", [*args, *second_ports], tmp_path, port=held if port_flag == "--port" else 0,
                       name="second")  # fmt: skip
        try:
            with pytest.raises(LaunchError, match=rf"exited with code \d+:[\s\S]*{held}[\s\S]*in use"):
                second.wait_ready(60)
        finally:
            second.stop()
        assert first.proc.poll() is None
    finally:
        first.stop()


def _any_request(draw: st.DrawFn) -> coordinator_pb2.GenerateRequest:
    """A prompt of any kind, then either any of the sampling and speculation fields within the
    limits (``within_limits``) or up to 4 fields each of the request, its sampling and
    speculation parameters at any value of their type; at most 8 new tokens."""
    request = coordinator_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["ids", "text", "messages", "any"]))
    if kind == "ids":
        request.prompt_token_ids.ids.extend(draw(st.lists(st.integers(0, len(EVERY_ID) - 1), min_size=1, max_size=8)))
    elif kind == "text":
        request.prompt = draw(st.text(min_size=1, max_size=40))
    elif kind == "messages":
        for role in draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=3)):
            request.messages.add(role=role, content=draw(st.text(max_size=20)))
    else:
        fill_any(draw, request, keep=frozenset({"sampling", "speculation"}))
    request.sampling.max_new_tokens = draw(st.integers(1, 8))  # a few tokens keep the run short
    if draw(st.booleans()):  # turns of a few sessions, each with other parameters
        request.session_id = draw(st.sampled_from(["", "fuzz-1", "fuzz-2"]))
        request.require_existing_session = bool(request.session_id) and draw(st.booleans())
    if draw(st.booleans()):
        within_limits(draw, request, len(EVERY_ID))
    else:
        fill_any(draw, request.sampling, keep=frozenset({"max_new_tokens"}))
        fill_any(draw, request.speculation)
    return request


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.data())
def test_any_requests_through_the_running_service_are_served_or_refused_as_the_client_s_error(
    robust_cluster: LocalCluster, redis_server: RedisServer, tiny_models: TinyModels, data: st.DataObject
) -> None:
    """Any requests a client can send (``_any_request``: NaN and infinite floats, the largest
    integers, unknown enum values, maps, or every feature within its limits together), one to
    three at once (the workers batch them), unary or streamed, through the real processes
    (coordinator, draft, target): each is served or refused with a client error that says what
    was wrong (no traceback), or cancelled by the client after its first round (one in five);
    no process exits, the draft is never blamed for them, each session they named is in Redis as
    they left it (a refused or cancelled turn rolled back) and free, and its next turn gives
    target-only greedy decoding's tokens after what Redis holds (``sent_at_once``)."""
    target = str(tiny_models.target)
    requests = [_any_request(data.draw) for _ in range(data.draw(st.integers(1, 3)))]
    cancels = [data.draw(st.integers(0, 4)) == 0 for _ in requests]  # one in five cancelled mid-stream
    calls = []
    with grpc.insecure_channel(robust_cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for request, cancel in zip(requests, cancels, strict=True):
            if cancel:
                _to_cancel(data.draw, request)
                calls.append(functools.partial(cancelled_after_its_first_round, stub.GenerateStream, request))
                continue
            method = stub.GenerateStream if data.draw(st.booleans()) else stub.Generate
            calls.append(functools.partial(method, request, timeout=60))
        state, greedy = redis_server.database(ROBUST_STATE_DB), functools.partial(greedy_continuation, target)
        outcomes = sent_at_once(
            robust_cluster, calls, requests, shares_a_session(requests), False, state, cancels, greedy
        )
        for outcome in outcomes:
            event(outcome)


def _to_cancel(draw: st.DrawFn, request: coordinator_pb2.GenerateRequest) -> None:
    """Makes ``request`` one whose turn is known by its length where the cancel comes too late:
    prompt ids, a named session or none, ``known_by_length`` (its other features stay as drawn)."""
    request.prompt_token_ids.ids[:] = draw(st.lists(st.integers(0, len(EVERY_ID) - 1), min_size=1, max_size=8))
    del request.messages[:]
    known_by_length(draw, request)
