"""``gpucoord bench``: the command. What it measures and how lives in ``coordinator.bench``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from coordinator.bench.report import Figures, side_by_side
from coordinator.bench.runner import QUICK, Sizes, run
from coordinator.cli.common import UsageError
from coordinator.limits import quote


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.n <= 100_000:
        raise UsageError(f"--n: must be within [1, 100000], got {quote(args.n)}", "see 'gpucoord bench --help'")
    sizes = QUICK if args.quick else Sizes(n=args.n)
    for flag, field, most in (("sessions", "idle_sessions", 100_000), ("reporting_hosts", "reporting_hosts", 100_000),
                              ("hosts", "p5_hosts", 100_000), ("leases", "p5_leases", 1_000_000)):
        given = getattr(args, flag, 0) or 0
        name = flag.replace("_", "-")
        if given and not 1 <= given <= most:
            raise UsageError(f"--{name}: must be within [1, {most}], got {quote(given)}", "see 'gpucoord bench --help'")
        if given:
            sizes = dataclasses.replace(sizes, **{field: int(given)})  # type: ignore[arg-type]
    out: Figures = {"quick": bool(args.quick), "cores": os.cpu_count()}
    started = time.time()
    lines = run(args.what, sizes, out, getattr(args, "profile_coordinator", "") or "",
                emit=(lambda _l: None) if args.json else (lambda line: print(line.render(), flush=True)))
    out["lines"] = [dataclasses.asdict(x) for x in lines]
    out["seconds"] = time.time() - started
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for row in side_by_side(out):
            print(row)
    return 0
