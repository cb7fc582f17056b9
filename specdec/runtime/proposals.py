"""Wire encoding shared by the coordinator and the workers: draft blocks (the draft worker encodes,
the target worker decodes) and warp parameters."""

from __future__ import annotations

import math

import torch

from specdec.runtime.sampling import DraftSample, Warp
from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2

_SUM_TOLERANCE = 1e-3


def encode_block(samples: list[DraftSample]) -> common_pb2.DraftBlock:
    """Encodes draft samples; all samples of a block share one kind."""
    block = common_pb2.DraftBlock(token_ids=[s.token_id for s in samples])
    if all(s.ids is None and s.probs is None for s in samples):
        block.kind = common_pb2.PROPOSAL_KIND_ONE_HOT
        return block
    sparse = all(s.ids is not None for s in samples)
    block.kind = common_pb2.PROPOSAL_KIND_SPARSE if sparse else common_pb2.PROPOSAL_KIND_DENSE
    for s in samples:
        if s.probs is None:
            raise ValueError("a block mixes one-hot and sampled proposals")
        entry = block.proposals.add(probs=s.probs.float().cpu().tolist())
        if sparse and s.ids is not None:
            entry.ids.extend(s.ids.cpu().tolist())
    return block


def decode_block(
    block: common_pb2.DraftBlock, vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [k] (int64) and dense proposal rows [k, V] (None for ONE_HOT), validated.

    Raises InvalidRequest for a block that cannot be the output of a correct draft worker.
    """
    k = len(block.token_ids)
    if any(t >= vocab_size for t in block.token_ids):
        raise InvalidRequest(f"draft token id out of range: the vocabulary has {vocab_size} ids")
    tokens = torch.tensor(list(block.token_ids), dtype=torch.long, device=device)
    if k == 0 or block.kind == common_pb2.PROPOSAL_KIND_ONE_HOT:
        if block.proposals:
            raise InvalidRequest("a ONE_HOT draft block carries no proposals")
        return tokens, None
    if block.kind not in (common_pb2.PROPOSAL_KIND_SPARSE, common_pb2.PROPOSAL_KIND_DENSE):
        raise InvalidRequest("draft block kind must be ONE_HOT, SPARSE or DENSE")
    if len(block.proposals) != k:
        raise InvalidRequest(f"draft block has {k} tokens but {len(block.proposals)} proposals")
    q = torch.zeros(k, vocab_size, dtype=torch.float32)
    for row, proposal in enumerate(block.proposals):
        q[row] = _decode_row(proposal, block.kind, vocab_size)
    return tokens, q.to(device)


def _decode_row(proposal: common_pb2.TokenProposal, kind: int, vocab_size: int) -> torch.Tensor:
    probs = torch.tensor(list(proposal.probs), dtype=torch.float32)
    if kind == common_pb2.PROPOSAL_KIND_DENSE:
        # A draft with a smaller (differently padded) vocabulary sends fewer rows: the rest are 0.
        if not 0 < probs.numel() <= vocab_size or proposal.ids:
            raise InvalidRequest(f"a DENSE proposal has 1 to {vocab_size} probs and no ids")
        row = torch.nn.functional.pad(probs, (0, vocab_size - probs.numel()))
    else:
        if probs.numel() == 0 or len(proposal.ids) != probs.numel():
            raise InvalidRequest("a SPARSE proposal has as many ids as probs (at least one)")
        if max(proposal.ids) >= vocab_size:
            raise InvalidRequest(f"proposal id out of range: the vocabulary has {vocab_size} ids")
        row = torch.zeros(vocab_size, dtype=torch.float32)
        row.index_put_((torch.tensor(list(proposal.ids), dtype=torch.long),), probs, accumulate=True)
    total = float(row.sum())
    if (
        not bool(torch.isfinite(row).all())
        or bool((row < 0).any())
        or not math.isclose(total, 1.0, abs_tol=_SUM_TOLERANCE)
    ):
        raise InvalidRequest("proposal probabilities must be finite, non-negative and sum to 1")
    return row / total


def warp_from_proto(warp: common_pb2.WarpParams) -> Warp:
    """WarpParams -> Warp; unset top_p (0) means off."""
    try:
        return Warp(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p or 1.0, min_p=warp.min_p)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def warp_to_proto(warp: Warp) -> common_pb2.WarpParams:
    return common_pb2.WarpParams(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p, min_p=warp.min_p)
