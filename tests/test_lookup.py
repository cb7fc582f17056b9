"""N-gram lookup drafts: the index the coordinator keeps over a session's tokens, and the reply index
over recent replies of all sessions."""

from __future__ import annotations

import random

import pytest

from specdec.runtime.lookup import GuessIndex, NgramIndex, ReplyIndex


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


def test_a_continuation_of_any_suffix_matches_a_brute_force_search() -> None:
    """``continuation``: the suffix is any sequence (the indexed tokens and drafted ones after
    them); the match is among the indexed tokens, its continuation stops at their end."""
    rng = random.Random(5)
    tokens = [rng.randrange(5) for _ in range(200)]
    index = NgramIndex(2, 4, tokens)
    for _ in range(300):
        suffix = [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
        want: list[int] = []
        for n in range(min(4, len(suffix)), 1, -1):
            ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix[len(suffix) - n :]]
            if ends:
                want = tokens[ends[-1] : ends[-1] + 6]
                break
        assert index.continuation(suffix, 6) == want
    assert index.continuation(tokens[-3:], 0) == []


def test_a_guess_index_runs_the_rows_its_rate_of_right_guesses_pays_for() -> None:
    """Row j of a guess is run while rate ** j >= min_use; the draws after every guess on offer
    update the rate, as far as the guess and the draws go, up to the first wrong token."""
    guesses = GuessIndex(2, 4, min_use=0.1)
    assert guesses.rate == 0.5 and guesses.rows(8) == 3  # the prior: 0.5 ** 3 >= 0.1 > 0.5 ** 4
    guesses.score([1, 2, 3, 4], [1, 2, 9, 4])  # two right, then a wrong one: 3 tries, 2 hits
    assert (guesses.hits, guesses.tries) == (3.0, 5.0)
    guesses.score([1, 2, 3], [1])  # the draws stop first: 1 try, 1 hit
    assert (guesses.hits, guesses.tries) == (4.0, 6.0)
    for _ in range(40):
        guesses.score([5] * 8, [5] * 8)
    assert guesses.rate > 0.95 and guesses.rows(8) == 8 and guesses.rows(2) == 2
    for _ in range(600):
        guesses.score([5, 6], [7, 6])
    assert guesses.rate < 0.1 and guesses.rows(8) == 0
    assert guesses.tries <= 256  # halved as it goes: recent draws count most


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(0, 2)


# --- the reply index (recent replies of all sessions) -------------------------------------------


def replies_brute_force(
    stored: list[tuple[str, list[int], int]], scope: str, tokens: list[int], n_min: int, n_max: int, k: int
) -> tuple[list[int], int]:
    """Over (scope, lead-in + reply, lead-in length), oldest first: the longest suffix of ``tokens``
    followed by a reply token in a reply of ``scope``; the latest such place's continuation."""
    end = len(tokens)
    for n in range(min(n_max, end), n_min - 1, -1):
        suffix = tokens[end - n :]
        for owner, seq, lead in reversed(stored):
            if owner != scope:
                continue
            for after in range(len(seq) - 1, max(lead, n) - 1, -1):
                if seq[after - n : after] == suffix:
                    return seq[after : after + k], n
    return [], 0


def test_a_reply_is_drafted_again_from_its_first_token() -> None:
    index = ReplyIndex(2, 4, 100)
    index.add("", [9, 1, 2, 3, 4], [10, 11, 12, 13])  # the lead-in is the context's last 4 tokens
    draft = index.propose("", [7, 7, 1, 2, 3, 4], 3)
    assert (draft.token_ids, draft.match_len) == ([10, 11, 12], 4)
    assert index.propose("", [5, 3, 4, 10, 11], 8).token_ids == [12, 13]  # up to the end of the reply
    assert index.propose("", [0, 1, 2, 3], 3).token_ids == []  # 1 2 3 is followed by a lead-in token only


def test_replies_are_found_only_in_their_own_scope() -> None:
    index = ReplyIndex(2, 3, 100)
    index.add("alice", [1, 2, 3], [4, 5, 6])
    assert index.propose("alice", [1, 2, 3], 2).token_ids == [4, 5]
    assert index.propose("bob", [1, 2, 3], 2).token_ids == []
    index.add("bob", [1, 2, 3], [7, 8])
    assert index.propose("alice", [1, 2, 3], 2).token_ids == [4, 5]  # bob's later reply is not alice's
    assert index.propose("bob", [1, 2, 3], 2).token_ids == [7, 8]


def test_the_oldest_replies_go_once_the_index_is_full() -> None:
    index = ReplyIndex(1, 2, 10)
    index.add("", [1], [2, 3, 4, 5])
    index.add("", [6], [7, 8, 9])
    index.add("", [10], [11, 12, 13])  # 4 + 3 + 3 = 10: all fit
    assert (len(index), index.tokens) == (3, 10)
    index.add("", [14], [15, 16])  # the first reply goes
    assert (len(index), index.tokens) == (3, 8)
    assert index.propose("", [1], 2).token_ids == []
    assert index.propose("", [6], 2).token_ids == [7, 8]
    index.add("", [0], list(range(100, 130)))  # longer than the index: its first 10 tokens, alone
    assert (len(index), index.tokens) == (1, 10)
    assert index.propose("", [0], 20).token_ids == list(range(100, 110))


def test_a_key_a_later_reply_took_over_survives_the_older_reply_leaving() -> None:
    index = ReplyIndex(2, 2, 6)
    index.add("", [1, 2], [3, 4])
    index.add("", [1, 2], [3, 5])  # (1, 2) and (2, 3) now lead to this reply
    index.add("", [8, 9], [6, 7])
    index.add("", [8, 9], [6, 0])  # the first reply goes; the second's keys stay
    assert index.propose("", [1, 2], 2).token_ids == [3, 5]
    assert index.propose("", [2, 3], 1).token_ids == [5]


def test_reply_lookups_match_a_brute_force_search_while_replies_come_and_go() -> None:
    rng = random.Random(5)
    index, stored, budget = ReplyIndex(1, 3, 60), [], 60
    for _ in range(40):
        scope = rng.choice(["a", "b"])
        context = [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
        reply = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        index.add(scope, context, reply)
        lead = context[max(len(context) - 3, 0) :]
        stored.append((scope, [*lead, *reply], len(lead)))
        while sum(len(seq) - lead_len for _, seq, lead_len in stored) > budget:
            stored.pop(0)
        assert index.tokens == sum(len(seq) - lead_len for _, seq, lead_len in stored)
        for _ in range(10):
            query = [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
            for k in (1, 4):
                got = index.propose(scope, query, k)
                assert (got.token_ids, got.match_len) == replies_brute_force(stored, scope, query, 1, 3, k)
    assert len(index._where) <= index.tokens * 3  # keys of dropped replies are gone


def test_reply_index_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="n_min <= n_max"):
        ReplyIndex(3, 2, 10)
    with pytest.raises(ValueError, match="at least one token"):
        ReplyIndex(1, 2, 0)
