"""Tests of coordinator.keys: builders, parsing, prefixes, range ends, lease ids and queue ranks."""
from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.keys import (
    DEFAULT_PREFIX,
    Keys,
    etcd_lease_from_session_id,
    lease_id_for,
    prefix_range_end,
    session_id_from_etcd_lease,
    valid_name,
)

PROPS = settings(max_examples=200, deadline=None)

names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:@-]{0,20}\Z", fullmatch=True)
prefixes = st.from_regex(r"\A/([a-z0-9_-]{1,8}/){0,3}\Z", fullmatch=True)


# -- prefix -------------------------------------------------------------------------------------

def test_default_prefix() -> None:
    assert DEFAULT_PREFIX == "/gpucoord/"
    assert Keys().prefix == DEFAULT_PREFIX
    assert Keys().root() == b"/gpucoord/"


@pytest.mark.parametrize("prefix", ["/", "/t/", "/a/b/", "/gpucoord/"])
def test_valid_prefix(prefix: str) -> None:
    assert Keys(prefix).root() == prefix.encode()


@pytest.mark.parametrize("prefix", ["", "gpucoord/", "/gpucoord", "gpucoord", "a/b"])
def test_invalid_prefix(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Keys(prefix)


# -- builders -----------------------------------------------------------------------------------

def test_builders_exact() -> None:
    k = Keys("/t/")
    assert k.host("h1") == b"/t/hosts/h1"
    assert k.hosts() == b"/t/hosts/"
    assert k.usage("h1") == b"/t/usage/h1"
    assert k.usages() == b"/t/usage/"
    assert k.partition("h1") == b"/t/partitions/h1"
    assert k.partitions() == b"/t/partitions/"
    assert k.gpu("h1", "GPU-1") == b"/t/gpus/h1/GPU-1"
    assert k.gpus() == b"/t/gpus/"
    assert k.gpus("h1") == b"/t/gpus/h1/"
    assert k.lease("h1", "GPU-1", "abc") == b"/t/leases/h1/GPU-1/abc"
    assert k.leases() == b"/t/leases/"
    assert k.leases("h1") == b"/t/leases/h1/"
    assert k.leases("h1", "GPU-1") == b"/t/leases/h1/GPU-1/"
    assert k.queue_entry("h1", "r") == b"/t/queue/h1/r"
    assert k.queue() == b"/t/queue/"
    assert k.queue("h1") == b"/t/queue/h1/"
    assert k.eviction("abc") == b"/t/evictions/abc"
    assert k.evictions() == b"/t/evictions/"
    assert k.session("agent-a", "1f") == b"/t/sessions/agent-a/1f"
    assert k.sessions() == b"/t/sessions/"
    assert k.sessions("agent-a") == b"/t/sessions/agent-a/"
    assert k.election() == b"/t/election/"
    assert k.coordinator("r1") == b"/t/coordinators/r1"
    assert k.coordinators() == b"/t/coordinators/"


def test_directory_keys_bound_their_members() -> None:
    """A directory key followed by prefix_range_end covers its members and nothing of a sibling."""
    k = Keys("/t/")
    pairs: list[tuple[bytes, bytes, bytes]] = [
        (k.hosts(), k.host("h"), k.usage("h")),
        (k.gpus("h"), k.gpu("h", "g"), k.gpu("h2", "g")),
        (k.leases("h", "g"), k.lease("h", "g", "l"), k.lease("h", "g2", "l")),
        (k.leases("h"), k.lease("h", "g", "l"), k.lease("h2", "g", "l")),
        (k.queue("h"), k.queue_entry("h", "r"), k.queue_entry("h2", "r")),
        (k.sessions("a"), k.session("a", "1"), k.session("a2", "1")),
        (k.root(), k.host("h"), b"/t2/hosts/h"),
    ]
    for start, member, outsider in pairs:
        end = prefix_range_end(start)
        assert start <= member < end
        assert not start <= outsider < end


@PROPS
@given(prefix=prefixes, host=names, gpu=names, lease=names, agent=names, other=names)
def test_parse_round_trip(prefix: str, host: str, gpu: str, lease: str, agent: str, other: str) -> None:
    k = Keys(prefix)
    cases: list[tuple[bytes, str, list[str]]] = [
        (k.host(host), "hosts", [host]),
        (k.usage(host), "usage", [host]),
        (k.partition(host), "partitions", [host]),
        (k.gpu(host, gpu), "gpus", [host, gpu]),
        (k.lease(host, gpu, lease), "leases", [host, gpu, lease]),
        (k.queue_entry(host, other), "queue", [host, other]),
        (k.eviction(lease), "evictions", [lease]),
        (k.session(agent, other), "sessions", [agent, other]),
        (k.coordinator(other), "coordinators", [other]),
    ]
    for key, kind, parts in cases:
        assert key.startswith(k.root())
        assert k.parse(key) == (kind, parts)


def test_parse_directories_and_root() -> None:
    k = Keys("/t/")
    assert k.parse(k.root()) == ("", [])
    assert k.parse(k.hosts()) == ("hosts", [])
    assert k.parse(k.election()) == ("election", [])
    assert k.parse(k.leases("h", "g")) == ("leases", ["h", "g", ""])


def test_parse_queue_entry_with_real_rank() -> None:
    k = Keys("/t/")
    rank = Keys.queue_rank(5, 123, "req-1")
    assert k.parse(k.queue_entry("h", rank)) == ("queue", ["h", rank])


@pytest.mark.parametrize("key", [b"/other/hosts/h", b"/t", b"t/hosts/h", b"", b"/t2/hosts/h"])
def test_parse_rejects_keys_outside_prefix(key: bytes) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Keys("/t/").parse(key)


def test_prefixes_do_not_overlap() -> None:
    a, b = Keys("/gpucoord/"), Keys("/gpucoord2/")
    with pytest.raises(ValueError):
        a.parse(b.host("h"))
    assert not b.host("h").startswith(a.root())


# -- prefix_range_end -----------------------------------------------------------------------------

@pytest.mark.parametrize(("prefix", "end"), [
    (b"/a/", b"/a0"),
    (b"/gpucoord/", b"/gpucoord0"),
    (b"a", b"b"),
    (b"a\xff", b"b"),
    (b"a\xff\xff", b"b"),
    (b"\x00", b"\x01"),
    (b"\xff", b"\0"),
    (b"\xff\xff\xff", b"\0"),
    (b"", b"\0"),
])
def test_prefix_range_end_examples(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end


@PROPS
@given(prefix=st.binary(min_size=1, max_size=8), suffix=st.binary(max_size=8), other=st.binary(max_size=10))
def test_prefix_range_end_bounds_the_prefix(prefix: bytes, suffix: bytes, other: bytes) -> None:
    end = prefix_range_end(prefix)
    if end == b"\0":  # etcd: every key >= start
        assert set(prefix) == {0xFF}
        return
    assert prefix + suffix < end
    # Every key in [prefix, end) starts with prefix.
    if prefix <= other < end:
        assert other.startswith(prefix)


# -- ids ----------------------------------------------------------------------------------------

def test_lease_id_for_is_deterministic_hex() -> None:
    a = lease_id_for("agent-a", "req-1", "h1")
    assert a == lease_id_for("agent-a", "req-1", "h1")
    assert a != lease_id_for("agent-a", "req-1", "h2")
    assert len(a) == 20
    int(a, 16)
    assert valid_name(a)


def test_lease_id_for_known_value() -> None:
    # Pinned: a change would orphan every lease created by an older coordinator (G6 across upgrades).
    import hashlib
    assert lease_id_for("a", "r", "h") == hashlib.sha256(b"h\0a\0r").hexdigest()[:20]


@PROPS
@given(a1=names, r1=st.text(max_size=20), a2=names, r2=st.text(max_size=20))
def test_lease_id_for_differs_per_agent_and_request(a1: str, r1: str, a2: str, r2: str) -> None:
    assert (lease_id_for(a1, r1, "h") == lease_id_for(a2, r2, "h")) == ((a1, r1) == (a2, r2))


def test_lease_id_for_no_concatenation_ambiguity() -> None:
    assert lease_id_for("ab", "c", "h") != lease_id_for("a", "bc", "h")
    assert lease_id_for("a", "", "h") != lease_id_for("", "a", "h")
    assert lease_id_for("a", "r", "h") != lease_id_for("h", "r", "a")


@PROPS
@given(st.integers(1, 2**63 - 1))
def test_session_id_round_trip(etcd_lease: int) -> None:
    sid = session_id_from_etcd_lease(etcd_lease)
    assert etcd_lease_from_session_id(sid) == etcd_lease
    assert valid_name(sid)


def test_session_id_is_hex() -> None:
    assert session_id_from_etcd_lease(0x694D7A1B2C) == "694d7a1b2c"


# -- queue rank ---------------------------------------------------------------------------------

priorities = st.integers(-1_000_000, 1_000_000)
arrivals = st.integers(0, 2**63 - 1)


def test_queue_rank_examples() -> None:
    assert Keys.queue_rank(0, 5, "x") == "1000000-00000000000000000005-x"
    assert Keys.queue_rank(1_000_000, 0, "x").startswith("0000000-")
    assert Keys.queue_rank(-1_000_000, 0, "x").startswith("2000000-")
    assert Keys.queue_rank(10, 1, "x") < Keys.queue_rank(9, 0, "x")      # higher priority first
    assert Keys.queue_rank(5, 1, "x") < Keys.queue_rank(5, 2, "x")       # then first come
    assert Keys.queue_rank(5, 9, "x") < Keys.queue_rank(5, 10, "x")      # numerically, not as text


@PROPS
@given(entries=st.lists(st.tuples(priorities, arrivals), min_size=1, max_size=30, unique=True))
def test_queue_rank_sorts_like_priority_then_arrival(entries: list[tuple[int, int]]) -> None:
    ranks = {Keys.queue_rank(p, t, f"r{i}"): (p, t) for i, (p, t) in enumerate(entries)}
    by_rank = [ranks[r] for r in sorted(ranks)]
    assert by_rank == sorted(entries, key=lambda e: (-e[0], e[1]))
    # ... and so does the byte order of the etcd keys.
    k = Keys("/t/")
    by_key = [ranks[k.parse(key)[1][1]] for key in sorted(k.queue_entry("h", r) for r in ranks)]
    assert by_key == by_rank


@PROPS
@given(p1=priorities, t1=arrivals, p2=priorities, t2=arrivals, k1=names, k2=names)
def test_queue_rank_pairwise_order(p1: int, t1: int, p2: int, t2: int, k1: str, k2: str) -> None:
    r1, r2 = Keys.queue_rank(p1, t1, k1), Keys.queue_rank(p2, t2, k2)
    if (-p1, t1) < (-p2, t2):
        assert r1 < r2
    elif (-p1, t1) > (-p2, t2):
        assert r1 > r2


@PROPS
@given(p=priorities, t=arrivals, key=st.text(st.characters(blacklist_characters="/"), max_size=30))
def test_parse_queue_rank_inverse(p: int, t: int, key: str) -> None:
    assert Keys.parse_queue_rank(Keys.queue_rank(p, t, key)) == (p, t, key)


def test_parse_queue_rank_key_with_dashes() -> None:
    assert Keys.parse_queue_rank(Keys.queue_rank(-3, 7, "a-b-c")) == (-3, 7, "a-b-c")


# -- names --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a", "A", "0", "agent-a", "gpu-node-1", "GPU-8f3c2a1e-1b2c", "h.example.com",
                                  "user@host", "a:b", "a_b", "a" * 128])
def test_valid_names(name: str) -> None:
    assert valid_name(name)


@pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "@a", "a/b", "a b", " a", "a\0", "a" * 129, "é",
                                  "a\tb", "a*", "/"])
def test_invalid_names(name: str) -> None:
    assert not valid_name(name)


@pytest.mark.parametrize("name", ["agent-a\n", "h\n"])
def test_invalid_name_trailing_newline(name: str) -> None:
    assert not valid_name(name)


@PROPS
@given(names)
def test_valid_names_never_contain_slash(name: str) -> None:
    assert valid_name(name)
    assert "/" not in name


@PROPS
@given(st.text(max_size=40))
def test_valid_name_implies_safe_alphabet(name: str) -> None:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@-")
    if valid_name(name):
        assert 1 <= len(name) <= 128
        assert name[0].isascii() and name[0].isalnum()
        assert set(name) <= allowed, repr(name)


def _all_builders(k: Keys) -> list[Callable[[], bytes]]:
    return [k.root, k.hosts, k.usages, k.partitions, k.gpus, k.leases, k.queue, k.evictions, k.sessions,
            k.election, k.coordinators]


def test_every_directory_is_under_root_and_ends_with_slash() -> None:
    k = Keys("/t/")
    for b in _all_builders(k):
        key = b()
        assert key.startswith(b"/t/") and key.endswith(b"/")
