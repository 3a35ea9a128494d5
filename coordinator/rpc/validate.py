"""Request validation, the one layer of it: the servicer checks every field a caller sends here, once, at the
RPC edge, before anything is read or written (the session lookup included), and refuses a bad one with
INVALID_ARGUMENT naming the field (quoting at most a short prefix of a bad value). The replica below
trusts what it is given.

One function per request (``open_session``, ``acquire``, ...) checks its fields in a fixed order; a call on
a session then has its ``SessionRef`` checked by ``session_ref`` just before the lookup. The field checks
below them are shared.
"""
from __future__ import annotations

import json

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors
from coordinator.host_records import label_error
from coordinator.keys import etcd_lease_from_session_id, valid_name
from coordinator.limits import (
    MAX_ATTACHED_PIDS,
    MAX_CLIENT_VERSION_BYTES,
    MAX_GANG_GPUS,
    MAX_GRACE_S,
    MAX_PID,
    MAX_PRIORITY,
    MAX_REASON_BYTES,
    MAX_REQUEST_ID_LEN,
    MAX_SESSION_ID_LEN,
    MAX_SPEC_BYTES,
    MAX_TTL_S,
    MAX_VRAM_MB,
    MAX_WAIT_S,
    MIN_TTL_S,
    quote,
)
from coordinator.policy import time_limits
from coordinator.policy.partition import PartitionError, PartitionSpec, parse_spec
from coordinator.policy.teams import MAX_MIN_RUNTIME_S
from coordinator.records import MAX_GANG_HOSTS, TOPOLOGIES, dumps


# -- requests -------------------------------------------------------------------------------------------
def open_session(request: pb.OpenSessionRequest) -> None:
    check_name("agent", request.agent)
    check_name("host", request.host)
    ttl = request.ttl_seconds   # 0: the configured default (itself within the bounds)
    if ttl and not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise errors.InvalidArgument(f"ttl_seconds: must be within [{MIN_TTL_S}, {MAX_TTL_S}], got {ttl}",
                                     "ttl_seconds")
    if not 0 <= request.pid <= MAX_PID:
        raise errors.InvalidArgument(f"pid: must be within [0, {MAX_PID}], got {request.pid}", "pid")
    check_text("client_version", request.client_version, MAX_CLIENT_VERSION_BYTES)


def session_ref(ref: pb.SessionRef) -> None:
    """The session a call names (checked after the call's own fields, before the session is looked up)."""
    check_name("session.agent", ref.agent)
    check_session_id(ref.session_id)


# A call on a session: its own fields here, then its session's (``session_ref``, by the servicer's lookup).
def acquire(request: pb.AcquireRequest) -> None:
    validate_gang(request.gpu_count, request.exclusive, request.topology, list(request.gpus), request.gpu,
                  request.vram_mb)
    validate_hosts(request.hosts, request.same, request.prefer, request.gpu, list(request.gpus))
    validate_acquire(request.vram_mb if not request.exclusive else 1, request.gpu, request.priority,
                     request.request_id, request.wait_seconds)
    validate_min_runtime(request.min_runtime_seconds)
    time_limits.check(request.time_limit_seconds)
    time_limits.check(request.time_limit_warning_seconds, "time_limit_warning_seconds")


def release(request: pb.ReleaseRequest) -> None:
    check_lease_id(request.lease_id)


def attach(request: pb.AttachProcessesRequest) -> None:
    validate_attach(request.lease_id, list(request.pids), request.pgid)


def evict(request: pb.EvictLeaseRequest) -> None:
    check_lease_id(request.lease_id)
    grace_s = request.grace_seconds
    if grace_s < 0 or grace_s != grace_s or grace_s > MAX_GRACE_S:
        raise errors.InvalidArgument(f"grace_seconds: must be within [0, {MAX_GRACE_S:g}]", "grace_seconds")
    check_text("reason", request.reason, MAX_REASON_BYTES)


def cordon(request: pb.CordonHostRequest) -> None:
    """CordonHost: the host's name, the reason's size, and a drain's grace (as EvictLease's)."""
    check_name("host", request.host)
    check_text("reason", request.reason, MAX_REASON_BYTES)
    grace_s = request.grace_seconds
    if grace_s < 0 or grace_s != grace_s or grace_s > MAX_GRACE_S:
        raise errors.InvalidArgument(f"grace_seconds: must be within [0, {MAX_GRACE_S:g}]", "grace_seconds")


def status_host(name: str) -> None:
    """GetStatus's host: "" for every host."""
    if name:
        check_name("host", name)


def partition_spec(spec_json: str) -> PartitionSpec:
    """ApplyPartition's spec: JSON, an object, within the size limit, structurally valid (``parse_spec``)."""
    try:
        data: object = json.loads(spec_json)
    except (ValueError, RecursionError) as e:
        raise errors.InvalidArgument(f"spec_json: not valid JSON: {e}", "spec_json") from e
    if not isinstance(data, dict):
        raise errors.InvalidArgument("spec_json: must be a JSON object", "spec_json")
    size = len(dumps(data))
    if size > MAX_SPEC_BYTES:
        raise errors.InvalidArgument(f"spec: {size} bytes of JSON, more than the limit of {MAX_SPEC_BYTES}", "spec")
    try:
        spec = parse_spec(data)
    except PartitionError as e:
        raise errors.InvalidArgument(str(e), e.field) from e
    check_name("host", spec.host)
    return spec


# -- fields ---------------------------------------------------------------------------------------------


def check_name(field: str, value: str) -> str:
    if not value:
        raise errors.InvalidArgument(f"{field}: is required", field)
    if not valid_name(value):
        raise errors.InvalidArgument(
            f"{field}: {quote(value)} is not a valid name (letters, digits, '.', '_', ':', '@', '-'; at most 128)",
            field)
    return value


def check_text(field: str, value: str, max_bytes: int) -> str:
    """A free-text field that is stored in etcd: bounded in UTF-8 bytes."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise errors.InvalidArgument(f"{field}: {size} bytes, more than the limit of {max_bytes}", field)
    return value


def check_session_id(session_id: str, field: str = "session.session_id") -> int:
    """The etcd_lease id a session id names (lowercase hex, at most 16 digits)."""
    if not session_id:
        raise errors.InvalidArgument(f"{field}: is required", field)
    if len(session_id) > MAX_SESSION_ID_LEN or any(c not in "0123456789abcdef" for c in session_id):
        raise errors.InvalidArgument(f"{field}: {quote(session_id)} is not a session id", field)
    return etcd_lease_from_session_id(session_id)


def validate_acquire(vram_mb: int, gpu: str, priority: int, request_id: str, wait_s: float) -> None:
    """Every field of an acquire, before anything is read (not even the session)."""
    if vram_mb <= 0:
        raise errors.InvalidArgument(f"vram_mb: must be > 0, got {vram_mb}", "vram_mb")
    if vram_mb > MAX_VRAM_MB:
        raise errors.InvalidArgument(f"vram_mb: {vram_mb} is above the limit of {MAX_VRAM_MB}", "vram_mb")
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise errors.InvalidArgument(f"priority: must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}]", "priority")
    if len(request_id) > MAX_REQUEST_ID_LEN or any(c in request_id for c in "/\0"):
        raise errors.InvalidArgument(
            f"request_id: at most {MAX_REQUEST_ID_LEN} characters, without '/' or NUL", "request_id")
    if not 0 <= wait_s <= MAX_WAIT_S or wait_s != wait_s:
        raise errors.InvalidArgument(f"wait_seconds: must be within [0, {MAX_WAIT_S:g}]", "wait_seconds")
    if gpu and not valid_name(gpu):
        raise errors.InvalidArgument(f"gpu: {quote(gpu)} is neither a GPU index nor a uuid", "gpu")


def validate_min_runtime(seconds: float) -> None:
    """A lease's minimum runtime before another team may reclaim it (teams, issue 22)."""
    if not 0 <= seconds <= MAX_MIN_RUNTIME_S or seconds != seconds:
        raise errors.InvalidArgument(f"min_runtime_seconds: must be within [0, {MAX_MIN_RUNTIME_S:g}]",
                                     "min_runtime_seconds")


def validate_gang(gpu_count: int, exclusive: bool, topology: str, gpus: list[str], gpu: str, vram_mb: int) -> None:
    """The gang fields of an acquire (issue 21): what the request alone shows wrong. What needs the host (at
    most its GPU count, its topology known, a set that could ever fit) is checked at admission."""
    if not 0 <= gpu_count <= MAX_GANG_GPUS:
        raise errors.InvalidArgument(f"gpu_count: must be within [1, {MAX_GANG_GPUS}] (0: 1), got {gpu_count}",
                                     "gpu_count")
    if topology not in ("", *TOPOLOGIES):
        raise errors.InvalidArgument(f"topology: {quote(topology)} is not one of {', '.join(TOPOLOGIES)}",
                                     "topology")
    if exclusive and vram_mb != 0:
        raise errors.InvalidArgument(
            f"vram_mb: must be 0 with exclusive (the lease takes each GPU's whole usable VRAM), got {vram_mb}",
            "vram_mb")
    if not gpus:
        if gpu and gpu_count > 1:
            raise errors.InvalidArgument(f"gpu: names one GPU, but gpu_count is {gpu_count}: name all {gpu_count} "
                                         "in gpus (or leave both empty)", "gpu")
        return
    if gpu:
        raise errors.InvalidArgument("gpus: name the GPUs either in gpu (one) or in gpus, not both", "gpus")
    if len(gpus) > MAX_GANG_GPUS:
        raise errors.InvalidArgument(f"gpus: at most {MAX_GANG_GPUS}, got {len(gpus)}", "gpus")
    bad = [g for g in gpus if not valid_name(g)]
    if bad:
        raise errors.InvalidArgument(f"gpus: {quote(bad[0])} is neither a GPU index nor a uuid", "gpus")
    if len(set(gpus)) != len(gpus) or len(gpus) != max(gpu_count, 1):
        raise errors.InvalidArgument(
            f"gpus: must name gpu_count ({max(gpu_count, 1)}) distinct GPUs, got {len(gpus)}", "gpus")


def validate_hosts(hosts: int, same: str, prefer: str, gpu: str, gpus: list[str]) -> None:
    """The multi-host fields of an acquire (issue 30): ``hosts`` within [0, MAX_GANG_HOSTS] (0 and 1: one
    host); ``same``/``prefer`` label keys, and only for two hosts or more; no named GPU (``gpu``, ``gpus``:
    indexes and uuids are a host's own). Whether some set of hosts could ever hold it is admission's."""
    if not 0 <= hosts <= MAX_GANG_HOSTS:
        raise errors.InvalidArgument(f"hosts: must be within [1, {MAX_GANG_HOSTS}] (0: 1), got {hosts}", "hosts")
    for field, key in (("same", same), ("prefer", prefer)):
        if not key:
            continue
        if hosts < 2:
            raise errors.InvalidArgument(f"{field}: only with hosts of 2 or more (a label key the hosts share)",
                                         field)
        if label_error(key, "x"):
            raise errors.InvalidArgument(f"{field}: {quote(key)} is not a label key (NAME or PREFIX/NAME)", field)
    if hosts >= 2 and gpu:
        raise errors.InvalidArgument(f"gpu: names one host's GPU, not with hosts ({hosts})", "gpu")
    if hosts >= 2 and gpus:
        raise errors.InvalidArgument(f"gpus: name one host's GPUs, not with hosts ({hosts})", "gpus")


def validate_attach(lease_id: str, pids: list[int], pgid: int) -> None:
    """Every field of AttachProcesses, before anything is read (not even the session)."""
    check_lease_id(lease_id)
    if len(pids) > MAX_ATTACHED_PIDS:
        raise errors.InvalidArgument(f"pids: at most {MAX_ATTACHED_PIDS}, got {len(pids)}", "pids")
    bad = [p for p in pids if not 1 <= p <= MAX_PID]
    if bad:
        raise errors.InvalidArgument(f"pids: {bad[0]} is not a process id (1..{MAX_PID})", "pids")
    if not 0 <= pgid <= MAX_PID:
        raise errors.InvalidArgument(f"pgid: {pgid} is not a process group id (0 for none, or 1..{MAX_PID})",
                                     "pgid")


def check_lease_id(lease_id: str) -> None:
    if not lease_id or not valid_name(lease_id):
        raise errors.InvalidArgument(f"lease_id: {quote(lease_id)} is not a lease id", "lease_id")
