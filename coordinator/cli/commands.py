"""The commands behind ``gpucoord``'s subcommands: each takes the parsed arguments and returns an exit status
(or raises ``CliError``); ``cli/main.py`` parses and runs them."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from coordinator.cli.common import (
    DEFAULT_ETCD,
    EXIT_HOST_TAKEN,
    EXIT_UNREACHABLE,
    CliError,
    UsageError,
    _client_tls,
    _env,
    _ready_line,
    _run_until_signal,
    _setup_logging,
    _stub,
    check_name,
    fetch_status,
    host_overrides,
    rpc_error,
)
from coordinator.cli.render import render_partition, render_status

if TYPE_CHECKING:
    from coordinator.etcd.store import Store

_TLS_HINT = "give readable PEM files with --tls-ca, --tls-cert and --tls-key (or GPUCOORD_TLS_CA/CERT/KEY)"


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator import errors
    from coordinator.config import ConfigError, CoordinatorConfig
    from coordinator.heap import FreezingCollector
    from coordinator.rpc.coordinator_server import serve
    from coordinator.security.tls import TlsError

    flags = {"etcd": args.etcd, "listen": args.listen, "advertise": args.advertise, "prefix": args.prefix,
             "metrics_listen": args.metrics_listen,
             "session_ttl_s": args.session_ttl, "eviction_grace_s": args.grace,
             "eviction_kill_margin_s": args.eviction_kill_margin, "max_time_limit_s": args.max_time_limit,
             "etcd_max_txn_ops": args.etcd_max_txn_ops,
             "default_time_limit_s": args.default_time_limit, "time_limit_warning_s": args.time_limit_warning,
             "idle_after_s": args.idle_after, "idle_below_pct": args.idle_below, "idle_action": args.idle_action,
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
    FreezingCollector().install()   # full garbage collections that follow the growth, not the heap (heap.py)
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
    from coordinator import errors
    from coordinator.etcd.store import Store
    from coordinator.host_records import parse_labels
    from coordinator.keys import Keys, valid_name
    from coordinator.node.daemon import MAX_DISK_PATH, quote_prefix
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source
    from coordinator.node.registration import HostTaken
    from coordinator.rpc.node_server import run_node
    from coordinator.security import etcd_auth, tls

    coordinators = [a.strip() for a in (args.coordinator or "").split(",") if a.strip()]
    try:
        tls_files = tls.from_args(args)
        etcd_security = etcd_auth.from_args(args)
        if coordinators and (args.etcd is not None or not etcd_security.empty):
            raise ValueError("--coordinator: a node daemon that talks to coordinators needs no etcd endpoints or "
                             "credentials (--etcd, --etcd-*): give one mode")
        if coordinators and args.fake_hosts:
            raise ValueError("--fake-hosts: only with --etcd (benchmarks write the simulated hosts to etcd directly)")
        if args.coordinator is not None and not coordinators:
            raise ValueError("--coordinator: give at least one HOST:PORT")
        for address, what in ((args.listen, "--listen"), (args.metrics_listen, "--metrics-listen")):
            error = tls.listen_error(address, tls_files, bool(args.insecure), what) if address else None
            if error:
                raise ValueError(error)
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord node --help' and docs/security.md, \"Running securely\"") from e
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
                         "e.g. --fake-gpus 4x80GiB, 2x24GiB,1x80GiB or 8x80GiB:numa=0-3,4-7:nvlink=0-3,4-7") from e
    try:
        overrides = host_overrides(args.fake_cpus, args.fake_mem, args.fake_disk)
        overrides["labels"] = parse_labels(args.label)
        if args.label and args.fake_hosts:
            raise ValueError("--label: not with --fake-hosts (the benchmarks' simulated hosts carry no labels)")
        from coordinator.limits import (
            MAX_HEARTBEAT_S,
            MAX_TTL_S,
            MIN_HEARTBEAT_S,
            MIN_TTL_S,
            quote,
        )
        from coordinator.node.enforce import Enforcer
        from coordinator.policy.partition import PartitionError, parse_mib
        try:
            tolerance_mb = parse_mib(args.over_use_tolerance, "--over-use-tolerance")
        except PartitionError as e:
            raise ValueError(str(e)) from None
        if not 0 <= args.untracked_grace < math.inf:
            raise ValueError("--untracked-grace: must be a finite number of seconds >= 0, "
                             f"got {quote(args.untracked_grace)}")
        if not MIN_TTL_S <= args.ttl <= MAX_TTL_S:
            raise ValueError(f"--ttl: must be within [{MIN_TTL_S}, {MAX_TTL_S}] seconds, got {quote(args.ttl)}")
        if not MIN_HEARTBEAT_S <= args.heartbeat <= MAX_HEARTBEAT_S:
            raise ValueError(f"--heartbeat: must be within [{MIN_HEARTBEAT_S:g}, {MAX_HEARTBEAT_S:g}] seconds, "
                             f"got {quote(args.heartbeat)}")
        enforcer = Enforcer(args.enforce, tolerance_mb, args.untracked_grace)
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord node --help'") from e
    _setup_logging(args.verbose)
    store: Store | None = None
    if not coordinators:
        logging.getLogger("gpucoord.node").warning(
            "this node daemon talks to etcd directly (--etcd), as nodes of earlier releases did; run it with "
            "--coordinator ADDR[,ADDR...] and no etcd credentials (docs/etcd.md \"Upgrading node daemons\")")
        store = Store((args.etcd or _env("ETCD", DEFAULT_ETCD)).split(","), timeout=3.0, security=etcd_security)
        if args.fake_hosts:
            return _fake_hosts(args, store, host)
    try:
        _run_until_signal(lambda stop: run_node(store, Keys(args.prefix), host, args.listen, source, args.disk_path,
                                                args.ttl, stop, ready=lambda p: _ready_line("node", p),
                                                metrics_listen=args.metrics_listen, heartbeat_s=args.heartbeat,
                                                overrides=overrides, enforcer=enforcer, tls=tls_files,
                                                insecure=bool(args.insecure), advertise=args.advertise,
                                                coordinators=coordinators))
    except HostTaken as e:
        raise CliError(e.message, "stop it first, or give this daemon another --host", EXIT_HOST_TAKEN) from e
    except errors.Unavailable as e:
        hint = ("is a coordinator running there? give its addresses with --coordinator HOST:PORT[,...]" if coordinators
                else "is etcd running? give its endpoints with --etcd HOST:PORT")
        raise CliError(f"the node daemon could not start: {e.message}", hint, EXIT_UNREACHABLE) from e
    except (errors.InvalidArgument, errors.NotOwner) as e:   # refused by the coordinator
        raise CliError(f"the node daemon could not start: {e.message}",
                       "a node's certificate must be gpucoord://node/HOST for its --host") from e
    except tls.TlsError as e:   # an unreadable certificate or key
        raise CliError(f"the node daemon could not start: {e}", _TLS_HINT) from e
    except (OSError, RuntimeError) as e:   # a port in use (no SO_REUSEPORT: never shared)
        raise CliError(f"the node daemon could not start: {e}",
                       "is the port taken by another process? choose another with --listen or --metrics-listen "
                       "(port 0 picks a free one)") from e
    return 0


def _fake_hosts(args: argparse.Namespace, store: Store, prefix: str) -> int:
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
    if args.host:
        check_name("--host", args.host, "status")
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
        gangs: dict[str, list[tuple[int, str]]] = {}   # lease id -> (GPU index, uuid) of a gang's records
        for kv in snap.kvs:
            try:
                doc = json.loads(kv.value)
                value = json.dumps(doc, sort_keys=True)
            except ValueError:
                doc, value = None, repr(kv.value)
            lease = f" etcd_lease={kv.etcd_lease:x}" if kv.etcd_lease else ""
            print(f"{kv.key.decode()}  (mod_revision={kv.mod_revision}{lease})\n    {value}")
            if isinstance(doc, dict) and isinstance(doc.get("gang"), list) and len(doc["gang"]) > 1:
                gangs.setdefault(str(doc.get("id")), []).append((int(doc.get("gpu_index", -1)),
                                                                 str(doc.get("gpu_uuid"))))
        for lease_id, parts in sorted(gangs.items()):
            parts.sort()
            print(f"# gang lease {lease_id}: one lease over GPUs {','.join(str(i) for i, _ in parts)} "
                  f"({', '.join(u for _, u in parts)}), one record per GPU above")
        print(f"# {len(snap.kvs)} keys at revision {snap.revision}")
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
            except OSError as e:
                raise CliError(f"{args.file}: {e}", "give a readable TOML file") from e
            except PartitionError as e:    # a bad value in the file: refused before anything is sent
                raise UsageError(f"{args.file}: {e}", "fix the spec and apply it again") from e
            # With --evict the coordinator waits for the offenders to go (up to their grace period).
            resp = stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(spec.to_json()),
                                                                dry_run=args.dry_run, evict=args.evict),
                                       timeout=3600 if args.evict else 15)
            doc = json.loads(resp.partition_json)
            print(json.dumps(doc, indent=2) if args.json else render_partition(doc), flush=True)
            print("applied" if resp.applied else "dry run: valid, nothing written", file=sys.stderr)
        else:
            check_name("host", args.host, "partition show")
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
    from coordinator.limits import MAX_GRACE_S, MAX_REASON_BYTES
    check_name("id", args.id, f"lease {args.lease_cmd}")
    if args.lease_cmd == "show":
        from coordinator.cli.lease_show import cmd_lease_show
        return cmd_lease_show(args)
    if args.lease_cmd == "evict":
        if args.grace is not None and not 0 <= args.grace <= MAX_GRACE_S:
            raise UsageError(f"--grace: must be within [0, {MAX_GRACE_S:g}] seconds", "see 'gpucoord lease evict --help'")
        if len(args.reason.encode("utf-8", "surrogatepass")) > MAX_REASON_BYTES:
            raise UsageError(f"--reason: at most {MAX_REASON_BYTES} bytes", "see 'gpucoord lease evict --help'")
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
                               "'gpucoord status' lists the live leases", refused=True)
            if resp.processes:
                print("revoking: the lease is bound to processes; its holder was told to SIGKILL them, and the "
                      "lease ends (its VRAM free) once the node reports them gone, or at the coordinator's kill "
                      "margin")
            else:
                print("revoked")
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from coordinator.cli.bench import main as bench_main
    return bench_main(args)


def _cmd_up(args: argparse.Namespace) -> int:
    from coordinator.cli.up import cmd_up
    return cmd_up(args)
