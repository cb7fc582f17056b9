"""Writes the test files' seconds table (tests/schedule.py) from pytest ``--durations=0`` output.

    PYTEST_ADDOPTS=--durations=0 scripts/test.sh > run.log
    .venv/bin/python scripts/file_seconds.py run.log --out tests/file_seconds.json

Each file's seconds are the sum of its tests' setup, call and teardown times in the log (several
logs: their mean).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

_LINE = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+([^:\s]+)::")


def file_seconds(log: str) -> dict[str, float]:
    """Each test file's seconds in one ``--durations=0`` output."""
    seconds: collections.Counter[str] = collections.Counter()
    for line in log.splitlines():
        match = _LINE.match(line)
        if match:
            seconds[match[2]] += float(match[1])
    return dict(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="pytest output with --durations=0")
    parser.add_argument("--out", type=Path, required=True, help="the table to write (JSON)")
    args = parser.parse_args(argv)
    runs = [file_seconds(path.read_text()) for path in args.logs]
    if not any(runs):
        parser.error("no --durations=0 lines in the logs: run pytest with --durations=0")
    files = sorted({name for run in runs for name in run})
    table = {name: round(sum(run.get(name, 0.0) for run in runs) / len(runs), 1) for name in files}
    args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
