"""Loading Hugging Face causal LMs and tokenizers (local directory or hub id)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(spec: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} requested but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere (CPU half precision is slow and inexact)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[spec]


def load_tokenizer(model_id: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer stored with a model."""
    return AutoTokenizer.from_pretrained(model_id, trust_remote_code=trust_remote_code)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the token-string -> id mapping (two tokenizers with equal hashes agree on ids)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with the facts a worker reports in Info."""

    model_id: str
    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer_hash: str


def load_model(
    model_id: str, device_spec: str = "auto", dtype_spec: str = "auto", trust_remote_code: bool = False
) -> LoadedModel:
    """Loads model weights and tokenizer; raises with a clear message when either is missing."""
    device = resolve_device(device_spec)
    dtype = resolve_dtype(dtype_spec, device)
    tokenizer = load_tokenizer(model_id, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to(device).eval()
    model.requires_grad_(False)
    config = model.config
    loaded = LoadedModel(
        model_id=model_id,
        model=model,
        device=device,
        dtype=dtype,
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context_len=int(getattr(config, "max_position_embeddings", 0) or tokenizer.model_max_length),
        eos_token_ids=_eos_ids(model, tokenizer),
        tokenizer_hash=tokenizer_fingerprint(tokenizer),
    )
    log.info(
        "model_loaded",
        model=model_id,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        vocab_size=loaded.vocab_size,
        max_context_len=loaded.max_context_len,
    )
    return loaded


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    candidates: list[Any] = []
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    candidates += [model.config.eos_token_id, tokenizer.eos_token_id]
    for value in candidates:
        if value is None:
            continue
        ids = value if isinstance(value, list | tuple) else [value]
        return tuple(sorted({int(i) for i in ids}))
    return ()
