"""Regenerates the committed gRPC modules from proto/gpucoord/v1/*.proto.

Run ``python -m agent_client.api.gen``. The .proto files are mapped onto this package's directory, so the
generated imports read ``from agent_client.api import ...`` while the wire package stays ``gpucoord.v1``.
"""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto" / "gpucoord" / "v1"
PROTOS = ("coordinator.proto", "node.proto", "registry.proto")


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{include}",
        f"-Iagent_client/api={PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[f"agent_client/api/{p}" for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> None:
    generate(ROOT)


if __name__ == "__main__":
    main()
