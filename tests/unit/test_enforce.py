"""The node's attribution of GPU processes to leases (coordinator/node/enforce.py): pure, no I/O."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.node.enforce import Covered, Enforcer, ProcInfo, attribute
from coordinator.records import GpuProcess, GpuUsage

G0, G1 = "GPU-0", "GPU-1"


def gpu(uuid: str, *procs: tuple[int, int]) -> GpuUsage:
    return GpuUsage(index=int(uuid[-1]), uuid=uuid, vram_used_mb=sum(mb for _, mb in procs), vram_free_mb=0,
                    processes=tuple(GpuProcess(pid, mb) for pid, mb in procs))


def cov(lease_id: str, gpu_uuid: str = G0, vram_mb: int = 1000, pids: tuple[int, ...] = (), pgid: int = 0,
        started: float | None = 100.0, pgid_started: float | None = 100.0, gone_at: float = 0.0) -> Covered:
    return Covered(lease_id, gpu_uuid, "agent-a", vram_mb, tuple((p, started) for p in pids), pgid,
                   pgid_started if pgid else None, gone_at)


def procs(**kw: tuple[int, float]) -> dict[int, ProcInfo]:
    return {int(k[1:]): ProcInfo(pgid, started) for k, (pgid, started) in kw.items()}


def states(result: object) -> list[tuple[int, str, str]]:
    return [(v.pid, v.state, v.lease_id) for v in result.processes]  # type: ignore[attr-defined]


def test_a_process_is_covered_by_pid_or_by_process_group() -> None:
    usage = [gpu(G0, (10, 300), (11, 200), (12, 100))]
    live = [cov("by-pid", pids=(10,)), cov("by-group", pgid=20)]
    info = procs(p10=(10, 100.0), p11=(20, 101.0), p12=(12, 102.0), p20=(20, 100.0))
    r = attribute(usage, live, [], info)
    assert states(r) == [(10, "leased", "by-pid"), (11, "leased", "by-group"), (12, "untracked", "")]
    assert [(u.lease_id, u.used_mb, u.over_use, u.pids) for u in r.lease_use] == [
        ("by-group", 200, False, (11,)), ("by-pid", 300, False, (10,))]
    assert r.kills == ()


def test_over_use_is_beyond_the_tolerance_and_shared_processes_count_once() -> None:
    usage = [gpu(G0, (10, 1300))]
    info = procs(p10=(10, 100.0))
    assert [u.over_use for u in attribute(usage, [cov("a", pids=(10,))], [], info, tolerance_mb=300).lease_use] \
        == [False]
    assert [u.over_use for u in attribute(usage, [cov("a", pids=(10,))], [], info, tolerance_mb=299).lease_use] \
        == [True]
    # One process covered by two leases of 1000 MiB: 1300 MiB is within their sum, for both of them.
    two = attribute(usage, [cov("a", pids=(10,)), cov("b", pgid=10)], [], info)
    assert [(u.lease_id, u.used_mb, u.over_use) for u in two.lease_use] == [("a", 1300, False), ("b", 1300, False)]


def test_a_lease_on_another_gpu_does_not_make_a_process_leased_here() -> None:
    usage = [gpu(G0, (10, 100)), gpu(G1, (10, 500))]
    r = attribute(usage, [cov("a", gpu_uuid=G0, pids=(10,))], [], procs(p10=(10, 100.0)), mode="kill-untracked")
    assert states(r) == [(10, "leased", "a"), (10, "leased_elsewhere", "a")]
    assert r.kills == ()


def test_orphans_are_killed_only_when_told() -> None:
    usage = [gpu(G0, (10, 500), (11, 500))]
    gone = [cov("old", pids=(10,), gone_at=5.0)]
    info = procs(p10=(10, 100.0), p11=(11, 100.0))
    for mode in ("report", "kill", "kill-untracked"):
        r = attribute(usage, [], gone, info, mode=mode, untracked_grace_s=10, now=50,
                      untracked_since={11: 45.0})
        assert states(r) == [(10, "orphaned", "old"), (11, "untracked", "")]
        assert [(k.pid, k.lease_id) for k in r.kills] == ([] if mode == "report" else [(10, "old")])
    # kill-untracked kills an untracked process once it has been so for the grace period.
    r = attribute(usage, [], gone, info, mode="kill-untracked", untracked_grace_s=10, now=60,
                  untracked_since={11: 45.0})
    assert sorted(k.pid for k in r.kills) == [10, 11]


def test_a_live_lease_wins_over_a_gone_one_and_exited_or_protected_processes_are_never_killed() -> None:
    usage = [gpu(G0, (10, 500), (11, 500), (12, 500))]
    gone = [cov("old", pids=(10, 11, 12), gone_at=5.0)]
    live = [cov("new", pids=(10,))]
    r = attribute(usage, live, gone, procs(p10=(10, 100.0), p12=(12, 100.0)), mode="kill", protected=(12,))
    assert states(r) == [(10, "leased", "new"), (11, "orphaned", "old"), (12, "orphaned", "old")]
    assert r.kills == ()   # 11 has exited (no ProcInfo), 12 is protected


def test_a_reused_pid_or_process_group_does_not_match() -> None:
    usage = [gpu(G0, (10, 500), (11, 500))]
    gone = [cov("old", pids=(10,), pgid=20, started=100.0, pgid_started=100.0, gone_at=5.0)]
    # pid 10 now belongs to a process that started later; group 20 now has a new leader (pid 20, later).
    info = procs(p10=(10, 200.0), p11=(20, 200.0), p20=(20, 199.0))
    r = attribute(usage, [], gone, info, mode="kill")
    assert states(r) == [(10, "untracked", ""), (11, "untracked", "")]
    assert r.kills == ()
    # The original group, its leader gone: a member still matches.
    r = attribute(usage, [], gone, procs(p10=(10, 100.0), p11=(20, 150.0)), mode="kill")
    assert states(r) == [(10, "orphaned", "old"), (11, "orphaned", "old")]


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="enforce"):
        attribute([], [], [], {}, mode="kill-everything")
    with pytest.raises(ValueError, match="--enforce"):
        Enforcer("nope")


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 5000)), max_size=20, unique_by=lambda t: t[0]),
       st.lists(st.tuples(st.integers(1, 30), st.integers(0, 1)), max_size=10),
       st.sampled_from(["report", "kill", "kill-untracked"]))
def test_every_process_gets_one_verdict_and_report_never_kills(rows: list[tuple[int, int]],
                                                               leases: list[tuple[int, int]], mode: str) -> None:
    usage = [gpu(G0, *rows)]
    live = [cov(f"l{i}", pids=(pid,)) for i, (pid, gone) in enumerate(leases) if not gone]
    gone = [cov(f"g{i}", pids=(pid,), gone_at=1.0) for i, (pid, g) in enumerate(leases) if g]
    info = {pid: ProcInfo(pid, 100.0) for pid, _ in rows}
    r = attribute(usage, live, gone, info, mode=mode, now=1000.0)
    assert [v.pid for v in r.processes] == [pid for pid, _ in rows]
    live_pids = {p for c in live for p, _ in c.pids}
    for v in r.processes:
        assert (v.state == "leased") == (v.pid in live_pids)
    if mode == "report":
        assert r.kills == ()
    killed = {k.pid for k in r.kills}
    assert not killed & live_pids
    if mode == "kill":
        # pid 1 (init) is never killed, whatever covers it.
        assert killed == {v.pid for v in r.processes if v.state == "orphaned"} - {1}


class FakeOs:
    def __init__(self) -> None:
        self.info: dict[int, ProcInfo] = {}
        self.killed: list[tuple[int, int]] = []

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))
        self.info.pop(pid, None)


def test_the_enforcer_remembers_the_processes_of_deleted_leases() -> None:
    from coordinator.records import VramLease
    fake = FakeOs()
    fake.info = {10: ProcInfo(10, 100.0)}
    e = Enforcer("kill", proc_info=fake.info.get, kill=fake.kill, remember_s=60)
    lease = VramLease(id="l1", host="h", gpu_uuid=G0, gpu_index=0, agent="a", session_id="1", vram_mb=1000,
                      priority=0, preemptible=True, request_id="r", token=1, created_at=0.0, pids=(10,), pgid=10)
    e.confirmed("l1", [10])   # the node confirmed pid 10 (and its group) as the caller's (ConfirmProcesses)
    e.lease_put(lease)
    assert [v.state for v in e.scan([gpu(G0, (10, 500))], now=1.0).processes] == ["leased"]
    e.lease_deleted("l1", now=2.0)
    r = e.scan([gpu(G0, (10, 500))], now=3.0)
    assert [(v.state, v.lease_id) for v in r.processes] == [("orphaned", "l1")]
    assert fake.killed == [(10, 9)]
    # Forgotten after remember_s: a later process with that pid is not touched.
    fake.info = {10: ProcInfo(10, 100.0)}
    assert [v.state for v in e.scan([gpu(G0, (10, 500))], now=100.0).processes] == ["untracked"]
    assert len(fake.killed) == 1


def test_the_enforcer_never_kills_what_the_node_did_not_confirm_as_the_agents() -> None:
    """G9: a lease record naming a process this node never confirmed (written past the coordinator's check, by
    an older coordinator or by hand) is attributed, but its process is never killed; one that carries the lease
    in its environment (what ``gpucoord run`` starts) is, even after the node restarted and forgot."""
    from coordinator.records import VramLease
    fake = FakeOs()
    fake.info = {10: ProcInfo(10, 100.0), 11: ProcInfo(11, 100.0)}
    e = Enforcer("kill", proc_info=fake.info.get, kill=fake.kill, carries=lambda pid, lid: (pid, lid) == (11, "l2"))
    for lid, pid in (("l1", 10), ("l2", 11)):
        e.lease_put(VramLease(id=lid, host="h", gpu_uuid=G0, gpu_index=0, agent="a", session_id="1", vram_mb=1000,
                              priority=0, preemptible=True, request_id="r", token=1, created_at=0.0, pids=(pid,)))
    assert [v.state for v in e.scan([gpu(G0, (10, 500), (11, 500))], now=1.0).processes] == ["leased", "leased"]
    e.lease_deleted("l1", now=2.0)
    e.lease_deleted("l2", now=2.0)
    r = e.scan([gpu(G0, (10, 500), (11, 500))], now=3.0)
    assert [(v.pid, v.state) for v in r.processes] == [(10, "orphaned"), (11, "orphaned")]
    assert fake.killed == [(11, 9)]
