"""Drafting across tokenizers: a draft whose vocabulary differs from the target's.

Two lossless methods (Timor et al., ICML 2025, "Accelerating LLM Inference with Lossless
Speculative Decoding Algorithms for Heterogeneous Vocabularies"):

- **TLI** (token-level intersection): the draft's distribution is restricted to the draft tokens
  whose text is also one target token, renormalised, and sent in target ids. Standard rejection
  sampling against that distribution keeps the target's output exact, greedy or sampled.
- **SLEM** (string-level exact match): the draft drafts freely in its own vocabulary; its text is
  re-tokenized with the target's tokenizer and proposed one-hot. A one-hot proposal is verified
  exactly (accepted with probability p(x), else drawn from p without x), so this is exact too.

Either way the draft keeps its own token history per session: the target ids the coordinator
commits are decoded to text and the text re-tokenized for the draft (``TextMirror``), so after a
partially accepted block the draft re-syncs from the committed *text*, never from its guesses.

Tokens are matched by the bytes they stand for (byte-level BPE and SentencePiece spellings of a
space agree); special and added tokens by their content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from specdec.runtime.tokens import PrefixHashes, common_prefix_len, start_on_a_character

VocabMethod = Literal["tli", "slem"]

_RETOKENIZE_MARGIN_CHARS = 32  # draft tokens this close to the end of the text are tokenized again
_DECODE_CONTEXT_TOKENS = 4  # tokens of left context when decoding a tail (SentencePiece spaces)
_MAX_UTF8_CONTINUATION = 3  # a character is at most 4 bytes: up to 3 tokens may await its end
_ANCHOR_TOKENS = 4  # committed target tokens re-tokenized with a SLEM draft's text
_REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """The character -> byte map of byte-level BPE (GPT-2): printable Latin-1 bytes stand for
    themselves, the other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


def _decoder_kinds(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {str(step.get("type")) for step in steps}


def token_keys(tokenizer: PreTrainedTokenizerBase) -> list[bytes | str | None]:
    """What each id stands for: the bytes of a regular token, ``"special:<content>"`` for an added
    token (so a draft's ``<|im_end|>`` meets the target's), None for an id with no token."""
    size = len(tokenizer)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    kinds = _decoder_kinds(tokenizer)
    alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
    keys: list[bytes | str | None] = []
    for i, piece in enumerate(pieces):
        if i in added:
            keys.append(f"special:{added[i]}")
        elif piece is None:
            keys.append(None)
        elif alphabet is not None:
            keys.append(bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else None)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            keys.append(bytes([int(piece[3:5], 16)]))
        else:
            keys.append(piece.replace("\u2581", " ").encode())
    return keys


class VocabBridge:
    """The fixed facts of one draft/target tokenizer pair: the id map for TLI and the
    decode/encode calls the mirrors use (the Rust tokenizers, no Python-side clean-up)."""

    def __init__(
        self,
        draft: PreTrainedTokenizerBase,
        target: PreTrainedTokenizerBase,
        draft_logits: int,
        method: VocabMethod,
    ) -> None:
        """``draft_logits``: the draft model's output rows (may exceed its tokenizer's size)."""
        for role, tok in (("draft", draft), ("target", target)):
            if not getattr(tok, "is_fast", False):
                raise ValueError(f"the {role} tokenizer must be a fast (tokenizers) one to draft across vocabularies")
        self.method: VocabMethod = method
        self._draft = draft.backend_tokenizer
        self._target = target.backend_tokenizer
        self.target_size = len(target)
        target_ids: dict[bytes | str, int] = {}
        for tid, key in enumerate(token_keys(target)):
            if key is not None and key != b"":
                target_ids.setdefault(key, tid)
        draft_to_target = torch.full((draft_logits,), -1, dtype=torch.long)
        for did, key in enumerate(token_keys(draft)[:draft_logits]):
            if key is not None and key in target_ids:
                draft_to_target[did] = target_ids[key]
        self.draft_to_target = draft_to_target
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        self._maps: dict[str, torch.Tensor] = {}
        self.shared_tokens = int((draft_to_target >= 0).sum())
        if not self.shared_tokens:
            raise ValueError("the draft and target tokenizers share no token; no draft can be verified")

    def proposable(self, vocab_limit: int, device: torch.device) -> torch.Tensor:
        """Draft ids (a bool mask over the draft's logits, on ``device``) that TLI may propose: those
        with a target id below ``vocab_limit`` (0 = the whole target tokenizer)."""
        limit = vocab_limit or self.target_size
        key = (limit, str(device))
        if key not in self._masks:
            self._masks[key] = ((self.draft_to_target >= 0) & (self.draft_to_target < limit)).to(device)
        return self._masks[key]

    def id_map(self, device: torch.device) -> torch.Tensor:
        """``draft_to_target`` on ``device``."""
        key = str(device)
        if key not in self._maps:
            self._maps[key] = self.draft_to_target.to(device)
        return self._maps[key]

    def decode_target(self, ids: Sequence[int]) -> str:
        return self._target.decode(list(ids), skip_special_tokens=False)

    def decode_draft(self, ids: Sequence[int]) -> str:
        return self._draft.decode(list(ids), skip_special_tokens=False)

    def encode_target(self, text: str) -> list[int]:
        return list(self._target.encode(text, add_special_tokens=False).ids)

    def encode_draft(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Draft ids of ``text`` and each one's character span in it."""
        encoding = self._draft.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]  # type: ignore[misc]


@dataclass
class TextMirror:
    """One session's committed target ids, their text, and the draft's tokenization of it.

    The coordinator syncs target ids (a prefix it can prove by hash, then a tail). The text grows
    by decoding the new ids with a few tokens of left context (starting on a character); ids that
    end inside a character wait (``clean`` < len) until the character is complete. The draft's
    tokens are re-made from the text's end: tokens ending more than a margin before the old end
    are kept, the rest of the text is tokenized again (so a word split by a round boundary is
    tokenized whole).
    """

    bridge: VocabBridge
    target_ids: list[int] = field(default_factory=list)
    clean: int = 0  # target_ids[:clean] decode to `text`
    text: str = ""
    draft_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # each draft token's characters in `text`
    _hashes: PrefixHashes = field(default_factory=PrefixHashes, repr=False)  # of `target_ids`, kept as they grow

    def holds(self, length: int, expected_hash: int) -> bool:
        """Whether the mirror holds ``length`` committed ids whose hash is ``expected_hash``."""
        return length <= len(self.target_ids) and self._hashes.of(self.target_ids, length) == expected_hash

    @property
    def pending(self) -> int:
        """Committed target ids not yet in the text (they end inside a character)."""
        return len(self.target_ids) - self.clean

    def update(self, base_len: int, tail: Sequence[int]) -> None:
        """The committed ids are now the first ``base_len`` held ones followed by ``tail``.

        Works on what changed (the lists are cut and extended in place), so that a round costs the
        same in a long session as in a short one."""
        ids = self.target_ids
        base_len = min(base_len, len(ids))
        same = base_len + common_prefix_len(ids[base_len:], tail)
        if same < len(ids):
            del ids[same:]
            self._hashes.cut(same)
        ids.extend(tail[same - base_len :])
        if same < self.clean:  # the text itself changed: start over
            self.clean, self.text, self.draft_ids, self.spans = 0, "", [], []
        old_len = len(self.text)
        self._extend_text()
        if len(self.text) != old_len or not self.draft_ids:
            self._retokenize(old_len)

    def _extend_text(self) -> None:
        ids, clean = self.target_ids, self.clean
        if clean == len(ids):
            return
        context = start_on_a_character(self.bridge.decode_target, ids, max(0, clean - _DECODE_CONTEXT_TOKENS), clean)
        for end in range(len(ids), clean, -1):
            piece = self.bridge.decode_target(ids[context:end])
            if not piece.endswith(_REPLACEMENT):
                self._append_text(context, end, piece)
                return
            if len(ids) - end >= _MAX_UTF8_CONTINUATION:
                break
        end = len(ids) - _MAX_UTF8_CONTINUATION  # bytes before this can no longer complete a character
        if end > clean:
            self._append_text(context, end, self.bridge.decode_target(ids[context:end]))

    def _append_text(self, context: int, end: int, piece: str) -> None:
        """Adds the text of ids[clean:end]; ``piece`` is the text of ids[context:end]."""
        before = self.bridge.decode_target(self.target_ids[context : self.clean]) if context < self.clean else ""
        if piece.startswith(before):
            self.text += piece[len(before) :]
        else:  # decoding is not concatenative here: decode the whole prefix
            self.text = self.bridge.decode_target(self.target_ids[:end])
        self.clean = end

    def _retokenize(self, old_len: int) -> None:
        limit = old_len - _RETOKENIZE_MARGIN_CHARS
        keep = len(self.spans)  # the tokens that end by the limit (the spans' ends never decrease)
        while keep and self.spans[keep - 1][1] > limit:
            keep -= 1
        while 0 < keep < len(self.spans) and self.spans[keep][0] != self.spans[keep - 1][1]:
            keep -= 1  # never restart inside a character split across tokens
        start = self.spans[keep - 1][1] if keep else 0
        ids, spans = self.bridge.encode_draft(self.text[start:])
        del self.draft_ids[keep:], self.spans[keep:]
        self.draft_ids.extend(ids)
        self.spans.extend((a + start, b + start) for a, b in spans)

    def draft_text(self, drafted: Sequence[int]) -> str:
        """The text the draft's ``drafted`` ids add after the mirrored text (a trailing partial
        character left out)."""
        context = self.draft_ids[-_DECODE_CONTEXT_TOKENS:]
        before = self.bridge.decode_draft(context)
        after = self.bridge.decode_draft([*context, *drafted])
        if not after.startswith(before):
            return ""
        return after[len(before) :].rstrip(_REPLACEMENT)

    def slem_targets(self, drafted: Sequence[int], k: int) -> list[int]:
        """SLEM: the draft's text tokenized as the target would, up to ``k`` target ids.

        The last few committed target ids are tokenized again together with the draft's text (so a
        word continued by the draft gets the target's own tokens), as long as that leaves the
        committed ids unchanged; otherwise fewer of them, down to the draft's text alone.
        """
        text = self.draft_text(drafted)
        if not text or self.pending:
            return []
        for anchor_len in range(min(_ANCHOR_TOKENS, self.clean), -1, -1):
            anchor = self.target_ids[self.clean - anchor_len : self.clean]
            anchor_text = self.bridge.decode_target(anchor) if anchor else ""
            if anchor_text.startswith(_REPLACEMENT):
                continue
            ids = self.bridge.encode_target(anchor_text + text)
            if ids[:anchor_len] == anchor:
                return ids[anchor_len : anchor_len + k]
        return []
