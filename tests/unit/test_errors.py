"""Every error of the tree names a real gRPC status code (the servers look it up by name)."""
from __future__ import annotations

import grpc

from coordinator import errors


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def test_every_error_names_a_grpc_status_code() -> None:
    for cls in _subclasses(errors.GpucoordError):
        assert isinstance(grpc.StatusCode[cls.code], grpc.StatusCode), cls
