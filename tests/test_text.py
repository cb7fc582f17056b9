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


def _stream(tok, text: str, stops: list[str], include: bool = False, per_push: int = 1) -> tuple[int, list[str], str]:  # type: ignore[no-untyped-def]
    """Feeds ``text``'s tokens ``per_push`` at a time (several per round, as speculation commits
    them); returns the tokens taken, the deltas a stream would send, and the matched stop."""
    from coordinator.text import ReplyText

    ids = tok(text)["input_ids"]
    reply = ReplyText(tok, tok("context: ")["input_ids"], stops, include)
    taken, deltas = 0, []
    for start in range(0, len(ids), per_push):
        chunk = ids[start : start + per_push]
        n = reply.push(chunk)
        taken += n
        stopped = reply.matched is not None
        deltas.append(reply.take(final=stopped or start + per_push >= len(ids)))
        if stopped:
            break
    return taken, deltas, reply.matched or ""


def test_stop_string_cuts_at_the_token_that_completes_it() -> None:
    tok = build_tokenizer()
    text = "héllo wörld — 日本語 ✓ done"
    for per_push in (1, 3, 8):
        taken, deltas, matched = _stream(tok, text, ["本語", "zzz"], per_push=per_push)
        # byte-level tokens: the stop ends with the last byte of 語
        assert taken == len(tok("héllo wörld — 日本語")["input_ids"]) and matched == "本語"
        assert "".join(deltas) == "héllo wörld — 日"
        taken, deltas, _ = _stream(tok, text, ["本語"], include=True, per_push=per_push)
        assert "".join(deltas) == "héllo wörld — 日本語"


def test_a_stream_never_shows_text_that_a_stop_string_later_removes() -> None:
    tok = build_tokenizer()
    _, deltas, matched = _stream(tok, "abc done dog", ["dog", "dx"])
    assert matched == "dog" and "".join(deltas) == "abc done "
    shown = ""
    for delta in deltas:
        shown += delta
        assert "abc done ".startswith(shown)  # never a piece of the stop string
    # a tail that looked like a stop's beginning ("d") is released once it cannot match
    _, deltas, matched = _stream(tok, "abc done", ["dx"])
    assert matched == "" and "".join(deltas) == "abc done"


def test_no_stop_strings_passes_every_token() -> None:
    tok = build_tokenizer()
    taken, deltas, matched = _stream(tok, "plain text", [], per_push=4)
    assert taken == len(tok("plain text")["input_ids"]) and "".join(deltas) == "plain text" and matched == ""


def test_stop_strings_do_not_match_before_min_tokens() -> None:
    """ "ab" occurs at tokens 1-2 and again at 6-7: with min_tokens 4 only the second one ends the
    reply; a match completed by the min_tokens-th token itself counts."""
    from coordinator.text import ReplyText

    tok = build_tokenizer()
    ids = tok("abxyzab!")["input_ids"]  # one token per byte
    for min_tokens, taken in [(0, 2), (2, 2), (3, 7), (7, 7)]:
        reply = ReplyText(tok, [], ["ab"], False, min_tokens)
        assert reply.push(ids) == taken, min_tokens
        assert reply.matched == "ab"
    reply = ReplyText(tok, [], ["ab"], False, 8)
    assert reply.push(ids) == len(ids) and reply.matched is None
