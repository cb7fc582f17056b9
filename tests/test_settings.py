"""Settings: env prefix, CLI flags, validation at start-up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coordinator.settings import CoordinatorSettings
from specdec.serving.settings import load_settings
from target_worker.settings import TargetSettings
from tests.forkserver import run_command


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
        ["--target-addresses", "a:1", "--state-url", "redis://r:6379/0", "--state-replica-acks", "17"],
        [  # not below the state store's socket timeout (2 s)
            *("--target-addresses", "a:1", "--state-url", "redis://r:6379/0"),
            *("--state-replica-acks", "1", "--state-replica-wait-s", "2"),
        ],
        ["--target-addresses", "a:1", "--max-session-tokens-per-caller", "1000"],  # no limit of sessions
    ],
)
def test_invalid_settings_stop_start_up(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, argv, "c")


def test_replica_acks_are_a_redis_setting_waited_for_within_one_call() -> None:
    argv = ["--target-addresses", "a:1", "--state-url", "redis://r:6379/0", "--state-replica-acks", "2"]
    settings = load_settings(CoordinatorSettings, argv, "c")
    assert (settings.state_replica_acks, settings.state_replica_wait_s) == (2, 1.0)


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


def test_draft_replicas_are_listed_in_one_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--draft-addresses lists the draft replicas (as --target-addresses lists the targets); the
    single --draft-address stays for one replica; both at once is refused, as is a repeated entry."""
    settings = load_settings(CoordinatorSettings, ["--target-addresses", "a:1", "--draft-addresses", "d:1, d:2"], "c")
    assert settings.drafts == ["d:1", "d:2"]
    settings = load_settings(CoordinatorSettings, ["--target-addresses", "a:1", "--draft-address", "d:3"], "c")
    assert settings.drafts == ["d:3"]
    assert load_settings(CoordinatorSettings, ["--target-addresses", "a:1"], "c").drafts == []
    monkeypatch.setenv("SPECDEC_DRAFT_ADDRESS", "d:3")
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, ["--target-addresses", "a:1", "--draft-addresses", "d:1,d:2"], "c")
    assert "both draft_address and draft_addresses are set" in capsys.readouterr().err
    monkeypatch.delenv("SPECDEC_DRAFT_ADDRESS")
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, ["--target-addresses", "a:1", "--draft-addresses", "d:1,d:1"], "c")
    assert "d:1 listed twice: list each replica once" in capsys.readouterr().err


def test_bad_device_is_rejected() -> None:
    with pytest.raises(SystemExit):
        load_settings(TargetSettings, ["--model", "m", "--device", "tpu"], "t")


def test_a_prompt_is_prefilled_in_chunks_sized_for_the_device() -> None:
    auto = load_settings(TargetSettings, ["--model", "m"], "target")
    assert (auto.prefill_chunk("cpu"), auto.prefill_chunk("cuda")) == (256, 2048)
    chosen = load_settings(TargetSettings, ["--model", "m", "--prefill-chunk-tokens", "64"], "target")
    assert (chosen.prefill_chunk("cpu"), chosen.prefill_chunk("cuda")) == (64, 64)


def test_a_specdec_variable_that_no_service_reads_is_reported() -> None:
    """A typo in a variable's name (SPECDEC_NUM_SPECULATIVE_TOKEN) was ignored without a word, so
    the service ran with the default the operator meant to change. Variables that another role
    reads (the shared ConfigMap sets coordinator settings on the workers too) are not reported,
    nor SPECDEC_MODELS (`specdec models fetch`'s folder); names are matched as pydantic-settings
    matches them, whatever their case."""
    from specdec.serving.settings import unknown_environment

    environ = {
        "SPECDEC_NUM_SPECULATIVE_TOKEN": "8",  # one letter short
        "specdec_max_sessions": "4",  # a target setting, in lower case
        "SPECDEC_TARGET_ADDRESSES": "t:1",  # the coordinator's, seen by a worker
        "SPECDEC_DRAFT_LAYERS": "2",  # the draft's
        "SPECDEC_MODELS": "/models",
        "SPECDEC_GPU": "yes",  # nothing like any setting
        "PATH": "/bin",
    }
    assert unknown_environment(environ) == [
        ("SPECDEC_NUM_SPECULATIVE_TOKEN", "SPECDEC_NUM_SPECULATIVE_TOKENS"),
        ("SPECDEC_GPU", None),
    ]


def test_a_service_logs_the_specdec_variables_no_service_reads(tmp_path: Path) -> None:
    """A real coordinator process: one `unknown_setting` warning per such variable, with the setting
    it resembles, at start-up (without the value, which may be a secret)."""
    env = {**os.environ, "SPECDEC_DRAFT_ADRESS": "secret-value", "SPECDEC_TARGET_ADDRESSES": "127.0.0.1:1"}
    done = run_command(["serve", "coordinator", "--port", "0", "--worker-startup-timeout-s", "1"], 120, env)
    lines = [json.loads(line) for line in done.stdout.splitlines() + done.stderr.splitlines() if line.startswith("{")]
    unknown = [line for line in lines if line["event"] == "unknown_setting"]
    assert len(unknown) == 1, done.stderr[-2000:]
    assert unknown[0]["variable"] == "SPECDEC_DRAFT_ADRESS" and unknown[0]["did_you_mean"] == "SPECDEC_DRAFT_ADDRESS"
    assert unknown[0]["level"] == "warning"
    assert "secret-value" not in done.stdout + done.stderr


# What Kubernetes puts in the environment of every pod for each Service of its namespace (unless
# the pod sets enableServiceLinks: false): here for k8s/'s Service `specdec` and `specdec-redis`.
SERVICE_LINKS = {
    "SPECDEC_SERVICE_HOST": "10.96.0.10",
    "SPECDEC_SERVICE_PORT": "50051",
    "SPECDEC_SERVICE_PORT_GRPC": "50051",
    "SPECDEC_PORT": "tcp://10.96.0.10:50051",
    "SPECDEC_PORT_50051_TCP": "tcp://10.96.0.10:50051",
    "SPECDEC_PORT_50051_TCP_PROTO": "tcp",
    "SPECDEC_PORT_50051_TCP_PORT": "50051",
    "SPECDEC_PORT_50051_TCP_ADDR": "10.96.0.10",
    "SPECDEC_REDIS_SERVICE_HOST": "10.96.0.11",
    "SPECDEC_REDIS_PORT": "tcp://10.96.0.11:6379",
}


def test_kubernetes_service_links_are_not_reported_as_unknown_settings() -> None:
    """A deployment that keeps Kubernetes' service links (its own manifests) gets a dozen
    SPECDEC_* variables per Service; they are no typo of the operator's and are not reported."""
    from specdec.serving.settings import unknown_environment

    assert unknown_environment({**SERVICE_LINKS, "SPECDEC_NUM_SPECULATIVE_TOKEN": "8"}) == [
        ("SPECDEC_NUM_SPECULATIVE_TOKEN", "SPECDEC_NUM_SPECULATIVE_TOKENS")
    ]


def test_a_service_link_in_place_of_a_setting_says_what_set_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Service named `specdec` (k8s/'s coordinator Service) makes Kubernetes set
    SPECDEC_PORT=tcp://IP:PORT in every pod of the namespace that does not set SPECDEC_PORT itself;
    the error said only that the port is not an integer."""
    for name, value in SERVICE_LINKS.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        load_settings(CoordinatorSettings, ["--target-addresses", "a:1"], "c")
    error = capsys.readouterr().err
    assert "SPECDEC_PORT" in error and "service link" in error and "enableServiceLinks: false" in error
