"""Tokenizers of Hugging Face checkpoints (local directory or hub id), without the model stack:
the coordinator needs only these, and importing transformers' modeling code costs seconds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_CHECKPOINT_HELP = (
    "pass a directory holding a Hugging Face checkpoint (config.json, weights, tokenizer files; "
    "`specdec models fetch` writes some), or a hub id such as Qwen/Qwen2.5-0.5B where the hub is reachable"
)


def check_source(model_id: str, need_config: bool = True) -> None:
    """Raises ValueError saying what is wrong when ``model_id`` is meant as a local directory (it
    exists, or it is written as a path) and is not a checkpoint; a hub id is left to the hub."""
    path = Path(model_id).expanduser()
    looks_like_a_path = model_id.startswith(("/", ".", "~")) or model_id.endswith("/") or model_id.count("/") > 1
    if not path.exists():
        if looks_like_a_path:
            raise ValueError(f"{model_id}: no such directory; {_CHECKPOINT_HELP}")
        return
    if not path.is_dir():
        raise ValueError(f"{model_id} is a file, not a checkpoint directory; {_CHECKPOINT_HELP}")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{model_id} holds no tokenizer ({' or '.join(_TOKENIZER_FILES)}); {_CHECKPOINT_HELP}")
    if need_config and not (path / "config.json").is_file():
        raise ValueError(f"{model_id} holds no config.json, so no model; {_CHECKPOINT_HELP}")


def load_tokenizer(model_id: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer stored with a model (a directory of tokenizer files will do)."""
    check_source(model_id, need_config=False)
    return AutoTokenizer.from_pretrained(model_id, trust_remote_code=trust_remote_code)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the token-string -> id mapping (two tokenizers with equal hashes agree on ids)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]
