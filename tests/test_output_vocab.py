"""A draft vocabulary: the draft's output layer scores only the tokens a corpus uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.runtime.modeling import LoadOptions, load_model
from specdec.runtime.output_vocab import (
    RestrictedHead,
    build_output_vocab,
    read_output_vocab,
    restrict_output,
)
from specdec.runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
from specdec.tools.cli import main
from specdec.tools.draft_vocab import corpus_texts, make_draft_vocab
from tests.helpers import draft_vocab_file
from tests.tiny_models import TinyModels, build_tokenizer


@pytest.mark.parametrize("bias", [True, False])
def test_the_restricted_head_computes_the_kept_rows_and_rules_out_the_rest(bias: bool) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias).requires_grad_(False)
    kept = torch.tensor([0, 3, 4, 17, 49])
    restricted = RestrictedHead(head, kept)
    x = torch.randn(2, 3, 16)
    logits = restricted(x)
    assert logits.shape == (2, 3, 50)
    torch.testing.assert_close(logits[..., kept], head(x)[..., kept])
    others = torch.ones(50, dtype=torch.bool)
    others[kept] = False
    assert torch.isneginf(logits[..., others]).all()
    assert torch.softmax(logits, -1)[..., others].sum() == 0  # the draft never proposes them


@pytest.mark.parametrize(
    ("quantize", "kernel"), [("none", "torch"), ("none", "packed"), ("int8", "auto"), ("int4", "auto")]
)
def test_a_draft_loaded_with_a_vocabulary_scores_only_its_tokens_and_the_end_of_sequence(
    tiny_models: TinyModels, tmp_path: Path, quantize: str, kernel: str
) -> None:
    if kernel == "packed" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    kept = list(range(70, 200))
    options = LoadOptions(device="cpu", dtype="float32", quantize=quantize, cpu_kernel=kernel)
    full = load_model(str(tiny_models.target), options)
    path = draft_vocab_file(tmp_path / "vocab.json", tiny_models.target, kept)
    restricted = load_model(str(tiny_models.target), LoadOptions(**{**options.__dict__, "output_vocab": str(path)}))
    assert restricted.vocab_size == full.vocab_size and restricted.eos_token_ids == full.eos_token_ids
    prompt = torch.tensor([[5, 17, 99, 3, 120]])  # int4: a wide pass, on its int8 copies; then a step on int4
    with torch.inference_mode():
        want, got = full.model(prompt).logits[0], restricted.model(prompt).logits[0]
        if quantize == "int4":
            step = prompt[:, -1:]
            want = torch.cat([want, full.model(step).logits[0]])
            got = torch.cat([got, restricted.model(step).logits[0]])
    scored = kept + list(full.eos_token_ids)  # the draft can always end a reply
    if quantize != "none":  # the kept rows quantized on their own: as close to fp32 as the full quantized head
        fp32 = load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float32", cpu_kernel="torch"))
        with torch.inference_mode():
            exact = fp32.model(prompt).logits[0]
            if quantize == "int4":
                exact = torch.cat([exact, fp32.model(prompt[:, -1:]).logits[0]])
            exact = exact[:, scored]
        full_error = float((want[:, scored] - exact).abs().max())
        assert float((got[:, scored] - exact).abs().max()) < 2 * full_error
    else:
        torch.testing.assert_close(got[:, scored], want[:, scored], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[:, [i for i in range(full.vocab_size) if i not in scored]]).all()


def test_building_keeps_special_tokens_then_the_most_frequent() -> None:
    tokenizer = build_tokenizer()
    texts = ["aaa b", "a c"]
    ids = build_output_vocab(tokenizer, texts, 6)  # 3 special tokens + 3
    specials = sorted(tokenizer.all_special_ids)
    a, b, c, space = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c", "Ġ"))
    assert ids[: len(specials)] == specials
    assert ids[len(specials) : len(specials) + 2] == [a, space]  # 4 a's, then 2 spaces
    assert set(ids[len(specials) + 2 :]) == {min(b, c)}  # a tie: the lower id
    filled = build_output_vocab(tokenizer, ["a"], 10)  # the text uses fewer: the lowest ids fill up
    assert len(filled) == 10 == len(set(filled)) and set(filled) >= {a, *specials, 0}
    with pytest.raises(ValueError, match="between 1 and 259"):
        build_output_vocab(tokenizer, texts, 260)


def test_a_vocabulary_file_is_checked_against_the_tokenizer(tiny_models: TinyModels, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_models.target))
    path = draft_vocab_file(tmp_path / "v.json", tiny_models.target, [1, 2, 3])
    assert read_output_vocab(str(path), tokenizer_fingerprint(tokenizer)) == [1, 2, 3]
    with pytest.raises(ValueError, match="another tokenizer"):
        read_output_vocab(str(path), "a different fingerprint")
    (tmp_path / "bad.json").write_text(json.dumps({"token_ids": [1]}))
    with pytest.raises(ValueError, match="not a draft vocabulary file"):
        read_output_vocab(str(tmp_path / "bad.json"), tokenizer_fingerprint(tokenizer))
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        read_output_vocab(str(tmp_path / "missing.json"), tokenizer_fingerprint(tokenizer))
    model = torch.nn.Module()
    model.get_output_embeddings = lambda: torch.nn.Linear(4, 10)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        restrict_output(model, [3, 10])


def test_the_corpus_is_read_from_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.py").write_text("x = 1\n")
    (tmp_path / "d" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "d" / "c.txt").write_text("not a .py file")
    (tmp_path / "d" / "blob.py").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "one.txt").write_text("hello")
    texts = list(corpus_texts([tmp_path / "d", tmp_path / "one.txt"], ["**/*.py"], 10**6))
    assert texts == ["x = 1\n", "y = 2\n", "hello"]
    assert list(corpus_texts([tmp_path / "d"], ["**/*.py", "*.txt"], 10**6)) == ["x = 1\n", "not a .py file", "y = 2\n"]
    assert list(corpus_texts([tmp_path / "d"], ["**/*.py"], 8)) == ["x = 1\n", "y "]
    with pytest.raises(ValueError, match="does not exist"):
        list(corpus_texts([tmp_path / "nope"], ["**/*"], 100))
    with pytest.raises(ValueError, match=r"no UTF-8 text .* \(files matching \*\*/\*.rs or \*.go\)"):
        list(corpus_texts([tmp_path / "d"], ["**/*.rs", "*.go"], 100))
    for nothing in (0, -1):  # read no text at all: a vocabulary of the lowest ids, not of the corpus
        with pytest.raises(ValueError, match=f"--max-bytes must be at least 1, got {nothing}"):
            list(corpus_texts([tmp_path / "d"], ["**/*.py"], nothing))


def test_the_command_writes_a_file_the_draft_worker_loads(tiny_models: TinyModels, tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    out = tmp_path / "vocab.json"
    args = ["draft-vocab", str(tmp_path / "corpus.txt"), "--model", str(tiny_models.target), "--size", "40"]
    assert main([*args, "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert len(document["token_ids"]) == 40 and document["vocab_size"] == 259
    loaded = load_model(str(tiny_models.target), LoadOptions(device="cpu", cpu_kernel="torch", output_vocab=str(out)))
    assert isinstance(loaded.model.get_output_embeddings(), RestrictedHead)
    assert main(["draft-vocab", str(tmp_path / "nope"), "--model", str(tiny_models.target), "--out", str(out)]) == 2


def test_the_command_checks_its_out_before_it_counts(tiny_models: TinyModels, tmp_path: Path) -> None:
    """An --out it cannot write is refused naming the flag before the corpus (up to 200 MB) is
    counted (the command prints the error; its main in this process would bind the log to this
    test's captured stderr)."""
    (tmp_path / "corpus.txt").write_text("x = 1\n")
    (tmp_path / "a-file").write_text("")
    for out, expected in ((tmp_path, "is a directory"), (tmp_path / "a-file" / "v.json", "cannot write --out")):
        with pytest.raises(ValueError, match=expected) as refused:
            make_draft_vocab(str(tiny_models.target), [tmp_path / "corpus.txt"], 40, out)
        assert f"--out {out}" in str(refused.value)
