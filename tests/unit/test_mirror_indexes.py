"""The mirror's indexes, whatever the sequence of puts, deletes and resets: the marked lease records
(``Mirror.marked_leases``) are exactly those whose value carries the marker, the ones the host-loss and
time-limit sweeps would find by scanning every lease; a host's stamp (``Mirror.host_stamp``) moves with every
change of one of its keys and with no other host's, and is 0 exactly when it has no key."""
from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator.etcd.types import KV, WatchBatch, WatchEvent
from coordinator.keys import Keys, prefix_range_end
from coordinator.replica import mirror as mirror_module
from coordinator.replica.mirror import MULTI_HOST, TIME_LIMITED, Mirror, mirrored_ranges

KEYS = Keys()
VALUES = (b'{"plain":1}', b'{"hosts":[["h1",[0]]]}', b'{"time_limit_s":60}',
          b'{"hosts":[["h1",[0]]],"time_limit_s":5}')
# (host, gpu, lease id) of lease keys, and a non-lease key of the same host.
LEASE_KEYS = [KEYS.lease(h, g, lid) for h in ("h1", "h2") for g in ("GPU-a", "GPU-b") for lid in ("l1", "l2")]
OTHER_KEYS = [KEYS.queue_entry("h1", "q1"), KEYS.host("h1"), KEYS.usage("h2"), KEYS.partition("h2"),
              KEYS.cordon("h1"), KEYS.sessions() + b"agent/0000000000000001"]
HOST_OF = {**{k: k.decode().split("/")[-3] for k in LEASE_KEYS}, KEYS.queue_entry("h1", "q1"): "h1",
           KEYS.host("h1"): "h1", KEYS.usage("h2"): "h2", KEYS.partition("h2"): "h2", KEYS.cordon("h1"): "h1"}

ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(LEASE_KEYS + OTHER_KEYS), st.sampled_from(VALUES)),
    st.tuples(st.just("delete"), st.sampled_from(LEASE_KEYS + OTHER_KEYS), st.just(b"")),
    st.tuples(st.just("reset"), st.just(b""), st.just(b"")),
), max_size=40)


def _scan(mirror: Mirror, marker: bytes) -> set[bytes]:
    return {kv.key for kv in mirror.all_host_items("leases") if marker in kv.value}


@given(ops)
def test_marked_leases_are_exactly_the_lease_records_carrying_the_marker(steps: list[tuple[str, bytes, bytes]]) -> None:
    mirror = Mirror(KEYS)
    mirror.reset([], 1)
    revision = 1
    for op, key, value in steps:
        revision += 1
        if op == "reset":
            kvs = mirror.all_host_items("leases")   # a resync to the same content
            mirror.reset(kvs, revision)
            continue
        kv = KV(key, value, revision, revision, 1, 0)
        mirror.apply(WatchBatch(revision, (WatchEvent("PUT" if op == "put" else "DELETE", kv, None),)))
        for marker in (MULTI_HOST, TIME_LIMITED):
            assert {kv.key for kv in mirror.marked_leases(marker)} == _scan(mirror, marker)
    for marker in (MULTI_HOST, TIME_LIMITED):
        assert {kv.key for kv in mirror.marked_leases(marker)} == _scan(mirror, marker)
        # The index holds the current version of each record, not one it replaced.
        current = {kv.key: kv for kv in mirror.all_host_items("leases")}
        assert all(current[kv.key] is kv for kv in mirror.marked_leases(marker))


def _has_keys(mirror: Mirror, host: str) -> bool:
    return any(HOST_OF.get(kv.key) == host for kind in ("leases", "queue") for kv in mirror.all_host_items(kind)) \
        or any(mirror.get(k) is not None for k, h in HOST_OF.items() if h == host)


@pytest.mark.parametrize("stamp_of, ignored", [("host_stamp", ()), ("shape_stamp", ("usage",))])
@given(steps=ops)
def test_a_host_stamp_moves_with_its_own_keys_only(stamp_of: str, ignored: tuple[str, ...],
                                                   steps: list[tuple[str, bytes, bytes]]) -> None:
    """``host_stamp`` moves with every change of one of the host's keys and with no other host's, and is 0
    exactly when it has no key. ``shape_stamp`` is the same, except that a change of the host's usage report
    alone leaves it (the fleet gauges follow those at most every ``USAGE_EVERY_S``) but for the deletion of the
    host's last key, so it may be 0 for a host with a usage report alone."""
    mirror = Mirror(KEYS)
    stamp_now = getattr(mirror, stamp_of)
    mirror.reset([], 1)
    revision = 1
    for op, key, value in steps:
        revision += 1
        before = {h: stamp_now(h) for h in ("h1", "h2")}
        if op == "reset":
            mirror.reset([kv for k in HOST_OF if (kv := mirror.get(k)) is not None], revision)
            continue
        kv = KV(key, value, revision, revision, 1, 0)
        existed = mirror.get(key) is not None
        mirror.apply(WatchBatch(revision, (WatchEvent("PUT" if op == "put" else "DELETE", kv, None),)))
        for host in ("h1", "h2"):
            stamp = stamp_now(host)
            if ignored:
                assert _has_keys(mirror, host) or stamp == 0, (host, stamp)
            else:
                assert (stamp == 0) == (not _has_keys(mirror, host)), (host, stamp)
            if HOST_OF.get(key) != host:
                assert stamp == before[host], f"{host}'s {stamp_of} moved with {op} of {key!r}"
            elif KEYS.parse(key)[0] in ignored:
                # Left as it was, unless that was the host's last key: a host without keys has none.
                gone = stamp == 0 and not _has_keys(mirror, host)
                assert stamp == before[host] or gone, f"{host}'s {stamp_of} moved with {op} of {key!r}"
            elif stamp and (op == "put" or existed):
                assert stamp != before[host], f"{host}'s {stamp_of} did not move with {op} of {key!r}"


def _step(mirror: Mirror, op: str, key: bytes, value: bytes, revision: int, kept: Iterable[bytes]) -> None:
    """One step of a plan at ``revision``: a resync to what the mirror holds of the keys ``kept``, or the watch event
    that puts or deletes ``key``."""
    if op == "reset":
        mirror.reset([kv for k in kept if (kv := mirror.get(k)) is not None], revision)
    else:
        kv = KV(key, value, revision, revision, 1, 0)
        mirror.apply(WatchBatch(revision, (WatchEvent("PUT" if op == "put" else "DELETE", kv, None),)))


@given(ops)
def test_every_key_of_a_per_host_kind_is_found_by_its_kind_and_no_other(steps: list[tuple[str, bytes, bytes]]) -> None:
    """``all_host_items(kind)`` (kept by an index of the hosts with a bucket of each kind) is every key of that
    kind, against a plain model of the keys put and deleted."""
    mirror = Mirror(KEYS)
    mirror.reset([], 1)
    model: dict[bytes, bytes] = {}
    revision = 1
    for op, key, value in steps:
        revision += 1
        _step(mirror, op, key, value, revision, model)
        if op == "put":
            model[key] = value
        elif op == "delete":
            model.pop(key, None)
        for kind in ("leases", "queue", "departing", "gpus"):
            found = mirror.all_host_items(kind)
            assert sorted(kv.key for kv in found) == sorted(k for k in model if k.startswith(KEYS.kind(kind)))


@given(st.one_of(
    st.binary(max_size=12).map(lambda tail: KEYS.root() + tail),
    st.tuples(st.sampled_from(["accounting", "gpus", "hosts", "leases", "sessions", "usage", "queue", "teams"]),
              st.binary(max_size=8)).map(lambda kt: KEYS.kind(kt[0]) + kt[1])))
def test_the_mirrors_ranges_hold_every_key_of_the_prefix_once_but_the_accounting(key: bytes) -> None:
    """``mirrored_ranges``: end to end, no key in two (they are read side by side), none of ``accounting/``."""
    ranges = mirrored_ranges(KEYS)
    holding = [r for r in ranges if r.key <= key < r.until]
    assert len(holding) == (0 if key.startswith(KEYS.kind("accounting")) else 1), (key, holding)
    assert all(a.until == b.key or b.key == prefix_range_end(KEYS.kind("accounting")) for a, b in zip(ranges, ranges[1:]))


@given(ops)
def test_a_kinds_keys_generation_moves_when_one_of_its_keys_comes_or_goes_and_never_comes_back(
        steps: list[tuple[str, bytes, bytes]]) -> None:
    """``keys_generation(kind)`` moves whenever the set of keys of ``kind`` changes (and at a reset), never back to a
    value it had; a key rewritten in place moves ``generation`` but leaves it."""
    mirror = Mirror(KEYS)
    mirror.reset([], 1)
    revision = 1
    flat_kinds = ("hosts", "usage", "partitions", "cordons")
    seen: dict[str, set[int]] = {kind: {mirror.keys_generation(kind)} for kind in flat_kinds}
    for op, key, value in steps:
        revision += 1
        before = {kind: (mirror.keys_generation(kind), {kv.key for kv in mirror.items(kind)}) for kind in flat_kinds}
        _step(mirror, op, key, value, revision, HOST_OF)
        for kind in flat_kinds:
            generation, keys = mirror.keys_generation(kind), {kv.key for kv in mirror.items(kind)}
            if keys != before[kind][1] or op == "reset":
                assert generation not in seen[kind], (kind, op, key)
            else:
                assert generation == before[kind][0], (kind, op, key)
            seen[kind].add(generation)


FLAT_KEYS = [f(h) for f in (KEYS.usage, KEYS.host) for h in ("h1", "h2", "h3")]
flat_ops = st.lists(st.tuples(st.sampled_from(["put"] * 6 + ["delete"] * 2 + ["reset"]), st.sampled_from(FLAT_KEYS),
                              st.sampled_from(VALUES)), max_size=30)


@settings(max_examples=300)
@given(flat_ops, st.integers(0, 40))
@example([("put", KEYS.usage("h1"), VALUES[0]), ("put", KEYS.usage("h2"), VALUES[0]),
          ("put", KEYS.usage("h1"), VALUES[1])], 2)     # a key rewritten after another key was put
@example([("put", KEYS.usage("h1"), VALUES[0]), ("put", KEYS.usage("h2"), VALUES[0]),
          ("delete", KEYS.usage("h2"), b"")], 1)         # a key put since, and gone
def test_the_keys_put_since_a_generation_are_those_whose_value_changed_since_and_still_exist(
        steps: list[tuple[str, bytes, bytes]], at: int) -> None:
    """``puts_since(kind, g)`` for a ``g`` read after any step: exactly the keys of ``kind`` put since then and still
    there, each with its current value, newest first; None once the mirror was reset since."""
    mirror = Mirror(KEYS)
    mirror.reset([], 1)
    revision = 1
    flat_kinds = ("hosts", "usage")
    marks: list[tuple[dict[str, int], dict[bytes, int], bool]] = []   # generations, then each key's last put, reset?
    last_put: dict[bytes, int] = {}
    for op, key, value in steps:
        revision += 1
        marks.append(({kind: mirror.generation(kind) for kind in flat_kinds}, dict(last_put), False))
        _step(mirror, op, key, value, revision, FLAT_KEYS)
        if op == "reset":
            marks = [(g, puts, True) for g, puts, _ in marks]
        elif op == "put":
            last_put[key] = revision
        else:
            last_put.pop(key, None)
    if not marks:
        return
    generations, puts_then, reset_since = marks[at % len(marks)]
    for kind in flat_kinds:
        found = mirror.puts_since(kind, generations[kind])
        if reset_since:
            assert found is None
            continue
        assert found is not None
        now = {kv.key: kv for kv in mirror.items(kind)}
        expected = sorted((k for k in now if last_put.get(k) != puts_then.get(k)), key=lambda k: -last_put[k])
        assert [kv.key for kv in found] == expected, kind
        assert all(kv is now[kv.key] for kv in found)


@pytest.mark.parametrize("kept", [4, None])
@settings(max_examples=200)
@given(steps=ops, at=st.integers(0, 40))
def test_the_hosts_changed_since_a_mark_are_those_with_a_key_put_or_deleted_since(
        kept: int | None, steps: list[tuple[str, bytes, bytes]], at: int) -> None:
    """``hosts_changed_since(mark)`` for a mark read after any step: exactly the hosts one of whose keys was put or
    deleted since (a host whose last key went among them); None once the mirror was reset since, or when its log no
    longer reaches back (``HOST_LOG_KEPT``: here 4, and the default, which these steps never reach)."""
    with pytest.MonkeyPatch.context() as patch:
        if kept is not None:
            patch.setattr(mirror_module, "HOST_LOG_KEPT", kept)
        _hosts_changed_since(kept, steps, at)


def _hosts_changed_since(kept: int | None, steps: list[tuple[str, bytes, bytes]], at: int) -> None:
    mirror = Mirror(KEYS)
    mirror.reset([], 1)
    revision = 1
    marks: list[tuple[int, set[str], bool]] = []    # the mark, the hosts changed since, a reset since?
    for op, key, value in steps:
        revision += 1
        marks.append((mirror.hosts_changed_since(-1)[0], set(), False))
        _step(mirror, op, key, value, revision, HOST_OF)
        marks = [(m, hosts | ({HOST_OF[key]} if key in HOST_OF and op != "reset" else set()), reset or op == "reset")
                 for m, hosts, reset in marks]
    if not marks:
        return
    mark, expected, reset_since = marks[at % len(marks)]
    end, found = mirror.hosts_changed_since(mark)
    assert end == mirror.hosts_changed_since(-1)[0]
    if reset_since:
        assert found is None
    elif kept is None:
        assert found == expected
    else:
        assert found is None or found == expected
