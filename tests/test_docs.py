"""The README stays true: every setting of every service is documented."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from coordinator.settings import CoordinatorSettings
from draft_worker.settings import DraftSettings
from target_worker.settings import TargetSettings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize("settings_cls", [CoordinatorSettings, DraftSettings, TargetSettings])
def test_readme_documents_every_setting(settings_cls: type[BaseSettings]) -> None:
    for name in settings_cls.model_fields:
        flag, env = f"--{name.replace('_', '-')}", f"SPECDEC_{name.upper()}"
        assert f"`{flag}` / `{env}`" in README, f"README configuration table lacks {flag} / {env}"


def test_generated_stubs_match_the_protos() -> None:
    from specdec.tools.protogen import stale_files

    assert stale_files() == []


def _bench_commands() -> list[list[str]]:
    """Every ``specdec bench`` command in the README's code blocks, as argv (continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[2:] for line in lines if line.startswith("specdec bench ")]


def test_readme_bench_commands_name_rows_the_bench_has() -> None:
    """A README bench command that names a renamed row ran only the target-only rows."""
    from specdec.tools.bench import check_methods
    from specdec.tools.cli import bench_config, build_parser

    commands = _bench_commands()
    assert len(commands) >= 3, "the README's benchmark commands were not found"
    for argv in commands:
        check_methods(bench_config(build_parser().parse_args(["bench", *argv])))
