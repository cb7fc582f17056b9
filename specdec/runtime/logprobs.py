"""Log-probabilities of chosen tokens under the raw model distribution (log-softmax of the logits)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.v1 import common_pb2

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogprobsAsk:
    """What a verify call returns besides the verdict: the raw log-probabilities of its tokens
    (``tokens``, with ``top`` alternatives) and of the last ``prompt_count`` committed tokens (the
    prompt, with ``prompt_top`` alternatives)."""

    tokens: bool = False
    top: int = 0
    prompt_count: int = 0
    prompt_top: int = 0


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[common_pb2.TokenLogprob]:
    """``logits`` [R, V]: row r scored ``token_ids[r]``; each entry gets the token's log-probability
    and the ``top_n`` most likely tokens of its row."""
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} rows for {len(token_ids)} tokens")
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(token_ids)), torch.tensor(list(token_ids), dtype=torch.long)].tolist()
    top_values, top_ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1) if top_n else (None, None)
    entries = []
    for row, (token, value) in enumerate(zip(token_ids, chosen, strict=True)):
        entry = common_pb2.TokenLogprob(token_id=token, logprob=value)
        if top_values is not None and top_ids is not None:
            for alt, alt_value in zip(top_ids[row].tolist(), top_values[row].tolist(), strict=True):
                entry.top.add(token_id=alt, logprob=alt_value)
        entries.append(entry)
    return entries
