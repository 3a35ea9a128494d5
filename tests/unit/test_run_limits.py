"""What ``gpucoord run`` applies of a partition (agent_client/run.py): pure planning, and the cgroup
directory it prepares (in a temporary directory shaped like cgroup v2, not a real cgroup)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from agent_client.process import exit_status, plan_limits, prepare_cgroup
from coordinator.node.fake import FakeProcess
from coordinator.node.inventory import FakeGpuSource, parse_fake_processes


def test_a_shared_partition_limits_nothing() -> None:
    plan = plan_limits(None, {0, 1})
    assert (plan.cores, plan.mem_bytes, plan.cpu_max, plan.notes) == ((), 0, "", ())


def test_cores_memory_and_cpu_max_come_from_the_allocation() -> None:
    plan = plan_limits({"cores": [2, 3], "mem_bytes": 1 << 30}, range(8))
    assert (plan.cores, plan.mem_bytes, plan.cpu_max, plan.notes) == ((2, 3), 1 << 30, "200000 100000", ())


def test_cores_missing_here_are_said() -> None:
    partial = plan_limits({"cores": [1, 2, 3]}, {0, 1})
    assert partial.cores == (1,) and "cores 2-3 of the partition are not available" in partial.notes[0]
    none = plan_limits({"cores": [5, 6]}, {0, 1})
    assert none.cores == () and "CPU affinity (cores 5-6) is not enforced" in none.notes[0]


def test_no_cgroup_root_means_memory_and_cpu_are_not_enforced() -> None:
    path, notes = prepare_cgroup(None, "x", 1024, "100000 100000")
    assert path is None and len(notes) == 2 and all("no --cgroup-root" in n for n in notes)
    assert prepare_cgroup(None, "x", 0, "") == (None, [])


def test_a_directory_that_is_not_a_cgroup_is_refused(tmp_path: Path) -> None:
    path, notes = prepare_cgroup(str(tmp_path), "x", 1024, "")
    assert path is None and f"{tmp_path} is not a cgroup v2 directory" in notes[0]
    assert list(tmp_path.iterdir()) == []


def test_a_missing_controller_is_said_and_the_other_is_set(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    path, notes = prepare_cgroup(str(tmp_path), "job", 4096, "100000 100000")
    assert path == tmp_path / "job"
    assert (path / "cpu.max").read_text() == "100000 100000" and not (path / "memory.max").exists()
    assert notes == [f"the memory limit (memory.max = 4096 B) is not enforced: the memory controller is not "
                     f"available in {tmp_path} (cgroup.controllers: cpu pids)"]
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"   # enabled for the children


def test_exit_status_is_shell_style() -> None:
    assert (exit_status(0), exit_status(3), exit_status(-9), exit_status(-15)) == (0, 3, 137, 143)


def test_fake_processes_are_validated() -> None:
    assert parse_fake_processes({"1": {"42": 100}}, 2) == {1: (FakeProcess(42, 100),)}
    assert parse_fake_processes({"0": {"7": {"mib": 5, "until": 1.5e9}}}, 1) == {0: (FakeProcess(7, 5, 1.5e9),)}
    for bad, match in (([], "JSON object"), ({"2": {}}, "GPU '2'"), ({"0": []}, "GPU 0"),
                       ({"0": {"x": 1}}, "not a pid"), ({"0": {"5": -1}}, "MiB"), ({"0": {"5": True}}, "MiB"),
                       ({"0": {"5": {"until": 1}}}, "expected MiB"), ({"0": {"5": {"mib": 1, "x": 1}}}, "keys"),
                       ({"0": {"5": {"mib": 1, "until": "soon"}}}, "until"),
                       ({"0": {"5": {"mib": 1, "until": True}}}, "until")):
        with pytest.raises(ValueError, match=match):
            parse_fake_processes(bad, 2)


def test_fake_processes_file_is_reread_and_dead_pids_are_dropped(tmp_path: Path) -> None:
    import os
    f = tmp_path / "p.json"
    src = FakeGpuSource("2x16GiB", "h", str(f))
    assert [u.processes for u in src.usage()] == [(), ()]     # missing file: nothing
    f.write_text(json.dumps({"0": {str(os.getpid()): 700, "4194304": 5}}))
    u0, u1 = src.usage()
    assert [(p.pid, p.used_mb) for p in u0.processes] == [(os.getpid(), 700)] and u0.vram_used_mb == 700
    assert [u.processes_visible for u in src.usage()] == [True, True]
    f.write_text("not json")
    assert [u.processes for u in src.usage()] == [(), ()]     # malformed: ignored with a warning
    assert [u.processes_visible for u in src.usage()] == [False, False]   # and the lists are not known


def test_a_fake_process_with_until_is_listed_until_then_whether_it_runs_or_not(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    src = FakeGpuSource("1x16GiB", "h", str(f))
    now = time.time()
    dead = 4194304   # above any pid_max here: no such process
    f.write_text(json.dumps({"0": {str(dead): {"mib": 300, "until": now + 60},
                                   str(os.getpid()): {"mib": 200, "until": now - 1}}}))
    (u,) = src.usage()
    assert [(p.pid, p.used_mb) for p in u.processes] == [(dead, 300)] and u.vram_used_mb == 300
    assert FakeGpuSource("1x16GiB", "h").usage()[0].processes_visible is False   # no --fake-processes
