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
    (a traceback follows its mark), overlapping excerpts merged, the first ``most`` marks; "" when there is
    none. An assertion's message: the offending lines themselves, wherever in the log they are, not its tail."""
    lines = log.splitlines()
    hits = [i for i, line in enumerate(lines) if any(bad in line for bad in UNHANDLED)]
    spans: list[list[int]] = []       # [first, last] line index of each excerpt
    for i in hits[:most]:
        start, end = max(0, i - before), min(len(lines) - 1, i + after)
        if spans and start <= spans[-1][1] + 1:
            spans[-1][1] = end
        else:
            spans.append([start, end])
    out: list[str] = []
    for start, end in spans:
        marks = ", ".join(str(i + 1) for i in hits[:most] if start <= i <= end)
        out.append(f"--- lines {start + 1}-{end + 1} of {len(lines)} (marks at {marks}):")
        out.extend(lines[start:end + 1])
    if len(hits) > most:
        out.append(f"--- and {len(hits) - most} more such lines")
    return "\n".join(out)
