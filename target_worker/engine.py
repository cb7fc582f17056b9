"""Verification: one forward pass over the uncached tail and the draft block, then rejection sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime.grammar import constrain
from specdec.runtime.kvcache import EarlierLogits, ResyncRequired, SessionCaches
from specdec.runtime.logprobs import LogprobsAsk, token_logprobs
from specdec.runtime.modeling import LoadedModel
from specdec.runtime.processing import Processing, process_logits
from specdec.runtime.proposals import decode_block
from specdec.runtime.sampling import Warp, position_generator, rejection_sample
from specdec.runtime.scheduler import ComputeMeter, Extend, Job
from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class VerifyResult:
    """``resync`` set: the cache did not hold the committed prefix and nothing was computed (the
    caller may resend from ``resync_from`` tokens, else from 0)."""

    resync: bool
    resync_from: int = 0
    num_accepted: int = 0
    token_ids: tuple[int, ...] = ()
    cache_len: int = 0
    computed_tokens: int = 0
    compute_ms: float = 0.0
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    prompt_logprobs: tuple[common_pb2.TokenLogprob, ...] = ()


def verify_job(
    caches: SessionCaches,
    loaded: LoadedModel,
    session_id: str,
    sync: common_pb2.PrefixSync,
    block: common_pb2.DraftBlock,
    warp: Warp,
    seed: int,
    processing: Processing,
    ask: LogprobsAsk,
) -> Job[VerifyResult]:
    """Verifies ``block`` after the committed prefix ``sync`` describes (one Extend step).

    Row i of the pass decides the token at ``committed_len + i``; ``processing`` (its grammar
    included) sees the history up to that row (the committed tokens and the drafts before it).
    Log-probabilities are of the raw logits. Prompt log-probabilities need the logits of the
    prompt positions, so the pass keeps them only when asked (the caller sends those tokens in
    the tail).
    """
    meter = ComputeMeter()
    drafts, q = decode_block(block, loaded.vocab_size, loaded.device)
    base_len, tail = sync.base_len, list(sync.tail_token_ids)
    committed_len = base_len + len(tail)
    # Prompt token j is scored by the row of position j - 1; the session's first token has none.
    prompt_first = committed_len - ask.prompt_count
    if prompt_first < 0:
        raise InvalidRequest(f"prompt_logprobs_count {ask.prompt_count} exceeds the {committed_len} committed tokens")
    scored_from = max(prompt_first, 1)
    prompt_rows = committed_len - scored_from if ask.prompt_count else 0
    if prompt_rows and scored_from - 1 < base_len:
        raise InvalidRequest("prompt logprobs need the prompt's positions in the tail: send a shorter base_len")
    try:
        entry = caches.sync(
            session_id, base_len, sync.prefix_hash, sync.source_session_id, sync.prompt_len, sync.shared_len
        )
    except ResyncRequired as exc:
        return VerifyResult(resync=True, resync_from=exc.start)
    k = len(drafts)
    scored = tail[scored_from - base_len :] if prompt_rows else []  # the prompt tokens rows score
    scored_logprobs: list[common_pb2.TokenLogprob] = []

    def score_prompt(chunk: torch.Tensor) -> None:  # the pass's rows before the block, in order
        done = len(scored_logprobs)
        scored_logprobs.extend(token_logprobs(chunk, scored[done : done + chunk.shape[0]], ask.prompt_top))

    earlier = EarlierLogits(prompt_rows, score_prompt) if prompt_rows else None
    raw = yield Extend(entry, [*tail, *drafts.tolist()], k + 1, meter, earlier)
    logits = process_logits(raw, entry.tokens, committed_len, processing, entry.counts)
    logits = constrain(
        logits, entry.grammar, entry.tokens, committed_len, processing.grammar, processing.reply_start, strict=True
    )
    generators = None
    if not warp.greedy:  # row i decides the token at position committed_len + i
        generators = [position_generator(seed, committed_len + i, "target", loaded.device) for i in range(k + 1)]
    if q is None and not warp.greedy:
        q = torch.nn.functional.one_hot(drafts, loaded.vocab_size).float()
    verdict = rejection_sample(logits, drafts, q, warp, generators)
    entry.truncate(committed_len + verdict.num_accepted)
    prompt_logprobs: list[common_pb2.TokenLogprob] = []
    if ask.prompt_count and prompt_first == 0:  # nothing precedes the session's first token
        prompt_logprobs.append(common_pb2.TokenLogprob(token_id=entry.tokens[0]))
    prompt_logprobs += scored_logprobs
    rows = len(verdict.token_ids)
    return VerifyResult(
        resync=False,
        num_accepted=verdict.num_accepted,
        token_ids=tuple(verdict.token_ids),
        cache_len=len(entry.tokens),
        computed_tokens=len(tail) + k,
        compute_ms=meter.ms,
        logprobs=tuple(token_logprobs(raw[:rows], verdict.token_ids, ask.top)) if ask.tokens else (),
        prompt_logprobs=tuple(prompt_logprobs),
    )
