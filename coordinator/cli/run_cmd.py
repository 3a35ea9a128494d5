"""``gpucoord run``: put a command under a lease (the flags checked here, before anything is sent; the
supervision itself is ``agent_client.command``)."""
from __future__ import annotations

import argparse
import asyncio
import socket

from coordinator.cli.common import UsageError, _client_tls, _setup_logging
from coordinator.cli.gangs import check_gang_flags
from coordinator.limits import quote


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
    from coordinator.keys import valid_name

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if not cmd:
            raise ValueError("a command is needed after --, e.g. gpucoord run --agent a --vram 1GiB -- python x.py")
        if args.exclusive and args.vram is not None:
            raise ValueError("--vram: not with --exclusive (the lease takes each GPU's whole usable VRAM)")
        if not args.exclusive and args.vram is None:
            raise ValueError("--vram: required (or --exclusive for whole GPUs)")
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
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord run --help'") from e
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
