"""``gpucoord run``'s agent side: a session of its own and one command bound to a lease (see
:mod:`agent_client.run`), with SIGINT, SIGTERM and SIGHUP forwarded to the command."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Sequence, Unpack

from agent_client import errors
from agent_client.client import AsyncClient
from agent_client.join import AsyncJoinedProcess
from agent_client.run import AsyncBoundProcess, CommandOptions


async def run_command(addresses: str | Sequence[str], agent: str, host: str, cmd: Sequence[str], vram_mb: int,
                      *, ttl: int | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                      tls_key: str | None = None, **options: Unpack[CommandOptions]) -> int:
    """``gpucoord run``: a session of its own, the command under a lease, SIGINT/SIGTERM/SIGHUP forwarded.
    ``tls_*`` (else ``GPUCOORD_TLS_CA/CERT/KEY``) turn on mTLS.

    Returns the command's exit status (128+N for signal N); 125 when gpucoord itself fails (no lease),
    126 or 127 when the command cannot be run.
    """
    _quiet_library()
    client = AsyncClient(addresses, agent=agent, host=host, ttl=ttl, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    return await _supervise(client, AsyncBoundProcess(client, cmd, vram_mb, say=_say, foreground=True, **options),
                            "no lease")


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


async def _supervise(client: AsyncClient, proc: AsyncBoundProcess, failed: str) -> int:
    """Start ``proc`` on ``client``'s new session, forward SIGINT/SIGTERM/SIGHUP to it, wait, close the session
    and say the final line (``failed``: its words when gpucoord fails before the command runs)."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    interrupted: list[int] = []

    def on_signal(sig: int) -> None:
        if proc.started and not proc.finished:
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
        await proc.start()
        status = await proc.wait()
        final = proc.message
        return status
    except asyncio.CancelledError:
        if not interrupted:
            raise
        final = f"interrupted by {signal.Signals(interrupted[0]).name} before the command started"
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


__all__ = ["join_command", "run_command"]
