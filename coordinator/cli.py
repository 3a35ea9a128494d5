"""``gpucoord``: up, coordinator, node, status, partition, lease, keys, bench."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

DEFAULT_COORDINATOR = "127.0.0.1:7070"
DEFAULT_ETCD = "127.0.0.1:2379"


def _env(name: str, default: str) -> str:
    return os.environ.get(f"GPUCOORD_{name}", default)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _run_until_signal(main: Any) -> None:
    """Run ``main(stop_event)`` until SIGINT/SIGTERM sets the event."""
    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)
    asyncio.run(runner())


def _ready_line(kind: str, port: int) -> None:
    print(f"READY {kind} port={port}", flush=True)


# -- coordinator / node ---------------------------------------------------------------------------
def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.config import ConfigError, CoordinatorConfig
    from coordinator.server import serve

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
    from coordinator.node.daemon import run_node
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source
    from coordinator.security import etcd_auth, tls
    from coordinator.store import Store

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
        print(f"gpucoord node: --host {host!r} is not a valid host name", file=sys.stderr)
        return 2
    try:
        source = open_gpu_source(args.fake_gpus, host)
    except NvmlUnavailable as e:
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"gpucoord node: --fake-gpus: {e}", file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {}
    try:
        from coordinator.partition import PartitionError, parse_size
        if args.fake_cpus is not None:
            if args.fake_cpus < 1:
                raise ValueError("--fake-cpus: must be >= 1")
            overrides.update(cpu_count=args.fake_cpus, core_ids=tuple(range(args.fake_cpus)))
        if args.fake_mem is not None:
            overrides["mem_bytes"] = parse_size(args.fake_mem, "--fake-mem")
        if args.fake_disk is not None:
            overrides["disk_bytes"] = parse_size(args.fake_disk, "--fake-disk")
    except (ValueError, PartitionError) as e:
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 2
    _setup_logging(args.verbose)
    store = Store(args.etcd.split(","), timeout=3.0, security=etcd_security)
    try:
        _run_until_signal(lambda stop: run_node(store, Keys(args.prefix), host, args.listen, source,
                                                args.disk_path, args.ttl, stop, ready=lambda p: _ready_line("node", p),
                                                metrics_listen=args.metrics_listen, heartbeat_s=args.heartbeat,
                                                overrides=overrides, tls=tls_files, insecure=bool(args.insecure)))
    except (OSError, ValueError) as e:   # a port in use (no SO_REUSEPORT: never shared), unreadable TLS files
        print(f"gpucoord node: {e}", file=sys.stderr)
        return 1
    return 0


# -- operator commands ----------------------------------------------------------------------------
def _stub(address: str, tls: Any = None) -> Any:
    from coordinator.api import coordinator_pb2_grpc as pb_grpc
    from coordinator.security.tls import sync_channel
    return pb_grpc.CoordinatorStub(sync_channel(address, tls))


def _client_tls(args: argparse.Namespace) -> Any:
    """The operator's TLS files: --tls-* flags, else GPUCOORD_TLS_CA/CERT/KEY."""
    from coordinator.security.tls import from_args
    return from_args(args)


def _fail(e: Any) -> int:
    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def fetch_status(address: str, host: str = "", tls: Any = None) -> dict[str, Any]:
    from google.protobuf import json_format

    from coordinator.api import coordinator_pb2 as pb
    resp = _stub(address, tls).GetStatus(pb.GetStatusRequest(host=host), timeout=10)
    doc: dict[str, Any] = json_format.MessageToDict(resp, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True)
    return doc


def _mib(mb: int) -> str:
    return f"{mb / 1024:.1f}G" if abs(mb) >= 1024 else f"{mb}M"


def render_status(doc: dict[str, Any]) -> str:
    """The operator's table: hosts, GPUs (total, leased, used, untracked, free), partitions, leases, queue."""
    lines = [f"revision {doc.get('revision', 0)}  leader {doc.get('leader') or 'none'}"]
    for h in doc.get("hosts", []):
        age = float(h.get("usage_age_seconds", -1))
        state = "alive" if h.get("alive") else "GONE (no new admissions)"
        sim = " simulated" if h.get("simulated") else ""
        lines.append(f"host {h['host']} {state}{sim}  addr={h.get('address', '')}  partition={h.get('partition_mode')}"
                     f"  usage age={'n/a' if age < 0 else f'{age:.1f}s'}")
        lines.append(f"  {'GPU':>3} {'uuid':<24} {'total':>8} {'usable':>8} {'leased':>8} {'used':>8} "
                     f"{'untracked':>9} {'free':>8} {'token':>6}")
        for g in h.get("gpus", []):
            used = int(g.get("used_mb", -1))
            lines.append(f"  {g['index']:>3} {g['uuid'][:24]:<24} {_mib(int(g['total_mb'])):>8} "
                         f"{_mib(int(g['usable_mb'])):>8} {_mib(int(g['leased_mb'])):>8} "
                         f"{'n/a' if used < 0 else _mib(used):>8} {_mib(int(g['untracked_mb'])):>9} "
                         f"{_mib(int(g['free_mb'])):>8} {g.get('seq', 0):>6}")
        if h.get("agents") and h.get("partition_mode") != "shared":
            lines.append("  partition:")
            for a in h["agents"]:
                alloc = json.loads(a["allocation_json"])
                caps = ", ".join(f"{u[-6:]}:{_mib(c)}" for u, c in alloc.get("vram_caps_mb", []))
                lines.append(f"    {a['agent']:<16} cores={len(alloc.get('cores', []))} "
                             f"mem={int(alloc.get('mem_bytes', 0)) / 2**30:.1f}GiB "
                             f"gpus={len(alloc.get('whole_gpus', []))} caps=[{caps}] "
                             f"leased={_mib(int(a.get('leased_mb', 0)))} ({a.get('leases', 0)} leases)")
        if h.get("leases"):
            lines.append(f"  {'lease':<20} {'agent':<14} {'GPU':>3} {'vram':>8} {'prio':>5} {'pre':>3} "
                         f"{'token':>6} {'ttl':>4}")
            for lease in sorted(h["leases"], key=lambda x: (x["gpu_index"], int(x["token"]))):
                lines.append(f"  {lease['id']:<20} {lease['agent']:<14} {lease['gpu_index']:>3} "
                             f"{_mib(int(lease['vram_mb'])):>8} {lease['priority']:>5} "
                             f"{'y' if lease['preemptible'] else 'n':>3} {lease['token']:>6} "
                             f"{lease.get('ttl_remaining', '?'):>4}")
        else:
            lines.append("  no leases")
        for q in h.get("queue", []):
            lines.append(f"  waiting: {q['agent']} {_mib(int(q['vram_mb']))} priority {q['priority']}"
                         f" gpu={q.get('gpu') or 'any'}")
    if not doc.get("hosts"):
        lines.append("no hosts registered")
    return "\n".join(lines)


def _ranges(ids: Sequence[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out: list[str] = []
    for i in sorted(ids):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        elif out and "-" not in out[-1] and int(out[-1]) == i - 1:
            out[-1] = f"{out[-1]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "-"


def render_partition(doc: dict[str, Any]) -> str:
    """One line per agent: cores, memory, disk, whole GPUs and VRAM caps."""
    lines = [f"host {doc['host']}: mode {doc['mode']}, VRAM headroom {doc.get('headroom_mb', 0)} MiB per GPU"]
    for a in doc.get("allocations", []):
        whole = ", ".join(a["whole_gpus"]) or "none"
        caps = ", ".join(f"{u} {c} MiB" for u, c in a["vram_caps_mb"]) or "none"
        lines.append(f"  {a['agent']}: cores {_ranges(a['cores'])} ({len(a['cores'])}), "
                     f"mem {a['mem_bytes']} B, disk {a['disk_bytes']} B")
        lines.append(f"    whole GPUs: {whole}")
        lines.append(f"    VRAM caps:  {caps}")
    if not doc.get("allocations"):
        r = (doc.get("spec") or {}).get("reserved", {})
        lines.append(f"  any agent: the whole host minus reserved (cpu {r.get('cpu', 0)}, mem {r.get('mem', 0)} B, "
                     f"disk {r.get('disk', 0)} B); every GPU with a cap of total - headroom")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    import grpc
    try:
        doc = fetch_status(args.coordinator, args.host or "", _client_tls(args))
    except grpc.RpcError as e:
        return _fail(e)
    print(json.dumps(doc, indent=2) if args.json else render_status(doc))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from coordinator.security import etcd_auth
    from coordinator.store import Store
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

    from coordinator.api import coordinator_pb2 as pb
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        if args.partition_cmd == "apply":
            from coordinator.partition import PartitionError, load_spec_file
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

    from coordinator.api import coordinator_pb2 as pb
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


def cmd_bench(args: argparse.Namespace) -> int:
    from coordinator.bench import main as bench_main
    return bench_main(args)


# -- up -------------------------------------------------------------------------------------------
class Child:
    """A child process that prints ``READY <kind> port=N`` once it serves."""

    def __init__(self, kind: str, argv: Sequence[str], log_path: pathlib.Path) -> None:
        self.kind = kind
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL)
        self.port = 0

    def wait_ready(self, timeout: float) -> int:
        import selectors
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline().decode()
                if line.startswith(f"READY {self.kind} port="):
                    self.port = int(line.split("port=")[1])
                    return self.port
                if not line and self.proc.poll() is not None:
                    break
            elif self.proc.poll() is not None:
                break
        raise RuntimeError(f"{self.kind} did not start (exit {self.proc.poll()}); log {self.log_path}:\n"
                           + self.log_path.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def cmd_up(args: argparse.Namespace) -> int:
    from coordinator.etcd_process import EtcdCluster, etcd_binary, port_is_free
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source

    fake = args.fake_gpus
    if fake is None:
        try:
            open_gpu_source(None, "probe").close()
            print("NVML found: using the real GPUs")
        except NvmlUnavailable:
            fake = "2x16GiB"
            print(f"NVML not available: simulating GPUs --fake-gpus {fake}")
    data_dir = pathlib.Path(args.data_dir or tempfile.mkdtemp(prefix="gpucoord-up-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    print(f"data directory: {data_dir}")
    secure = None
    if args.secure:
        from coordinator.demo import DEMO_AGENTS
        from coordinator.etcd_process import ClientTls
        from coordinator.security.commands import prepare_secure
        secure = prepare_secure(data_dir, args.host, DEMO_AGENTS if args.demo else (args.agent,))
        print(f"certificates: {secure.dir} (CA {secure.ca})")
    # etcd's usual port when it is free, so that `gpucoord keys` and etcdctl work with their defaults.
    etcd = EtcdCluster(1, base_dir=data_dir, client_port=2379 if port_is_free(2379) else 0,
                       client_tls=None if secure is None else ClientTls(secure.ca, secure.etcd_server.cert,
                                                                        secure.etcd_server.key))
    children: list[Child] = []
    py = sys.executable
    operator_tls = None if secure is None else secure.operator
    try:
        etcd.start()
        ep = etcd.endpoints[0]
        etcdctl = f"{etcd_binary('etcdctl')} --endpoints={ep}"
        coord_extra: list[str] = []
        node_extra: list[str] = []
        if secure is not None:
            from coordinator.security.etcd_auth import setup_roles
            asyncio.run(setup_roles(ep, secure.etcd_security(secure.etcd_root), "/gpucoord/", [args.host]))
            etcdctl += (f" --cacert={secure.ca} --cert={secure.etcd_root.cert} --key={secure.etcd_root.key}")
            coord_extra = secure.tls_flags(secure.coordinator) + secure.etcd_flags(secure.coordinator)
            node_extra = secure.tls_flags(secure.node) + secure.etcd_flags(secure.node)
            print("etcd:        client-certificate TLS, auth enabled (users root, gpucoord-coordinator, "
                  f"gpucoord-operator, gpucoord-node-{args.host})")
        print(f"etcd:        {ep}   (etcdctl: {etcdctl} get --prefix /gpucoord/)")
        coord = Child("coordinator", [py, "-m", "coordinator.cli", "coordinator", "--etcd", ep,
                                      "--listen", args.listen, "--metrics-listen", "127.0.0.1:0",
                                      "--session-ttl", str(args.session_ttl), *coord_extra],
                      data_dir / "coordinator.log")
        children.append(coord)
        cport = coord.wait_ready(30)
        caddr = f"127.0.0.1:{cport}"
        print(f"coordinator: {caddr}   (log {coord.log_path})")
        node_argv = [py, "-m", "coordinator.cli", "node", "--etcd", ep, "--host", args.host,
                     "--listen", args.node_listen, *node_extra]
        if fake:
            node_argv += ["--fake-gpus", fake]
        node = Child("node", node_argv, data_dir / "node.log")
        children.append(node)
        nport = node.wait_ready(30)
        print(f"node:        127.0.0.1:{nport} host={args.host}   (log {node.log_path})")
        _wait_host(caddr, args.host, 15, operator_tls)
        print(render_status(fetch_status(caddr, tls=operator_tls)))
        if secure is not None:
            print("\nmTLS is on. An agent needs these three variables (agent_client reads them):")
            for name, files in secure.agents.items():
                print(f"  # gpucoord://agent/{name}")
                print("  " + " ".join(f"export {k}={v}" for k, v in files.env().items()))
            print("  # the operator (gpucoord status, partition, lease)")
            print("  " + " ".join(f"export {k}={v}" for k, v in secure.operator.env().items()), flush=True)
        if args.demo:
            from coordinator.demo import run_demo
            run_demo(caddr, args.host, data_dir, tls=operator_tls,
                     agent_tls=None if secure is None else secure.agents)
            if not args.keep:
                print("demo finished; shutting down")
                return 0
        print("gpucoord is up. Press Ctrl-C to stop.", flush=True)
        # Block the signals and wait for one, while watching that the children stay up.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while all(c.proc.poll() is None for c in children):
            if signal.sigtimedwait({signal.SIGINT, signal.SIGTERM}, 0.5) is not None:
                break
        else:
            print("a child process exited; shutting down", file=sys.stderr)
        return 0
    finally:
        for c in reversed(children):
            c.stop()
        etcd.stop()
        print(f"stopped; etcd data kept in {data_dir}")


def _wait_host(caddr: str, host: str, timeout: float, tls: Any = None) -> None:
    import grpc
    deadline = time.monotonic() + timeout
    while True:
        try:
            doc = fetch_status(caddr, host, tls)
            if doc["hosts"] and doc["hosts"][0]["alive"]:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"host {host} did not register within {timeout}s")
        time.sleep(0.1)


# -- parser ---------------------------------------------------------------------------------------
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
    up.set_defaults(fn=cmd_up)

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
    no.add_argument("--heartbeat", type=float, default=5.0,
                    help="usage is rewritten at least this often (seconds); stale after 3 heartbeats")
    no.add_argument("--prefix", default=_env("PREFIX", "/gpucoord/"))
    no.add_argument("--metrics-listen", default="")
    tls_args(no, server=True)
    etcd_args(no)
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

    be = sub.add_parser("bench", help="measure against baselines taken in the same run")
    be.add_argument("what", choices=("acquire", "p7", "all"),
                    help="acquire: P1 (latency ratio) and P2 (raft proposals); p7: eviction-notice and "
                         "release-to-grant latency")
    be.add_argument("--n", type=int, default=300, help="acquire+release pairs to time")
    be.set_defaults(fn=cmd_bench)
    security_parsers(sub, DEFAULT_ETCD)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
