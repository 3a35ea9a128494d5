"""``gpucoord up``: etcd, a coordinator and a node daemon on loopback, as child processes."""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Sequence

from coordinator.cli.common import CliError, UsageError, fetch_status, host_overrides
from coordinator.cli.render import render_status

if TYPE_CHECKING:
    from coordinator.security.tls import TlsFiles


# etcd's --max-txn-ops for the embedded etcd, and the coordinator's etcd_max_txn_ops: room for a multi-host gang
# of more than 7 hosts x 8 GPUs (etcd's default, 128, holds about 7 x 8) in its one transaction, up to what
# etcd's 1.5 MiB request allows (about 19 x 8: docs/agents.md "How large").
UP_MAX_TXN_OPS = 1024


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
        lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1].strip() if lines else "no output"
        raise CliError(f"the {self.kind} did not start (exit {self.proc.poll()}): {last}",
                       f"its log is {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _address(flag: str, value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{flag}: {value!r} is not HOST:PORT", "e.g. 127.0.0.1:7070 (port 0 picks a free one)")
    return host, int(port)


def _check_free(flag: str, value: str) -> str:
    """``value`` with port 0 replaced by a free port; a one-line error naming ``flag`` if it is taken."""
    from coordinator.etcd.process import free_port, port_is_free

    host, port = _address(flag, value)
    if port == 0:
        return f"{host}:{free_port()}"
    if not port_is_free(port, host):
        raise CliError(f"{flag} {value}: the address is already in use",
                       f"is another gpucoord up running? stop it, or choose another address with {flag} "
                       f"(port 0 picks a free one)")
    return value


def cmd_up(args: argparse.Namespace) -> int:
    from coordinator.etcd.process import (
        ClientTls,
        EtcdCluster,
        EtcdOptions,
        choose_etcd,
        port_is_free,
    )
    from coordinator.etcd.versions import MINIMUM_PRODUCTION
    from coordinator.host_records import parse_labels
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source
    from coordinator.policy.partition import PartitionError, parse_size

    try:
        binary = choose_etcd(args.etcd_binary)
        retention = args.etcd_auto_compaction_retention or ("5m" if args.etcd_auto_compaction_mode == "periodic"
                                                             else "10000")
        options = EtcdOptions(args.etcd_auto_compaction_mode, retention, parse_size(args.etcd_quota, "--etcd-quota"),
                              max_txn_ops=UP_MAX_TXN_OPS)
    except (FileNotFoundError, PartitionError, ValueError) as e:
        raise UsageError(str(e), "see 'gpucoord up --help'") from e
    print(f"etcd binary: {binary.describe()}")
    if binary.crash_bugs:
        print(f"WARNING: this etcd has known crash bugs: {'; '.join(binary.crash_bugs)}. gpucoord never sends "
              f"the requests that crash it, but other clients may, and a member killed under load may drift: "
              f"for production run etcd "
              f"{MINIMUM_PRODUCTION} or newer (--etcd-binary PATH or $GPUCOORD_ETCD_BINARY).")

    try:
        host_overrides(args.fake_cpus, args.fake_mem, args.fake_disk)
        parse_labels(args.label)
    except ValueError as e:
        raise UsageError(str(e), "see 'gpucoord up --help'") from e
    # Every address is checked before anything starts, so that a taken port is one clear line.
    if args.etcd_listen is None:
        # etcd's usual port when it is free, so that `gpucoord keys` and etcdctl work with their defaults.
        etcd_host, etcd_port = "127.0.0.1", 2379
        if not port_is_free(etcd_port, etcd_host):
            print("127.0.0.1:2379 is in use (another etcd?): this etcd takes a free port; give one with --etcd-listen")
            etcd_port = 0
    else:
        etcd_host, etcd_port = _address("--etcd-listen", _check_free("--etcd-listen", args.etcd_listen))
        if etcd_host != "127.0.0.1":
            raise UsageError(f"--etcd-listen {args.etcd_listen}: the etcd of 'gpucoord up' listens on 127.0.0.1 only",
                             "give 127.0.0.1:PORT; run etcd yourself for anything else")
    listen = _check_free("--listen", args.listen)
    metrics_listen = _check_free("--metrics-listen", args.metrics_listen)
    node_listen = _check_free("--node-listen", args.node_listen)
    node_metrics_listen = _check_free("--node-metrics-listen", args.node_metrics_listen)

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
        from coordinator.cli.demo import DEMO_AGENTS
        from coordinator.security.commands import prepare_secure
        secure = prepare_secure(data_dir, args.host, DEMO_AGENTS if args.demo else (args.agent,))
        print(f"certificates: {secure.dir} (CA {secure.ca})")
    etcd = EtcdCluster(1, base_dir=data_dir, client_port=etcd_port, binary=binary.path, options=options,
                       client_tls=None if secure is None else ClientTls(secure.etcd_ca, secure.etcd_server.cert,
                                                                        secure.etcd_server.key))
    children: list[Child] = []
    py = sys.executable
    operator_tls = None if secure is None else secure.operator
    try:
        try:
            etcd.start()
        except (RuntimeError, TimeoutError) as e:
            raise CliError(f"etcd did not start: {str(e).splitlines()[0]}",
                           f"its log is in {data_dir}; with --data-dir, the directory may belong to another etcd") from e
        ep = etcd.endpoints[0]
        etcdctl = f"{binary.etcdctl()} --endpoints={ep}"
        coord_extra: list[str] = []
        node_extra: list[str] = []
        if secure is not None:
            from coordinator.etcd.auth import setup_roles
            asyncio.run(setup_roles(ep, secure.etcd_security(secure.etcd_root), "/gpucoord/", []))
            etcdctl = (f"{binary.etcdctl()} --endpoints=https://{ep} --cacert={secure.etcd_ca} "
                       f"--cert={secure.etcd_root.cert} --key={secure.etcd_root.key}")
            coord_extra = secure.tls_flags(secure.coordinator) + secure.etcd_flags("coordinator")
            node_extra = secure.tls_flags(secure.node)
            print("etcd:        client-certificate TLS, auth enabled (users root, gpucoord-coordinator); it "
                  f"trusts only the etcd CA {secure.etcd_ca}, which signs no agent's, operator's or node's "
                  "certificate")
        print(f"etcd:        {ep}   (etcdctl: {etcdctl} get --prefix /gpucoord/)")
        print(f"             auto-compaction {options.auto_compaction_mode} {options.auto_compaction_retention}, "
              f"quota {options.quota_backend_bytes} B (alarm NOSPACE past it: see docs/etcd.md), "
              f"max-txn-ops {options.max_txn_ops}")
        coord = Child("coordinator", [py, "-m", "coordinator.cli", "coordinator", "--etcd", ep,
                                      "--listen", listen, "--metrics-listen", metrics_listen,
                                      "--session-ttl", str(args.session_ttl),
                                      "--etcd-max-txn-ops", str(UP_MAX_TXN_OPS), *coord_extra],
                      data_dir / "coordinator.log")
        children.append(coord)
        cport = coord.wait_ready(30)
        caddr = f"{listen.rpartition(':')[0]}:{cport}"
        print(f"coordinator: {caddr}   (log {coord.log_path})")
        # The node daemon talks to the coordinator only (the registry mode): it has no etcd credentials.
        node_argv = [py, "-m", "coordinator.cli", "node", "--coordinator", caddr, "--host", args.host,
                     "--listen", node_listen, "--metrics-listen", node_metrics_listen, *node_extra]
        if fake:
            node_argv += ["--fake-gpus", fake]
        for flag, value in (("--fake-cpus", args.fake_cpus), ("--fake-mem", args.fake_mem),
                            ("--fake-disk", args.fake_disk), ("--fake-processes", args.fake_processes)):
            if value is not None:
                node_argv += [flag, str(value)]
        node_argv += ["--enforce", args.enforce, *(f"--label={x}" for x in args.label)]
        node = Child("node", node_argv, data_dir / "node.log")
        children.append(node)
        nport = node.wait_ready(30)
        print(f"node:        {node_listen.rpartition(':')[0]}:{nport} host={args.host}   (log {node.log_path})")
        # With --secure the coordinator's and the node's /metrics are HTTPS and want a client certificate.
        scheme = "http" if secure is None else "https"
        print(f"metrics:     coordinator {scheme}://{metrics_listen}/metrics   node {scheme}://{node_metrics_listen}"
              f"/metrics   etcd {etcd.members[0].metrics_url}")
        # The read-only fleet console is served on the coordinator's metrics port (coordinator.web).
        print(f"console:     {scheme}://{metrics_listen}/")
        _wait_host(caddr, args.host, 15, operator_tls)
        print(render_status(fetch_status(caddr, tls=operator_tls)))
        if secure is not None:
            print("\nmTLS is on. An agent needs these three variables (agent_client reads them):")
            for name, files in secure.agents.items():
                print(f"  # gpucoord://agent/{name}")
                print("  " + " ".join(f"export {k}={v}" for k, v in files.env().items()))
            print("  # the operator (gpucoord status, partition, lease, team, certs revoke: all through the coordinator)")
            print("  " + " ".join(f"export {k}={v}" for k, v in secure.operator.env().items()))
            print("  # break glass only (gpucoord keys, certs revoke --etcd, etcdctl): etcd's root; only the "
                  "coordinator holds etcd credentials day to day")
            print("  " + " ".join(f"export {k}={v}" for k, v in secure.break_glass_env().items()), flush=True)
        if args.demo:
            from coordinator.cli.demo import run_demo
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
        print(f"stopped; etcd data kept in {data_dir}", flush=True)


def _wait_host(caddr: str, host: str, timeout: float, tls: TlsFiles | None = None) -> None:
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
            raise CliError(f"the node daemon of host {host} did not register within {timeout:g} s",
                           "see node.log in the data directory")
        time.sleep(0.1)
