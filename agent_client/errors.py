"""Typed errors of the agent client, one per gRPC status code the coordinator answers with.

Each carries the coordinator's machine-readable ``reason`` (``SESSION_GONE``, ``NO_FIT``, ``QUEUE_FULL``,
``INVALID_FIELD``, ...) and the request ``field`` at fault, read from the status's rich details (a
``google.rpc.ErrorInfo``); the client acts on the reason, never on the message's text.
"""
from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"
SESSION_GONE = "SESSION_GONE"


class GpucoordError(Exception):
    """Root of the client's errors. ``code`` is the gRPC status; ``message`` the coordinator's text."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, reason: str = "", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field


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


def error_info(e: grpc.RpcError) -> tuple[str, str]:
    """The coordinator's reason and the field at fault, from the error's rich status details; ("", "") when
    it sent none (e.g. the error came from gRPC itself)."""
    trailing: Iterable[tuple[str, str | bytes]] | None = \
        e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else ()
    for key, value in trailing or ():
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return "", ""
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info.reason, info.metadata.get("field", "")
    return "", ""


def session_gone(e: grpc.RpcError) -> bool:
    """The coordinator says the session is gone (expired, closed or unknown)."""
    return error_info(e)[0] == SESSION_GONE


def from_rpc_error(e: grpc.RpcError) -> GpucoordError:
    code = e.code()
    details = e.details() or code.name
    reason, field = error_info(e)
    if reason == SESSION_GONE:
        return SessionExpired(details, reason, field)
    return _BY_CODE.get(code, GpucoordError)(details, reason, field)
