"""Which processes of a lease a node's usage report still lists (``coordinator.policy.departing``): the test
G3 applies to an evicted lease bound to processes. Pure functions over the report."""
from __future__ import annotations

from typing import Any

from agent_client.api import coordinator_pb2 as pb
from coordinator.policy.departing import (
    process_state,
    processes_visible,
    reported_pids,
    reports_none,
    still_reported,
)
from coordinator.rpc.status_message import redact_for_agent

GPU = "GPU-0"


def report(*procs: dict[str, Any], visible: bool = True, omitted: int = 0, gpu: str = GPU) -> dict[str, Any]:
    g: dict[str, Any] = {"uuid": gpu, "processes": list(procs), "processes_visible": visible}
    if omitted:
        g["processes_omitted"] = omitted
    return {"ts": 1.0, "gpus": [g]}


def proc(pid: int, lease_id: str = "", state: str = "leased") -> dict[str, Any]:
    return {"pid": pid, "used_mb": 0, "state": state, "lease_id": lease_id}


def test_a_process_counts_when_attributed_to_the_lease_or_when_it_is_a_recorded_pid() -> None:
    usage = report(proc(10, "L"), proc(11, "", "untracked"), proc(12, "other"), proc(13, "L", "orphaned"))
    assert reported_pids(usage, GPU, "L") == (10, 13)
    assert reported_pids(usage, GPU, "L", pids=(11,)) == (10, 11, 13)
    assert reported_pids(usage, "GPU-1", "L") == ()          # another GPU's list
    assert still_reported(usage, GPU, "L") and not still_reported(usage, GPU, "M")


def test_none_reported_needs_a_visible_whole_list() -> None:
    assert reports_none(report(proc(12, "other")), GPU, "L")
    assert not reports_none(report(proc(12, "other"), visible=False), GPU, "L")   # NVML cannot list them
    assert not reports_none(report(omitted=3), GPU, "L")     # some were left out: they may be the lease's
    assert not reports_none({"gpus": [{"uuid": GPU, "processes": []}]}, GPU, "L")   # an older node
    assert not reports_none(None, GPU, "L") and not processes_visible(None, GPU)


def test_a_malformed_report_lists_nothing_and_shows_nothing() -> None:
    for bad in ({"gpus": "x"}, {"gpus": [1, {"uuid": GPU, "processes": [None, {"pid": "7", "lease_id": "L"}]}]},
                [], "x"):
        assert reported_pids(bad, GPU, "L") == ()    # type: ignore[arg-type]
        assert not reports_none(bad, GPU, "L")        # type: ignore[arg-type]


def test_process_state_for_status() -> None:
    assert process_state(report(proc(10, "L")), GPU, "L", (10,)) == "stopping"
    assert process_state(report(), GPU, "L", (10,)) == "gone"
    assert process_state(report(visible=False), GPU, "L", (10,)) == "unknown"
    assert process_state(report(), GPU, "L", ()) == ""       # not bound to processes


def test_an_agents_status_shows_other_agents_departing_leases_without_processes_or_requester() -> None:
    """G9 for departing leases: an agent's GetStatus shows another agent's ended lease (its VRAM, whether it
    is held) but neither its processes nor who evicted it; its own in full."""
    status = pb.GetStatusResponse()
    gpu = status.hosts.add(host="h1").gpus.add(index=0, uuid="GPU-0")
    gpu.departing.add(lease_id="a1", agent="agent-a", vram_mb=100, pids=[11, 12], held=True,
                      requested_by="agent-b/r1", reason="x")
    gpu.departing.add(lease_id="b1", agent="agent-b", vram_mb=200, pids=[21], held=True, requested_by="operator")
    redact_for_agent(status, "agent-b")
    other, own = status.hosts[0].gpus[0].departing
    assert (other.lease_id, other.vram_mb, other.held, list(other.pids), other.requested_by) == \
        ("a1", 100, True, [], ""), other
    assert (list(own.pids), own.requested_by) == ([21], "operator"), own


def test_an_agent_sees_no_other_agents_request_id_among_the_waiting_gangs_nor_etcds_members() -> None:
    status = pb.GetStatusResponse()
    status.gang_queue.add(agent="agent-a", request_id="theirs", hosts=2)
    status.gang_queue.add(agent="agent-b", request_id="mine", hosts=2)
    status.etcd_members.add(name="etcd-0", leader=True)
    redact_for_agent(status, "agent-b")
    assert [x.request_id for x in status.gang_queue] == ["", "mine"] and not status.etcd_members
