"""The error tree, and the one table (``TABLE``) that says what each error is on the wire: its gRPC status
code (a ``grpc.StatusCode`` member name) and its machine-readable reason (``google.rpc.ErrorInfo.reason``,
refined by the field at fault where one class covers several causes). The servers turn an error into its
status with ``coordinator.security.status``, for unary calls and Session stream messages alike; this module
and the pure policy that raises these need no grpc.

Only the etcd boundary (``coordinator.etcd.store``) and the request validation raise these. Each carries a
human message that names the field or key at fault.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Status:
    """What an error is on the wire: ``code`` a ``grpc.StatusCode`` member name, ``reason`` the ErrorInfo
    reason a client acts on (never the message's text), ``field`` the request field at fault ("" if none)."""

    code: str
    reason: str
    field: str = ""


class GpucoordError(Exception):
    """Root of every gpucoord error."""


    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    @property
    def status(self) -> Status:
        """Its code, reason and field, from ``TABLE``."""
        return status_of(type(self), self.field)

    @property
    def code(self) -> str:
        return self.status.code

    @property
    def reason(self) -> str:
        return self.status.reason


class InvalidArgument(GpucoordError):
    """The request can never succeed as written (bad field, can never fit)."""



class NotFound(GpucoordError):
    """A named session, host, GPU or lease does not exist (or no longer does)."""



class SessionGone(NotFound):
    """The session's etcd_lease expired or was revoked: the agent must open a new session."""


class FailedPrecondition(GpucoordError):
    """The request conflicts with current state (e.g. a partition that live leases would break)."""



class CapacityError(GpucoordError):
    """It does not fit now; it might later."""



class WaitTimeout(CapacityError):
    """A request waited in the queue for as long as it asked and still did not fit; its entry is gone."""


class NotOwner(GpucoordError):
    """The caller acts on something that belongs to another session or agent."""



class Unavailable(GpucoordError):
    """etcd (or this replica) cannot serve now; safe to retry."""



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


    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


@dataclasses.dataclass(frozen=True)
class Translation:
    """A row of ``TABLE``: the status code of a class of errors, its reason, and the reasons that the field
    at fault refines it to (one class, several causes a client tells apart)."""

    code: str
    reason: str
    by_field: tuple[tuple[str, str], ...] = ()


# The one table: error class -> status code and reason. A class not in it takes its nearest ancestor's row.
TABLE: dict[type[GpucoordError], Translation] = {
    GpucoordError: Translation("UNKNOWN", "UNKNOWN"),
    InvalidArgument: Translation("INVALID_ARGUMENT", "INVALID_FIELD"),
    NotFound: Translation("NOT_FOUND", "NOT_FOUND"),
    SessionGone: Translation("NOT_FOUND", "SESSION_GONE"),
    FailedPrecondition: Translation("FAILED_PRECONDITION", "FAILED_PRECONDITION",
                                    (("host", "HOST_UNUSABLE"), ("record", "RECORD_MALFORMED"))),
    CapacityError: Translation("RESOURCE_EXHAUSTED", "NO_CAPACITY",
                               (("vram_mb", "NO_FIT"), ("queue", "QUEUE_FULL"), ("agent", "TOO_MANY_LEASES"),
                                ("sessions", "TOO_MANY_SESSIONS"), ("rate", "RATE_LIMITED"),
                                ("streams", "TOO_MANY_STREAMS"), ("stream", "STREAM_UNREAD"))),
    WaitTimeout: Translation("RESOURCE_EXHAUSTED", "WAIT_TIMEOUT"),
    NotOwner: Translation("PERMISSION_DENIED", "NOT_PERMITTED"),
    Unavailable: Translation("UNAVAILABLE", "UNAVAILABLE"),
    OutcomeUnknown: Translation("UNAVAILABLE", "OUTCOME_UNKNOWN"),
    EtcdNoSpace: Translation("UNAVAILABLE", "ETCD_NO_SPACE"),
    Timeout: Translation("UNAVAILABLE", "ETCD_TIMEOUT"),
    Compacted: Translation("OUT_OF_RANGE", "COMPACTED"),
}


def status_of(cls: type[GpucoordError], field: str | None = None) -> Status:
    """The status of an error of class ``cls`` naming ``field``: its row of ``TABLE`` (or its nearest
    ancestor's), with the reason the field refines it to. The field is that of the request ("pids[3]" and
    "allocations.x" are "pids" and "allocations")."""
    row = next(TABLE[c] for c in cls.__mro__ if c in TABLE)
    name = (field or "").split(".", 1)[0].split("[", 1)[0]
    return Status(row.code, dict(row.by_field).get(name, row.reason), field or "")
