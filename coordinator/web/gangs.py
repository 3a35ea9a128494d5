"""How a multi-host gang (issue 30) reads in a status document, for the console and ``gpucoord status``/``queue``
alike: a lease over its hosts as one phrase (``hosts a,b (2x4 GPUs)``), and a queue entry that is a
multi-host gang's reservation on a host (its ``reserve``: the GPUs no later-ranked request is granted)."""
from __future__ import annotations

import time
from typing import Any, Mapping


def lease_hosts(lease: Mapping[str, Any]) -> str:
    """``hosts a,b (2x4 GPUs)`` for a multi-host lease (its hosts in rank order, GPUs per host); "" for a lease
    of one host."""
    hosts = [str(h) for h in lease.get("hosts") or ()]
    if not hosts:
        return ""
    gpus = lease.get("gpus") or [{}]
    first = gpus[0].get("host", "")
    per_host = sum(1 for g in gpus if g.get("host", "") == first) or 1
    return f"hosts {','.join(hosts)} ({len(hosts)}x{per_host} GPUs)"


def lease_rank(lease: Mapping[str, Any]) -> int:
    """The rank of the part a status row shows (its first GPU's); 0 for a lease of one host."""
    gpus = lease.get("gpus") or [{}]
    return int(gpus[0].get("rank", 0) or 0)


def reservation(entry: Mapping[str, Any], index_of: Mapping[str, Any]) -> str:
    """``reserves GPUs 0,1 for a 2-host gang (same rack)`` for a multi-host gang's reservation on a host (its
    GPUs by index, from ``index_of``: uuid -> index; a uuid the host no longer lists stays a uuid); ""
    for any other entry."""
    reserve = [str(u) for u in entry.get("reserve") or ()]
    if not reserve:
        return ""
    gpus = ",".join(str(index_of.get(u, u)) for u in reserve)
    same = f" (same {entry['same']})" if entry.get("same") else ""
    start = float(entry.get("start_after") or entry.get("start_after_unix") or 0.0)
    when = (f", starts by {time.strftime('%H:%M:%S', time.gmtime(start))} UTC (backfill until then)" if start > 0
            else "")
    return (f"reserves GPU{'s' if len(reserve) > 1 else ''} {gpus} for a {int(entry.get('hosts') or 2)}-host "
            f"gang{same}{when}")


__all__ = ["lease_hosts", "lease_rank", "reservation"]
