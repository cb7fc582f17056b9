"""Worker faults with real processes: kills, pauses, restarts, crashes inside the forward pass.

Pass criterion unless stated: the client's greedy output is token-identical to target-only greedy.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from specdec.runtime.grammar import grammar_of
from specdec.serving.server import INTERNAL_MESSAGE
from specdec.tools.launch import worker_info
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import fault_cluster, logged_events, metric, stream_with_fault, wait_for
from tests.helpers import RedisServer, stored_sessions
from tests.netproxy import LateLink, ProxyRoutes
from tests.reference import make_request, read_session, reference_greedy
from tests.spec_oracle import reference_grammar
from tests.tiny_models import TinyModels, build_crashy, build_model, build_tokenizer

PROMPT = [5, 17, 99, 3]
LONG = 120  # tokens: enough rounds to inject a fault in the middle
EOS = 257  # the byte tokenizer's </s>


def speculation_resumes(stub: coordinator_pb2_grpc.GenerationStub, timeout_s: float = 15) -> float:
    """Seconds until a request is speculative again."""
    return wait_for(
        lambda: stub.Generate(make_request(PROMPT, max_new=8)).stats.draft_tokens_proposed > 0, timeout_s, 0.2
    )


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_draft_lost_mid_stream_falls_back_then_resumes(
    fault: str, tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), LONG, ignore_eos=True)
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, route=routes(0.01)) as cluster:
        draft = cluster.processes["draft"]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            request = make_request(PROMPT, k=4, max_new=LONG, ignore_eos=True)
            tokens, last, gap = stream_with_fault(
                stub, request, lambda: os.kill(draft.proc.pid, getattr(signal, fault))
            )
            assert tokens == expected
            assert last.stats.target_only_rounds > 0 and last.stats.draft_tokens_proposed > 0
            assert gap < 1.0 + 0.5  # a hung draft costs at most --draft-timeout-s once
            if fault == "SIGKILL":
                draft.restart()
            else:
                os.kill(draft.proc.pid, signal.SIGCONT)
            resumed = speculation_resumes(stub)
    fault_report[f"draft {fault} mid-stream"] = {
        "identical_output": True,
        "client_errors": 0,
        "longest_stall_s": round(gap, 3),
        "speculation_resumed_after_s": round(resumed, 2),
    }


@pytest.mark.parametrize("role", ["draft", "target"])
def test_close_session_with_a_hung_worker_answers_at_once(
    role: str, tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """CloseSession while a worker is hung (SIGSTOP). The session is deleted from the state store
    first; freeing the workers' caches is best effort (they also free idle ones themselves). Main
    waited for each worker's ReleaseSession up to --worker-timeout-s (60 s): a client's CloseSession
    with a 10 s deadline got DEADLINE_EXCEEDED though the session was gone. Now the releases get the
    same 2 s a failed turn's clean-up gets."""
    with (
        fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(PROMPT, session_id="hung", max_new=6))
        process = cluster.processes["target-0" if role == "target" else role]
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            closed = stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="hung"), timeout=10)
            took = time.monotonic() - began
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
        assert closed.existed and took < 4, took
        assert not stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="hung"), timeout=10).existed
    fault_report[f"CloseSession with the {role} hung"] = {"answered_s": round(took, 2), "existed": True}


def test_draft_model_error_falls_back_to_target_only(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    crashy = build_crashy(tiny_models.target, tmp_path / "crashy-draft", crash_token_id=PROMPT[2])
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 24)
    with fault_cluster(tmp_path / "run", tiny_models.target, crashy, worker_args=["--trust-remote-code"]) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            reply = coordinator_pb2_grpc.GenerationStub(channel).Generate(make_request(PROMPT, max_new=24))
        assert list(reply.token_ids) == expected
        assert reply.stats.target_only_rounds == reply.stats.rounds
        draft = cluster.processes["draft"].proc
        exited = wait_for(lambda: draft.poll() is not None, 10)
        assert draft.returncode == 1
    fault_report["draft model error"] = {
        "identical_output": True,
        "client_errors": 0,
        "draft_exit_code": 1,
        "exited_after_s": round(exited, 2),
    }


def test_target_model_error_fails_fast_with_internal(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    crashy = build_crashy(tiny_models.target, tmp_path / "crashy-target", crash_token_id=PROMPT[2])
    with fault_cluster(tmp_path / "run", crashy, tiny_models.other, worker_args=["--trust-remote-code"]) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                coordinator_pb2_grpc.GenerationStub(channel).Generate(make_request(PROMPT), timeout=30)
            elapsed = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert err.value.details() == "the target worker failed while processing the request"
        assert elapsed < 2.0
        target = cluster.processes["target-0"].proc
        exited = wait_for(lambda: target.poll() is not None, 15)
        assert target.returncode == 1
        log = cluster.processes["target-0"].log_tail(400)
        assert "injected failure inside the forward pass" in log and INTERNAL_MESSAGE not in err.value.details()
    fault_report["target model error"] = {
        "client_code": "INTERNAL",
        "client_error_after_s": round(elapsed, 3),
        "target_exit_code": 1,
        "exited_after_s": round(exited, 2),
    }


def test_target_restarted_between_turns_is_reprefilled(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.other) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            turn1 = stub.Generate(make_request(PROMPT, session_id="s1", max_new=10, ignore_eos=True))
            cluster.processes["target-0"].restart()
            request = make_request([8, 9], session_id="s1", max_new=10, ignore_eos=True)
            turn2 = None
            for _ in range(50):  # the coordinator reconnects to the restarted worker within ~1 s
                try:
                    turn2 = stub.Generate(request)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    time.sleep(0.1)
            assert turn2 is not None
        history = (*PROMPT, *turn1.token_ids, 8, 9)
        assert list(turn2.token_ids) == reference_greedy(str(tiny_models.target), history, 10, ignore_eos=True)
        assert turn2.stats.cache_resyncs >= 1 and turn2.usage.cached_tokens == 0
    fault_report["target restarted between turns"] = {
        "identical_output": True,
        "cache_resyncs": turn2.stats.cache_resyncs,
    }


def test_session_moves_to_a_second_target_replica(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), LONG, ignore_eos=True)
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, targets=2, route=routes(0.01)) as cluster:
        replicas = [cluster.processes["target-0"], cluster.processes["target-1"]]

        def kill_session_replica() -> None:
            holder = next(r for r in replicas if worker_info(r.address, "target").active_sessions > 0)
            holder.proc.kill()

        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            tokens, _, gap = stream_with_fault(
                stub, make_request(PROMPT, max_new=LONG, ignore_eos=True), kill_session_replica
            )
        assert tokens == expected
        assert metric(cluster, "coordinator", "specdec_target_failovers_total") >= 1
        assert sum(r.proc.poll() is None for r in replicas) == 1
    fault_report["target replica killed mid-stream (2 replicas)"] = {
        "identical_output": True,
        "client_errors": 0,
        "longest_stall_s": round(gap, 3),
    }


def test_a_constrained_reply_moved_to_a_second_target_replica_stays_exact(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes]
) -> None:
    """Structured output under a failover: the replica that takes the session over mid-reply has
    no matcher for it and rebuilds the grammar's state from the reply so far; the reply equals
    target-only greedy decoding with the constraint's mask at every step."""
    constraint = common_pb2.StructuredOutput(regex=r"[a-c]{60,90}-[0-9]{1,3}")
    target = str(tiny_models.target)
    mask = reference_grammar(grammar_of(constraint), target, len(build_tokenizer()), [EOS], len(PROMPT))
    expected = reference_greedy(target, tuple(PROMPT), LONG, mask=mask)
    assert expected[-1] == EOS  # the constraint, not max_new_tokens, ends it
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, targets=2, route=routes(0.01)) as cluster:
        replicas = [cluster.processes["target-0"], cluster.processes["target-1"]]

        def kill_session_replica() -> None:
            next(r for r in replicas if worker_info(r.address, "target").active_sessions > 0).proc.kill()

        request = make_request(PROMPT, max_new=LONG)
        request.sampling.structured_output.CopyFrom(constraint)
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            tokens, last, _ = stream_with_fault(stub, request, kill_session_replica)
        assert tokens == expected and last.finish_reason == coordinator_pb2.FINISH_REASON_STOP
        assert metric(cluster, "coordinator", "specdec_target_failovers_total") >= 1


def test_constrained_sessions_are_verified_only_where_grammars_apply(tmp_path: Path, tiny_models: TinyModels) -> None:
    """Target replicas that differ in structured output (one started with --no-structured-output;
    in a rolling upgrade, a replica of a version without it): constrained sessions are placed and
    verified only on replicas that apply grammars, while other sessions still use every replica.
    Main placed constrained sessions on either replica and those on the other one failed."""
    constraint = common_pb2.StructuredOutput(regex=r"[a-c]{5,12}-[0-9]{1,3}")
    target = str(tiny_models.target)
    mask = reference_grammar(grammar_of(constraint), target, len(build_tokenizer()), [EOS], len(PROMPT))
    expected = reference_greedy(target, tuple(PROMPT), 40, mask=mask)
    assert expected[-1] == EOS
    no_grammars = {"target-1": ["--no-structured-output"]}
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, targets=2, replica_args=no_grammars) as cluster:
        applies, refuses = (cluster.processes[f"target-{i}"].address for i in range(2))
        assert worker_info(applies, "target").structured_output and not worker_info(refuses, "target").structured_output
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            assert "sampling.structured_output" in stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10).features
            for i in range(8):
                assert list(stub.Generate(_constrained(f"json-{i}", constraint), timeout=60).token_ids) == expected
            assert [worker_info(a, "target").active_sessions for a in (applies, refuses)] == [8, 0]
            _free_sessions_reach(stub, refuses)  # unconstrained sessions still go there
        assert metric(cluster, "coordinator", "specdec_target_failovers_total") == 0


def _constrained(session_id: str, constraint: common_pb2.StructuredOutput) -> coordinator_pb2.GenerateRequest:
    request = make_request(PROMPT, max_new=40, session_id=session_id)
    request.sampling.structured_output.CopyFrom(constraint)
    return request


def _free_sessions_reach(stub: coordinator_pb2_grpc.GenerationStub, address: str) -> None:
    """Starts unconstrained sessions (placed by rendezvous hash) until one is cached on the target
    replica at ``address``; 32 without one would mean the replica is left out (a chance of 2^-32)."""
    for i in range(32):
        stub.Generate(make_request(PROMPT, max_new=4, session_id=f"free-{i}", ignore_eos=True), timeout=60)
        if worker_info(address, "target").active_sessions:
            return
    raise AssertionError(f"no unconstrained session of 32 was placed on {address}")


def test_a_target_replica_restarted_without_grammars_hands_constrained_sessions_on(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    """A replica whose Info said it applies grammars restarts without them (the coordinator reads
    Info again only every --target-info-refresh-s): its refusal of a constrained step moves that
    session to a replica that applies them, within the turn, without a failover or an error and
    without taking the replica out for other sessions."""
    constraint = common_pb2.StructuredOutput(regex=r"[a-c]{5,12}-[0-9]{1,3}")
    target = str(tiny_models.target)
    mask = reference_grammar(grammar_of(constraint), target, len(build_tokenizer()), [EOS], len(PROMPT))
    expected = reference_greedy(target, tuple(PROMPT), 40, mask=mask)
    late = ["--target-info-refresh-s", "600"]  # the coordinator learns of the restart from the refusal alone
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, targets=2, coordinator_args=late) as cluster:
        restarted = cluster.processes["target-1"]
        restarted.args = [*restarted.args, "--no-structured-output"]
        restarted.restart()
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)

            def refusals() -> list[str]:
                events = logged_events(cluster.processes["coordinator"])
                return [e["address"] for e in events if e["event"] == "target_applies_no_grammars"]

            first = None  # placed by rendezvous hash: until one lands on the restarted replica, then 8 more
            for i in range(48):
                assert list(stub.Generate(_constrained(f"json-{i}", constraint), timeout=60).token_ids) == expected
                first = i if first is None and refusals() else first
                if first is not None and i >= first + 8:
                    break
            assert refusals() == [restarted.address]  # once: then it was left out
            assert worker_info(restarted.address, "target").active_sessions == 0
            _free_sessions_reach(stub, restarted.address)  # it still serves the others
        assert metric(cluster, "coordinator", "specdec_target_failovers_total") == 0


def test_structured_output_is_offered_while_a_target_replica_applies_grammars(
    tmp_path: Path, tiny_models: TinyModels
) -> None:
    """GetInfo and request checks follow the target replicas' Info as it is read again
    (--target-info-refresh-s): a replica restarted with grammars turned on offers structured output
    without a coordinator restart (main decided once, from the first replica's Info at start-up),
    and one restarted with them turned off withdraws it: constrained requests are refused up front
    with the reason instead of failing on the worker."""
    constraint = common_pb2.StructuredOutput(regex=r"[a-c]{5,12}-[0-9]{1,3}")
    target = str(tiny_models.target)
    mask = reference_grammar(grammar_of(constraint), target, len(build_tokenizer()), [EOS], len(PROMPT))
    expected = reference_greedy(target, tuple(PROMPT), 40, mask=mask)
    off = {"target-0": ["--no-structured-output"]}
    refresh = ["--target-info-refresh-s", "0.5"]
    with fault_cluster(
        tmp_path, tiny_models.target, tiny_models.noisy, replica_args=off, coordinator_args=refresh
    ) as cluster:
        replica = cluster.processes["target-0"]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)

            def offered() -> bool:
                features = stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10).features
                return "sampling.structured_output" in features

            def refused() -> None:
                with pytest.raises(grpc.RpcError) as error:
                    stub.Generate(_constrained("json", constraint), timeout=60)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "needs target workers that apply grammars" in (error.value.details() or "")

            assert not offered()
            refused()
            replica.args = [a for a in replica.args if a != "--no-structured-output"]
            replica.restart()
            wait_for(offered, 30)
            assert list(stub.Generate(_constrained("json", constraint), timeout=60).token_ids) == expected
            replica.args = [*replica.args, "--no-structured-output"]
            replica.restart()
            wait_for(lambda: not offered(), 30)
            refused()


def test_a_target_replica_that_takes_shorter_blocks_gets_them_cut(tmp_path: Path, tiny_models: TinyModels) -> None:
    """Target replicas whose --max-draft-tokens differ (a configuration rolled out one replica at a
    time): a block longer than a replica takes is cut to its first tokens there (a shorter
    proposal, verified exactly), whichever replica served first at start-up. Main sized blocks by
    the first replica that served, and a session on the other one failed on its first round
    (INTERNAL: the worker refused the block)."""
    short = {"target-1": ["--max-draft-tokens", "2"]}
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.same, targets=2, replica_args=short) as cluster:
        addresses = [cluster.processes[f"target-{i}"].address for i in range(2)]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            assert stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10).max_speculative_tokens == 8
            for i in range(32):  # placed by rendezvous hash: at least 8, until both replicas verified some
                prompt = [5 + i, 17, 99, 3 + i]
                expected = reference_greedy(str(tiny_models.target), tuple(prompt), 16, ignore_eos=True)
                request = make_request(prompt, k=6, max_new=16, session_id=f"s{i}", ignore_eos=True)
                assert list(stub.Generate(request, timeout=60).token_ids) == expected, prompt
                if i >= 7 and all(worker_info(a, "target").active_sessions for a in addresses):
                    break
        assert all(worker_info(a, "target").active_sessions for a in addresses)  # both replicas verified sessions
        assert metric(cluster, "coordinator", "specdec_target_failovers_total") == 0


def test_sessions_are_spread_over_draft_replicas_and_move_when_one_fails(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Two draft replicas (--draft-addresses). Main took one draft address: behind a Service, each
    coordinator drafted with whichever pod its one connection reached, so replicas shared the load
    only as the connections fell. Now each session drafts on one replica, chosen by rendezvous hash
    as for targets (every coordinator picks the same one) and kept while it serves, so its draft
    cache is reused turn after turn; when that replica fails, the session moves to the other one
    within the turn (its draft cache rebuilt there) instead of decoding target-only."""
    sessions = [f"s{i}" for i in range(16)]
    prompts = {s: [5 + i, 17, 99, 3 + i] for i, s in enumerate(sessions)}
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.same, drafts=2) as cluster:
        drafts = [cluster.processes["draft"], cluster.processes["draft-1"]]
        histories = {s: list(p) for s, p in prompts.items()}
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)

            def turn(session: str, prompt: list[int]) -> coordinator_pb2.GenerateResponse:
                reply = stub.Generate(make_request(prompt, session_id=session, max_new=8, ignore_eos=True), timeout=60)
                histories[session] += [*prompt[len(histories[session]) :], *reply.token_ids]
                return reply

            first = {s: turn(s, p) for s, p in prompts.items()}
            held = [worker_info(d.address, "draft").active_sessions for d in drafts]
            second = {}
            for s in sessions:
                expected = reference_greedy(str(tiny_models.target), (*histories[s], 8, 9), 8, ignore_eos=True)
                histories[s] += [8, 9]
                second[s] = turn(s, [8, 9])
                assert list(second[s].token_ids) == expected
            still = [worker_info(d.address, "draft").active_sessions for d in drafts]
            busiest = drafts[held.index(max(held))]
            busiest.proc.kill()
            busiest.proc.wait()
            third = {}
            for s in sessions:
                expected = reference_greedy(str(tiny_models.target), (*histories[s], 7), 8, ignore_eos=True)
                histories[s] += [7]
                third[s] = turn(s, [7])
                assert list(third[s].token_ids) == expected
            survivor = next(d for d in drafts if d is not busiest)
            moved = worker_info(survivor.address, "draft").active_sessions
            assert metric(cluster, "coordinator", "specdec_replica_turns") == 0  # every turn left its replicas
    for s in sessions:
        expected = reference_greedy(str(tiny_models.target), tuple(prompts[s]), 8, ignore_eos=True)
        assert list(first[s].token_ids) == expected
    assert all(h > 0 for h in held) and sum(held) == len(sessions), f"sessions per draft replica: {held}"
    # the second turns drafted on the replica holding the session's cache (a move would cache it on both)
    assert still == held, f"sessions per draft replica after the first turns {held}, the second {still}"
    assert all(r.stats.draft_tokens_accepted > 0 for r in second.values())
    # after the kill, every session drafted with the surviving replica within its turn
    assert moved == len(sessions)
    assert all(r.stats.draft_tokens_proposed > r.stats.lookup_tokens_proposed for r in third.values())
    fault_report["a draft replica killed between turns (2 replicas)"] = {
        "sessions_per_replica": held,
        "identical_output": True,
        "sessions_drafted_after_the_kill": len(sessions),
    }


def test_requests_sharing_a_prompt_prefix_are_spread_over_the_replicas(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """One-shot requests that share a long prompt prefix (a system prompt, a chat template's
    preamble: what nearly every request through a gateway has), sent concurrently to 2 target and
    2 draft replicas. Main sent every request that found the prefix cached to the replicas holding
    it, so the replica that cached it first got all such traffic and the others none. Now a request
    starts from a cached prefix only on a replica that is not clearly busier than the least busy
    one (as SGLang's cache-aware router balances), and each replica keeps its own record of the
    prefixes it holds, so the prefix soon is cached on every replica and reused there."""
    from concurrent.futures import ThreadPoolExecutor

    shared = [(7 * i) % 250 + 3 for i in range(48)]  # three 16-token blocks
    prompts = [[*shared, 5 + i, 17, 99, 3 + i] for i in range(32)]
    expected = [reference_greedy(str(tiny_models.target), tuple(p), 8, ignore_eos=True) for p in prompts]
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.same, targets=2, drafts=2) as cluster:
        targets = [cluster.processes["target-0"], cluster.processes["target-1"]]
        drafts = [cluster.processes["draft"], cluster.processes["draft-1"]]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)

            def generate(prompt: list[int]) -> coordinator_pb2.GenerateResponse:
                return stub.Generate(make_request(prompt, max_new=8, ignore_eos=True), timeout=120)

            generate([*shared, 1, 2])  # caches and records the prefix on one target replica
            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(generate, prompts))
            stream = stub.GenerateStream(make_request([*shared, 9, 9], max_new=64, ignore_eos=True), timeout=60)
            next(stream)
            stream.cancel()  # a turn cancelled mid-way leaves its replicas too
            wait_for(lambda: metric(cluster, "coordinator", "specdec_active_requests") == 0, 10)
            left = metric(cluster, "coordinator", "specdec_replica_turns")
        served = [worker_info(t.address, "target").active_sessions for t in targets]  # the cancelled turn's freed
        drafted = [worker_info(d.address, "draft").active_sessions for d in drafts]
        assert left == 0, f"{left} turns still counted on the replicas once every turn had ended"
    assert [list(r.token_ids) for r in replies] == expected
    assert sum(r.usage.cached_tokens > 0 for r in replies) >= len(prompts) // 2  # the prefix is still reused
    assert min(served) >= len(prompts) // 4, f"one-shot requests per target replica: {served}"
    assert min(drafted) >= len(prompts) // 4, f"one-shot requests per draft replica: {drafted}"
    fault_report["requests sharing a prompt prefix (2 target, 2 draft replicas)"] = {
        "requests_per_target_replica": served,
        "requests_per_draft_replica": drafted,
        "requests_reusing_a_cached_prefix": sum(r.usage.cached_tokens > 0 for r in replies),
        "identical_output": True,
    }


START_UP_FAILURES = {
    "coordinator": (["--target-addresses", "127.0.0.1:1", "--worker-startup-timeout-s", "1"], "--target-addresses"),
    "target": (["--model", "/nonexistent/model", "--device", "cpu"], "no such directory"),
    "draft": (["--model", "/nonexistent/model", "--device", "cuda:7"], "use --device cpu"),
}


@pytest.mark.parametrize("role", list(START_UP_FAILURES))
def test_a_start_up_that_cannot_go_on_says_why_and_what_to_do_without_a_traceback(role: str, tmp_path: Path) -> None:
    """No target worker serving within --worker-startup-timeout-s (a wrong address, workers that
    never came up), a model directory that is not there, a device the host lacks: start-up ends,
    as it must, but main logged `startup_failed` with a Python traceback into the operator's log
    (and for the coordinator "no target worker is serving: ADDRESS", nothing to do said), for
    conditions the message explains. Now: the message says what to check or change, and no
    traceback (tracebacks stay for failures nobody explained)."""
    from specdec.tools.launch import spawn

    args, advice = START_UP_FAILURES[role]
    service = spawn(role, args, tmp_path)
    assert service.proc.wait(timeout=60) == 1
    events = logged_events(service)
    (failed,) = [e for e in events if e["event"] == "startup_failed"]
    assert "exception" not in failed, failed["exception"]
    assert advice in failed["error"]


def test_a_target_replica_down_at_start_up_does_not_hold_the_coordinator_back(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Two replicas, the second unreachable when the coordinator starts (a node lost, a model still
    loading). Main waited for every replica up to --worker-startup-timeout-s (600 s by default)
    before serving at all, though one served. Now the coordinator serves once one replica does; the
    other is not used while it is not serving and joins when it comes up."""
    link = LateLink("target-1")

    def joined(log: str) -> bool:
        return any("target_joined" in line and link.address in line for line in log.splitlines())

    prompts = [[5 + i, 17, 99, 3 + i] for i in range(12)]
    expected = [reference_greedy(str(tiny_models.target), tuple(p), 6) for p in prompts]
    began = time.monotonic()
    flags = ["--worker-startup-timeout-s", "60"]
    with (
        link,
        fault_cluster(tmp_path, tiny_models.target, None, targets=2, route=link, coordinator_args=flags) as cluster,
    ):
        started = time.monotonic() - began
        assert started < 40, f"the coordinator took {started:.0f} s to serve with one replica up"
        late = cluster.processes["target-1"]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            replies = [list(stub.Generate(make_request(p, max_new=6), timeout=60).token_ids) for p in prompts]
            assert replies == expected
            assert metric(cluster, "coordinator", "specdec_target_failovers_total") == 0
            link.come_up()
            wait_for(lambda: joined(cluster.processes["coordinator"].log_tail(200)), 30, 0.2)
            again = [list(stub.Generate(make_request(p, max_new=6), timeout=60).token_ids) for p in prompts]
            assert again == expected
            assert worker_info(late.address, "target").prefill_tokens_total > 0
    fault_report["a target replica down at start-up (2 replicas)"] = {
        "coordinator_ready_s": round(started, 1),
        "identical_output": True,
        "late_replica_used_once_up": True,
    }


def test_a_draft_down_at_start_up_joins_when_it_serves(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """The draft unreachable when the coordinator starts (its CPU node still coming up). Main waited
    for it up to --worker-startup-timeout-s and then ended start-up: the whole service down for a
    missing optimisation, against the failure model (a draft that is down means target-only). Now
    the coordinator waits at most --draft-startup-wait-s (10 s by default; 2 here) for it, serves
    without it (lookup drafts, as a coordinator with no draft), and takes it on when it serves:
    GetInfo names it, and requests are drafted by it."""

    def joined(log: str) -> bool:
        return any("draft_joined" in line for line in log.splitlines())

    prompts = [[5 + i, 17, 99, 3 + i] for i in range(6)]
    expected = [reference_greedy(str(tiny_models.target), tuple(p), 8, ignore_eos=True) for p in prompts]
    flags = ["--worker-startup-timeout-s", "60", "--draft-startup-wait-s", "2"]
    began = time.monotonic()
    with (
        LateLink("draft") as link,
        fault_cluster(tmp_path, tiny_models.target, tiny_models.same, route=link, coordinator_args=flags) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        started = time.monotonic() - began
        assert started < 40, f"the coordinator took {started:.0f} s to serve without its draft"
        events = logged_events(cluster.processes["coordinator"])
        at = {e["event"]: datetime.fromisoformat(e["timestamp"]) for e in events}
        waited = (at["coordinator_ready"] - at["server_started"]).total_seconds()
        assert 2 <= waited < 8, f"start-up waited {waited:.1f} s for the draft with --draft-startup-wait-s 2"
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        assert stub.GetInfo(coordinator_pb2.GetInfoRequest()).draft_model_id == ""
        before = [stub.Generate(make_request(p, max_new=8, fixed=False, ignore_eos=True)) for p in prompts]
        assert [list(r.token_ids) for r in before] == expected
        assert all(r.stats.draft_tokens_proposed == r.stats.lookup_tokens_proposed for r in before)
        turn1 = stub.Generate(make_request(PROMPT, session_id="across", max_new=8, ignore_eos=True))
        link.come_up()
        wait_for(lambda: joined(cluster.processes["coordinator"].log_tail(200)), 30, 0.2)
        assert stub.GetInfo(coordinator_pb2.GetInfoRequest()).draft_model_id
        after = [stub.Generate(make_request(p, max_new=8, ignore_eos=True)) for p in prompts]
        assert [list(r.token_ids) for r in after] == expected
        # a session begun without the draft goes on with it (the draft computes its history)
        turn2 = stub.Generate(make_request([8, 9], session_id="across", max_new=8, ignore_eos=True))
        history = (*PROMPT, *turn1.token_ids, 8, 9)
        assert list(turn2.token_ids) == reference_greedy(str(tiny_models.target), history, 8, ignore_eos=True)
        assert turn2.stats.draft_tokens_proposed > turn2.stats.lookup_tokens_proposed
        modelled = sum(r.stats.draft_tokens_proposed - r.stats.lookup_tokens_proposed for r in after)
        assert modelled > 0
    fault_report["the draft down at start-up"] = {
        "coordinator_ready_s": round(started, 1),
        "identical_output": True,
        "model_draft_tokens_once_up": modelled,
    }


def test_a_draft_whose_info_fails_at_start_up_does_not_end_it(tmp_path: Path, tiny_models: TinyModels) -> None:
    """The draft's address answers health checks SERVING but its Info call fails (the draft died
    between the two, or the address leads to another gRPC service for now). Main ended start-up
    with the Info call's error, so the whole service crash-looped on its draft; now the
    coordinator serves without it, as with a draft that does not answer at all, and takes it on
    when its Info answers."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    decoy = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # health only: Info is UNIMPLEMENTED
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, decoy)
    port = decoy.add_insecure_port("127.0.0.1:0")
    decoy.start()
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    try:
        with (
            LateLink("draft", first=f"127.0.0.1:{port}") as link,
            fault_cluster(tmp_path, tiny_models.target, tiny_models.same, route=link) as cluster,
            grpc.insecure_channel(cluster.address) as channel,
        ):
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            assert stub.GetInfo(coordinator_pb2.GetInfoRequest()).draft_model_id == ""
            reply = stub.Generate(make_request(PROMPT, max_new=8, ignore_eos=True))
            assert list(reply.token_ids) == expected
            log = cluster.processes["coordinator"].log_tail(200)
            assert "draft_not_ready" in log and "UNIMPLEMENTED" in log
            link.come_up()
            wait_for(lambda: "draft_joined" in cluster.processes["coordinator"].log_tail(200), 30, 0.2)
            reply = stub.Generate(make_request(PROMPT, max_new=8, ignore_eos=True))
            assert list(reply.token_ids) == expected
            assert reply.stats.draft_tokens_proposed > reply.stats.lookup_tokens_proposed
    finally:
        decoy.stop(None)


def test_start_up_goes_on_once_one_draft_replica_drafts(tmp_path: Path, tiny_models: TinyModels) -> None:
    """With several draft replicas, one that does not serve at start-up joins when it does, like a
    lone draft that was late; start-up no longer waits the whole 10 s for it once another replica
    drafts for the target (main: `coordinator_ready` 10 s after the target had joined)."""
    from datetime import datetime

    with (
        LateLink("draft-1") as link,
        fault_cluster(tmp_path, tiny_models.target, tiny_models.same, drafts=2, route=link) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        coordinator = cluster.processes["coordinator"]
        events: dict[str, datetime] = {}
        for event in logged_events(coordinator):
            events.setdefault(event["event"], datetime.fromisoformat(event["timestamp"]))
        waited = (events["coordinator_ready"] - events["target_joined"]).total_seconds()
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        reply = stub.Generate(make_request(PROMPT, max_new=8, ignore_eos=True, session_id="s"))
        link.come_up()
        wait_for(lambda: "draft_joined" in coordinator.log_tail(200), 30, 0.2)
    assert waited < 5, f"start-up waited {waited:.1f} s for a draft replica that was down"
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    assert reply.stats.draft_tokens_proposed > reply.stats.lookup_tokens_proposed  # the replica up drafted


def _other_vocabulary_model(path: Path) -> Path:
    """A random model whose tokenizer has one more token than the tiny models' (another hash)."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    return build_model(path, seed=9, hidden=32, layers=1, vocab=len(tokenizer), tokenizer=tokenizer)


def test_a_target_replica_that_comes_back_with_another_model_is_not_used(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Replica 1 is restarted on its port with a model of another vocabulary (a rollout gone wrong,
    or a replica down when the coordinator started and checked the others). Main only compared the
    replicas that answered at start-up, so about half the requests were verified by the other model:
    ids beyond the vocabulary, with OK. Now every verify names the vocabulary the coordinator
    serves, the replica refuses it before computing anything, and the requests go to replica 0;
    once replica 1 serves the right model again it is used again."""
    other = _other_vocabulary_model(tmp_path / "other-vocabulary")
    prompts = [[5 + i, 17, 99, 3 + i] for i in range(12)]
    expected = [reference_greedy(str(tiny_models.target), tuple(p), 6) for p in prompts]
    with fault_cluster(tmp_path / "run", tiny_models.target, None, targets=2) as cluster:
        replica = cluster.processes["target-1"]
        right_args = list(replica.args)
        replica.args = ["--model", str(other), *right_args[2:]]
        replica.restart()
        time.sleep(1.5)  # past --target-retry-s: the coordinator may try the replica again
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            ids = [(("x-request-id", f"vocab-{i}"),) for i in range(len(prompts))]
            replies = [
                list(stub.Generate(make_request(p, max_new=6), timeout=60, metadata=ids[i]).token_ids)
                for i, p in enumerate(prompts)
            ]
            assert replies == expected
            assert worker_info(replica.address, "target").prefill_tokens_total == 0
            refused = metric(cluster, "coordinator", "specdec_target_failovers_total")
            assert refused >= 1
            # the replica's refusals name the requests they came in (the coordinator forwards the ids)
            refusals = [e for e in logged_events(replica) if e["event"] == "rpc_failed" and e["rpc"] == "Verify"]
            assert refusals and {e.get("request_id") for e in refusals} <= {v for ((_, v),) in ids}
            replica.args = right_args
            replica.restart()
            time.sleep(1.5)
            again = [list(stub.Generate(make_request(p, max_new=6), timeout=60).token_ids) for p in prompts]
            assert again == expected
            assert worker_info(replica.address, "target").prefill_tokens_total > 0
    fault_report["target replica back with another model"] = {"identical_output": True, "refused_verifies": refused}


def test_a_draft_that_comes_back_with_another_model_is_not_used(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """The draft is restarted on its port with a model of another tokenizer (a rollout gone wrong).
    Main checked the draft's tokenizer only at start-up, so the draft went on drafting with ids of
    its own tokenizer: no error anywhere, its compute spent on blocks the target rejected. Now every
    proposal request names the tokenizer the coordinator serves and the draft refuses it before
    computing anything (FAILED_PRECONDITION); the coordinator logs `draft_serves_another_model`
    and decodes target-only (identical output) until the draft serves the right model again."""
    other = _other_vocabulary_model(tmp_path / "other-vocabulary")
    prompts = [[5 + i, 17, 99, 3 + i] for i in range(6)]
    expected = [reference_greedy(str(tiny_models.target), tuple(p), 6) for p in prompts]
    with fault_cluster(tmp_path / "run", tiny_models.target, tiny_models.same) as cluster:
        draft = cluster.processes["draft"]
        right_args = list(draft.args)
        draft.args = ["--model", str(other), *right_args[2:]]
        draft.restart()
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            stub.Generate(make_request([9, 8, 7], max_new=2), timeout=60)  # finds the old draft gone
            time.sleep(1.5)  # past --draft-retry-s: the coordinator tries the draft again
            ids = [(("x-request-id", f"draft-{i}"),) for i in range(len(prompts))]
            replies = [
                stub.Generate(make_request(p, max_new=6), timeout=60, metadata=ids[i]) for i, p in enumerate(prompts)
            ]
            computed = worker_info(draft.address, "draft").prefill_tokens_total
            # the draft's refusals name the requests whose streams they ended (the coordinator forwards the ids)
            refusals = [e for e in logged_events(draft) if e["event"] == "rpc_failed" and e["rpc"] == "Propose"]
            named = [e.get("request_id") for e in refusals]
            assert None not in named and {v for ((_, v),) in ids} & set(named), named
            draft.args = right_args
            draft.restart()
            stub.Generate(make_request([9, 8, 7], max_new=2), timeout=60)
            time.sleep(1.5)
            again = [stub.Generate(make_request(p, max_new=6), timeout=60) for p in prompts]
        log = cluster.processes["coordinator"].log_file.read_text()
    assert [list(r.token_ids) for r in replies] == expected
    assert [list(r.token_ids) for r in again] == expected
    assert computed == 0, f"the draft of another tokenizer computed {computed} tokens"
    assert '"draft_serves_another_model"' in log
    assert sum(r.stats.draft_tokens_proposed for r in again) > 0
    fault_report["draft back with another model"] = {"identical_output": True, "draft_tokens_computed": computed}


def test_only_target_down_is_unavailable_within_a_second_and_leaves_no_state(
    tmp_path: Path, tiny_models: TinyModels, redis_server: RedisServer, fault_report: dict
) -> None:
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.other, state_url=redis_server.url) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            turn1 = stub.Generate(make_request(PROMPT, session_id="down-1", max_new=6, ignore_eos=True))
            cluster.processes["target-0"].proc.kill()
            cluster.processes["target-0"].proc.wait()
            timings = []
            for request in (make_request([1, 2], session_id="down-1", max_new=6), make_request([1, 2], max_new=6)):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    stub.Generate(request, timeout=30)
                timings.append(time.monotonic() - started)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert err.value.details() == "the target worker is unavailable; retry later"
        assert max(timings) < 1.0
        record = read_session(redis_server.url, "down-1")
        assert record.tokens == [*PROMPT, *turn1.token_ids]  # the failed turn was rolled back
        assert record.owner == ""  # and its lease released
        assert "down-1" in stored_sessions(redis_server.url)
        assert not stored_sessions(redis_server.url, "oneshot-*")  # the failed one-shot left nothing
    fault_report["only target down"] = {
        "client_code": "UNAVAILABLE",
        "worst_latency_s": round(max(timings), 3),
        "orphaned_state": "none",
    }


@pytest.mark.parametrize("draft_name", ["adversarial", "other", "noisy"])
def test_adversarial_drafts_keep_output_and_cache_lengths(
    draft_name: str, tmp_path: Path, tiny_models: TinyModels, redis_server: RedisServer, fault_report: dict
) -> None:
    """Always wrong / random / sometimes right drafts: identical output, accepted <= proposed, and
    the caches the workers report after each rollback never run past the committed tokens."""
    prompt, session = [200, 1, 42, 42, 7], f"adv-{draft_name}"
    expected = reference_greedy(str(tiny_models.target), tuple(prompt), 40, ignore_eos=True)
    with (
        fault_cluster(
            tmp_path, tiny_models.target, getattr(tiny_models, draft_name), state_url=redis_server.url
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        reply = stub.Generate(make_request(prompt, k=6, max_new=40, session_id=session, ignore_eos=True))
    assert list(reply.token_ids) == expected
    stats = reply.stats
    assert stats.draft_tokens_accepted <= stats.draft_tokens_proposed
    record = read_session(redis_server.url, session)
    committed = len(prompt) + 40
    assert len(record.tokens) == committed
    assert record.target is not None and record.target.length == committed - 1  # all but the last token
    assert record.draft is not None and record.draft.length <= committed - 1
    if draft_name == "adversarial":
        assert stats.draft_tokens_accepted == 0
    if draft_name == "noisy":
        assert 0.1 < stats.acceptance_rate < 0.9  # right some of the time
    fault_report[f"{draft_name} draft"] = {
        "identical_output": True,
        "acceptance_rate": round(stats.acceptance_rate, 3),
        "target_cache_len": record.target.length,
        "committed": committed,
    }


def test_a_reply_over_the_message_limit_is_that_requests_error(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Prompt logprobs can make the target's reply larger than the coordinator accepts
    (--max-message-bytes, here 20,000 bytes: a 150-token prompt at top 20 is about 35,000). That is
    the request's own limit, not a replica fault: RESOURCE_EXHAUSTED saying what to change, no
    replica marked down, no session moved. Before, the coordinator took it for the replica being
    unavailable: it marked the replicas down (four failovers, the prompt scored four times) and
    answered UNAVAILABLE, "retry later", which would fail again."""
    args = ["--max-message-bytes", "20000"]
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, targets=2, coordinator_args=args) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            history = [*PROMPT, 7, 8]
            stub.Generate(make_request(history, max_new=4, session_id="bystander", ignore_eos=True), timeout=30)
            prompt = [5 + i % 50 for i in range(150)]
            big = make_request(prompt, max_new=4, ignore_eos=True, prompt_logprobs=20)
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(big, timeout=30)
            small = stub.Generate(make_request(prompt, max_new=4, ignore_eos=True, prompt_logprobs=1), timeout=30)
            after = stub.Generate(make_request([9], max_new=4, session_id="bystander", ignore_eos=True), timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-message-bytes" in (error.value.details() or "")
        assert "prompt_logprobs" in (error.value.details() or "")
        assert len(small.prompt_logprobs) == len(prompt)  # a smaller ask of the same prompt is served
        assert metric(cluster, "coordinator", "specdec_target_failovers_total") == 0
        assert after.stats.cache_resyncs == 0 and after.usage.cached_tokens > 0
    fault_report["a reply over the coordinator's message limit"] = {"details": error.value.details(), "failovers": 0}


@pytest.mark.alone
def test_a_long_prefill_is_not_taken_for_a_hung_worker(tmp_path: Path, fault_report: dict) -> None:
    """--worker-timeout-s / --draft-timeout-s bound a call to a hung worker. A call that must first
    compute a long prompt gets, on top, 4x the time the worker's measured prefill rate says those
    tokens take. Before: a prompt whose target prefill outlasted the timeout failed UNAVAILABLE
    "retry later" on every attempt (the target computing it each time), and one whose draft prefill
    outlasted the draft's patience marked the draft down for every session for --draft-retry-s.
    The very first request, before any rate was measured, uses the rate each worker measured on a
    warm-up pass at start-up (reported in Info); before, it had the bare timeouts and failed."""
    model = build_model(tmp_path / "model", seed=5, hidden=384, layers=4, vocab=260, context=4096)
    timeouts = ["--worker-timeout-s", "0.4", "--draft-timeout-s", "0.3", "--draft-retry-s", "30"]
    with (
        fault_cluster(tmp_path, model, model, coordinator_args=timeouts) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        first_long = [5 + (13 * i) % 250 for i in range(3500)]
        started = time.monotonic()
        first = stub.Generate(make_request(first_long, max_new=8, ignore_eos=True), timeout=60)
        first_took = time.monotonic() - started
        short = [5 + (7 * i) % 250 for i in range(200)]
        stub.Generate(make_request(short, max_new=8, ignore_eos=True), timeout=60)  # the rates are measured
        long = [5 + (11 * i) % 250 for i in range(3500)]
        started = time.monotonic()
        reply = stub.Generate(make_request(long, max_new=8, ignore_eos=True), timeout=60)
        took = time.monotonic() - started
        after = stub.Generate(make_request([9, 8, 7, 6], max_new=8, ignore_eos=True), timeout=60)
        draft_failures = metric(cluster, "coordinator", "specdec_draft_failures_total")
    assert list(first.token_ids) == reference_greedy(str(model), tuple(first_long), 8, ignore_eos=True)
    assert list(reply.token_ids) == reference_greedy(str(model), tuple(long), 8, ignore_eos=True)
    assert took > 0.4 and first_took > 0.4  # the prefills did outlast both timeouts
    assert first.stats.target_only_rounds == 0
    assert reply.stats.target_only_rounds == 0 and after.stats.draft_tokens_proposed > 0
    assert draft_failures == 0
    fault_report["a prefill longer than the worker and draft timeouts"] = {
        "prompt_tokens": 3500,
        "served_after_s": round(took, 2),
        "first_request_served_after_s": round(first_took, 2),
        "draft_failures": draft_failures,
    }
