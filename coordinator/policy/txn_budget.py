"""etcd's limits on one transaction, as budgets: host rounds stop deciding before they would pass them
(``planner.py``), and a multi-host gang that could never fit one is refused (``replica/fleet_view.py``)."""
from __future__ import annotations

from typing import Sequence

from coordinator.txn import Compare, Op, Put

# etcd refuses a transaction with more than 128 compares, or 128 operations (--max-txn-ops), its default.
TXN_OPS_BUDGET = 120
TXN_COMPARES_BUDGET = 120
# A site may raise etcd's limit (``--max-txn-ops``) and tell the coordinators (``etcd_max_txn_ops``): a
# multi-host gang's one transaction (a record and a ledger per GPU) may then be that much larger. Host rounds
# keep the budgets above.
TXN_HEADROOM = 8


# etcd refuses a request larger than --max-request-bytes (default 1.5 MiB). A multi-host gang's record lists every
# part (its hosts and their GPUs), so its grant grows with GPUs x parts: it must stay below this.
TXN_BYTES_BUDGET = 1_400_000
# What a GPU's two puts (its lease record and its ledger, keys included) take besides the host names and uuids
# in them, at most (ids, agent, session, request id, times, flags, the key prefix), and what each part adds
# besides its uuids (the host name's quotes and brackets), in bytes.
RECORD_BYTES, PART_BYTES = 1200, 8


def gang_txn_bytes(hosts: int, gpu_count: int, longest_host: int, longest_uuid: int) -> int:
    """At most how many bytes a multi-host gang's grant puts: per GPU a record listing every part and its host's
    GPUs (``gang``), and a ledger, under keys naming the host and the GPU."""
    parts = hosts * (PART_BYTES + longest_host + gpu_count * (longest_uuid + 3))
    own = gpu_count * (longest_uuid + 3) + 3 * (longest_host + longest_uuid)
    return hosts * gpu_count * (RECORD_BYTES + parts + own)


def gang_budgets(max_txn_ops: int) -> tuple[int, int]:
    """The operations and compares one multi-host gang's transaction may have under etcd's ``--max-txn-ops``."""
    return max_txn_ops - TXN_HEADROOM, max_txn_ops - TXN_HEADROOM


def beyond(ops: int, compares: int, size: int, max_txn_ops: int) -> str:
    """Which of a gang's transaction's limits ``ops`` operations, ``compares`` compares and ``size`` bytes of
    puts pass (a message's end), "" when none."""
    ops_budget, compares_budget = gang_budgets(max_txn_ops)
    if ops > ops_budget or compares > compares_budget:
        return (f"{ops} writes and {compares} compares in one etcd transaction, above its limits ({ops_budget}, "
                f"{compares_budget}; etcd_max_txn_ops {max_txn_ops}): ask fewer hosts or GPUs, or raise etcd's "
                f"--max-txn-ops and etcd_max_txn_ops")
    if size > TXN_BYTES_BUDGET:
        return (f"{size} bytes in one etcd transaction (each GPU's record lists every part), above "
                f"{TXN_BYTES_BUDGET} (etcd's --max-request-bytes is 1.5 MiB): ask fewer hosts or GPUs")
    return ""


def too_large(compares: Sequence[Compare], ops: Sequence[Op], max_txn_ops: int) -> str:
    """``beyond`` of a built transaction: its puts' keys and values and every other key it names, in bytes."""
    size = sum(len(op.key) + (len(op.value) if isinstance(op, Put) else 0) for op in ops if hasattr(op, "key"))
    size += sum(len(getattr(c, "key", b"") or getattr(c, "prefix", b"")) for c in compares)
    return beyond(len(ops), len(compares), size, max_txn_ops)
