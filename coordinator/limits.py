"""Protocol limits: the documented bounds of what a request may carry and of what the coordinator stores
(docs/guarantees.md "Limits"), and ``quote()`` for the messages that refuse a value past them.

Not settings (``config.py`` holds those): these are the same for every deployment. The bottom of the
package: it imports nothing of it, so every layer (security, config, policy, the servers) may use it.
"""
from __future__ import annotations

# Every string the coordinator stores in etcd has a bound, checked before any etcd call: names (agent,
# host, GPU) by ``keys.valid_name`` (<= 128 characters of a safe alphabet), and the free-text fields below.
MIN_TTL_S = 2
MAX_TTL_S = 300
MIN_HEARTBEAT_S, MAX_HEARTBEAT_S = 0.1, 3600.0   # a node daemon's --heartbeat (its usage rewritten this often)
MAX_PRIORITY = 1_000_000
MAX_VRAM_MB = 1 << 30  # 1 PiB in MiB: anything above is a typo
MAX_REQUEST_ID_LEN = 128          # characters (so at most 512 bytes of UTF-8); no '/' or NUL
MAX_WAIT_S = 3600.0
MAX_ATTACHED_PIDS = 64    # processes one lease may name (AttachProcesses)
MAX_GANG_GPUS = 64        # GPUs one lease may hold (gpu_count; also at most the host's GPU count)
MAX_PID = 1 << 22         # Linux's highest pid_max
MAX_CLIENT_VERSION_BYTES = 256    # OpenSession.client_version, UTF-8
MAX_REASON_BYTES = 256            # EvictLease.reason, UTF-8
MAX_SESSION_ID_LEN = 16           # lowercase hex of an etcd_lease id (64 bits)
MAX_SPEC_BYTES = 64 * 1024        # a partition spec, as JSON
MAX_PARTITION_BYTES = 256 * 1024  # the computed partition stored under partitions/<host>
MAX_GRACE_S = 3600.0              # an operator's eviction grace
MAX_KILL_MARGIN_S = 600.0         # eviction_kill_margin_s
MIN_TXN_OPS, MAX_TXN_OPS = 128, 16384   # etcd_max_txn_ops (etcd's --max-txn-ops: its default, and a sane top)
MAX_TIME_LIMIT_S = 30 * 86400.0   # a lease's time limit (and its warning)
MAX_STREAM_CALLS = 256            # calls in flight on one Session stream
QUOTE_CHARS = 32                  # an error message quotes at most this much of a bad value


def quote(value: object) -> str:
    """A user-supplied value for an error message: its repr, cut to a short prefix. A message must never
    echo a whole value back (a 1 MB name would make the status itself too large for gRPC metadata)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= QUOTE_CHARS:
        return repr(text)
    return repr(text[:QUOTE_CHARS]) + f"\u2026 ({len(text)} characters)"
