"""``gpucoord usage``: GPU-hours, VRAM-GiB-hours and evictions of the leases that ended, by team, agent or host
(docs/teams.md, "Usage accounting"). It reads etcd (like ``keys``): the hourly rollups for ``--by team|agent``, the
raw records for ``--by host``."""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from typing import Any, Callable

from coordinator.cli.common import EXIT_UNREACHABLE, CliError, UsageError
from coordinator.limits import quote

_HINT = "see 'gpucoord usage --help'"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The CSV header: each column's unit in brackets, so that a spreadsheet shows it.
CSV_COLUMNS = ("GPU-hours [GPU*h]", "VRAM-GiB-hours [GiB*h]", "evictions suffered [count]", "leases ended [count]",
               "evictions caused [count]", "idle GPU-hours [GPU*h]")
_FIELDS = ("gpu_hours", "vram_gib_hours", "evictions", "leases", "evictions_caused", "idle_gpu_hours")


def add_parsers(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    from coordinator.security.etcd_auth import add_arguments as etcd_args
    us = command(sub, "usage", ("etcd", "prefix"), help="GPU-hours and evictions of the leases that ended")
    us.add_argument("--by", choices=("team", "agent", "host"), default="team")
    us.add_argument("--since", default="7d", metavar="AGO|TIME",
                    help="start of the window: a duration ago (30m, 12h, 7d, 2w) or a UTC time (2026-12-01T00); "
                         "default 7d")
    us.add_argument("--until", default=None, metavar="AGO|TIME", help="end of the window (default now)")
    us.add_argument("--lease", default=None, metavar="LEASE_ID",
                    help="the usage records of one lease id instead (each time the id ended), within the retention")
    out = us.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--csv", action="store_true", help="CSV with a header that names each column's unit")
    etcd_args(us)
    us.set_defaults(fn=cmd_usage)


def parse_when(text: str, flag: str, now: float) -> float:
    """A duration ago (``7d``) or a UTC time (``2026-12-01``, ``2026-12-01T19``, ``2026-12-01T19:30``)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if m:
        when = now - float(m.group(1)) * _UNITS[m.group(2)]
        if not when >= 0:   # also -inf, from a duration too long to be a number
            raise UsageError(f"{flag}: {text[:32]!r} reaches back before 1970", _HINT)
        return when
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H", "%Y-%m-%d"):
        try:
            import calendar
            return float(calendar.timegm(time.strptime(text.strip().removesuffix("Z"), fmt)))
        except ValueError:
            continue
    raise UsageError(f"{flag}: {text!r} is neither a duration (30m, 12h, 7d, 2w) nor a UTC time (2026-12-01T19)",
                     _HINT)


def cmd_usage(args: argparse.Namespace) -> int:
    import asyncio

    from coordinator.security import etcd_auth
    try:
        security = etcd_auth.from_args(args)
    except ValueError as e:
        raise UsageError(str(e), _HINT) from e
    now = time.time()
    since = parse_when(args.since, "--since", now)
    until = parse_when(args.until, "--until", now) if args.until else now
    if until <= since:
        raise UsageError("--until: the window ends before it starts", _HINT)
    if args.lease is not None:
        from coordinator.keys import valid_name
        if not valid_name(args.lease):
            raise UsageError(f"--lease: {quote(args.lease)} is not a lease id", _HINT)
        return asyncio.run(_lease(args, security))
    rows = asyncio.run(_read(args, security, since, until))
    _print(args, rows, since, until)
    return 0


async def _lease(args: argparse.Namespace, security: Any) -> int:
    """One lease id's records, oldest first: when it was granted and ended (revisions and times), how it
    ended, what it used."""
    import grpc

    from coordinator import errors
    from coordinator.etcd.store import Store
    from coordinator.keys import Keys
    keys = Keys(args.prefix)
    store = Store(args.etcd.split(","), timeout=3.0, retry_for=0.0, security=security)
    try:
        await store.connect()
        kvs = (await store.get_prefix(keys.usage_record(args.lease + "@"))).kvs
    except (errors.GpucoordError, grpc.RpcError, OSError) as e:
        raise CliError(f"cannot reach etcd at {args.etcd} ({getattr(e, 'message', e)})",
                       "is etcd running? give its address with --etcd HOST:PORT", EXIT_UNREACHABLE) from e
    finally:
        await store.close()
    docs = sorted((json.loads(kv.value) for kv in kvs), key=lambda d: int(d["start_revision"]))
    if not docs:
        raise CliError(f"lease {args.lease} has no usage record", "it is still held, never ended, or its record "
                       "is past the retention (usage_retention_s)")
    if args.json or args.csv:
        print(json.dumps(docs))
        return 0
    for d in docs:
        print(f"lease {d['lease_id']} of {d['agent']} (team {d['team']}) on {d['host']} GPUs "
              f"{','.join(str(i) for i in d['gpu_indexes'])}: granted at revision {d['start_revision']} "
              f"({_iso(d['start_unix'])}), ended by {d['reason']} at revision {d['end_revision']} "
              f"({_iso(d['end_unix'])}); {d['gpu_seconds']:g} GPU-s, {d['vram_mib_seconds']:g} VRAM MiB-s")
    return 0


async def _read(args: argparse.Namespace, security: Any, since: float, until: float) -> dict[str, dict[str, Any]]:
    import grpc

    from coordinator import errors
    from coordinator.etcd.store import Store
    from coordinator.keys import Keys
    from coordinator.policy.accounting import (
        UsageRecord,
        hour_of,
        hour_start,
        totals_from_records,
        totals_from_rollups,
    )
    keys = Keys(args.prefix)
    store = Store(args.etcd.split(","), timeout=3.0, retry_for=0.0, security=security)
    try:
        await store.connect()
        if args.by == "host":
            kvs = (await store.get_prefix(keys.usage_records())).kvs
            records = [UsageRecord.from_json(json.loads(kv.value)) for kv in kvs]
            totals = totals_from_records(records, "host", since, until)
        else:
            first = hour_of(since)
            kvs = (await store.get_prefix(keys.usage_rollups())).kvs
            rollups = []
            for kv in kvs:
                _, parts = keys.parse(kv.key)
                hour, team = parts[1], parts[2]
                # Whole hours: every hour that overlaps the window.
                if first <= hour and hour_start(hour) < until:
                    rollups.append((hour, team, json.loads(kv.value)))
            totals = totals_from_rollups(rollups, args.by)
    except (errors.GpucoordError, grpc.RpcError, OSError) as e:
        raise CliError(f"cannot reach etcd at {args.etcd} ({getattr(e, 'message', e)})",
                       "is etcd running? give its address with --etcd HOST:PORT", EXIT_UNREACHABLE) from e
    finally:
        await store.close()
    return {name: t.row() for name, t in sorted(totals.items())}


def _iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _print(args: argparse.Namespace, rows: dict[str, dict[str, Any]], since: float, until: float) -> None:
    if args.json:
        print(json.dumps({"by": args.by, "since": _iso(since), "until": _iso(until),
                          "rows": [{args.by: name, **row} for name, row in rows.items()]}))
        return
    if args.csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow([args.by, *CSV_COLUMNS])
        for name, row in rows.items():
            w.writerow([name, *(row[f] for f in _FIELDS)])
        return
    header = [args.by.upper(), "GPU-HOURS", "VRAM-GIB-HOURS", "EVICTIONS", "LEASES", "CAUSED", "IDLE-GPU-HOURS"]
    table = [header, *([name, *(f"{row[f]:g}" if isinstance(row[f], float) else str(row[f]) for f in _FIELDS)]
                       for name, row in rows.items())]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print(f"usage of the leases that ended, {_iso(since)} to {_iso(until)}")
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
