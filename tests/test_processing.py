"""History-dependent logit processing, min-p and logprobs, against independent references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MinPLogitsWarper

from specdec.runtime.logprobs import token_logprobs
from specdec.runtime.processing import Processing, process_logits
from specdec.runtime.sampling import Warp, warped_probs
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
