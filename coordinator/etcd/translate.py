"""The one place where etcd's failures become gpucoord errors (``coordinator.errors``)."""
from __future__ import annotations

import grpc

from coordinator import errors, metrics


def translate(e: grpc.aio.AioRpcError, write: bool) -> errors.GpucoordError:
    """The one place etcd's failures become gpucoord errors."""
    code, details = e.code(), (e.details() or "")
    if "database space exceeded" in details:
        metrics.ETCD_NOSPACE.inc()
        return errors.EtcdNoSpace(
            "etcd is out of space (alarm NOSPACE, \"database space exceeded\"): it refuses every write until an "
            "operator frees space: etcdctl compact <current revision>, etcdctl defrag (every member), then "
            "etcdctl alarm disarm; or raise --quota-backend-bytes (see docs/etcd.md, \"Production: etcd\")")
    if "lease not found" in details:
        return errors.SessionGone(f"etcd: {details}")
    if "compacted" in details:
        return errors.Compacted(f"etcd: {details}", 0)
    # etcd answers a deadline that passed while it served the call as UNKNOWN "context deadline exceeded".
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or "context deadline exceeded" in details:
        if write:
            return errors.OutcomeUnknown(f"etcd write timed out, outcome unknown: {details}")
        return errors.Timeout(f"etcd read timed out: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        if write and code != grpc.StatusCode.UNAVAILABLE:
            return errors.OutcomeUnknown(f"etcd write interrupted, outcome unknown: {details}")
        return errors.Unavailable(f"etcd unavailable: {details}")
    if "too many operations in txn request" in details:
        return errors.FailedPrecondition(
            f"etcd_max_txn_ops: a transaction passed etcd's --max-txn-ops ({details}); is the coordinators' "
            f"etcd_max_txn_ops above etcd's? set them equal", "etcd_max_txn_ops")
    if "request is too large" in details:
        return errors.FailedPrecondition(f"etcd refused a request as too large ({details}): above its "
                                         f"--max-request-bytes")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(f"etcd rejected the request: {details}")
    return errors.Unavailable(f"etcd error {code.name}: {details}")


def response_too_large(e: grpc.aio.AioRpcError) -> bool:
    """A response over gRPC's message limit: the read is made again in smaller pages."""
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")


def future_revision(e: grpc.aio.AioRpcError) -> bool:
    """A read at a revision the member has not applied yet: read again linearizably."""
    return "future revision" in (e.details() or "")


def read_may_be_retried(e: BaseException) -> bool:
    """A Range that etcd could not serve now (unavailable, or slow: a hung member) is tried again; one it
    refused, or that its caller handles (too large, a future revision), is not."""
    return (isinstance(e, grpc.aio.AioRpcError) and not response_too_large(e) and not future_revision(e)
            and isinstance(translate(e, write=False), errors.Unavailable))
