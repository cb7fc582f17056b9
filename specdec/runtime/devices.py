"""Devices and dtypes by name, with torch alone (no transformers): what a command checks before
it starts services that load the models themselves."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(spec: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU. Raises ValueError
    (starting with ``spec``) for a device torch does not know or CUDA where there is none."""
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"{spec} is not a device torch knows (auto, cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{spec} requested but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere: on a CPU half precision is slow except
    bfloat16 where the CPU has AMX, and bfloat16's greedy tokens are not always those of one-token
    passes (README, Guarantees), so a CPU user opts in."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[spec]
