"""The coordinator's decisions: sessions, admission (group commit), release, status.

A replica keeps no state that etcd does not have. What it keeps in memory is a cache (which host a
session is on) and the per-host batches of acquires it is deciding right now. Every decision is made
from one consistent snapshot and committed in one transaction that compares what it read.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Awaitable, Callable

from coordinator import clock, errors
from coordinator.aio import cancel_and_wait, spawn
from coordinator.config import CoordinatorConfig
from coordinator.etcd.election import Election
from coordinator.etcd.store import ChannelFactory, Store
from coordinator.keys import (
    Keys,
    etcd_lease_from_session_id,
    lease_id_for,
    session_id_from_etcd_lease,
)
from coordinator.policy.fleet import FleetRequest
from coordinator.policy.partition import Partition, PartitionError, PartitionSpec
from coordinator.records import (
    EvictionRecord,
    Gang,
    InvalidRecord,
    QueueEntry,
    SessionInfo,
    VramLease,
    dumps,
    load_record,
)
from coordinator.replica import fair_share
from coordinator.replica.admitter import ADMITTER_IDLE_S, HostAdmitter
from coordinator.replica.call import AcquireCall
from coordinator.replica.context import ReplicaContext
from coordinator.replica.ends import LeaseEnds
from coordinator.replica.fleet import FleetAdmitter
from coordinator.replica.follow import Follower, Outbox
from coordinator.replica.gauges import MirrorGauges
from coordinator.replica.idle import IdleReclaim
from coordinator.replica.leader import Leadership
from coordinator.replica.leases import Confirm, Leases
from coordinator.replica.liveness import Liveness
from coordinator.replica.mirror import Mirror
from coordinator.replica.ownership import Ownership, owner_of  # noqa: F401 - owner_of: where the tests look
from coordinator.replica.partitions import Partitions
from coordinator.replica.status import StatusReport, agent_hosts, read_report
from coordinator.replica.view import invalid_host
from coordinator.txn import Exists, ModRevisionIs, NothingWrittenSince, Put, Range

log = logging.getLogger(__name__)


SINGLE = Gang()   # a plain single-GPU request


class CoordinatorService(Follower):
    """The domain side of the Coordinator gRPC service (the servicer translates messages and errors)."""

    def __init__(self, config: CoordinatorConfig, store: Store | None = None, advertise: str = "",
                 channel: ChannelFactory | None = None) -> None:
        keys = Keys(config.prefix)
        self.ctx = ReplicaContext(
            # A read is retried (e.g. across an etcd leader election) for at most one more etcd timeout,
            # so that a call fails within about twice the timeout when etcd has no quorum.
            store=store or Store(config.etcd, timeout=config.etcd_timeout_s, retry_for=config.etcd_timeout_s,
                                 security=config.etcd_security(), channel=channel),
            keys=keys, config=config, replica_id=uuid.uuid4().hex[:12], advertise=advertise, mirror=Mirror(keys))
        self.config, self.keys, self.store = config, keys, self.ctx.store
        self.replica_id, self.advertise, self.mirror = self.ctx.replica_id, advertise, self.ctx.mirror
        self.evictions = self.ctx.evictions    # lease id -> notice, from the watch (updated in place)
        self.leases = Leases(self.ctx)
        self.partitions = Partitions(self.ctx, self.leases)
        self._sessions: dict[tuple[str, str], SessionInfo] = {}
        self.liveness = Liveness(self.ctx, lambda info: self._sessions.pop((info.agent, info.session_id), None))
        self.ctx.session_left = self.liveness.table.remaining
        self.ends = LeaseEnds(keys, self.mirror)   # gpucoord_releases_total's close and expiry
        self._admitters: dict[str, HostAdmitter] = {}
        self._fleet: FleetAdmitter | None = None
        self._widest = 1   # the most hosts a multi-host gang asked for through this replica (``_lease_id``)
        self.admitter_idle_s = ADMITTER_IDLE_S
        self.ownership = Ownership(self.mirror)
        # KeepAlive streams this replica serves: session id -> queues of outgoing notices.
        self._streams: dict[str, set[Outbox]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()   # fire-and-forget clean-ups, kept referenced
        self.watch_ready = asyncio.Event()
        self.leadership: Leadership | None = None
        self._closed = False
        self.on_stop: list[Callable[[], Awaitable[None]]] = []   # e.g. the RPC layer's forwarding channels
        self.observed = self.ctx.observed
        self.usage_age = self.ctx.usage_age
        self.reach = self.ctx.reach
        self.reach.listeners.append(self._on_reach)

    async def start(self, leader_duties: bool = True) -> None:
        await self.store.connect()
        self._tasks.append(spawn(self._watch(), "watch"))
        await asyncio.wait_for(self.watch_ready.wait(), self.config.etcd_timeout_s * 3)
        self._tasks.append(spawn(MirrorGauges(self.ctx).run(), "the fleet gauges"))
        self._tasks.append(spawn(IdleReclaim(self.ctx, self.leases).sample_forever(), "the GPUs' utilization"))
        self._tasks.append(spawn(fair_share.run(self.ctx), "the teams' fair shares"))
        self._tasks.append(spawn(self.liveness.run(), "the sessions' expiry"))
        if leader_duties:
            self.leadership = Leadership(self.ctx, self.leases)
            self._tasks.append(spawn(self.leadership.run(), "leadership"))

    async def stop(self) -> None:
        self._closed = True
        for a in list(self._admitters.values()):   # an idle admitter retires (leaves the dict) meanwhile
            await a.stop()
        if self._fleet is not None:
            await self._fleet.stop()
        for q in [q for qs in self._streams.values() for q in qs]:
            q.put_nowait(errors.Unavailable("coordinator is shutting down; reconnect to another replica"))
        if self.leadership is not None:
            await self.leadership.resign()
        await cancel_and_wait(self._tasks)
        for hook in self.on_stop:
            await hook()
        await self.store.close()

    # -- eviction notices to KeepAlive streams ---------------------------------------------------
    def register_stream(self, session_id: str, queue: Outbox) -> None:
        self._streams.setdefault(session_id, set()).add(queue)
        self._push_pending(session_id, only=queue)

    def unregister_stream(self, session_id: str, queue: Outbox) -> None:
        qs = self._streams.get(session_id, set())
        qs.discard(queue)
        if not qs:
            self._streams.pop(session_id, None)

    def grace_left(self, record: EvictionRecord) -> float:
        """Seconds left until a notice's deadline, measured as the leader measures it (our monotonic clock,
        from when we saw the notice); the whole grace if we have not seen the notice itself yet."""
        kv = self.mirror.get(self.keys.eviction(record.lease_id))
        if kv is None:
            return max(0.0, record.deadline_unix - record.created_at)
        return max(0.0, self.ctx.notice_deadline(kv, record) - clock.monotonic())

    def _deliver(self, record: EvictionRecord, only: Outbox | None = None) -> None:
        if only is not None:
            only.put_nowait(record)
            return
        for session_id in (record.session_id, *self._joined(record)):
            for q in self._streams.get(session_id, ()):
                q.put_nowait(record)

    def _joined(self, record: EvictionRecord) -> list[str]:
        """The other sessions a multi-host gang's notice goes to: those of its agent on one of its hosts, which
        ``run --join`` opens to run a part (issue 30); none for a lease of one host."""
        kv = self.mirror.lease(record.lease_id)
        if kv is None or b'"hosts":[[' not in kv.value:
            return []
        try:
            hosts = {h for h, _ in VramLease.from_kv(kv).parts}
        except InvalidRecord:
            return []
        return [sid for (agent, sid), info in list(self._sessions.items())
                if agent == record.agent and info.host in hosts and sid != record.session_id]

    def _push_pending(self, session_id: str, only: Outbox | None = None) -> None:
        for record in list(self.evictions.values()):
            if record.session_id == session_id or session_id in self._joined(record):
                for q in ([only] if only is not None else list(self._streams.get(session_id, ()))):
                    q.put_nowait(record)

    # -- sessions ------------------------------------------------------------------------------
    async def open_session(self, agent: str, host: str, ttl_s: int, pid: int, client_version: str) -> tuple[str, int]:
        """Fields validated by the caller (``coordinator.rpc.validate``); ``ttl_s`` 0: the configured TTL."""
        self.reach.check()
        ttl = ttl_s or self.config.session_ttl_s
        for _ in range(self.config.commit_attempts):
            snap = await self.store.snapshot([Range(self.keys.host(host)), Range(self.keys.partition(host)),
                                              Range(self.keys.sessions(agent), prefix=True, keys_only=True)])
            host_kvs, part_kvs, own_sessions = snap.ranges
            if len(own_sessions) >= self.config.max_sessions_per_agent:
                raise errors.CapacityError(
                    f"sessions: agent {agent!r} has {len(own_sessions)} open sessions, the most allowed "
                    f"(max_sessions_per_agent); close one first", "sessions")
            if not host_kvs:
                raise errors.NotFound(f"host: no node daemon has registered host {host!r}", "host")
            if part_kvs:
                try:
                    partition = Partition.from_json(load_record(part_kvs[0].value).get("partition"))  # type: ignore[arg-type]
                except (InvalidRecord, PartitionError) as e:
                    raise invalid_host(host, f"partitions/{host}: {str(e)[:200]}") from None
                if not partition.allows(agent):
                    raise errors.NotOwner(
                        f"agent: {agent!r} is not in the {partition.mode} partition of host {host!r}", "agent")
            etcd_ttl = self.liveness.etcd_ttl(ttl)
            etcd_lease = await self.store.grant(etcd_ttl)
            session_id = session_id_from_etcd_lease(etcd_lease)
            value = dumps({"agent": agent, "host": host, "pid": pid, "client_version": client_version,
                           "ttl": ttl, "opened_at": clock.wall(), "coordinator": self.replica_id})
            part_rev = part_kvs[0].mod_revision if part_kvs else 0
            written = False
            try:
                # No session of the agent opened since the count: the cap holds under concurrent opens.
                res = await self.store.commit(
                    [Exists(self.keys.host(host)), ModRevisionIs(self.keys.partition(host), part_rev),
                     NothingWrittenSince(self.keys.sessions(agent), snap.revision)],
                    [Put(self.keys.session(agent, session_id), value, etcd_lease)])
                written = res.succeeded
            finally:
                if not written:
                    # Whatever went wrong (a lost compare, an etcd error, a cancelled call), nobody will
                    # ever know this etcd_lease: it goes now rather than living out its TTL.
                    await self._revoke_unused(etcd_lease)
            if written:
                self._sessions[(agent, session_id)] = info = SessionInfo(agent, session_id, host, etcd_lease, ttl)
                self.liveness.opened(info, etcd_ttl)
                self.ends.kept(info)
                return session_id, ttl
        raise errors.Unavailable("open session: too much contention on the host's partition; retry")

    async def _revoke_unused(self, etcd_lease: int) -> None:
        """Revoke an etcd_lease that no key uses, even if the caller is being cancelled."""
        async def revoke() -> None:
            try:
                await self.store.revoke(etcd_lease)
            except errors.GpucoordError as e:
                log.warning("could not revoke the unused etcd_lease %x (it expires with its TTL): %s", etcd_lease, e)
        task = spawn(revoke(), f"revoking the unused etcd_lease {etcd_lease:x}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        await asyncio.shield(task)

    async def agent_hosts(self, agent: str) -> set[str]:
        """The hosts on which ``agent`` has a live session (authorization of an agent's reads)."""
        return await agent_hosts(self.ctx, agent)

    async def session(self, agent: str, session_id: str) -> SessionInfo:
        """The session's (cached) identity. Liveness is checked by every transaction, not here. The caller
        has validated both fields (``coordinator.rpc.validate.session_ref``)."""
        etcd_lease = etcd_lease_from_session_id(session_id)
        self.reach.check()
        info = self._sessions.get((agent, session_id))
        if info is not None:
            return info
        key = self.keys.session(agent, session_id)   # a record's identity never changes: the mirror's will do
        kv = self.mirror.flat(key) or await self.store.get(key)
        if kv is None:
            raise errors.SessionGone(f"session: no live session {session_id} of agent {agent!r} "
                                     "(unknown or expired)", "session")
        doc = load_record(kv.value)
        host = doc.get("host")
        if not isinstance(host, str):
            raise InvalidRecord(f"sessions/{agent}/{session_id}: host: expected a string")
        ttl = doc.get("ttl")
        info = SessionInfo(agent, session_id, host, etcd_lease, ttl if isinstance(ttl, int) else 0)
        self._sessions[(agent, session_id)] = info
        return info

    async def keepalive(self, info: SessionInfo) -> int:
        """Refresh the session. Given up (UNAVAILABLE) after a quarter of its TTL at most, so that a client
        whose replica cannot refresh it (etcd slow or out of reach) tries another one in time."""
        self.reach.check()
        timeout = min(self.store.timeout, info.ttl_s / 4) if info.ttl_s > 0 else None
        try:
            ttl = await self.liveness.keepalive(info, timeout)
        except errors.Timeout:
            self.reach.suspect_now("a session's keepalive timed out")
            raise
        self.ends.kept(info)
        return ttl

    def kept_in_memory(self, agent: str, session_id: str) -> bool:
        """The keepalive of a session known here that needs no etcd (``Liveness.kept_in_memory``): True when
        done; False: it needs ``session`` and ``keepalive`` (KeepAliveSessions' fast path)."""
        info = self._sessions.get((agent, session_id))
        if info is None or not self.reach.ok or not self.liveness.kept_in_memory(info):
            return False
        self.ends.kept(info)
        return True

    async def close_session(self, info: SessionInfo) -> None:
        self.liveness.forget(info.session_id)
        self.ends.closing(info)
        await self.store.revoke(info.etcd_lease)
        self._sessions.pop((info.agent, info.session_id), None)

    # -- host ownership (replica/ownership.py) -------------------------------------------------------
    def live_replicas(self) -> dict[str, str]:
        return self.ownership.live_replicas()

    def owner(self, host: str) -> tuple[str, str] | None:
        return self.ownership.owner(host)

    # -- acquire -------------------------------------------------------------------------------
    async def acquire(self, info: SessionInfo, vram_mb: int, gpu: str, priority: int, preemptible: bool,
                      request_id: str, wait_s: float, forwarded: bool = False, capped: bool = True,
                      gang: Gang = SINGLE, min_runtime_s: float = 0.0,
                      time_limit: tuple[float, float] = (0.0, 0.0)) -> tuple[VramLease, ...]:
        """The lease granted: each GPU's record, in index order (one for a single GPU; a gang's all).
        ``capped``: held to the agent's priority cap on the host (docs/security.md "Priority caps"); False for an
        operator's own acquire. ``time_limit``: the lease's (limit, warning), resolved by the caller
        (``policy.time_limits.resolve``). The fields are validated by the caller (``coordinator.rpc.validate``)."""
        if self._closed:
            raise errors.Unavailable("coordinator is shutting down; retry on another replica")
        self.reach.check()
        if forwarded and self.reach.suspect:
            # The replica that forwarded it decides it itself, rather than wait for us to find out.
            raise errors.Unavailable(f"coordinator {self.replica_id} may not reach etcd (its calls run late): "
                                     "decide it yourself")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        call = AcquireCall(info, vram_mb, gpu or None, priority, preemptible, request_id,
                           self._lease_id(info, request_id, gang), wait_s, loop.create_future(),
                           forwarded=forwarded, capped=capped, gpu_count=gang.gpu_count,
                           exclusive=gang.exclusive, topology=gang.topology, gpus=gang.gpus,
                           min_runtime_s=min_runtime_s, time_limit_s=time_limit[0],
                           time_limit_warning_s=time_limit[1])
        if gang.hosts > 1:
            self._widest = max(self._widest, gang.hosts)
            if self._fleet is None:
                self._fleet = FleetAdmitter(self.ctx)
            req = FleetRequest(gang.hosts, gang.gpu_count, 0 if gang.exclusive else vram_mb, gang.exclusive,
                               gang.topology, gang.same, gang.prefer)
            await self._fleet.submit(call, req)
            return call.parts
        admitter = self._admitters.get(info.host)
        if admitter is None:
            admitter = self._admitters[info.host] = HostAdmitter(self.ctx, self.leases, info.host,
                                                                 self.admitter_idle_s, self._admitter_idle)
        lease = await admitter.submit(call)
        return call.parts or (lease,)

    def _lease_id(self, info: SessionInfo, request_id: str, gang: Gang) -> str:
        """The lease id of a request (G6). A multi-host gang's is of its own kind (its hosts count in it), so that
        a request of another shape with the same request_id can never add records under a gang's id; one of one
        host whose request_id names a live multi-host gang (as this replica's mirror knows it) is refused."""
        if gang.hosts > 1:
            return lease_id_for(info.agent, request_id, f"{info.host}/hosts={gang.hosts}")
        for hosts in range(2, self._widest + 1) if self.mirror.ready else ():
            if self.mirror.lease(lease_id_for(info.agent, request_id, f"{info.host}/hosts={hosts}")) is not None:
                raise errors.FailedPrecondition(f"hosts: request_id {request_id[:32]!r} names a lease over {hosts} "
                                                f"hosts; retry it with hosts={hosts}", "hosts")
        return lease_id_for(info.agent, request_id, info.host)

    def _admitter_idle(self, admitter: HostAdmitter) -> None:
        if self._admitters.get(admitter.host) is admitter:
            del self._admitters[admitter.host]

    def tracked(self) -> dict[str, int]:
        """How many per-host and per-session structures this replica holds (tests of bounded memory)."""
        return {"admitters": len(self._admitters), "sessions": len(self._sessions), "streams": len(self._streams),
                "live_sessions": len(self.liveness.table),
                "evictions": len(self.evictions), "background": len(self._background),
                **{f"mirror_{k}": v for k, v in self.mirror.tracked().items()}}

    # -- leases, partitions, status (replica/leases.py, partitions.py, status.py) ---------------------
    async def withdraw_evictions(self, entry: QueueEntry) -> None:
        await self.leases.withdraw_evictions(entry)

    async def evict(self, lease_id: str, grace_s: float, reason: str, asked_by: str = "") -> float:
        return await self.leases.evict(lease_id, grace_s, reason, asked_by)

    async def revoke(self, lease_id: str, host: str | None = None, notice_revision: int | None = None,
                     fence: Election | None = None) -> bool:
        return await self.leases.revoke(lease_id, host, notice_revision, fence)

    async def revoke_by_operator(self, lease_id: str, asked_by: str = "") -> tuple[bool, bool]:
        return await self.leases.revoke_by_operator(lease_id, asked_by)

    async def release(self, info: SessionInfo, lease_id: str) -> bool:
        """Answered within the etcd timeout: UNAVAILABLE (outcome unknown) when etcd did not settle it by
        then; a release is idempotent, so the client retries it, through another replica if it must."""
        try:
            async with asyncio.timeout(self.config.etcd_timeout_s):
                return await self.leases.release(info, lease_id)
        except TimeoutError:
            self.reach.suspect_now("a release timed out")
            raise errors.OutcomeUnknown(f"release: etcd did not settle the release of {lease_id} in time; it may or "
                                        "may not have happened: retry (a release is idempotent)") from None

    async def attach_processes(self, info: SessionInfo, lease_id: str, pids: list[int], pgid: int,
                               confirm: Confirm | None = None) -> bool:
        return await self.leases.attach_processes(info, lease_id, pids, pgid, confirm)

    async def find_lease(self, lease_id: str, host: str | None = None) -> VramLease | None:
        return await self.leases.find_lease(lease_id, host)

    async def apply_partition(self, spec: PartitionSpec, dry_run: bool, evict: bool) -> tuple[Partition, bool]:
        return await self.partitions.apply_partition(spec, dry_run, evict)

    async def get_partition(self, host: str) -> tuple[Partition, bool]:
        return await self.partitions.get_partition(host)

    async def status(self, host: str = "") -> StatusReport:
        """Every host's view at one revision, the TTLs of the sessions' etcd_leases, the eviction notices and
        the leader (``replica.status``)."""
        leader = self.leadership.leader_id if self.leadership is not None else ""
        return await read_report(self.ctx, host, leader)
