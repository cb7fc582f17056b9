"""Settings: env prefix, CLI flags, validation at start-up."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings
from specdec.serving.settings import load_settings
from target_worker.settings import TargetSettings


def test_cli_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_MODEL", "from-env")
    monkeypatch.setenv("SPECDEC_MAX_SESSIONS", "7")
    settings = load_settings(TargetSettings, ["--model", "from-cli", "--device", "cpu"], "t")
    assert settings.model == "from-cli" and settings.max_sessions == 7 and settings.device == "cpu"


def test_list_setting_from_comma_separated_flag() -> None:
    settings = load_settings(CoordinatorSettings, ["--target-addresses", "a:1,b:2"], "c")
    assert settings.target_addresses == ["a:1", "b:2"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--target-addresses", "a:1", "--num-speculative-tokens", "9", "--max-speculative-tokens", "4"],
        ["--target-addresses", "a:1", "--port", "70000"],
        ["--target-addresses", "a:1", "--session-lease-s", "60"],  # not above worker timeout 60 + state retry 5
        ["--target-addresses", "a:1", "--worker-timeout-s", "100"],
    ],
)
def test_invalid_settings_stop_start_up(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, argv, "c")


def test_bad_device_is_rejected() -> None:
    with pytest.raises(SystemExit):
        load_settings(TargetSettings, ["--model", "m", "--device", "tpu"], "t")
