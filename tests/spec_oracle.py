"""Speculative generation over logit tables, for exactness tests of the sampling math.

A "model" here is a function from a token prefix to logits over a tiny vocabulary, so that the
exact target distribution of short sequences can be enumerated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from specdec.runtime.sampling import Verdict, Warp, proposal_matrix, rejection_sample, sample_draft_token, warped_probs

LogitFn = Callable[[tuple[int, ...]], torch.Tensor]
Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Warp, torch.Generator | None], Verdict]


def random_logit_table(vocab: int, scale: float, seed: int) -> LogitFn:
    """Deterministic random logits per prefix (memoised)."""
    table: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in table:
            g = torch.Generator().manual_seed(hash((seed, prefix)) & 0x7FFFFFFF)
            table[prefix] = torch.randn(vocab, generator=g) * scale
        return table[prefix]

    return logits


def speculative_sequence(
    target: LogitFn,
    draft: LogitFn,
    prompt: tuple[int, ...],
    length: int,
    k: int,
    warp: Warp,
    top_n: int,
    generator: torch.Generator,
    sampler: Sampler = rejection_sample,
) -> tuple[int, ...]:
    """Generates ``length`` tokens by draft-then-verify rounds."""
    seq = prompt
    while len(seq) - len(prompt) < length:
        samples = []
        ctx = seq
        for _ in range(k):
            s = sample_draft_token(draft(ctx), warp, top_n, generator)
            samples.append(s)
            ctx = (*ctx, s.token_id)
        drafts = torch.tensor([s.token_id for s in samples], dtype=torch.long)
        target_logits = torch.stack([target((*seq, *drafts[:i].tolist())) for i in range(k + 1)])
        q = proposal_matrix(samples, target_logits.shape[1])
        verdict = sampler(target_logits, drafts, q, warp, generator)
        seq = (*seq, *verdict.token_ids)
    return seq[len(prompt) : len(prompt) + length]


def exact_distribution(
    target: LogitFn, prompt: tuple[int, ...], length: int, vocab: int, warp: Warp
) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of ``length`` tokens under the warped target."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(vocab), repeat=length):
        prob = 1.0
        for i in range(length):
            prob *= float(warped_probs(target((*prompt, *seq[:i])), warp)[seq[i]])
            if prob == 0.0:
                break
        out[seq] = prob
    return out
