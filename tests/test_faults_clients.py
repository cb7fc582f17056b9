"""Client-side faults with real processes: cancellation, dead clients, overload, bad input, shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from specdec.serving.errors import InvalidRequest
from specdec.tools.launch import LocalCluster, ServiceProcess, spawn, worker_info
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import FAULT_COORDINATOR_ARGS, HUGE_TEXT, fault_cluster, loop_stall_during, metric, wait_for
from tests.helpers import SESSION_KEY, RedisServer, stored_sessions
from tests.netproxy import ProxyRoutes, TcpProxy
from tests.reference import make_request, read_session, reference_greedy
from tests.tiny_models import TinyModels

PROMPT = [5, 17, 99, 3]


def live_caches(cluster: LocalCluster) -> int:
    return sum(worker_info(cluster.processes[r].address, r).active_sessions for r in ("target-0", "draft"))


def idle(cluster: LocalCluster, kept: int | tuple[int, ...] = 0) -> bool:
    """No request running and no cache but the ``kept`` ones (finished one-shot requests leave
    theirs for prefix reuse); a tuple: any of those numbers of caches."""
    allowed = kept if isinstance(kept, tuple) else (kept,)
    return live_caches(cluster) in allowed and metric(cluster, "coordinator", "specdec_active_requests") == 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_cancelled_streams_free_everything(
    tmp_path: Path,
    tiny_models: TinyModels,
    redis_server: RedisServer,
    routes: Callable[..., ProxyRoutes],
    fault_report: dict,
) -> None:
    """200 cancels at random points: caches freed within 500 ms each; at the end no live requests,
    no cache slots, no Redis key without a TTL, and the coordinator's open files back to baseline."""
    rng = random.Random(7)
    route = routes(0.002)
    with fault_cluster(
        tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url, route=route
    ) as cluster:
        coordinator_pid = cluster.processes["coordinator"].proc.pid
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            stub.Generate(make_request(PROMPT, max_new=4))  # warm up connections before the baseline
            baseline = open_fds(coordinator_pid)
            kept = live_caches(cluster)  # the warm-up request's caches, kept for prefix reuse
            assert kept == 2
            cleanup = []
            for i in range(200):
                session = f"cancel-{i}" if rng.random() < 0.5 else ""
                call = stub.GenerateStream(
                    make_request(PROMPT, k=rng.choice([0, 2, 4]), max_new=60, session_id=session)
                )
                for _ in range(rng.randint(0, 4)):
                    next(call)
                time.sleep(rng.random() * 0.01)
                call.cancel()
                cleanup.append(wait_for(lambda: idle(cluster, kept), 5, 0.005))
        assert max(cleanup) < 0.5, f"slowest cleanup {max(cleanup):.3f}s"
        client = redis.Redis.from_url(redis_server.url)
        ttls = [client.pttl(key) for key in client.scan_iter(f"{SESSION_KEY}cancel-*")]
        assert all(ttl > 0 for ttl in ttls)  # a session its own cancelled turn created is deleted
        assert not stored_sessions(redis_server.url, "oneshot-*")
        client.close()
        fd_growth = open_fds(coordinator_pid) - baseline
        assert fd_growth <= 2
        # A cancel that lands between two messages failed the next write inside grpc: it was
        # logged as a crash (rpc_crashed, error level, a traceback) and counted INTERNAL.
        crashes = cluster.processes["coordinator"].log_tail(100_000).count("rpc_crashed")
        internal = metric(cluster, "coordinator", "specdec_rpcs_total", 'code="INTERNAL"')
        cancelled = metric(cluster, "coordinator", "specdec_rpcs_total", 'code="CANCELLED"')
        assert crashes == 0 and internal == 0, (crashes, internal, cancelled)
        assert cancelled >= 150  # the rest ended before the cancel reached them, or never began
    cleanup.sort()
    fault_report["client cancels mid-stream (x200)"] = {
        "caches_freed_p50_s": round(cleanup[100], 3),
        "caches_freed_max_s": round(cleanup[-1], 3),
        "live_requests_after": 0,
        "keys_without_ttl": 0,
        "coordinator_fd_growth": fd_growth,
        "logged_as_crashes": crashes,
    }


def test_a_session_closed_during_its_turn_stays_closed_without_warnings(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes]
) -> None:
    """CloseSession while a turn of that session runs (a user deleting a chat mid-reply): the
    session is deleted at once; a turn that then goes on finds it gone at its next commit and
    ends ABORTED saying so; one its client cancels first has nothing to roll back either. Both
    leave the session closed, free the workers' caches and log no warning. Each logged the
    warning session_cleanup_failed (its rollback found no session: 71 times in a 6-minute random
    run with closes), which alerts on warnings would page for. The target link is slowed (0.25 s
    each way) so that the close lands inside a round. The turn that goes on waits for its round
    longer than a third of its lease (the link held 2.2 s, the lease 6 s), so its lease renewal
    finds the session closed too: it logged the warning session_lease_lost, as for a lease taken
    by another request; it now ends renewing with an info line."""
    route = routes(0.0)
    lease = ["--session-lease-s", "6", "--worker-timeout-s", "4.5", "--state-retry-s", "0.5"]
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, route=route, coordinator_args=lease) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            stub.Generate(make_request(PROMPT, max_new=4))  # warm up the links
            kept = live_caches(cluster)  # the warm-up's caches, kept for prefix reuse
            for session in ("closed-then-cancelled", "closed-while-running"):  # sessions with a turn behind them
                stub.Generate(make_request(PROMPT, session_id=session, max_new=2))
            route.proxies["target-0"].delay_s = 0.25
            outcomes = {}
            for session, cancel in (("closed-then-cancelled", True), ("closed-while-running", False)):
                call = stub.GenerateStream(make_request(PROMPT, session_id=session, max_new=40, ignore_eos=True))
                next(call)  # the first round committed; the next one is on its way to the target
                close = coordinator_pb2.CloseSessionRequest(session_id=session)
                closing = threading.Thread(
                    target=lambda close=close: outcomes.update({close.session_id: stub.CloseSession(close).existed})
                )
                closing.start()
                time.sleep(0.1)  # the session is deleted (the memory store answers at once); the round is in flight
                if cancel:
                    call.cancel()
                else:  # the round's reply held past a lease renewal (every 2 s), within the worker timeout
                    route.proxies["target-0"].set_blackhole(True)
                    time.sleep(2.2)
                    route.proxies["target-0"].set_blackhole(False)
                with pytest.raises(grpc.RpcError) as ended:
                    list(call)
                closing.join()
                if cancel:
                    assert ended.value.code() == grpc.StatusCode.CANCELLED
                else:
                    assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value.details()
                    assert "closed during the request" in (ended.value.details() or "")
            assert outcomes == {"closed-then-cancelled": True, "closed-while-running": True}
            route.proxies["target-0"].delay_s = 0.0
            wait_for(lambda: idle(cluster, kept), 10)
            for session in outcomes:
                assert not stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id=session)).existed
        log = cluster.processes["coordinator"].log_tail(1_000_000)
        warnings = [line for line in log.splitlines() if '"level": "warning"' in line and "closed-" in line]
        assert warnings == [], "\n".join(warnings)
        renewals = [line for line in log.splitlines() if "session_gone_during_turn" in line]
        assert len(renewals) == 1 and "closed-while-running" in renewals[0], renewals


def test_a_session_closed_and_made_again_during_a_turn_is_the_new_request_s(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes]
) -> None:
    """CloseSession while a turn runs, then a new turn under the same id (the chat deleted
    mid-reply and started again) before the first turn's next commit, for a turn that made its
    session and for one that continued it. The first turn ends ABORTED "expired or was closed
    during the request", as when the session stays closed; its clean-up leaves the new session
    alone and logs no warning; the new turn finishes and its session is there to go on with.
    Before: a turn that made its session deleted the new one on its clean-up (a plain delete), so
    the new turn ended ABORTED too; and the first turn was told the session "was taken over by"
    (made) or "was changed by another request" (continued), as for a lease that lapsed, the one
    that continued it also logging the warning session_cleanup_failed (its rollback refused).
    Each commit now names the session's creation time, and a session made since is gone for it.
    The target link is slowed (0.25 s each way) so that the close and the new turn land inside
    the first turn."""
    route = routes(0.0)
    cluster_context = fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, route=route)
    with cluster_context as cluster, grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.Generate(make_request(PROMPT, max_new=4))  # warm up the links
        stub.Generate(make_request(PROMPT, session_id="continued", max_new=2))  # a turn behind it
        for session in ("made", "continued"):
            route.proxies["target-0"].delay_s = 0.25
            first = stub.GenerateStream(make_request(PROMPT, session_id=session, max_new=40, ignore_eos=True))
            next(first)  # a round committed
            closed = stub.CloseSession(coordinator_pb2.CloseSessionRequest(session_id=session))
            assert closed.existed
            second = stub.GenerateStream(make_request(PROMPT, session_id=session, max_new=8, ignore_eos=True))
            next(second)  # a new session under the same id, its first round committed
            with pytest.raises(grpc.RpcError) as ended:
                list(first)
            assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value.details()
            assert "closed during the request" in (ended.value.details() or ""), (session, ended.value.details())
            route.proxies["target-0"].delay_s = 0.0
            rest = list(second)  # the new session's turn finishes
            assert rest and rest[-1].finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
            follow = make_request([5, 6], session_id=session, max_new=2)
            follow.require_existing_session = True
            again = stub.Generate(follow, timeout=60)  # and the session is there to go on with
            assert len(again.token_ids) == 2
        log = cluster.processes["coordinator"].log_tail(1_000_000)
        warnings = [line for line in log.splitlines() if '"level": "warning"' in line and "session_id" in line]
        assert warnings == [], "\n".join(warnings)


def test_callers_short_deadlines_are_not_counted_against_the_draft(cluster_same: LocalCluster) -> None:
    """A caller whose deadline runs out while the draft drafts ends the draft call early: that is
    the caller's doing. It was counted as a draft request error (the metric says "by their own
    input") with a draft_request_failed warning each time, so short client deadlines looked like
    a sick draft."""
    names = ("specdec_draft_request_errors_total", "specdec_draft_failures_total")
    before = {name: metric(cluster_same, "coordinator", name) for name in names}
    lines_before = len(cluster_same.processes["coordinator"].log_tail(100_000).splitlines())
    codes: dict[str, int] = {}
    with grpc.insecure_channel(cluster_same.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for i in range(40):
            request = make_request([200, 1, 42, 42, 7, 130, 64, 11, 250, 0], max_new=200, ignore_eos=True)
            try:
                for _ in stub.GenerateStream(request, timeout=(0.01, 0.03, 0.06, 0.1)[i % 4]):
                    pass
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
        time.sleep(0.5)
        assert codes.get("DEADLINE_EXCEEDED", 0) >= 30, codes
        after = {name: metric(cluster_same, "coordinator", name) for name in names}
        assert after == before
        new_lines = cluster_same.processes["coordinator"].log_tail(100_000).splitlines()[lines_before:]
        assert not [line for line in new_lines if "draft_request_failed" in line]
        reply = stub.Generate(make_request(PROMPT, k=4, fixed=True, max_new=12, ignore_eos=True))
        assert reply.stats.draft_tokens_accepted > 0  # the draft still drafts for everyone


def test_callers_expired_deadlines_are_counted_as_such(cluster_same: LocalCluster) -> None:
    """A call whose caller's deadline ran out was counted `CANCELLED` in `specdec_rpcs_total`,
    like a caller's cancel, so the metric could not show requests that took too long for their
    callers. It is now `DEADLINE_EXCEEDED` (what the caller got); a cancel stays `CANCELLED`."""
    method = 'method="specdec.v1.Generation/GenerateStream"'

    def counted(code: str) -> float:
        return metric(cluster_same, "coordinator", "specdec_rpcs_total", f'code="{code}",{method}')

    before = {code: counted(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
    expired = 0
    with grpc.insecure_channel(cluster_same.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        for i in range(20):
            request = make_request([200, 1, 42, 42, 7, 130, 64, 11, 250, 0], max_new=200, ignore_eos=True)
            try:
                for _ in stub.GenerateStream(request, timeout=(0.02, 0.05, 0.1)[i % 3]):
                    pass
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                expired += 1
        cancelled = stub.GenerateStream(make_request(PROMPT, max_new=200, ignore_eos=True))
        next(cancelled)
        cancelled.cancel()
    wait_for(lambda: counted("CANCELLED") == before["CANCELLED"] + 1, 5)
    assert expired >= 15
    assert counted("DEADLINE_EXCEEDED") - before["DEADLINE_EXCEEDED"] == expired  # main: most were CANCELLED


class _LeftAt:
    """A call's server context whose client left (grpc cancelled the handler) with ``remaining``
    seconds of the server's deadline to go (None: the call had no deadline)."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def code(self) -> None:
        return None

    def time_remaining(self) -> float | None:
        return self.remaining


def test_a_deadline_that_ran_out_at_the_caller_first_is_still_a_deadline() -> None:
    """The server's deadline starts when its grpc core reads the call's headers, so it runs out a
    little after the caller's, whose grpc then resets the stream: grpc's server sees that as a
    cancel with some milliseconds of its own deadline left. Such calls were counted `CANCELLED`
    (3 of 300 streams with 20-100 ms deadlines on a 2-core host with 3 busy loops, 1.5-4.3 ms
    left; a fresh-clone CI run failed test_callers_expired_deadlines_are_counted_as_such so).
    A caller's cancel well before its deadline, or without one, stays `CANCELLED`."""
    from specdec.serving.metrics import RpcMetrics
    from specdec.serving.security import Authenticator
    from specdec.serving.server import ServerControl, _Rpc

    registry = CollectorRegistry()
    rpc = _Rpc("s/M", "M", ServerControl(), Authenticator(), RpcMetrics(registry))
    for remaining in (0.0, 0.0015, 0.0043, 0.03, 1.0, 30.0, None):
        rpc.ended(_LeftAt(remaining), time.monotonic(), client_left=True)  # type: ignore[arg-type]
    counted = _calls_by_code(registry, "s/M", ("DEADLINE_EXCEEDED", "CANCELLED"))
    assert counted == {"DEADLINE_EXCEEDED": 4.0, "CANCELLED": 3.0}  # main: 1 and 6


CLIENT_SCRIPT = """
import sys, grpc
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
request = coordinator_pb2.GenerateRequest(
    prompt_token_ids=common_pb2.TokenIds(ids=[5, 17, 99, 3]),
    sampling=common_pb2.SamplingParams(max_new_tokens=200, ignore_eos=True),
    speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=4, fixed=True),
)
stub = coordinator_pb2_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
for message in stub.GenerateStream(request):
    print("got", flush=True)
"""  # grpc and the protos only: each of the five clients starts in a fraction of a second


def test_client_process_killed_mid_stream(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, route=routes(0.01)) as cluster:
        timings = []
        for _ in range(5):
            client = subprocess.Popen(
                [sys.executable, "-c", CLIENT_SCRIPT, cluster.address], stdout=subprocess.PIPE, text=True
            )
            assert client.stdout is not None and client.stdout.readline().strip() == "got"
            client.kill()
            client.wait()
            timings.append(wait_for(lambda: idle(cluster), 5, 0.005))
        assert max(timings) < 0.5
    fault_report["client process killed mid-stream (x5)"] = {"caches_freed_max_s": round(max(timings), 3)}


def test_overload_is_rejected_fast_and_capacity_returns(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    args = ["--max-concurrent-requests", "4"]
    with fault_cluster(tmp_path, tiny_models.target, None, coordinator_args=args, route=routes(0.01)) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            long_request = make_request(PROMPT, max_new=150, ignore_eos=True)
            results: list[object] = []
            workers = [
                threading.Thread(target=lambda: results.append(stub.Generate(long_request, timeout=60)))
                for _ in range(4)
            ]
            for w in workers:
                w.start()
            wait_for(lambda: metric(cluster, "coordinator", "specdec_active_requests") == 4, 10)
            latencies, codes = [], set()
            for _ in range(60):  # 2x capacity and then some, while the first four run
                started = time.monotonic()
                try:
                    stub.Generate(make_request(PROMPT, max_new=4), timeout=10)
                    codes.add("OK")
                except grpc.RpcError as exc:
                    codes.add(exc.code().name)
                    assert "limit of 4 concurrent requests" in exc.details()
                latencies.append(time.monotonic() - started)
            still_running = metric(cluster, "coordinator", "specdec_active_requests")
            for w in workers:
                w.join()
            assert len(results) == 4
            again = [stub.Generate(make_request(PROMPT, max_new=4)) for _ in range(4)]
        assert still_running == 4 and codes == {"RESOURCE_EXHAUSTED"}
        assert len(again) == 4
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert p99 < 0.05
    fault_report["overload at 2x+ capacity"] = {
        "rejected": len(latencies),
        "reject_p99_s": round(p99, 4),
        "capacity_back": True,
    }


def test_a_caller_at_its_request_limit_is_refused_and_others_are_served(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes]
) -> None:
    """--max-requests-per-caller: alice, with 2 long requests generating, is refused a third at
    once (RESOURCE_EXHAUSTED, saying so) while bob is served, and served again once hers end. Main
    had only the server's limit: one caller could take every slot of it."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:alice-token-0123456789\nbob:bob-token-0123456789\n")
    args = ["--auth-tokens-file", str(tokens), "--max-requests-per-caller", "2", "--max-concurrent-requests", "8"]
    alice, bob = ([("authorization", f"Bearer {who}-token-0123456789")] for who in ("alice", "bob"))
    cluster = fault_cluster(tmp_path, tiny_models.target, None, coordinator_args=args, route=routes(0.01))
    with cluster as running, grpc.insecure_channel(running.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        long_request = make_request(PROMPT, max_new=150, ignore_eos=True)
        results: list[object] = []
        workers = [
            threading.Thread(target=lambda: results.append(stub.Generate(long_request, metadata=alice, timeout=60)))
            for _ in range(2)
        ]
        for w in workers:
            w.start()
        wait_for(lambda: metric(running, "coordinator", "specdec_active_requests") == 2, 10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(make_request(PROMPT, max_new=4), metadata=alice, timeout=10)
        served = stub.Generate(make_request(PROMPT, max_new=4), metadata=bob, timeout=10)
        still_running = metric(running, "coordinator", "specdec_active_requests")
        for w in workers:
            w.join()
        again = stub.Generate(make_request(PROMPT, max_new=4), metadata=alice, timeout=10)
        info = stub.GetInfo(coordinator_pb2.GetInfoRequest(), metadata=bob, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "you have 2 requests generating" in (refused.value.details() or "")
    assert still_running == 2 and len(results) == 2
    assert len(served.token_ids) == 4 and len(again.token_ids) == 4
    assert info.max_requests_per_caller == 2 and info.max_concurrent_requests == 8


BAD_INPUTS = [
    ("empty prompt", coordinator_pb2.GenerateRequest(), "INVALID_ARGUMENT", "the prompt is empty"),
    (
        "token id >= vocab",
        make_request([1, 259]),
        "INVALID_ARGUMENT",
        "contains token id 259, but the vocabulary has 259 ids",
    ),
    (
        "max_new_tokens 0",
        make_request(PROMPT, max_new=0),
        "INVALID_ARGUMENT",
        "max_new_tokens must be in [1, 255], got 0",
    ),
    (
        "max_new_tokens over context",
        make_request(PROMPT, max_new=300),
        "INVALID_ARGUMENT",
        "max_new_tokens must be in [1, 255]",
    ),
    (
        "prompt + max_new_tokens over context",
        make_request([1] * 200, max_new=100),
        "INVALID_ARGUMENT",
        "exceeds the context length 256",
    ),
    (
        "NaN temperature",
        make_request(PROMPT, temperature=float("nan")),
        "INVALID_ARGUMENT",
        "temperature must be a finite number >= 0",
    ),
    (
        "negative temperature",
        make_request(PROMPT, temperature=-1.0),
        "INVALID_ARGUMENT",
        "temperature must be a finite number >= 0",
    ),
    ("top_p 0", make_request(PROMPT, top_p=0.0), "INVALID_ARGUMENT", "top_p must be in (0, 1]"),
    ("top_p > 1", make_request(PROMPT, top_p=1.5), "INVALID_ARGUMENT", "top_p must be in (0, 1]"),
    ("top_k < 0", make_request(PROMPT, top_k=-3), "INVALID_ARGUMENT", "top_k must be >= 0"),
    ("K over the maximum", make_request(PROMPT, k=9), "INVALID_ARGUMENT", "num_speculative_tokens must be <= 8"),
    (
        "prompt over the character limit",
        coordinator_pb2.GenerateRequest(prompt="a" * 1_000_001),
        "RESOURCE_EXHAUSTED",
        "the limit is 1000000",
    ),
    ("message over the size limit", coordinator_pb2.GenerateRequest(prompt="a" * (9 << 20)), "RESOURCE_EXHAUSTED", ""),
    (
        "unknown session, continue-only",
        coordinator_pb2.GenerateRequest(
            session_id="nope", prompt_token_ids=common_pb2.TokenIds(ids=[1]), require_existing_session=True
        ),
        "NOT_FOUND",
        "session 'nope' does not exist",
    ),
]


def computed_tokens(cluster: LocalCluster) -> int:
    return sum(worker_info(cluster.processes[r].address, r).prefill_tokens_total for r in ("target-0", "draft"))


def test_bad_input_is_rejected_before_any_worker_is_called(
    tmp_path: Path, tiny_models: TinyModels, redis_server: RedisServer, fault_report: dict
) -> None:
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url) as cluster:
        before = computed_tokens(cluster)
        sessions_before = stored_sessions(redis_server.url)
        with grpc.insecure_channel(cluster.address, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            for name, request, code, message in BAD_INPUTS:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Generate(request, timeout=10)
                assert err.value.code().name == code, name
                assert message in (err.value.details() or ""), (name, err.value.details())
                assert "Traceback" not in (err.value.details() or "") and "redis://" not in (err.value.details() or "")
        assert computed_tokens(cluster) == before
        assert stored_sessions(redis_server.url) == sessions_before
    fault_report["bad input (14 kinds)"] = {
        "rejected_before_workers": True,
        "codes": sorted({c for _, _, c, _ in BAD_INPUTS}),
    }


def test_one_session_used_by_two_requests_at_once(
    tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    cluster_cm = fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, route=routes(0.01))
    with cluster_cm as cluster, grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        first = stub.GenerateStream(make_request(PROMPT, session_id="shared", max_new=80, ignore_eos=True))
        next(first)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(make_request([1], session_id="shared", max_new=4))
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "is generating for another request" in err.value.details()
        rest = [t for m in first for t in m.token_ids]
        assert len(rest) > 0
        follow_up = stub.Generate(make_request([1], session_id="shared", max_new=4))  # free again once done
        assert len(follow_up.token_ids) == 4
    fault_report["same session, two concurrent requests"] = {"second_request": "ABORTED", "first_unaffected": True}


def health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.3)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.parametrize("role", ["coordinator", "draft", "target-0"])
def test_sigterm_drains_gracefully(
    role: str, tmp_path: Path, tiny_models: TinyModels, routes: Callable[..., ProxyRoutes], fault_report: dict
) -> None:
    """SIGTERM: health NOT_SERVING at once, new RPCs refused, the in-flight stream completes
    correctly, the process exits 0 with its last log event written, and its whole log (model
    loading, library warnings, health checks in flight at the stop) is JSON lines. (With two
    target replicas, a draining one hands over.)"""
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 100, ignore_eos=True)
    targets = 2 if role.startswith("target") else 1
    # The stream runs to its end under the coordinator's drain: about 2 s after the stop on a quiet
    # host, over 5 s (the fault clusters' grace period) on a loaded one, so a longer grace here.
    with fault_cluster(
        tmp_path,
        tiny_models.target,
        tiny_models.noisy,
        targets=targets,
        route=routes(0.01),
        coordinator_args=["--grace-period-s", "60"],
    ) as cluster:
        process = cluster.processes[role]
        if role.startswith("target"):
            # drain the replica that holds the stream's session
            with grpc.insecure_channel(cluster.address) as channel:
                stub = coordinator_pb2_grpc.GenerationStub(channel)
                stream = stub.GenerateStream(make_request(PROMPT, max_new=100, ignore_eos=True))
                tokens = list(next(stream).token_ids)
                holders = [
                    n for n in ("target-0", "target-1") if worker_info(cluster.processes[n].address, n).active_sessions
                ]
                process = cluster.processes[holders[0]]
                rest, exited = _drain_during(process, stream)
        else:
            with grpc.insecure_channel(cluster.address) as channel:
                stub = coordinator_pb2_grpc.GenerationStub(channel)
                stream = stub.GenerateStream(make_request(PROMPT, max_new=100, ignore_eos=True))
                tokens = list(next(stream).token_ids)
                rest, exited = _drain_during(process, stream, refuse=role == "coordinator", stub=stub)
        assert tokens + rest == expected
        assert process.proc.returncode == 0
        # its log is complete, nothing lost at exit, and every line is one JSON event
        lines = process.log_file.read_text().splitlines()
        assert [line for line in lines if not line.startswith("{")] == []
        events = [json.loads(line) for line in lines]
        assert (events[-1]["event"], events[-1]["exit_code"]) == ("stopped", 0)
    # so is every other process's, which saw it go (grpc's own lines included) and then stopped
    for other in cluster.processes.values():
        assert [line for line in other.log_file.read_text().splitlines() if not line.startswith("{")] == [], other.role
    fault_report[f"SIGTERM {role.removesuffix('-0')} mid-stream"] = {
        "in_flight_completed": True,
        "exit_code": 0,
        "exited_after_stream_s": round(exited, 2),
    }


# A service that returns right after stopping its server with no grace while clients watch its
# health: grpc's tasks for the cancelled watches are still ending when it returns.
_WATCHED_SERVICE = """
import asyncio, threading
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from specdec.serving.logging import configure_logging
from specdec.serving.server import run_service

WATCHERS = 8
watching = threading.Semaphore(0)

def watch(port):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                watching.release()
        except grpc.RpcError:
            pass

async def main():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for _ in range(WATCHERS):
        threading.Thread(target=watch, args=(port,), daemon=True).start()
    for _ in range(WATCHERS):
        await asyncio.to_thread(watching.acquire, True, 10)
    await server.stop(0)
    return 0

configure_logging()
run_service(main())
"""


def test_calls_still_ending_at_exit_leave_no_traceback_in_the_log() -> None:
    """A service that returns while grpc's tasks for calls it cancelled at the stop are still
    ending exits without a word from grpc about them. Before, leaving the event loop cancelled the tasks
    left, and grpc logged each as an error and printed its CancelledError's traceback to stderr:
    the SIGTERM test failed on it once in CI (a health check's task). Here 8
    watches end at the stop; before the fix 7 of 8 such processes printed tracebacks, so three
    in a row catch it all but once in 500."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _WATCHED_SERVICE],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
        )
        assert done.returncode == 0, done.stderr
        # the service logs nothing itself: neither grpc's error events nor their tracebacks
        assert done.stderr.splitlines() == []


def _second_coordinator(cluster: LocalCluster, state_url: str, workdir: Path, *extra: str) -> ServiceProcess:
    """Another coordinator replica on the cluster's workers and state store (not yet ready)."""
    args = [
        "--target-addresses", cluster.processes["target-0"].address, "--tokenizer", cluster.target_model,
        "--draft-address", cluster.processes["draft"].address, *FAULT_COORDINATOR_ARGS,
        "--state-url", state_url, *extra,
    ]  # fmt: skip
    return spawn("coordinator", args, workdir)


def test_a_stopping_coordinator_hands_its_clients_to_another_replica(
    tmp_path: Path, tiny_models: TinyModels, redis_server: RedisServer, routes: Callable[..., ProxyRoutes]
) -> None:
    """Two coordinator replicas behind one address, as behind a Kubernetes Service: a proxy whose
    new connections go to the replicas that are ready. On SIGTERM the first one finished its
    in-flight stream, but answered every new call that its clients sent on their open connections
    UNAVAILABLE "the server is shutting down" for the whole grace period: a rolling update or an
    HPA scale-down failed the calls of every client connected to the pod it stopped (gRPC
    channels keep their connection; the Service only steers new ones). Now it tells its clients
    to go (HTTP/2 GOAWAY) as it starts to drain: their next calls open a connection to the other
    replica, while the stream in flight still completes where it runs."""
    short = make_request(PROMPT, max_new=8, ignore_eos=True)
    expected_short = reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    expected_long = reference_greedy(str(tiny_models.target), tuple(PROMPT), 200, ignore_eos=True)
    with fault_cluster(
        tmp_path, tiny_models.target, tiny_models.noisy, state_url=redis_server.url, route=routes(0.03),
        coordinator_args=["--grace-period-s", "30"],
    ) as cluster:  # fmt: skip
        first = cluster.processes["coordinator"]
        second = _second_coordinator(cluster, redis_server.url, tmp_path / "second")
        service = TcpProxy(first.address)
        try:
            second.wait_ready(60)
            with grpc.insecure_channel(service.address) as channel:
                stub = coordinator_pb2_grpc.GenerationStub(channel)
                assert list(stub.Generate(short, timeout=30).token_ids) == expected_short  # on the first replica
                stream = stub.GenerateStream(make_request(PROMPT, max_new=200, ignore_eos=True), timeout=120)
                tokens = list(next(stream).token_ids)
                os.kill(first.proc.pid, signal.SIGTERM)
                service.retarget(second.address)  # the endpoints controller drops the stopping pod
                wait_for(lambda: _not_serving(first), 5)
                try:
                    reply = stub.Generate(short, timeout=30)  # main: UNAVAILABLE "the server is shutting down"
                except grpc.RpcError as exc:
                    # grpc core's open issue 41785: a call that reaches the stopping server between
                    # its GOAWAY and the client's reading of it ends CANCELLED before any handler
                    # runs (UNAVAILABLE is meant); nothing was done, so it is sent again. About 1 run
                    # in 10 on a busy 2-core host.
                    assert exc.code() == grpc.StatusCode.CANCELLED and exc.details() == "CANCELLED", exc
                    reply = stub.Generate(short, timeout=30)
                assert list(reply.token_ids) == expected_short
                assert first.proc.poll() is None, "the first replica is still draining its stream"
                tokens += [t for m in stream for t in m.token_ids]
                assert tokens == expected_long
            assert wait_for(lambda: first.proc.poll() is not None, 30) >= 0 and first.proc.returncode == 0
            assert "turn_ended" in second.log_tail(50)  # the second replica served the call
        finally:
            service.close()
            second.stop()


def test_clients_spread_to_a_replica_added_after_they_connected(
    tmp_path: Path, tiny_models: TinyModels, redis_server: RedisServer
) -> None:
    """A client's gRPC channel keeps its connection for ever, and a Service steers only new
    connections: coordinator replicas that the HPA adds under load got no call from the clients
    already connected, however long they ran. A coordinator now ends its connections after
    `--max-connection-age-s` (HTTP/2 GOAWAY; calls in flight go on), so clients reconnect through
    the Service and spread over the replicas there are then. Here the age is 2 s: a client that
    connected when only the first replica served reaches the second one added afterwards
    (main: every call stayed on the first)."""
    request = make_request(PROMPT, max_new=4, ignore_eos=True)
    age = ["--max-connection-age-s", "2"]
    with fault_cluster(
        tmp_path, tiny_models.target, tiny_models.same, state_url=redis_server.url, coordinator_args=age
    ) as cluster:
        second = _second_coordinator(cluster, redis_server.url, tmp_path / "second", *age)
        service = TcpProxy(cluster.address)
        try:
            second.wait_ready(60)
            with grpc.insecure_channel(service.address) as channel:
                stub = coordinator_pb2_grpc.GenerationStub(channel)
                stub.Generate(request, timeout=30)  # connected to the first replica
                service.retarget(second.address)  # new connections now go to the added replica
                served = 0
                deadline = time.monotonic() + 10
                while served == 0 and time.monotonic() < deadline:
                    stub.Generate(request, timeout=30)
                    served = second.log_tail(200).count("turn_ended")
                    time.sleep(0.2)
            assert served > 0, "every call stayed on the first replica"
        finally:
            service.close()
            second.stop()


def _log_problems(process) -> list[str]:  # type: ignore[no-untyped-def]
    """Lines of a service's log that are not JSON events, and its error events."""
    lines = process.log_file.read_text().splitlines()
    return [line for line in lines if not line.startswith("{") or json.loads(line)["level"] in ("error", "critical")]


def test_calls_outliving_the_grace_period_end_unavailable(
    tmp_path: Path,
    tiny_models: TinyModels,
    redis_server: RedisServer,
    routes: Callable[..., ProxyRoutes],
    fault_report: dict,
) -> None:
    """SIGTERM with calls that outlive the grace period: the draft's Propose stream of a running
    turn is ended (the turn goes on target-only, its tokens unchanged), and a client's stream on the
    coordinator ends UNAVAILABLE saying why, its turn rolled back (an engine-API stream likewise).
    Each process exits 0 and logs no error for it (grpc logs a handler it has to cancel itself as an
    error with a traceback). From the coordinator's stop on the state store answers slowly (0.3 s
    each way), so rolling the turns back takes about 4 s, as it can on a loaded host: the calls
    still end with the service's own words once their rollback is done (before, grpc's own stop
    ended them 2.5 s after the grace period, "Cancelling all calls", and the coordinator closed
    its store under the rollbacks: a CI run hit it once)."""
    expected = reference_greedy(str(tiny_models.target), tuple(PROMPT), 150, ignore_eos=True)
    state = TcpProxy(f"127.0.0.1:{redis_server.port}")
    with (
        contextlib.closing(state),
        fault_cluster(
            tmp_path,
            tiny_models.target,
            tiny_models.noisy,
            state_url=f"redis://{state.address}/0",
            route=routes(0.01),
            coordinator_args=["--grace-period-s", "0.5", "--state-timeout-s", "5"],
            draft_args=["--grace-period-s", "0.3"],
        ) as cluster,
    ):
        draft, coordinator = cluster.processes["draft"], cluster.processes["coordinator"]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            stream = stub.GenerateStream(make_request(PROMPT, max_new=150, ignore_eos=True))
            tokens = list(next(stream).token_ids)
            os.kill(draft.proc.pid, signal.SIGTERM)
            tokens += [t for m in stream for t in m.token_ids]
            assert tokens == expected
            assert wait_for(lambda: draft.proc.poll() is not None, 10) >= 0 and draft.proc.returncode == 0

            first = stub.Generate(make_request(PROMPT, max_new=4, ignore_eos=True, session_id="cut"))
            stream = stub.GenerateStream(make_request([7], max_new=150, ignore_eos=True, session_id="cut"))
            assert next(stream).token_ids
            params = vllm_pb2.SamplingParams(max_tokens=150, ignore_eos=True)
            engine = vllm_grpc.VllmEngineStub(channel).Generate(
                vllm_pb2.GenerateRequest(
                    request_id="cut", tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT), sampling_params=params,
                    stream=True,
                )
            )  # fmt: skip
            assert next(engine).chunk.token_ids
            state.delay_s = 0.3
            os.kill(coordinator.proc.pid, signal.SIGTERM)
            errors = []
            for call in (stream, engine):
                with pytest.raises(grpc.RpcError) as err:
                    for _ in call:
                        pass
                errors.append(err.value)
            took = wait_for(lambda: coordinator.proc.poll() is not None, 20)
        for error in errors:  # the native turn and the engine API's alike
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            assert "grace period" in (error.details() or "")
        assert coordinator.proc.returncode == 0
        session = read_session(redis_server.url, "cut")  # as the first turn left it, the lease free
        assert (session.tokens, session.owner) == ([*PROMPT, *first.token_ids], "")
        assert _log_problems(draft) == [] and _log_problems(coordinator) == []
    fault_report["SIGTERM, a call outliving the grace period"] = {
        "draft_stream": "ended; the turn went on target-only with identical output",
        "client_stream": "UNAVAILABLE (grace period), turn rolled back",
        "coordinator_exited_after_s": round(took, 2),
    }


def _not_serving(process) -> bool:  # type: ignore[no-untyped-def]
    """Health says NOT_SERVING, or the server already drained its in-flight calls and closed."""
    try:
        return health(process.address) == "NOT_SERVING"
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE


def _drain_during(process, stream, refuse: bool = False, stub=None) -> tuple[list[int], float]:  # type: ignore[no-untyped-def]
    """Stops ``process`` while its health is probed without pause (as a kubelet's probes may
    be when the stop comes); returns the rest of ``stream`` and how long the process took to
    exit after it."""
    stopped = threading.Event()

    def probe() -> None:
        with grpc.insecure_channel(process.address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            while not stopped.is_set() and process.proc.poll() is None:
                with contextlib.suppress(grpc.RpcError):
                    check(health_pb2.HealthCheckRequest(), timeout=0.3)

    probes = [threading.Thread(target=probe) for _ in range(4)]
    for thread in probes:
        thread.start()
    try:
        os.kill(process.proc.pid, signal.SIGTERM)
        wait_for(lambda: _not_serving(process), 1)
        if refuse:  # a new call on the open channel: it was told to go, and nothing else listens here
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(make_request(PROMPT, max_new=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        tokens = [t for m in stream for t in m.token_ids]
        return tokens, wait_for(lambda: process.proc.poll() is not None, 10)
    finally:
        stopped.set()
        for thread in probes:
            thread.join()


def test_a_cancellation_swallowed_by_a_library_call_still_ends_the_turn(cluster_same: LocalCluster) -> None:
    """A task's cancellation can be lost inside a library call: grpc.aio returns a call's reply
    when the cancel arrives just as the reply does (Python 3.11's wait_for likewise), and the
    gateway's Abort then did nothing: the request ran to its end (seen about 1 in 20 disconnects
    through the gateway). The turn checks at every round whether its task was asked to stop.
    Here a round that swallows the cancellation stands for that call: the in-process coordinator
    runs over the real workers; the consumer cancels its own task after the first round."""
    import asyncio

    from coordinator.engine import Engine
    from coordinator.settings import CoordinatorSettings
    from coordinator.validation import parse_request
    from specdec.serving.metrics import CoordinatorMetrics

    settings = CoordinatorSettings(
        target_addresses=[cluster_same.processes["target-0"].address],
        draft_address=cluster_same.processes["draft"].address,
    )
    request = make_request(PROMPT, k=2, max_new=200, ignore_eos=True)

    async def scenario() -> tuple[int, bool]:
        engine = Engine(settings, CoordinatorMetrics(CollectorRegistry()))
        await engine.start()
        try:
            turn = engine.new_turn(parse_request(request, engine.limits), None)
            run_round = turn._run_round

            async def round_that_swallows_a_cancel() -> object:
                call = asyncio.ensure_future(run_round())
                try:
                    return await asyncio.shield(call)
                except asyncio.CancelledError:
                    return await call  # the reply arrived with the cancellation: returned, the cancel lost

            turn._run_round = round_that_swallows_a_cancel  # type: ignore[method-assign]
            rounds = 0

            async def consume() -> None:
                nonlocal rounds
                async for _ in turn.rounds():
                    rounds += 1
                    if rounds == 1:
                        asyncio.current_task().cancel()  # type: ignore[union-attr]

            task = asyncio.create_task(consume())
            try:
                await task
            except asyncio.CancelledError:
                return rounds, True
            return rounds, False
        finally:
            await engine.stop()

    rounds, cancelled = asyncio.run(scenario())
    assert cancelled, f"the turn ran to its end ({rounds} rounds) after its task was cancelled"
    assert rounds <= 2  # the round in flight when the cancel came may still finish


def test_a_huge_prompt_does_not_stall_other_requests(cluster_same: LocalCluster, fault_report: dict) -> None:
    """A prompt is tokenized off the coordinator's event loop: while a 1,000,000-character prompt
    (the largest allowed) is tokenized, other calls are answered. Before, every other stream,
    health check and lease renewal waited for it (GetInfo took as long as the whole request)."""
    took, worst, error = loop_stall_during(cluster_same.address, coordinator_pb2.GenerateRequest(prompt=HUGE_TEXT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "context length" in (error.details() or "")
    assert took > 0.5  # long enough that a stalled event loop would show
    assert worst < took / 4, (worst, took)
    fault_report["a 1,000,000-character prompt beside other calls"] = {
        "request_s": round(took, 3),
        "worst_other_call_s": round(worst, 3),
    }


def _stalled_stream(api: str, channel: grpc.Channel) -> Iterator[object]:
    """A long stream with large messages (top-20 logprobs): the native API on session "stalled",
    or the vLLM engine API the gateway uses."""
    if api == "native":
        logprobs = {"logprobs": True, "top_logprobs": 20, "prompt_logprobs": 20}
        request = make_request(PROMPT, max_new=200, session_id="stalled", ignore_eos=True, **logprobs)
        return coordinator_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=60)
    # short enough to end well within the write timeout on a slow host (its turn runs on its own)
    params = vllm_pb2.SamplingParams(max_tokens=40, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    engine = vllm_pb2.GenerateRequest(
        request_id="stalled", tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT), sampling_params=params, stream=True
    )
    return vllm_grpc.VllmEngineStub(channel).Generate(engine, timeout=60)


@pytest.mark.parametrize("api", ["native", "engine"])
def test_a_client_that_stops_reading_a_stream_loses_its_turn(
    tmp_path: Path, tiny_models: TinyModels, fault_report: dict, api: str
) -> None:
    """A client that stops reading a stream (here with a 1 KiB flow-control window, as any client
    may set) blocks the coordinator's writes; before, a native turn then held its admission slot,
    its session's lease (renewed for ever) and both workers' caches for as long as the connection
    lived, and an engine-API call (its turn done) stayed in flight, holding up a drain. Past
    --stream-write-timeout-s without a message taken the call ends with DEADLINE_EXCEEDED: a
    native turn rolls back, and the session can be used at once."""
    args = ["--stream-write-timeout-s", "1"]
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, coordinator_args=args) as cluster:
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        with grpc.insecure_channel(cluster.address, options=options) as channel:
            stream = _stalled_stream(api, channel)
            next(stream)  # then read nothing
            started = time.monotonic()
            # the native turn is held at its blocked write and rolled back; an engine request runs
            # on in its own task (its chunks queue up) and, one-shot, keeps its caches for reuse,
            # unless a slow host had not finished it when the write timeout ended the call, which
            # frees them (a CI run waited for its caches in vain)
            kept = (0,) if api == "native" else (0, 2)
            freed = wait_for(lambda: idle(cluster, kept=kept), 10, 0.05)
            time.sleep(max(0.0, 1.5 - (time.monotonic() - started)))  # past the write timeout
            with pytest.raises(grpc.RpcError) as error:
                list(stream)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stopped reading" in (error.value.details() or "")
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            again = stub.Generate(make_request(PROMPT, max_new=8, session_id="stalled", ignore_eos=True), timeout=30)
        assert again.usage.prompt_tokens == len(PROMPT)  # the stalled turn left nothing in the session
        assert list(again.token_ids) == reference_greedy(str(tiny_models.target), tuple(PROMPT), 8, ignore_eos=True)
    assert (1 if api == "native" else 0) <= freed < 5, freed  # native: ended by the write timeout
    fault_report[f"a client that stops reading a stream ({api})"] = {
        "write_timeout_s": 1,
        "freed_after_s": round(freed, 3),
        "waited_s": round(time.monotonic() - started, 3),
    }


def test_a_unary_reply_over_the_message_limit_rolls_the_turn_back(tmp_path: Path, tiny_models: TinyModels) -> None:
    """A unary reply carries every round's logprobs in one message; one that would outgrow the
    coordinator's --max-message-bytes (here 20,000 bytes; 150 tokens at top 20 are about 30,000)
    ends the turn with RESOURCE_EXHAUSTED before it finishes, so the session is rolled back like
    any failed turn. Before, the turn finished and committed, and then the reply could not be
    sent: the caller got an error for a turn its session had kept. A stream (a message per
    round) serves the same request. The engine API's non-streaming reply (a message per
    completion; 240 tokens at top 20 are 29,579 bytes in its packed form) likewise ends with
    RESOURCE_EXHAUSTED that says what to do; before, its send failed with grpc's own "Sent
    message larger than max"."""
    args = ["--max-message-bytes", "20000"]
    with fault_cluster(tmp_path, tiny_models.target, tiny_models.noisy, coordinator_args=args) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.GenerationStub(channel)
            first = make_request(PROMPT, max_new=4, session_id="limit", ignore_eos=True)
            history = [*PROMPT, *stub.Generate(first, timeout=30).token_ids, 9]
            big = make_request([9], max_new=150, session_id="limit", ignore_eos=True, logprobs=True, top_logprobs=20)
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(big, timeout=30)
            after = stub.Generate(make_request([9], max_new=4, session_id="limit", ignore_eos=True), timeout=30)
            big.session_id = "limit-stream"
            streamed = list(stub.GenerateStream(big, timeout=30))
            engine = vllm_pb2.GenerateRequest(
                request_id="big", tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT),
                sampling_params=vllm_pb2.SamplingParams(max_tokens=240, ignore_eos=True, logprobs=20),
            )  # fmt: skip
            with pytest.raises(grpc.RpcError) as engine_error:
                list(vllm_grpc.VllmEngineStub(channel).Generate(engine, timeout=30))
            engine.stream = True
            chunks = list(vllm_grpc.VllmEngineStub(channel).Generate(engine, timeout=30))
        assert engine_error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-message-bytes" in (engine_error.value.details() or ""), engine_error.value.details()
        assert "stream" in (engine_error.value.details() or "")
        assert sum(len(c.chunk.token_ids) for c in chunks) == 240
        assert sum(len(c.chunk.output_logprobs.token_ids) for c in chunks) == 240
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the big turn left nothing behind: the session goes on from its first turn
        assert list(after.token_ids) == reference_greedy(str(tiny_models.target), tuple(history), 4, ignore_eos=True)
        assert "GenerateStream" in (error.value.details() or "")
        assert sum(len(m.token_ids) for m in streamed) == 150
        assert sum(len(m.logprobs) for m in streamed) == 150


class _CancelledAtWrite:
    """A stream call's server context whose client cancels while the first message is written
    (it took the message at once and cancelled: grpc ends the call before the write returns)."""

    def __init__(self) -> None:
        self.written: list[object] = []

    async def write(self, item: object) -> None:
        import asyncio

        self.written.append(item)
        raise asyncio.CancelledError

    def code(self) -> None:
        return None

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


async def test_a_stream_cancelled_during_its_first_write_counts_that_message() -> None:
    """`specdec_rpc_first_message_seconds` times each stream to its first message, when it is
    handed to grpc to send: a client that takes the first message and cancels at once can end
    the call before the server's write returns, and that stream's first message went uncounted
    (main: 0 here; a full run's test_every_rpc_is_counted_by_method_and_status_code_and_timed
    counted 1 of its 2 streams)."""
    import asyncio

    from specdec.serving.metrics import RpcMetrics
    from specdec.serving.security import Authenticator
    from specdec.serving.server import ServerControl, _Rpc, _wrap_stream

    async def messages(request: object, context: object) -> object:
        yield "first"
        yield "second"

    registry = CollectorRegistry()
    rpc = _Rpc("s/Stream", "Stream", ServerControl(), Authenticator(), RpcMetrics(registry))
    context = _CancelledAtWrite()
    with pytest.raises(asyncio.CancelledError):
        await _wrap_stream(messages, rpc, 0.0)(None, context)
    assert context.written == ["first"]
    assert registry.get_sample_value("specdec_rpc_first_message_seconds_count", {"method": "s/Stream"}) == 1
    assert registry.get_sample_value("specdec_rpcs_total", {"method": "s/Stream", "code": "CANCELLED"}) == 1


async def test_calls_that_outlive_the_cancel_wait_are_a_warning() -> None:
    """At a stop, the calls cut off at the end of the grace period get ``cancel_wait_s`` to undo
    their work; one still running after it (its rollback's store did not answer) is ended by
    grpc's own stop with its work left undone, and the operator is told so at warning level,
    with what is left and where it goes, beside the info line of a drain that cancelled calls."""
    import asyncio

    from structlog.testing import capture_logs

    from specdec.serving.server import ServerControl

    control = ServerControl()

    async def call(undo_s: float) -> None:
        control.enter()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(undo_s)  # undoing its work, past the wait when undo_s is long
        finally:
            control.exit()

    quick = asyncio.create_task(call(0.0))
    slow = asyncio.create_task(call(30.0))
    await asyncio.sleep(0)
    with capture_logs() as logs:
        assert not await control.drain(0.05, 0.2)
    assert quick.done() and not slow.done()
    warnings = [entry for entry in logs if entry["event"] == "calls_outlived_cancel_wait"]
    assert len(warnings) == 1, logs
    assert warnings == [
        {
            "event": "calls_outlived_cancel_wait",
            "log_level": "warning",
            "still_running": 1,
            "cancel_wait_s": 0.2,
            "hint": warnings[0]["hint"],
        }
    ]
    assert "--session-lease-s" in warnings[0]["hint"]
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await slow


def _calls_by_code(
    registry: CollectorRegistry, method: str, codes: tuple[str, ...] = ("DEADLINE_EXCEEDED", "INVALID_ARGUMENT")
) -> dict[str, float | None]:
    """How many calls of ``method`` were counted with each of ``codes`` (None: none yet)."""
    return {code: registry.get_sample_value("specdec_rpcs_total", {"method": method, "code": code}) for code in codes}


def _fail_after_the_deadline() -> None:
    time.sleep(0.6)  # holds the event loop: grpc's core ends the call at the deadline meanwhile
    raise InvalidRequest("bad input")


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
async def test_an_error_whose_caller_already_left_is_counted_as_the_caller_saw_it(
    streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that fails (bad input, say) just as its caller's deadline runs out, through a
    real grpc server: grpc's core has ended the call, so sending the error fails inside grpc. The
    call was counted with the error's code (INVALID_ARGUMENT) though the caller got
    DEADLINE_EXCEEDED; and where grpc learnt of the failed send before it learnt the call had
    ended, it logged an error with a traceback ("ExecuteBatchError raised in core by servicer
    method": 4 times in 70,000 random requests with short deadlines against a cluster). The
    window is held open here by a handler that keeps the event loop past the deadline."""
    import asyncio
    import logging

    from structlog.testing import capture_logs

    from specdec.serving.metrics import RpcMetrics
    from specdec.serving.server import ErrorInterceptor, ServerControl

    async def unary(request: bytes, context: object) -> bytes:
        _fail_after_the_deadline()
        return b""

    async def stream(request: bytes, context: object) -> object:
        _fail_after_the_deadline()
        yield b""

    method = grpc.unary_stream_rpc_method_handler(stream) if streaming else grpc.unary_unary_rpc_method_handler(unary)
    registry = CollectorRegistry()
    server = grpc.aio.server(interceptors=[ErrorInterceptor(ServerControl(), RpcMetrics(registry))])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.S", {"M": method})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    def call() -> grpc.StatusCode:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                if streaming:
                    list(channel.unary_stream("/t.S/M")(b"", timeout=0.2))
                else:
                    channel.unary_unary("/t.S/M")(b"", timeout=0.2)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    try:
        with caplog.at_level(logging.WARNING), capture_logs() as logs:
            assert await asyncio.to_thread(call) == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.3)  # grpc logs a failed send after the handler returns
    finally:
        await server.stop(None)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")], logs
    assert _calls_by_code(registry, "t.S/M") == {"DEADLINE_EXCEEDED": 1.0, "INVALID_ARGUMENT": None}


class _EndedBeforeTheStatus:
    """A call's server context that grpc's core ended (the caller's deadline ran out) before the
    handler's error status could be sent: the send fails inside grpc."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        from grpc._cython import cygrpc

        raise cygrpc.ExecuteBatchError("Failed execute_batch: the call has ended")

    def code(self) -> None:
        return None

    def time_remaining(self) -> float:
        return 0.0


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
async def test_a_status_grpc_could_not_send_does_not_leave_the_handler(streaming: bool) -> None:
    """grpc logs a failed send that leaves a handler as an error with a traceback unless it has
    already learnt that the call ended, which depends on the order of two events in grpc's core
    (the failure above, seen in a cluster but not reproducible on demand): the handler itself must
    take it as the caller having left, count it so and end quietly."""
    from specdec.serving.metrics import RpcMetrics
    from specdec.serving.security import Authenticator
    from specdec.serving.server import ServerControl, _Rpc, _wrap_stream, _wrap_unary

    async def unary(request: object, context: object) -> object:
        raise InvalidRequest("bad input")

    async def stream(request: object, context: object) -> object:
        raise InvalidRequest("bad input")
        yield

    registry = CollectorRegistry()
    rpc = _Rpc("s/M", "M", ServerControl(), Authenticator(), RpcMetrics(registry))
    handler = _wrap_stream(stream, rpc, 0.0) if streaming else _wrap_unary(unary, rpc)
    assert await handler(None, _EndedBeforeTheStatus()) is None
    assert _calls_by_code(registry, "s/M") == {"DEADLINE_EXCEEDED": 1.0, "INVALID_ARGUMENT": None}
