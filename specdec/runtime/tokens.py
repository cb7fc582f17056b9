"""Helpers over committed token sequences shared by the coordinator and the workers."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def prefix_hash(token_ids: Sequence[int]) -> int:
    """64-bit hash of a token sequence; 0 for the empty sequence.

    The coordinator sends it with every worker call so that a worker can prove its cache holds
    exactly the committed prefix before it reuses it.
    """
    if not token_ids:
        return 0
    digest = hashlib.blake2b(pack_tokens(token_ids), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def block_hashes(token_ids: Sequence[int], block: int, salt: str = "") -> list[str]:
    """Chain hashes of the full ``block``-token blocks: entry i identifies ``token_ids[:(i + 1) *
    block]`` (each hash covers the previous one and the block), salted (e.g. with the caller's
    identity, so that one caller's prefixes are never found by another)."""
    hashes: list[str] = []
    previous = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for end in range(block, len(token_ids) + 1, block):
        previous = hashlib.blake2b(previous + pack_tokens(token_ids[end - block : end]), digest_size=16).digest()
        hashes.append(previous.hex())
    return hashes


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the state store's encoding)."""
    arr = array("I", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """Inverse of ``pack_tokens``."""
    arr = array("I")
    arr.frombytes(data)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()
