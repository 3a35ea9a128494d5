"""Host labels (``gpucoord node --label KEY=VALUE``, issue 30): the grammar, the flags, and the stored inventory
(``hosts/<host>``), read as every other field of it (InvalidRecord naming ``labels``). Pure: no I/O."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from agent_client.api import registry_pb2 as pb
from coordinator import errors
from coordinator.cli.render import render_status
from coordinator.host_records import MAX_LABELS, HostInventory, parse_labels
from coordinator.node.fake import parse_fake_gpus
from coordinator.record_fields import InvalidRecord
from coordinator.rpc import registry_fields

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOST = "h1"


def inventory(**kw: object) -> HostInventory:
    return HostInventory(HOST, "127.0.0.1:1", 8, tuple(range(8)), 1 << 34, "/", 1 << 40,
                         parse_fake_gpus("2x16GiB", HOST), **kw)  # type: ignore[arg-type]


def test_flags_become_sorted_labels() -> None:
    labels = parse_labels(["rack=r1", "block=b2", "example.com/zone=Z-1.a_b"])
    assert labels == (("block", "b2"), ("example.com/zone", "Z-1.a_b"), ("rack", "r1"))
    assert parse_labels([]) == ()
    assert inventory(labels=labels).label("rack") == "r1" and inventory(labels=labels).label("row") is None
    longest = "k" * 63
    assert parse_labels([f"{'p' * 63}.{'q' * 63}/{longest}={'V' * 63}"])[0][1] == "V" * 63


@pytest.mark.parametrize("arg, says", [
    ("rack", "expected KEY=VALUE"),
    ("=r1", "key ''"),
    ("Rack=r1", "key 'Rack'"),               # a key is lowercase
    ("-rack=r1", "key '-rack'"),
    ("rack-=r1", "key 'rack-'"),
    ("k" * 64 + "=v", "key 'kkkk"),
    ("/rack=r1", "key '/rack'"),
    ("a_b/rack=r1", "key 'a_b/rack'"),       # a prefix is a DNS name
    ("a" * 254 + "/rack=r1", "key 'aaaa"),
    ("rack=", "value ''"),
    ("rack=r 1", "value 'r 1'"),
    ("rack=r1-", "value 'r1-'"),
    ("rack=" + "v" * 64, "value 'vvvv"),
    ("rack=r1=r2", "value 'r1=r2'"),
    ("rack=r\n1", "value 'r\\n1'"),
])
def test_a_malformed_label_is_refused_naming_the_flag(arg: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_labels([arg])
    assert str(e.value).startswith("--label") and says in str(e.value), str(e.value)
    assert len(str(e.value)) < 600


def test_a_repeated_key_and_too_many_labels_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--label: the key 'rack' is given twice"):
        parse_labels(["rack=r1", "rack=r2"])
    parse_labels([f"k{i}=v" for i in range(MAX_LABELS)])
    with pytest.raises(ValueError, match=rf"--label: more than {MAX_LABELS} labels"):
        parse_labels([f"k{i}=v" for i in range(MAX_LABELS + 1)])


def test_an_inventory_of_the_previous_release_has_no_labels() -> None:
    old = inventory().to_json()
    del old["labels"]                      # what the releases before labels wrote
    assert HostInventory.from_json(old).labels == ()
    assert inventory(labels=(("rack", "r1"),)).to_json()["labels"] == {"rack": "r1"}


def test_a_previous_releases_node_registers_through_the_registry() -> None:
    """A node of the previous release sends an inventory without labels: registered, with none."""
    old = inventory().to_json()
    del old["labels"]
    msg = pb.HostRegistration(host=HOST, address="127.0.0.1:1", inventory_json=json.dumps(old), ttl_seconds=10,
                              pid=1, started_at=1.0, version="0.9")
    stored = json.loads(registry_fields.registration(msg).value)
    assert stored["inventory"]["labels"] == {}
    new = inventory(labels=(("rack", "r1"),)).to_json()
    msg.inventory_json = json.dumps(new)
    assert json.loads(registry_fields.registration(msg).value)["inventory"]["labels"] == {"rack": "r1"}


@pytest.mark.parametrize("labels", [
    [], "rack=r1", {"rack": 1}, {"rack": None}, {"Rack": "r1"}, {"rack": ""}, {"rack": "r" * 64},
    {f"k{i}": "v" for i in range(MAX_LABELS + 1)},
])
def test_a_malformed_stored_labels_field_makes_the_inventory_invalid_naming_it(labels: object) -> None:
    doc = {**inventory().to_json(), "labels": labels}
    with pytest.raises(InvalidRecord, match=r"^labels: "):
        HostInventory.from_json(doc)
    msg = pb.HostRegistration(host=HOST, address="127.0.0.1:1", inventory_json=json.dumps(doc), ttl_seconds=10,
                              pid=1, started_at=1.0, version="1")
    with pytest.raises(errors.InvalidArgument) as e:
        registry_fields.registration(msg)
    assert e.value.field == "inventory_json" and "labels:" in e.value.message


def test_status_shows_a_hosts_labels_and_no_line_without_them() -> None:
    host = {"host": HOST, "alive": True, "address": "", "partition_mode": "shared", "gpus": []}
    shown = render_status({"hosts": [{**host, "labels": {"rack": "r1", "block": "b2"}}]})
    assert "  labels: block=b2 rack=r1" in shown.splitlines()
    assert "labels:" not in render_status({"hosts": [{**host, "labels": {}}]})


ALNUM_LOWER = st.sampled_from(string.ascii_lowercase + string.digits)
ALNUM = st.sampled_from(string.ascii_letters + string.digits)
DNS_PART = st.builds(lambda a, m, b: a + m + b, ALNUM_LOWER,
                     st.text(string.ascii_lowercase + string.digits + "-", max_size=20), ALNUM_LOWER)
def ends_alnum(first: st.SearchStrategy[str], middle: str, last: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """One character of ``first``, or ``first`` + up to 61 of ``middle`` + ``last``."""
    return st.one_of(first, st.builds(lambda a, m, b: a + m + b, first, st.text(middle, max_size=61), last))


KEY = st.builds(lambda p, n: (p + "/" if p else "") + n,
                st.one_of(st.just(""), st.lists(DNS_PART, min_size=1, max_size=4).map(".".join)),
                ends_alnum(ALNUM_LOWER, string.ascii_lowercase + string.digits + "._-", ALNUM_LOWER))
VALUE = ends_alnum(ALNUM, string.ascii_letters + string.digits + "._-", ALNUM)
LABELS = st.dictionaries(KEY, VALUE, max_size=MAX_LABELS)


@PROPS
@given(LABELS)
def test_valid_labels_round_trip_through_the_stored_inventory(labels: dict[str, str]) -> None:
    parsed = parse_labels([f"{k}={v}" for k, v in labels.items()])
    assert dict(parsed) == labels
    inv = inventory(labels=parsed)
    stored = json.loads(json.dumps(inv.to_json()))
    assert HostInventory.from_json(stored) == inv


def spec_name(s: str, chars: str) -> bool:
    """The grammar's NAME/VALUE rule, written out by hand (the oracle the code is checked against)."""
    ends = string.ascii_letters + string.digits if "A" in chars else string.ascii_lowercase + string.digits
    return 1 <= len(s) <= 63 and s[0] in ends and s[-1] in ends and all(c in chars for c in s)


def spec_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if not slash:
        return spec_name(name, string.ascii_lowercase + string.digits + "._-")
    parts = prefix.split(".")
    return (len(prefix) <= 253 and spec_name(name, string.ascii_lowercase + string.digits + "._-")
            and all(spec_name(p, string.ascii_lowercase + string.digits + "-") for p in parts))


NOISE = st.text("aZ09._-/ =\n\x00é", max_size=70)     # near the grammar: every rule is broken somewhere
VALUE_CHARS = string.ascii_letters + string.digits + "._-"


@PROPS
@given(LABELS, st.one_of(KEY, NOISE), st.one_of(VALUE, NOISE, st.text(VALUE_CHARS, min_size=60, max_size=66)))
def test_a_label_is_accepted_exactly_when_the_grammar_allows_it(labels: dict[str, str], key: str,
                                                                 value: str) -> None:
    """Whatever the drawn (key, value): accepted by the flags and by the stored inventory exactly when the
    grammar (written out independently above) allows it; else refused naming the flag or the field."""
    assume("=" not in key and key not in labels)   # "=" would split the flag elsewhere; a repeat is another test
    valid = spec_key(key) and spec_name(value, VALUE_CHARS) and len(labels) < MAX_LABELS
    doc = {**inventory().to_json(), "labels": {**labels, key: value}}
    flags = [f"{k}={v}" for k, v in {**labels, key: value}.items()]
    if valid:
        assert dict(parse_labels(flags)) == {**labels, key: value}
        assert dict(HostInventory.from_json(doc).labels) == {**labels, key: value}
    else:
        with pytest.raises(InvalidRecord, match=r"^labels: "):
            HostInventory.from_json(doc)
        with pytest.raises(ValueError, match=r"^--label"):
            parse_labels(flags)
