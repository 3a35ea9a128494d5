"""The witness of a reclaim victim (``policy/reclaim_guard.py``): the fewest older leases of its team whose
presence alone keeps it over quota, and a Hypothesis property: with every witness lease still there, the
victim is over quota whatever else of its team ends or is granted."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.reclaim_guard import quota_witness
from coordinator.policy.teams import Charge, Membership, Team, in_quota

TEAMS = Membership([Team("a", quota_mb=10, members=("a-*",), quota_by_model=(("big", 6),))])


def _c(i: int, mb: int, model: str = "", team: str = "a") -> Charge:
    return Charge(id=f"l{i}", team=team, vram_mb=mb, gpus=(f"g{i}",), created_at=float(i), model=model)


def test_the_witness_is_the_fewest_older_leases_largest_first() -> None:
    charges = [_c(0, 2), _c(1, 7), _c(2, 3), _c(3, 4)]
    # l3 (4) is over the quota of 10 while more than 6 MiB of older leases live: l1 (7) alone does it.
    assert [c.id for c in quota_witness(charges[3], charges, TEAMS) or []] == ["l1"]


def test_a_lease_over_quota_on_its_own_needs_no_witness_and_one_in_quota_has_none() -> None:
    charges = [_c(0, 4), _c(1, 11)]
    assert quota_witness(charges[1], charges, TEAMS) == []
    assert quota_witness(charges[0], charges, TEAMS) is None


def test_a_model_quota_may_give_the_smaller_witness() -> None:
    charges = [_c(0, 3), _c(1, 3, "big"), _c(2, 3), _c(3, 4, "big")]
    # Fleet: 4 + older > 10 needs all three older ones; model "big": 4 + 3 > 6 needs l1 alone.
    assert [c.id for c in quota_witness(charges[3], charges, TEAMS) or []] == ["l1"]


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["", "big"])), min_size=1, max_size=8),
       data=st.data())
def test_with_its_witness_alive_a_victim_stays_over_quota_whatever_else_ends(sizes: list[tuple[int, str]],
                                                                           data: st.DataObject) -> None:
    charges = [_c(i, mb, model) for i, (mb, model) in enumerate(sizes)]
    marks = in_quota(charges, TEAMS)
    for victim in charges:
        witness = quota_witness(victim, charges, TEAMS)
        assert (witness is None) == marks[victim.id]
        if witness is None:
            continue
        keep = {c.id for c in witness} | {victim.id}
        ended = data.draw(st.sets(st.sampled_from([c.id for c in charges if c.id not in keep]) if
                                  len(charges) > len(keep) else st.nothing()))
        left = [c for c in charges if c.id not in ended]
        assert not in_quota(left, TEAMS)[victim.id]
