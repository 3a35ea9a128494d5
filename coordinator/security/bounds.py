"""Bounds that hold for a request as a whole, checked by the interceptor before any handler logic.

Per-field rules (names, lengths, numbers) live with the handlers that own those fields; this module holds
the limits on size and count that protect the servers themselves (docs/guarantees.md "Limits"):

* gRPC messages: at most 1 MiB received (``tls.MAX_RECEIVE_BYTES``, a server option);
* a partition spec: at most ``limits.MAX_SPEC_BYTES`` (64 KiB) of JSON, refused before it is parsed
  (and 256 agents, ``partition.MAX_AGENTS``);
* open sessions per agent: ``max_sessions_per_agent`` (64), enforced by the session's own transaction.
"""
from __future__ import annotations

from google.protobuf.message import Message

from coordinator import errors
from coordinator.limits import MAX_SPEC_BYTES

MAX_GPU_UUID_LEN = 128


def check_request(method: str, request: Message) -> None:
    """INVALID_ARGUMENT naming the field when a request is out of bounds. Pure: no I/O."""
    name = method.rpartition("/")[2]
    if name == "ApplyPartition" and len(request.spec_json) > MAX_SPEC_BYTES:
        raise errors.InvalidArgument(
            f"spec_json: {len(request.spec_json)} bytes, above the limit of {MAX_SPEC_BYTES}", "spec_json")
    if name == "CheckToken" and len(request.gpu_uuid) > MAX_GPU_UUID_LEN:
        raise errors.InvalidArgument(f"gpu_uuid: longer than {MAX_GPU_UUID_LEN} characters", "gpu_uuid")
