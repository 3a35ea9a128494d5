"""Which etcd versions have known crash bugs, and how a version is read (pure logic)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.etcd.versions import (
    crash_bugs,
    drifts_when_killed,
    format_version,
    parse_etcd_version,
)

pytestmark = pytest.mark.unit

WHEEL_VERSION_OUTPUT = """etcd Version: 3.5.1
Git SHA: e8732fb5f
Go Version: go1.16.3
Go OS/Arch: linux/amd64
"""


@pytest.mark.parametrize("text, expected", [
    (WHEEL_VERSION_OUTPUT, (3, 5, 1)),
    ("etcd Version: 3.4.23\nGit SHA: Not provided (use ./build instead of go build)\nGo Version: go1.19.8\n",
     (3, 4, 23)),
    ("3.5.17", (3, 5, 17)),                     # a Maintenance Status answer
    ("v3.6.0", (3, 6, 0)),
    ("Go Version: go1.21.3\netcd Version: 3.5.9\n", (3, 5, 9)),   # the Go version is never taken for etcd's
    ("", None),
    ("etcd Version: unknown", None),
])
def test_parse_etcd_version(text: str, expected: tuple[int, int, int] | None) -> None:
    assert parse_etcd_version(text) == expected


@pytest.mark.parametrize("version, affected", [
    ((3, 4, 23), False), ((3, 4, 0), False),
    ((3, 5, 0), True), ((3, 5, 1), True), ((3, 5, 4), True),     # etcd-io/etcd#14110
    ((3, 5, 5), True), ((3, 5, 6), True),                        # etcd-io/etcd#14891
    ((3, 5, 7), False), ((3, 5, 17), False), ((3, 6, 0), False),
])
def test_crash_bugs(version: tuple[int, int, int], affected: bool) -> None:
    assert bool(crash_bugs(version)) is affected


def test_the_3_5_1_bug_names_the_upstream_issue() -> None:
    assert any("14110" in b for b in crash_bugs((3, 5, 1)))


@pytest.mark.parametrize("version, drifts", [((3, 5, 0), True), ((3, 5, 1), True), ((3, 5, 2), True), ((3, 5, 3), False),
                                              ((3, 5, 16), False), ((3, 4, 23), False)])
def test_the_data_inconsistency_of_3_5_0_to_3_5_2_is_known(version: tuple[int, int, int], drifts: bool) -> None:
    assert any("13766" in b for b in crash_bugs(version)) is drifts
    assert drifts_when_killed(version) is drifts    # the nemesis kills no member of these releases


def test_an_unknown_version_is_not_said_to_drift() -> None:
    assert drifts_when_killed(None) is False


@given(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(0, 999)))
def test_a_formatted_version_parses_back(version: tuple[int, int, int]) -> None:
    assert parse_etcd_version(format_version(version)) == version
    assert parse_etcd_version(f"etcd Version: {format_version(version)}\nGo Version: go1.16.3") == version
