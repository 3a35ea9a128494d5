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
from agent_client.run import AsyncBoundProcess, CommandOptions


async def run_command(addresses: str | Sequence[str], agent: str, host: str, cmd: Sequence[str], vram_mb: int,
                      *, ttl: int | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                      tls_key: str | None = None, **options: Unpack[CommandOptions]) -> int:
    """``gpucoord run``: a session of its own, the command under a lease, SIGINT/SIGTERM/SIGHUP forwarded.
    ``tls_*`` (else ``GPUCOORD_TLS_CA/CERT/KEY``) turn on mTLS.

    Returns the command's exit status (128+N for signal N); 125 when gpucoord itself fails (no lease),
    126 or 127 when the command cannot be run.
    """
    def say(msg: str) -> None:
        print(f"gpucoord run: {msg}", file=sys.stderr, flush=True)

    if not logging.getLogger().handlers:
        # Nobody asked for logs (no --verbose): what the library would warn about (a session that expired,
        # a release that failed) is said once, in the final line; Python's last-resort handler would print
        # it a second time, bare.
        logging.getLogger("agent_client").setLevel(logging.ERROR)

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    client = AsyncClient(addresses, agent=agent, host=host, ttl=ttl, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    proc = AsyncBoundProcess(client, cmd, vram_mb, say=say, foreground=True, **options)
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
        final = f"no lease: {type(e).__name__}: {e.message}"
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
            say(final)


__all__ = ["run_command"]
