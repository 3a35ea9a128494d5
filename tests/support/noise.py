"""The asyncio noise a command must never print at its exit (issue 20, item 5): a task still pending when its
event loop was destroyed, or something used after its loop closed."""
from __future__ import annotations

ASYNCIO_NOISE = ("Task was destroyed but it is pending", "Event loop is closed")


def assert_no_asyncio_noise(stderr: str, what: str) -> None:
    """``stderr`` (of the command ``what``) holds none of ASYNCIO_NOISE."""
    for noise in ASYNCIO_NOISE:
        assert noise not in stderr, f"{what}: {noise!r} in its stderr:\n{stderr[-3000:]}"
