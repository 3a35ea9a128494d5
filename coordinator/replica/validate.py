"""Request validation: every field a caller sends is checked here before anything is read or written, and
refused with INVALID_ARGUMENT naming the field (quoting at most a short prefix of a bad value)."""
from __future__ import annotations

from coordinator import errors
from coordinator.limits import (MAX_ATTACHED_PIDS, MAX_PID, MAX_PRIORITY, MAX_REQUEST_ID_LEN, MAX_SESSION_ID_LEN, MAX_VRAM_MB,
                                MAX_WAIT_S, quote)
from coordinator.keys import etcd_lease_from_session_id, valid_name


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
