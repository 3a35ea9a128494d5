"""``gpucoord bench``: every performance target (docs/performance.md, "Performance") as a ratio to a baseline measured in
the same run.

Each phase starts what it needs on loopback (its own etcd, coordinator, node daemons), as subprocesses,
so that the coordinator's CPU can be read from its process alone:

* P1: acquire p50 through agent_client, against (empty gRPC unary p50 + raw etcd read p50 + raw
  compare-and-put txn p50). The raw read is a linearizable Range: gpucoord never sends a read-only Txn
  (they crash etcd 3.5.0-3.5.6 when cancelled), and neither does the baseline.
* P2: raft proposals per successful acquire (etcd's /metrics), serial and with 16 agents (group commit).
* P3: acquire+release pairs/s with 64 agents over 16 simulated hosts x 8 GPUs, against raw
  compare-and-put txn/s with 64 concurrent writers.
* P4: against a lock-based admission built here (etcd's lock recipe as Go's concurrency.Mutex does it;
  read the ledger and leases; put the lease and the ledger; unlock; release the same way), on one GPU:
  serial acquire p50, and acquire+release pairs/s with 16 agents; both p99s. The side-by-side at 1, 4
  and 16 agents also reports the coordinator's CPU seconds per pair (robust to a loaded machine).
* P5: acquire p50 with 1,000 simulated hosts x 8 GPUs and 10,000 live leases, against the same on an empty
  cluster; and the time from starting a new coordinator (the old one killed) to its first acquire.
* P6: reclaim after the holder is SIGKILLed, against a raw etcd_lease holder killed the same way with the
  same TTL and keepalive interval; and 1,000 sessions killed at once, all reclaimed within TTL + 2 s.
* P7: eviction notice and release-to-grant latency, p99.
* P8: idle cost with 1,000 open sessions: coordinator CPU % and RSS, node daemon CPU %, etcd writes/s
  (raft proposals/s: every writer, not only the node).
* GANG: 2-GPU NVLink gangs against two single leases a pair (``phases/gang.py``).
* MULTIHOST: 2-host x 4-GPU exclusive gangs over 8 hosts against a 4-GPU gang on each host, host A then host B
  (``phases/multihost.py``).
* TEAMS: P1's acquire p50 and P4's pairs/s and CPU per pair with teams stored, against the same without, in
  alternating rounds (``phases/teams.py``): teams may cost at most 10 %.

``--quick`` runs every phase small (under a minute): the suite runs it to prove every line is produced.
Its numbers mean little.

The package, one concern a module:

* ``rig``: the processes of a phase (etcd, coordinators, node daemons, session-holding workers) and what
  is read of them (CPU seconds, RSS, etcd's ``/metrics``).
* ``load``: what agents do to gpucoord in a phase (timed acquires, acquire+release loops).
* ``baselines``: what each target is measured against: an empty gRPC unary, raw etcd reads and
  compare-and-put txns, a raw etcd_lease holder, and a lock-based admission with keys of its own.
* ``phases``: P1-P8, GANG, MULTIHOST and TEAMS, each phase a function that runs on its own rig and returns its
  report lines.
* ``stats``: the one percentile definition every figure uses.
* ``report``: a line's verdict and rendering, the side-by-side table.
* ``runner``: sizes (full and ``--quick``) and which phases a command runs.
* ``eventloop``: the one event loop the phases' asyncio work shares for the whole command.
"""
