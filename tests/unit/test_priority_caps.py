"""Priority caps (pure): parsing ``[priority_caps]`` of a partition spec, and which entry caps an agent."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.policy.partition import PartitionError, parse_spec
from coordinator.policy.partition.caps import (
    TLS_DEFAULT,
    UNCAPPED,
    PriorityCap,
    cap_for,
    check,
    parse_caps,
)

pytestmark = pytest.mark.unit

CAPS = parse_caps({"agent-a": {"max_priority": 100, "non_preemptible": True}, "agent-*": {"max_priority": 5},
                   "agent-b*": {"max_priority": 7}, "*": {"max_priority": -1}})


def test_an_exact_name_wins_then_the_longest_pattern_then_the_default() -> None:
    assert cap_for("agent-a", CAPS, TLS_DEFAULT) == (PriorityCap(100, True), "agent-a")
    assert cap_for("agent-bee", CAPS, TLS_DEFAULT) == (PriorityCap(7), "agent-b*")
    assert cap_for("agent-c", CAPS, TLS_DEFAULT) == (PriorityCap(5), "agent-*")
    assert cap_for("trainer", CAPS, TLS_DEFAULT) == (PriorityCap(-1), "*")
    assert cap_for("trainer", tuple(c for c in CAPS if c[0] == "agent-a"), TLS_DEFAULT) == (TLS_DEFAULT, "the default")
    assert cap_for("x", (), UNCAPPED)[0] == UNCAPPED


@given(agent=st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True), priority=st.integers(-10**6, 10**6),
       preemptible=st.booleans())
def test_check_refuses_exactly_what_is_above_the_cap(agent: str, priority: int, preemptible: bool) -> None:
    cap, _ = cap_for(agent, CAPS, TLS_DEFAULT)
    err = check(agent, "h1", priority, preemptible, CAPS, TLS_DEFAULT)
    allowed = priority <= cap.max_priority and (preemptible or cap.non_preemptible)
    assert (err is None) == allowed
    if err is not None:
        assert err.code == "PERMISSION_DENIED" and err.field in ("priority", "preemptible")
        assert err.message.startswith(f"{err.field}: ")
        assert (f"max_priority {cap.max_priority}" if err.field == "priority" else "non_preemptible = false") \
            in err.message, err.message


def test_the_messages_name_the_field_and_the_cap() -> None:
    err = check("agent-c", "h1", 6, True, CAPS, TLS_DEFAULT)
    assert err is not None and err.message.startswith("priority: 6 is above the cap of agent 'agent-c'")
    assert "max_priority 5" in err.message and "'agent-*'" in err.message
    err = check("agent-c", "h1", 0, False, CAPS, TLS_DEFAULT)
    assert err is not None and err.field == "preemptible" and "non_preemptible = false" in err.message
    err = check("x" * 200, "h1", 1, True, (), TLS_DEFAULT)
    assert err is not None and "x" * 33 not in err.message and "the default" in err.message


def test_a_spec_carries_its_caps_and_refuses_bad_ones_naming_the_entry() -> None:
    spec = parse_spec({"host": "h1", "priority_caps": {"agent-a": {"max_priority": 10}}})
    assert spec.priority_caps == (("agent-a", PriorityCap(10, False)),)
    assert parse_spec(spec.to_json()) == spec
    assert "priority_caps" not in parse_spec({"host": "h1"}).to_json()
    bad = [({"a/b": {"max_priority": 1}}, "priority_caps.'a/b'"),
           ({"a": {"max_priority": 10**7}}, "priority_caps.a.max_priority"),
           ({"a": {"max_priority": True}}, "priority_caps.a.max_priority"),
           ({"a": {}}, "priority_caps.a.max_priority"),
           ({"a": {"max_priority": 1, "non_preemptible": "yes"}}, "priority_caps.a.non_preemptible"),
           ({"a": {"max_priority": 1, "bogus": 1}}, "priority_caps.a.bogus"),
           ({"a": 5}, "priority_caps.a"), ([1], "priority_caps")]
    for caps, field in bad:
        with pytest.raises(PartitionError) as info:
            parse_spec({"host": "h1", "priority_caps": caps})
        assert info.value.field == field, (caps, info.value)
