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

The suite's CLI commands (``specdec generate``, ``specdec bench``) start services themselves: a
command forked with ``"fork_server"`` (the server's Unix socket) starts them through this server
too, over a connection of its own with the same protocol (a child whose connection closes, its
command gone, is killed). Such a command's stdout and stderr go to the files ``"stdout"`` and
``"stderr"`` (``ForkServer.run``: what subprocess.run with capture_output gives). A request with
``"script"`` runs that file instead of ``specdec`` (``run_script``: the repository's scripts, as
``python <script> <argv>`` runs them: their folder first on sys.path, ``__name__ == "__main__"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
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


def _child(request: dict) -> dict:
    """Turns a just-forked child into the service's process; returns its request."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the only handler the server set
    signal.set_wakeup_fd(-1)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(request.get(name, request.get("log")), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    script = request.get("script")
    sys.argv = [script or str(ROOT / "specdec" / "__main__.py"), *request["argv"]]
    if script:  # as ``python <script>`` starts: its folder, then PYTHONPATH's, before the rest
        sys.path[:0] = [str(Path(script).parent), *filter(None, request["env"].get("PYTHONPATH", "").split(os.pathsep))]
    if request.get("fork_server"):  # a command that starts services: forked by this server as well
        from specdec.tools import launch

        launch.use_starter(_SocketClient(request["fork_server"]).start)
    return request


def _serve(listen: str | None) -> dict | None:
    """The server's loop; returns in a forked child only (with the child's request). ``listen``: a
    Unix socket path where commands it forked ask for their services."""
    for name in PRELOAD:
        __import__(name)
    loaded = sorted(m for m in ("grpc", "specdec.serving") if m in sys.modules)
    if loaded or threading.active_count() != 1:
        raise SystemExit(f"the fork server must not load {loaded} or run Python threads before forking")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    owners: dict[int, Callable[[dict], None]] = {}  # child pid -> where its exit is reported
    pending: dict[int, bytes] = {0: b""}  # what each requester (stdin: 0, or a connection's fd) sent so far
    connections: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    listener = None
    if listen:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(listen)
        listener.listen()
        selector.register(listener, selectors.EVENT_READ)

    def to_suite(message: dict) -> None:
        os.write(1, json.dumps(message).encode() + b"\n")

    def to_connection(connection: socket.socket) -> Callable[[dict], None]:
        def send(message: dict) -> None:
            with contextlib.suppress(OSError):  # the command has gone
                connection.sendall(json.dumps(message).encode() + b"\n")

        return send

    def kill(send: Callable[[dict], None] | None) -> None:
        """Kills the children of one requester (None: all)."""
        for pid, owner in owners.items():
            if send is None or owner is send:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    senders: dict[int, Callable[[dict], None]] = {0: to_suite}
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                while owners:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    owner = owners.pop(pid, None)
                    if owner is not None:
                        owner({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            if listener is not None and key.fileobj is listener:
                connection, _ = listener.accept()
                fd = connection.fileno()
                connections[fd], pending[fd], senders[fd] = connection, b"", to_connection(connection)
                selector.register(connection, selectors.EVENT_READ)
                continue
            fd = key.fd
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                if fd == 0:  # the suite has gone: so do the services it left
                    kill(None)
                    return None
                kill(senders[fd])  # a command has gone: so do the services it left
                selector.unregister(connections[fd])
                connections.pop(fd).close()
                del pending[fd], senders[fd]
                continue
            pending[fd] += chunk
            while b"\n" in pending[fd]:
                line, pending[fd] = pending[fd].split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for held in (listener, *connections.values()):  # their fds are closed by _child;
                        if held is not None:  # their objects must not close the numbers again later
                            held.detach()
                    return _child(request)
                owners[pid] = senders[fd]
                senders[fd]({"pid": pid})


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class ForkedProcess:
    """A service process forked by the server: the parts of subprocess.Popen the launcher uses."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.argv = argv  # its `specdec` arguments (its /proc cmdline is the server's)
        self.returncode: int | None = None
        self.stdin = None  # the server gives its children /dev/null (a child whose requester has gone is killed)
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


class _Client:
    """Asks a fork server for processes over a stream of JSON lines (see the module doc): the
    suite over the server's stdin and stdout, a command over a socket connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pids: list[int] = []
        self._pid_ready = threading.Condition()
        self._processes: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._gone = False  # the server's stream closed
        self._loaded_env: dict[str, str] = {}
        self._where = "the fork server's stderr"

    def _connect(self) -> None:
        """Makes sure there is a server to send to (and a thread reading its answers)."""
        raise NotImplementedError

    def _send(self, data: bytes) -> None:
        raise NotImplementedError

    def start(self, argv: Sequence[str], log_file: Path, env: dict[str, str]) -> ForkedProcess:
        """launch.ProcessStarter: ``specdec <argv>`` with stdout and stderr in ``log_file``."""
        return self.request({"argv": list(argv), "env": env, "cwd": os.getcwd(), "log": str(log_file)})

    def request(self, request: dict) -> ForkedProcess:
        with self._lock:
            self._connect()
            if _import_time(request["env"]) != self._loaded_env:
                raise ValueError("a service needs another import-time environment than the fork server loaded with")
            self._send(json.dumps(request).encode() + b"\n")
            with self._pid_ready:
                if not self._pid_ready.wait_for(lambda: self._pids or self._gone, timeout=120):
                    raise RuntimeError(f"the fork server did not answer; see {self._where}")
                if not self._pids:
                    raise RuntimeError(f"the fork server has gone; see {self._where}")
                process = ForkedProcess(self._pids.pop(0), list(request["argv"]))
                self._processes[process.pid] = process
                if process.pid in self._early_exits:
                    process._exit(self._early_exits.pop(process.pid))
        return process

    def running(self) -> list[ForkedProcess]:
        """The processes started and not yet exited."""
        with self._pid_ready:
            return [process for process in self._processes.values() if process.returncode is None]

    def _read(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            message = json.loads(line)
            with self._pid_ready:
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    process = self._processes.get(message["exited"])
                    if process is None:  # exited before request() had recorded it
                        self._early_exits[message["exited"]] = message["code"]
                    else:
                        process._exit(message["code"])
                self._pid_ready.notify_all()
        with self._pid_ready:
            self._gone = True
            self._pid_ready.notify_all()


class _SocketClient(_Client):
    """A forked command's side: its services are forked by the server at ``path`` too."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path
        self._socket: socket.socket | None = None
        self._loaded_env = _import_time(dict(os.environ))  # the server's: this process was forked with it

    def _connect(self) -> None:
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket.connect(self._path)
            threading.Thread(target=self._read, args=(self._socket.makefile("rb"),), daemon=True).start()

    def _send(self, data: bytes) -> None:
        assert self._socket is not None
        self._socket.sendall(data)


class ForkServer(_Client):
    """The suite's side: starts the server on first use; ``start`` is a launch.ProcessStarter."""

    def __init__(self, stderr_file: Path) -> None:
        super().__init__()
        self.stderr_file = stderr_file
        self._where = str(stderr_file)
        self.socket_path = stderr_file.parent / "forkserver.sock"
        self._server: subprocess.Popen[bytes] | None = None

    def _connect(self) -> None:
        if self._server is None:
            self._loaded_env = _import_time(dict(os.environ))
            with self.stderr_file.open("ab") as stderr:
                self._server = subprocess.Popen(
                    [sys.executable, "-m", "tests.forkserver", str(self.socket_path)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT,
                )  # fmt: skip
            threading.Thread(target=self._read, args=(self._server.stdout,), daemon=True).start()

    def _send(self, data: bytes) -> None:
        assert self._server is not None and self._server.stdin is not None
        self._server.stdin.write(data)
        self._server.stdin.flush()

    def run(
        self, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None, script: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``python -m specdec <argv>`` (or ``python <script> <argv>``) as subprocess.run with
        capture_output and text gives it (stdin empty; on ``timeout`` the command is killed, with
        the services it started, and TimeoutExpired raised), but forked, the services it starts
        forked too."""
        env = dict(os.environ if env is None else env)
        with self._lock:
            self._connect()
        if _import_time(env) != self._loaded_env:  # not one the server can fork: a fresh process
            return _fresh(argv, timeout, env, script)
        folder = Path(tempfile.mkdtemp(prefix="command-", dir=self.stderr_file.parent))
        out, err = folder / "stdout", folder / "stderr"
        request = {
            "argv": list(argv), "env": env, "cwd": os.getcwd(),
            "stdout": str(out), "stderr": str(err), "fork_server": str(self.socket_path),
        }  # fmt: skip
        if script is not None:
            request["script"] = str(script)
        process = self.request(request)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
            raise
        return subprocess.CompletedProcess(_command(argv, script), code, out.read_text(), err.read_text())

    def close(self) -> str:
        """Stops the server (and any service still running); returns what it wrote to stderr."""
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(timeout=30)
        return self.stderr_file.read_text() if self.stderr_file.exists() else ""


_commands: ForkServer | None = None  # the suite's server, for run_command


def serve_commands(server: ForkServer | None) -> None:
    """Makes ``run_command`` fork commands from ``server`` (None: start them as fresh processes)."""
    global _commands
    _commands = server


def run_command(
    argv: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m specdec <argv>`` with its output captured (see ForkServer.run)."""
    return _commands.run(argv, timeout, env) if _commands is not None else _fresh(argv, timeout, env)


def run_script(
    script: Path, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python <script> <argv>`` with its output captured (see ForkServer.run)."""
    return _commands.run(argv, timeout, env, script) if _commands is not None else _fresh(argv, timeout, env, script)


def _command(argv: Sequence[str], script: Path | None) -> list[str]:
    return [sys.executable, *([str(script)] if script is not None else ["-m", "specdec"]), *argv]


def _fresh(
    argv: Sequence[str], timeout: float, env: dict[str, str] | None, script: Path | None = None
) -> subprocess.CompletedProcess[str]:
    args = _command(argv, script)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    request = _serve(sys.argv[1] if len(sys.argv) > 1 else None)
    if request is not None:
        if request.get("script"):
            import runpy

            runpy.run_path(request["script"], run_name="__main__")
            sys.exit(0)
        from specdec.tools.cli import main

        sys.exit(main(request["argv"]))
