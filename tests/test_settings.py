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


@pytest.mark.parametrize("addresses", ["a:1,", "", "a:1,,b:2", " ", "a:1,a:1"])
def test_target_addresses_without_a_blank_or_repeated_entry(addresses: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A trailing or doubled comma made an empty address the coordinator waited for until its
    start-up timeout (600 s); a repeated one made one worker two replicas to fail over between."""
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, ["--target-addresses", addresses], "c")
    assert "target_addresses (--target-addresses / SPECDEC_TARGET_ADDRESSES)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "expected"),
    [('["a:1","b:2"]', ["a:1", "b:2"]), ("a:1,b:2", ["a:1", "b:2"]), ("a:1", ["a:1"]), (' [ "a:1" ] ', ["a:1"])],
)
def test_a_list_in_the_environment_is_json_or_comma_separated(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: list[str]
) -> None:
    """SPECDEC_TARGET_ADDRESSES=t0:50051 (written as the flag takes it) ended start-up with
    pydantic's traceback ("error parsing value for field"): the environment took JSON lists only."""
    monkeypatch.setenv("SPECDEC_TARGET_ADDRESSES", value)
    monkeypatch.setenv("SPECDEC_TLS_ALLOWED_CLIENT_NAMES", value)
    for name in ("CERT", "KEY", "CLIENT_CA"):  # read when the server starts, not here
        monkeypatch.setenv(f"SPECDEC_TLS_{name}_FILE", f"/etc/specdec/{name.lower()}.pem")
    settings = load_settings(CoordinatorSettings, [], "c")
    assert settings.target_addresses == expected and settings.tls_allowed_client_names == expected


def test_a_list_in_the_environment_that_is_broken_json_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPECDEC_TARGET_ADDRESSES", '["a:1",')
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, [], "c")
    error = capsys.readouterr().err
    assert "invalid setting target_addresses (--target-addresses / SPECDEC_TARGET_ADDRESSES)" in error
    assert "a JSON list of strings or comma-separated" in error


def test_addresses_are_stripped_and_a_blank_draft_address_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECDEC_DRAFT_ADDRESS="" (a ConfigMap's way to say none) is target-only decoding, not a
    draft at the address "" waited for at start-up."""
    monkeypatch.setenv("SPECDEC_DRAFT_ADDRESS", " ")
    settings = load_settings(CoordinatorSettings, ["--target-addresses", "a:1, b:2 "], "c")
    assert settings.target_addresses == ["a:1", "b:2"] and settings.draft_address is None
    settings = load_settings(CoordinatorSettings, ["--target-addresses", "a:1", "--draft-address", " d:3"], "c")
    assert settings.draft_address == "d:3"


def test_bad_device_is_rejected() -> None:
    with pytest.raises(SystemExit):
        load_settings(TargetSettings, ["--model", "m", "--device", "tpu"], "t")
