"""Failed TLS handshakes: counted, and logged at most once a minute with the count, not once each.

gRPC's core writes a line to the process's stderr for every connection whose TLS handshake fails (a client
without a certificate, with another CA's or an expired one): 32 such clients in a loop wrote 13,268 lines
in 9 s. A server process (``gpucoord coordinator``, ``gpucoord node``) therefore puts a pipe in front of its
stderr (file descriptor 2): a reader thread passes every line through unchanged, except gRPC core's
"Handshake failed" lines, which it counts (``gpucoord_tls_handshake_failures_total``); another thread logs
one WARNING with the count and the last reason at the first failure and then at most once a minute.
``GPUCOORD_RAW_GRPC_LOGS=1`` leaves stderr as it is.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("gpucoord.handshakes")

MARKER = b"Handshake failed"
_CORE_LINE = re.compile(rb"^[IWEF]\d{4} ")   # gRPC core's (absl's) line prefix: severity, month, day
LOG_EVERY_S = 60.0
_installed = False


class HandshakeLog:
    """The counting and the once-a-minute summary; ``line`` is fed each line gRPC core wrote."""

    def __init__(self, count: Callable[[], None], every_s: float = LOG_EVERY_S) -> None:
        self.count, self.every_s = count, every_s
        self.failed = 0            # since the last summary
        self.total = 0
        self.last_reason = b""
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def line(self, data: bytes) -> bool:
        """True when ``data`` is a failed handshake (swallowed: counted instead)."""
        if MARKER not in data or not _CORE_LINE.match(data):
            return False
        with self._lock:
            self.failed += 1
            self.total += 1
            self.last_reason = data.rpartition(MARKER)[2].strip()[:160]
        self.count()
        self._wake.set()
        return True

    def summary(self) -> str | None:
        with self._lock:
            n, why, self.failed = self.failed, self.last_reason, 0
        if not n:
            return None
        return (f"{n} TLS handshake(s) failed since the last report ({self.total} in all; clients without a "
                f"certificate of the gRPC CA, or with an expired one); the last: {why.decode(errors='replace')}")

    def summaries(self) -> None:
        """Log a summary when handshakes failed, then wait at least ``every_s`` before the next (forever)."""
        while True:
            self._wake.wait()
            self._wake.clear()
            text = self.summary()
            if text is not None:
                log.warning("%s", text)
                time.sleep(self.every_s)   # the rate bound of this log: at most one line a minute


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def install(count: Callable[[], None]) -> HandshakeLog | None:
    """Put the filter in front of this process's stderr (once; not with ``GPUCOORD_RAW_GRPC_LOGS=1``)."""
    global _installed
    if _installed or os.environ.get("GPUCOORD_RAW_GRPC_LOGS") == "1":
        return None
    _installed = True
    hs = HandshakeLog(count)
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def reader() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = b"".join(line + b"\n" for line in lines if not hs.line(line))
                _write_all(original, out)
            _write_all(original, pending)

    filter_thread = threading.Thread(target=reader, daemon=True, name="stderr filter")
    filter_thread.start()
    threading.Thread(target=hs.summaries, daemon=True, name="handshake log").start()

    def drain() -> None:
        """At exit, what the process wrote last (its error message) reaches the real stderr: fd 2 goes back
        to it, which closes the pipe's only write end, and the reader passes on what is left, then ends."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(original, 2)
        filter_thread.join(timeout=5)
    atexit.register(drain)
    return hs


__all__ = ["HandshakeLog", "install"]
