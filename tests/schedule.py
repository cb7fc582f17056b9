"""pytest plugin: test files are queued longest first, so the two xdist workers end together.

Under ``--dist loadfile`` a worker takes the next file of the queue when it runs short of work.
pytest-xdist queues the files by their number of tests unless told not to
(``--no-loadscope-reorder``), which put ``tests/test_combinations.py`` (9 tests, about 200 s)
near the end, run by one worker while the other had nothing left. Here the collected tests are
sorted by their file's measured seconds (the ini option ``file_seconds`` names the table, a JSON
object of file path to seconds, written by ``scripts/file_seconds.py`` from a ``--durations=0``
run), longest first, each file's tests in their own order; pyproject's addopts turn xdist's
reordering off so the queue keeps it. A file the table does not list counts as 0 s (last).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("file_seconds", "JSON table of each test file's seconds, queued longest first (tests/schedule.py)")


def longest_first(items: list[pytest.Item], seconds: Mapping[str, float], root: Path) -> list[pytest.Item]:
    """``items`` by their file's ``seconds`` (paths relative to ``root``), longest first; items of
    files with equal seconds, and of one file, keep their order (the sort is stable)."""
    return sorted(items, key=lambda item: -seconds.get(item.path.relative_to(root).as_posix(), 0.0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    table = config.getini("file_seconds")
    if table:
        items[:] = longest_first(items, json.loads((config.rootpath / table).read_text()), config.rootpath)
