"""History-dependent logit processing: repetition / presence / frequency penalties, logit bias and
the min_tokens ban, applied row by row to the history up to each row.

Under speculation one forward pass scores several positions: row ``r`` of a verify pass decides
the token at position ``first_position + r``, and its history is every token before that position,
the drafts before it included. Applying a penalty to the committed history only (a bug peers have
shipped) changes the distribution of every row after the first; here each row gets its own counts.
The draft applies the same processing to its own proposals (acceptance stays high); exactness does
not depend on that, because the target verifies against the distribution the draft sampled from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2

Tensor = torch.Tensor


@dataclass(frozen=True)
class Processing:
    """What to apply before the warp (temperature / top-k / top-p / min-p), in this order:
    repetition penalty (HF: over every token before the position), presence and frequency
    penalties (OpenAI: over the reply's tokens before the position), additive logit bias, and the
    ban of ``banned_until_min`` while the reply is shorter than ``min_tokens``."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    reply_start: int = 0
    min_tokens: int = 0
    banned_until_min: tuple[int, ...] = ()
    grammar: str = ""  # structured output (specdec.runtime.grammar), from reply_start; applied apart

    @property
    def active(self) -> bool:
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or (self.min_tokens and self.banned_until_min)
        )


NO_PROCESSING = Processing()


class TokenCounts:
    """Occurrence counts of ``tokens[start:length]`` for one token list that changes only at its
    end (a session cache's), kept between calls: a call costs the tokens added or removed since the
    last one, not the session's length. A cut must be reported (``cut``) before the tokens go.
    Counts are kept for the two latest ``start`` values (the whole history, and the reply), and
    only once a processing that needs them has run (int32, a vocabulary's worth each)."""

    _KEPT = 2

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], tuple[int, Tensor]] = {}  # (start, vocab) -> (length, counts)

    def of(self, tokens: Sequence[int], start: int, length: int, vocab: int) -> Tensor:
        """The [vocab] counts of the ids below ``vocab`` in ``tokens[start:length]`` (do not modify)."""
        key = (start, vocab)
        kept, counts = self._kept.pop(key, (start, None))
        if counts is None:
            counts = torch.zeros(vocab, dtype=torch.int32)
        length = max(length, start)
        _add(counts, tokens[kept:length], vocab, 1)
        _add(counts, tokens[length:kept], vocab, -1)
        self._kept[key] = (length, counts)
        while len(self._kept) > self._KEPT:
            del self._kept[next(iter(self._kept))]
        return counts

    def cut(self, tokens: Sequence[int], length: int) -> None:
        """``tokens`` are about to lose everything from ``length`` on."""
        for key, (kept, counts) in list(self._kept.items()):
            if kept > length:
                end = max(length, key[0])
                _add(counts, tokens[end:kept], key[1], -1)
                self._kept[key] = (end, counts)


def _add(counts: Tensor, token_ids: Sequence[int], vocab: int, sign: int) -> None:
    ids = torch.tensor([t for t in token_ids if t < vocab], dtype=torch.long)
    if len(ids):
        counts.index_add_(0, ids, torch.full(ids.shape, sign, dtype=counts.dtype))


def _counts(
    tokens: Sequence[int],
    start: int,
    first_position: int,
    rows: int,
    vocab: int,
    device: torch.device,
    kept: TokenCounts,
) -> tuple[Tensor, Tensor]:
    """The ids below ``vocab`` that occur in tokens[start : first_position + rows - 1] (sorted, [S])
    and their float counts [rows, S]: row r counts tokens[start : first_position + r]. Only those
    columns can be penalised, so a pass costs the ids seen, not the vocabulary."""
    base = kept.of(tokens, start, first_position, vocab)
    # the token row r sees that row r - 1 did not
    later = [(r, tokens[first_position + r - 1]) for r in range(1, rows) if first_position + r - 1 >= start]
    later = [(r, token) for r, token in later if token < vocab]
    added = torch.tensor([token for _, token in later], dtype=torch.long)
    ids = torch.cat([base.nonzero().squeeze(1), added]).unique()  # sorted
    counts = base[ids].float().expand(rows, len(ids)).clone()
    for (r, _), column in zip(later, torch.searchsorted(ids, added).tolist(), strict=True):
        counts[r:, column] += 1
    return ids.to(device), counts.to(device)


def process_logits(
    logits: Tensor, tokens: Sequence[int], first_position: int, processing: Processing, kept: TokenCounts | None = None
) -> Tensor:
    """``logits`` [R, V] -> processed float32 logits [R, V]; row r decides the token at position
    ``first_position + r`` and sees ``tokens[:first_position + r]`` (``tokens`` must reach that far).
    ``kept``: the token list's counts kept between calls (a session cache's); None counts afresh."""
    if not processing.active:
        return logits
    kept = kept or TokenCounts()
    rows, vocab = logits.shape
    if len(tokens) < first_position + rows - 1:
        raise ValueError(f"{rows} rows from position {first_position} need {first_position + rows - 1} tokens")
    p, out = processing, logits.float().clone()
    # each penalty changes only the columns of the ids it counts, elementwise as over the whole row
    if p.repetition_penalty != 1.0:
        ids, counts = _counts(tokens, 0, first_position, rows, vocab, out.device, kept)
        picked = out[:, ids]
        penalised = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
        out[:, ids] = torch.where(counts > 0, penalised, picked)
    if p.presence_penalty or p.frequency_penalty:
        ids, counts = _counts(tokens, p.reply_start, first_position, rows, vocab, out.device, kept)
        picked = out[:, ids]
        out[:, ids] = picked - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    for token, bias in p.logit_bias:
        if token < vocab:
            out[:, token] += bias
    if p.min_tokens and p.banned_until_min:
        banned = [t for t in p.banned_until_min if t < vocab]
        for r in range(rows):
            if first_position + r - p.reply_start < p.min_tokens:
                out[r, banned] = -math.inf
    return out


# A penalty divides positive logits: one near 0 took them past float32's range (2^-149 made every
# seen token's logit +inf), so it is kept to [1/100, 100]; 1/100 as the float32 the wire carries.
MAX_REPETITION_PENALTY = 100.0
MIN_REPETITION_PENALTY = float(torch.tensor(1 / MAX_REPETITION_PENALTY, dtype=torch.float32))


def processing_from_proto(params: common_pb2.LogitsParams) -> Processing:
    """LogitsParams -> Processing (0 repetition penalty = off), checked."""
    repetition = params.repetition_penalty or 1.0
    values = (repetition, params.presence_penalty, params.frequency_penalty, *params.logit_bias.values())
    if not all(math.isfinite(v) for v in values) or not MIN_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(
            "logits processing needs finite values and a repetition penalty in "
            f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
        )
    return Processing(
        repetition_penalty=repetition,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=tuple(sorted(params.logit_bias.items())),
        reply_start=params.reply_start,
        min_tokens=params.min_tokens,
        banned_until_min=tuple(sorted(set(params.banned_until_min))),
        grammar=params.grammar,
    )


def processing_to_proto(processing: Processing) -> common_pb2.LogitsParams:
    return common_pb2.LogitsParams(
        repetition_penalty=processing.repetition_penalty,
        presence_penalty=processing.presence_penalty,
        frequency_penalty=processing.frequency_penalty,
        logit_bias=dict(processing.logit_bias),
        reply_start=processing.reply_start,
        min_tokens=processing.min_tokens,
        banned_until_min=list(processing.banned_until_min),
        grammar=processing.grammar,
    )
