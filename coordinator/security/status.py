"""An error on the wire: the one translation of ``coordinator.errors`` to a gRPC status.

Both servers and the interceptor answer every refusal through here, for unary calls and Session stream
messages alike: the status code and reason come from ``errors.TABLE``, the message is the error's, and the
rich status details (the ``grpc-status-details-bin`` trailer, as gRPC's status packages send it) hold a
``google.rpc.Status`` with one ``google.rpc.ErrorInfo``: domain ``gpucoord``, the reason (``SESSION_GONE``,
``NO_FIT``, ``QUEUE_FULL``, ``INVALID_FIELD``, ...) and, when the error names one, the field at fault in its
metadata. A client acts on the reason, never on the message's text. A Session stream message carries the
same bytes in ``SessionResponse.details``.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from coordinator import errors
from coordinator.records import InvalidRecord

DETAILS_KEY = "grpc-status-details-bin"
DOMAIN = "gpucoord"


@dataclasses.dataclass(frozen=True)
class WireStatus:
    """A status as it goes out: code, message and the serialized ``google.rpc.Status``."""

    code: grpc.StatusCode
    message: str
    details: bytes

    @property
    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((DETAILS_KEY, self.details),)


def as_error(exc: BaseException) -> errors.GpucoordError | None:
    """The gpucoord error ``exc`` answers as; None for an unexpected exception (a bug: INTERNAL)."""
    if isinstance(exc, errors.GpucoordError):
        return exc
    if isinstance(exc, InvalidRecord):   # a malformed stored value that the call needed: it is left as it is
        return errors.FailedPrecondition(
            f"record: a stored value this call needs is malformed ({str(exc)[:200]})", "record")
    return None


def wire_status(error: errors.GpucoordError) -> WireStatus:
    status = error.status
    return _build(grpc.StatusCode[status.code], error.message, status.reason, status.field)


def internal(exc: BaseException) -> WireStatus:
    """The status of an unexpected exception."""
    return _build(grpc.StatusCode.INTERNAL, f"internal error: {repr(exc)[:200]}", "INTERNAL", "")


def deadline_exceeded() -> WireStatus:
    """A Session stream message whose own deadline passed (a unary call's is gRPC's to answer)."""
    return _build(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "DEADLINE_EXCEEDED", "")


def _build(code: grpc.StatusCode, message: str, reason: str, field: str) -> WireStatus:
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata={"field": field} if field else {})
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return WireStatus(code, message, status.SerializeToString())


def refuse(context: grpc.aio.ServicerContext, error: errors.GpucoordError) -> None:
    """Answer the call with ``error``'s status once the handler returns (no abort: see
    ``coordinator.security.interceptor``)."""
    set_status(context, wire_status(error))


def set_status(context: grpc.aio.ServicerContext, status: WireStatus) -> None:
    context.set_code(status.code)
    context.set_details(status.message)
    context.set_trailing_metadata(status.trailing_metadata)


def error_info(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str, str]:
    """The reason and field of a status's details, from its trailing metadata; ("", "") without them."""
    for key, value in trailing_metadata or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            try:
                status = status_pb2.Status.FromString(value)
            except DecodeError:
                return "", ""
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason, info.metadata.get("field", "")
    return "", ""


async def abort(context: grpc.aio.ServicerContext, error: errors.GpucoordError) -> None:
    """End a stream with ``error``'s status (raises, as ``context.abort`` does)."""
    status = wire_status(error)
    await context.abort(status.code, status.message, status.trailing_metadata)
