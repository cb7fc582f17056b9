"""Shared fixtures: a real redis-server, tiny random models built from a config."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from specdec.tools import launch
from specdec.tools.launch import LocalCluster
from tests import forkserver
from tests.forkserver import ForkServer
from tests.helpers import RedisServer
from tests.netproxy import ProxyRoutes
from tests.tiny_models import TinyModels, build_tiny_models

pytest_plugins = ["tests.alone", "tests.schedule"]

HOST_THREADS = torch.get_num_threads()  # torch's default: the host's cores
torch.set_num_threads(1)  # (what the fixtures set up before the first test have)


@pytest.fixture(autouse=True)
def _torch_threads(request: pytest.FixtureRequest) -> None:
    """One intra-op thread in a test that shares the host: two xdist workers share its two cores
    with the services they start, and torch's OpenMP threads spin while they wait for a core that
    another process holds (the windowed-cache test of a tiny model took 17 s on two threads beside
    one busy process, 3.7 s on one; about the same alone). A test marked ``alone`` has the host's
    cores."""
    torch.set_num_threads(HOST_THREADS if request.node.get_closest_marker("alone") else 1)


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """Service processes are forked from a server that has torch and transformers loaded (see
    tests/forkserver.py); what those imports wrote to stderr, a service's log would have held."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver") / "stderr.log")
    launch.use_starter(server.start)
    forkserver.serve_commands(server)
    yield server
    forkserver.serve_commands(None)
    launch.use_starter(None)
    written = server.close()
    assert not written, f"the fork server's imports wrote to stderr:\n{written[-2000:]}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return build_tiny_models(Path(tmp_path_factory.mktemp("models")))


CLUSTER_WORKER_ARGS = ["--device", "cpu", "--torch-threads", "1"]
CLUSTER_COORDINATOR_ARGS = ["--max-speculative-tokens", "8"]


def _cluster(
    tmp_path_factory: pytest.TempPathFactory,
    target: Path,
    draft: Path | None,
    name: str,
    state_url: str = "memory://",
    coordinator_args: Sequence[str] = (),
) -> Iterator[LocalCluster]:
    workdir = Path(tmp_path_factory.mktemp(name))
    cluster = LocalCluster(
        str(target),
        str(draft) if draft else None,
        workdir,
        worker_args=CLUSTER_WORKER_ARGS,
        coordinator_args=[*CLUSTER_COORDINATOR_ARGS, "--state-url", state_url, *coordinator_args],
        startup_timeout_s=120,
    )
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster_same(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """Target + a draft identical to it + coordinator, as separate processes."""
    yield from _cluster(tmp_path_factory, tiny_models.target, tiny_models.same, "cluster-same")


@pytest.fixture(scope="session")
def cluster_other(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels, redis_server: RedisServer
) -> Iterator[LocalCluster]:
    """Target + an unrelated draft + coordinator keeping session state in a real redis-server."""
    yield from _cluster(tmp_path_factory, tiny_models.target, tiny_models.other, "cluster-other", redis_server.url)


@pytest.fixture(scope="session")
def cluster_adversarial(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """Target + a draft that always proposes the target's least likely token."""
    yield from _cluster(tmp_path_factory, tiny_models.target, tiny_models.adversarial, "cluster-adversarial")


@pytest.fixture(scope="session")
def fault_report() -> Iterator[dict[str, dict[str, object]]]:
    """Measurements of the fault scenarios, written to build/fault-report.json for docs/faults.md."""
    report: dict[str, dict[str, object]] = {}
    yield report
    if report:
        out = Path(__file__).resolve().parents[1] / "build" / "fault-report.json"
        out.parent.mkdir(exist_ok=True)
        from tests.alone import locked  # imported here: pytest imports the plugin first (assertion rewriting)

        with locked(out.parent / "fault-report.lock", fcntl.LOCK_EX):  # pytest-xdist workers each add their rows
            previous = json.loads(out.read_text()) if out.exists() else {}
            out.write_text(json.dumps({**previous, **report}, indent=2, sort_keys=True))


@pytest.fixture
def routes() -> Iterator[Callable[..., ProxyRoutes]]:
    """Makes ProxyRoutes for a fault cluster; closes their proxies afterwards."""
    made: list[ProxyRoutes] = []

    def make(delay_s: float = 0.0, roles: tuple[str, ...] = ("target",)) -> ProxyRoutes:
        made.append(ProxyRoutes(delay_s, roles))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="session")
def cluster_pipelined(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """Target + a sometimes-right draft + a coordinator in pipelined mode."""
    mode = ["--speculation-mode", "pipelined"]
    yield from _cluster(
        tmp_path_factory, tiny_models.target, tiny_models.noisy, "cluster-pipelined", coordinator_args=mode
    )


@pytest.fixture(scope="session")
def cluster_sequential(tmp_path_factory: pytest.TempPathFactory, tiny_models: TinyModels) -> Iterator[LocalCluster]:
    """The same models as cluster_pipelined, coordinator in sequential mode."""
    mode = ["--speculation-mode", "sequential"]
    yield from _cluster(
        tmp_path_factory, tiny_models.target, tiny_models.noisy, "cluster-sequential", coordinator_args=mode
    )
