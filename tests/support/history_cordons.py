"""The history checker's cordon rule (issue 31, docs/policies.md "Cordon and drain"), fed by the replay of
tests/history.check_history:

* **no grant on a cordoned host**: a lease created (its record's version 1) in a revision after which
  ``cordons/<host>`` exists is a violation. Every grant compares the cordon key as its snapshot read it, so a
  grant commits only while the host is not cordoned, and the cordon's own write never shares a revision with
  a grant: once the key exists, no later revision adds a lease there until it is deleted (uncordon).
"""
from __future__ import annotations

from typing import Any

from coordinator.etcd.store import WatchEvent


class CordonRules:
    def __init__(self) -> None:
        self.cordoned: dict[str, dict[str, Any]] = {}   # host -> its cordon's value, while the key exists
        self.grants: list[tuple[str, str]] = []          # (host, lease id) created in this revision

    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        if kind == "cordons" and len(parts) == 1:
            if ev.kind == "PUT":
                self.cordoned[parts[0]] = {"mod_revision": ev.kv.mod_revision}
            else:
                self.cordoned.pop(parts[0], None)
        elif kind == "leases" and len(parts) == 3 and ev.kind == "PUT" and ev.kv.version == 1:
            self.grants.append((parts[0], parts[2]))

    def check(self, rev: int) -> list[str]:
        out = [f"rev {rev}: cordon: lease {lease_id} granted on host {host}, cordoned since rev "
               f"{self.cordoned[host]['mod_revision']}"
               for host, lease_id in dict.fromkeys(self.grants) if host in self.cordoned]
        self.grants = []
        return out
