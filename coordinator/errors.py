"""The error tree, and the one table that maps it to gRPC status codes.

Only the etcd boundary (``coordinator.store``) and the request validation raise these. Each carries a
human message that names the field or key at fault.
"""
from __future__ import annotations

import grpc


class GpucoordError(Exception):
    """Root of every gpucoord error."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgument(GpucoordError):
    """The request can never succeed as written (bad field, can never fit)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GpucoordError):
    """A named session, host, GPU or lease does not exist (or no longer does)."""

    code = grpc.StatusCode.NOT_FOUND


class SessionGone(NotFound):
    """The session's etcd_lease expired or was revoked: the agent must open a new session."""


class FailedPrecondition(GpucoordError):
    """The request conflicts with current state (e.g. a partition that live leases would break)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleToken(FailedPrecondition):
    """A fencing token that is no longer live."""


class CapacityError(GpucoordError):
    """It does not fit now; it might later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotOwner(GpucoordError):
    """The caller acts on something that belongs to another session or agent."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(GpucoordError):
    """etcd (or this replica) cannot serve now; safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class OutcomeUnknown(Unavailable):
    """A write timed out: it may or may not have been applied. Retry only idempotent writes."""


class EtcdNoSpace(Unavailable):
    """etcd raised its NOSPACE alarm (database space exceeded) and refuses every write until an operator
    compacts, defragments and disarms it. UNAVAILABLE rather than RESOURCE_EXHAUSTED: it is not the GPU that
    is full, and the write was certainly not applied, so a retry after the repair is safe."""


class Timeout(GpucoordError):
    """A deadline passed (a wait for capacity, or an etcd call with no side effect)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Conflict(GpucoordError):
    """A compare-and-set lost: re-read and decide again. Never leaves the coordinator."""

    code = grpc.StatusCode.ABORTED


class Compacted(GpucoordError):
    """A watch asked for history that etcd has compacted away; the watcher must resync."""

    code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, GpucoordError):
        return exc.code
    return grpc.StatusCode.INTERNAL
