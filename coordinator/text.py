"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 4  # earlier tokens decoded with the new ones, so leading spaces come out right


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (a few context tokens + the unread tokens) and emits only the text
    after the context; holds back output that ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(context[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever text is still held back (at the end of generation)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
