"""The committed gRPC modules must be exactly what the .proto files generate."""
from __future__ import annotations

import pathlib

from agent_client.api import gen

API = pathlib.Path(gen.__file__).parent
GENERATED = ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py",
             "node_pb2.py", "node_pb2.pyi", "node_pb2_grpc.py",
             "registry_pb2.py", "registry_pb2.pyi", "registry_pb2_grpc.py")


def test_generated_modules_match_the_protos(tmp_path: pathlib.Path) -> None:
    gen.generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "agent_client" / "api" / name).read_text()
        committed = (API / name).read_text()
        assert fresh == committed, f"agent_client/api/{name} is stale: run `python -m agent_client.api.gen`"


def test_generated_runtime_versions_are_pinned_together() -> None:
    import grpc
    from google.protobuf import __version__ as protobuf_version

    text = (API / "coordinator_pb2_grpc.py").read_text()
    generated_grpc = text.split("GRPC_GENERATED_VERSION = '")[1].split("'")[0]
    assert tuple(map(int, grpc.__version__.split(".")[:3])) >= tuple(map(int, generated_grpc.split(".")))
    gencode = (API / "coordinator_pb2.py").read_text().split("Protobuf Python Version: ")[1].split()[0]
    assert tuple(map(int, protobuf_version.split(".")[:2])) >= tuple(map(int, gencode.split(".")[:2]))
