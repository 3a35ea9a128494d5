"""GPU utilization through NVML (issue 31, docs/policies.md "Idle GPUs"): what the node reports so that idle leases can be
told from busy ones.

* ``nvmlDeviceGetUtilizationRates``: the percentage of the last sample period in which a kernel ran on the GPU
  (``.gpu``). Any NVML error (NotSupported on some devices, a GPU in trouble) makes it unknown: -1, never 0, so
  that a GPU gpucoord cannot read is never judged idle.
* ``nvmlDeviceGetProcessUtilization`` where the driver has it: each process's SM percentage over the samples
  since the previous scan. NotFound (no sample since then) is an empty answer; NotSupported, FunctionNotFound or
  a pynvml build without the function leave the per-process figures out (None). Reported for operators only:
  the idle judgment uses the GPU's figure.
"""
from __future__ import annotations

import logging
from typing import Any

from coordinator.node.nvml_api import Handle, _err_text, _error_code

log = logging.getLogger(__name__)

UNKNOWN = -1
NVML_ERROR_NOT_FOUND = 6   # nvml.h: no sample since the time stamp given


def _percent(value: object) -> int:
    """0..100, or UNKNOWN for anything else (NVML's "not available" marker, a broken binding)."""
    try:
        pct = int(value)   # type: ignore[call-overload]
    except (TypeError, ValueError):
        return UNKNOWN
    return pct if 0 <= pct <= 100 else UNKNOWN


def gpu_utilization(nvml: Any, handle: Handle, errors: tuple[type[BaseException], ...]) -> int:
    """The GPU's utilization in percent, UNKNOWN (-1) when NVML cannot say."""
    fn = getattr(nvml, "nvmlDeviceGetUtilizationRates", None)
    if not callable(fn):
        return UNKNOWN
    caught: tuple[type[BaseException], ...] = (*errors, TypeError, ValueError)
    try:
        rates = fn(handle)
    except caught as e:
        log.debug("nvmlDeviceGetUtilizationRates failed (%s): utilization unknown", _err_text(e))
        return UNKNOWN
    return _percent(getattr(rates, "gpu", None))


def process_utilization(nvml: Any, handle: Handle, errors: tuple[type[BaseException], ...],
                        since_us: int) -> tuple[tuple[int, int], ...] | None:
    """(pid, SM percent) of each process sampled since ``since_us`` (NVML's microsecond time stamps; 0: its whole
    buffer), the highest per pid; None when the driver cannot tell."""
    fn = getattr(nvml, "nvmlDeviceGetProcessUtilization", None)
    if not callable(fn):
        return None
    caught: tuple[type[BaseException], ...] = (*errors, TypeError, ValueError)
    try:
        samples = fn(handle, since_us)
    except caught as e:
        if _error_code(e) == NVML_ERROR_NOT_FOUND:
            return ()
        log.debug("nvmlDeviceGetProcessUtilization failed (%s): no per-process utilization", _err_text(e))
        return None
    out: dict[int, int] = {}
    for s in samples or ():
        try:
            pid = int(s.pid)
        except (AttributeError, TypeError, ValueError):
            continue
        pct = _percent(getattr(s, "smUtil", None))
        if pid > 0 and pct != UNKNOWN:
            out[pid] = max(out.get(pid, 0), pct)
    return tuple(sorted(out.items()))
