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
    _witness_keeps_each_victim_over_quota(charges, data)


def _witness_keeps_each_victim_over_quota(charges: list[Charge], data: st.DataObject) -> None:
    """A victim has a witness exactly when it is over quota, and while its witness lives it stays over quota
    whatever else of its team ends."""
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


def _gang(i: int, parts: list[tuple[int, str]]) -> Charge:
    """A lease over ``parts`` ((MiB, model) per GPU): a gang over GPUs of different models when more than one."""
    gpus = tuple(f"g{i}.{n}" for n in range(len(parts)))
    return Charge(id=f"l{i}", team="a", vram_mb=parts[0][0], gpus=gpus, created_at=float(i), model=parts[0][1],
                  per_gpu=tuple((g, mb, model) for g, (mb, model) in zip(gpus, parts)))


def test_a_gang_over_two_models_is_witnessed_by_its_own_models_charges() -> None:
    """Model "big" has a quota of 6 (the team's quota, 100, is roomy). l0, a gang, holds 2 on "big" and 8 on
    another model (10 in all); l1 holds 2 on "big"; l2 (3 on "big") is over the model's quota while both
    live (7 > 6): its witness is both. Counting l0's 10 in all as "big" (its first GPU's model), l0 alone
    was the witness, and with l1 gone l2 is in quota (5 <= 6) though the witness still stood."""
    teams = Membership([Team("a", quota_mb=100, members=("a-*",), quota_by_model=(("big", 6),))])
    charges = [_gang(0, [(2, "big"), (8, "")]), _gang(1, [(2, "big")]), _gang(2, [(3, "big")])]
    assert not in_quota(charges, teams)["l2"]
    assert sorted(c.id for c in quota_witness(charges[2], charges, teams) or []) == ["l0", "l1"]
    assert in_quota([charges[0], charges[2]], teams)["l2"]


def test_a_gang_over_quota_on_its_second_gpus_model_has_a_witness() -> None:
    """l1 is a gang whose first GPU is of a model without a quota and whose second is "big": it is over the
    model's quota (6) because of l0 (5 on "big"), so l0 is its witness (not None, as if it were in quota)."""
    teams = Membership([Team("a", quota_mb=100, members=("a-*",), quota_by_model=(("big", 6),))])
    charges = [_gang(0, [(5, "big")]), _gang(1, [(2, ""), (2, "big")])]
    assert not in_quota(charges, teams)["l1"]
    assert [c.id for c in quota_witness(charges[1], charges, teams) or []] == ["l0"]


PARTS = st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["", "big"])), min_size=1, max_size=2)


@settings(max_examples=300, deadline=None)
@given(leases=st.lists(PARTS, min_size=1, max_size=8), data=st.data())
def test_with_its_witness_alive_a_gang_over_models_stays_over_quota_whatever_else_ends(
        leases: list[list[tuple[int, str]]], data: st.DataObject) -> None:
    charges = [_gang(i, parts) for i, parts in enumerate(leases)]
    _witness_keeps_each_victim_over_quota(charges, data)
