"""The replica's table of sessions it keeps alive (``replica/session_table.SessionTable``): a session is never due
before its TTL has passed since its last touch, and is due within one tick after; adoption picks one live
replica per session, and moves few sessions when a replica joins."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.records import SessionInfo
from coordinator.replica.session_table import TICK_S, SessionTable, adopter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def info(n: int) -> SessionInfo:
    return SessionInfo("agent", f"s{n}", "h1", n + 1, 5)


def test_a_touch_moves_the_deadline_and_a_drop_forgets() -> None:
    clock = Clock()
    table = SessionTable(clock)
    table.touch(info(1), 5)
    clock.t += 4
    table.touch(info(1), 5)
    clock.t += 4
    assert table.expired() == []
    clock.t += 1 + TICK_S
    assert [i.session_id for i in table.expired()] == ["s1"]
    table.drop("s1")
    assert table.expired() == [] and len(table) == 0


def test_adopted_stays_adopted_until_a_touch_that_owns_it() -> None:
    table = SessionTable(Clock())
    table.touch(info(1), 5, owned=False)
    t = table.get("s1")
    assert t is not None and not t.owned
    table.touch(info(1), 5)
    assert t.owned


ops = st.lists(st.tuples(st.sampled_from(["touch", "drop", "wait"]), st.integers(0, 4),
                         st.floats(min_value=0.0, max_value=3.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(min_value=1, max_value=5))
def test_never_due_before_its_ttl_and_due_within_a_tick_after(steps: list[tuple[str, int, float]], ttl: int) -> None:
    clock = Clock()
    table = SessionTable(clock)
    touched: dict[str, float] = {}
    for op, n, dt in steps:
        if op == "touch":
            table.touch(info(n), ttl)
            touched[f"s{n}"] = clock.t
        elif op == "drop":
            table.drop(f"s{n}")
            touched.pop(f"s{n}", None)
        else:
            clock.t += dt
        due = {i.session_id for i in table.expired()}
        assert due <= set(touched)
        for sid, at in touched.items():
            if sid in due:
                assert clock.t >= at + ttl - 1e-9, (sid, at, clock.t)
            else:
                assert clock.t < at + ttl + TICK_S + 1e-9, (sid, at, clock.t)


def test_adoption_picks_one_replica_and_a_newcomer_takes_only_its_share() -> None:
    sessions = [f"s{i}" for i in range(2000)]
    before = {s: adopter(s, ["r1", "r2", "r3"]) for s in sessions}
    after = {s: adopter(s, ["r1", "r2", "r3", "r4"]) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "r4" for s in moved)
    assert 300 < len(moved) < 700       # about a quarter
