"""The etcd key schema. This module is the only place that builds or parses gpucoord keys.

Every key lives under a prefix (default ``/gpucoord/``, configurable). Values are compact JSON, so
``etcdctl get --prefix /gpucoord/`` reads well.

=====================================  ==========================================================  ====================  =================================  ==================================================  ==========================================
key                                    value                                                       hangs on              written by                         compare-and-set rule                                deleted by
=====================================  ==========================================================  ====================  =================================  ==================================================  ==========================================
``hosts/<host>``                       address, inventory (cpu, mem, disk, gpus: index, uuid,      host's registration   coordinator, for its node daemon   one txn: put if on its registration, else if        etcd, when the node's etcd_lease expires
                                       name, vram_total_mb, numa_node (null: unknown),                                                                      absent (version 0); else refused: one per host
                                       nvlink_peers (GPU indexes; absent in older records: unknown
                                       topology)), version, pid, started_at
``usage/<host>``                       per GPU: vram_used_mb from NVML, processes, untracked_mb,   host's registration   coordinator, for the node, <= ~1/s put only while hosts/<host> is on the node's        etcd, with the node's etcd_lease
                                       ts (the node's wall clock); each process's attribution                                                               etcd_lease (compare on its lease)
                                       (state, lease_id) and each lease's VRAM use (over_use)
``partitions/<host>``                  spec + computed allocation per agent                        nothing (durable)     coordinator (``partition apply``)  apply compares its mod_revision; every acquire      operator (``partition apply`` of shared)
                                                                                                                                                        compares it too
``gpus/<host>/<gpu_uuid>``             the GPU's ledger: capacity_mb, seq (last fencing token)     nothing (durable)     every admission on that GPU        admission compares its mod_revision (or version 0   never (it keeps the token sequence)
                                                                                                                                                        when it is created)
``leases/<host>/<gpu_uuid>/<lease_id>`` agent, session, vram_mb, priority, preemptible,             agent's session       coordinator                        created comparing every ledger of the host, so no   release (compares mod_revision), session
                                       request_id, token, created_at; pids, pgid once                                                                   other admission raced it (G6: one id per request);  expiry, forced eviction
                                       AttachProcesses recorded them                                                                                    AttachProcesses compares its mod_revision
                                       a gang: one record per GPU under one id, each listing
                                       all its GPUs (format 2: gang, exclusive, topology)
``queue/<host>/<rank>``                a waiting request; rank sorts by priority (highest first),  waiter's session      coordinator                        created with version == 0; every admission compares the grant's transaction, a timed-out or
                                       then arrival                                                                                                             that no entry changed since its snapshot            cancelled waiter, session expiry, leader sweep,
                                                                                                                                                                                                                    an arrival that displaces it (full queue)
``gangqueue/<rank>``                   a waiting multi-host gang (format 5: hosts, same, prefer);  waiter's session      the replica serving the waiting    created with version == 0; its grant compares it    the grant's transaction (with its
                                       its reservation on each host is an entry of                                       RPC                                (and every ledger of every host it touches) and     reservations), a timed-out or cancelled
                                       ``queue/<host>/<rank>`` (same rank) listing ``reserve``                                                              each host's queue condition                         waiter, session expiry, leader sweep
``evictions/<lease_id>``               who asked (and its priority), why, deadline                 victim's session      the deciding coordinator, or an    created with version == 0, comparing the victim's   release of the victim, leader at deadline +
                                                                                                                         operator; the leader enforces      mod_revision                                        the kill margin (or earlier once the node
                                                                                                                                                                                                                    reports none of its processes)
``departing/<host>/<gpu_uuid>/<lease_id>``
                                       an ended lease whose processes the node still reported:     nothing (durable)     the replica that releases a lease  created in the transaction that deletes the lease   leader: once the node reports none of its
                                       agent, vram_mb, pids, pgid, who asked, bound, forced;                             under a notice; the leader at the  (compares it, its notice and the usage report);     processes (or the host is gone), or 5 min
                                       its VRAM counts as held until the node lists none of                              kill margin                        the leader marks it forced at the bound             after the bound
                                       them, or the kill margin passes
``sessions/<agent>/<session_id>``      agent, host, pid, client version, ttl                       the session itself    coordinator                        every admission compares version > 0                CloseSession (revoke) or etcd on expiry
``election/<id>``, ``coordinators/<id>`` leader election, live replicas                            replica's etcd_lease  coordinator                        election: lowest create_revision leads              etcd, with the replica's etcd_lease
``revoked/<serial>``                   a revoked certificate: serial (lowercase hex), role, name,  nothing (durable)     operator (``certs revoke``, its    created with version == 0 (revoking twice keeps     never by gpucoord (an operator may delete it
                                       not_after, revoked_at, revoked_by, reason; the key alone                          etcd user may write only here)     the first record)                                   once the certificate has expired)
                                       revokes, whatever the value
``teams/<team>``                       a team: quota_mb (guaranteed VRAM over the fleet),          nothing (durable)     coordinator (``team set`` /        set compares its mod_revision (0 to create)         operator (``team delete``)
                                       quota_by_model ({GPU model: MiB}), limit_mb (hard cap,                            ``team delete``, operator only)    and that no team changed since its read, so no two
                                       null: none), weight, members (agent names or patterns                                                                teams ever claim the same member pattern
                                       ``name-*``), max_min_runtime_s; agents no team names are
                                       in ``default``
``teamledgers/<team>``                 a team's admission ledger: seq (bumped by every grant       nothing (durable)     every admission that grants a      the grant compares its mod_revision (0 to create),  never (like a GPU's ledger)
                                       charged to a team that has a limit); its mod_revision is                          lease to a team with a limit       and that no team changed since the usage it counted:
                                       the compare-and-set point that keeps the team's use exact                                                            no two grants count the same room under a limit
                                       across hosts and replicas
``accounting/cursor``                  the accountant's watch cursor: revision (every deletion up  nothing (durable)     the leader's accountant            every write compares its mod_revision (0 to         never
                                       to it is accounted), skip (records of the next revision                                                              create) and the leader's fence: records and
                                       already written), at                                                                                                 rollups go in the same transaction
``accounting/records/<lease_id>@<rev>`` one ended lease's usage record (docs/teams.md, "Usage      nothing (durable)     the leader's accountant            written with the cursor (above); <rev>: the         the leader, past ``usage_retention_s``
                                       accounting"); <rev> is the lease's create_revision                                                                   lease's create_revision
``accounting/hours/<hour>/<team>``     a team's usage in one UTC hour (``2026-12-04T19``): gpu_s,  nothing (durable)     the leader's accountant            written with the cursor (above)                     the leader, past ``usage_rollup_days``
                                       vram_mib_s, evictions, leases; per agent the same
``cordons/<host>``                     a cordoned host (issue 31): host, reason, drain (the        nothing (durable)     coordinator (``host cordon`` /     written comparing its mod_revision (0 to create);   operator (``host uncordon``)
                                       drain's notices went with it), grace_s, asked_by,                                 ``host drain``, operator only)     every grant compares it (mod_revision 0: absent),
                                       created_at                                                                                                           so no grant lands on a host once it is cordoned
=====================================  ==========================================================  ====================  =================================  ==================================================  ==========================================

The host's registration is an etcd_lease that the coordinator replica holding the node daemon's
``Registry.Register`` stream grants and refreshes once per heartbeat of the node
(``coordinator.rpc.registry_server``); a node daemon of an earlier release (``gpucoord node --etcd``) holds
its own and writes both keys itself, with the same transactions (``coordinator.node.registration``).

``session_id`` is the hex id of the session's etcd_lease. ``lease_id`` is derived from
(host, agent, request_id), so a retried acquire can only ever name the same key (G6).
"""
from __future__ import annotations

import hashlib
import re

DEFAULT_PREFIX = "/gpucoord/"

# Names of hosts, agents and GPUs end up inside keys: keep them to a safe alphabet, without '/'.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


def valid_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name))


def prefix_range_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix`` (etcd's range_end)."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def last_segment(key: bytes) -> str:
    """The last path segment of a key: the lease id of ``leases/h/g/<id>``, the rank of ``queue/h/<rank>``."""
    return key.decode().rsplit("/", 1)[-1]


def session_id_from_etcd_lease(etcd_lease_id: int) -> str:
    return format(etcd_lease_id, "x")


def etcd_lease_from_session_id(session_id: str) -> int:
    return int(session_id, 16)


def lease_id_for(agent: str, request_id: str, host: str) -> str:
    """A VRAM lease id that is a function of (agent, request_id, host): retries cannot mint a second one,
    and ids are unique across hosts (``evictions/<lease_id>`` is not host-qualified)."""
    return hashlib.sha256(f"{host}\0{agent}\0{request_id}".encode()).hexdigest()[:20]


class Keys:
    """Key builders and parsers for one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"prefix: must start and end with '/', got {prefix!r}")
        self.prefix = prefix

    def _k(self, *parts: str) -> bytes:
        return (self.prefix + "/".join(parts)).encode()

    def _dir(self, *parts: str) -> bytes:
        return (self.prefix + "".join(p + "/" for p in parts)).encode()

    # -- keys -------------------------------------------------------------------------------
    def root(self) -> bytes:
        return self.prefix.encode()

    def relative(self, key: bytes) -> str:
        """A key below the prefix, as the Registry service sends it to a node ("leases/h1/GPU-0/l-1"): the node
        puts it under its own prefix with ``absolute``."""
        root = self.root()
        return (key[len(root):] if key.startswith(root) else key).decode(errors="replace")

    def absolute(self, relative: str) -> bytes:
        return self.root() + relative.encode()

    def host(self, host: str) -> bytes:
        return self._k("hosts", host)

    def hosts(self) -> bytes:
        return self._dir("hosts")

    def usage(self, host: str) -> bytes:
        return self._k("usage", host)

    def usages(self) -> bytes:
        return self._dir("usage")

    def partition(self, host: str) -> bytes:
        return self._k("partitions", host)

    def partitions(self) -> bytes:
        return self._dir("partitions")

    def gpu(self, host: str, gpu_uuid: str) -> bytes:
        return self._k("gpus", host, gpu_uuid)

    def gpus(self, host: str | None = None) -> bytes:
        return self._dir("gpus", host) if host else self._dir("gpus")

    def lease(self, host: str, gpu_uuid: str, lease_id: str) -> bytes:
        return self._k("leases", host, gpu_uuid, lease_id)

    def leases(self, host: str | None = None, gpu_uuid: str | None = None) -> bytes:
        parts = [p for p in (host, gpu_uuid) if p]
        return self._dir("leases", *parts)

    def queue_entry(self, host: str, rank: str) -> bytes:
        return self._k("queue", host, rank)

    def queue(self, host: str | None = None) -> bytes:
        return self._dir("queue", host) if host else self._dir("queue")

    def gang_queue_entry(self, rank: str) -> bytes:
        """``gangqueue/<rank>``: a waiting multi-host gang (issue 30), ranked as ``queue/<host>/<rank>``."""
        return self._k("gangqueue", rank)

    def gang_queue(self) -> bytes:
        return self._dir("gangqueue")

    def eviction(self, lease_id: str) -> bytes:
        return self._k("evictions", lease_id)

    def evictions(self) -> bytes:
        return self._dir("evictions")

    def departing(self, host: str, gpu_uuid: str, lease_id: str) -> bytes:
        return self._k("departing", host, gpu_uuid, lease_id)

    def departings(self, host: str | None = None) -> bytes:
        return self._dir("departing", host) if host else self._dir("departing")

    def session(self, agent: str, session_id: str) -> bytes:
        return self._k("sessions", agent, session_id)

    def sessions(self, agent: str | None = None) -> bytes:
        return self._dir("sessions", agent) if agent else self._dir("sessions")

    def election(self) -> bytes:
        return self._dir("election")

    def candidate(self, replica_id: str) -> bytes:
        """``election/<id>``: a replica's candidacy; the lowest create_revision leads."""
        return self._k("election", replica_id)

    def kind(self, kind: str) -> bytes:
        """The prefix of every key of one kind: ``kind("leases")`` -> ``/gpucoord/leases/``."""
        return self._dir(kind)

    def coordinator(self, replica_id: str) -> bytes:
        return self._k("coordinators", replica_id)

    def coordinators(self) -> bytes:
        return self._dir("coordinators")

    def revoked(self, serial: str) -> bytes:
        """``revoked/<serial>``: a revoked certificate (serial in lowercase hex)."""
        return self._k("revoked", serial)

    def revocations(self) -> bytes:
        return self._dir("revoked")

    def team(self, team: str) -> bytes:
        """``teams/<team>``: a team's quota, limit, weight and members (operator-managed)."""
        return self._k("teams", team)

    def teams(self) -> bytes:
        return self._dir("teams")

    def team_ledger(self, team: str) -> bytes:
        """``teamledgers/<team>``: the compare-and-set point of grants charged to a team with a limit."""
        return self._k("teamledgers", team)

    def accounting_cursor(self) -> bytes:
        """``accounting/cursor``: how far the leader's accountant has read etcd's deletions."""
        return self._k("accounting", "cursor")

    def usage_record(self, name: str) -> bytes:
        """``accounting/records/<lease_id>@<create_revision>``: one ended lease's usage record."""
        return self._k("accounting", "records", name)

    def usage_records(self) -> bytes:
        return self._dir("accounting", "records")

    def usage_rollup(self, hour: str, team: str) -> bytes:
        """``accounting/hours/<hour>/<team>``: a team's usage in one UTC hour."""
        return self._k("accounting", "hours", hour, team)

    def usage_rollups(self) -> bytes:
        return self._dir("accounting", "hours")
    def cordon(self, host: str) -> bytes:
        """``cordons/<host>``: the host gets no new grant while it exists (``host cordon``/``drain``)."""
        return self._k("cordons", host)

    def cordons(self) -> bytes:
        return self._dir("cordons")

    # -- parsing ----------------------------------------------------------------------------
    def parse(self, key: bytes) -> tuple[str, list[str]]:
        """Split a key into (kind, parts): ``/gpucoord/leases/h/g/l`` -> ``("leases", ["h", "g", "l"])``."""
        s = key.decode()
        if not s.startswith(self.prefix):
            raise ValueError(f"key {s!r} is not under prefix {self.prefix!r}")
        kind, _, rest = s[len(self.prefix):].partition("/")
        return kind, (rest.split("/") if rest else [])

    @staticmethod
    def queue_rank(priority: int, arrival_ns: int, request_key: str) -> str:
        """A rank that sorts lexicographically: highest priority first, then first come, first served.

        Priority is bounded to [-1_000_000, 1_000_000]; it is inverted and zero-padded so that a plain
        byte order over ``queue/<host>/`` is the service order.
        """
        inverted = 1_000_000 - priority
        return f"{inverted:07d}-{arrival_ns:020d}-{request_key}"

    @staticmethod
    def parse_queue_rank(rank: str) -> tuple[int, int, str]:
        inv, arrival, request_key = rank.split("-", 2)
        return 1_000_000 - int(inv), int(arrival), request_key
