"""Regenerates the Python modules for protos/*.proto (`python -m protos.codegen`) with grpcio-tools
1.84.0 (a newer 1.84.x's stubs refuse an older grpcio 1.84); `generate(out_dir)` is what the test
that keeps the committed modules current calls.
"""
from __future__ import annotations

import pathlib
import sys

PROTO_FILES = ("protos/generate.proto", "protos/executor.proto", "protos/admin.proto")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(out_dir: pathlib.Path) -> None:
    """Writes protos/<name>_pb2.py, _pb2.pyi and _pb2_grpc.py under out_dir."""
    from grpc_tools import protoc  # build-time only: the services never import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / p) for p in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
