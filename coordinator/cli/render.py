"""Tables for people: ``gpucoord status`` and ``gpucoord partition``. Pure formatting of JSON documents."""
from __future__ import annotations

import time
from typing import Any, Sequence

from coordinator.policy.partition.units import show_bytes, show_mib
from coordinator.web.gangs import lease_hosts, lease_rank, reservation

_mib = show_mib   # the one display rule of sizes (docs/cli.md, "Sizes"): binary units, at most 4 significant digits


_PROCESSES = {"stopping": "processes stopping (still on the GPU)", "gone": "processes gone",
              "unknown": "processes not visible to the node"}


def _time_limit(lease: dict[str, Any], now: float) -> str:
    """The mark of a lease with a time limit: the limit and the time left to its end (by this machine's clock
    against the granting replica's ``created_at``: for people, not what the leader enforces)."""
    limit = float(lease.get("time_limit_seconds", 0) or 0)
    if not limit:
        return ""
    left = float(lease.get("created_at", now)) + limit - now
    return f" time limit {limit:g}s, " + (f"ends in {left:.0f}s" if left > 0 else "at its end")


def _idle(lease: dict[str, Any], now: float) -> str:
    """The mark of an idle lease (docs/policies.md "Idle GPUs"): since when its GPUs stayed below the threshold, and what
    its policy does."""
    if not lease.get("idle"):
        return ""
    since = now - float(lease.get("idle_since", now) or now)
    return f" IDLE for {max(0.0, since):.0f}s ({lease.get('idle_action') or 'warn'})"


def _eviction(notice: dict[str, Any] | None, now: float) -> str:
    """The mark of a lease under an eviction notice: who asks, the time left before the deadline, and how
    its processes stand (a lease bound to processes is revoked once they are gone, or at the kill margin)."""
    if not notice:
        return ""
    left = float(notice.get("deadline_unix", 0)) - now
    procs = _PROCESSES.get(str(notice.get("processes") or ""), "")
    what = "REVOKING" if notice.get("revoke") else "EVICTING"
    when = f"deadline in {left:.0f}s" if left > 0 else "deadline passed"
    return (f"  {what}: {when}, asked by {notice.get('requested_by') or '?'}"
            f" ({notice.get('reason') or 'no reason'})" + (f"; {procs}" if procs else ""))


def _departing(gpu: dict[str, Any]) -> list[str]:
    """Ended leases whose processes the node still reported: their VRAM is held until they are gone."""
    out = []
    for d in gpu.get("departing", []):
        pids = ", ".join(str(x) for x in d.get("pids", [])) or "none now"
        if d.get("held"):
            state = "VRAM held until they are gone (or the kill margin passes)"
        elif d.get("forced"):
            state = ("the kill margin passed: no longer held for it (what NVML still counts is untracked VRAM); "
                     "the node kills them with --enforce kill")
        else:
            state = "gone: VRAM free"
        out.append(f"  DEPARTING on GPU {gpu['index']}: lease {d.get('lease_id', '?')} ({d.get('agent', '?')}, "
                   f"{_mib(int(d.get('vram_mb', 0)))}) ended, {'revoked' if d.get('revoke') else 'evicted'} by "
                   f"{d.get('requested_by') or '?'}; its processes on the GPU: {pids}; {state}")
    return out


def render_status(doc: dict[str, Any], now: float | None = None) -> str:
    """The operator's table: hosts, GPUs (total, leased, used, untracked, free; NUMA node, ``?`` when unknown,
    and NVLink peers, ``-`` for none), partitions, leases, queue.
    ``now`` (unix seconds) is when the deadlines of eviction notices are counted from."""
    now = time.time() if now is None else now
    lines = [f"revision {doc.get('revision', 0)}  leader {doc.get('leader') or 'none'}"]
    members = doc.get("etcd_members", [])
    if members:
        leader = next((m.get("name") or m.get("id") for m in members if m.get("leader")), "none")
        lines.append(f"etcd {len(members)} member{'s' if len(members) != 1 else ''}  leader {leader}")
    for h in doc.get("hosts", []):
        age = float(h.get("usage_age_seconds", -1))
        state = "alive" if h.get("alive") else "GONE (no new admissions)"
        sim = " simulated" if h.get("simulated") else ""
        lines.append(f"host {h['host']} {state}{sim}  addr={h.get('address', '')}  partition={h.get('partition_mode')}"
                     f"  usage age={'n/a' if age < 0 else f'{age:.1f}s'}"
                     + ("  USAGE STALE (admission keeps the last untracked VRAM)" if h.get("usage_stale") else ""))
        if h.get("labels"):
            lines.append("  labels: " + " ".join(f"{k}={v}" for k, v in sorted(h["labels"].items())))
        if h.get("invalid"):
            lines.append(f"  INVALID {h['invalid']}  (no admission on this host until it is rewritten)")
        if h.get("cordoned"):
            c = h.get("cordon") or {}
            state = "DRAINING" if h.get("draining") else "CORDONED"
            lines.append(f"  {state} (no new lease until 'gpucoord host uncordon'): {c.get('reason') or 'no reason given'}"
                         + (f"  by {c['asked_by']}" if str(c.get("asked_by", "")).startswith("gpucoord://") else ""))
        lines.append(f"  {'GPU':>3} {'uuid':<24} {'total':>8} {'usable':>8} {'leased':>8} {'used':>8} "
                     f"{'untracked':>9} {'free':>8} {'token':>6} {'numa':>4} nvlink")
        for g in h.get("gpus", []):
            used = int(g.get("used_mb", -1))
            numa = -1 if g.get("numa_node") is None else int(g["numa_node"])
            lines.append(f"  {g['index']:>3} {g['uuid'][:24]:<24} {_mib(int(g['total_mb'])):>8} "
                         f"{_mib(int(g['usable_mb'])):>8} {_mib(int(g['leased_mb'])):>8} "
                         f"{'n/a' if used < 0 else _mib(used):>8} {_mib(int(g['untracked_mb'])):>9} "
                         f"{_mib(int(g['free_mb'])):>8} {g.get('seq', 0):>6} {'?' if numa < 0 else numa:>4} "
                         f"{_ranges([int(x) for x in g.get('nvlink_peers', [])])}")
        known = [f"GPU {g['index']} {int(g['utilization_percent'])}%" for g in h.get("gpus", [])
                 if int(g.get("utilization_percent", -1)) >= 0]
        if known:
            lines.append("  utilization: " + ", ".join(known))
        for g in h.get("gpus", []):
            lines += _departing(g)
            for u in g.get("lease_use", []):
                if u.get("over_use"):
                    lines.append(f"  OVER-USE on GPU {g['index']}: lease {u['lease_id']} ({u['agent']}) uses "
                                 f"{_mib(int(u['used_mb']))} of {_mib(int(u['vram_mb']))} leased "
                                 f"(pids {', '.join(str(x) for x in u.get('pids', []))})")
            for p in g.get("processes", []):
                if p.get("state") == "orphaned":
                    lines.append(f"  ORPHANED on GPU {g['index']}: pid {p['pid']} uses {_mib(int(p['used_mb']))}; "
                                 f"its lease {p['lease_id']} no longer exists")
                elif p.get("state") in ("untracked", "leased_elsewhere"):
                    lines.append(f"  {p['state']} on GPU {g['index']}: pid {p['pid']} uses {_mib(int(p['used_mb']))}"
                                 + (f" (its lease {p['lease_id']} is on another GPU)" if p.get("lease_id") else ""))
        index_of = {g["uuid"]: g["index"] for g in h.get("gpus", [])}   # a uuid is too long for a table row
        if h.get("agents") and h.get("partition_mode") != "shared":
            lines.append("  partition:")
            for a in h["agents"]:
                alloc = a["allocation"]
                caps = ", ".join(f"GPU {index_of.get(u, u)}: {_mib(c)}" for u, c in alloc.get("vram_caps_mb", []))
                lines.append(f"    {a['agent']:<16} cores={len(alloc.get('cores', []))} "
                             f"mem={show_bytes(int(alloc.get('mem_bytes', 0)))} "
                             f"gpus={len(alloc.get('whole_gpus', []))} caps=[{caps}] "
                             f"leased={_mib(int(a.get('leased_mb', 0)))} ({a.get('leases', 0)} leases)")
        if h.get("leases"):
            lines.append(f"  {'lease':<20} {'agent':<14} {'GPU':>3} {'vram':>8} {'prio':>5} {'pre':>3} "
                         f"{'token':>6} {'ttl':>4}")
            for lease in sorted(h["leases"], key=lambda x: (x["gpu_index"], int(x["token"]))):
                gpus = [str(g.get("index", 0)) for g in lease.get("gpus", [])]   # a gang: all its GPUs
                where = ",".join(gpus) if len(gpus) > 1 else str(lease["gpu_index"])
                lines.append(f"  {lease['id']:<20} {lease['agent']:<14} {where:>3} "
                             f"{_mib(int(lease['vram_mb'])):>8} {lease['priority']:>5} "
                             f"{'y' if lease['preemptible'] else 'n':>3} {lease['token']:>6} "
                             f"{lease.get('ttl_remaining', '?'):>4}{' over quota' if lease.get('over_quota') else ''}"
                             f"{_part(lease)}"
                             f"{_time_limit(lease, now)}{_idle(lease, now)}{_eviction(lease.get('eviction'), now)}")
        else:
            lines.append("  no leases")
        for q in h.get("queue", []):
            held = reservation(q, index_of)
            lines.append(f"  {'reserved' if held else 'waiting'}: {q['agent']} {_shape(q)} priority {q['priority']}"
                         + (f"; {held}" if held else "") + (f"\n    {q['reason']}" if q.get("reason") else ""))
    if not doc.get("hosts"):
        lines.append("no hosts registered")
    lines += _multi_host(doc)
    if doc.get("teams"):
        from coordinator.cli.teams import render_teams
        lines += ["teams:"] + ["  " + line for line in render_teams(doc["teams"]).splitlines()]
    return "\n".join(lines)


def _part(lease: dict[str, Any]) -> str:
    """The mark of a multi-host lease's part on a host: its rank and the lease's hosts."""
    over = lease_hosts(lease)
    return f" rank {lease_rank(lease)} of {over}" if over else ""


def _multi_host(doc: dict[str, Any]) -> list[str]:
    """Every multi-host lease as one row over its hosts (each host's section lists its part)."""
    rows: dict[str, str] = {}
    for h in doc.get("hosts", []):
        for lease in h.get("leases", []):
            over = lease_hosts(lease)
            if over and lease["id"] not in rows:
                rows[lease["id"]] = (f"  {lease['id']:<20} {lease['agent']:<14} {over}, "
                                     f"{'whole GPUs' if lease.get('exclusive') else _mib(int(lease['vram_mb'])) + ' each'}"
                                     f", priority {lease['priority']}")
    return ["multi-host leases:", *rows.values()] if rows else []


def _shape(q: dict[str, Any]) -> str:
    """What a waiting request asks for: its VRAM (on each of its GPUs), or whole GPUs; which GPUs; topology."""
    count = int(q.get("gpu_count") or 1)
    what = (f"{count} whole GPU{'s' if count > 1 else ''}" if q.get("exclusive")
            else _mib(int(q["vram_mb"])) + (f" x {count} GPUs" if count > 1 else ""))
    named = ",".join(str(x) for x in q.get("gpus") or ()) or q.get("gpu") or "any"
    topology = q.get("topology") or "any"
    return f"{what} gpu{'s' if count > 1 else ''}={named}" + (f" topology={topology}" if topology != "any" else "")


def _ranges(ids: Sequence[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out: list[str] = []
    for i in sorted(ids):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        elif out and "-" not in out[-1] and int(out[-1]) == i - 1:
            out[-1] = f"{out[-1]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "-"


def render_partition(doc: dict[str, Any]) -> str:
    """One line per agent: cores, memory, disk, whole GPUs and VRAM caps (sizes as docs/cli.md "Sizes" shows them)."""
    lines = [f"host {doc['host']}: mode {doc['mode']}, VRAM headroom {_mib(int(doc.get('headroom_mb', 0)))} per GPU"]
    for a in doc.get("allocations", []):
        whole = ", ".join(a["whole_gpus"]) or "none"
        caps = ", ".join(f"{u} {_mib(int(c))}" for u, c in a["vram_caps_mb"]) or "none"
        lines.append(f"  {a['agent']}: cores {_ranges(a['cores'])} ({len(a['cores'])}), "
                     f"mem {show_bytes(int(a['mem_bytes']))}, disk {show_bytes(int(a['disk_bytes']))}")
        lines.append(f"    whole GPUs: {whole}")
        lines.append(f"    VRAM caps:  {caps}")
    if not doc.get("allocations"):
        r = (doc.get("spec") or {}).get("reserved", {})
        lines.append(f"  any agent: the whole host minus reserved (cpu {r.get('cpu', 0)}, mem "
                     f"{show_bytes(int(r.get('mem', 0)))}, disk {show_bytes(int(r.get('disk', 0)))}); every GPU "
                     "with a cap of total - headroom")
    priority_caps: dict[str, Any] = (doc.get("spec") or {}).get("priority_caps") or {}
    for name, cap in sorted(priority_caps.items()):
        lines.append(f"  priority cap {name}: at most {cap.get('max_priority')}"
                     + (", non-preemptible allowed" if cap.get("non_preemptible") else ", preemptible leases only"))
    return "\n".join(lines)
