"""Wire encoding shared by the coordinator and the workers: draft blocks (the draft worker encodes,
the target worker decodes) and warp parameters."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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
        entry = block.proposals.add()
        entry.MergeFromString(_packed_probs(s.probs))
        if sparse and s.ids is not None:
            entry.ids.extend(s.ids.cpu().tolist())
    return block


_PROBS_TAG = bytes([common_pb2.TokenProposal.PROBS_FIELD_NUMBER << 3 | 2])  # wire type 2: length-delimited


def _packed_probs(probs: torch.Tensor) -> bytes:
    """A TokenProposal holding only ``probs``, as protobuf writes it: the field's tag, its length
    in bytes as a varint, then the values as little-endian float32 (proto3 packs a repeated
    float). Built from the array's bytes at once: a dense row of 151,936 values took about 10 ms
    as a Python list (protobuf's fastest input; a numpy array is read a value at a time)."""
    data = probs.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()
    size, length = len(data), bytearray()
    while size > 0x7F:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return _PROBS_TAG + bytes(length) + data


def decode_block(
    block: common_pb2.DraftBlock, vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [k] (int64) and dense proposal rows [k, V] (None for ONE_HOT), validated.

    The wire's repeated fields are read as arrays (protobuf's containers hand numpy their
    values at once; a Python list of a 151,936-id row took 15 ms) and checked as they came; a
    sparse block becomes its dense rows in one scatter on ``device``, so a GPU target is sent
    the entries, not the [k, V] matrix.

    Raises InvalidRequest for a block that cannot be the output of a correct draft worker.
    """
    token_ids = np.asarray(block.token_ids, dtype=np.int64)
    k = token_ids.size
    if k and int(token_ids.max()) >= vocab_size:
        raise InvalidRequest(f"draft token id out of range: the vocabulary has {vocab_size} ids")
    tokens = torch.from_numpy(token_ids).to(device)
    if k == 0 or block.kind == common_pb2.PROPOSAL_KIND_ONE_HOT:
        if block.proposals:
            raise InvalidRequest("a ONE_HOT draft block carries no proposals")
        return tokens, None
    if block.kind not in (common_pb2.PROPOSAL_KIND_SPARSE, common_pb2.PROPOSAL_KIND_DENSE):
        raise InvalidRequest("draft block kind must be ONE_HOT, SPARSE or DENSE")
    if len(block.proposals) != k:
        raise InvalidRequest(f"draft block has {k} tokens but {len(block.proposals)} proposals")
    if block.kind == common_pb2.PROPOSAL_KIND_DENSE:
        return tokens, _dense_rows(block.proposals, vocab_size).to(device)
    return tokens, _sparse_rows(block.proposals, vocab_size, device)


def _dense_rows(proposals: Sequence[common_pb2.TokenProposal], vocab_size: int) -> torch.Tensor:
    # A draft with a smaller (differently padded) vocabulary sends fewer rows: the rest are 0.
    q = torch.zeros(len(proposals), vocab_size, dtype=torch.float32)
    for row, proposal in enumerate(proposals):
        if not 0 < len(proposal.probs) <= vocab_size or proposal.ids:
            raise InvalidRequest(f"a DENSE proposal has 1 to {vocab_size} probs and no ids")
        q[row, : len(proposal.probs)] = torch.from_numpy(np.asarray(proposal.probs, dtype=np.float32))
    return q / _checked(q, q.sum(-1, dtype=torch.float64)).float()[:, None]


def _sparse_rows(
    proposals: Sequence[common_pb2.TokenProposal], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    ids, probs = [], []
    for proposal in proposals:
        if not proposal.probs or len(proposal.ids) != len(proposal.probs):
            raise InvalidRequest("a SPARSE proposal has as many ids as probs (at least one)")
        ids.append(np.asarray(proposal.ids, dtype=np.int64))
        probs.append(np.asarray(proposal.probs, dtype=np.float32))
    flat_ids = torch.from_numpy(np.concatenate(ids))
    if int(flat_ids.max()) >= vocab_size:
        raise InvalidRequest(f"proposal id out of range: the vocabulary has {vocab_size} ids")
    flat_probs = torch.from_numpy(np.concatenate(probs))
    rows = torch.arange(len(proposals)).repeat_interleave(torch.tensor([len(i) for i in ids]))
    totals = torch.zeros(len(proposals), dtype=torch.float64).index_add_(0, rows, flat_probs.double())
    values = flat_probs / _checked(flat_probs, totals).float()[rows]
    q = torch.zeros(len(proposals), vocab_size, dtype=torch.float32, device=device)
    # an id listed twice adds up, as its two entries were drawn from
    return q.index_put_((rows.to(device), flat_ids.to(device)), values.to(device), accumulate=True)


def _checked(probs: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """``totals`` (each row's sum of ``probs``), once every probability is finite and
    non-negative and every row sums to 1 (to _SUM_TOLERANCE)."""
    if (
        not bool(torch.isfinite(probs).all())
        or bool((probs < 0).any())
        or not bool(((totals - 1.0).abs() <= _SUM_TOLERANCE).all())
    ):
        raise InvalidRequest("proposal probabilities must be finite, non-negative and sum to 1")
    return totals


def warp_from_proto(warp: common_pb2.WarpParams) -> Warp:
    """WarpParams -> Warp; unset top_p (0) means off."""
    try:
        return Warp(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p or 1.0, min_p=warp.min_p)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def warp_to_proto(warp: Warp) -> common_pb2.WarpParams:
    return common_pb2.WarpParams(temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p, min_p=warp.min_p)
