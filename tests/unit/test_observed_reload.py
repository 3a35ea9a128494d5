"""``Observed.reload``: a state read again keeps the first-seen time of every version it had seen (an eviction
notice's grace, a queue entry's wait, a report's age run on across a watch's restart), starts the clock for
versions it had not, and forgets keys the read no longer has. Against a model: ``saw`` of each key, then
dropping the rest (what the replica did before, in two passes). Pure logic."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.replica.observed import Observed

pytestmark = pytest.mark.unit

KEYS = st.sampled_from([b"k%d" % i for i in range(6)])
VERSIONS = st.lists(st.tuples(KEYS, st.integers(1, 5)), max_size=8)


def _model(before: list[tuple[bytes, int]], read: list[tuple[bytes, int]]) -> dict[bytes, tuple[int, float]]:
    seen: dict[bytes, tuple[int, float]] = {}
    for key, ident in before:
        held = seen.get(key)
        if held is None or held[0] < ident:
            seen[key] = (ident, 1.0)
    last = dict(read)    # a read has each key once: its last version here
    out = {}
    for key, ident in last.items():
        held = seen.get(key)
        out[key] = held if held is not None and held[0] >= ident else (ident, 2.0)
    return out


@given(VERSIONS, VERSIONS)
def test_a_state_read_again_keeps_what_was_seen_of_it_and_nothing_else(
        before: list[tuple[bytes, int]], read: list[tuple[bytes, int]]) -> None:
    o = Observed()
    for key, ident in before:
        o.saw(key, ident, now=1.0)
    o.reload(dict(read).items(), now=2.0)
    want = _model(before, read)
    assert len(o) == len(want)
    for key, (ident, t) in want.items():
        assert o.saw(key, ident, now=3.0) == t, key
