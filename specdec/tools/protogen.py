"""Regenerates the gRPC stubs in ``specdec/v1`` from ``protos/``.

Run from a source checkout: ``python -m specdec.tools.protogen`` (or ``--check`` to verify that the
committed stubs match the protos).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
STUB_DIR = Path("specdec") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Runs protoc over every proto file, writing ``specdec/v1/*`` under ``out_root``."""
    protos = sorted(PROTO_ROOT.glob("specdec/v1/*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT}; run from a source checkout")
    include = str(files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its messages above")
    generated = out_root / STUB_DIR
    (generated / "__init__.py").write_text('"""Generated gRPC stubs (python -m specdec.tools.protogen)."""\n')
    return sorted(generated.iterdir())


def stale_files() -> list[str]:
    """Names of committed stub files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = REPO_ROOT / STUB_DIR
        return [
            f.name
            for f in fresh
            if not (committed / f.name).exists() or not filecmp.cmp(f, committed / f.name, shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    if parser.parse_args().check:
        stale = stale_files()
        if stale:
            sys.stderr.write(f"stale stubs: {', '.join(stale)}; run python -m specdec.tools.protogen\n")
            return 1
        return 0
    generate(REPO_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
