"""``gpucoord run``'s agent side: a session of its own and one command bound to a lease (see
:mod:`agent_client.run`), with SIGINT, SIGTERM and SIGHUP forwarded to the command."""
from __future__ import annotations

import asyncio
import logging
import shlex
import signal
import sys
from typing import Awaitable, Callable, Sequence, Unpack

from agent_client import errors
from agent_client._aio import first_of
from agent_client.client import AsyncClient
from agent_client.join import AsyncJoinedProcess
from agent_client.lease import AsyncLease
from agent_client.run import AsyncBoundProcess, CommandOptions

_ACQUIRE = ("gpu", "priority", "preemptible", "wait", "request_id", "gpu_count", "exclusive", "topology",
            "min_runtime", "time_limit", "time_limit_warning")


async def run_command(addresses: str | Sequence[str], agent: str, host: str, cmd: Sequence[str], vram_mb: int,
                      *, ttl: int | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                      tls_key: str | None = None, hosts: int = 1, same: str = "", prefer: str = "",
                      **options: Unpack[CommandOptions]) -> int:
    """``gpucoord run``: a session of its own, the command under a lease, SIGINT/SIGTERM/SIGHUP forwarded.
    ``tls_*`` (else ``GPUCOORD_TLS_CA/CERT/KEY``) turn on mTLS.

    ``hosts`` of 2 or more (``same``, ``prefer``): a multi-host gang. gpucoord starts nothing on other hosts:
    the lease's id and each rank's ``gpucoord run --join LEASE --rank R -- CMD`` go to stderr, and the command
    runs here, on this host's part, only when this host holds one; else the lease is held until an
    eviction notice (then released: status 0) or an interrupt. Ending the command ends the whole lease.

    Returns the command's exit status (128+N for signal N); 125 when gpucoord itself fails (no lease),
    126 or 127 when the command cannot be run.
    """
    _quiet_library()
    client = AsyncClient(addresses, agent=agent, host=host, ttl=ttl, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    if hosts <= 1:
        return await _supervise(client, AsyncBoundProcess(client, cmd, vram_mb, say=_say, foreground=True, **options),
                                "no lease")
    held: list[AsyncLease] = []   # a multi-host lease held without a part here

    async def launch() -> AsyncBoundProcess | int:
        lease = await client.acquire(vram_mb, hosts=hosts, same=same, prefer=prefer,
                                     **{k: v for k, v in options.items() if k in _ACQUIRE})  # type: ignore[arg-type]
        announce(lease, cmd, _say)
        rank = lease.rank_of(host)
        if rank is None:
            held.append(lease)
            return await hold(lease, client, _say)
        # Its acquire options are the lease's already: the part's client answers the lease granted.
        return AsyncBoundProcess(Granted(client, lease.on_part(rank)), cmd, vram_mb,
                                 say=_say, foreground=True, **options)
    return await _supervise(client, None, "no lease", launch, held)


async def join_command(addresses: str | Sequence[str], agent: str, host: str, cmd: Sequence[str], lease_id: str,
                       rank: int | None, *, ttl: int | None = None, tls_ca: str | None = None,
                       tls_cert: str | None = None, tls_key: str | None = None,
                       kill_after: float | None = None, cgroup_root: str | None = None) -> int:
    """``gpucoord run --join LEASE_ID --rank R``: a session of its own on ``host``, the command bound to rank R's
    part of the lease (``agent_client.join``). Exit statuses as ``run_command``'s: 125 when gpucoord fails
    before the command runs (no such lease, rank R not on ``host``, the attach refused)."""
    _quiet_library()
    client = AsyncClient(addresses, agent=agent, host=host, ttl=ttl, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    proc = AsyncJoinedProcess(client, cmd, lease_id, rank, say=_say, foreground=True, kill_after=kill_after,
                              cgroup_root=cgroup_root)
    return await _supervise(client, proc, f"cannot join lease {lease_id}")


def _say(msg: str) -> None:
    print(f"gpucoord run: {msg}", file=sys.stderr, flush=True)


def _quiet_library() -> None:
    if not logging.getLogger().handlers:
        # Nobody asked for logs (no --verbose): what the library would warn about (a session that expired,
        # a release that failed) is said once, in the final line; Python's last-resort handler would print
        # it a second time, bare.
        logging.getLogger("agent_client").setLevel(logging.ERROR)


async def _supervise(client: AsyncClient, proc: AsyncBoundProcess | None, failed: str,
                     launch: Callable[[], Awaitable[AsyncBoundProcess | int]] | None = None,
                     held: Sequence[AsyncLease] = ()) -> int:
    """Start ``proc`` on ``client``'s new session, forward SIGINT/SIGTERM/SIGHUP to it, wait, close the session
    and say the final line (``failed``: its words when gpucoord fails before the command runs). Without ``proc``,
    ``launch()`` makes it once connected, or answers an exit status itself (a multi-host lease held here)."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    interrupted: list[int] = []

    def on_signal(sig: int) -> None:
        if proc is not None and proc.started and not proc.finished:
            proc.send_signal(sig)
        elif not interrupted:
            interrupted.append(sig)
            main.cancel()

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    final = ""
    try:
        await client.connect()
        if proc is None:
            assert launch is not None
            made = await launch()
            if isinstance(made, int):
                return made
            proc = made
        await proc.start()
        status = await proc.wait()
        final = proc.message
        return status
    except asyncio.CancelledError:
        if not interrupted:
            raise
        final = f"interrupted by {signal.Signals(interrupted[0]).name} " + (
            f"while holding lease {held[0].id}: closing the session ends it" if held else "before the command started")
        return 128 + interrupted[0]
    except errors.GpucoordError as e:
        final = f"{failed}: {type(e).__name__}: {e.message}"
        return 125
    except FileNotFoundError as e:
        final = str(e.strerror or e)
        return 127
    except PermissionError as e:
        final = str(e)
        return 126
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await client.close()
        if final:
            _say(final)


def announce(lease: AsyncLease, cmd: Sequence[str], say: Callable[[str], None]) -> None:
    """A multi-host lease's parts, and what to run on each host: gpucoord starts no remote process."""
    per_host = len(lease.parts[0].gpus)
    say(f"lease {lease.id}: hosts {','.join(lease.hosts)} ({len(lease.hosts)}x{per_host} GPUs)")
    for part in lease.parts:
        say(f"rank {part.rank} on {part.host} (GPUs {','.join(str(g.index) for g in part.gpus)}): "
            f"gpucoord run --join {lease.id} --rank {part.rank} -- {shlex.join(cmd)}")


async def hold(lease: AsyncLease, client: AsyncClient, say: Callable[[str], None]) -> int:
    """Hold a multi-host lease that has no part on this host until an eviction notice (then release it: 0) or
    the session ends (125)."""
    say(f"this host holds no part of lease {lease.id}: holding it until an eviction notice or an interrupt")
    noticed = asyncio.Event()
    lease.on_evict(lambda notice: noticed.set())
    first, _ = await first_of(noticed.wait(), client.done.wait())
    if first == 1:
        say(f"lease {lease.id} lost: the session ended")
        return 125
    await lease.release()
    say(f"lease {lease.id}: eviction notice ({lease.notice.reason if lease.notice else '?'}): released")
    return 0


class Granted:
    """A client whose ``acquire`` answers the lease already granted (a multi-host lease's part on this host),
    so that ``AsyncBoundProcess`` binds the command to it; everything else is the session's client."""

    def __init__(self, client: AsyncClient, lease: AsyncLease) -> None:
        self._client, self._lease = client, lease
        self.agent, self.keepalive_interval, self.done = client.agent, client.keepalive_interval, client.done

    @property
    def expired(self) -> bool:
        return self._client.expired

    @expired.setter
    def expired(self, value: bool) -> None:
        self._client.expired = value

    async def acquire(self, vram_mb: int = 0, *args: object, **kwargs: object) -> AsyncLease:
        return self._lease

    async def partition(self) -> dict[str, object]:
        return await self._client.partition()

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool:
        return await self._client.attach_processes(lease_id, pids, pgid)


__all__ = ["join_command", "run_command"]
