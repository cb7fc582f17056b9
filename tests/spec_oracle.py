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
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from specdec.runtime.grammar import grammar_of
from specdec.runtime.processing import Processing
from specdec.runtime.sampling import (
    DraftSample,
    Verdict,
    Warp,
    rejection_sample,
    sample_draft_token,
    warped_probs,
)
from specdec.v1 import common_pb2

# The thresholds of every chi-square check of exactness in the suite (tests/test_helpers.py keeps
# them the only ones). A check passes when p > PASS_P. 32 such checks run in a CI run, and several
# of them see other samples each run (adaptive K and the rounds' timing change which positions are
# drafted, so a seed need not replay). The pooled chi-square's p is a little too small in its tail
# at these sample sizes (scripts/chi_square_tail.py: 1,500 draws from the exact distributions of
# tests/test_combinations.py's three mixes, 2 million times each, gave p < 1e-3 1.3-1.5x as often
# as 1e-3 and p < 1e-5 2.1-3.0x as often as 1e-5). So a correct service fails a run with a chance
# of about 32 x 3e-5 = 1e-3 at 1e-5, where 1e-3 gave about 32 x 1.4e-3 = 4.5% (the fresh-clone CI
# run on tree 1f7d2b8 failed so: p = 0.0008, while 22,500 requests of that check pooled gave p =
# 0.20). The price: a deviation the check catches half the time is 1.2x the one it caught at 1e-3.
PASS_P = 1e-5
# A power check's planted bug must give p < PLANTED_P: below PASS_P, so that bug fails the check.
PLANTED_P = 1e-6
POOL_BELOW = 5  # outcomes expected fewer times than this are pooled into one bin (chi_square_pvalue)

LogitFn = Callable[[tuple[int, ...]], torch.Tensor]
Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Warp, torch.Generator | None], Verdict]


def proposal_matrix(samples: list[DraftSample], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense q [k, V] (float32) for a block of draft samples: the reference the workers' sparse and
    one-hot proposals are checked against."""
    q = torch.zeros(len(samples), vocab_size, dtype=torch.float32, device=device)
    for row, sample in enumerate(samples):
        if sample.ids is not None and sample.probs is not None:
            q[row].index_put_((sample.ids.to(device).long(),), sample.probs.to(device).float(), accumulate=True)
        elif sample.probs is not None:
            q[row] = sample.probs.to(device).float()
        else:
            q[row, sample.token_id] = 1.0
    return q


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
        if prob * n >= POOL_BELOW:
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


class Enumerator:
    """The exact distribution of a sampled request's first ``length`` tokens: a plain forward
    pass of the target (HF, fp32, no cache, no speculation) per position over the whole sequence,
    the independent reference processing and structured-output mask above, the request's warp;
    a sequence ends at a stop id (EOS unless ignore_eos, stop_token_ids) or a stop string, once
    the reply has min_tokens tokens. With a ``bug``, the distribution a service
    with that bug would sample: "min_tokens counts the history" (the session's tokens before the
    reply count towards min_tokens), "the mask ignores the reply" (every position is masked with
    the grammar's state at the reply's start), "stop strings ignored", "the temperature ignored"
    (sampled at temperature 1)."""

    def __init__(self, model_dir: str, length: int) -> None:
        self.model_dir, self.length = model_dir, length
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.model.config.eos_token_id
        self.eos = set(eos) if isinstance(eos, list) else {eos}

    def distribution(
        self, context: tuple[int, ...], sampling: common_pb2.SamplingParams, bug: str = ""
    ) -> dict[tuple[int, ...], float]:
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos)
        processing = Processing(
            repetition_penalty=sampling.repetition_penalty or 1.0,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            logit_bias=tuple(sampling.logit_bias.items()),
        )
        banned = Processing(min_tokens=sampling.min_tokens, banned_until_min=tuple(sorted(stop_ids)))
        processors = [
            reference_processing(processing, len(context)),
            reference_processing(banned, 0 if bug == "min_tokens counts the history" else len(context)),
        ]
        if sampling.HasField("structured_output"):
            grammar = grammar_of(sampling.structured_output)
            mask = reference_grammar(
                grammar, self.model_dir, self.model.config.vocab_size, sorted(self.eos), len(context)
            )
            if bug == "the mask ignores the reply":
                processors.append(lambda logits, _: mask(logits, context))
            else:
                processors.append(mask)
        stops = () if bug == "stop strings ignored" else tuple(sampling.stop)
        min_tokens = 0 if bug == "min_tokens counts the history" else sampling.min_tokens
        temperature = 1.0 if bug == "the temperature ignored" else sampling.temperature
        warp = Warp(temperature, sampling.top_k, sampling.top_p or 1.0, sampling.min_p)
        out: dict[tuple[int, ...], float] = {}

        def walk(reply: tuple[int, ...], prob: float) -> None:
            if len(reply) == self.length or (reply and self._ends(reply, min_tokens, stop_ids, stops)):
                out[reply] = prob
                return
            with torch.inference_mode():
                logits = self.model(torch.tensor([[*context, *reply]])).logits[0, -1]
            for processor in processors:
                logits = processor(logits, (*context, *reply))
            p = warped_probs(logits, warp)
            for token in torch.nonzero(p).flatten().tolist():
                walk((*reply, token), prob * float(p[token]))

        walk((), 1.0)
        return out

    def _ends(self, reply: tuple[int, ...], min_tokens: int, stop_ids: set[int], stops: tuple[str, ...]) -> bool:
        """Whether the reply's last token ends it (the reply's text is its tokens' own: the byte
        tokenizer's tokens are whole characters here)."""
        if len(reply) < min_tokens:
            return False
        if reply[-1] in stop_ids:
            return True
        before, text = self.tokenizer.decode(reply[:-1]), self.tokenizer.decode(reply)
        return any(stop in text[max(0, len(before) - len(stop) + 1) :] for stop in stops)

    def likely_char(self, distribution: dict[tuple[int, ...], float]) -> str:
        """The printable ASCII character most likely to come second or third (its token's
        probability summed over the sequences): a stop string of it ends many replies inside a
        block."""
        weight: collections.Counter[str] = collections.Counter()
        for reply, prob in distribution.items():
            for token in reply[1:]:
                text = self.tokenizer.decode([token])
                if len(text) == 1 and text.isascii() and text.isprintable():
                    weight[text] += prob
        return weight.most_common(1)[0][0]

    def favourite_bias(self, context: tuple[int, ...]) -> dict[int, float]:
        """A logit bias that moves the first token's distribution: -100 on the target's second
        choice after ``context`` (never sampled), +2 on its fourth."""
        with torch.inference_mode():
            ranked = self.model(torch.tensor([context])).logits[0, -1].argsort(descending=True).tolist()
        return {ranked[1]: -100.0, ranked[3]: 2.0}


def rejects(samples: collections.Counter[tuple[int, ...]], distribution: dict[tuple[int, ...], float]) -> bool:
    """The chi-square test rejects: a sequence the distribution cannot give, or p < PLANTED_P."""
    if any(distribution.get(outcome, 0.0) == 0.0 for outcome in samples):
        return True
    return chi_square_pvalue(samples, distribution, samples.total()) < PLANTED_P
