"""Time, in one place.

Nothing that matters across machines compares wall clocks of different machines: deadlines and
staleness are measured on one machine's monotonic clock from when that machine *observed* a revision
(``coordinator/replica/observed.py``). Wall time is still written into records for people (``created_at``,
``deadline_unix``, a usage report's ``ts``) and differences of two wall times written by the *same*
process (``deadline_unix - created_at`` is a grace period) are used.

``GPUCOORD_CLOCK_OFFSET_S`` shifts this process's wall clock (tests run a node and a replica with skewed
clocks through it, to prove that nothing depends on clocks agreeing).
"""
from __future__ import annotations

import os
import time

OFFSET_ENV = "GPUCOORD_CLOCK_OFFSET_S"


def _offset() -> float:
    raw = os.environ.get(OFFSET_ENV, "")
    try:
        return float(raw) if raw else 0.0
    except ValueError:
        raise SystemExit(f"{OFFSET_ENV}: {raw!r} is not a number of seconds") from None


_OFFSET = _offset()


def wall() -> float:
    """This process's wall clock (seconds since the epoch), as written into records."""
    return time.time() + _OFFSET


def monotonic() -> float:
    """The clock every local deadline and age is measured with."""
    return time.monotonic()
