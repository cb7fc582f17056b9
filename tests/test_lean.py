"""The lean one-token step of a fused int8 or int4 draft (specdec.runtime.lean): the model's own logits, bit
for bit, through the cache path the workers use, and only for the models it is built for."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import structlog
import torch

from specdec.runtime import attention
from specdec.runtime import lean as lean_module
from specdec.runtime.kvcache import SessionCaches
from specdec.runtime.lean import LeanStep
from specdec.runtime.modeling import LoadOptions, load_model
from specdec.serving import logging as logging_setup
from tests.tiny_models import build_crashy, build_family

STEP_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "draft_step.py"

INT8 = LoadOptions(device="cpu", quantize="int8", structured_output=False)


def _decode(caches: SessionCaches, vocab: int) -> list[torch.Tensor]:
    """Logits of a prefill, one-token steps, a cut back (a rejected block), more steps, a block and
    steps after it: what a draft worker's session does."""
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    entry = caches.sync("s", 0, 0)
    outs = [caches.extend(entry, tokens(40), 1)]
    outs += [caches.extend(entry, tokens(1), 1) for _ in range(5)]
    entry.truncate(len(entry.tokens) - 3)
    outs += [caches.extend(entry, tokens(1), 1) for _ in range(3)]
    outs.append(caches.extend(entry, tokens(4), 2))
    outs += [caches.extend(entry, tokens(1), 1) for _ in range(3)]
    return outs


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("family", ["LlamaConfig", "Qwen2Config"])
@pytest.mark.parametrize("long_keys", [attention.LONG_KEYS, 8])
def test_a_lean_step_gives_the_model_s_own_logits_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, long_keys: int, quantize: str
) -> None:
    """Every one-token step of a fused int8 or int4 Llama or Qwen2 draft (Qwen2's projections
    have biases, Llama's none) runs the lean step, and every logit of the session (prefill, steps,
    a cut back, a block, steps after it) equals the model's own forward exactly; also where the
    attention reads grouped heads stacked (``long_keys`` 8: a cache past it takes that path)."""
    monkeypatch.setattr(attention, "LONG_KEYS", long_keys)
    options = LoadOptions(device="cpu", quantize=quantize, structured_output=False)
    loaded = load_model(str(build_family(tmp_path / family, family)), options)
    lean = SessionCaches(loaded, 2, 600)
    assert lean.lean is not None
    steps = 0
    step = lean.lean

    def counted(cache: object, token: int) -> torch.Tensor:
        nonlocal steps
        steps += 1
        return step(cache, token)

    lean.lean = counted  # type: ignore[assignment]
    got = _decode(lean, loaded.vocab_size)
    assert steps == 11  # every one-token step, and nothing else
    plain = SessionCaches(loaded, 2, 600)
    plain.lean = None
    want = _decode(plain, loaded.vocab_size)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b)


def test_only_fused_llama_and_qwen2_decoders_of_transformers_own_classes_get_a_lean_step(tmp_path: Path) -> None:
    """An unfused model (float32), another family (Gemma: its norm adds one to its weight) and a
    subclass of LlamaForCausalLM (its forward raises on a token: it must run) keep the model's
    own forward."""
    llama = build_family(tmp_path / "llama", "LlamaConfig")
    assert LeanStep.of(load_model(str(llama), INT8).model) is not None
    assert LeanStep.of(load_model(str(llama), LoadOptions(device="cpu", structured_output=False)).model) is None
    gemma = build_family(tmp_path / "gemma", "GemmaConfig")
    assert LeanStep.of(load_model(str(gemma), INT8).model) is None
    crashy = build_crashy(llama, tmp_path / "crashy", crash_token_id=13)
    loaded = load_model(str(crashy), LoadOptions(device="cpu", quantize="int8", trust_remote_code=True))
    caches = SessionCaches(loaded, 1, 600)
    assert caches.lean is None
    entry = caches.sync("s", 0, 0)
    caches.extend(entry, [5, 6], 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        caches.extend(entry, [13], 1)


def test_the_step_timing_script_compares_both_ways_and_checks_the_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/draft_step.py on a tiny int8 Qwen2: a line per run and the median ratio, the logits
    found equal; a model without a lean step is refused saying so."""
    qwen2 = build_family(tmp_path / "qwen2", "Qwen2Config")
    # the script configures logging for its process: here it would print to this test's captured
    # stderr, closed once the test ends, in every later test of the worker that logs
    monkeypatch.setattr(logging_setup, "configure_logging", lambda *_: None)
    args = ["draft_step.py", str(qwen2), "--context", "20", "--steps", "3", "--runs", "2", "--threads", "1"]
    monkeypatch.setattr("sys.argv", args)
    runpy.run_path(str(STEP_SCRIPT), run_name="__main__")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("run ", "lean / "))]
    assert [line.split(":")[0] for line in printed[:2]] == ["run 0", "run 1"]
    assert printed[2].startswith("lean / model's forward: median ") and printed[2].endswith("logits equal")
    assert len(printed) == 3
    monkeypatch.setattr("sys.argv", [*args[:2], "--quantize", "none"])
    with pytest.raises(SystemExit, match="gets no lean step"):
        runpy.run_path(str(STEP_SCRIPT), run_name="__main__")


def test_a_lean_step_that_differs_from_the_model_s_forward_is_checked_out_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caches check a step of the lean step against the model's forward on a short cache when
    they are made: a step whose logits differ at all (here its norms 0.1% off, as a transformers
    release whose decoder does more might make it) is not used, and the check says so in the log."""
    loaded = load_model(str(build_family(tmp_path / "llama", "LlamaConfig")), INT8)
    assert SessionCaches(loaded, 1, 600).lean is not None
    normed = lean_module._rms_norm
    monkeypatch.setattr(lean_module, "_rms_norm", lambda x, norm: normed(x, norm) * 1.001)  # 0.1% off
    with structlog.testing.capture_logs() as logs:
        caches = SessionCaches(loaded, 1, 600)
    assert caches.lean is None
    (line,) = [line for line in logs if line["event"] == "lean_step_differs"]
    assert line["largest_logit_difference"] > 0


def test_a_lean_step_that_fails_on_the_model_is_checked_out_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lean step that trips on the model (as one might on a decoder whose parts a transformers
    release renamed) leaves the caches to the model's forward, logged with the error, instead of
    failing the worker's start-up."""
    loaded = load_model(str(build_family(tmp_path / "llama", "LlamaConfig")), INT8)

    def renamed(self: LeanStep, cache: object, token: int) -> torch.Tensor:
        raise AttributeError("'LlamaAttention' object has no attribute 'scaling'")

    monkeypatch.setattr(LeanStep, "__call__", renamed)
    with structlog.testing.capture_logs() as logs:
        caches = SessionCaches(loaded, 1, 600)
    assert caches.lean is None
    (line,) = [line for line in logs if line["event"] == "lean_step_differs"]
    assert line["error"] == "AttributeError: 'LlamaAttention' object has no attribute 'scaling'"
    entry = caches.sync("s", 0, 0)
    assert caches.extend(entry, [5], 1).shape == (1, loaded.vocab_size)  # the model's forward
