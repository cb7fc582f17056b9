"""The README and docs/ stay true: every setting of every service is documented, with its default;
every test and repository file they name exists."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from coordinator.settings import CoordinatorSettings
from draft_worker.settings import DraftSettings
from target_worker.settings import TargetSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("settings_cls", [CoordinatorSettings, DraftSettings, TargetSettings])
def test_readme_documents_every_setting(settings_cls: type[BaseSettings]) -> None:
    for name in settings_cls.model_fields:
        flag, env = f"--{name.replace('_', '-')}", f"SPECDEC_{name.upper()}"
        assert f"`{flag}` / `{env}`" in README, f"README configuration table lacks {flag} / {env}"


_ROLES = {
    CoordinatorSettings: ("coordinator",),
    DraftSettings: ("draft", "workers"),
    TargetSettings: ("target", "workers"),
}


def _documented_default(flag: str) -> str:
    """The default column of the README configuration row of ``--flag``."""
    match = re.search(rf"^\| `--{flag}` / `SPECDEC_[A-Z0-9_]+` \| ([^|]*) \|", README, flags=re.M)
    assert match, f"README configuration table lacks --{flag}"
    return match.group(1).strip()


def _as_documented(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"{value >> 20} MiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("settings_cls", [CoordinatorSettings, DraftSettings, TargetSettings])
def test_readme_states_each_settings_default(settings_cls: type[BaseSettings]) -> None:
    """A default changed in code but not in the table misleads every operator who reads it.
    Settings without a default say ``required``; those left unset say so, or what they fall back
    to; a cell shared by the services says each one's value (``50052 draft``)."""
    for name, field in settings_cls.model_fields.items():
        cell = _documented_default(name.replace("_", "-"))
        if field.is_required():
            assert cell == "required", f"--{name}: required, but the README says {cell!r}"
        elif field.default_factory is not None:
            assert field.default_factory() == [] and cell == "empty", f"--{name}: the README says {cell!r}"
        elif field.default is None:
            assert not re.fullmatch(r"`?[0-9.]+`?|true|false", cell), f"--{name} is unset by default, not {cell!r}"
        elif "," in cell:  # one value per service
            wanted = _as_documented(field.default)
            parts = [part.strip() for part in cell.split(",")]
            assert any(part in (f"{wanted} {role}" for role in _ROLES[settings_cls]) for part in parts), (
                f"--{name}: {settings_cls.__name__} defaults to {wanted}, the README says {cell!r}"
            )
        else:
            wanted = _as_documented(field.default)
            assert cell == wanted, f"--{name}: the code's default is {wanted}, the README says {cell!r}"


def test_generated_stubs_match_the_protos() -> None:
    from specdec.tools.protogen import stale_files

    assert stale_files() == []


def _bench_commands(text: str) -> list[list[str]]:
    """Every ``specdec bench`` command in ``text``'s code blocks, as argv (continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[2:] for line in lines if line.startswith("specdec bench ")]


def test_readme_bench_commands_name_rows_the_bench_has() -> None:
    """A bench command in the README or docs/ (the runs' history) that names a renamed row ran
    only the target-only rows."""
    from specdec.tools.bench import check_methods
    from specdec.tools.cli import bench_config, build_parser

    assert len(_bench_commands(README)) >= 3, "the README's benchmark commands were not found"
    for doc in DOCS:
        for argv in _bench_commands(doc.read_text()):
            check_methods(bench_config(build_parser().parse_args(["bench", *argv])))


def cited_tests(text: str, tests: Path) -> list[str]:
    """The tests ``text`` cites (``file.py::name`` or a bare ``test_...`` name) that ``tests``
    does not hold: a test renamed or removed leaves the sentence citing it unbacked."""
    sources = {path.stem: path.read_text() for path in tests.glob("test_*.py")}
    every = "\n".join(sources.values())
    missing = [
        f"{stem}.py::{name}"
        for stem, name in re.findall(r"\b(test_\w+)\.py::(test_\w+)", text)
        if not re.search(rf"\bdef {name}\(", sources.get(stem, ""))
    ]
    bare = re.findall(r"(?<![\w/.:])(test_\w+)\b(?!\.py|\*)", text)
    missing += [name for name in bare if name not in sources and not re.search(rf"\bdef {name}\(", every)]
    return sorted(set(missing))


def test_the_docs_cite_only_tests_that_exist(tmp_path: Path) -> None:
    for doc in DOCS:
        assert cited_tests(doc.read_text(), ROOT / "tests") == [], f"{doc.name} cites tests that do not exist"
    # the check sees a renamed test, in either form, and a file named with its test
    (tmp_path / "test_a.py").write_text("def test_kept(x):\n    pass\n")
    text = "`test_a.py::test_kept`, `test_a.py::test_gone`, `test_b.py::test_kept`, `test_kept`, `test_lost`, `test_a`"
    assert cited_tests(text, tmp_path) == ["test_a.py::test_gone", "test_b.py::test_kept", "test_lost"]


def test_the_docs_name_only_files_that_exist() -> None:
    """Every repository path the README and docs/ name in code spans or links (reports, plots,
    scripts, manifests) is there: a report moved or a script renamed leaves its sentence unbacked.
    A link or image that names no such top folder is relative to its document (as GitHub reads it)."""
    tops = "docs|scripts|k8s|protos|specdec|coordinator|draft_worker|target_worker|tests|\\.ci"
    for doc in DOCS:
        text = doc.read_text()
        named = re.findall(rf"`((?:{tops})/[^`\s:*]*)`", text) + re.findall(rf"\]\(((?:{tops})/[^)\s]+)\)", text)
        assert named or doc.name != "README.md", "the README's paths were not found"
        missing = sorted({path for path in named if not (ROOT / path).exists()})
        relative = re.findall(rf"\]\((?!(?:{tops})/|[a-z]+:|#)([^)\s]+)\)", text)
        missing += sorted({path for path in relative if not (doc.parent / path).exists()})
        assert missing == [], f"{doc.name} names files that are not in the repository: {missing}"


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "specdec") -> dict[str, argparse.ArgumentParser]:
    """Each leaf command of ``parser`` (``specdec models fetch``...) by its full name."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(_subcommands(child, f"{prefix} {name}"))
    return found or {prefix: parser}


def test_the_commands_table_names_every_flag_each_command_takes() -> None:
    """The README's Commands row of each ``specdec`` command names the flags it takes (in its
    command or its description), and its command names no flag the command refuses."""
    from specdec.tools.cli import build_parser

    rows = [
        line for line in README.split("## Commands", 1)[1].split("\n\n", 2)[1].splitlines() if line.startswith("| `")
    ]
    commands = _subcommands(build_parser())
    assert len(commands) >= 6, "the CLI's commands were not found"
    for name, parser in commands.items():
        if name == "specdec serve":
            continue  # its role's settings: test_readme_documents_every_setting
        row = next((r for r in rows if re.search(rf"`{name}( |`)", r)), None)
        assert row is not None, f"the README's Commands table has no row for `{name}`"
        command_cell = row.split("` |")[0].split(name, 1)[1].split("/ `")[0]
        named = set(re.findall(r"--[a-z][a-z0-9-]*", command_cell))
        takes = {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
        takes.discard("--help")
        assert named <= takes, f"the README's `{name}` names flags it does not take: {sorted(named - takes)}"
        undocumented = sorted(flag for flag in takes if not re.search(rf"{flag}(?![a-z0-9-])", row))
        assert undocumented == [], f"the README's Commands row of `{name}` does not name {undocumented}"
