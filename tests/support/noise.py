"""The asyncio noise a command must never print at its exit (issue 20, item 5): a task still pending when its
event loop was destroyed, or something used after its loop closed; and the marks of an error nobody handled in
a daemon's log."""
from __future__ import annotations

ASYNCIO_NOISE = ("Task was destroyed but it is pending", "Event loop is closed")
UNHANDLED = ("Traceback", "never retrieved", "destroyed but it is pending")


def assert_no_asyncio_noise(stderr: str, what: str) -> None:
    """``stderr`` (of the command ``what``) holds none of ASYNCIO_NOISE."""
    for noise in ASYNCIO_NOISE:
        assert noise not in stderr, f"{what}: {noise!r} in its stderr:\n{stderr[-3000:]}"


def unhandled_in_log(log: str, before: int = 3, after: int = 25, most: int = 5) -> str:
    """The lines of ``log`` that hold one of UNHANDLED, each with ``before`` lines above it and ``after`` below
    (a traceback follows its mark), the first ``most`` of them; "" when there is none. An assertion's message:
    the offending lines themselves, wherever in the log they are, not its tail."""
    lines = log.splitlines()
    hits = [i for i, line in enumerate(lines) if any(bad in line for bad in UNHANDLED)]
    out: list[str] = []
    shown_to = -1
    for i in hits[:most]:
        start = max(i - before, shown_to + 1)
        if start > i:
            continue      # already shown in the excerpt before
        out.append(f"--- line {i + 1} of {len(lines)}:")
        shown_to = min(i + after, len(lines) - 1)
        out.extend(lines[start:shown_to + 1])
    if len(hits) > most:
        out.append(f"--- and {len(hits) - most} more such lines")
    return "\n".join(out)
