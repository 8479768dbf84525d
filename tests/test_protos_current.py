"""The committed generated modules are exactly what grpcio-tools makes from the .proto files."""
import pathlib

import pytest

from protos import codegen

pytest.importorskip("grpc_tools")


def test_generated_code_is_current(tmp_path):
    codegen.generate(tmp_path)
    committed = pathlib.Path(codegen.__file__).parent
    generated = sorted((tmp_path / "protos").iterdir())
    assert {p.name for p in generated} >= {"generate_pb2.py", "executor_pb2_grpc.py"}
    for path in generated:
        assert (committed / path.name).read_bytes() == path.read_bytes(), (
            f"protos/{path.name} is stale: run `python -m protos.codegen`")


def test_stubs_import_under_installed_grpc():
    from protos import executor_pb2_grpc, generate_pb2_grpc  # noqa: F401
