"""Which processes of a lease a node's usage report still lists on the lease's GPU: the test of G3's
"the victim is gone first" for leases bound to processes. Pure functions over the ``usage/<host>`` document
(the node's attribution of NVML's process list, or of ``--fake-processes``), no I/O.

A process is the lease's when the node attributed it to the lease (``lease_id``: it matched the recorded
PIDs or process group, while the lease lived or after it ended), or when its PID is one the lease recorded
(the node may not have seen the record yet). A report that left processes out (more than it lists) may hide
the lease's: it counts as still listing them.
"""
from __future__ import annotations

from typing import Collection, Mapping


def gpu_report(usage: Mapping[str, object] | None, gpu_uuid: str) -> Mapping[str, object] | None:
    """The report's entry for one GPU, or None."""
    if not isinstance(usage, Mapping):
        return None
    gpus = usage.get("gpus")
    if not isinstance(gpus, list):
        return None
    for g in gpus:
        if isinstance(g, Mapping) and g.get("uuid") == gpu_uuid:
            return g
    return None


def processes_visible(usage: Mapping[str, object] | None, gpu_uuid: str) -> bool:
    """Whether the report's process list of this GPU is NVML's whole list (it may be empty): false for a GPU
    whose processes NVML cannot list, simulated GPUs without ``--fake-processes``, and older nodes."""
    g = gpu_report(usage, gpu_uuid)
    return g is not None and g.get("processes_visible") is True


def reported_pids(usage: Mapping[str, object] | None, gpu_uuid: str, lease_id: str,
                  pids: Collection[int] = ()) -> tuple[int, ...]:
    """The PIDs on this GPU that the report attributes to the lease, or that the lease recorded."""
    g = gpu_report(usage, gpu_uuid)
    if g is None:
        return ()
    out: list[int] = []
    procs = g.get("processes")
    for p in procs if isinstance(procs, list) else ():
        if not isinstance(p, Mapping):
            continue
        pid = p.get("pid")
        if isinstance(pid, int) and (p.get("lease_id") == lease_id or pid in pids):
            out.append(pid)
    return tuple(sorted(set(out)))


def still_reported(usage: Mapping[str, object] | None, gpu_uuid: str, lease_id: str, pids: Collection[int] = ()) -> bool:
    """Whether the report may still show some of the lease's processes on this GPU: it lists one, or it
    left some processes out."""
    if reported_pids(usage, gpu_uuid, lease_id, pids):
        return True
    g = gpu_report(usage, gpu_uuid)
    omitted = g.get("processes_omitted", 0) if g is not None else 0
    return isinstance(omitted, int) and omitted > 0


def reports_none(usage: Mapping[str, object] | None, gpu_uuid: str, lease_id: str, pids: Collection[int] = ()) -> bool:
    """Whether the report shows that none of the lease's processes is on this GPU: the GPU's process list
    is visible, whole, and lists none of them."""
    return processes_visible(usage, gpu_uuid) and not still_reported(usage, gpu_uuid, lease_id, pids)


def process_state(usage: Mapping[str, object] | None, gpu_uuid: str, lease_id: str, pids: Collection[int],
                  pgid: int = 0) -> str:
    """How an evicted lease's processes stand, for ``status``: ``stopping`` (the node still reports some on
    the GPU), ``gone`` (it reports none), ``unknown`` (the GPU's processes are not visible to the node), or
    "" for a lease not bound to processes."""
    if not pids and not pgid:
        return ""
    if still_reported(usage, gpu_uuid, lease_id, pids):
        return "stopping"
    return "gone" if processes_visible(usage, gpu_uuid) else "unknown"
