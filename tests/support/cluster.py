"""In-process services: ``Cluster`` runs real coordinators and node daemons (real gRPC on loopback, real etcd)
in the test's process, so that starting them is cheap; its linked coordinators and nodes put their connections
behind a ``tests.faultlink.FaultLink`` that a test cuts, slows and heals. Reads for assertions: ``queue``,
``session_alive``, ``leaked``/``wait_no_leaks``, ``revision``/``writes_since``. ``EtcdEndpoint`` is what the
``etcd`` fixture hands a test."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.etcd.store import ChannelFactory, Store
from coordinator.keys import Keys
from coordinator.node.daemon import NodeDaemon
from coordinator.node.enforce import Enforcer
from coordinator.node.inventory import FakeGpuSource
from coordinator.node.remote import RemoteNodeDaemon
from coordinator.records import QueueEntry
from coordinator.rpc.coordinator_server import create_server
from coordinator.rpc.node_server import create_node_server
from coordinator.txn import Range
from tests.faultlink import FaultLink
from tests.history import empty_at
from tests.support.waiting import LoopThread, wait_for


@dataclasses.dataclass(frozen=True)
class EtcdEndpoint:
    """What the ``etcd`` fixture hands a test: client endpoints and the metrics URL of the first member."""
    endpoints: list[str]
    metrics_url: str
    provider: str = "process"    # or "docker IMAGE"


# ``Cluster.start_node`` runs its nodes in the registry mode (through the cluster's coordinators, no etcd
# connection, as ``gpucoord node --coordinator`` does) whenever a plaintext coordinator already runs and the
# node is neither linked nor serving TLS; GPUCOORD_TEST_NODE_MODE=etcd runs them in the etcd mode of earlier
# releases instead (a node started before any coordinator always is).
NODE_MODE_ENV = "GPUCOORD_TEST_NODE_MODE"

# The image the docker provider of the ``etcd`` fixture runs unless GPUCOORD_TEST_ETCD_IMAGE names another.
DEFAULT_ETCD_IMAGE = "gpucoord/etcd:3.5.1"


class Cluster:
    """Coordinators and node daemons of one test, all under the test's own key prefix."""

    def __init__(self, endpoints: list[str], prefix: str, etcd_channel: ChannelFactory | None = None) -> None:
        """``etcd_channel``: the channel factory of every Store of the cluster (its own, its coordinators',
        its nodes'), e.g. ``record_etcd_calls().channel``."""
        self.endpoints = endpoints
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.lt = LoopThread()
        self.etcd_channel = etcd_channel
        self.store = Store(endpoints, channel=etcd_channel)
        self.lt.run(self.store.connect())
        # A new prefix holds nothing yet: its history checks start here, not at the shared etcd's revision 1.
        snap = self.lt.run(self.store.snapshot([Range(self.keys.root(), prefix=True, keys_only=True)]))
        if not snap.ranges[0]:
            empty_at(self.keys.root(), snap.revision)
        self.coordinators: dict[str, tuple[Any, Any]] = {}
        self.nodes: dict[str, tuple[NodeDaemon, Any, FakeGpuSource]] = {}
        # Network faults: the link of a linked coordinator's (by its address) or node's (by host) etcd
        # connection, and of a linked coordinator's clients (its address is that link's endpoint).
        self.etcd_links: dict[str, FaultLink] = {}
        self.client_links: dict[str, FaultLink] = {}

    def config(self, **overrides: Any) -> CoordinatorConfig:
        base = dict(etcd=tuple(self.endpoints), prefix=self.prefix, listen="127.0.0.1:0")
        base.update(overrides)
        return CoordinatorConfig(**base).validate()

    def start_coordinator(self, linked: bool = False, **overrides: Any) -> str:
        """An in-process coordinator; returns the address its clients use. ``linked``: its etcd connection
        (``etcd_links[addr]``) and its clients' connections to it (``client_links[addr]``; it advertises that
        link's endpoint, so the other replicas' forwarded calls take it too) each run through a FaultLink."""
        if not linked:
            server, port, svc = self.lt.run(create_server(self.config(**overrides), self.etcd_channel))
            addr = f"127.0.0.1:{port}"
            self.coordinators[addr] = (server, svc)
            self._tell_nodes(addr)
            return addr
        from coordinator.etcd.process import free_port
        port = free_port()
        clients, etcd = FaultLink(f"127.0.0.1:{port}", "clients"), FaultLink(self.endpoints, "etcd")
        overrides = {"listen": f"127.0.0.1:{port}", "advertise": clients.endpoint, "etcd": tuple(etcd.endpoints),
                     **overrides}
        server, _, svc = self.lt.run(create_server(self.config(**overrides), self.etcd_channel))
        addr = clients.endpoint
        self.coordinators[addr] = (server, svc)
        self._tell_nodes(addr)
        self.etcd_links[addr], self.client_links[addr] = etcd, clients
        return addr

    def _tell_nodes(self, addr: str) -> None:
        """A new coordinator is one more address for the registry-mode nodes (as an operator's list would be)."""
        for daemon, _, _ in self.nodes.values():
            if isinstance(daemon, RemoteNodeDaemon) and addr not in daemon.coordinators:
                daemon.coordinators.append(addr)

    def service(self, addr: str) -> Any:
        """The CoordinatorService of the in-process coordinator at ``addr``."""
        return self.coordinators[addr][1]

    def stop_coordinator(self, addr: str) -> None:
        server, svc = self.coordinators.pop(addr)

        async def stop() -> None:
            await svc.stop()
            await server.stop(grace=0.5)
        self.lt.run(stop())
        for links in (self.etcd_links, self.client_links):
            link = links.pop(addr, None)
            if link is not None:
                link.close()

    def start_node(self, host: str, fake_gpus: str = "1x16GiB", ttl: int = 10, heartbeat_s: float = 5.0,
                   fake_processes: str | None = None, enforce: str = "report", over_use_tolerance_mb: int = 256,
                   tls: Any = None, linked: bool = False, via: list[str] | None = None, credentials: Any = None,
                   **overrides: Any) -> NodeDaemon:
        """An in-process node daemon; ``linked``: its etcd connection runs through ``etcd_links[host]``.
        ``via``: coordinator addresses; the daemon then runs in the registry mode, with no etcd connection
        (``credentials``: its client TLS credentials to them). Without ``via`` it does so through the cluster's
        coordinators where a plaintext one runs (``NODE_MODE_ENV``); ``via=[]``: the etcd mode, always."""
        source = FakeGpuSource(fake_gpus, host, fake_processes)
        if (via is None and not linked and tls is None and self.coordinators
                and os.environ.get(NODE_MODE_ENV, "registry") == "registry"
                and all(svc.config.tls_files() is None for _, svc in self.coordinators.values())):
            via = list(self.coordinators)   # registry mode by default, where a coordinator runs
        endpoints = self.endpoints
        if linked:
            link = self.etcd_links[host] = FaultLink(self.endpoints, f"node {host}")
            endpoints = link.endpoints

        async def start() -> tuple[NodeDaemon, Any]:
            daemon: NodeDaemon
            if via:
                daemon = RemoteNodeDaemon(via, self.keys, host, "127.0.0.1:0", source, "/", ttl, scan_interval_s=0.2,
                                          heartbeat_s=heartbeat_s, overrides=overrides,
                                          enforcer=Enforcer(enforce, over_use_tolerance_mb), credentials=credentials)
            else:
                store = Store(endpoints, channel=self.etcd_channel)
                await store.connect()
                daemon = NodeDaemon(store, self.keys, host, "127.0.0.1:0", source, "/", ttl, scan_interval_s=0.2,
                                    heartbeat_s=heartbeat_s, overrides=overrides,
                                    enforcer=Enforcer(enforce, over_use_tolerance_mb))
            server, port = await create_node_server(daemon, "127.0.0.1:0", tls)
            daemon.address = f"127.0.0.1:{port}"
            await daemon.start()
            return daemon, server
        daemon, server = self.lt.run(start())
        self.nodes[host] = (daemon, server, source)
        return daemon

    def stop_node(self, host: str, revoke: bool = True) -> None:
        daemon, server, _ = self.nodes.pop(host)

        async def stop() -> None:
            await server.stop(grace=0.2)
            await daemon.stop(revoke=revoke)
            if daemon.reads_etcd:
                await daemon.store.close()
        self.lt.run(stop())
        link = self.etcd_links.pop(host, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for link in [*self.etcd_links.values(), *self.client_links.values()]:
            link.heal()      # a quick shutdown: nothing waits on a cut link
        for host in [h for h, (d, _, _) in self.nodes.items() if not d.reads_etcd]:
            self.stop_node(host)   # while their coordinators still answer
        for addr in list(self.coordinators):
            self.stop_coordinator(addr)
        for host in list(self.nodes):
            self.stop_node(host)
        self.lt.run(self.store.close())
        self.lt.close()

    # -- reads for assertions --------------------------------------------------------------------
    def get_prefix(self, prefix: bytes) -> list[Any]:
        return list(self.lt.run(self.store.get_prefix(prefix)).kvs)

    def state(self) -> set[tuple[bytes, int]]:
        """(key, mod_revision) of every key a coordinator writes: equal before and after means no write (the
        leader's ``accounting/`` aside: the usage records of leases that ended before, written moments later)."""
        out = set()
        for kv in self.get_prefix(self.keys.root()):
            kind, _ = self.keys.parse(kv.key)
            if kind not in ("hosts", "usage", "coordinators", "election", "accounting"):
                out.add((kv.key, kv.mod_revision))
        return out

    def replicas(self) -> dict[str, str]:
        """replica id -> address, of the replicas registered under ``coordinators/``."""
        return {json.loads(kv.value)["replica"]: json.loads(kv.value)["address"]
                for kv in self.get_prefix(self.keys.coordinators())}

    def owner(self, host: str, replicas: int) -> str:
        """The address of the replica that owns ``host`` once ``replicas`` replicas are registered, and once every
        in-process replica's own view (its mirror) names it too: a replica whose mirror has not seen a registration
        yet forwards the host's calls to the one it thinks owns it (a test that hooks the owner would miss them)."""
        from coordinator.replica.service import owner_of
        reps = wait_for(lambda: (lambda r: r if len(r) == replicas else None)(self.replicas()), 15,
                        f"{replicas} replicas to register")
        winner = owner_of(host, reps)
        wait_for(lambda: all(svc.owner(host) == (winner, reps[winner]) for _, svc in self.coordinators.values()), 15,
                 f"every replica to see that {winner} owns {host}")
        return str(reps[winner])

    def leases(self) -> list[Any]:
        from coordinator.records import VramLease
        return [VramLease.from_kv(kv) for kv in self.get_prefix(self.keys.leases())]


def queue(cluster: Cluster, host: str = "h1") -> list[QueueEntry]:
    """The host's queue entries in etcd, in rank order."""
    return [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue(host))]


def session_alive(cluster: Cluster, agent: str, session_id: str) -> bool:
    return bool(cluster.get_prefix(cluster.keys.session(agent, session_id)))


def leaked(cluster: Cluster) -> list[bytes]:
    """The leases, queue entries, eviction notices and sessions under the cluster's prefix."""
    return [kv.key for kv in cluster.get_prefix(cluster.keys.root())
            if cluster.keys.parse(kv.key)[0] in ("leases", "queue", "evictions", "sessions")]


def wait_no_leaks(cluster: Cluster, within: float) -> None:
    """The leak check that ends a fault test once every agent is gone: nothing of theirs is left in etcd."""
    wait_for(lambda: not leaked(cluster), within, "no leaked lease, queue entry, eviction or session")


def revision(cluster: Cluster) -> int:
    """etcd's current revision."""
    return int(cluster.lt.run(cluster.store.snapshot([Range(b"/")])).revision)


def events_since(cluster: Cluster, before: int) -> list[tuple[str, bytes, int]]:
    """(kind, key, mod_revision) of every event after revision ``before`` up to etcd's current revision."""
    now = revision(cluster)
    if now == before:
        return []

    async def collect() -> list[tuple[str, bytes, int]]:
        seen: list[tuple[str, bytes, int]] = []
        async for batch in cluster.store.watch(b"/", start_revision=before + 1):
            seen += [(ev.kind, ev.kv.key, ev.kv.mod_revision) for ev in batch.events]
            if any(rev >= now for *_, rev in seen):
                return seen
        return seen
    return [e for e in cluster.lt.run(asyncio.wait_for(collect(), 10)) if e[2] <= now]


def writes_since(cluster: Cluster, before: int) -> list[str]:
    """Keys written (put or deleted) after revision ``before``, other than the node daemon's own
    ``hosts/`` and ``usage/`` (it republishes usage by itself when leases change) and the leader's
    ``accounting/`` (usage records of leases that ended before, written moments later): on an etcd of the
    module's own, an empty list means nothing that a request could have caused was written."""
    return [f"{kind} {key.decode(errors='replace')}" for kind, key, rev in events_since(cluster, before)
            if cluster.keys.parse(key)[0] not in ("hosts", "usage", "accounting")]