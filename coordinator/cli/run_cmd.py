"""``gpucoord run``: put a command under a lease, or (``--join``) under one host's part of a lease another session
holds (the flags declared and checked here, before anything is sent; the supervision itself is
``agent_client.command``)."""
from __future__ import annotations

import argparse
import asyncio
import socket

from coordinator.cli.common import UsageError, _client_tls, _setup_logging, duration
from coordinator.cli.gangs import add_gang_flags, check_gang_flags
from coordinator.limits import quote

RUN_HELP = ("run a command under a VRAM lease: GPU by uuid, partition limits, SIGTERM on eviction notice, SIGKILL at "
            "the deadline or when the lease is lost; --join: under one host's part of a multi-host lease")
RUN_USAGE = ("gpucoord run --agent NAME [--host H] (--vram SIZE | --exclusive | --join LEASE_ID [--rank R]) "
             "[--gpus N] [options] -- CMD [ARGS...]")

# The flags that shape an acquire, with their defaults: --join acquires nothing, so none of them goes with it.
_ACQUIRE_FLAGS = {"vram": None, "exclusive": False, "gpu": None, "gpus": 1, "topology": "any", "priority": 0,
                  "min_runtime": 0.0, "time_limit": 0.0, "signal_before": 0.0, "no_preemptible": False, "wait": 0.0,
                  "hosts": 1, "same": "", "prefer": ""}


def add_run_arguments(ru: argparse.ArgumentParser) -> None:
    """``gpucoord run``'s flags (docs/agents.md, "gpucoord run" and "Joining a multi-host lease")."""
    ru.add_argument("--agent", required=True)
    ru.add_argument("--host", default=None, help="this host's name in gpucoord (default: the hostname)")
    ru.add_argument("--vram", default=None, help="VRAM to lease (per GPU), with a unit: 4096MiB, 24GiB")
    ru.add_argument("--gpu", default=None, help="GPU index or uuid (default: best fit)")
    ru.add_argument("--gpus", type=int, default=1, metavar="N",
                    help="lease N GPUs at once, all or nothing (CUDA_VISIBLE_DEVICES lists their uuids)")
    ru.add_argument("--exclusive", action="store_true", help="whole GPUs, shared with no other lease (no --vram)")
    add_gang_flags(ru)
    ru.add_argument("--topology", default="any", choices=("any", "numa", "nvlink"),
                    help="how the GPUs must be joined: any, numa (one NUMA node), nvlink (every pair)")
    ru.add_argument("--priority", type=int, default=0)
    ru.add_argument("--min-runtime", type=float, default=0.0, metavar="SECONDS",
                    help="teams: run this long before another team may reclaim the lease while it is over its "
                         "team's quota (capped by the team's maximum)")
    ru.add_argument("--time", type=duration, default=0.0, metavar="DURATION", dest="time_limit",
                    help="time limit: the lease is revoked this long after its grant (90, 90s, 5m, 2h; default: "
                         "none, or the fleet's default)")
    ru.add_argument("--signal-before", type=duration, default=0.0, metavar="DURATION",
                    help="with --time: the eviction notice (SIGTERM to CMD) comes this long before the end "
                         "(default: the fleet's time_limit_warning_s, 120 s)")
    ru.add_argument("--no-preemptible", action="store_true", help="never evict this lease for another request")
    ru.add_argument("--wait", type=float, default=0.0, help="queue up to this many seconds for the VRAM")
    ru.add_argument("--join", default=None, metavar="LEASE_ID",
                    help="acquire nothing: run CMD on this host's part of a lease of the same agent (a multi-host "
                         "gang's rank), with its GPUs, GPUCOORD_RANK/GPUCOORD_HOSTS and torchrun's PET_* variables")
    ru.add_argument("--rank", type=int, default=None, metavar="R",
                    help="with --join: the rank to run, whose host must be --host (default: this host's rank)")
    ru.add_argument("--kill-after", type=float, default=None,
                    help="on an eviction notice, SIGKILL this long after SIGTERM (never later than the deadline)")
    ru.add_argument("--cgroup-root", default=None,
                    help="a writable cgroup v2 directory (e.g. a delegated systemd slice) for memory.max and cpu.max")
    ru.add_argument("--ttl", type=int, default=None, help="session TTL, seconds (default: the coordinator's)")
    ru.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def _vram_mb(text: str) -> int:
    """``--vram``: a size (docs/cli.md, "Sizes": ``1GiB``, ``4096MiB``, ``1.5GB``; a number without a unit is bytes),
    rounded up to whole MiB; 0 and anything under 1 MiB are refused."""
    from coordinator.policy.partition import PartitionError, parse_mib
    try:
        n = parse_mib(text, "--vram", round_up=True)
    except PartitionError as e:
        raise ValueError(str(e)) from None
    if n <= 0:
        raise ValueError("--vram: must be more than 0")
    return n


def _check_run_numbers(args: argparse.Namespace) -> None:
    """``run``'s numbers within the bounds the coordinator holds them to (docs/guarantees.md, "Limits"): ValueError
    naming the flag, before anything is sent."""
    from coordinator.limits import MAX_PRIORITY, MAX_TTL_S, MAX_WAIT_S, MIN_TTL_S
    from coordinator.policy.team_fields import MAX_MIN_RUNTIME_S
    if not -MAX_PRIORITY <= args.priority <= MAX_PRIORITY:
        raise ValueError(f"--priority: must be within [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    if not 0 <= args.wait <= MAX_WAIT_S:
        raise ValueError(f"--wait: must be within [0, {MAX_WAIT_S:g}] seconds")
    if not 0 <= args.min_runtime <= MAX_MIN_RUNTIME_S:
        raise ValueError(f"--min-runtime: must be within [0, {MAX_MIN_RUNTIME_S:g}] seconds")
    from coordinator.limits import MAX_TIME_LIMIT_S
    for flag, value in (("--time", args.time_limit), ("--signal-before", args.signal_before)):
        if value > MAX_TIME_LIMIT_S:
            raise ValueError(f"{flag}: must be at most {MAX_TIME_LIMIT_S:g} seconds (30 days)")
    if args.ttl is not None and not MIN_TTL_S <= args.ttl <= MAX_TTL_S:
        raise ValueError(f"--ttl: must be within [{MIN_TTL_S}, {MAX_TTL_S}] seconds")
    if args.gpu is not None and args.gpus > 1:
        raise ValueError(f"--gpu: names one GPU, but --gpus is {args.gpus} (leave --gpu out: the GPUs are chosen)")


def cmd_run(args: argparse.Namespace) -> int:
    from agent_client.command import run_command

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if not cmd:
            raise ValueError("a command is needed after --, e.g. gpucoord run --agent a --vram 1GiB -- python x.py")
        joining = args.join is not None or args.rank is not None
        vram_mb, host = (0, _check_join(args)) if joining else _check_acquire(args)
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord run --help'") from e
    if joining:
        return _run_join(args, host, cmd)
    tls = _client_tls(args)
    if args.verbose:
        _setup_logging(True)
    return asyncio.run(run_command(
        args.coordinator, args.agent, host, cmd, vram_mb, ttl=args.ttl, gpu=args.gpu, priority=args.priority,
        gpu_count=args.gpus, exclusive=args.exclusive, topology=args.topology, min_runtime=args.min_runtime,
        time_limit=args.time_limit, time_limit_warning=args.signal_before,
        preemptible=not args.no_preemptible, wait=args.wait, kill_after=args.kill_after,
        cgroup_root=args.cgroup_root, tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
        tls_key=tls.key if tls else None, hosts=args.hosts, same=args.same, prefer=args.prefer))


def _check_acquire(args: argparse.Namespace) -> tuple[int, str]:
    """``run``'s flags of an acquire: ValueError naming the flag; else the VRAM (MiB) and the session's host."""
    from coordinator.keys import valid_name
    if args.exclusive and args.vram is not None:
        raise ValueError("--vram: not with --exclusive (the lease takes each GPU's whole usable VRAM)")
    if not args.exclusive and args.vram is None:
        raise ValueError("--vram: required (or --exclusive for whole GPUs, or --join LEASE_ID for a part of a lease)")
    if not 1 <= args.gpus <= 64:
        raise ValueError("--gpus: must be within [1, 64]")
    vram_mb = 0 if args.exclusive else _vram_mb(args.vram)
    host = args.host or socket.gethostname()
    for field, value in (("--agent", args.agent), ("--host", host), ("--gpu", args.gpu or "0")):
        if not valid_name(value):
            raise ValueError(f"{field}: {quote(value)} is not a valid name")
    if args.kill_after is not None and not 0 <= args.kill_after <= 3600:
        raise ValueError("--kill-after: must be within [0, 3600] seconds")
    _check_run_numbers(args)
    check_gang_flags(args)
    return vram_mb, host


def _check_join(args: argparse.Namespace) -> str:
    """``run --join LEASE_ID [--rank R]``'s flags: ValueError naming the flag; else the session's host."""
    from coordinator.keys import valid_name

    if args.join is None:
        raise ValueError("--rank: only with --join LEASE_ID")
    for flag, default in _ACQUIRE_FLAGS.items():
        if getattr(args, flag) != default:
            raise ValueError(f"--{flag.replace('_', '-') if flag != 'time_limit' else 'time'}: not with --join "
                             "(the lease is acquired already; --join runs on its part)")
    host = args.host or socket.gethostname()
    for field, value in (("--agent", args.agent), ("--host", host), ("--join", args.join)):
        if not valid_name(value):
            raise ValueError(f"{field}: {quote(value)} is not a valid name")
    from coordinator.records import MAX_GANG_HOSTS
    if args.rank is not None and not 0 <= args.rank < MAX_GANG_HOSTS:
        raise ValueError(f"--rank: must be within [0, {MAX_GANG_HOSTS - 1}]")
    if args.kill_after is not None and not 0 <= args.kill_after <= 3600:
        raise ValueError("--kill-after: must be within [0, 3600] seconds")
    from coordinator.limits import MAX_TTL_S, MIN_TTL_S
    if args.ttl is not None and not MIN_TTL_S <= args.ttl <= MAX_TTL_S:
        raise ValueError(f"--ttl: must be within [{MIN_TTL_S}, {MAX_TTL_S}] seconds")
    return host


def _run_join(args: argparse.Namespace, host: str, cmd: list[str]) -> int:
    from agent_client.command import join_command
    tls = _client_tls(args)
    if args.verbose:
        _setup_logging(True)
    return asyncio.run(join_command(
        args.coordinator, args.agent, host, cmd, args.join, args.rank, ttl=args.ttl, kill_after=args.kill_after,
        cgroup_root=args.cgroup_root, tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
        tls_key=tls.key if tls else None))
