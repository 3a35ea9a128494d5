"""Whose process is it? The node's answer to a coordinator's ``ConfirmProcesses``, before an AttachProcesses is
recorded (G9: an agent attaches only processes that are its own).

A lease's agent calls AttachProcesses over one TCP connection; the coordinator passes on where that call came
from (``peer``, as gRPC names it: ``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:41234``). On this host a process
belongs to that caller when

* its environment carries ``GPUCOORD_LEASE_ID`` equal to the lease (what ``gpucoord run`` gives its command
  and everything the command starts): no one but the process's starter sets its environment; or
* it, or one of its ancestors, holds the connection the call came over: the calling process itself
  (``lease.attach()``) and whatever it started (``gpucoord run``'s child, a supervisor's worker).

Anything else is refused: a pid the status table shows, another agent's process, a process that merely runs
under the same user. A caller behind a NAT or a proxy (its peer is not an address of this host) can attach
only the processes its lease's environment names.
"""
from __future__ import annotations

import ipaddress
from typing import Iterable

import psutil

LEASE_ENV = "GPUCOORD_LEASE_ID"
MAX_ANCESTORS = 64   # a parent chain longer than this is not followed further


def parse_peer(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string as (ip, port); None for anything but a TCP peer (``unix:``, empty, malformed)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host.split("%", 1)[0])), int(port)
    except ValueError:
        return None


def _same_address(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a.split("%", 1)[0]), ipaddress.ip_address(b.split("%", 1)[0])
    except ValueError:
        return False
    # An IPv4 client of a dual-stack server shows as ::ffff:a.b.c.d on one side and a.b.c.d on the other.
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None:
        x = x.ipv4_mapped
    if isinstance(y, ipaddress.IPv6Address) and y.ipv4_mapped is not None:
        y = y.ipv4_mapped
    return x == y


def _holds(proc: psutil.Process, peer: tuple[str, int]) -> bool:
    try:
        conns = proc.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return False
    return any(c.laddr and c.laddr[1] == peer[1] and _same_address(c.laddr[0], peer[0]) and c.raddr
               for c in conns)


def _carries_lease(proc: psutil.Process, lease_id: str) -> bool:
    try:
        return bool(lease_id) and proc.environ().get(LEASE_ENV) == lease_id
    except (psutil.Error, OSError):
        return False


def carries_lease(pid: int, lease_id: str) -> bool:
    """Does the live process ``pid`` carry ``GPUCOORD_LEASE_ID`` = ``lease_id`` in its environment?"""
    try:
        return _carries_lease(psutil.Process(pid), lease_id)
    except (psutil.Error, OSError, ValueError):
        return False


def belongs(pid: int, lease_id: str, peer: tuple[str, int] | None) -> bool:
    """Does the live process ``pid`` belong to the caller (see the module's docstring)?"""
    try:
        proc: psutil.Process | None = psutil.Process(pid)
    except (psutil.Error, OSError, ValueError):
        return False
    assert proc is not None
    if _carries_lease(proc, lease_id):
        return True
    if peer is None:
        return False
    for _ in range(MAX_ANCESTORS):
        if proc is None or proc.pid in (0, 1):
            return False
        if _holds(proc, peer):
            return True
        try:
            proc = proc.parent()
        except (psutil.Error, OSError):
            return False
    return False


def refused(lease_id: str, pids: Iterable[int], pgid: int, peer: str) -> list[int]:
    """The pids (and the group id, by its leader) that do not belong to the caller, in the order given."""
    where = parse_peer(peer)
    wanted = list(dict.fromkeys([*pids, *([pgid] if pgid else [])]))
    return [pid for pid in wanted if pid <= 0 or not belongs(pid, lease_id, where)]


__all__ = ["LEASE_ENV", "belongs", "carries_lease", "parse_peer", "refused"]
