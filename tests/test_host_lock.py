"""HostLock: co-located CPU workers take turns for their forward passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from specdec.scheduler import HostLock

_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("held")
else:
    print("free")
"""


def _probe(path: Path) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, check=True).stdout


def test_another_process_waits_while_a_forward_holds_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    lock = HostLock(str(path))
    with lock:
        assert _probe(path).strip() == "held"
    assert _probe(path).strip() == "free"


def test_no_file_means_no_locking() -> None:
    lock = HostLock(None)
    with lock, lock:  # re-entrant because it does nothing
        pass
