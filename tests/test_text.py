"""Incremental detokenization never splits characters and adds up to the full decode."""

from __future__ import annotations

from coordinator.text import IncrementalDetokenizer
from tests.tiny_models import build_tokenizer


def test_deltas_add_up_to_the_full_text_with_multibyte_characters() -> None:
    tok = build_tokenizer()
    text = "héllo wörld — 日本語 ✓ done"
    ids = tok(text)["input_ids"]
    context = tok("prefix: ")["input_ids"]
    detok = IncrementalDetokenizer(tok, context)
    deltas = [detok.push([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped() -> None:
    tok = build_tokenizer()
    ids = [*tok("ab")["input_ids"], tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids) + detok.flush() == "ab"
