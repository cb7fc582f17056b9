"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from specdec.runtime.tokens import start_on_a_character

_CONTEXT_TOKENS = 4  # earlier tokens decoded with the new ones, so leading spaces come out right
_CHARACTER_BYTES = 4  # the longest UTF-8 character: at most this many byte tokens
# Tokens held back past the last release before looking for a point that is safe to release: more
# than a character's bytes are held only for text that ends in U+FFFD for good (invalid bytes) or
# adds nothing.
_HELD_LIMIT = 16


@functools.lru_cache(maxsize=8)
def _skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Special tokens that decoding skips: they never change the text, so they are never decoded."""
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    special |= set(tokenizer.all_special_ids)
    return frozenset(i for i in special if tokenizer.decode([i], skip_special_tokens=True) == "")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that add up to the decode of the whole
    (but where a run of byte tokens turns invalid after characters of it were released: those
    stand), taking the tokens one at a time, so the text does not depend on how they are grouped.

    Decodes a window from the previous release point (after a few context tokens at first) and
    emits the text after what was already released; holds back output that ends in an
    incomplete character (U+FFFD). A window always starts at a release point: one that starts
    inside a run of byte tokens (SentencePiece byte fallback decodes a run as a whole) garbles
    it. Text held back for good (invalid bytes) is released once no later token can change it,
    so the window, and the cost of a round, stays bounded.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: Sequence[int], skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special  # False: special tokens' text is kept (vLLM's skip_special_tokens=false)
        self._skipped = _skipped_ids(tokenizer) if skip_special else frozenset()
        visible = [i for i in context if i not in self._skipped]
        self._ids = visible[start_on_a_character(self._decode, visible, max(len(visible) - _CONTEXT_TOKENS, 0)) :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # the decode of ids[prefix_offset:read_offset], once needed

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they complete (possibly empty). The tokens are taken one
        at a time, so the text is the same whatever rounds they come in."""
        return "".join(self._push_one(i) for i in token_ids if i not in self._skipped)

    def _push_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text, new_text = self._window()
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            return self._release(len(self._ids), prefix_text, new_text)
        if len(self._ids) - self._read_offset > _HELD_LIMIT:
            return self._unblock(prefix_text, new_text)
        return ""

    def _window(self) -> tuple[str, str]:
        """The text of the window's released tokens, and of the window with the held ones after.
        A token that goes on with a run of byte tokens can change how the run's released
        characters decode (SentencePiece byte fallback decodes a run that is not valid UTF-8 as a
        whole to U+FFFD throughout); the released text stands, and the window then starts after
        it (inside the run: what follows is byte tokens, whose decode has no leading space)."""
        if self._prefix_text is None:  # changes only when the window moves, not with every token
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        prefix_text, new_text = self._prefix_text, self._decode(self._ids[self._prefix_offset :])
        if not new_text.startswith(prefix_text):
            self._prefix_offset, self._prefix_text = self._read_offset, ""
            prefix_text, new_text = "", self._decode(self._ids[self._read_offset :])
        return prefix_text, new_text

    def _release(self, end: int, prefix_text: str, text: str) -> str:
        """Releases the text of the tokens up to ``end``; the next window starts where this one read."""
        self._prefix_offset, self._read_offset, self._prefix_text = self._read_offset, end, None
        return text[len(prefix_text) :]

    def _unblock(self, prefix_text: str, new_text: str) -> str:
        """Many tokens held back: releases what fed one at a time they would have, else what no
        later token can change, else drops tokens that add no text."""
        start, ids = self._prefix_offset, self._ids
        for end in range(len(ids) - 1, self._read_offset, -1):
            text = self._decode(ids[start:end])
            if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
                return self._release(end, prefix_text, text)
        if new_text == prefix_text:
            del ids[self._read_offset :]
            return ""
        # No point in the last _HELD_LIMIT tokens ends a character: the bytes before the last
        # _CHARACTER_BYTES tokens are invalid whatever follows, and their text is final once it
        # agrees with the decode that has those tokens after it.
        end = len(ids) - _CHARACTER_BYTES
        text = self._decode(ids[start:end])
        if len(text) > len(prefix_text) and text.startswith(prefix_text) and new_text.startswith(text):
            return self._release(end, prefix_text, text)
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (at the end of generation)."""
        prefix_text, new_text = self._window()
        self._read_offset, self._prefix_text = len(self._ids), None
        return new_text[len(prefix_text) :]


class ReplyText:
    """The reply's text as its tokens are committed, with stop strings.

    ``push`` takes a round's tokens one at a time and stops at the token whose text completes a
    stop string (the match may fall inside a speculated block: the caller commits only the tokens
    taken). ``take`` returns the text not yet sent, holding back a tail that could still grow into
    a stop string, so a stream never shows text that a later stop removes; the deltas add up to
    the final text. Stop strings do not match before the reply has ``min_tokens`` tokens (a match
    that ends in a later token still counts). With ``skip_special`` False, special tokens' text is
    part of the reply and of what stop strings match (vLLM's skip_special_tokens=false).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context: Sequence[int],
        stops: Sequence[str],
        include_stop: bool,
        min_tokens: int = 0,
        skip_special: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, context, skip_special)
        self._stops = tuple(stops)
        self._include = include_stop
        self._min_tokens = min_tokens
        self._longest = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._released = 0
        self._tokens = 0
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The reply's text so far (complete once the last round was taken)."""
        return self._text

    def push(self, token_ids: Sequence[int]) -> int:
        """Adds tokens until one completes a stop string; returns how many were taken."""
        if not self._stops:
            self._text += self._detok.push(token_ids)
            self._tokens += len(token_ids)
            return len(token_ids)
        for taken, token in enumerate(token_ids, 1):
            before = len(self._text)
            self._text += self._detok.push([token])
            self._tokens += 1
            if self._tokens < self._min_tokens:
                continue
            hit = self._find(before)
            if hit is not None:
                position, self.matched = hit
                self._text = self._text[: position + len(self.matched) if self._include else position]
                return taken
        return len(token_ids)

    def _find(self, before: int) -> tuple[int, str] | None:
        """The earliest stop string that ends after the first ``before`` characters: one the new
        token completed (any that ended earlier either matched then or came before min_tokens)."""
        hits = [
            (position, stop)
            for stop in self._stops
            if (position := self._text.find(stop, max(0, before - len(stop) + 1))) >= 0
        ]
        return min(hits) if hits else None

    def take(self, final: bool) -> str:
        """Text not sent yet; on the last round everything (the tokenizer's held-back bytes too)."""
        if final and self.matched is None:
            self._text += self._detok.flush()
        end = len(self._text) if final or self.matched is not None else len(self._text) - self._undecided()
        delta, self._released = self._text[self._released : end], end
        return delta

    def _undecided(self) -> int:
        """Length of the longest unsent tail that is the start of a stop string."""
        tail = self._text[self._released :]
        for n in range(min(len(tail), self._longest - 1), 0, -1):
            if any(stop.startswith(tail[-n:]) for stop in self._stops):
                return n
        return 0
