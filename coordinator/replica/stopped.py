"""When the leader may revoke an evicted lease before the kill margin (G3's order, ``leader.py``): once every
GPU the lease holds is shown free of its processes, on every host of a multi-host gang.

After a notice's deadline the holder has killed what it ran (``gpucoord run`` SIGKILLs at the deadline); the
kill margin past the deadline is only the time to see them exit. So the leader revokes as soon as it sees that
they did: every record of the lease (a gang: one per GPU, on each host) is bound to processes, and its host's
node, in a usage report taken and seen after the deadline, shows the GPU's whole process list without any of
them. A part on the host that a ``host-lost`` notice names as lost (its registration and its usage report both
gone, before the notice was sent) is settled by the loss: nobody can know its processes, and nothing is granted
on a host that has no registration; the revoke compares that both are still absent. A host lost under another
notice (perhaps after its deadline, its processes last seen running) waits for the margin. Anything else (a part not bound to
processes, a GPU whose processes the node cannot list, a report from before the deadline) waits for the margin.
"""
from __future__ import annotations

from coordinator.etcd.types import KV
from coordinator.policy.departing import reports_none
from coordinator.records import EvictionRecord, InvalidRecord, VramLease
from coordinator.replica.context import ReplicaContext
from coordinator.replica.host_lost import REASON as HOST_LOST
from coordinator.replica.leases import usage_report
from coordinator.txn import Absent, Compare, ModRevisionIs


def stopped_everywhere(ctx: ReplicaContext, record: EvictionRecord, lease: VramLease,
                       deadline: float) -> list[Compare] | None:
    """The compares under which the lease may go now (the records and the reports this decision read), or
    None when some GPU of it is not yet shown free of its processes. ``deadline``: the notice's deadline on
    this replica's monotonic clock."""
    keys, mirror = ctx.keys, ctx.mirror
    compares: list[Compare] = []
    for host, uuids in lease.parts:
        records = []
        for uuid_ in uuids:
            kv = mirror.get(keys.lease(host, uuid_, lease.id))
            if kv is None:
                return None      # (the mirror is between versions: look again)
            try:
                records.append(VramLease.from_kv(kv))
            except InvalidRecord:
                return None
            compares.append(ModRevisionIs(kv.key, kv.mod_revision))
        usage_kv = mirror.get(keys.usage(host))
        if lease.hosts and usage_kv is None and mirror.get(keys.host(host)) is None:
            if record.reason != HOST_LOST:
                return None      # lost after another notice, maybe after its deadline: the margin decides
            compares += [Absent(keys.host(host)), Absent(keys.usage(host))]    # the lost host
            continue
        if usage_kv is None or not all(p.pids or p.pgid for p in records):
            return None
        usage = usage_report(usage_kv)
        if usage is None or not _published_after(ctx, usage_kv, usage.get("ts"), deadline, record):
            return None
        if not all(reports_none(usage, p.gpu_uuid, p.id, p.pids) for p in records):
            return None
        compares.append(ModRevisionIs(usage_kv.key, usage_kv.mod_revision))
    return compares


def _published_after(ctx: ReplicaContext, usage_kv: KV, taken: object, deadline: float,
                     record: EvictionRecord) -> bool:
    """Whether a usage report was published after a notice's deadline: this replica saw it first after the
    deadline (its clock), and its node's clock says it was taken after the deadline (so a report that was
    merely slow to arrive does not count)."""
    seen = ctx.observed.saw(usage_kv.key, usage_kv.mod_revision)
    if not isinstance(taken, (int, float)) or isinstance(taken, bool):
        return False
    return seen >= deadline and taken >= record.deadline_unix
