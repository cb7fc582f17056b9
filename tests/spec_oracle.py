"""Speculative generation over logit tables, for exactness tests of the sampling math.

A "model" here is a function from a token prefix to logits over a tiny vocabulary, so that the
exact target distribution of short sequences can be enumerated.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import torch
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer
from scipy import stats
from transformers import AutoTokenizer, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from specdec.runtime.processing import Processing
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


def chi_square(observed: list[int], expected_weights: list[float]) -> float:
    """p-value of a chi-square goodness-of-fit test; expected weights are scaled to the sample size."""
    total = sum(observed) / sum(expected_weights)
    return float(stats.chisquare(observed, [w * total for w in expected_weights]).pvalue)


def chi_square_pvalue(
    samples: collections.Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float], n: int
) -> float:
    """Chi-square goodness of fit; outcomes with small expected counts are pooled into one bin."""
    observed, expected, pool_obs, pool_exp = [], [], 0, 0.0
    for outcome, prob in exact.items():
        if prob * n >= 5:
            observed.append(samples[outcome])
            expected.append(prob * n)
        else:
            pool_obs += samples[outcome]
            pool_exp += prob * n
    assert sum(samples.values()) == n
    assert all(outcome in exact and exact[outcome] > 0 for outcome in samples), "sampled an impossible sequence"
    if pool_exp > 0:
        observed.append(pool_obs)
        expected.append(pool_exp)
    return chi_square(observed, expected)


Processor = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def reference_processing(processing: Processing, prompt_len: int) -> Processor:
    """``processing`` written independently of specdec.runtime.processing, with HF's own processors
    where HF has one: (logits of the next token, the whole sequence before it) -> processed logits.
    The reply starts after ``prompt_len`` tokens."""
    repetition = RepetitionPenaltyLogitsProcessor(processing.repetition_penalty)
    minimum = MinNewTokensLengthLogitsProcessor(prompt_len, processing.min_tokens, list(processing.banned_until_min))

    def apply(logits: torch.Tensor, sequence: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor([sequence])
        scores = repetition(ids, logits[None].clone().float())[0]
        for token, count in collections.Counter(sequence[prompt_len:]).items():
            scores[token] -= processing.frequency_penalty * count + processing.presence_penalty
        for token, bias in processing.logit_bias:
            scores[token] += bias
        if processing.banned_until_min:
            scores = minimum(ids, scores[None])[0]
        return scores

    return apply


def reference_grammar(grammar: str, model_dir: str, vocab: int, eos: list[int], prompt_len: int) -> Processor:
    """A structured-output mask written independently of specdec.runtime.grammar: for each
    position a fresh llguidance matcher consumes the whole reply before it (no state kept between
    positions, no rollback) and the tokens it does not allow get -inf. The reply starts after
    ``prompt_len`` tokens."""
    tokenizer = from_tokenizer(AutoTokenizer.from_pretrained(model_dir), n_vocab=vocab, eos_token=eos)

    def apply(logits: torch.Tensor, sequence: tuple[int, ...]) -> torch.Tensor:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        assert matcher.consume_tokens(list(sequence[prompt_len:])), matcher.get_error()
        bits = matcher.compute_bitmask()
        allowed = torch.tensor([bool(bits[i // 8] >> (i % 8) & 1) for i in range(logits.shape[-1])])
        return logits.float().masked_fill(~allowed, float("-inf"))

    return apply
