"""Incremental detokenization never splits characters and adds up to the full decode."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from coordinator.text import IncrementalDetokenizer
from tests.tiny_models import build_byte_fallback_tokenizer, build_tokenizer


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


def _streamed(
    tok: PreTrainedTokenizerBase, context: Sequence[int], ids: Sequence[int], sizes: Sequence[int], skip: bool = True
) -> str:
    """The deltas (and the final flush) of ``ids`` pushed ``sizes[0]``, ``sizes[1]``, ... at a time."""
    detok = IncrementalDetokenizer(tok, context, skip_special=skip)
    deltas, start, turn = [], 0, 0
    while start < len(ids):
        size = sizes[turn % len(sizes)]
        deltas.append(detok.push(ids[start : start + size]))
        start, turn = start + size, turn + 1
    deltas.append(detok.flush())
    return "".join(deltas)


def _after(tok: PreTrainedTokenizerBase, context: Sequence[int], ids: Sequence[int], skip: bool = True) -> str:
    """The text ``ids`` add after ``context`` when the two are decoded together."""
    before = tok.decode(list(context), skip_special_tokens=skip)
    whole = tok.decode([*context, *ids], skip_special_tokens=skip)
    assert whole.startswith(before)
    return whole[len(before) :]


BYTE_SPELLED = "hello 字测试 world 测试的字hello a😀b the 日本語 中文"


@pytest.mark.parametrize("per_push", [1, 2, 3, 5, 8, 20])
def test_characters_spelled_in_byte_tokens_come_out_whole(per_push: int) -> None:
    """Llama 2, Mistral and Gemma spell a character outside their vocabulary as UTF-8 byte tokens
    and decode a run of them as a whole (U+FFFD per byte where the run is not valid UTF-8). A
    decode window that starts inside such a run garbles it: the text must still be the decode of
    the whole reply, for any number of tokens per round."""
    tok = build_byte_fallback_tokenizer()
    context = tok("the", add_special_tokens=False)["input_ids"]
    ids = tok(BYTE_SPELLED, add_special_tokens=False)["input_ids"]
    assert sum(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids) > 40  # runs of byte tokens
    assert _streamed(tok, context, ids, [per_push]) == _after(tok, context, ids) == " " + BYTE_SPELLED


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 258), max_size=80), st.lists(st.integers(1, 24), min_size=1, max_size=6))
def test_any_byte_level_reply_adds_up_to_its_decode(ids: list[int], sizes: list[int]) -> None:
    """Any ids (incomplete and invalid UTF-8, special tokens) in any rounds: the deltas add up to
    the decode of the whole reply."""
    tok = build_tokenizer()
    context = tok("ctx ")["input_ids"]
    assert _streamed(tok, context, ids, sizes) == _after(tok, context, ids)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 258), max_size=80), st.lists(st.integers(1, 24), min_size=1, max_size=6))
def test_any_byte_level_reply_keeping_special_tokens_adds_up_to_its_decode(ids: list[int], sizes: list[int]) -> None:
    """With special tokens kept (vLLM's skip_special_tokens=false), their text is the reply's too:
    the deltas add up to the decode of the whole reply with them."""
    tok = build_tokenizer()
    context = [*tok("ctx ")["input_ids"], tok.eos_token_id]
    assert _streamed(tok, context, ids, sizes, skip=False) == _after(tok, context, ids, skip=False)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 267), max_size=60),
    st.integers(0, 8),
    st.lists(st.integers(1, 12), min_size=1, max_size=6),
)
def test_any_byte_fallback_ids_keeping_special_tokens_give_one_text_whatever_the_rounds(
    ids: list[int], cut: int, sizes: list[int]
) -> None:
    """Special tokens kept among byte-fallback ids: the same text in any rounds as one token at a
    time, and where no byte run goes invalid, the decode of the whole reply with them."""
    tok = build_byte_fallback_tokenizer()
    context, reply = ids[:cut], ids[cut:]
    streamed = _streamed(tok, context, reply, sizes, skip=False)
    assert streamed == _streamed(tok, context, reply, [1], skip=False)
    whole = tok.decode(ids, skip_special_tokens=False)
    if "\ufffd" not in whole and whole.startswith(tok.decode(context, skip_special_tokens=False)):
        assert streamed == _after(tok, context, reply, skip=False)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.integers(0, 60), st.lists(st.integers(1, 24), min_size=1, max_size=6))
def test_any_byte_fallback_text_adds_up_to_its_decode(text: str, cut: int, sizes: list[int]) -> None:
    """Any text, split into prompt and reply anywhere but inside a character, in any rounds."""
    tok = build_byte_fallback_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    context, reply = ids[:cut], ids[cut:]
    assume(tok.decode([*context, *reply]).startswith(tok.decode(context)))
    assert _streamed(tok, context, reply, sizes) == _after(tok, context, reply)


@pytest.mark.parametrize("per_push", [1, 4])
def test_a_reply_that_goes_on_with_the_prompt_s_byte_tokens_is_not_garbled(per_push: int) -> None:
    """A completion prompt that ends in characters spelled in byte tokens, and a reply that goes on
    in them: the decode window must not start inside the prompt's run of byte tokens."""
    tok = build_byte_fallback_tokenizer()
    text = "测试的字符串 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]  # "▁", then 3 byte tokens a character
    for cut in (4, 7, 10, 13, 16):
        context, reply = ids[:cut], ids[cut:]
        assert _streamed(tok, context, reply, [per_push]) == _after(tok, context, reply) == text[cut // 3 :]


@pytest.mark.parametrize("sizes", [[1], [2], [5], [7], [3, 1]])
def test_a_byte_run_that_turns_invalid_keeps_the_characters_already_complete(sizes: list[int]) -> None:
    """The tokenizer's own decode turns every byte of a run of byte tokens that is not valid UTF-8
    as a whole into U+FFFD, the valid characters in it too: 中, a stray continuation byte, A and
    another stray byte are six U+FFFD. A stream has sent 中 by the time the stray byte comes and
    cannot take it back, so the reply keeps it, in whatever rounds the tokens come; the rest of
    the run is decoded as the tokenizer decodes it (the README says so)."""
    tok = build_byte_fallback_tokenizer()
    ids = tok.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0xAD>", "<0x85>", "<0x41>", "<0x85>", "▁a"])
    assert tok.decode(ids) == "\ufffd" * 6 + " a"
    assert _streamed(tok, [], ids, sizes) == "中" + "\ufffd" * 3 + " a"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(3, 267), max_size=60),
    st.integers(0, 8),
    st.lists(st.integers(1, 12), min_size=1, max_size=6),
)
def test_any_byte_fallback_ids_give_one_text_whatever_the_rounds(ids: list[int], cut: int, sizes: list[int]) -> None:
    """Any byte-fallback ids (runs of byte tokens that are not valid UTF-8 included) give the same
    text in any rounds as one token at a time: the text is the tokens', not the blocks' in which
    speculation happened to accept them (it was not: a run decoded in one window came out as
    U+FFFD where the same run split between rounds kept its characters)."""
    tok = build_byte_fallback_tokenizer()
    context, reply = ids[:cut], ids[cut:]
    assert _streamed(tok, context, reply, sizes) == _streamed(tok, context, reply, [1])


@pytest.mark.parametrize(
    ("tokenizer", "piece"),
    [
        (build_tokenizer, "Ä"),  # byte 0xC4: a UTF-8 lead byte that the next byte never completes
        (build_tokenizer, "</s>"),  # a special token: no text
        (build_byte_fallback_tokenizer, "<0x80>"),
        (build_byte_fallback_tokenizer, "<pad>"),
    ],
)
def test_a_reply_held_back_for_good_costs_linear_decoding(
    tokenizer: type[PreTrainedTokenizerBase], piece: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text that ends in U+FFFD (or adds nothing) after every token is held back; each round
    decoded everything since the last release again, so a reply of n such tokens (a client can
    ask for them with logit_bias) cost O(n^2) on the coordinator's event loop (as in SGLang
    #34740): 4,000,000 token decodes for these 2,000. Now it is linear."""
    tok = tokenizer()
    token = tok.convert_tokens_to_ids(piece)
    assert token is not None and token != tok.unk_token_id
    ids, context = [token] * 2000, tok("ab", add_special_tokens=False)["input_ids"]
    decoded = 0
    decode = tok.decode

    def counting(token_ids: list[int], **kwargs: object) -> str:
        nonlocal decoded
        decoded += len(token_ids)
        return decode(token_ids, **kwargs)

    monkeypatch.setattr(tok, "decode", counting)
    text = _streamed(tok, context, ids, [1])
    monkeypatch.setattr(tok, "decode", decode)
    assert text == _after(tok, context, ids)
    assert decoded < 100 * len(ids), decoded


def test_special_tokens_are_skipped() -> None:
    tok = build_tokenizer()
    ids = [*tok("ab")["input_ids"], tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids) + detok.flush() == "ab"


def test_special_tokens_kept_on_request_are_text_that_stop_strings_match() -> None:
    """skip_special_tokens=false (vLLM's, the engine protocol's): a special token's text is part of
    the reply and of what stop strings are matched against, as vLLM matches them; skipped (the
    default), a stop string never spans one."""
    from coordinator.text import ReplyText

    tok = build_tokenizer()
    ids = [*tok("ab")["input_ids"], tok.pad_token_id, *tok("c")["input_ids"]]
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special=False)
    assert detok.push(ids) + detok.flush() == "ab<pad>c"
    for skip, stops, taken, text in (
        (False, ["b<pad>"], 3, "a"),
        (False, ["bc"], 4, "ab<pad>c"),
        (True, ["b<pad>"], 4, "abc"),
        (True, ["bc"], 4, "a"),
    ):
        reply = ReplyText(tok, [tok.bos_token_id], stops, include_stop=False, skip_special=skip)
        assert (reply.push(ids), reply.take(final=True)) == (taken, text), (skip, stops)


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


def test_a_stop_string_completed_before_min_tokens_never_matches_later() -> None:
    """A longer stop string widens the window searched for each new token; a shorter one that
    lies wholly in text completed before min_tokens must not match in it once the reply reaches
    min_tokens (it did, and cut the reply's text back into tokens already sent)."""
    from coordinator.text import ReplyText

    tok = build_tokenizer()
    ids = tok("abxyzab!")["input_ids"]  # one token per byte
    for min_tokens in (3, 4):
        reply = ReplyText(tok, [], ["ab", "never-there"], False, min_tokens)
        assert reply.push(ids) == 7 and reply.matched == "ab"
        assert reply.text == "abxyz" and reply.take(final=True) == "abxyz"
    reply = ReplyText(tok, [], ["ab", "never-there"], True, 3)
    assert reply.push(ids) == 7 and reply.text == "abxyzab"
    reply = ReplyText(tok, [], ["b!", "a", "never"], False, 7)  # "a" at token 6, "b!" ends at token 8
    assert reply.push(ids) == 8 and reply.matched == "b!" and reply.text == "abxyza"
