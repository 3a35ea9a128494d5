"""The node daemon's check of GPU use against VRAM leases.

Every scan, NVML lists the processes on each GPU with the memory they use. A lease covers the processes
it recorded with ``AttachProcesses``: PIDs, and/or a process group (``gpucoord run`` records its child's
group, which also covers what the child starts). The node runs on the same host, so it reads each
process's group and start time from the OS.

:func:`attribute` is the decision, a pure function with no I/O. Each process on a GPU is

* ``leased``: a live lease on that GPU covers it;
* ``leased_elsewhere``: a live lease covers it, but on another GPU of the host;
* ``orphaned``: only a lease that no longer exists (released, revoked, expired, evicted past its
  deadline) covers it. The node remembers the processes of the leases it saw deleted for that;
* ``untracked``: nothing gpucoord knows covers it.

Each live lease with recorded processes gets the VRAM its processes use on its GPU, and is **over-use**
when that is more than the lease plus a tolerance (processes shared by several leases count against
their sum). With ``--enforce kill`` the orphaned processes are SIGKILLed; with ``kill-untracked`` also
the untracked ones, once untracked for a grace period. ``report`` (the default) kills nothing.

A PID can be reused by an unrelated process: a process matches a recorded PID only if it started when
the recorded one did, and a recorded group only while its group id has not been taken by a new leader.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from typing import Callable, Iterable, Mapping, Sequence

import psutil

from coordinator import metrics
from coordinator.node.ownership import carries_lease
from coordinator.records import GpuUsage, VramLease

log = logging.getLogger(__name__)

ENFORCE_MODES = ("report", "kill", "kill-untracked")
STATES = ("leased", "leased_elsewhere", "orphaned", "untracked")
_SAME_START_S = 0.05   # psutil's create_time of one process is stable to well below this


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    """What the OS says about a live process."""

    pgid: int
    started: float   # creation time (psutil), which tells a reused PID from the original


@dataclasses.dataclass(frozen=True)
class Covered:
    """The processes one lease covers, with their identities as seen when the lease recorded them."""

    lease_id: str
    gpu_uuid: str
    agent: str
    vram_mb: int
    pids: tuple[tuple[int, float | None], ...]   # (pid, start time or None when it was not seen)
    pgid: int = 0
    pgid_started: float | None = None            # the group leader's start time, when it was seen
    gone_at: float = 0.0                         # when the lease was seen deleted; 0 while it lives
    vouched: bool = True                         # this node confirmed them as the lease's agent's own (G9)


@dataclasses.dataclass(frozen=True)
class ProcessVerdict:
    pid: int
    gpu_uuid: str
    used_mb: int
    state: str
    lease_id: str = ""


@dataclasses.dataclass(frozen=True)
class LeaseUse:
    lease_id: str
    agent: str
    gpu_uuid: str
    vram_mb: int
    used_mb: int
    over_use: bool
    pids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Kill:
    pid: int
    gpu_uuid: str
    lease_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Attribution:
    processes: tuple[ProcessVerdict, ...]
    lease_use: tuple[LeaseUse, ...]
    kills: tuple[Kill, ...]

    def for_gpu(self, gpu_uuid: str) -> tuple[list[ProcessVerdict], list[LeaseUse]]:
        return ([p for p in self.processes if p.gpu_uuid == gpu_uuid],
                [u for u in self.lease_use if u.gpu_uuid == gpu_uuid])


def _same_start(a: float | None, b: float) -> bool:
    return a is None or abs(a - b) < _SAME_START_S


def covers(c: Covered, pid: int, info: ProcInfo | None, procs: Mapping[int, ProcInfo]) -> bool:
    """Does ``c`` cover process ``pid`` (``info``: the OS's view of it, None if it just vanished)?"""
    for recorded, started in c.pids:
        if recorded == pid and (info is None or _same_start(started, info.started)):
            return True
    if c.pgid and info is not None and info.pgid == c.pgid:
        leader = procs.get(c.pgid)
        # A group id is only reused once the old group is empty, by a new leader whose pid is that id.
        reused = (leader is not None and leader.pgid == c.pgid and c.pgid_started is not None
                  and not _same_start(c.pgid_started, leader.started))
        return not reused
    return False


def attribute(usage: Sequence[GpuUsage], live: Sequence[Covered], gone: Sequence[Covered],
              procs: Mapping[int, ProcInfo], *, mode: str = "report", tolerance_mb: int = 0,
              untracked_since: Mapping[int, float] | None = None, now: float = 0.0,
              untracked_grace_s: float = 0.0, protected: Iterable[int] = ()) -> Attribution:
    """Match every GPU process to the leases (see the module's docstring). ``procs`` holds the live
    processes (the GPU's and the recorded group leaders); a process missing from it has exited and is
    never killed. ``protected`` PIDs are never killed."""
    if mode not in ENFORCE_MODES:
        raise ValueError(f"enforce: {mode!r} is not one of {', '.join(ENFORCE_MODES)}")
    keep = set(protected) | {0, 1}
    since = untracked_since or {}
    verdicts: list[ProcessVerdict] = []
    kills: dict[int, Kill] = {}
    lease_uses: list[LeaseUse] = []
    by_id = {c.lease_id: c for c in live}
    for u in usage:
        # lease id -> processes of this GPU it covers; and the union of leases that share processes.
        own: dict[str, list[tuple[int, int]]] = {c.lease_id: [] for c in live if c.gpu_uuid == u.uuid}
        group: dict[str, str] = {lid: lid for lid in own}

        def root(x: str) -> str:
            while group[x] != x:  # noqa: B023 - find() is used within this iteration only
                group[x] = group[group[x]]  # noqa: B023 - find() is used within this iteration only
                x = group[x]  # noqa: B023 - find() is used within this iteration only
            return x

        shared_use: list[tuple[set[str], int]] = []
        for p in u.processes:
            info = procs.get(p.pid)
            holders = sorted(c.lease_id for c in live if covers(c, p.pid, info, procs))
            here = [lid for lid in holders if lid in own]
            if here:
                verdicts.append(ProcessVerdict(p.pid, u.uuid, p.used_mb, "leased", here[0]))
                for lid in here:
                    own[lid].append((p.pid, p.used_mb))
                    group[root(lid)] = root(here[0])
                shared_use.append((set(here), p.used_mb))
                continue
            if holders:
                verdicts.append(ProcessVerdict(p.pid, u.uuid, p.used_mb, "leased_elsewhere", holders[0]))
                continue
            was = sorted((c for c in gone if covers(c, p.pid, info, procs)), key=lambda c: -c.gone_at)
            if was:
                lid = was[0].lease_id
                verdicts.append(ProcessVerdict(p.pid, u.uuid, p.used_mb, "orphaned", lid))
                # G9: only what a lease of its own agent attached, as this node confirmed, is ever killed.
                if mode != "report" and info is not None and p.pid not in keep and was[0].vouched:
                    kills.setdefault(p.pid, Kill(p.pid, u.uuid, lid, f"its lease {lid} no longer exists"))
                continue
            verdicts.append(ProcessVerdict(p.pid, u.uuid, p.used_mb, "untracked"))
            if (mode == "kill-untracked" and info is not None and p.pid not in keep
                    and now - since.get(p.pid, now) >= untracked_grace_s):
                kills.setdefault(p.pid, Kill(p.pid, u.uuid, "", "no lease covers it (--enforce kill-untracked)"))
        # Over-use per cluster of leases that share processes: each process counts once.
        used_by_cluster: dict[str, int] = {}
        for lids, mb in shared_use:
            r = root(next(iter(lids)))
            used_by_cluster[r] = used_by_cluster.get(r, 0) + mb
        leased_by_cluster: dict[str, int] = {}
        for lid in own:
            r = root(lid)
            leased_by_cluster[r] = leased_by_cluster.get(r, 0) + by_id[lid].vram_mb
        for lid in sorted(own):
            c = by_id[lid]
            r = root(lid)
            over = used_by_cluster.get(r, 0) > leased_by_cluster[r] + tolerance_mb
            lease_uses.append(LeaseUse(lid, c.agent, u.uuid, c.vram_mb, sum(mb for _, mb in own[lid]), over,
                                       tuple(pid for pid, _ in own[lid])))
    return Attribution(tuple(verdicts), tuple(lease_uses), tuple(kills.values()))


def read_proc_info(pid: int) -> ProcInfo | None:
    """The OS's view of a live process; None when it is gone (or a zombie, which holds no GPU memory)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return ProcInfo(os.getpgid(pid), p.create_time())
    except (psutil.Error, ProcessLookupError, PermissionError, OSError):
        return None


class Enforcer:
    """The node's memory of which processes leases covered, and the executor of ``attribute``'s kills.

    ``lease_put``/``lease_deleted`` come from the node's lease watch; ``scan`` from its usage loop (in a
    worker thread, hence the lock).
    """

    def __init__(self, mode: str = "report", tolerance_mb: int = 256, untracked_grace_s: float = 30.0,
                 remember_s: float = 3600.0, max_remembered: int = 4096,
                 proc_info: Callable[[int], ProcInfo | None] = read_proc_info,
                 kill: Callable[[int, int], None] = os.kill,
                 carries: Callable[[int, str], bool] = carries_lease) -> None:
        if mode not in ENFORCE_MODES:
            raise ValueError(f"--enforce: {mode!r} is not one of {', '.join(ENFORCE_MODES)}")
        if tolerance_mb < 0:
            raise ValueError("--over-use-tolerance: must be >= 0")
        self.mode, self.tolerance_mb, self.untracked_grace_s = mode, tolerance_mb, untracked_grace_s
        self.remember_s, self.max_remembered = remember_s, max_remembered
        self._proc_info, self._kill, self._carries = proc_info, kill, carries
        self._lock = threading.Lock()
        # Keyed by (lease id, GPU uuid): a gang has one record, with the same id, on each of its GPUs.
        self.live: dict[tuple[str, str], Covered] = {}
        self.gone: dict[tuple[str, str], Covered] = {}
        self._untracked_since: dict[int, float] = {}
        self._reported: set[tuple[int, str, str]] = set()   # (pid, state, lease) already logged
        self._metric_labels: set[tuple[str, str]] = set()
        self.last: Attribution = Attribution((), (), ())
        # lease id -> the pids (and group ids) this node confirmed as its caller's (ConfirmProcesses).
        self._confirmed: dict[str, set[int]] = {}

    def confirmed(self, lease_id: str, pids: Iterable[int]) -> None:
        """``Node.ConfirmProcesses`` said these belong to the caller attaching them to ``lease_id``."""
        with self._lock:
            self._confirmed.setdefault(lease_id, set()).update(pids)
            while len(self._confirmed) > 2 * self.max_remembered:
                del self._confirmed[next(iter(self._confirmed))]

    def _vouched(self, lease: VramLease) -> bool:
        """Did this node confirm every process of the lease, or does each carry the lease in its environment
        (what ``gpucoord run`` starts; that survives a restart of the node)? Otherwise nothing of it is killed."""
        with self._lock:
            known = self._confirmed.get(lease.id, set())
        wanted = {*lease.pids, *([lease.pgid] if lease.pgid else [])}
        return all(pid in known or self._carries(pid, lease.id) for pid in wanted)

    # -- from the lease watch -------------------------------------------------------------------
    def lease_put(self, lease: VramLease) -> None:
        key = (lease.id, lease.gpu_uuid)
        if not lease.pids and not lease.pgid:
            with self._lock:
                self.live.pop(key, None)
            return
        with self._lock:
            old = self.live.get(key)
        if old is not None and tuple(p for p, _ in old.pids) == lease.pids and old.pgid == lease.pgid:
            return
        pids = tuple((pid, (info.started if (info := self._proc_info(pid)) else None)) for pid in lease.pids)
        leader = self._proc_info(lease.pgid) if lease.pgid else None
        covered = Covered(lease.id, lease.gpu_uuid, lease.agent, lease.vram_mb, pids, lease.pgid,
                          leader.started if leader is not None and leader.pgid == lease.pgid else None,
                          vouched=self._vouched(lease))
        with self._lock:
            self.live[key] = covered

    def lease_deleted(self, lease_id: str, now: float, gpu_uuid: str | None = None) -> None:
        """The lease's record on ``gpu_uuid`` is gone (None: its records on every GPU)."""
        with self._lock:
            for key in [k for k in self.live if k[0] == lease_id and gpu_uuid in (None, k[1])]:
                c = self.live.pop(key)
                self.gone[key] = dataclasses.replace(c, gone_at=now)
                while len(self.gone) > self.max_remembered:
                    del self.gone[min(self.gone, key=lambda k: self.gone[k].gone_at)]

    # -- from the usage loop ---------------------------------------------------------------------
    def scan(self, usage: Sequence[GpuUsage], now: float) -> Attribution:
        """Attribute the GPU's processes, act as the mode says, log what changed, update the metrics."""
        with self._lock:
            for lid in [k for k, c in self.gone.items() if now - c.gone_at > self.remember_s]:
                del self.gone[lid]
            live, gone = list(self.live.values()), list(self.gone.values())
        pids = {p.pid for u in usage for p in u.processes} | {c.pgid for c in (*live, *gone) if c.pgid}
        procs = {pid: info for pid in pids if (info := self._proc_info(pid)) is not None}
        gpu_pids = {p.pid for u in usage for p in u.processes}
        self._untracked_since = {pid: t for pid, t in self._untracked_since.items() if pid in gpu_pids}
        result = attribute(usage, live, gone, procs, mode=self.mode, tolerance_mb=self.tolerance_mb,
                           untracked_since=self._untracked_since, now=now,
                           untracked_grace_s=self.untracked_grace_s, protected=(os.getpid(),))
        for v in result.processes:
            if v.state == "untracked":
                self._untracked_since.setdefault(v.pid, now)
            else:
                self._untracked_since.pop(v.pid, None)
        self._log_changes(result)
        for k in result.kills:
            try:
                self._kill(k.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            except PermissionError as e:
                log.error("enforce: cannot SIGKILL pid %d on GPU %s (lease %s): %s", k.pid, k.gpu_uuid,
                          k.lease_id or "none", e)
                continue
            metrics.NODE_ENFORCE_KILLS.labels("orphaned" if k.lease_id else "untracked").inc()
            log.warning("enforce: SIGKILL pid %d on GPU %s (lease %s): %s", k.pid, k.gpu_uuid,
                        k.lease_id or "none", k.reason)
        self._update_metrics(usage, result)
        self.last = result
        return result

    def _log_changes(self, result: Attribution) -> None:
        now_seen: set[tuple[int, str, str]] = set()
        for v in result.processes:
            key = (v.pid, v.state, v.lease_id)
            now_seen.add(key)
            if key in self._reported or v.state == "leased":
                continue
            if v.state == "orphaned":
                log.warning("pid %d on GPU %s uses %d MiB but its lease %s no longer exists (%s)", v.pid,
                            v.gpu_uuid, v.used_mb, v.lease_id,
                            "reporting only: --enforce report" if self.mode == "report" else "killing it")
            elif v.state == "untracked":
                log.info("pid %d on GPU %s uses %d MiB and no lease covers it", v.pid, v.gpu_uuid, v.used_mb)
            else:
                log.warning("pid %d uses %d MiB on GPU %s, but its lease %s is on another GPU", v.pid, v.used_mb,
                            v.gpu_uuid, v.lease_id)
        for u in result.lease_use:
            key = (-1, "over_use", u.lease_id)
            if not u.over_use:
                continue
            now_seen.add(key)
            if key not in self._reported:
                log.warning("lease %s of %s on GPU %s: its processes %s use %d MiB, above the %d MiB leased "
                            "(tolerance %d MiB)", u.lease_id, u.agent, u.gpu_uuid, list(u.pids), u.used_mb,
                            u.vram_mb, self.tolerance_mb)
        self._reported = now_seen

    def _update_metrics(self, usage: Sequence[GpuUsage], result: Attribution) -> None:
        labels: set[tuple[str, str]] = set()
        for u in result.lease_use:
            labels.add((u.gpu_uuid, u.lease_id))
            metrics.NODE_LEASE_VRAM_USED.labels(u.gpu_uuid, u.lease_id).set(u.used_mb * metrics.MIB)
            metrics.NODE_LEASE_OVER_USE.labels(u.gpu_uuid, u.lease_id).set(
                max(0, u.used_mb - u.vram_mb) * metrics.MIB if u.over_use else 0)
        for gpu, lease in self._metric_labels - labels:
            for gauge in (metrics.NODE_LEASE_VRAM_USED, metrics.NODE_LEASE_OVER_USE):
                try:
                    gauge.remove(gpu, lease)
                except KeyError:
                    pass
        self._metric_labels = labels
        for g in usage:
            for state in STATES:
                metrics.NODE_GPU_PROCESSES.labels(g.uuid, state).set(
                    sum(1 for v in result.processes if v.gpu_uuid == g.uuid and v.state == state))


def usage_doc(verdicts: Sequence[ProcessVerdict], uses: Sequence[LeaseUse]) -> dict[str, list[dict[str, object]]]:
    """The per-GPU part of ``usage/<host>`` this module adds: processes with their attribution, and the
    use of each lease that recorded processes."""
    return {
        "processes": [{"pid": v.pid, "used_mb": v.used_mb, "state": v.state, "lease_id": v.lease_id}
                      for v in verdicts],
        "leases": [{"lease_id": u.lease_id, "agent": u.agent, "vram_mb": u.vram_mb, "used_mb": u.used_mb,
                    "over_use": u.over_use, "pids": list(u.pids)} for u in uses],
    }


__all__ = ["ENFORCE_MODES", "Attribution", "Covered", "Enforcer", "Kill", "LeaseUse", "ProcInfo", "ProcessVerdict",
           "attribute", "covers", "read_proc_info", "usage_doc"]
