"""A fork server for the suite's service processes.

The suite starts about 400 service processes (a cluster per fault scenario), and each took a median
4.5-6 s from its start to serving on this 2-core machine, almost all of it importing torch and
transformers: most of the suite's time. This server (``python -m tests.forkserver``, started once
by ForkServer) imports them once and forks a child per service. The child is a process of its own:
it gets its own argv, environment, working directory, stdin (/dev/null) and log (stdout and
stderr), resets the signal handling to a fresh interpreter's and runs the production entry point,
``specdec.tools.cli.main``, exactly as ``python -m specdec`` does; its exit status is its own.
Neither grpc nor specdec's servers are loaded before the fork (serve_role still sets GRPC_VERBOSITY
before grpc loads), and the server checks that it runs no thread of its own (numpy's and scipy's
OpenBLAS thread pools are fork-safe: they are re-created in the child, as in a PyTorch DataLoader
worker).

Whatever the imports write to stderr (a warning a fresh service would have written to its log) goes
to the server's stderr file, which the suite checks is empty at the end.

Protocol, one JSON object per line: requests on the server's stdin ``{"argv", "env", "cwd",
"log"}``, answered on its stdout in order with ``{"pid"}``; each child's exit is reported as
``{"exited": pid, "code": N}`` (N as Popen.returncode: -signal for a signal). When its stdin
closes the server kills the children it has left and exits.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# variables that torch, transformers and tokenizers read when they load: a service that needs other
# values than the server loaded with cannot be forked from it
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS", "CUDA", "HF_", "TRANSFORMERS", "TOKENIZERS")
# what every service imports before it serves (grpc and the servers are left to the child)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "tokenizers",
    "pydantic_settings",
    "structlog",
    "prometheus_client",
)


def _child(request: dict) -> list[str]:
    """Turns a just-forked child into the service's process; returns its `specdec` argv."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the only handler the server set
    signal.set_wakeup_fd(-1)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    sys.argv = [str(ROOT / "specdec" / "__main__.py"), *request["argv"]]
    return list(request["argv"])


def _serve() -> list[str] | None:
    """The server's loop; returns in a forked child only (with the child's argv)."""
    for name in PRELOAD:
        __import__(name)
    loaded = sorted(m for m in ("grpc", "specdec.serving") if m in sys.modules)
    if loaded or threading.active_count() != 1:
        raise SystemExit(f"the fork server must not load {loaded} or run Python threads before forking")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    pending = b""
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)

    def send(message: dict) -> None:
        os.write(1, json.dumps(message).encode() + b"\n")

    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    children.discard(pid)
                    send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the suite has gone: so do the services it left
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    return _child(request)
                children.add(pid)
                send({"pid": pid})


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class ForkedProcess:
    """A service process forked by the server: the parts of subprocess.Popen the launcher uses."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.argv = argv  # its `specdec` arguments (its /proc cmdline is the server's)
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The suite's side: starts the server on first use; ``start`` is a launch.ProcessStarter."""

    def __init__(self, stderr_file: Path) -> None:
        self.stderr_file = stderr_file
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._pids: list[int] = []
        self._pid_ready = threading.Condition()
        self._processes: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._gone = False  # the server's stdout closed
        self._loaded_env: dict[str, str] = {}

    def start(self, argv: Sequence[str], log_file: Path, env: dict[str, str]) -> ForkedProcess:
        request = {"argv": list(argv), "env": env, "cwd": os.getcwd(), "log": str(log_file)}
        with self._lock:
            server = self._ensure_server()
            if _import_time(env) != self._loaded_env:
                raise ValueError("a service needs another import-time environment than the fork server loaded with")
            assert server.stdin is not None
            server.stdin.write(json.dumps(request).encode() + b"\n")
            server.stdin.flush()
            with self._pid_ready:
                if not self._pid_ready.wait_for(lambda: self._pids or self._gone, timeout=120):
                    raise RuntimeError(f"the fork server did not answer; see {self.stderr_file}")
                if not self._pids:
                    raise RuntimeError(f"the fork server exited: {self.stderr_file.read_text()[-2000:]}")
                process = ForkedProcess(self._pids.pop(0), list(argv))
                self._processes[process.pid] = process
                if process.pid in self._early_exits:
                    process._exit(self._early_exits.pop(process.pid))
        return process

    def running(self) -> list[ForkedProcess]:
        """The processes started and not yet exited."""
        with self._pid_ready:
            return [process for process in self._processes.values() if process.returncode is None]

    def _ensure_server(self) -> subprocess.Popen[bytes]:
        if self._server is None:
            self._loaded_env = _import_time(dict(os.environ))
            with self.stderr_file.open("ab") as stderr:
                self._server = subprocess.Popen(
                    [sys.executable, "-m", "tests.forkserver"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT,
                )  # fmt: skip
            threading.Thread(target=self._read, args=(self._server,), daemon=True).start()
        return self._server

    def _read(self, server: subprocess.Popen[bytes]) -> None:
        assert server.stdout is not None
        for line in server.stdout:
            message = json.loads(line)
            with self._pid_ready:
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    process = self._processes.get(message["exited"])
                    if process is None:  # exited before start() had recorded it
                        self._early_exits[message["exited"]] = message["code"]
                    else:
                        process._exit(message["code"])
                self._pid_ready.notify_all()
        with self._pid_ready:
            self._gone = True
            self._pid_ready.notify_all()

    def close(self) -> str:
        """Stops the server (and any service still running); returns what it wrote to stderr."""
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(timeout=30)
        return self.stderr_file.read_text() if self.stderr_file.exists() else ""


if __name__ == "__main__":
    argv = _serve()
    if argv is not None:
        from specdec.tools.cli import main

        sys.exit(main(argv))
