"""End to end over real gRPC: coordinator, draft and target as three separate processes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis.vendor.pretty import pretty
from transformers import AutoModelForCausalLM, AutoTokenizer

from coordinator.settings import CoordinatorSettings
from specdec.serving.settings import ModelWorkerSettings
from specdec.tools.launch import LaunchError, LocalCluster, spawn, worker_info
from specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tests.clusters import fault_cluster, metric, wait_for
from tests.helpers import RedisServer
from tests.reference import SAMPLED_AT_ONCE, coordinator_stub, make_request, reference_greedy
from tests.spec_oracle import PASS_P
from tests.tiny_models import TinyModels, build_byte_fallback_tokenizer, build_model, build_sharp

PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 130, 64, 11, 250, 0]]
MAX_NEW = 24


def stub(cluster: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    yield from coordinator_stub(cluster)


@pytest.fixture
def same(cluster_same: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    yield from stub(cluster_same)


@pytest.fixture
def other(cluster_other: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    yield from stub(cluster_other)


@pytest.fixture
def adversarial(cluster_adversarial: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    yield from stub(cluster_adversarial)


request = make_request


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
@pytest.mark.parametrize("draft", ["same", "other", "adversarial"])
def test_greedy_speculative_equals_target_greedy(
    draft: str, prompt: list[int], k: int, tiny_models: TinyModels, request: pytest.FixtureRequest
) -> None:
    client: coordinator_pb2_grpc.GenerationStub = request.getfixturevalue(draft)
    reply = client.Generate(globals()["request"](prompt, k=k))
    expected = reference_greedy(str(tiny_models.target), tuple(prompt), MAX_NEW)
    assert list(reply.token_ids) == expected
    stats = reply.stats
    assert stats.draft_tokens_accepted <= stats.draft_tokens_proposed
    assert stats.rounds == stats.target_forward_passes
    assert reply.usage.completion_tokens == len(expected)
    if draft == "same":
        assert stats.acceptance_rate > 0.9
        assert stats.rounds <= -(-len(expected) // (k + 1)) + 1
    elif draft == "other":
        assert stats.acceptance_rate < 0.5
    else:
        assert stats.draft_tokens_accepted == 0
        assert stats.rounds == len(expected)


@pytest.fixture
def pipelined(cluster_pipelined: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    yield from stub(cluster_pipelined)


@pytest.mark.parametrize("stop", ["draft_confidence", "draft_block_confidence"])
@pytest.mark.parametrize("draft", ["same", "other", "pipelined"])
def test_blocks_ended_by_the_draft_s_confidence_keep_the_target_s_greedy_tokens(
    draft: str, stop: str, tiny_models: TinyModels, request: pytest.FixtureRequest
) -> None:
    """K = 8 with one of the draft's confidence stops at 0.6 (fixed K, so the stop alone shortens
    a block; ``pipelined``: a sometimes-right draft drafting ahead): the target's greedy tokens;
    the unrelated draft's blocks end early."""
    client: coordinator_pb2_grpc.GenerationStub = request.getfixturevalue(draft)
    for prompt in PROMPTS:
        req = globals()["request"](prompt, k=8)
        setattr(req.speculation, stop, 0.6)
        reply = client.Generate(req)
        assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), MAX_NEW)
        assert 0 < reply.stats.mean_k <= 8
        if draft == "other":
            assert reply.stats.mean_k < 4, reply.stats


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
def test_the_server_s_block_stop_follows_the_measured_costs(mode: str, tmp_path: Path, tiny_models: TinyModels) -> None:
    """Adaptive requests without a block stop of their own (a sometimes-right draft), on a
    sequential and on a pipelined coordinator: the draft is asked for the threshold the measured
    costs set, which moves with the costs (not the server's 0.5); one that sets 0.5 gets 0.5. The
    target's greedy tokens throughout. A cluster of its own, so that what other tests' requests
    leave in a shared coordinator's pooled estimates cannot decide it: on the shared pipelined
    cluster one CI run had every turn here draft without a stop (no threshold to check). Its
    draft is sure where it is right (the target's output layer noised and sharpened, as
    scripts/pipelined_emulation.py's): the suite's noisy draft, whose probabilities are all below
    0.25 and say little of where it is right, has its stops switched off (the check since
    2026-12-07 compares the tokens they end blocks on with those the draft went on after)."""
    mode_args = ["--speculation-mode", mode]
    draft = build_sharp(tiny_models.target, tmp_path / "sharp")
    with (
        fault_cluster(tmp_path, tiny_models.target, draft, coordinator_args=mode_args) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        client = coordinator_pb2_grpc.GenerationStub(channel)
        info = client.GetInfo(coordinator_pb2.GetInfoRequest())
        assert info.draft_block_confidence_from_costs and info.draft_block_confidence == pytest.approx(0.5)
        stops = []
        for rerun in range(3):  # the first requests may draft before the costs are measured (at 0.5)
            for prompt in PROMPTS:
                default, own = (
                    globals()["request"](prompt, k=0, fixed=False),
                    globals()["request"](prompt, k=0, fixed=False),
                )
                default.speculation.method = own.speculation.method = coordinator_pb2.DRAFT_METHOD_MODEL
                own.speculation.draft_block_confidence = 0.5
                expected = reference_greedy(str(tiny_models.target), tuple(prompt), MAX_NEW)
                replies = client.Generate(default), client.Generate(own)
                assert [list(r.token_ids) for r in replies] == [expected, expected]
                assert all(r.stats.draft_tokens_proposed > 0 for r in replies), replies
                assert replies[1].stats.mean_block_stop in (0.0, pytest.approx(0.5))  # 0: every stop dropped (unpaid)
                stops += [replies[0].stats.mean_block_stop] * (rerun > 0)
    assert any(stops), stops
    # each a mean of per-round thresholds set by the costs, each in [0.05, 0.9]
    assert all(stop == 0.0 or (0.05 <= stop <= 0.9 and stop != pytest.approx(0.5)) for stop in stops), stops


def test_target_only_mode_is_identical(same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels) -> None:
    req = request(PROMPTS[0])
    req.speculation.disable = True
    reply = same.Generate(req)
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPTS[0]), MAX_NEW)
    assert reply.stats.draft_tokens_proposed == 0
    assert reply.stats.target_only_rounds == reply.stats.rounds == len(reply.token_ids)


def test_a_cluster_s_repr_names_its_addresses_and_logs_in_a_line(cluster_same: LocalCluster) -> None:
    """Hypothesis prints a failing example's fixtures: a cluster's repr must leave room for the
    error (a dataclass's repr of its processes, their arguments included, ran to over 12,000
    characters and hid the assertion of a CI failure). Hypothesis' own printer lists a
    dataclass's fields whatever its ``__repr__`` says (a later CI failure still printed them all):
    it must print the same line."""
    text = repr(cluster_same)
    assert len(text) < 400 and "\n" not in text, text
    assert cluster_same.address in text and str(cluster_same.workdir) in text
    assert all(f"{name}=" in text for name in cluster_same.processes)
    assert pretty(cluster_same) == text


def test_the_first_round_which_computes_the_prompt_is_reported_apart(same: coordinator_pb2_grpc.GenerationStub) -> None:
    """``stats.first_round``: the turn's first round (it also computes the prompt on both workers),
    part of the totals; a one-round turn's totals are its first round's; target-only, no draft
    tokens (and well under a millisecond of draft time: the round's bookkeeping)."""
    reply = same.Generate(request(PROMPTS[0], k=4))
    s, first = reply.stats, reply.stats.first_round
    assert s.rounds > 1 and (first.draft_tokens_proposed, first.lookup_tokens_proposed) == (4, 0), s
    assert 0 < first.verify_ms < s.verify_ms and 0 < first.draft_ms < s.draft_ms, s
    one = same.Generate(request(PROMPTS[1], k=4, max_new=5)).stats
    assert one.rounds == 1 and one.first_round.draft_tokens_proposed == one.draft_tokens_proposed == 4, one
    assert (one.first_round.verify_ms, one.first_round.draft_ms) == (one.verify_ms, one.draft_ms), one
    alone = request(PROMPTS[0])
    alone.speculation.disable = True
    plain = same.Generate(alone).stats
    assert plain.first_round.draft_tokens_proposed == 0 and plain.first_round.draft_ms <= plain.draft_ms < 1, plain
    assert 0 < plain.first_round.verify_ms < plain.verify_ms, plain


def test_text_prompt_round_trip(other: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.target)
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    req = coordinator_pb2.GenerateRequest(
        prompt="The capital of France is", sampling=common_pb2.SamplingParams(max_new_tokens=16)
    )
    reply = other.Generate(req)
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt_ids), 16)
    assert reply.text == tokenizer.decode(reply.token_ids, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}])
def test_seeded_sampling_is_reproducible(
    other: coordinator_pb2_grpc.GenerationStub, sampling: dict[str, float]
) -> None:
    first = other.Generate(request(PROMPTS[0], seed=1234, **sampling))
    again = other.Generate(request(PROMPTS[0], seed=1234, **sampling))
    different = other.Generate(request(PROMPTS[0], seed=99, **sampling))
    assert list(first.token_ids) == list(again.token_ids)
    assert first.seed == 1234
    assert list(first.token_ids) != list(different.token_ids)


def test_unseeded_sampling_reports_its_seed(other: coordinator_pb2_grpc.GenerationStub) -> None:
    reply = other.Generate(request(PROMPTS[0], temperature=1.0))
    replay = other.Generate(request(PROMPTS[0], temperature=1.0, seed=reply.seed))
    assert list(replay.token_ids) == list(reply.token_ids)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}])
def test_stream_and_unary_give_the_same_tokens(
    other: coordinator_pb2_grpc.GenerationStub, sampling: dict[str, float]
) -> None:
    unary = other.Generate(request(PROMPTS[1], **sampling))
    messages = list(other.GenerateStream(request(PROMPTS[1], **sampling)))
    streamed = [t for m in messages for t in m.token_ids]
    assert streamed == list(unary.token_ids)
    assert "".join(m.text for m in messages) == unary.text
    assert all(m.finish_reason == coordinator_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == unary.finish_reason
    assert last.usage == unary.usage
    assert last.stats.rounds == len(messages) == unary.stats.rounds


def test_max_new_tokens_and_stop_tokens_are_exact(
    same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPTS[1]), MAX_NEW, ignore_eos=True)
    for n in (1, 2, 5, 9):
        reply = same.Generate(request(PROMPTS[1], k=8, max_new=n, ignore_eos=True))
        assert list(reply.token_ids) == expected[:n]
        assert reply.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    stop = expected[6]
    cut = expected.index(stop) + 1
    reply = same.Generate(request(PROMPTS[1], k=8, stop_token_ids=[stop]))
    assert list(reply.token_ids) == expected[:cut]
    assert reply.finish_reason == coordinator_pb2.FINISH_REASON_STOP


def unset_max_new(prompt: list[int], **fields: object) -> coordinator_pb2.GenerateRequest:
    req = request(prompt, k=8, ignore_eos=True, **fields)
    req.sampling.ClearField("max_new_tokens")
    return req


def test_an_unset_max_new_tokens_stops_at_the_end_of_the_context(
    same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """The server's default max_new_tokens (255 here) is a cap, not a demand: a prompt that leaves
    less room gets a reply up to the end of the context (vLLM's rule for an unset max_tokens), not
    an error about a limit the caller never set. A limit the caller did set still must fit."""
    context = same.GetInfo(coordinator_pb2.GetInfoRequest()).max_context_len
    prompt = [5 + i % 50 for i in range(200)]
    reply = same.Generate(unset_max_new(prompt))
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), context - 200, True)
    assert reply.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    assert len(same.Generate(unset_max_new([7] * (context - 1))).token_ids) == 1
    # A session: the room left is what the history and the new prompt leave.
    first = same.Generate(request(prompt[:100], session_id="room-1", max_new=100, ignore_eos=True))
    second = same.Generate(unset_max_new(prompt[100:150], session_id="room-1"))
    assert len(first.token_ids) == 100 and len(second.token_ids) == context - 250
    with pytest.raises(grpc.RpcError) as full:
        same.Generate(unset_max_new([3], session_id="room-1"))
    assert full.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "leave no room for a reply" in (full.value.details() or "")
    same.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="room-1"))
    with pytest.raises(grpc.RpcError) as short:  # min_tokens must fit in the room left
        same.Generate(unset_max_new(prompt, min_tokens=context - 199))
    assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_tokens" in (short.value.details() or "")
    with pytest.raises(grpc.RpcError) as set_limit:  # a max_new_tokens the caller set is not cut
        same.Generate(request(prompt, max_new=100))
    assert "exceeds the context length" in (set_limit.value.details() or "")


def test_eos_ends_a_reply_unless_ignored(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """A prompt whose greedy continuation meets EOS: the reply stops on it; with ignore_eos it goes
    on, equal to a plain greedy loop over the target (and to the generate() reference)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models.target).eval()
    eos = model.config.eos_token_id

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    prompt = next([p] for p in range(256) if eos in greedy([p], 20)[:-1])
    expected = greedy(prompt, 20)

    def finished() -> dict[str, float]:
        name = "specdec_finished_requests_total"
        return {r: metric(cluster_other, "coordinator", name, f'reason="{r}"') for r in ("eos", "length")}

    before = finished()
    stopped = other.Generate(request(prompt, k=3, max_new=20))
    assert list(stopped.token_ids) == expected[: expected.index(eos) + 1]
    assert stopped.finish_reason == coordinator_pb2.FINISH_REASON_STOP
    ignored = other.Generate(request(prompt, k=3, max_new=20, ignore_eos=True))
    assert list(ignored.token_ids) == expected == reference_greedy(str(tiny_models.target), tuple(prompt), 20, True)
    assert ignored.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    after = finished()
    assert after["eos"] == before["eos"] + 1 and after["length"] == before["length"] + 1


def test_every_rpc_is_counted_by_method_and_status_code_and_timed(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub
) -> None:
    """An operator's error rate and latency: every RPC is counted by method and status code
    (`specdec_rpcs_total`) and timed (`specdec_rpc_seconds`; a stream also to its first message,
    the first tokens of GenerateStream). There were no such metrics: failed requests and request
    latency could not be alerted on."""
    generate, stream = "specdec.v1.Generation/Generate", "specdec.v1.Generation/GenerateStream"
    verify = "specdec.v1.TargetWorker/Verify"

    def counts() -> dict[str, float]:
        rpcs = "specdec_rpcs_total"
        return {
            "ok": metric(cluster_other, "coordinator", rpcs, f'code="OK",method="{generate}"'),
            "invalid": metric(cluster_other, "coordinator", rpcs, f'code="INVALID_ARGUMENT",method="{generate}"'),
            "stream ok": metric(cluster_other, "coordinator", rpcs, f'code="OK",method="{stream}"'),
            "stream cancelled": metric(cluster_other, "coordinator", rpcs, f'code="CANCELLED",method="{stream}"'),
            "stream timed": metric(cluster_other, "coordinator", "specdec_rpc_seconds_count", f'method="{stream}"'),
            "stream seconds": metric(cluster_other, "coordinator", "specdec_rpc_seconds_sum", f'method="{stream}"'),
            "first": metric(cluster_other, "coordinator", "specdec_rpc_first_message_seconds_count", stream),
            "first seconds": metric(cluster_other, "coordinator", "specdec_rpc_first_message_seconds_sum", stream),
            "verify ok": metric(cluster_other, "target-0", rpcs, f'code="OK",method="{verify}"'),
        }

    before = counts()
    other.Generate(request(PROMPTS[0], max_new=4))
    bad = request(PROMPTS[0], max_new=4)
    bad.sampling.top_p = 2.0
    with pytest.raises(grpc.RpcError) as refused:
        other.Generate(bad)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    list(other.GenerateStream(request(PROMPTS[1], max_new=6, ignore_eos=True)))
    cancelled = other.GenerateStream(request(PROMPTS[1], max_new=200, ignore_eos=True))
    next(cancelled)
    cancelled.cancel()
    wait_for(lambda: counts()["stream cancelled"] == before["stream cancelled"] + 1, 10)
    after = counts()
    for key in ("ok", "invalid", "stream ok", "stream timed", "first"):
        assert after[key] - before[key] == {"stream timed": 2, "first": 2}.get(key, 1), key
    assert after["verify ok"] > before["verify ok"]
    # a stream's first message comes before its end
    assert 0 < after["first seconds"] - before["first seconds"] < after["stream seconds"] - before["stream seconds"]


def test_a_finished_turn_ends_its_draft_stream_with_ok(
    cluster_pipelined: LocalCluster, pipelined: coordinator_pb2_grpc.GenerationStub
) -> None:
    """A turn that finished closes its Propose stream (the draft drops a block it drafted ahead
    and ends the call OK); only a turn that did not finish cancels it. Every finished turn used
    to cancel it: the draft's `specdec_rpcs_total` counted each one CANCELLED, so an operator's
    error rate over the draft's RPCs was one per request."""
    propose = 'method="specdec.v1.DraftWorker/Propose"'

    def counts() -> tuple[float, float]:
        rpcs = "specdec_rpcs_total"
        return (
            metric(cluster_pipelined, "draft", rpcs, f'code="OK",{propose}'),
            metric(cluster_pipelined, "draft", rpcs, f'code="CANCELLED",{propose}'),
        )

    ok, cancelled = counts()
    for prompt in PROMPTS:
        reply = pipelined.Generate(request(prompt, max_new=12, ignore_eos=True))
        assert reply.stats.draft_tokens_proposed > 0
    wait_for(lambda: counts()[0] == ok + len(PROMPTS), 10)
    assert counts() == (ok + len(PROMPTS), cancelled)


def test_every_turn_leaves_one_log_line_of_what_it_cost(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub
) -> None:
    """`turn_ended` (info): the session, whether it finished and why, tokens, rounds, acceptance
    and seconds, never the text; a cancelled turn's line says it did not finish."""
    reply = other.Generate(request(PROMPTS[0], session_id="logged-turn", max_new=5, ignore_eos=True))
    cancelled = other.GenerateStream(request(PROMPTS[1], session_id="logged-cancel", max_new=200, ignore_eos=True))
    next(cancelled)
    cancelled.cancel()

    def ended(session: str) -> list[dict]:
        lines = cluster_other.processes["coordinator"].log_tail(2000).splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == "turn_ended" and e["session_id"] == session]

    wait_for(lambda: bool(ended("logged-cancel")), 10)
    (done,) = ended("logged-turn")
    assert done["finished"] is True and done["reason"] == "length" and done["level"] == "info"
    assert done["completion_tokens"] == len(reply.token_ids) == 5 and done["prompt_tokens"] == len(PROMPTS[0])
    assert done["rounds"] == reply.stats.rounds and 0 < done["seconds"] < 30
    (gone,) = ended("logged-cancel")
    assert gone["finished"] is False and gone["reason"] is None
    assert not {"text", "prompt", "prompt_token_ids", "token_ids"} & done.keys()


def test_each_call_s_request_id_is_logged_with_it_and_sent_back(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub
) -> None:
    """`x-request-id` (the caller's, or one the coordinator makes up) comes back in the call's
    initial metadata and is on the call's log lines (`turn_ended`, `rpc_failed`); a malformed one
    is the caller's error, naming the header."""
    given = (("x-request-id", "client-7f3a:turn/1"),)
    _, call = other.Generate.with_call(request(PROMPTS[0], session_id="id-given", max_new=3), metadata=given)
    assert dict(call.initial_metadata())["x-request-id"] == "client-7f3a:turn/1"
    _, call = other.Generate.with_call(request(PROMPTS[0], session_id="id-made", max_new=3))
    made = dict(call.initial_metadata())["x-request-id"]
    assert (
        len(made) == 32
        and made != dict(other.Generate.with_call(request(PROMPTS[0], max_new=1))[1].initial_metadata())["x-request-id"]
    )
    stream = other.GenerateStream(
        request(PROMPTS[1], session_id="id-stream", max_new=3), metadata=(("x-request-id", "s-1"),)
    )
    assert list(stream)[-1].finish_reason and dict(stream.initial_metadata())["x-request-id"] == "s-1"
    bad_sampling = request(PROMPTS[0], max_new=3)
    bad_sampling.sampling.temperature = -1.0
    with pytest.raises(grpc.RpcError) as refused:
        other.Generate(bad_sampling, metadata=(("x-request-id", "failing-1"),))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for bad in ("two words", "x" * 129, ""):
        with pytest.raises(grpc.RpcError) as refused:
            other.Generate(request(PROMPTS[0], max_new=1), metadata=(("x-request-id", bad),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert "x-request-id must be 1-128 printable ASCII characters" in refused.value.details(), bad

    def events() -> list[dict]:
        lines = cluster_other.processes["coordinator"].log_tail(3000).splitlines()
        return [e for e in map(json.loads, lines) if e["event"] in ("turn_ended", "rpc_failed")]

    def ids(session: str) -> list[str]:
        return [e.get("request_id") for e in events() if e["event"] == "turn_ended" and e.get("session_id") == session]

    wait_for(lambda: ids("id-stream") != [], 10)
    assert ids("id-given") == ["client-7f3a:turn/1"] and ids("id-made") == [made] and ids("id-stream") == ["s-1"]
    failed = [e for e in events() if e["event"] == "rpc_failed" and e.get("request_id") == "failing-1"]
    assert [e["code"] for e in failed] == ["INVALID_ARGUMENT"]


def target_info(cluster: LocalCluster) -> common_pb2.WorkerInfo:
    return worker_info(cluster.processes["target-0"].address, "target")


MAX_SESSIONS = ModelWorkerSettings.model_fields["max_sessions"].default  # what the suite's clusters' workers keep


def with_one_more(held: int) -> int:
    """The caches a worker holds once one more came: ``held`` + 1, or ``held`` where it was at
    MAX_SESSIONS (the least recently used made room). The suite's session-scoped clusters serve
    other files' tests too (test_combinations.py sends 1,500 requests a mix), which can leave them
    full: a CI run that queued that file first failed on ``256 == 256 + 1``."""
    return min(held + 1, MAX_SESSIONS)


def test_multi_turn_session_reuses_the_worker_caches(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    # an earlier test's cancelled turn frees its caches after it logged its end: wait for that first
    wait_for(lambda: metric(cluster_other, "coordinator", "specdec_active_requests") == 0, 10)
    kept = target_info(cluster_other).active_sessions  # earlier one-shot requests' caches (prefix reuse)
    draft_kept = worker_info(cluster_other.processes["draft"].address, "draft").active_sessions
    turn1 = other.Generate(request(PROMPTS[0], session_id="chat-1", max_new=12, ignore_eos=True))
    history = [*PROMPTS[0], *turn1.token_ids]
    second_prompt = [9, 8, 7]
    before = target_info(cluster_other).prefill_tokens_total
    turn2 = other.Generate(request(second_prompt, session_id="chat-1", max_new=12, ignore_eos=True))
    computed = target_info(cluster_other).prefill_tokens_total - before
    full = [*history, *second_prompt]
    assert list(turn2.token_ids) == reference_greedy(str(tiny_models.target), tuple(full), 12, ignore_eos=True)
    assert turn2.usage.cached_tokens == len(history) - 1  # all but the last committed token
    # The target ran only the new tokens: the last turn-1 token + the new prompt in round 1, one
    # committed token per later round, and the drafted positions; the history was not re-prefilled.
    rounds, proposed = turn2.stats.rounds, turn2.stats.draft_tokens_proposed
    assert computed == len(second_prompt) + 1 + (rounds - 1) + proposed
    assert target_info(cluster_other).active_sessions == with_one_more(kept)
    assert other.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="chat-1")).existed
    assert target_info(cluster_other).active_sessions == with_one_more(kept) - 1
    assert (
        worker_info(cluster_other.processes["draft"].address, "draft").active_sessions == with_one_more(draft_kept) - 1
    )
    assert not other.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="chat-1")).existed
    with pytest.raises(grpc.RpcError) as err:
        req = request([1], session_id="chat-1")
        req.require_existing_session = True
        other.Generate(req)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_one_shot_request_reuses_the_cached_prefix_of_an_earlier_one(
    cluster_same: LocalCluster, same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """Prefix reuse (blocks of 16 tokens): a finished one-shot request leaves its caches; a later
    one-shot request whose prompt starts with those tokens copies them instead of recomputing
    them (cached_tokens, the workers' reused-token counters), with the same tokens as target-only
    decoding; a cancelled one leaves nothing."""
    prompt = [(7 * i + 3) % 250 for i in range(40)]
    first = same.Generate(request(prompt, max_new=8, ignore_eos=True))
    assert first.usage.cached_tokens == 0
    info = target_info(cluster_same)
    draft_before = worker_info(cluster_same.processes["draft"].address, "draft")
    longer = [*prompt, *first.token_ids, 11, 12, 13]
    second = same.Generate(request(longer, max_new=8, ignore_eos=True))
    after = target_info(cluster_same)
    # the first request's target cache holds 47 tokens (all but the last): two whole blocks of 16
    assert second.usage.cached_tokens == 32
    assert after.reused_tokens_total - info.reused_tokens_total == 32
    # the target ran the uncached tail, one token per later round and the drafts: not the prefix
    computed = after.prefill_tokens_total - info.prefill_tokens_total
    assert computed == len(longer) - 32 + (second.stats.rounds - 1) + second.stats.draft_tokens_proposed
    draft_after = worker_info(cluster_same.processes["draft"].address, "draft")
    assert draft_after.reused_tokens_total > draft_before.reused_tokens_total
    expected = reference_greedy(str(tiny_models.target), tuple(longer), 8, ignore_eos=True)
    assert list(second.token_ids) == expected
    left = with_one_more(after.active_sessions) - 1  # the cancelled request's cache freed
    stream = same.GenerateStream(request(longer, max_new=60, ignore_eos=True))
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 2
    while target_info(cluster_same).active_sessions != left:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("without_draft", ["disable", "ngram"])
def test_a_request_decoded_without_the_draft_leaves_its_prefix_cached_for_the_draft(
    cluster_same: LocalCluster, same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels, without_draft: str
) -> None:
    """A request whose draft model never runs (speculation off, or lookup drafts only) finds a
    cached prefix and records its own tokens for the next request, as any other. Its record named
    its own draft cache, which never got the prefix: the next request sharing it found it for the
    target only and its draft computed all of it. The record now names the draft cache that holds
    the prefix (the earlier request's), so the next request's draft copies it too."""
    salt = {"disable": 1, "ngram": 2}[without_draft]
    prompt = [(9 * i + 4 * salt) % 250 for i in range(40)]
    same.Generate(request(prompt, max_new=8, ignore_eos=True))
    plain = request([*prompt, 1, 2, 3], max_new=4, ignore_eos=True)
    if without_draft == "disable":
        plain.speculation.disable = True
    else:
        plain.speculation.method = coordinator_pb2.DRAFT_METHOD_NGRAM
    reply = same.Generate(plain)
    assert reply.usage.cached_tokens == 32 and reply.stats.draft_tokens_proposed == reply.stats.lookup_tokens_proposed
    draft = cluster_same.processes["draft"].address
    before = worker_info(draft, "draft").reused_tokens_total
    longer = [*prompt, 4, 5, 6]
    third = same.Generate(request(longer, max_new=8, ignore_eos=True))
    assert third.usage.cached_tokens == 32
    assert worker_info(draft, "draft").reused_tokens_total - before == 32  # main: 0
    assert list(third.token_ids) == reference_greedy(str(tiny_models.target), tuple(longer), 8, ignore_eos=True)


def test_a_session_whose_first_turn_ran_without_the_draft_drafts_from_the_prefix_it_found(
    cluster_same: LocalCluster, same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """A session's first turn, decoded without the draft model (speculation off), starts from a
    prefix an earlier request left cached; its next turn speculates. The session's record named its
    own draft cache as holding that prefix, which never got it: the next turn's draft was sent it as
    cached, answered with a resync and computed all of it. The record now names the cache that holds
    it, so the draft copies it from there."""
    prompt = [(5 * i + 9) % 250 for i in range(40)]
    same.Generate(request(prompt, max_new=8, ignore_eos=True))
    first = request([*prompt, 1, 2, 3], session_id="off-then-on", max_new=4, ignore_eos=True)
    first.speculation.disable = True
    turn1 = same.Generate(first)
    assert turn1.usage.cached_tokens == 32 and turn1.stats.draft_tokens_proposed == 0
    draft = cluster_same.processes["draft"].address
    before = worker_info(draft, "draft").reused_tokens_total
    turn2 = same.Generate(request([7, 8], session_id="off-then-on", max_new=8, ignore_eos=True))
    assert turn2.stats.cache_resyncs == 0  # main: 1
    assert worker_info(draft, "draft").reused_tokens_total - before == 32  # main: 0
    history = [*prompt, 1, 2, 3, *turn1.token_ids, 7, 8]
    assert list(turn2.token_ids) == reference_greedy(str(tiny_models.target), tuple(history), 8, ignore_eos=True)
    assert same.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="off-then-on")).existed


def test_empty_prompt_is_invalid(same: coordinator_pb2_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        same.Generate(coordinator_pb2.GenerateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is empty" in err.value.details()


@pytest.mark.parametrize("role", ["coordinator", "draft", "target"])
def test_health_reflection_and_info(cluster_same: LocalCluster, tiny_models: TinyModels, role: str) -> None:
    full_names = {
        "coordinator": "specdec.v1.Generation",
        "draft": "specdec.v1.DraftWorker",
        "target": "specdec.v1.TargetWorker",
    }
    with grpc.insecure_channel(cluster_same.processes["target-0" if role == "target" else role].address) as channel:
        for service in ("", full_names[role]):
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
        assert {full_names[role], "grpc.health.v1.Health"} <= names
        if role != "coordinator":
            info_stub = (
                target_pb2_grpc.TargetWorkerStub(channel)
                if role == "target"
                else draft_pb2_grpc.DraftWorkerStub(channel)
            )
            info = info_stub.Info(
                target_pb2.TargetInfoRequest() if role == "target" else draft_pb2.DraftInfoRequest()
            ).info
            assert info.vocab_size == 259 and info.device == "cpu" and info.dtype == "float32"
            assert info.model_id == str(tiny_models.target if role == "target" else tiny_models.same)
            assert info.eos_token_ids == [257] and info.max_context_len == 256 and len(info.tokenizer_hash) == 32


def test_coordinator_refuses_a_draft_with_another_tokenizer(tmp_path: Path, tiny_models: TinyModels) -> None:
    other_tokenizer = build_model(tmp_path / "other-tokenizer", seed=3, hidden=32, layers=1, vocab=300)
    tokenizer = AutoTokenizer.from_pretrained(other_tokenizer)
    tokenizer.add_tokens(["<tool_call>"])  # one more token: a different token -> id mapping
    tokenizer.save_pretrained(other_tokenizer)
    cluster = LocalCluster(
        str(tiny_models.target), str(other_tokenizer), tmp_path / "run", worker_args=["--device", "cpu"],
        startup_timeout_s=120,
    )  # fmt: skip
    with pytest.raises(LaunchError, match="does not share the tokenizer"):
        cluster.start()


def test_workers_that_lost_a_session_are_resynced(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    turn1 = other.Generate(request(PROMPTS[1], session_id="resync-1", max_new=8, ignore_eos=True))
    for role, stub_cls, message in (
        ("target-0", target_pb2_grpc.TargetWorkerStub, target_pb2.TargetReleaseSessionRequest),
        ("draft", draft_pb2_grpc.DraftWorkerStub, draft_pb2.DraftReleaseSessionRequest),
    ):
        with grpc.insecure_channel(cluster_other.processes[role].address) as channel:
            assert stub_cls(channel).ReleaseSession(message(session_id="resync-1")).existed
    turn2 = other.Generate(request([1, 2], session_id="resync-1", max_new=8, ignore_eos=True))
    full = (*PROMPTS[1], *turn1.token_ids, 1, 2)
    assert list(turn2.token_ids) == reference_greedy(str(tiny_models.target), full, 8, ignore_eos=True)
    assert turn2.usage.cached_tokens == 0  # re-prefilled from the committed tokens in the state store
    assert turn2.stats.cache_resyncs == 2  # target and draft each refused the stale prefix once
    assert turn2.stats.target_forward_passes == turn2.stats.rounds
    other.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="resync-1"))


def test_sampled_tokens_follow_the_target_distribution(
    other: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """Through the whole service: the first two sampled tokens match the exact warped target distribution."""
    from scipy import stats as scipy_stats

    from specdec.runtime.sampling import Warp, warped_probs

    warp, prompt, n = Warp(temperature=1.0, top_k=4), PROMPTS[0], 1500
    model = AutoModelForCausalLM.from_pretrained(tiny_models.target, dtype=torch.float32).eval()
    with torch.no_grad():
        first = warped_probs(model(torch.tensor([prompt])).logits[0, -1], warp)
        exact: dict[tuple[int, int], float] = {}
        for a in torch.nonzero(first).flatten().tolist():
            second = warped_probs(model(torch.tensor([[*prompt, a]])).logits[0, -1], warp)
            for b in torch.nonzero(second).flatten().tolist():
                exact[(a, b)] = float(first[a] * second[b])
    counts: dict[tuple[int, int], int] = dict.fromkeys(exact, 0)

    def sample(seed: int) -> coordinator_pb2.GenerateResponse:
        return other.Generate(request(prompt, k=3, max_new=2, temperature=1.0, top_k=4, seed=seed, ignore_eos=True))

    with ThreadPoolExecutor(SAMPLED_AT_ONCE) as pool:  # several at once, as clients send them: the target batches them
        replies = list(pool.map(sample, range(n)))
    for reply in replies:
        pair = (reply.token_ids[0], reply.token_ids[1])
        assert pair in counts, f"sampled {pair}, which has probability 0 under the target"
        counts[pair] += 1
    keys = sorted(exact)
    total = sum(exact.values())
    observed = [counts[key] for key in keys]
    expected = [exact[key] / total * n for key in keys]
    assert scipy_stats.chisquare(observed, expected).pvalue > PASS_P


def test_a_seeded_turn_replays_after_the_workers_lost_the_session(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub
) -> None:
    """Fixed K, a seed: the same tokens whether the workers still hold the session's caches or
    must re-prefill it (every draw is keyed to its position, not to what ran before)."""
    replies = []
    for i, drop_caches in enumerate((False, True)):
        session = f"seeded-{i}"
        other.Generate(request(PROMPTS[1], session_id=session, max_new=8, temperature=1.0, seed=3, ignore_eos=True))
        if drop_caches:
            for role, stub_cls, message in (
                ("target-0", target_pb2_grpc.TargetWorkerStub, target_pb2.TargetReleaseSessionRequest),
                ("draft", draft_pb2_grpc.DraftWorkerStub, draft_pb2.DraftReleaseSessionRequest),
            ):
                with grpc.insecure_channel(cluster_other.processes[role].address) as channel:
                    assert stub_cls(channel).ReleaseSession(message(session_id=session)).existed
        turn = request([1, 2], session_id=session, max_new=16, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
        replies.append(other.Generate(turn))
        other.CloseSession(coordinator_pb2.CloseSessionRequest(session_id=session))
    assert list(replies[0].token_ids) == list(replies[1].token_ids)
    assert replies[0].stats.cache_resyncs == 0 and replies[1].stats.cache_resyncs == 2


def _request_fields(descriptor, prefix: str = "") -> set[str]:  # type: ignore[no-untyped-def]
    """Every leaf field of a request message, by its proto path (TokenIds counts as one field)."""
    fields = set()
    for field in descriptor.fields:
        path = f"{prefix}{field.name}"
        message = field.message_type
        if message is not None and message.name in ("SamplingParams", "SpeculationParams"):
            fields |= _request_fields(message, f"{path}.")
        else:
            fields.add(path)
    return fields


def test_get_info_describes_the_server(same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels) -> None:
    info = same.GetInfo(coordinator_pb2.GetInfoRequest())
    assert info.server_version == "0.1.0"
    assert info.target_model_id == str(tiny_models.target) and info.draft_model_id == str(tiny_models.same)
    assert list(info.draft_methods) == ["model", "ngram", "hybrid"] and info.default_draft_method == "hybrid"
    assert info.lookup_max_tokens == 8
    assert info.draft_confidence == pytest.approx(CoordinatorSettings.model_fields["draft_confidence"].default)
    block_default = CoordinatorSettings.model_fields["draft_block_confidence"].default
    assert info.draft_block_confidence == pytest.approx(block_default)
    assert info.draft_block_confidence_from_costs  # adaptive K (sequential or pipelined)
    assert info.max_context_len == info.draft_max_context_len == 256 and info.vocab_size == 259
    assert list(info.eos_token_ids) == [257]
    assert info.max_speculative_tokens == 8 and info.default_speculative_tokens == 4
    assert info.max_new_tokens == 255 and info.default_max_new_tokens == 255  # 256 capped by the context
    assert info.max_message_bytes == 8 << 20 and info.max_concurrent_requests == 64
    assert info.max_prompt_chars == 1_000_000 and info.speculation_mode == "sequential" and info.adaptive_k
    assert info.greedy_temperature == pytest.approx(1e-5)
    # The features list is what the server honours: every request field, no more, no less.
    assert set(info.features) == _request_fields(coordinator_pb2.GenerateRequest.DESCRIPTOR)


def _stop_case(model_dir: str, prompt: tuple[int, ...]) -> tuple[list[int], str, int, str]:
    """The greedy reply, a 2-character ASCII stop string from its text, the number of tokens up to
    the one that completes it, and the text before it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = reference_greedy(model_dir, prompt, MAX_NEW, ignore_eos=True)

    def text(n: int) -> str:
        return tokenizer.decode(expected[:n], skip_special_tokens=True)

    full = text(len(expected))
    stop = next(
        full[i : i + 2] for i in range(4, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    cut = next(n for n in range(1, len(expected) + 1) if stop in text(n))
    return expected, stop, cut, full[: full.index(stop)]


def test_stop_strings_end_the_reply_inside_a_block(
    same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """The draft is the target, K = 8: the stop string is met inside an accepted block. Only the
    tokens up to it are committed (the next turn continues from exactly there), the text ends
    before it (or with it), and the stream never shows it."""
    prompt = tuple(PROMPTS[1])
    expected, stop, cut, before = _stop_case(str(tiny_models.target), prompt)
    req = request(list(prompt), k=8, session_id="stops", ignore_eos=True)
    req.sampling.stop.extend([stop, "never-there"])
    reply = same.Generate(req)
    assert list(reply.token_ids) == expected[:cut] and reply.text == before
    assert reply.finish_reason == coordinator_pb2.FINISH_REASON_STOP and reply.stop_string == stop
    assert reply.usage.completion_tokens == cut and reply.stats.draft_tokens_accepted > 0
    follow = same.Generate(request([7, 8], k=8, session_id="stops", max_new=8, ignore_eos=True))
    history = (*prompt, *expected[:cut], 7, 8)
    assert list(follow.token_ids) == reference_greedy(str(tiny_models.target), history, 8, ignore_eos=True)
    same.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="stops"))
    req = request(list(prompt), k=8, ignore_eos=True)
    req.sampling.stop.append(stop)
    req.sampling.include_stop_str_in_output = True
    assert same.Generate(req).text == before + stop
    shown = ""
    messages = list(same.GenerateStream(request(list(prompt), k=3, ignore_eos=True, stop=[stop])))
    for message in messages:
        shown += message.text
        assert before.startswith(shown)
    assert shown == before and messages[-1].stop_string == stop
    assert [t for m in messages for t in m.token_ids] == expected[:cut]


def test_a_stop_string_met_before_min_tokens_does_not_end_the_reply_later(
    same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """min_tokens 6 with a stop string of one character the reply has at its start and a long one
    it never has (which widens the window searched for each new token): the reply ends at the
    first token from the 6th on whose text completes the short one, as target-only decoding with
    that rule gives, and the text is cut there. Before, the reply ended at the 6th token, its text
    cut back to the occurrence before min_tokens (text the stream had already sent)."""
    prompt = tuple(PROMPTS[1])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.target))
    expected = reference_greedy(str(tiny_models.target), prompt, MAX_NEW, ignore_eos=True)
    texts = [tokenizer.decode(expected[:n], skip_special_tokens=True) for n in range(len(expected) + 1)]
    min_tokens = 6
    short = next(c for c in texts[min_tokens - 1] if c.isascii() and c.isprintable())
    stops = [short, "never-there-at-all"]

    def completed_by(n: int) -> int:  # where a `short` that token n completes starts, or -1
        return texts[n].find(short, len(texts[n - 1]) - len(short) + 1)

    cut = next((n for n in range(min_tokens, len(expected) + 1) if completed_by(n) >= 0), None)
    for k in (1, 8):
        req = request(list(prompt), k=k, ignore_eos=True, stop=stops, min_tokens=min_tokens)
        reply = same.Generate(req)
        streamed = list(same.GenerateStream(req))
        if cut is None:
            assert list(reply.token_ids) == expected and reply.text == texts[-1]
        else:
            assert list(reply.token_ids) == expected[:cut] and reply.stop_string == short
            assert reply.text == texts[cut][: completed_by(cut)]
        assert "".join(m.text for m in streamed) == reply.text
        assert [t for m in streamed for t in m.token_ids] == list(reply.token_ids)


def test_a_byte_fallback_reply_has_one_text_whatever_blocks_speculation_accepted(tmp_path: Path) -> None:
    """A Llama-2-style tokenizer (SentencePiece byte fallback) and a random model, which writes
    runs of byte tokens that are often not valid UTF-8, drafted by its own copy: the same greedy
    tokens in blocks of 1 and of 8 tokens, streamed and not, and with a stop string that never
    matches, give one text, the tokens' own (fed to the detokenizer one at a time). Before, a run
    that one round brought whole decoded to U+FFFD throughout while the same run split between
    rounds kept its characters: 5 of these 6 replies had two or three texts."""
    from coordinator.text import IncrementalDetokenizer

    tokenizer = build_byte_fallback_tokenizer()
    target = build_model(tmp_path / "bf", seed=3, hidden=64, layers=2, vocab=len(tokenizer), init_range=0.2,
                         tokenizer=tokenizer)  # fmt: skip
    with fault_cluster(tmp_path / "cluster", target, target) as cluster, grpc.insecure_channel(cluster.address) as ch:
        stub = coordinator_pb2_grpc.GenerationStub(ch)
        for seed in range(6):
            prompt = [(seed * 37 + j * 11) % 265 + 3 for j in range(5)]
            replies = set()
            for k, stream, stop in [(1, False, []), (8, False, []), (8, True, []), (1, True, ["\n\n\n"])]:
                req = request(prompt, k=k, max_new=48, ignore_eos=True, stop=stop)
                req.speculation.method = coordinator_pb2.DRAFT_METHOD_MODEL
                if stream:
                    messages = list(stub.GenerateStream(req))
                    ids, text = [t for m in messages for t in m.token_ids], "".join(m.text for m in messages)
                else:
                    reply = stub.Generate(req)
                    ids, text = list(reply.token_ids), reply.text
                replies.add((tuple(ids), text))
            assert len(replies) == 1, (seed, replies)
            ((ids, text),) = replies
            detok = IncrementalDetokenizer(tokenizer, prompt)
            assert text == "".join(detok.push([i]) for i in ids) + detok.flush()


def test_a_stop_token_is_reported(same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels) -> None:
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPTS[1]), MAX_NEW, ignore_eos=True)
    reply = same.Generate(request(PROMPTS[1], k=8, stop_token_ids=[expected[5]], ignore_eos=True))
    assert reply.WhichOneof("matched_stop") == "stop_token_id" and reply.stop_token_id == expected[5]
    assert list(reply.token_ids) == expected[: expected.index(expected[5]) + 1]


def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(
    same: coordinator_pb2_grpc.GenerationStub, tiny_models: TinyModels
) -> None:
    """A stop token that ends the reply stays in `token_ids`, but its text is left out of `text`
    unless `include_stop_str_in_output`, and is then not searched for stop strings (vLLM's rule, and
    what the gateway's OpenAI replies give). Before, the native `text` had the stop token's text,
    and a stop string that text completed ended the reply in its place."""
    prompt = tuple(PROMPTS[1])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.target))
    expected = reference_greedy(str(tiny_models.target), prompt, MAX_NEW, ignore_eos=True)
    texts = [tokenizer.decode(expected[:n], skip_special_tokens=True) for n in range(len(expected) + 1)]
    cut = next(n for n in range(6, len(expected) + 1) if texts[n][len(texts[n - 1]) :].strip())
    stop, own = expected[cut - 1], texts[cut][len(texts[cut - 1]) :]
    assert expected.index(stop) == cut - 1 and own not in texts[cut - 1], (expected, texts)
    for k in (1, 8):
        for include in (False, True):
            for stops in ([], [own]):
                req = request(list(prompt), k=k, ignore_eos=True, stop_token_ids=[stop], stop=stops)
                req.sampling.include_stop_str_in_output = include
                reply = same.Generate(req)
                streamed = list(same.GenerateStream(req))
                assert list(reply.token_ids) == expected[:cut]
                assert reply.text == (texts[cut] if include else texts[cut - 1])
                if include and stops:
                    assert reply.WhichOneof("matched_stop") == "stop_string" and reply.stop_string == own
                else:
                    assert reply.WhichOneof("matched_stop") == "stop_token_id" and reply.stop_token_id == stop
                assert "".join(m.text for m in streamed) == reply.text
                assert [t for m in streamed for t in m.token_ids] == list(reply.token_ids)


def test_special_tokens_kept_on_request_are_text_that_stop_strings_match(
    same: coordinator_pb2_grpc.GenerationStub,
) -> None:
    """`skip_special_tokens` false: a special token's text is part of `text` and of what stop
    strings match (vLLM's skip_special_tokens=false); unset, it is left out of both. A logit bias
    makes every token `<pad>` (the tiny tokenizer's special id 258), drafted in blocks of 8."""
    for k in (1, 8):
        req = request(PROMPTS[1], k=k, max_new=6, ignore_eos=True, stop=["<pad><pad><pad>"])
        req.sampling.logit_bias[258] = 100.0
        skipped = same.Generate(req)
        assert list(skipped.token_ids) == [258] * 6 and skipped.text == ""
        assert skipped.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
        req.sampling.skip_special_tokens = False
        kept = same.Generate(req)
        assert list(kept.token_ids) == [258] * 3 and kept.text == "" and kept.stop_string == "<pad><pad><pad>"
        req.sampling.include_stop_str_in_output = True
        streamed = list(same.GenerateStream(req))
        assert "".join(m.text for m in streamed) == "<pad><pad><pad>"
        req.sampling.ClearField("stop")
        assert same.Generate(req).text == "<pad>" * 6


@pytest.mark.parametrize(
    ("stops", "message"),
    [([""], "1 to 256 characters"), (["x" * 257], "1 to 256 characters"), (["s"] * 17, "at most 16")],
)
def test_bad_stop_strings_are_invalid(
    same: coordinator_pb2_grpc.GenerationStub, stops: list[str], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        same.Generate(request(PROMPTS[0], stop=stops))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_prefix_records_last_as_long_as_the_target_keeps_an_unused_cache(
    cluster_other: LocalCluster, other: coordinator_pb2_grpc.GenerationStub, redis_server: RedisServer
) -> None:
    """A record of where a prefix is cached (about 300 bytes of Redis per 16 tokens of every finished
    request) is kept as long as the target keeps a cache nobody uses (--session-idle-s, 900 s by
    default), not for the whole session TTL (3600 s): past that it could only point to a freed cache."""
    prompt = [(13 * i + 7) % 250 for i in range(48)]
    other.Generate(request(prompt, max_new=4, ignore_eos=True))
    client = redis.Redis(port=redis_server.port)
    try:
        lifetimes = [client.pttl(key) for key in client.scan_iter("specdec:prefix:*")]
    finally:
        client.close()
    assert lifetimes and all(0 < ms <= 900_000 for ms in lifetimes), max(lifetimes)
    assert max(lifetimes) > 890_000  # the newest records: the whole idle time
    assert target_info(cluster_other).cache_idle_s == 900


def test_another_coordinator_replica_finds_the_cached_prefix(
    cluster_other: LocalCluster, tmp_path: Path, tiny_models: TinyModels
) -> None:
    """The prefix index lives in Redis: a request on a second coordinator (same workers, same
    Redis) starts from the caches a request on the first one left."""
    prompt = [(11 * i + 5) % 250 for i in range(40)]
    with grpc.insecure_channel(cluster_other.address) as channel:
        coordinator_pb2_grpc.GenerationStub(channel).Generate(request(prompt, max_new=4, ignore_eos=True))
    first = cluster_other.processes["coordinator"]
    second = spawn("coordinator", first.args, tmp_path, name="coordinator-2")
    try:
        second.wait_ready(120)
        with grpc.insecure_channel(second.address) as channel:
            reply = coordinator_pb2_grpc.GenerationStub(channel).Generate(request(prompt, max_new=6, ignore_eos=True))
    finally:
        second.stop()
    assert reply.usage.cached_tokens == 32  # two whole blocks of the 40-token prompt
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(prompt), 6, ignore_eos=True)


def test_idle_connections_kept_alive_by_pings_stay_open(cluster_same: LocalCluster) -> None:
    """A client that keeps its idle connection alive with HTTP/2 pings, as the coordinator keeps
    its links to the workers (every 20 s) and many gRPC clients keep theirs: grpc's servers
    allow one ping in 5 minutes by default, so after the third ping the coordinator and the
    workers dropped the connection with GOAWAY "too_many_pings" (a probe with the coordinator's
    own 20 s: dropped after 60 s idle, and grpc wrote an ERROR line, not JSON, into the client's
    log). Pings 5 s apart or more are now allowed. Here, 6 s apart, on the coordinator's public
    port and on a worker's: the connections stay open (main: dropped after 18 s)."""
    from specdec.serving.server import channel_options
    from specdec.serving.settings import ServiceSettings

    options = [o for o in channel_options(ServiceSettings()) if o[0] != "grpc.keepalive_time_ms"]
    options.append(("grpc.keepalive_time_ms", 6_000))
    states: dict[str, list[grpc.ChannelConnectivity]] = {}
    channels = []
    try:
        for role in ("coordinator", "target-0"):
            channel = grpc.insecure_channel(cluster_same.processes[role].address, options=options)
            channels.append(channel)
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            channel.subscribe(states.setdefault(role, []).append)
        time.sleep(24)
    finally:
        for channel in channels:
            channel.close()
    assert states == {role: [grpc.ChannelConnectivity.READY] for role in ("coordinator", "target-0")}
