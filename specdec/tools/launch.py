"""Starts the three services as local processes on free ports (demo, benchmark, tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from specdec.v1 import common_pb2


class ServiceProc(Protocol):
    """What the launcher needs of a started process (subprocess.Popen has it)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ProcessStarter(Protocol):
    """Starts `specdec <argv>` as a process of its own with stdout and stderr appended to
    ``log_file`` and ``env`` as its whole environment."""

    def __call__(self, argv: Sequence[str], log_file: Path, env: dict[str, str]) -> ServiceProc: ...


# Set by start_process: the service stops when its stdin, a pipe from the process that started it,
# reaches its end (see stop_with_launcher)
STOP_WITH_LAUNCHER = "SPECDEC_STOP_WITH_LAUNCHER"


def start_process(argv: Sequence[str], log_file: Path, env: dict[str, str]) -> ServiceProc:
    """The default starter: a fresh `python -m specdec <argv>`, its stdin a pipe that only this
    process holds open, so that a service outlives neither a stop nor a kill of its launcher."""
    with log_file.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "specdec", *argv],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, STOP_WITH_LAUNCHER: "1"},
        )


def stop_with_launcher() -> None:
    """In a service started by start_process: stops it once its stdin reaches its end, which is
    when the process that started it has gone, however it went (``specdec generate`` or ``specdec
    bench`` killed, or out of memory), with SIGTERM: the service's graceful stop once it has bound
    its ports, the signal's default (it ends) before. A watcher thread, as the service's own loop
    may be busy loading a model."""
    if os.environ.pop(STOP_WITH_LAUNCHER, None) != "1":
        return

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


_starter: ProcessStarter = start_process


def use_starter(starter: ProcessStarter | None) -> None:
    """Makes spawn() start processes with ``starter`` (None: the default), e.g. a test suite's fork
    server that has the heavy imports done once."""
    global _starter
    _starter = starter or start_process


class LaunchError(RuntimeError):
    """A service process did not come up."""


@dataclass
class ServiceProcess:
    """A running `specdec serve <role>` process."""

    role: str
    proc: ServiceProc
    ready_file: Path
    log_file: Path
    args: Sequence[str]
    env: dict[str, str] | None
    port: int = 0
    metrics_port: int = 0
    health_port: int = 0
    local_port: int = 0  # the loopback-only plaintext API port, 0 = none

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.role} exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready_file.exists():
                ready = json.loads(self.ready_file.read_text())
                self.port = int(ready["port"])
                self.metrics_port = int(ready.get("metrics_port", 0))
                self.health_port = int(ready.get("health_port", 0))
                self.local_port = int(ready.get("local_port", 0))
                return
            time.sleep(0.05)
        raise LaunchError(f"{self.role} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_stdin()

    def _close_stdin(self) -> None:
        """Lets go of the stopped process's stdin pipe (start_process's), if it has one."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def restart(self, timeout_s: float = 120.0) -> None:
        """Kills the process (if still running) and starts it again on the same port."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_stdin()
        name = self.ready_file.name.removesuffix(".ready.json")
        fresh = spawn(self.role, self.args, self.ready_file.parent, self.env, port=self.port, name=name)
        fresh.wait_ready(timeout_s)
        self.proc, self.metrics_port = fresh.proc, fresh.metrics_port


def spawn(
    role: str,
    args: Sequence[str],
    workdir: Path,
    env: dict[str, str] | None = None,
    port: int = 0,
    name: str | None = None,
) -> ServiceProcess:
    """Starts `python -m specdec serve <role> --port <port> ...`; call wait_ready() next."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = name or role
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_file = workdir / f"{name}.log"
    argv = ["serve", role, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metrics-port", "0", "--ready-file", str(ready), *args]
    proc = _starter(argv, log_file, {**os.environ, **(env or {})})
    return ServiceProcess(role=role, proc=proc, ready_file=ready, log_file=log_file, args=list(args), env=env)


def worker_info(address: str, role: str, timeout_s: float = 5.0) -> common_pb2.WorkerInfo:
    """The ``Info`` a running worker reports (its dtype, sessions, counters); ``role`` "draft" or
    any target replica's name ("target", "target-1")."""
    import grpc

    from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        if role.startswith("target"):
            stub = target_pb2_grpc.TargetWorkerStub(channel)
            return stub.Info(target_pb2.TargetInfoRequest(), timeout=timeout_s).info
        return draft_pb2_grpc.DraftWorkerStub(channel).Info(draft_pb2.DraftInfoRequest(), timeout=timeout_s).info


@dataclass
class LocalCluster:
    """Target replica(s) + optional draft replica(s) + coordinator processes; use as a context manager.

    The processes are named ``target-0`` .. ``target-{targets-1}`` and ``draft``, ``draft-1`` ..
    ``draft-{drafts-1}``. ``route`` maps (role, address) to the address the coordinator should use, so that tests can
    put a proxy in between.
    """

    target_model: str
    draft_model: str | None
    workdir: Path
    worker_args: Sequence[str] = ()
    draft_args: Sequence[str] = ()
    coordinator_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0
    targets: int = 1
    drafts: int = 1  # draft replicas (with a draft model)
    route: Callable[[str, str], str] | None = None
    share_cpu: bool = False  # CPU workers on this host take turns for the cores (see HostLock)
    replica_args: Mapping[str, Sequence[str]] = field(default_factory=dict)  # more flags, by process name
    processes: dict[str, ServiceProcess] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.processes["coordinator"].address

    def start(self) -> LocalCluster:
        lock = ["--cpu-lock-file", str(self.workdir / "cpu.lock")] if self.share_cpu else []
        try:
            for i in range(self.targets):
                name = f"target-{i}"
                args = ["--model", self.target_model, *self.worker_args, *lock, *self.replica_args.get(name, ())]
                self.processes[name] = spawn("target", args, self.workdir, self.env, name=name)
            for name in self._draft_names():
                draft_args = ["--model", str(self.draft_model), *self.worker_args, *lock, *self.draft_args]
                draft_args += self.replica_args.get(name, ())
                self.processes[name] = spawn("draft", draft_args, self.workdir, self.env, name=name)
            for process in list(self.processes.values()):
                process.wait_ready(self.startup_timeout_s)
            self.processes["coordinator"] = spawn("coordinator", self._coordinator_args(), self.workdir, self.env)
            self.processes["coordinator"].wait_ready(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _routed(self, name: str) -> str:
        address = self.processes[name].address
        return self.route(name, address) if self.route else address

    def _coordinator_args(self) -> list[str]:
        targets = ",".join(self._routed(f"target-{i}") for i in range(self.targets))
        args = ["--target-addresses", targets, "--tokenizer", self.target_model]
        if self.draft_model:
            args += ["--draft-addresses", ",".join(self._routed(name) for name in self._draft_names())]
        if self.share_cpu:  # a busy draft waits its turn for the cores behind a full target batch
            args += ["--draft-timeout-s", "30"]
        return [*args, *self.coordinator_args]

    def __repr__(self) -> str:
        """Its processes' addresses and where their logs are: a failing test that prints its
        fixtures (pytest's locals; Hypothesis' arguments of a failing example, through
        ``_repr_pretty_``) stays short enough for its own error to show."""
        running = ", ".join(f"{name}={process.address}" for name, process in self.processes.items())
        return f"LocalCluster({running or 'not started'}; logs in {self.workdir})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """The same line for pretty printers (IPython's protocol, which Hypothesis' printer of a
        failing example follows; without it that printer lists a dataclass's every field)."""
        printer.text(repr(self))

    def _draft_names(self) -> list[str]:
        return ["draft", *(f"draft-{i}" for i in range(1, self.drafts))] if self.draft_model else []

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
