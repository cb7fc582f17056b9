"""Helpers over committed token sequences shared by the coordinator and the workers."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any


def prefix_hash(token_ids: Sequence[int]) -> int:
    """64-bit hash of a token sequence; 0 for the empty sequence.

    The coordinator sends it with every worker call so that a worker can prove its cache holds
    exactly the committed prefix before it reuses it.
    """
    if not token_ids:
        return 0
    digest = hashlib.blake2b(pack_tokens(token_ids), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


_CHECKPOINT_TOKENS = 4096  # PrefixHashes keeps the hash state after every this many tokens


class PrefixHashes:
    """``prefix_hash(tokens[:length])`` of one growing token list, in time proportional to the
    tokens added since the last call (the hash state is kept and extended), not to ``length``.

    Valid while the caller only appends to the list, or reports a cut with ``cut``: a state is
    kept for the list object last hashed (another list starts over), and after every 4,096 tokens
    a copy of it, so that a shorter length or a cut costs at most that many tokens again.
    """

    def __init__(self) -> None:
        self._tokens: Sequence[int] | None = None
        self._length = 0
        self._state = hashlib.blake2b(digest_size=8)
        self._checkpoints: list[Any] = []  # [i]: the state after tokens[: (i + 1) * _CHECKPOINT_TOKENS]

    def of(self, tokens: Sequence[int], length: int) -> int:
        """``prefix_hash(tokens[:length])``."""
        if tokens is not self._tokens:
            self._tokens = tokens
            self.cut(0)
        elif length < self._length:
            self.cut(length)
        while self._length < length:
            end = min(length, (self._length // _CHECKPOINT_TOKENS + 1) * _CHECKPOINT_TOKENS)
            self._state.update(pack_tokens(tokens[self._length : end]))
            self._length = end
            if end % _CHECKPOINT_TOKENS == 0 and len(self._checkpoints) < end // _CHECKPOINT_TOKENS:
                self._checkpoints.append(self._state.copy())
        return (int.from_bytes(self._state.digest(), "little") or 1) if length else 0

    def cut(self, length: int) -> None:
        """The list's tokens from ``length`` on changed (or were removed): forget their state."""
        if length >= self._length:
            return
        del self._checkpoints[length // _CHECKPOINT_TOKENS :]
        self._length = len(self._checkpoints) * _CHECKPOINT_TOKENS
        self._state = self._checkpoints[-1].copy() if self._checkpoints else hashlib.blake2b(digest_size=8)


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


_COMPARE_CHUNK = 1024  # common_prefix_len compares this many tokens at a time (at C speed)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (chunk by chunk, then token
    by token inside the first chunk that differs)."""
    n = min(len(a), len(b))
    for start in range(0, n, _COMPARE_CHUNK):
        end = min(start + _COMPARE_CHUNK, n)
        if list(a[start:end]) != list(b[start:end]):
            return next(i for i in range(start, end) if a[i] != b[i])
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


def start_on_a_character(
    decode: Callable[[Sequence[int]], str], token_ids: Sequence[int], start: int, end: int | None = None
) -> int:
    """``start`` moved back (by at most 16 tokens) to where the text of ``token_ids[start:end]``
    does not begin with U+FFFD: a decode window that starts inside a character, or inside a run of
    byte tokens (which SentencePiece byte fallback decodes as a whole), turns it, and the rest of
    the run, into U+FFFD."""
    earliest = max(start - 16, 0)
    while start > earliest and decode(token_ids[start:end]).startswith("\ufffd"):
        start -= 1
    return start
