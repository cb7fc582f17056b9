"""State store and network faults: Redis paused or restarted, links blackholed or reset."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from specdec.tools.launch import LaunchError
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import fault_cluster, wait_for
from tests.helpers import SESSION_KEY, RedisServer, free_port, replica_of, stored_sessions
from tests.netproxy import ProxyRoutes, TcpProxy
from tests.reference import greedy_continuation, logit_gap, make_request, read_session, reference_greedy
from tests.tiny_models import TinyModels

PROMPT = [5, 17, 99, 3]


def test_redis_paused_two_seconds_mid_stream(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """SIGSTOP on Redis for 2 s: bounded timeouts and idempotent retries; the stream completes correctly."""
    redis_server = RedisServer(tmp_path / "redis-data")
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 80, ignore_eos=True)
    try:
        with fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url, route=routes(0.01),
            coordinator_args=["--state-timeout-s", "0.5"],
        ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            started = time.monotonic()
            stream = stub.GenerateStream(
                make_request(PROMPT, session_id="paused", max_new=80, ignore_eos=True), timeout=20
            )
            tokens = list(next(stream).token_ids)
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            threading.Timer(2.0, os.kill, (redis_server.proc.pid, signal.SIGCONT)).start()
            tokens += [t for m in stream for t in m.token_ids]
            elapsed = time.monotonic() - started
        assert tokens == expected
        assert elapsed < 20
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        redis_server.stop()
    fault_report["Redis paused 2 s mid-stream"] = {
        "outcome": "completed, identical output",
        "stream_total_s": round(elapsed, 2),
    }


def test_redis_paused_past_the_deadline_fails_inside_it(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Redis stays paused: the request fails inside its 3 s deadline (never a long hang), and the
    service works again once Redis is back."""
    redis_server = RedisServer(tmp_path / "redis-data")
    try:
        with fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url,
            coordinator_args=["--state-timeout-s", "0.5"],
        ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            stub.Generate(make_request(PROMPT, max_new=4))
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(make_request(PROMPT, max_new=8), timeout=3)
            elapsed = time.monotonic() - started
            code = err.value.code().name
            os.kill(redis_server.proc.pid, signal.SIGCONT)
            recovered = wait_for(lambda: _succeeds(stub), 10, 0.1)
        assert code in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
        assert elapsed < 3.5
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        redis_server.stop()
    fault_report["Redis paused past the deadline"] = {
        "client_code": code,
        "failed_after_s": round(elapsed, 2),
        "recovered_after_s": round(recovered, 2),
    }


def _succeeds(stub: coordinator_pb2_grpc.GenerationStub) -> bool:
    try:
        stub.Generate(make_request(PROMPT, max_new=4), timeout=5)
        return True
    except grpc.RpcError:
        return False


def test_redis_restarted_without_persistence_is_reported(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    redis_server = RedisServer(tmp_path / "redis-data")
    try:
        with (
            fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url) as cluster,
            grpc.insecure_channel(cluster.address) as channel,
        ):
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            stub.Generate(make_request(PROMPT, session_id="chat", max_new=6))
            port = redis_server.port
            redis_server.stop()
            redis_server = RedisServer(tmp_path / "redis-data", port=port)  # empty: no persistence
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(make_request([1, 2], session_id="chat", max_new=6))
            assert err.value.code() == grpc.StatusCode.ABORTED
            assert "lost its data" in err.value.details() and "start it again" in err.value.details()
            fresh = stub.Generate(make_request(PROMPT, session_id="chat-2", max_new=6))
            assert len(fresh.token_ids) == 6
    finally:
        redis_server.stop()
    fault_report["Redis restarted without persistence"] = {
        "client_code": "ABORTED",
        "silent_restart": False,
        "new_sessions_work": True,
    }


def test_redis_not_up_yet_at_start_up_is_waited_for(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Redis comes up after the coordinator (`kubectl apply -f k8s/` starts them together): here 3 s
    after the coordinator has said that it waits. Main ended start-up at once (startup_failed, exit
    1: a crash loop in k8s, its restart back-off growing). Now start-up waits for the state store as
    for a worker, up to --worker-startup-timeout-s, not ready meanwhile, saying so at once and every
    10 s; then it serves."""
    port = free_port()
    servers: list[RedisServer] = []
    log_file = tmp_path / "coordinator.log"
    said = threading.Event()

    def come_up_later() -> None:
        try:
            wait_for(lambda: log_file.exists() and "waiting_for_state_store" in log_file.read_text(), 120, 0.1)
        except TimeoutError:
            return
        said.set()
        time.sleep(3.0)
        servers.append(RedisServer(tmp_path / "redis-data", port=port))

    later = threading.Thread(target=come_up_later, daemon=True)
    url = f"redis://127.0.0.1:{port}/0"
    began = time.monotonic()
    later.start()
    try:
        with (
            fault_cluster(tmp_path, tiny_models.target, None, state_url=url) as cluster,
            grpc.insecure_channel(cluster.address) as channel,
        ):
            ready = time.monotonic() - began
            assert said.is_set(), "the coordinator served before it said it waited for its store"
            line = next(x for x in log_file.read_text().splitlines() if "waiting_for_state_store" in x)
            assert "ConnectionError" in line and url in line, line
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            reply = stub.Generate(make_request(PROMPT, session_id="early", max_new=6))
            assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPT), 6)
            assert read_session(url, "early").tokens[-6:] == list(reply.token_ids)
    finally:
        later.join(timeout=150)
        for server in servers:
            server.stop()
    fault_report["Redis not up yet at start-up"] = {"coordinator_ready_s": round(ready, 1), "served_after": True}


def test_a_wrong_redis_password_still_stops_start_up_at_once(tmp_path: Path, tiny_models: TinyModels) -> None:
    """A configuration error is not waited out: a wrong password ends start-up at once, with one
    `startup_failed` line that names it and says what to check, and no traceback (the reason is
    known)."""
    server = RedisServer(tmp_path / "redis-data", password="right-Pa55word-0123")
    began = time.monotonic()
    try:
        with (
            pytest.raises(LaunchError, match="AuthenticationError") as error,
            fault_cluster(tmp_path, tiny_models.target, None, state_url=f"redis://:wrong@127.0.0.1:{server.port}/0"),
        ):
            pass
    finally:
        server.stop()
    assert time.monotonic() - began < 60
    failed = [line for line in str(error.value).splitlines() if "startup_failed" in line]
    assert len(failed) == 1 and "--state-password-file" in failed[0], failed
    assert "Traceback" not in str(error.value) and '"exception"' not in failed[0]


@pytest.mark.parametrize("deadline", ["client", "worker-timeout"])
def test_blackholed_target_link_fails_within_the_deadline(
    deadline: str, tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """A peer that stops answering (connection open, no bytes): keepalive would not notice; the per-call
    deadline (the client's, or --worker-timeout-s) does."""
    route = routes()
    with (
        fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, route=route, coordinator_args=["--worker-timeout-s", "2"]
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(PROMPT, max_new=4))
        route.proxies["target-0"].set_blackhole(True)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(make_request(PROMPT, max_new=8), timeout=1.5 if deadline == "client" else None)
        elapsed = time.monotonic() - started
        route.proxies["target-0"].set_blackhole(False)
        recovered = wait_for(lambda: _succeeds(stub), 10, 0.1)
    expected_code, limit = ("DEADLINE_EXCEEDED", 1.5) if deadline == "client" else ("UNAVAILABLE", 2.0)
    assert err.value.code().name == expected_code
    assert elapsed < limit + 0.5
    fault_report[f"target link blackholed ({deadline} deadline)"] = {
        "client_code": expected_code,
        "failed_after_s": round(elapsed, 2),
        "recovered_after_s": round(recovered, 2),
    }


def test_target_connection_reset_mid_stream_is_ridden_out(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    route = routes(0.01)
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 80, ignore_eos=True)
    with (
        fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, route=route) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(make_request(PROMPT, max_new=80, ignore_eos=True), timeout=30)
        tokens = list(next(stream).token_ids)
        route.proxies["target-0"].reset_connections()
        tokens += [t for m in stream for t in m.token_ids]
    assert tokens == expected
    fault_report["target connection reset mid-stream"] = {"identical_output": True, "client_errors": 0}


def test_two_coordinators_race_on_one_session(
    tmp_path: Path, tiny_models: TinyModels, redis_server: RedisServer, fault_report: dict
) -> None:
    """50 concurrent turns on one session through 2 coordinator processes sharing Redis. A turn runs
    alone (lease + compare-and-set) or gets ABORTED and retries with backoff, as a client would; the
    session ends up exactly the 50 turns one after another, each the target's greedy continuation of
    the history before it."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.tools.launch import spawn

    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url) as cluster:
        first = cluster.processes["coordinator"]
        second = spawn("coordinator", first.args, tmp_path, name="coordinator-2")
        second.wait_ready(60)
        try:
            channels = [grpc.insecure_channel(p.address) for p in (first, second)]
            stubs = [coordinator_pb2_grpc.GenerationStub(c) for c in channels]

            def turn(i: int) -> tuple[list[int], int]:
                request = make_request([100 + i], k=2, max_new=3, session_id="raced", ignore_eos=True)
                for aborted in range(1000):
                    try:
                        return list(stubs[i % 2].Generate(request, timeout=30).token_ids), aborted
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.ABORTED, exc.details()
                        time.sleep(random.uniform(0.005, 0.05))
                raise AssertionError("turn never got the session")

            with ThreadPoolExecutor(max_workers=16) as pool:
                results = dict(zip(range(50), pool.map(turn, range(50)), strict=True))
            for channel in channels:
                channel.close()
        finally:
            second.stop()
    done = {100 + i: out for i, (out, _) in results.items()}
    record = read_session(redis_server.url, "raced")
    target, position, near_ties = str(tiny_models.target), 0, 0
    history: list[int] = []
    while position < len(record.tokens):
        prompt = record.tokens[position]
        output = done.pop(prompt)  # every block starts with a successful turn's prompt token
        assert record.tokens[position + 1 : position + 1 + len(output)] == output
        assert len(output) == 3, f"turn {prompt} gave {output}, not its 3 tokens"
        before = [*history, prompt]
        expected = greedy_continuation(target, before, 3)
        if output != expected:  # the service's token where the two differ by a float near tie
            expected = greedy_continuation(target, before, 3, prefer=output)
            near_ties += output == expected
        if output != expected:
            at = next(i for i, (a, b) in enumerate(zip(output, expected, strict=True)) if a != b)
            gap = logit_gap(target, [*before, *output[:at]], output[at])
            raise AssertionError(
                f"turn {prompt}: the service gave {output}, target-only greedy {expected} (the service's "
                f"token {gap:.3g} below the best logit at its position {at}) after the history {history}"
            )
        history += [prompt, *output]
        position += 1 + len(output)
    assert not done  # every turn is in the session exactly once
    fault_report["2 coordinators, 50 concurrent turns on one session"] = {
        "turns_committed": 50,
        "aborted_attempts_retried": sum(aborted for _, aborted in results.values()),
        "session_is_the_turns_in_order": True,
        "float_near_ties_taken": near_ties,
    }


def _owner_released(url: str, session: str) -> bool:
    return read_session(url, session).owner == ""


def test_a_failed_or_cancelled_turn_is_rolled_back_and_the_session_free_at_once(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """A named session's turn ends badly at many points: cancelled mid-stream, cancelled while Redis
    is stalled, cancelled while its lease request is in flight (Redis paused 0.6 s), cut by the
    caller's deadline. Each time the session is back to its pre-turn tokens and free within a few
    seconds (not after the 90 s lease), and the next turn continues it with the target's greedy
    output over the pre-turn history."""
    redis_server = RedisServer(tmp_path / "redis-data")
    session = "atomic"
    history = list(PROMPT)
    freed_after: dict[str, float] = {}
    try:
        with fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url, route=routes(0.01),
            coordinator_args=["--state-timeout-s", "0.3"],
        ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            first = stub.Generate(make_request(PROMPT, session_id=session, max_new=5, ignore_eos=True), timeout=30)
            history += list(first.token_ids)

            def pause_redis(seconds: float) -> None:
                os.kill(redis_server.proc.pid, signal.SIGSTOP)
                threading.Timer(seconds, os.kill, (redis_server.proc.pid, signal.SIGCONT)).start()

            def cancel_mid_stream() -> None:
                call = stub.GenerateStream(make_request([1, 2], session_id=session, max_new=60, ignore_eos=True))
                next(call)
                call.cancel()

            def cancel_during_stall() -> None:
                call = stub.GenerateStream(make_request([1, 2], session_id=session, max_new=60, ignore_eos=True))
                next(call)
                pause_redis(0.6)
                time.sleep(0.2)
                call.cancel()

            def cancel_while_acquiring() -> None:
                pause_redis(0.6)
                call = stub.GenerateStream(make_request([1, 2], session_id=session, max_new=60, ignore_eos=True))
                time.sleep(0.3)  # the lease request is stuck in the paused Redis
                call.cancel()

            def deadline_mid_turn() -> None:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Generate(make_request([1, 2], session_id=session, max_new=200, ignore_eos=True), timeout=0.4)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            scenarios = {
                "cancelled mid-stream": cancel_mid_stream,
                "cancelled while Redis is stalled": cancel_during_stall,
                "cancelled while taking the lease": cancel_while_acquiring,
                "caller's deadline mid-turn": deadline_mid_turn,
            }
            for name, fault in scenarios.items():
                started = time.monotonic()
                fault()
                wait_for(lambda: _owner_released(redis_server.url, session), 8, 0.05)
                freed_after[name] = round(time.monotonic() - started, 2)
                assert read_session(redis_server.url, session).tokens == history, name
                follow = make_request([3, 4], session_id=session, max_new=4, ignore_eos=True)
                follow.require_existing_session = True
                reply = stub.Generate(follow, timeout=30)
                expected = reference_greedy(str(tiny_models.target), (*history, 3, 4), 4, ignore_eos=True)
                assert list(reply.token_ids) == expected, name
                history += [3, 4, *reply.token_ids]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        redis_server.stop()
    assert max(freed_after.values()) < 8
    fault_report["named turn failed or cancelled at any point (incl. Redis stalls, lease in flight)"] = {
        "rolled_back": True,
        "session_free_after_s": freed_after,
        "next_turn_identical_output": True,
    }


def test_a_full_redis_refuses_requests_as_full_and_leaves_every_session_as_it_was(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """Redis reaches its maxmemory (noeviction, as the Deployment configures it) while a named
    session's turn and a one-shot request stream. Both fail RESOURCE_EXHAUSTED saying the state store
    is full (at once, not retried as an outage); the named session is back to its pre-turn tokens and
    free, the one-shot's session gone; a new request is refused the same way at once; CloseSession
    works. Once Redis has
    room, the session's next turn is the target's greedy output over the pre-turn history. Main
    retried the refused writes as an outage (UNAVAILABLE) and could not release the session's lease:
    it stayed busy for the 90 s lease, the one-shot's session for the TTL."""
    redis_server = RedisServer(tmp_path / "redis-data", extra_args=["--maxmemory-policy", "noeviction"])
    session = "full"
    history = list(PROMPT)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        with fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url, route=routes(0.01)
        ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            first = stub.Generate(make_request(PROMPT, session_id=session, max_new=5, ignore_eos=True), timeout=30)
            history += list(first.token_ids)
            stub.Generate(make_request(PROMPT, session_id="done-with", max_new=2, ignore_eos=True), timeout=30)
            turn = stub.GenerateStream(make_request([1, 2], session_id=session, max_new=200, ignore_eos=True))
            one_shot = stub.GenerateStream(make_request([6, 7], max_new=200, ignore_eos=True))
            next(turn), next(one_shot)
            admin.config_set("maxmemory", 1)  # full: Redis refuses every write that may grow it
            started = time.monotonic()
            for call in (turn, one_shot):
                with pytest.raises(grpc.RpcError) as err:
                    for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
                assert "state store is full" in (err.value.details() or "")
            wait_for(lambda: _owner_released(redis_server.url, session), 2, 0.05)
            freed_after = time.monotonic() - started
            assert read_session(redis_server.url, session).tokens == history
            # the one-shot's session went
            wait_for(lambda: stored_sessions(redis_server.url) == {session, "done-with"}, 2, 0.05)
            closed = stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="done-with"), timeout=30)
            assert closed.existed and stored_sessions(redis_server.url) == {session}

            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(make_request(PROMPT, session_id="new", max_new=4, ignore_eos=True), timeout=30)
            refused_after = time.monotonic() - started
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert refused_after < 2  # not retried for --state-retry-s (5 s) as an outage

            admin.config_set("maxmemory", 0)
            follow = make_request([3, 4], session_id=session, max_new=4, ignore_eos=True)
            follow.require_existing_session = True
            reply = stub.Generate(follow, timeout=30)
            expected = reference_greedy(str(tiny_models.target), (*history, 3, 4), 4, ignore_eos=True)
            assert list(reply.token_ids) == expected
    finally:
        admin.close()
        redis_server.stop()
    fault_report["Redis full (maxmemory, noeviction) mid-turn"] = {
        "outcome": "RESOURCE_EXHAUSTED 'the state store is full'; sessions as before the turn, one-shot's deleted",
        "session_free_after_s": round(freed_after, 2),
        "new_request_refused_after_s": round(refused_after, 2),
        "next_turn_identical_output": True,
    }


def test_with_replica_acks_a_client_gets_only_tokens_a_replica_has(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """--state-replica-acks 1 with a primary and one replica: each streamed chunk's tokens are on the
    replica when the client receives them (a failover to it would lose none). With the replica
    stopped (SIGSTOP: lagging, cut off), a turn fails UNAVAILABLE saying the replicas did not confirm
    its commit (retried for --state-retry-s first), no token of it reaches the client, and the session is
    back to its pre-turn tokens and free; once the replica is back the next turn is the target's
    greedy output over that history. Main sent every round's tokens whatever the replicas had."""
    primary = RedisServer(tmp_path / "primary")
    replica = replica_of(primary, tmp_path / "replica")
    session, history = "replicated", list(PROMPT)
    args = ["--state-replica-acks", "1", "--state-replica-wait-s", "0.3", "--state-retry-s", "1"]
    try:
        with fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, state_url=primary.url, route=routes(0.01),
            coordinator_args=args,
        ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            chunks = 0
            for chunk in stub.GenerateStream(make_request(PROMPT, session_id=session, max_new=12, ignore_eos=True)):
                history += list(chunk.token_ids)
                assert read_session(replica.url, session).tokens[: len(history)] == history
                chunks += 1
            assert len(history) == len(PROMPT) + 12 and read_session(replica.url, session).tokens == history

            os.kill(replica.proc.pid, signal.SIGSTOP)
            try:
                started, received = time.monotonic(), []
                with pytest.raises(grpc.RpcError) as err:
                    for chunk in stub.GenerateStream(make_request([3, 4], session_id=session, max_new=8), timeout=30):
                        received += list(chunk.token_ids)
                failed_after = time.monotonic() - started
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "state store replicas a commit needs (--state-replica-acks)" in (err.value.details() or "")
                assert received == []
                wait_for(lambda: _owner_released(primary.url, session), 5, 0.05)
                assert read_session(primary.url, session).tokens == history
            finally:
                os.kill(replica.proc.pid, signal.SIGCONT)
            follow = make_request([3, 4], session_id=session, max_new=4, ignore_eos=True)
            follow.require_existing_session = True
            reply = stub.Generate(follow, timeout=30)
            assert list(reply.token_ids) == reference_greedy(
                str(tiny_models.target), (*history, 3, 4), 4, ignore_eos=True
            )
    finally:
        replica.stop()
        primary.stop()
    fault_report["a replica of Redis stops confirming commits (--state-replica-acks 1)"] = {
        "outcome": "UNAVAILABLE naming the replicas; no token of the turn sent; session as before the turn",
        "chunks_checked_on_the_replica": chunks,
        "failed_after_s": round(failed_after, 2),
        "next_turn_identical_output": True,
    }


def test_a_full_memory_store_is_the_request_s_error_until_sessions_close(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """memory:// with --state-memory-max-tokens 300 (each session counts 64 tokens more than its
    ids): a session of 9 tokens fits; a second one's 200-token prompt would not, and the request
    fails RESOURCE_EXHAUSTED saying the state store is full, leaving nothing behind; once the first
    session is closed the same request is served, equal to target-only greedy decoding."""
    long_prompt = [(7 * i) % 90 + 5 for i in range(200)]
    with fault_cluster(
        tmp_path, tiny_models.target, tiny_models.noisy, coordinator_args=["--state-memory-max-tokens", "300"]
    ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(PROMPT, session_id="first", max_new=5, ignore_eos=True), timeout=30)
        second = make_request(long_prompt, session_id="second", max_new=4, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(second, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert "state store is full" in (err.value.details() or "")
        closed = stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id="first"), timeout=30)
        assert closed.existed
        reply = stub.Generate(second, timeout=30)
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), tuple(long_prompt), 4, ignore_eos=True)
    fault_report["memory:// store full (--state-memory-max-tokens)"] = {
        "outcome": "RESOURCE_EXHAUSTED 'the state store is full'; served once a session was closed",
        "next_request_identical_output": True,
    }


def _after_the_dead_lease(call: Callable[[], object], timeout_s: float = 30) -> object:
    """``call()``, retried while the session is still leased to the turn that died (ABORTED)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_turn_whose_coordinator_died_is_undone_before_the_next_one(
    tmp_path: Path,
    tiny_models: TinyModels,
    redis_server: RedisServer,
    routes: Callable[..., ProxyRoutes],
    fault_report: dict,
) -> None:
    """The coordinator is SIGKILLed mid-turn: no rollback runs, and the turn's prompt and rounds are
    already committed. When the dead turn's lease has lapsed, the next request on the session finds
    it unfinished and undoes it first: the session is what it was before that turn (a turn is
    atomic), and a session that the dead turn created is gone, as after any failed first turn."""
    lease = ["--session-lease-s", "4", "--worker-timeout-s", "2", "--state-retry-s", "1"]
    with fault_cluster(
        tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url, route=routes(0.03),
        coordinator_args=lease,
    ) as cluster:  # fmt: skip
        coordinator = cluster.processes["coordinator"]

        def killed_mid_turn(session: str, prompt: list[int]) -> None:
            with grpc.insecure_channel(cluster.address) as channel:
                request = make_request(prompt, session_id=session, max_new=200, ignore_eos=True)
                stream = coordinator_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=60)
                next(stream)
                next(stream)
                coordinator.restart()  # SIGKILL, then a fresh process on the same port

        with grpc.insecure_channel(cluster.address) as channel:
            first = coordinator_pb2_grpc.GenerationStub(channel).Generate(
                make_request(PROMPT, session_id="kept", max_new=5, ignore_eos=True), timeout=30
            )
        history = [*PROMPT, *first.token_ids]
        killed_mid_turn("kept", [1, 2])
        dead_turn = read_session(redis_server.url, "kept").tokens
        assert dead_turn[: len(history) + 2] == [*history, 1, 2] and len(dead_turn) > len(history) + 2
        killed_mid_turn("made", [7, 8])
        assert read_session(redis_server.url, "made").tokens[:2] == [7, 8]

        started = time.monotonic()
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            follow = make_request([3, 4], session_id="kept", max_new=4, ignore_eos=True)
            follow.require_existing_session = True
            reply = _after_the_dead_lease(lambda: stub.Generate(follow, timeout=30))
            waited = time.monotonic() - started
            expected = reference_greedy(str(tiny_models.target), (*history, 3, 4), 4, ignore_eos=True)
            assert list(reply.token_ids) == expected
            assert read_session(redis_server.url, "kept").tokens == [*history, 3, 4, *expected]
            again = make_request([9], session_id="made", max_new=2, ignore_eos=True)
            again.require_existing_session = True
            with pytest.raises(grpc.RpcError) as err:
                _after_the_dead_lease(lambda: stub.Generate(again, timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    fault_report["coordinator SIGKILLed mid-turn"] = {
        "dead_turn_tokens_committed": len(dead_turn) - len(history),
        "undone_at_next_turn": True,
        "next_turn_served_after_s": round(waited, 2),
        "created_session_removed": True,
    }


def test_a_redis_failover_that_keeps_the_old_primary_up_is_ridden_out(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict
) -> None:
    """Redis fails over to its replica and the old primary stays up as a replica of the new one
    (Sentinel, or a managed Redis behind one DNS name): the coordinator's open connections now
    reach a read-only node, which answers every write READONLY. It reconnects (the address now
    names the new primary) instead of failing every request until it restarts; sessions go on
    from the replicated state."""
    old = RedisServer(tmp_path / "redis-a")
    new = RedisServer(tmp_path / "redis-b", extra_args=["--replicaof", "127.0.0.1", str(old.port)])
    name = TcpProxy(f"127.0.0.1:{old.port}")
    try:
        with fault_cluster(
            tmp_path, tiny_models.target, tiny_models.noisy, state_url=f"redis://{name.address}/0"
        ) as cluster, grpc.insecure_channel(cluster.address) as channel:  # fmt: skip
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            first = stub.Generate(make_request(PROMPT, session_id="kept", max_new=5, ignore_eos=True), timeout=30)
            history = [*PROMPT, *first.token_ids]
            old_client, new_client = redis.Redis(port=old.port), redis.Redis(port=new.port)
            wait_for(lambda: new_client.exists(f"{SESSION_KEY}kept") == 1, 10, 0.05)
            new_client.replicaof("NO", "ONE")
            old_client.replicaof("127.0.0.1", new.port)
            name.retarget(f"127.0.0.1:{new.port}")
            started = time.monotonic()
            follow = make_request([3, 4], session_id="kept", max_new=4, ignore_eos=True)
            follow.require_existing_session = True
            errors: list[str] = []
            for _ in range(3):  # a client's retries; on main all fail (READONLY) until the coordinator restarts
                try:
                    reply = stub.Generate(follow, timeout=30)
                    break
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")
                    time.sleep(0.5)
            else:
                raise AssertionError(f"every turn failed after the failover: {errors}")
            recovered = time.monotonic() - started
            old_client.close()
            new_client.close()
    finally:
        name.close()
        new.stop()
        old.stop()
    assert list(reply.token_ids) == reference_greedy(str(tiny_models.target), (*history, 3, 4), 4, ignore_eos=True)
    fault_report["Redis failover, old primary kept up as a replica"] = {
        "failed_attempts": len(errors),
        "served_after_s": round(recovered, 2),
        "identical_output": True,
    }
