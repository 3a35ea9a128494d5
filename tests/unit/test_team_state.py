"""G11 in a round: the teams' state an admission round is decided against, as the replica's mirror shows it.
Each round reads it; what it derives from the teams' records is kept between rounds, so these check that every
change the watch brings (a team set, changed or deleted; a lease granted or ended; the mirror reset) is in the
next round's state."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.etcd.types import KV, WatchBatch, WatchEvent
from coordinator.keys import Keys
from coordinator.policy.team_admission import TeamState, over_quota_mark, team_use
from coordinator.policy.teams import DEFAULT_TEAM, Membership, Team
from coordinator.records import InvalidRecord, VramLease, dumps
from coordinator.replica.mirror import Mirror
from coordinator.replica.teams import build_team_state, membership_of, mirror_team_state
from tests.support.planner_calls import HOST, session
from tests.support.planner_calls import host_view as _host

KEYS = Keys("/t/")


class _Etcd:
    """A mirror fed by watch batches, one revision a write, as the replica's watch feeds it."""

    def __init__(self) -> None:
        self.mirror = Mirror(KEYS)
        self.revision = 1
        self.mirror.reset([], self.revision)

    def put(self, key: bytes, value: bytes) -> None:
        self.revision += 1
        kv = KV(key, value, self.revision, self.revision, 1, 0)
        self.mirror.apply(WatchBatch(self.revision, (WatchEvent("PUT", kv, None),)))

    def delete(self, key: bytes) -> None:
        self.revision += 1
        kv = KV(key, b"", 0, self.revision, 0, 0)
        self.mirror.apply(WatchBatch(self.revision, (WatchEvent("DELETE", kv, None),)))

    def team(self, team: Team) -> None:
        self.put(KEYS.team(team.name), dumps(team.to_json()))

    def lease(self, lease_id: str, agent: str, vram_mb: int, host: str = "h", gpu: int = 0) -> bytes:
        lease = VramLease(id=lease_id, host=host, gpu_uuid=f"GPU-{gpu}", gpu_index=gpu, agent=agent, session_id="s",
                          vram_mb=vram_mb, priority=0, preemptible=True, request_id=f"r-{lease_id}", token=1,
                          created_at=1.7e9)
        key = KEYS.lease(host, f"GPU-{gpu}", lease_id)
        self.put(key, dumps(lease.to_json()))
        return key


def test_the_mirrors_team_state_follows_every_team_change_between_rounds() -> None:
    etcd = _Etcd()
    assert mirror_team_state(etcd.mirror) is None              # no team: nothing is charged
    etcd.team(Team("research", limit_mb=4096, members=("r-*",)))
    etcd.lease("l1", "r-1", 1024)
    etcd.lease("l2", "bob", 512)
    state = mirror_team_state(etcd.mirror)
    assert state is not None and state.revision == etcd.revision
    assert state.membership.team_of("r-1") == "research" and state.limited("research")
    assert dict(state.used) == {"research": 1024, DEFAULT_TEAM: 512} and state.counted == {"l1", "l2"}

    # An operator changes the team: the next round sees the new members and limit.
    etcd.team(Team("research", members=("r-*", "bob")))
    state = mirror_team_state(etcd.mirror)
    assert state is not None and not state.limited("research")
    assert dict(state.used) == {"research": 1536}

    # A second team, then the first one deleted: its agents fall to default.
    etcd.team(Team("infra", limit_mb=2048, members=("i-*",)))
    etcd.delete(KEYS.team("research"))
    state = mirror_team_state(etcd.mirror)
    assert state is not None and state.membership.team_of("r-1") == DEFAULT_TEAM
    assert state.limited("infra") and dict(state.used) == {DEFAULT_TEAM: 1536}

    # The last team deleted: nothing is charged again.
    etcd.delete(KEYS.team("infra"))
    assert mirror_team_state(etcd.mirror) is None

    # A reset (the watch lost history) with a team in it is read afresh.
    team = Team("ops", limit_mb=1024, members=("bob",))
    etcd.mirror.reset([KV(KEYS.team("ops"), dumps(team.to_json()), 2, 2, 1, 0)], etcd.revision)
    state = mirror_team_state(etcd.mirror)
    assert state is not None and state.limited("ops") and dict(state.used) == {}


def test_the_mirrors_team_state_counts_the_leases_granted_and_ended_since_the_last_round() -> None:
    etcd = _Etcd()
    etcd.team(Team("research", limit_mb=1 << 20, members=("r-*",)))
    first = etcd.lease("l1", "r-1", 1000)
    state = mirror_team_state(etcd.mirror)
    assert state is not None and dict(state.used) == {"research": 1000}
    etcd.lease("l2", "r-2", 200)
    etcd.delete(first)
    state = mirror_team_state(etcd.mirror)
    assert state is not None and dict(state.used) == {"research": 200} and state.counted == {"l2"}
    # A ledger bump is in the next round's state (its mod_revision is what the grant compares).
    etcd.put(KEYS.team_ledger("research"), dumps({"seq": 3}))
    state = mirror_team_state(etcd.mirror)
    assert state is not None and state.ledger("research") == (etcd.revision, 3)


_HOSTS = ("h1", "h2", "h3")
_AGENTS = ("r-1", "r-2", "i-1", "bob")
_TEAMS = (Team("research", limit_mb=1 << 20, members=("r-*",)), Team("research", members=("r-*", "bob")),
          Team("infra", limit_mb=4096, members=("i-*",)))
_op = st.one_of(
    st.tuples(st.just("grant"), st.sampled_from(_HOSTS), st.integers(0, 5), st.sampled_from(_AGENTS),
              st.integers(0, 4096), st.integers(1, 2)),
    st.tuples(st.just("end"), st.integers(0, 5)),
    st.tuples(st.just("team"), st.integers(0, len(_TEAMS) - 1)),
    st.tuples(st.just("untag"), st.sampled_from(("research", "infra"))),
    st.tuples(st.just("garbage"), st.sampled_from(_HOSTS)),
    st.tuples(st.just("reset")),
)


def _from_scratch(mirror: Mirror) -> TeamState | None:
    """What a round would decide against if it parsed every team and lease again (the etcd path's way)."""
    leases = []
    for kv in mirror.all_host_items("leases"):
        try:
            lease = VramLease.from_kv(kv)
        except InvalidRecord:
            continue
        leases.append(lease)
    return build_team_state(membership_of(mirror.items("teams")), mirror.items("teamledgers"), leases,
                            mirror.revision)


def _seen(state: TeamState | None) -> tuple[Any, ...] | None:
    """What a round reads of a teams' state (a team using nothing is one not listed; the fleet's lease records,
    which reclaim reads)."""
    if state is None:
        return None
    return (state.membership.teams, {t: mb for t, mb in state.used.items() if mb}, state.counted,
            dict(state.ledgers), state.revision, sorted((x.id, x.gpu_uuid, x.mod_revision) for x in state.records()))


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_the_team_state_kept_between_rounds_is_the_one_read_afresh(ops: list[tuple[Any, ...]]) -> None:
    """Whatever the watch brings between rounds (grants on any host, gangs, ends, team changes and deletes,
    a malformed lease record, a reset), the teams' use and the leases counted are those of a fresh parse."""
    etcd = _Etcd()
    keys: dict[int, list[bytes]] = {}
    for op in ops:
        if op[0] == "grant":
            _, host, slot, agent, vram, gpus = op
            for key in keys.pop(slot, []):
                etcd.delete(key)
            keys[slot] = [etcd.lease(f"l{slot}", agent, vram, host=host, gpu=g) for g in range(gpus)]
        elif op[0] == "end":
            for key in keys.pop(op[1], []):
                etcd.delete(key)
        elif op[0] == "team":
            etcd.team(_TEAMS[op[1]])
        elif op[0] == "untag":
            etcd.delete(KEYS.team(op[1]))
        elif op[0] == "garbage":
            etcd.put(KEYS.lease(op[1], "GPU-9", "junk"), b"{not json")
        else:
            everything = [kv for (_, _), bucket in etcd.mirror._buckets.items() for kv in bucket.values()]
            etcd.mirror.reset([*everything, *etcd.mirror._flat.values()], etcd.revision)
        assert _seen(mirror_team_state(etcd.mirror)) == _seen(_from_scratch(etcd.mirror))


def test_a_lease_of_the_hosts_snapshot_that_the_later_teams_copy_no_longer_has_is_not_counted() -> None:
    """The round's host snapshot (older) still holds lease ``gone`` (written at revision 50) of team t; the
    teams' copy, read at revision 100, no longer has it: it ended in between, and t's use is the copy's. A
    record written after the copy (revision 150) and this round's grant (no revision yet) are counted."""
    def lease(lid: str, gpu: int, mb: int, mod_revision: int) -> VramLease:
        s = session("a")
        return VramLease(id=lid, host=HOST, gpu_uuid=f"GPU-sim-{HOST}-{gpu}", gpu_index=gpu, agent="a",
                         session_id=s.session_id, vram_mb=mb, priority=0, preemptible=True, request_id=lid, token=1,
                         created_at=1.0, etcd_lease=s.etcd_lease, mod_revision=mod_revision)
    state = TeamState(Membership([Team("t", quota_mb=8192, members=("a",))]), {"t": 4096}, frozenset({"held"}),
                      {"t": (90, 3)}, 100)
    view = _host("2x16GiB", [lease("held", 0, 4096, 40), lease("gone", 1, 8192, 50)])
    assert team_use(state, view, "t") == 4096
    assert over_quota_mark(state, view, "a", 4096) is False
    view = _host("2x16GiB", [lease("held", 0, 4096, 40), lease("newer", 1, 2048, 150), lease("granted", 1, 1024, 0)])
    assert team_use(state, view, "t") == 4096 + 2048 + 1024
