"""A draft whose output layer scores only the tokens a workload uses (FR-Spec, EAGLE-3's draft
vocabulary; SGLang's ``--speculative-token-map``).

A small draft model spends a large share of each step in its output layer: Qwen2.5-0.5B's LM head
is 136M of its 494M weights. Keeping only the rows of the tokens that a workload's text is made
of (a frequency count over a corpus of it, ``build_output_vocab``) makes each draft step cheaper;
the draft then proposes only those tokens. Exactness does not depend on the choice: the other
tokens get logit -inf, so probability 0 in the proposal distribution the target verifies against
(a token the draft cannot propose is the target's to produce, as after any rejection).

The file (``specdec draft-vocab``) is JSON: the tokenizer's fingerprint (a file made for another
tokenizer is refused at load), the vocabulary size and the kept token ids, most frequent first.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

FORMAT = "specdec-draft-vocab/1"


class RestrictedHead(torch.nn.Module):
    """An output layer computing the logits of ``ids`` only; every other token's logit is -inf.

    ``inner`` holds just those rows of the original layer (a plain ``nn.Linear``, so int8
    quantization and the packed CPU kernel apply to it as to any other layer)."""

    def __init__(self, head: torch.nn.Linear, ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = head.out_features
        self.inner = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device="meta")
        # indexing by ``ids`` copies the rows (the original matrix stays with a tied embedding)
        self.inner.weight = torch.nn.Parameter(head.weight.detach()[ids], requires_grad=False)
        if head.bias is not None:
            self.inner.bias = torch.nn.Parameter(head.bias.detach()[ids], requires_grad=False)
        self.register_buffer("ids", ids, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.inner(x)
        logits = rows.new_full((*rows.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.ids, rows)

    def extra_repr(self) -> str:
        return f"kept={len(self.ids)}, vocab_size={self.vocab_size}"


def restrict_output(model: Any, ids: Sequence[int]) -> int:
    """Replaces ``model``'s output layer with a RestrictedHead over ``ids``; returns how many it keeps."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"--draft-vocab needs an nn.Linear output layer; this model has {type(head).__name__}")
    kept = torch.tensor(sorted(set(ids)), dtype=torch.long, device=head.weight.device)
    if len(kept) == 0 or int(kept[0]) < 0 or int(kept[-1]) >= head.out_features:
        raise ValueError(f"--draft-vocab ids must lie in [0, {head.out_features}) and not be empty")
    model.set_output_embeddings(RestrictedHead(head, kept))
    return len(kept)


def build_output_vocab(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str], size: int) -> list[int]:
    """The ``size`` tokens to keep: every special token (end of sequence, chat and fill-in-the-middle
    markup), then the most frequent tokens of ``texts`` (ties: the lower id), then, if the texts
    use fewer, the lowest ids not yet kept (byte-level BPE numbers merges in the order they were
    learned, most frequent first). Most frequent first."""
    vocab = len(tokenizer)
    if not 0 < size <= vocab:
        raise ValueError(f"the draft vocabulary size must be between 1 and {vocab} (this tokenizer), got {size}")
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    added = (i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    kept = dict.fromkeys(sorted({i for i in (*tokenizer.all_special_ids, *added) if 0 <= i < vocab}))
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(kept) >= size:
            break
        kept.setdefault(token)
    for token in range(vocab):
        if len(kept) >= size:
            break
        kept.setdefault(token)
    return list(kept)[:size]


def write_output_vocab(path: Path, ids: Sequence[int], tokenizer_hash: str, vocab_size: int, source: str) -> None:
    document = {"format": FORMAT, "tokenizer": tokenizer_hash, "vocab_size": vocab_size, "source": source}
    path.write_text(json.dumps({**document, "token_ids": list(ids)}) + "\n")


def read_output_vocab(path: str, tokenizer_hash: str) -> list[int]:
    """The token ids of a ``specdec draft-vocab`` file; raises ValueError saying what is wrong."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--draft-vocab {path}: cannot read it as JSON ({e})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"--draft-vocab {path}: not a draft vocabulary file (make one with `specdec draft-vocab`)")
    if document.get("tokenizer") != tokenizer_hash:
        raise ValueError(
            f"--draft-vocab {path} was made for another tokenizer than this draft model's; "
            "rebuild it with `specdec draft-vocab --model` set to this draft model"
        )
    ids = document.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"--draft-vocab {path}: token_ids must be a list of integers")
    return ids
