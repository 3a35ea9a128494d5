"""Fair service (pure, a fake clock): the per-identity token bucket, the cap on open streams, how many
refused calls are held before their answer, and what a call costs."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors
from coordinator.security import limits
from coordinator.security.limits import COSTS, KEPT_PER_TOKEN, Limits, cost

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_allows_its_burst_then_its_rate_and_names_the_limit() -> None:
    clock = Clock()
    lim = Limits(10.0, 20, 4, clock)
    for _ in range(20):
        lim.take("a")
    with pytest.raises(errors.CapacityError) as info:
        lim.take("a")
    assert info.value.field == "rate" and info.value.message.startswith("rate: a is over its limit of 10 calls")
    lim.take("b")                       # another identity has its own bucket
    clock.now += 0.1                    # one token back
    lim.take("a")
    with pytest.raises(errors.CapacityError):
        lim.take("a")
    clock.now += 100                    # never more than the burst
    for _ in range(20):
        lim.take("a")
    with pytest.raises(errors.CapacityError):
        lim.take("a")
    clock.now += 1.0
    with pytest.raises(errors.CapacityError):
        lim.take("a", cost=11)          # an expensive call needs its whole cost
    lim.take("a", cost=10)
    Limits(0, 1, 1, clock).take("a", cost=10**9)   # 0: no limit


@given(gaps=st.lists(st.floats(0, 0.5), min_size=1, max_size=200))
def test_over_any_stretch_an_identity_gets_at_most_burst_plus_rate_times_time(gaps: list[float]) -> None:
    clock = Clock()
    lim = Limits(10.0, 5, 1, clock)
    granted = 0
    for gap in gaps:
        clock.now += gap
        try:
            lim.take("a")
            granted += 1
        except errors.CapacityError:
            pass
    assert granted <= 5 + 10.0 * clock.now + 1e-6


def test_streams_are_capped_per_identity_and_counted_back() -> None:
    lim = Limits(1.0, 1, 2)
    lim.open_stream("a")
    lim.open_stream("a")
    with pytest.raises(errors.CapacityError) as info:
        lim.open_stream("a")
    assert info.value.field == "streams" and "max_streams_per_identity" in info.value.message
    lim.open_stream("b")
    lim.close_stream("a")
    lim.open_stream("a")
    for _ in range(3):
        lim.close_stream("a")
    assert lim.streams("a") == 0 and lim.streams("b") == 1


def test_refused_calls_held_are_bounded_per_identity_in_all_and_by_size() -> None:
    lim = Limits(1.0, 1, 1)
    assert all(lim.hold("a", 10) for _ in range(limits.MAX_HELD))
    assert not lim.hold("a", 10)
    assert not lim.hold("b", limits.MAX_HELD_BYTES)
    lim.release_held("a")
    assert lim.hold("a", 10)
    many = Limits(1.0, 1, 1)
    held = sum(many.hold(f"id-{i}", 10) for i in range(limits.MAX_HELD_ALL + 10))
    assert held == limits.MAX_HELD_ALL


def test_a_keepalive_of_many_sessions_costs_by_its_sessions_and_other_calls_as_before() -> None:
    def request(n: int) -> pb.KeepAliveSessionsRequest:
        return pb.KeepAliveSessionsRequest(sessions=[pb.SessionRef(agent="a", session_id=f"{i:016x}")
                                                     for i in range(n)])
    assert cost("KeepAliveSessions", request(1)) == 1
    assert cost("KeepAliveSessions", request(KEPT_PER_TOKEN)) == 2
    assert cost("KeepAliveSessions", request(10 * KEPT_PER_TOKEN + 1)) == 11
    assert cost("KeepAliveSessions", None) == 1   # the stream's opening
    assert cost("GetStatus", None) == COSTS["GetStatus"] and cost("Acquire", pb.AcquireRequest()) == 1
