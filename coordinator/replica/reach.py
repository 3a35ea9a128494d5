"""Whether this replica can reach etcd, as its own candidacy's session tells (``etcd/session.py``, ``in_doubt``).

A replica cut off from etcd while its clients still reach it must not hold on to them: every decision needs
etcd, and a session it cannot refresh expires. So while etcd is out of reach (two refreshes of the replica's
own etcd_lease in a row failed, or its session was lost and no new one could be granted):

* every call is answered UNAVAILABLE at once, naming the replica and why, so that clients go to another
  replica rather than wait out the etcd timeout (KeepAlive moves within moments, well before a session's TTL);
* the session streams it serves end with UNAVAILABLE, and its waiting acquires are answered UNAVAILABLE: the
  client retries them through another replica with the same request_id, which takes over their queue entries
  (they keep their place);
* the leader stops its duties (``replica/leader.py``).

When a refresh succeeds again (or a new session is granted), it serves again. Knowing this costs no etcd call
of its own: the candidacy's keepalives are the probe.

Before that is known, a replica whose etcd calls run late (a waiter it could not answer in time, a round
that failed on etcd) is **suspect**: it refreshes its etcd_lease at once to find out, and meanwhile answers
acquires forwarded by other replicas UNAVAILABLE, so that they decide them themselves rather than wait on it
(forwarding is only an optimisation). A refresh that gets through clears the suspicion.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from coordinator import errors

log = logging.getLogger(__name__)


class EtcdReach:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.ok = True
        self.since = time.monotonic()
        self.why = ""
        self.suspect = False
        self.probe: Callable[[], None] | None = None     # refreshes the replica's etcd_lease now
        self.listeners: list[Callable[[bool], None]] = []

    def suspect_now(self, why: str) -> None:
        """etcd answered this replica late: find out now whether it still reaches etcd."""
        if self.ok and not self.suspect:
            log.info("replica %s: its etcd calls run late (%s): refreshing its etcd lease to find out whether "
                     "etcd is out of reach", self.replica_id, why)
            self.suspect = True
            if self.probe is not None:
                self.probe()

    def refreshed(self, ok: bool) -> None:
        """The replica's own etcd_lease was refreshed (``ok``), or a refresh failed."""
        if ok:
            self.suspect = False

    def set(self, ok: bool, why: str = "") -> None:
        if ok:
            self.suspect = False
        if ok == self.ok:
            return
        self.ok, self.since, self.why = ok, time.monotonic(), why
        if ok:
            log.warning("replica %s reaches etcd again: serving", self.replica_id)
        else:
            log.warning("replica %s cannot reach etcd (%s): answering UNAVAILABLE, so that clients move to "
                        "another replica", self.replica_id, why)
        for listener in list(self.listeners):
            listener(ok)

    def error(self) -> errors.Unavailable:
        return errors.Unavailable(f"coordinator {self.replica_id} cannot reach etcd ({self.why}); retry through "
                                  "another replica")

    def check(self) -> None:
        """Raise UNAVAILABLE while etcd is out of reach."""
        if not self.ok:
            raise self.error()
