"""No request can hurt the service: extreme but type-valid values, one session's trouble, worker survival.

Every test runs the real processes (coordinator, draft and target workers) on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specdec.launch import LocalCluster
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import fault_cluster, metric
from tests.reference import make_request, reference_greedy
from tests.tiny_models import TinyModels

PROMPT = [5, 17, 99, 3]
U32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1e-45  # the smallest positive (denormal) float32


def _sampled(**sampling: object) -> coordinator_pb2.GenerateRequest:
    return make_request(PROMPT, k=4, max_new=8, **sampling)


EXTREME = [
    ("temperature 1e-40", _sampled(temperature=1e-40, seed=1)),
    ("temperature 1e-30, top_k 1", _sampled(temperature=1e-30, top_k=1, seed=1)),
    ("temperature 1e-6", _sampled(temperature=1e-6, seed=1)),
    ("temperature 1e-5", _sampled(temperature=1e-5, seed=1)),
    ("temperature 1e-4", _sampled(temperature=1e-4, seed=1)),
    ("temperature float32 max", _sampled(temperature=FLOAT32_MAX, seed=1)),
    ("top_p smallest float", _sampled(temperature=1.0, top_p=FLOAT32_TINY, seed=2)),
    ("top_p just below 1", _sampled(temperature=1.0, top_p=0.99999994, seed=2)),
    ("top_k 2^31-1", _sampled(temperature=0.7, top_k=2**31 - 1, seed=3)),
    ("seed 2^64-1", _sampled(temperature=1.0, seed=2**64 - 1)),
    ("seed 0", _sampled(temperature=1.0, seed=0)),
    ("100k stop ids", _sampled(temperature=1.0, seed=4, stop_token_ids=[i % 250 + 3 for i in range(100_000)])),
    ("tiny temperature, tiny top_p", _sampled(temperature=1e-3, top_p=FLOAT32_TINY, seed=5)),
    ("max_new_tokens 2^32-1", make_request(PROMPT, max_new=U32_MAX)),
    ("K 2^32-1", make_request(PROMPT, k=U32_MAX)),
    ("token id 2^32-1", make_request([U32_MAX])),
    ("stop id 2^32-1", _sampled(stop_token_ids=[U32_MAX])),
    ("session id with a newline", make_request(PROMPT, session_id="chat\n")),
    ("session id of 129 characters", make_request(PROMPT, session_id="a" * 129)),
]


def _pids(cluster: LocalCluster) -> dict[str, int]:
    return {name: p.proc.pid for name, p in cluster.processes.items() if p.proc.poll() is None}


@pytest.fixture(scope="module")
def robust_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """A pipelined cluster with a sometimes-right draft (both workers sample on every request)."""
    workdir = Path(tmp_path_factory.mktemp("robust"))
    with fault_cluster(
        workdir, tiny_models.target, tiny_models.noisy, coordinator_args=["--speculation-mode", "pipelined"]
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
