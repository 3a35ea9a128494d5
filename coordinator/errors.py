"""The error tree. Each class names its gRPC status code (``code``, a ``grpc.StatusCode`` member name);
the gRPC servers turn it into the status, so this module and the pure policy that raises these need no grpc.

Only the etcd boundary (``coordinator.etcd.store``) and the request validation raise these. Each carries a
human message that names the field or key at fault.
"""
from __future__ import annotations


class GpucoordError(Exception):
    """Root of every gpucoord error."""

    code = "UNKNOWN"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidArgument(GpucoordError):
    """The request can never succeed as written (bad field, can never fit)."""

    code = "INVALID_ARGUMENT"


class NotFound(GpucoordError):
    """A named session, host, GPU or lease does not exist (or no longer does)."""

    code = "NOT_FOUND"


class SessionGone(NotFound):
    """The session's etcd_lease expired or was revoked: the agent must open a new session."""


class FailedPrecondition(GpucoordError):
    """The request conflicts with current state (e.g. a partition that live leases would break)."""

    code = "FAILED_PRECONDITION"


class CapacityError(GpucoordError):
    """It does not fit now; it might later."""

    code = "RESOURCE_EXHAUSTED"


class WaitTimeout(CapacityError):
    """A request waited in the queue for as long as it asked and still did not fit; its entry is gone."""


class NotOwner(GpucoordError):
    """The caller acts on something that belongs to another session or agent."""

    code = "PERMISSION_DENIED"


class Unavailable(GpucoordError):
    """etcd (or this replica) cannot serve now; safe to retry."""

    code = "UNAVAILABLE"


class OutcomeUnknown(Unavailable):
    """A write timed out: it may or may not have been applied. Retry only idempotent writes."""


class EtcdNoSpace(Unavailable):
    """etcd raised its NOSPACE alarm (database space exceeded) and refuses every write until an operator
    compacts, defragments and disarms it. UNAVAILABLE rather than RESOURCE_EXHAUSTED: it is not the GPU that
    is full, and the write was certainly not applied, so a retry after the repair is safe."""


class Timeout(Unavailable):
    """etcd did not answer a call with no side effect in time: it has no quorum, or the call met a hung
    member. UNAVAILABLE, not DEADLINE_EXCEEDED: the caller's own deadline has not passed, and the same call
    may succeed on another replica or a moment later."""


class Compacted(GpucoordError):
    """A watch asked for history that etcd has compacted away; the watcher must resync."""

    code = "OUT_OF_RANGE"

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision
