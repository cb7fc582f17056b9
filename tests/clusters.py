"""Clusters for fault tests: each scenario gets its own processes (it kills, pauses or restarts them)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from specdec.tools.launch import LocalCluster, ServiceProcess
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

FAULT_COORDINATOR_ARGS = [
    "--max-speculative-tokens", "8", "--draft-timeout-s", "1", "--draft-retry-s", "1", "--target-retry-s", "1",
    "--grace-period-s", "5",
]  # fmt: skip
FAULT_WORKER_ARGS = ["--device", "cpu", "--torch-threads", "1", "--grace-period-s", "2"]


@contextmanager
def fault_cluster(
    workdir: Path,
    target: Path,
    draft: Path | None,
    *,
    targets: int = 1,
    drafts: int = 1,
    state_url: str = "memory://",
    coordinator_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    draft_args: Sequence[str] = (),
    route: Callable[[str, str], str] | None = None,
    replica_args: Mapping[str, Sequence[str]] | None = None,
) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        str(target),
        str(draft) if draft else None,
        workdir,
        worker_args=[*FAULT_WORKER_ARGS, *worker_args],
        draft_args=draft_args,
        coordinator_args=[*FAULT_COORDINATOR_ARGS, "--state-url", state_url, *coordinator_args],
        startup_timeout_s=120,
        targets=targets,
        drafts=drafts,
        route=route,
        replica_args=replica_args or {},
    )
    with cluster:
        yield cluster


def stream_with_fault(
    stub: coordinator_pb2_grpc.GenerationStub,
    request: coordinator_pb2.GenerateRequest,
    fault: Callable[[], None],
    after: int = 2,
) -> tuple[list[int], coordinator_pb2.GenerateStreamResponse, float]:
    """Streams a completion, runs ``fault()`` after ``after`` messages; returns tokens, last message, max gap."""
    tokens: list[int] = []
    last = None
    gap, previous = 0.0, time.monotonic()
    for i, message in enumerate(stub.GenerateStream(request, timeout=120)):
        now = time.monotonic()
        gap, previous = max(gap, now - previous), now
        tokens += message.token_ids
        last = message
        if i + 1 == after:
            fault()
            previous = time.monotonic()
    assert last is not None
    return tokens, last, gap


def logged_events(service: ServiceProcess) -> list[dict[str, Any]]:
    """A service's JSON log lines so far, in order."""
    return [json.loads(line) for line in service.log_file.read_text().splitlines() if line.startswith("{")]


def metric(cluster: LocalCluster, role: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus metric's samples scraped from a service's /metrics (only the
    samples whose labels contain ``label``, e.g. ``reason="eos"``, when given: 0 while no such
    labelled sample exists yet)."""
    port = cluster.processes[role].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    values = [float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE) if label in (m[1] or "")]
    if not values and not label:
        raise KeyError(f"{name} not exported by {role}")
    return sum(values)


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> float:
    """Polls until ``predicate()``; returns the seconds it took; raises TimeoutError."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)
    return time.monotonic() - started


# 1,000,000 CJK characters (the default --max-prompt-chars): 3,000,000 tokens for the byte-level
# test tokenizer, 1.6 million for Qwen2.5's; tokenizing them takes seconds.
HUGE_TEXT = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(1_000_000))


def loop_stall_during(address: str, request: coordinator_pb2.GenerateRequest) -> tuple[float, float, grpc.RpcError]:
    """Sends ``request`` (one that fails: its prompt is too long for the context) while another
    client polls GetInfo; returns (seconds the request took, the longest GetInfo call meanwhile,
    the request's error). A coordinator that tokenized on its event loop answers nobody meanwhile."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=10)
        calls: list[float] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                started = time.perf_counter()
                stub.GetInfo(coordinator_pb2.GetInfoRequest(), timeout=60)
                calls.append(time.perf_counter() - started)
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        started = time.perf_counter()
        try:
            stub.Generate(request, timeout=60)
        except grpc.RpcError as exc:
            error = exc
        else:
            raise AssertionError("the huge prompt was served")
        finally:
            took = time.perf_counter() - started
            done.set()
            poller.join()
    return took, max(calls), error
