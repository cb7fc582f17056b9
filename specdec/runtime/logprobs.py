"""Log-probabilities of chosen tokens under the raw model distribution (log-softmax of the logits)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.v1 import common_pb2

MAX_TOP_LOGPROBS = 20


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
