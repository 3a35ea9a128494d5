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
from typing import Any, Sequence

from coordinator.cli.common import fetch_status
from coordinator.cli.render import render_status


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
    from coordinator.etcd.process import ClientTls, EtcdCluster, EtcdOptions, choose_etcd, port_is_free
    from coordinator.etcd.versions import MINIMUM_PRODUCTION
    from coordinator.node.inventory import NvmlUnavailable, open_gpu_source
    from coordinator.policy.partition import PartitionError, parse_size

    try:
        binary = choose_etcd(args.etcd_binary)
        retention = args.etcd_auto_compaction_retention or ("5m" if args.etcd_auto_compaction_mode == "periodic"
                                                             else "10000")
        options = EtcdOptions(args.etcd_auto_compaction_mode, retention, parse_size(args.etcd_quota, "--etcd-quota"))
    except (FileNotFoundError, PartitionError, ValueError) as e:
        print(f"gpucoord up: {e}", file=sys.stderr)
        return 2
    print(f"etcd binary: {binary.describe()}")
    if binary.crash_bugs:
        print(f"WARNING: this etcd has known crash bugs: {'; '.join(binary.crash_bugs)}. gpucoord never sends "
              f"the requests that trigger them, but other clients may: for production run etcd "
              f"{MINIMUM_PRODUCTION} or newer (--etcd-binary PATH or $GPUCOORD_ETCD_BINARY).")

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
    # etcd's usual port when it is free, so that `gpucoord keys` and etcdctl work with their defaults.
    etcd = EtcdCluster(1, base_dir=data_dir, client_port=2379 if port_is_free(2379) else 0, binary=binary.path,
                       options=options,
                       client_tls=None if secure is None else ClientTls(secure.ca, secure.etcd_server.cert,
                                                                        secure.etcd_server.key))
    children: list[Child] = []
    py = sys.executable
    operator_tls = None if secure is None else secure.operator
    try:
        etcd.start()
        ep = etcd.endpoints[0]
        etcdctl = f"{binary.etcdctl()} --endpoints={ep}"
        coord_extra: list[str] = []
        node_extra: list[str] = []
        if secure is not None:
            from coordinator.security.etcd_auth import setup_roles
            asyncio.run(setup_roles(ep, secure.etcd_security(secure.etcd_root), "/gpucoord/", [args.host]))
            etcdctl = (f"{binary.etcdctl()} --endpoints=https://{ep} --cacert={secure.ca} "
                       f"--cert={secure.etcd_root.cert} --key={secure.etcd_root.key}")
            coord_extra = secure.tls_flags(secure.coordinator) + secure.etcd_flags(secure.coordinator)
            node_extra = secure.tls_flags(secure.node) + secure.etcd_flags(secure.node)
            print("etcd:        client-certificate TLS, auth enabled (users root, gpucoord-coordinator, "
                  f"gpucoord-operator, gpucoord-node-{args.host})")
        print(f"etcd:        {ep}   (etcdctl: {etcdctl} get --prefix /gpucoord/)")
        print(f"             auto-compaction {options.auto_compaction_mode} {options.auto_compaction_retention}, "
              f"quota {options.quota_backend_bytes} B (alarm NOSPACE past it: see the README)")
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
        if args.fake_processes:
            node_argv += ["--fake-processes", args.fake_processes]
        node_argv += ["--enforce", args.enforce]
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
