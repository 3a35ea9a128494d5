"""Applying and reading partitions: one transaction that compares the host's ledgers (so an apply is ordered
against every acquire), refused while live leases would break it unless their eviction is asked for."""
from __future__ import annotations

import asyncio
import time

from coordinator import errors
from coordinator.limits import MAX_PARTITION_BYTES
from coordinator.policy.host import HostView
from coordinator.policy.partition import (
    Partition,
    PartitionError,
    PartitionSpec,
    compute_partition,
    default_partition,
)
from coordinator.records import (
    HostInventory,
    InvalidRecord,
    VramLease,
    dumps,
    load_record,
)
from coordinator.replica.context import ReplicaContext
from coordinator.replica.leases import Leases
from coordinator.replica.view import host_view, invalid_host, read_host
from coordinator.txn import Compare, ModRevisionIs, Put, Range


class Partitions:
    def __init__(self, ctx: ReplicaContext, leases: Leases) -> None:
        self.ctx, self.leases = ctx, leases
        self.store, self.keys, self.config = ctx.store, ctx.keys, ctx.config

    async def apply_partition(self, spec: PartitionSpec, dry_run: bool, evict: bool) -> tuple[Partition, bool]:
        """``spec``: parsed and validated by the caller (``coordinator.rpc.validate.partition_spec``)."""
        deadline = time.monotonic() + self.config.eviction_grace_s + self.config.eviction_kill_margin_s + 5
        for _ in range(self.config.commit_attempts * 4):
            snap = await read_host(self.store, self.keys, spec.host)
            view = host_view(self.keys, spec.host, snap, untracked=False)
            if view.invalid_kinds - {"partitions"}:
                # (A malformed partition alone is what a new spec repairs.)
                raise invalid_host(spec.host, view.invalid)
            if view.inventory is None:
                raise errors.NotFound(f"host: no node daemon has registered host {spec.host!r}", "host")
            try:
                partition = compute_partition(view.inventory, spec)
            except PartitionError as e:
                raise errors.InvalidArgument(str(e), e.field) from e
            conflicts, offenders = partition_conflicts(partition, view)
            if conflicts and (not evict or dry_run):
                raise errors.FailedPrecondition(
                    "partition: live leases would break the new partition: " + "; ".join(conflicts)
                    + ("" if dry_run else " (apply with --evict to send them eviction notices)"), "partition")
            if conflicts:
                # --evict: notices to the offenders; the partition is written once they are gone (released,
                # or revoked by the leader past their deadline), so no revision ever breaks the new caps.
                if time.monotonic() > deadline:
                    raise errors.Unavailable("partition: the evicted leases are still held; retry", "partition")
                for lease in offenders:
                    try:
                        await self.leases.evict(lease.id, 0, f"partition of {spec.host} changes")
                    except errors.NotFound:
                        pass
                await self._host_changed(spec.host, snap.revision, timeout=1.0)
                continue
            if dry_run:
                return partition, False
            part_key = self.keys.partition(spec.host)
            compares: list[Compare] = [ModRevisionIs(part_key, view.partition_kv.mod_revision if view.partition_kv else 0)]
            # Any admission on the host bumps a ledger: comparing them all orders apply against acquires.
            compares += [ModRevisionIs(self.keys.gpu(spec.host, u), g.ledger.mod_revision)
                         for u, g in view.gpus.items()]
            value = dumps({"partition": partition.to_json()})
            if len(value) > MAX_PARTITION_BYTES:
                raise errors.InvalidArgument(f"partition: the computed partition takes {len(value)} bytes, more "
                                             f"than the limit of {MAX_PARTITION_BYTES}", "partition")
            res = await self.store.commit(compares, [Put(part_key, value)])
            if res.succeeded:
                return partition, True
        raise errors.Unavailable("partition apply: too much contention; retry")

    async def _host_changed(self, host: str, revision: int, timeout: float) -> None:
        """Wait (at most ``timeout``) for any lease on ``host`` to change after ``revision``."""
        async def watch() -> None:
            async for batch in self.store.watch(self.keys.leases(host), start_revision=revision + 1):
                if batch.events or batch.resync:
                    return
        try:
            await asyncio.wait_for(watch(), timeout)
        except asyncio.TimeoutError:
            pass

    async def get_partition(self, host: str) -> tuple[Partition, bool]:
        snap = await self.store.snapshot([Range(self.keys.host(host)), Range(self.keys.partition(host))])
        host_kvs, part_kvs = snap.ranges
        try:
            if part_kvs:
                return Partition.from_json(load_record(part_kvs[0].value).get("partition")), True  # type: ignore[arg-type]
            if not host_kvs:
                raise errors.NotFound(f"host: no node daemon has registered host {host!r}", "host")
            inventory = HostInventory.from_json(load_record(host_kvs[0].value).get("inventory"))  # type: ignore[arg-type]
        except (InvalidRecord, PartitionError) as e:
            raise invalid_host(host, f"{'partitions' if part_kvs else 'hosts'}/{host}: {str(e)[:200]}") from None
        return default_partition(inventory), False


def partition_conflicts(partition: Partition, view: HostView) -> tuple[list[str], list[VramLease]]:
    """Live leases that the new partition would not admit: readable lines, and the fewest leases (newest
    first) whose removal would make it admit the rest."""
    assert view.inventory is not None
    lines: list[str] = []
    offenders: dict[str, VramLease] = {}
    newest_first = sorted(view.leases.values(), key=lambda x: (-x.created_at, -x.token))
    per_agent_gpu: dict[tuple[str, str], list[VramLease]] = {}
    for lease in newest_first:
        per_agent_gpu.setdefault((lease.agent, lease.gpu_uuid), []).append(lease)
    for (agent, gpu_uuid), held in sorted(per_agent_gpu.items()):
        used = sum(x.vram_mb for x in held)
        caps = partition.gpu_caps(agent, view.inventory)
        if not partition.allows(agent):
            lines.append(f"agent {agent} holds {used} MiB on {gpu_uuid} but is not in the partition")
            offenders.update((x.id, x) for x in held)
        elif gpu_uuid not in caps:
            lines.append(f"agent {agent} holds {used} MiB on {gpu_uuid}, outside its partition")
            offenders.update((x.id, x) for x in held)
        elif used > caps[gpu_uuid]:
            lines.append(f"agent {agent} holds {used} MiB on {gpu_uuid}, above its cap of {caps[gpu_uuid]} MiB")
            for x in held:
                if used <= caps[gpu_uuid]:
                    break
                offenders[x.id] = x
                used -= x.vram_mb
    for gpu in view.gpus.values():
        usable = partition.usable_mb(view.inventory.gpu(gpu.uuid))  # type: ignore[arg-type]
        if gpu.leased_mb > usable:
            lines.append(f"GPU {gpu.uuid} has {gpu.leased_mb} MiB leased, above the new usable {usable} MiB")
            left = gpu.leased_mb - sum(x.vram_mb for x in offenders.values() if x.gpu_uuid == gpu.uuid)
            for x in sorted(gpu.leases, key=lambda x: (-x.created_at, -x.token)):
                if left <= usable:
                    break
                if x.id not in offenders:
                    offenders[x.id] = x
                    left -= x.vram_mb
    return lines, list(offenders.values())
