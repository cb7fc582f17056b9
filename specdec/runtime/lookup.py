"""Drafting without a model: n-gram lookup over a session's own tokens (prompt lookup).

The last n committed tokens are looked up among the earlier ones; the tokens that followed
their most recent earlier occurrence are the draft. The longest n in [n_min, n_max] that
occurs wins (a longer context match predicts better). The draft is one-hot (each token had
probability 1 under the proposer), so the target's rejection sampling accepts token x with
probability p(x) and otherwise samples from p without x: exact for greedy and sampled decoding.

The index is incremental: appending tokens costs O(n_max - n_min + 1) dictionary updates each,
and a lookup O(n_max - n_min + 1) dictionary reads, whatever the session's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LookupDraft:
    """Proposed tokens and the length of the n-gram that matched (0 = no match)."""

    token_ids: list[int]
    match_len: int


NO_DRAFT = LookupDraft([], 0)


class NgramIndex:
    """Where each n-gram of a token sequence last occurred with a continuation."""

    def __init__(self, n_min: int, n_max: int, tokens: Sequence[int] = ()) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._tokens: list[int] = []
        # n-gram -> the index just past its most recent occurrence that has a next token
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens; each one becomes the continuation of the n-grams ending before it."""
        for token in tokens:
            end = len(self._tokens)  # the n-grams ending here now have a continuation: `token`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._last[tuple(self._tokens[end - n : end])] = end
            self._tokens.append(int(token))

    def propose(self, k: int) -> LookupDraft:
        """Up to ``k`` tokens that followed the longest recent match of the sequence's suffix."""
        end = len(self._tokens)
        if k <= 0:
            return NO_DRAFT
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            start = self._last.get(tuple(self._tokens[end - n : end]))
            if start is not None:
                draft = self._tokens[start : start + k]
                while len(draft) < k:  # the match runs into the suffix: the pattern repeats, copy on
                    draft.append(draft[len(draft) - (end - start)])
                return LookupDraft(draft, n)
        return NO_DRAFT
