"""`specdec draft-vocab`: count a corpus's tokens and write the draft vocabulary file that
`specdec serve draft --draft-vocab` loads (see specdec.runtime.output_vocab)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import structlog

from specdec.runtime.output_vocab import build_output_vocab, write_output_vocab
from specdec.runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
from specdec.tools.paths import check_output_file

log = structlog.get_logger(__name__)


def corpus_texts(paths: Sequence[Path], patterns: Sequence[str], max_bytes: int) -> Iterator[str]:
    """The UTF-8 text of ``paths`` (files, and the files under directories that match any of
    ``patterns``), in a stable order, up to ``max_bytes`` in all; files that are not UTF-8 text are
    skipped. Raises ValueError for a path that does not exist or a corpus with no text."""
    if max_bytes < 1:
        raise ValueError(f"--max-bytes must be at least 1, got {max_bytes}")
    read = 0
    for path in paths:
        if not path.exists():
            raise ValueError(f"corpus path {path} does not exist")
        files = [path]
        if path.is_dir():
            files = sorted({p for pattern in patterns for p in path.glob(pattern) if p.is_file()})
        for file in files:
            if read >= max_bytes:
                return
            try:
                data = file.read_bytes()[: max_bytes - read]
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            read += len(data)
            yield text
    if read == 0:
        where = ", ".join(map(str, paths))
        raise ValueError(f"no UTF-8 text found in {where} (files matching {' or '.join(patterns)})")


def make_draft_vocab(
    model: str,
    corpus: Sequence[Path],
    size: int,
    out: Path,
    patterns: Sequence[str] = ("**/*",),
    max_bytes: int = 200_000_000,
) -> list[int]:
    """Builds the draft vocabulary of ``model``'s tokenizer from ``corpus`` and writes it to ``out``."""
    check_output_file(out, "--out", " (the draft vocabulary's JSON)")
    tokenizer = load_tokenizer(model)
    ids = build_output_vocab(tokenizer, corpus_texts(corpus, patterns, max_bytes), size)
    source = f"{size} tokens of {', '.join(map(str, corpus))} ({' or '.join(patterns)})"
    write_output_vocab(out, ids, tokenizer_fingerprint(tokenizer), len(tokenizer), source)
    log.info("draft_vocab_written", path=str(out), kept=len(ids), vocab_size=len(tokenizer))
    return ids
