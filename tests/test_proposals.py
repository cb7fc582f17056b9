"""Draft block encoding and the target's validation of what it receives."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.proposals import decode_block, encode_block
from specdec.runtime.sampling import DraftSample, Warp, sample_draft_token
from specdec.serving.errors import InvalidRequest
from specdec.v1 import common_pb2
from tests.spec_oracle import proposal_matrix

V = 10


def test_round_trip_every_kind() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    for samples in (
        [DraftSample(3), DraftSample(4)],
        [sample_draft_token(logits, Warp(1.0), 4, gen) for _ in range(3)],
        [sample_draft_token(logits, Warp(0.7), 0, gen) for _ in range(2)],
    ):
        block = encode_block(samples)
        tokens, q = decode_block(block, V, "cpu")
        assert tokens.tolist() == [s.token_id for s in samples]
        if samples[0].probs is None:
            assert block.kind == common_pb2.PROPOSAL_KIND_ONE_HOT and q is None
        else:
            torch.testing.assert_close(q, proposal_matrix(samples, V))


def test_sparse_rows_of_any_length_and_a_repeated_id_decode_to_their_distributions() -> None:
    """Rows are scattered together: each keeps its own ids, an id listed twice adds up, and each
    row is divided by its own sum."""
    samples = [
        DraftSample(2, ids=torch.tensor([2, 7, 2]), probs=torch.tensor([0.25, 0.5, 0.25])),
        DraftSample(9, ids=torch.tensor([9]), probs=torch.tensor([1.0])),
        DraftSample(0, ids=torch.tensor([0, 1, 3, 4, 5]), probs=torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2005])),
    ]
    tokens, q = decode_block(encode_block(samples), V, "cpu")
    assert tokens.tolist() == [2, 9, 0] and q is not None
    assert q[0, 2] == 0.5 and q[0, 7] == 0.5 and q[1, 9] == 1.0
    torch.testing.assert_close(q[2, [0, 1, 3, 4, 5]], torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2005]) / 1.0005)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert int((q > 0).sum()) == 2 + 1 + 5


def test_a_block_is_encoded_as_protobuf_encodes_it() -> None:
    """The proposals' probabilities are written from the arrays' bytes (a dense row of the real
    vocabulary took ~10 ms as a list): the same wire bytes protobuf writes from a list, for a
    dense row longer than a one-byte and a two-byte length, sparse rows, a row of one value,
    values float32 rounds, and the edge values a row holds (0, the smallest subnormal, 1)."""
    long_row = torch.softmax(torch.randn(40_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64), -1)
    edges = torch.tensor([0.0, 1e-45, 0.5, 1.0, 1 / 3])
    for samples in (
        [DraftSample(5, probs=long_row), DraftSample(1, probs=edges), DraftSample(0, probs=torch.tensor([1.0]))],
        [
            DraftSample(2, ids=torch.tensor([2, 300, 70_000]), probs=edges[2:]),
            DraftSample(9, ids=torch.tensor([9]), probs=edges[3:4]),
        ],
    ):
        as_protobuf = common_pb2.DraftBlock(token_ids=[s.token_id for s in samples])
        as_protobuf.kind = encode_block(samples).kind
        for s in samples:
            entry = as_protobuf.proposals.add(probs=s.probs.float().tolist())
            if s.ids is not None:
                entry.ids.extend(s.ids.tolist())
        assert encode_block(samples).SerializeToString() == as_protobuf.SerializeToString()
        assert encode_block(samples) == as_protobuf


def sparse(ids: list[int], probs: list[float], tokens: list[int] | None = None) -> common_pb2.DraftBlock:
    return common_pb2.DraftBlock(
        token_ids=tokens or [ids[0]],
        kind=common_pb2.PROPOSAL_KIND_SPARSE,
        proposals=[common_pb2.TokenProposal(ids=ids, probs=probs)],
    )


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (common_pb2.DraftBlock(token_ids=[V]), "draft token id out of range"),
        (sparse([1, V], [0.5, 0.5]), "proposal id out of range"),
        (sparse([1, 2], [0.5]), "as many ids as probs"),
        (sparse([1, 2], [0.5, 0.6]), "sum to 1"),
        (sparse([1, 2], [1.5, -0.5]), "non-negative"),
        (sparse([1, 2], [float("nan"), 1.0]), "finite"),
        (sparse([1], [1.0], tokens=[1, 2]), "2 tokens but 1 proposals"),
        (
            common_pb2.DraftBlock(
                token_ids=[1],
                kind=common_pb2.PROPOSAL_KIND_DENSE,
                proposals=[common_pb2.TokenProposal(probs=[1 / 11] * 11)],
            ),
            "1 to 10 probs",
        ),
        (
            common_pb2.DraftBlock(
                token_ids=[1],
                kind=common_pb2.PROPOSAL_KIND_UNSPECIFIED,
                proposals=[common_pb2.TokenProposal(probs=[1.0])],
            ),
            "kind must be",
        ),
    ],
)
def test_malformed_blocks_are_rejected(block: common_pb2.DraftBlock, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        decode_block(block, V, "cpu")


def test_a_dense_row_from_a_smaller_vocabulary_is_padded_with_zeros() -> None:
    """A draft whose output layer has fewer rows than the target's sends shorter dense rows."""
    probs = torch.tensor([0.5, 0.25, 0.25])
    block = encode_block([DraftSample(token_id=1, probs=probs)])
    tokens, q = decode_block(block, V, "cpu")
    assert tokens.tolist() == [1] and q is not None
    assert q[0].tolist() == [0.5, 0.25, 0.25] + [0.0] * (V - 3)
    too_long = encode_block([DraftSample(token_id=1, probs=torch.full((V + 1,), 1 / (V + 1)))])
    with pytest.raises(InvalidRequest, match="1 to 10 probs"):
        decode_block(too_long, V, "cpu")
