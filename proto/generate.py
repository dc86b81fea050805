"""Regenerate the Python gRPC stubs in common/grpc_gen/ from proto/*.proto.

Usage: python proto/generate.py [OUT_DIR]. grpc_tools writes absolute imports
(`import x_pb2`); we rewrite them to package-relative ones so the stubs live
inside the `common.grpc_gen` package. tests/test_proto_stubs.py regenerates
into a temp dir and fails if the committed stubs differ.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_DIR.parent / "common" / "grpc_gen"


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        path.write_text(fixed)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT):
        print(p)
