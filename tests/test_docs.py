"""The README stays true: every setting of every service is documented."""

from __future__ import annotations

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
