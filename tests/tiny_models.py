"""Tiny random Llama-style models and a byte-level tokenizer, built from a config (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<s>", "</s>", "<pad>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: 256 byte tokens + <s>, </s>, <pad> (259 ids)."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for name in SPECIALS:
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_model(path: Path, seed: int, hidden: int, layers: int, vocab: int, init_range: float = 0.02) -> Path:
    """Saves a random Llama with the byte tokenizer at ``path``."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_adversarial(target: Path, path: Path) -> Path:
    """The target with its output layer negated: its favourite token is the target's least likely."""
    model = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight.neg_()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@dataclass(frozen=True)
class TinyModels:
    target: Path
    same: Path  # a copy of the target: every draft token is accepted
    other: Path  # an unrelated, smaller random model with the same tokenizer
    adversarial: Path  # proposes the target's least likely token: every greedy draft is rejected


def build_tiny_models(root: Path) -> TinyModels:
    vocab = len(build_tokenizer())
    target = build_model(root / "target", seed=0, hidden=64, layers=2, vocab=vocab, init_range=0.2)
    same = build_model(root / "same", seed=0, hidden=64, layers=2, vocab=vocab, init_range=0.2)
    other = build_model(root / "other", seed=1, hidden=32, layers=1, vocab=vocab, init_range=0.2)
    adversarial = build_adversarial(target, root / "adversarial")
    return TinyModels(target=target, same=same, other=other, adversarial=adversarial)
