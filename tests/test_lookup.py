"""N-gram lookup drafts: the index the coordinator keeps over a session's tokens."""

from __future__ import annotations

import random

import pytest

from specdec.runtime.lookup import NgramIndex


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """The longest suffix (n_max down to n_min) with an earlier occurrence; its latest one's continuation."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                draft = tokens[start + n : start + n + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (end - start - n)])
                return draft, n
    return [], 0


def test_the_longest_most_recent_match_wins() -> None:
    index = NgramIndex(2, 3, [1, 2, 3, 9, 2, 3, 5, 1, 2, 3])
    draft = index.propose(2)
    assert (draft.token_ids, draft.match_len) == ([9, 2], 3)  # (1, 2, 3) beats the later (2, 3)
    index = NgramIndex(2, 2, [1, 2, 3, 9, 2, 3, 5, 1, 2, 3])
    assert index.propose(2).token_ids == [5, 1]  # among (2, 3) matches, the most recent


def test_no_match_and_short_sequences_propose_nothing() -> None:
    assert NgramIndex(2, 4, [5, 6, 7]).propose(4).token_ids == []
    assert NgramIndex(1, 4, []).propose(4).token_ids == []
    assert NgramIndex(1, 4, [1, 2, 1]).propose(0).token_ids == []


def test_a_repeating_pattern_is_copied_past_the_end() -> None:
    assert NgramIndex(1, 3, [7, 7, 7]).propose(5).token_ids == [7, 7, 7, 7, 7]
    assert NgramIndex(2, 2, [4, 1, 2, 1, 2]).propose(5).token_ids == [1, 2, 1, 2, 1]


def test_incremental_updates_match_a_brute_force_search() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(300)]
    index = NgramIndex(1, 4)
    for i, token in enumerate(tokens):
        index.extend([token])
        for k in (1, 3, 8):
            got = index.propose(k)
            assert (got.token_ids, got.match_len) == brute_force(tokens[: i + 1], 1, 4, k)
    assert len(index) == len(tokens)


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(0, 2)
