"""Drafting without a model: n-gram lookup over a session's own tokens (prompt lookup), and
over recent replies of all sessions (``ReplyIndex``).

The last n committed tokens are looked up among the earlier ones; the tokens that followed
their most recent earlier occurrence are the draft. The longest n in [n_min, n_max] that
occurs wins (a longer context match predicts better). The draft is one-hot (each token had
probability 1 under the proposer), so the target's rejection sampling accepts token x with
probability p(x) and otherwise samples from p without x: exact for greedy and sampled decoding.

The index is incremental: appending tokens costs O(n_max - n_min + 1) dictionary updates each,
and a lookup O(n_max - n_min + 1) dictionary reads, whatever the session's length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LookupDraft:
    """Proposed tokens and the length of the n-gram that matched (0 = no match)."""

    token_ids: list[int]
    match_len: int
    from_replies: bool = False  # drafted from the reply index (earlier requests), not the session


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
        match = self._latest(self._tokens[-self.n_max :]) if k > 0 else None
        if match is None:
            return NO_DRAFT
        start, n = match
        end = len(self._tokens)
        draft = self._tokens[start : start + k]
        while len(draft) < k:  # the match runs into the suffix: the pattern repeats, copy on
            draft.append(draft[len(draft) - (end - start)])
        return LookupDraft(draft, n)

    def continuation(self, suffix: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent occurrence, in the indexed tokens, of
        the longest n-gram (n in [n_min, n_max]) that ends ``suffix`` (any sequence, e.g. the
        indexed tokens followed by drafted ones); [] when none occurs."""
        match = self._latest(suffix) if k > 0 else None
        return [] if match is None else self._tokens[match[0] : match[0] + k]

    def _latest(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        """(the index just past it, n) for the most recent occurrence with a continuation of the
        longest n-gram that ends ``suffix``; None when none occurs. (An n-gram as long as the whole
        indexed sequence never has a continuation, so trying it as well changes nothing.)"""
        for n in range(min(self.n_max, len(suffix)), self.n_min - 1, -1):
            start = self._last.get(tuple(suffix[len(suffix) - n :]))
            if start is not None:
                return start, n
        return None


class GuessIndex:
    """A draft's guesses ahead (see draft_worker.engine): the session's committed tokens in an
    n-gram index, and how often the draft has drawn the guessed tokens (a row computed for a guess
    pays only if the draft draws everything guessed before it).

    The draft's draws are compared with the whole guess on offer at each pass, run or not, so
    the rate stays current where few rows are run. A pass runs row j of a guess (the token j
    after the next) while the rate makes ``rate ** j`` at least ``min_use``: the chance that row j
    is used, if the draft draws each guessed token with the same chance."""

    def __init__(self, n_min: int, n_max: int, min_use: float, prior: tuple[float, float] = (1.0, 2.0)) -> None:
        self.ngrams = NgramIndex(n_min, n_max)
        self.min_use = min_use
        self.hits, self.tries = prior

    def __len__(self) -> int:
        return len(self.ngrams)

    @property
    def rate(self) -> float:
        """The estimated chance that the draft draws a guessed token, all before it drawn."""
        return self.hits / self.tries

    def rows(self, limit: int) -> int:
        """How many tokens of a guess of ``limit`` are worth running."""
        rate, rows = self.rate, 0
        while rows < limit and rate ** (rows + 1) >= self.min_use:
            rows += 1
        return rows

    def score(self, guess: Sequence[int], drawn: Sequence[int]) -> None:
        """Counts a guess against the tokens the draft drew after it (as far as both go)."""
        for guessed, token in zip(guess, drawn, strict=False):
            self.tries += 1
            if guessed != token:
                break
            self.hits += 1
        if self.tries > 256:  # recent passes count most
            self.hits, self.tries = self.hits / 2, self.tries / 2


@dataclass
class _Reply:
    scope: str
    tokens: list[int]  # the lead-in (the context's last tokens) + the reply
    size: int  # tokens of the reply (without the lead-in)
    keys: list[int]  # the index keys this reply set


class ReplyIndex:
    """Recent replies of all sessions, bounded, for lookup drafts of answers given before.

    Each reply is stored with a lead-in (the last ``n_max`` tokens before it), so a later request
    whose context ends the same way is drafted the reply from its first token. A lookup matches
    the longest suffix (``n_max`` down to ``n_min`` tokens) of a session's tokens against the
    n-grams followed by a reply token, most recent reply first, and drafts what followed, up to
    the end of that reply. Replies live in scopes (the caller's identity): a lookup only finds
    its own scope's replies. The oldest replies are dropped once the replies hold more than
    ``max_tokens`` tokens. Keys are hashes of (scope, n-gram), one int per n-gram instead of a
    tuple; a hit is checked against the stored tokens and scope, so a hash collision is a miss.
    """

    def __init__(self, n_min: int, n_max: int, max_tokens: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}..{n_max}")
        if max_tokens < 1:
            raise ValueError(f"a reply index needs room for at least one token, got {max_tokens}")
        self.n_min, self.n_max, self.max_tokens = n_min, n_max, max_tokens
        self._replies: OrderedDict[int, _Reply] = OrderedDict()
        self._where: dict[int, tuple[int, int]] = {}  # key -> (reply id, index of the token after the n-gram)
        self._next_id = 0
        self.tokens = 0  # reply tokens held (lead-ins not counted)

    def __len__(self) -> int:
        return len(self._replies)

    def add(self, scope: str, context: Sequence[int], reply: Sequence[int]) -> None:
        """Stores ``reply`` (its first ``max_tokens`` tokens), which followed ``context``."""
        body = [int(t) for t in reply[: self.max_tokens]]
        if not body:
            return
        while self.tokens + len(body) > self.max_tokens:
            self._drop_oldest()
        lead = [int(t) for t in context[max(len(context) - self.n_max, 0) :]]
        tokens, rid = [*lead, *body], self._next_id
        self._next_id += 1
        keys = []
        for after in range(len(lead), len(tokens)):
            for n in range(self.n_min, min(self.n_max, after) + 1):
                key = hash((scope, *tokens[after - n : after]))
                self._where[key] = (rid, after)
                keys.append(key)
        self._replies[rid] = _Reply(scope, tokens, len(body), keys)
        self.tokens += len(body)

    def propose(self, scope: str, tokens: Sequence[int], k: int) -> LookupDraft:
        """Up to ``k`` tokens that followed the longest suffix of ``tokens`` in a stored reply."""
        end = len(tokens)
        if k <= 0:
            return NO_DRAFT
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            suffix = [int(t) for t in tokens[end - n : end]]
            hit = self._where.get(hash((scope, *suffix)))
            if hit is None:
                continue
            reply, after = self._replies[hit[0]], hit[1]
            if reply.scope == scope and reply.tokens[after - n : after] == suffix:
                return LookupDraft(reply.tokens[after : after + k], n)
        return NO_DRAFT

    def _drop_oldest(self) -> None:
        rid, reply = self._replies.popitem(last=False)
        for key in reply.keys:
            if self._where.get(key, (-1, 0))[0] == rid:  # a later reply may have taken the key over
                del self._where[key]
        self.tokens -= reply.size


def lookup_draft(
    index: NgramIndex, replies: ReplyIndex | None, scope: str, tokens: Sequence[int], k: int
) -> LookupDraft:
    """A session's lookup draft: the longest match in its own tokens (``index``, which holds
    ``tokens``) or, where the reply index matches a longer suffix, the reply that followed it."""
    own = index.propose(k)
    if replies is None or own.match_len >= index.n_max:
        return own
    other = replies.propose(scope, tokens, k)
    return LookupDraft(other.token_ids, other.match_len, from_replies=True) if other.match_len > own.match_len else own
