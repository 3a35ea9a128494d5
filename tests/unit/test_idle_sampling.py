"""Idle GPUs (issue 31, docs/policies.md "Idle GPUs"), the replica's sampling (``coordinator/replica/idle.py``) over plain
records, with no etcd: a fresh report's utilization is sampled as of when the replica first saw it, a stale or
gone report makes the GPU unknown, and a team's policy overrides the fleet's for its agents."""
from __future__ import annotations

import functools
import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.policy.idle import UNKNOWN, UtilizationHistory
from coordinator.record_fields import InvalidRecord, check_usage, load_record
from coordinator.replica import idle
from coordinator.replica.idle_judged import IdleJudgments
from tests.support.observed import FakeObserved

pytestmark = pytest.mark.unit
K = Keys("/t/")


class FakeMirror:
    def __init__(self) -> None:
        self.kvs: dict[str, list[KV]] = {"usage": [], "leases": [], "teams": []}
        self.lease_changes = 0
        self.changes = 0                     # the usage reports' generation, as ``Mirror.generation``
        self.keys_at = 0                     # ... and ``keys_generation``
        self.put_at: dict[bytes, int] = {}   # each report's generation when last put

    def generation(self, kind: str) -> int:
        return self.changes

    def keys_generation(self, kind: str) -> int:
        return self.keys_at

    def puts_since(self, kind: str, generation: int) -> list[KV]:
        return sorted((kv for kv in self.kvs["usage"] if self.put_at[kv.key] > generation),
                      key=lambda kv: -self.put_at[kv.key])

    def flat(self, key: bytes) -> KV | None:
        return next((kv for kv in self.kvs["usage"] if kv.key == key), None)

    def put_usage(self, kv: KV) -> None:
        self.changes += 1
        if kv.key not in self.put_at:
            self.keys_at = self.changes
        self.put_at[kv.key] = self.changes
        self.kvs["usage"] = [*(other for other in self.kvs["usage"] if other.key != kv.key), kv]

    def drop_usage(self, key: bytes) -> None:
        if self.put_at.pop(key, None) is not None:
            self.changes += 1
            self.keys_at = self.changes
        self.kvs["usage"] = [kv for kv in self.kvs["usage"] if kv.key != key]

    def lease_stamps(self) -> dict[str, int]:
        return {"h1": self.lease_changes} if self.kvs["leases"] else {}   # (every lease here is on h1)

    def host_items(self, kind: str, host: str) -> list[KV]:
        return [kv for kv in self.items(kind) if f"/{host}/".encode() in kv.key]

    def items(self, kind: str) -> list[KV]:
        return list(self.kvs.get(kind, []))

    def all_host_items(self, kind: str) -> list[KV]:
        return self.items(kind)

    def get(self, key: bytes) -> KV | None:
        return None


def ctx(**config: Any) -> Any:
    observed = FakeObserved()
    c = SimpleNamespace(config=CoordinatorConfig(**config), mirror=FakeMirror(), observed=observed, keys=K,
                        utilization=UtilizationHistory(), idle_judgments=IdleJudgments(), age=0.0)
    c.usage_age = lambda kv: c.age
    return c


def put_usage(c: Any, rev: int, pct: Any, host: str = "h1", gpus: tuple[str, ...] = ("GPU-0",)) -> None:
    """``host``'s report (the others' stay): ``pct`` on each of ``gpus``."""
    doc = {"ts": 0.0, "interval_s": 1.0,
           "gpus": [{"uuid": uuid, "vram_used_mb": 0, "utilization_pct": pct} for uuid in gpus]}
    c.mirror.put_usage(KV(K.usage(host), json.dumps(doc).encode(), 1, rev, 1, 0))


def put_lease(c: Any, agent: str = "a", lease_id: str = "l1") -> None:
    doc = {"id": lease_id, "host": "h1", "gpu_uuid": "GPU-0", "gpu_index": 0, "agent": agent, "session_id": "1f",
           "vram_mb": 100, "priority": 0, "preemptible": True, "request_id": lease_id, "token": 1, "created_at": 0.0}
    kv = KV(K.lease("h1", "GPU-0", lease_id), json.dumps(doc).encode(), 5, 5, 1, 0)
    c.mirror.kvs["leases"].append(kv)
    c.mirror.lease_changes += 1
    c.observed.saw(kv.key, kv.create_revision)   # (the replica's watch sees it now)


def test_a_fresh_report_is_sampled_as_first_seen_and_a_stale_or_gone_one_is_unknown(monkeypatch: Any) -> None:
    c = ctx(idle_after_s=10.0, idle_action="evict")
    monkeypatch.setattr(idle.clock, "monotonic", lambda: c.observed.now)
    put_usage(c, 2, 0)
    put_lease(c)
    idle.sample(c)
    assert c.utilization.points("GPU-0") == ((100.0, 0),)
    c.observed.now = 111.0
    assert idle.judged(c)["l1"][0].idle
    c.age = 10.0          # no new report for 10 of the node's 1 s intervals: stale
    idle.sample(c)
    assert c.utilization.current("GPU-0") == UNKNOWN and not idle.judged(c)["l1"][0].idle
    c.age = 0.0
    put_usage(c, 3, 1)
    idle.sample(c)
    assert c.utilization.points("GPU-0")[-1] == (111.0, 1)
    c.mirror.drop_usage(K.usage("h1"))   # the host's report is gone
    idle.sample(c)
    assert c.utilization.points("GPU-0") == () and not idle.judged(c)["l1"][0].idle


def test_a_report_without_a_figure_is_unknown(monkeypatch: Any) -> None:
    c = ctx(idle_after_s=1.0)
    monkeypatch.setattr(idle.clock, "monotonic", lambda: c.observed.now)
    for bad in (None, True, "0"):
        put_usage(c, 2, bad)
        idle.sample(c)
        assert c.utilization.current("GPU-0") == UNKNOWN


def test_a_teams_policy_overrides_the_fleets_for_its_agents(monkeypatch: Any) -> None:
    c = ctx(idle_after_s=10.0, idle_action="evict")
    monkeypatch.setattr(idle.clock, "monotonic", lambda: c.observed.now)
    team = {"name": "calm", "members": ["b"], "idle_action": "warn", "idle_after_s": 50.0}
    c.mirror.kvs["teams"] = [KV(K.team("calm"), json.dumps(team).encode(), 1, 1, 1, 0)]
    put_usage(c, 2, 0)
    put_lease(c, "a", "l1")
    put_lease(c, "b", "l2")
    idle.sample(c)
    c.observed.now = 120.0
    found = idle.judged(c)
    assert found["l1"][0].idle and found["l1"][0].action == "evict" and found["l1"][1] == "default"
    assert not found["l2"][0].idle and found["l2"][0].action == "warn" and found["l2"][1] == "calm"
    c.observed.now = 151.0
    assert idle.judged(c)["l2"][0].idle
    off = ctx()   # the fleet's default: off, and no team sets a window
    assert idle.judged(off) == {}
    c.config, c.mirror.kvs["teams"] = CoordinatorConfig(), []   # turned off: nothing kept
    assert idle.judged(c) == {} and not c.idle_judgments._hosts


HOSTS = ("h1", "h2")
GPU_SETS = ((0,), (0, 1), (1,))   # the GPUs a host's report names (a report may name other GPUs later)
steps = st.lists(st.one_of(
    # a new version of a host's report: its GPUs, this percent on each
    st.tuples(st.just("report"), st.tuples(st.sampled_from(HOSTS), st.sampled_from(GPU_SETS), st.integers(0, 100))),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 2.0, 10.0])),  # time passes: the reports go stale 3 s after
    st.tuples(st.just("team"), st.sampled_from([0.0, 5.0, 50.0])),   # a team's idle threshold (0: none)
    st.tuples(st.just("gone"), st.sampled_from(HOSTS)),
    st.tuples(st.just("sample"), st.just(0)),
), max_size=30)


def _age(observed: FakeObserved, kv: KV) -> float:
    return max(0.0, observed.now - observed.saw(kv.key, kv.mod_revision))


def _uuids(host: str, gpus: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(f"{host}-GPU-{i}" for i in gpus)


@settings(max_examples=300)
@given(steps)
@example([("report", ("h1", (0,), 5)), ("sample", 0), ("wait", 10.0), ("sample", 0)])    # the same report, now stale
@example([("report", ("h1", (0,), 5)), ("sample", 0), ("report", ("h2", (0,), 5)), ("sample", 0), ("wait", 2.0),
          ("sample", 0), ("report", ("h2", (0,), 6)), ("sample", 0)])   # one report goes stale while another is put
@example([("report", ("h1", (0,), 3)), ("sample", 0), ("report", ("h1", (0,), 8)), ("sample", 0), ("team", 5.0),
          ("sample", 0)])  # a new band
@example([("report", ("h1", (0, 1), 3)), ("sample", 0), ("report", ("h1", (0,), 3)), ("sample", 0)])  # a GPU left
@example([("report", ("h1", (0,), 3)), ("sample", 0), ("gone", "h1"), ("report", ("h2", (0,), 3)),
          ("sample", 0)])   # one report went and another came: as many reports as before
def test_sampling_that_skips_reports_it_sampled_unchanged_keeps_the_same_history(plan: list[tuple[str, Any]]) -> None:
    """``sample`` with its memory between passes (as ``IdleReclaim`` runs it) samples only the reports put since its
    last pass and those gone stale since, while no report came or went and the thresholds held; else it skips a
    report whose version, staleness and thresholds it sampled before, and looks for GPUs without a report only when
    a report came, went or changed its GPUs: the history it keeps is the one sampling everything keeps, GPU by
    GPU. (A report's age is the test's clock less when the replica first saw it, as ``ReplicaContext.usage_age``.)"""
    every_gpu = [uuid for host in HOSTS for uuid in _uuids(host, (0, 1))]
    with pytest.MonkeyPatch.context() as mp:
        plain, memo = ctx(idle_after_s=10.0, idle_below_pct=10.0), ctx(idle_after_s=10.0, idle_below_pct=10.0)
        for c in (plain, memo):
            c.usage_age = functools.partial(_age, c.observed)
        mp.setattr(idle.clock, "monotonic", lambda: plain.observed.now)
        last = idle.SampleMemory()
        rev = 1
        for op, arg in plan:
            for c in (plain, memo):
                if op == "report":
                    host, gpus, pct = arg
                    put_usage(c, rev + 1, pct, host, _uuids(host, gpus))
                elif op == "wait":
                    c.observed.now += arg
                elif op == "team":
                    team = {"name": "t", "members": ["a"], "idle_below_pct": arg}
                    c.mirror.kvs["teams"] = [KV(K.team("t"), json.dumps(team).encode(), 1, rev + 1, 1, 0)] \
                        if arg else []
                elif op == "gone":
                    c.mirror.drop_usage(K.usage(arg))
            rev += 1
            if op == "sample":
                idle.sample(plain)
                idle.sample(memo, last)
                for uuid in every_gpu:
                    assert memo.utilization.points(uuid) == plain.utilization.points(uuid), uuid
                    assert memo.utilization.current(uuid) == plain.utilization.current(uuid), uuid
            plain.observed.now += 1.0
            memo.observed.now = plain.observed.now


def _full_parse(value: bytes) -> idle.Parsed:
    """A report parsed whole: ``_parse`` must say what this says of every value."""
    try:
        doc = check_usage(load_record(value, "usage"))
    except InvalidRecord:
        return None
    return float(doc.get("interval_s", 5.0)), tuple(   # type: ignore[arg-type]
        (str(g.get("uuid", "")), g.get("utilization_pct", -1) if type(g.get("utilization_pct", -1)) is int else -1)
        for g in doc.get("gpus", ()))   # type: ignore[union-attr]


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 200), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=4))
gpu = st.fixed_dictionaries({"uuid": st.one_of(st.sampled_from(["GPU-0", "GPU-1"]), json_leaf),
                             "vram_used_mb": st.one_of(st.integers(0, 100), json_leaf)},
                            optional={"utilization_pct": st.one_of(st.integers(-1, 100), json_leaf)})
report = st.fixed_dictionaries({}, optional={"gpus": st.one_of(st.lists(gpu, max_size=3), json_leaf),
                                             "interval_s": st.one_of(st.floats(0.5, 10), json_leaf),
                                             "ts": st.one_of(st.floats(-1e12, 1e12), st.integers(), json_leaf),
                                             "zz": json_leaf})
tails = st.sampled_from([b"", b',"ts":1}', b',"ts":-0.5e3}', b',"ts":01}', b',"ts":1.}', b',"ts":"x"}', b'}',
                         b',"ts":1}}', b' ,"ts":1}'])


@settings(max_examples=400)
@given(report, st.booleans(), st.binary(max_size=6), tails, st.integers(0, 12))
@example({"gpus": [], "ts": 1.0}, True, b"", b"", 0)
@example({}, True, b"{", b',"ts":1}', 1)          # ``{,"ts":1}``: not JSON, though ``{}`` is
@example({}, True, b"{ ", b',"ts":1}', 1)         # nor ``{ ,"ts":1}``
def test_a_report_is_sampled_as_it_parses_whole_whatever_its_ts(doc: dict[str, Any], sorted_keys: bool, junk: bytes,
                                                                  tail: bytes, cut: int) -> None:
    """``_parse`` parses a report less its last ``ts`` member (and caches that): what it says of any value, a
    daemon's report or not, valid or not, is what parsing the whole value says."""
    value = json.dumps(doc, sort_keys=sorted_keys, separators=(",", ":")).encode()
    for v in (value, value[:-1] + tail if tail else value, junk + tail, value[:cut] + tail):
        assert idle._parse(KV(b"/t/usage/h1", v, 1, 1, 1, 0)) == _full_parse(v), v
