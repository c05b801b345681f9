"""Regenerate the Python gRPC stubs in this folder from ``protos/minicpmo/v1/*.proto``.

The stubs are committed so that a runtime install needs no grpcio-tools (the GPU host installs the
project with ``--no-deps``). ``tests/test_proto_stubs.py`` regenerates into a temporary folder and
fails when the committed files are stale, so the protos stay the single source of truth.

Usage: ``python -m services.common.pb.generate [OUT_DIR]``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[3] / "protos"
PROTO_FILES = ("common", "thinker", "talker", "code2wav")
# Generated code imports siblings as ``minicpmo.v1``; rewrite to this package's import path.
_IMPORT_RE = re.compile(r"^from minicpmo\.v1 import (\w+) as", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc over every proto and write rewritten stubs into ``out_dir``."""
    import tempfile

    import grpc_tools
    from grpc_tools import protoc  # build-time only

    include = Path(grpc_tools.__file__).parent / "_proto"
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [str(PROTO_ROOT / "minicpmo" / "v1" / f"{name}.proto") for name in PROTO_FILES]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {PROTO_ROOT}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted((Path(tmp) / "minicpmo" / "v1").iterdir()):
            text = _IMPORT_RE.sub(r"from services.common.pb import \1 as", src.read_text())
            text = text.replace("from minicpmo.v1 import ", "from services.common.pb import ")
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    for path in generate(out):
        print(path)


if __name__ == "__main__":
    main()
