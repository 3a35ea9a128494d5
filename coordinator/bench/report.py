"""The bench's report: one line per figure with its verdict, and the side-by-side table of P4."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

# The figures behind the lines, as ``--json`` prints them: each phase adds its own under its key ("p1",
# "side_by_side", ...), with the lines and the run's facts beside them.
Figures = dict[str, Any]


@dataclasses.dataclass
class Line:
    id: str
    what: str
    figure: float
    unit: str
    baseline: float | None
    baseline_what: str
    ratio: float | None
    target: str
    ok: bool | None

    def render(self) -> str:
        base = f"baseline {self.baseline:9.3f} {self.unit:<6} ({self.baseline_what})" if self.baseline is not None \
            else f"({self.baseline_what})" if self.baseline_what else ""
        ratio = f"ratio {self.ratio:7.3f}" if self.ratio is not None else " " * 13
        verdict = "PASS" if self.ok else "FAIL" if self.ok is not None else "----"
        return f"{self.id:<5} {verdict}  {self.what:<46} {self.figure:10.3f} {self.unit:<6} {ratio}  " \
               f"target {self.target:<12} {base}"


def line(id: str, what: str, figure: float, unit: str, baseline: float | None, baseline_what: str, target: str,
         ok: Callable[[float], bool], use_ratio: bool = True) -> Line:
    """A judged line: ``ok`` is applied to figure / baseline when there is a baseline (and ``use_ratio``),
    else to the figure; a ``report`` target has no verdict."""
    ratio = figure / baseline if baseline and use_ratio else None
    value = ratio if ratio is not None else figure
    return Line(id, what, figure, unit, baseline, baseline_what, ratio, target,
                None if target == "report" else bool(ok(value)))


def side_by_side(out: Figures) -> list[str]:
    """The side-by-side table of the P4 phase (none when it did not run)."""
    if "side_by_side" not in out:
        return []
    rows = ["side by side on one GPU (acquire+release pairs/s; acquire p50/p99 ms; coordinator CPU ms per pair):"]
    for agents, s in out["side_by_side"].items():
        rows.append(f"  {agents:>3} agents  gpucoord {s['gpucoord_pairs_s']:7.1f}/s  "
                    f"p50 {s['gpucoord_acquire_p50_ms']:6.2f}  p99 {s['gpucoord_acquire_p99_ms']:7.2f}  "
                    f"cpu/pair {s['coordinator_cpu_ms_per_pair']:.2f} ms  "
                    f"(coordinator at {s['coordinator_cpu_share'] * 100:.0f}% of a core)   lock-based "
                    f"{s['lock_pairs_s']:7.1f}/s  p50 {s['lock_acquire_p50_ms']:6.2f}  "
                    f"p99 {s['lock_acquire_p99_ms']:7.2f}")
    return rows
