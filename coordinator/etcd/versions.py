"""Which etcd server versions are safe to run gpucoord against. Pure logic, no I/O (``log_versions`` logs).

``up``, the test fixtures and the version check at start of the coordinator and the node daemon all
use these two functions, so the rule lives in one place.
"""
from __future__ import annotations

import logging
import re
from typing import Mapping

Version = tuple[int, int, int]

# (first affected, first fixed, what goes wrong). Both bugs crash the server on a read-only transaction
# whose context is cancelled (a client deadline, a paused process). gpucoord never sends read-only
# transactions, but other clients of the same etcd may.
# The first entry is no crash but a data inconsistency: the fault tier's HashKV comparison is there to catch it.
# Its range is also KILL_DRIFT's: the releases where killing a member during writes may make it drift.
KILL_DRIFT: tuple[Version, Version] = ((3, 5, 0), (3, 5, 3))
KNOWN_CRASH_BUGS: tuple[tuple[Version, Version, str], ...] = (
    (*KILL_DRIFT, "a member killed during writes can apply entries twice on restart and drift from "
                           "the others (data inconsistency, etcd-io/etcd#13766, fixed in 3.5.3)"),
    ((3, 5, 0), (3, 5, 5), "panics when a read-only transaction is cancelled by its client deadline "
                           "(etcd-io/etcd#14110, fixed in 3.5.5)"),
    ((3, 5, 5), (3, 5, 7), "nil-pointer panic when a read-only transaction is cancelled after a pause "
                           "(etcd-io/etcd#14891, fixed in 3.5.7)"),
)

# The oldest releases gpucoord recommends for production, per minor line (docs/etcd.md says the same).
MINIMUM_PRODUCTION = "3.5.7 (or 3.4.23 on the 3.4 line)"

_VERSION = re.compile(r"(?<![\d.])v?(\d+)\.(\d+)\.(\d+)")


def parse_etcd_version(text: str) -> Version | None:
    """The version in etcd's ``--version`` output ("etcd Version: 3.5.1 ...") or a Status answer
    ("3.5.1"); ``None`` when there is none. The first line naming etcd's version wins over the Go version."""
    for line in text.splitlines() or [text]:
        if "go version" in line.lower() or "git sha" in line.lower():
            continue
        m = _VERSION.search(line)
        if m:
            return int(m.group(1)), int(m.group(2)), int(m.group(3))
    return None


def crash_bugs(version: Version) -> list[str]:
    """The known crash bugs of this etcd server version (empty: none known)."""
    return [what for first, fixed, what in KNOWN_CRASH_BUGS if first <= version < fixed]


def drifts_when_killed(version: Version | None) -> bool:
    """Whether a member of this release killed during writes may come back drifted (etcd-io/etcd#13766)."""
    return version is not None and KILL_DRIFT[0] <= version < KILL_DRIFT[1]


def format_version(version: Version | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def log_versions(versions: Mapping[str, str], log: logging.Logger) -> None:
    """Log each member's version (endpoint -> version text, "" when unknown) to ``log``, with a WARNING for
    versions with known crash bugs."""
    for endpoint, text in versions.items():
        version = parse_etcd_version(text) if text else None
        if version is None:
            continue
        bugs = crash_bugs(version)
        if bugs:
            log.warning("etcd %s runs %s, which has known crash bugs: %s. Run etcd %s or newer in "
                        "production.", endpoint, format_version(version), "; ".join(bugs), MINIMUM_PRODUCTION)
        else:
            log.info("etcd %s runs %s", endpoint, format_version(version))
