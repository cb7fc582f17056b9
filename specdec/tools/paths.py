"""Checks of the paths the command-line tools write, made before the work that ends in writing them."""

from __future__ import annotations

import os
from pathlib import Path


def check_output_file(path: Path, flag: str, hint: str = "") -> None:
    """Raises ValueError naming ``flag`` when ``path`` cannot be written: a directory, or a file
    whose directory cannot be made or written to. Makes that directory."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give the file's name{hint}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot write {flag} {path}: {e}") from None
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"cannot write {flag} {path}: its directory is not writable")
