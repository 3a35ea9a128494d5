"""Typed errors of the agent client, one per gRPC status code the coordinator answers with."""
from __future__ import annotations

import grpc


class GpucoordError(Exception):
    """Root of the client's errors. ``code`` is the gRPC status; ``message`` the coordinator's text."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(GpucoordError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GpucoordError):
    code = grpc.StatusCode.NOT_FOUND


class SessionExpired(NotFound):
    """The session's TTL passed (or it was closed): its leases are gone. Open a new client."""


class FailedPrecondition(GpucoordError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(GpucoordError):
    """It does not fit now (or the queue is full)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(GpucoordError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(GpucoordError):
    """No coordinator could be reached before the deadline."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(GpucoordError):
    """No replica answered in time: attempts ran past their deadline (or their replica hung) on every
    address tried, until the call's own deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE: dict[grpc.StatusCode, type[GpucoordError]] = {
    c.code: c for c in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, PermissionDenied,
                        Unavailable, DeadlineExceeded)
}


def from_rpc_error(e: grpc.RpcError) -> GpucoordError:
    code = e.code()
    details = e.details() or code.name
    if code == grpc.StatusCode.NOT_FOUND and details.startswith("session"):
        return SessionExpired(details)
    return _BY_CODE.get(code, GpucoordError)(details)
