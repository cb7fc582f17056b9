"""History-dependent logit processing, min-p and logprobs, against independent references."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MinPLogitsWarper

from specdec.runtime.logprobs import token_logprobs
from specdec.runtime.processing import Processing, TokenCounts, process_logits, processing_from_proto
from specdec.runtime.sampling import Warp, warped_probs
from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2
from tests.helpers import opcodes
from tests.spec_oracle import reference_processing

VOCAB = 12
PROMPT = (3, 5, 3, 9)
PROCESSING = Processing(
    repetition_penalty=1.7,
    presence_penalty=0.4,
    frequency_penalty=0.9,
    logit_bias=((1, 2.5), (5, -3.0)),
    reply_start=len(PROMPT),
    min_tokens=3,
    banned_until_min=(0, 7),
)


@pytest.mark.parametrize("processing", [PROCESSING, Processing(repetition_penalty=0.6, reply_start=len(PROMPT))])
def test_every_row_is_processed_with_the_history_up_to_it(processing: Processing) -> None:
    """Rows of one pass (committed reply 5, 5 then drafts 3, 5, 11) equal the reference applied
    to each row's own history, including the drafts before the row."""
    tokens = [*PROMPT, 5, 5, 3, 5, 11]
    first = len(PROMPT) + 2  # the position row 0 decides
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    out = process_logits(logits, tokens, first, processing)
    reference = reference_processing(processing, len(PROMPT))
    for row in range(4):
        expected = reference(logits[row], tuple(tokens[: first + row]))
        assert torch.allclose(out[row], expected, atol=1e-6), row


def test_min_tokens_bans_stop_tokens_only_before_the_minimum() -> None:
    logits = torch.zeros(5, VOCAB)
    out = process_logits(logits, [*PROMPT, 1, 2, 3, 4], len(PROMPT), Processing(**{**_plain(), "min_tokens": 3}))
    banned = [bool(math.isinf(out[row, 7])) for row in range(5)]
    assert banned == [True, True, True, False, False]


def _plain() -> dict[str, object]:
    return {"reply_start": len(PROMPT), "banned_until_min": (7,)}


def test_no_processing_returns_the_logits_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    assert process_logits(logits, list(PROMPT), 2, Processing()) is logits


def test_min_p_matches_hf() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    warp = Warp(temperature=0.7, min_p=0.2)
    scores = MinPLogitsWarper(0.2)(torch.zeros(1, 1, dtype=torch.long), (logits / 0.7)[None])[0]
    assert torch.allclose(warped_probs(logits, warp), scores.softmax(-1), atol=1e-6)


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    entries = token_logprobs(logits, [3, 8], top_n=3)
    logp = torch.log_softmax(logits, -1)
    assert [e.token_id for e in entries] == [3, 8]
    assert entries[1].logprob == pytest.approx(float(logp[1, 8]), abs=1e-6)
    top = [t.token_id for t in entries[0].top]
    assert top == torch.topk(logp[0], 3).indices.tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["extend", "cut", "process", "next turn"]), st.integers(0, 30), st.integers(1, 5)),
        max_size=30,
    )
)
def test_counts_kept_with_a_session_equal_counting_afresh(operations: list[tuple[str, int, int]]) -> None:
    """A session cache's tokens grow, are cut back (rejected drafts) and are processed at any
    position, turn after turn (the reply's start moves): processing with the counts the cache keeps
    gives exactly what counting the history afresh gives."""
    tokens: list[int] = [*PROMPT]
    kept = TokenCounts()
    reply_start = len(tokens)
    for operation, n, rows in operations:
        if operation == "extend":
            tokens.extend((n * 7 + i) % (VOCAB + 2) for i in range(n % 6 + 1))  # ids past the vocabulary too
        elif operation == "cut":
            length = min(n, len(tokens))
            kept.cut(tokens, length)  # as SessionCache.truncate reports it, before the tokens go
            del tokens[length:]
        elif operation == "next turn":
            reply_start = len(tokens)
        rows = min(rows, len(tokens) + 1)
        first = min(n, len(tokens) - rows + 1)
        processing = dataclasses.replace(PROCESSING, reply_start=min(reply_start, first))
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(n))
        assert torch.equal(
            process_logits(logits, tokens, first, processing, kept), process_logits(logits, tokens, first, processing)
        )


def _penalised_over_the_whole_row(logits: torch.Tensor, tokens: list[int], first: int, p: Processing) -> torch.Tensor:
    """The penalties applied elementwise to every column (the formula before only the seen ids'
    columns were touched)."""
    rows, vocab = logits.shape

    def counts(start: int) -> torch.Tensor:
        table = torch.zeros(rows, vocab)
        for r in range(rows):
            for token in tokens[start : first + r]:
                if token < vocab:
                    table[r, token] += 1
        return table

    out = logits.float().clone()
    if p.repetition_penalty != 1.0:
        penalised = torch.where(out < 0, out * p.repetition_penalty, out / p.repetition_penalty)
        out = torch.where(counts(0) > 0, penalised, out)
    if p.presence_penalty or p.frequency_penalty:
        reply = counts(p.reply_start)
        out = out - p.frequency_penalty * reply - p.presence_penalty * (reply > 0).float()
    return out


_LOGIT = st.one_of(st.floats(-50, 50, width=32), st.sampled_from([-math.inf, math.inf, -0.0, 0.0, 3e38, -3e38, 1e-40]))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, VOCAB + 1), min_size=1, max_size=20),  # ids past the vocabulary too
    st.data(),
    st.sampled_from([1.0, 0.6, 1.7]),
    st.sampled_from([0.0, 0.4, -1.3]),
    st.sampled_from([0.0, 0.9, -2.0]),
)
def test_penalties_change_the_seen_ids_columns_exactly_as_over_the_whole_row(
    tokens: list[int], data: st.DataObject, repetition: float, presence: float, frequency: float
) -> None:
    """A pass touches only the columns of ids the history holds (a 151,936-id vocabulary was
    processed whole for every row): every value, infinities and zeros included, equals the
    whole-row formula's exactly."""
    rows = data.draw(st.integers(1, min(5, len(tokens) + 1)))
    first = data.draw(st.integers(0, len(tokens) - rows + 1))
    reply_start = data.draw(st.integers(0, first))
    processing = Processing(
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency, reply_start=reply_start
    )
    logits = torch.tensor(data.draw(st.lists(_LOGIT, min_size=rows * VOCAB, max_size=rows * VOCAB))).view(rows, VOCAB)
    kept = TokenCounts()
    if first:
        process_logits(logits[:1], tokens, first - 1, processing, kept)  # counts kept from an earlier pass
    out = process_logits(logits, tokens, first, processing, kept)
    assert torch.equal(out, _penalised_over_the_whole_row(logits, tokens, first, processing))


def test_a_penalised_step_costs_the_same_in_a_long_session() -> None:
    """With the counts a session cache keeps, a verify pass's processing does Python work for the
    tokens that changed, not for the history: at 16,000 tokens as at 1,000 (a list of the whole
    history was built for every pass, and for every token the draft proposed)."""
    work = []
    for length in (1_000, 16_000):
        tokens = [(i * 7919) % VOCAB for i in range(length)]
        kept = TokenCounts()
        process_logits(torch.zeros(1, VOCAB), tokens, length - 10, PROCESSING, kept)  # earlier rounds
        tokens += [1, 2, 3, 4, 5]  # this round's tail and drafts
        logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
        work.append(opcodes(lambda t=tokens, k=kept, x=logits: process_logits(x, t, len(t) - 5, PROCESSING, k)))
    assert work[1] < 2 * work[0], work


def test_a_repetition_penalty_whose_division_could_overflow_is_the_caller_s_error() -> None:
    """A penalty near 0 divides a positive logit past float32's range (2^-149: every seen token's
    logit became +inf, and the worker failed the request INTERNAL for non-finite logits; found by
    the Propose fuzz test). Penalties below 1/100 (the largest is 100) are refused as the caller's
    error; 1/100 and up are served, and keep a large logit finite."""
    for refused in (2.0**-149, 1e-30, 0.0099):
        with pytest.raises(InvalidRequest, match=r"repetition penalty in \[0.01, 100\]"):
            processing_from_proto(common_pb2.LogitsParams(repetition_penalty=refused))
    processing = processing_from_proto(common_pb2.LogitsParams(repetition_penalty=0.01))
    out = process_logits(torch.tensor([[1e30, -1e30, 2.0]]), [0, 1], 2, processing)
    assert torch.isfinite(out).all() and out[0, 0] == torch.tensor(1e30) / 0.01
