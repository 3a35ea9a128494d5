"""A cordoned host in an admission round (issue 31, docs/policies.md "Cordon and drain"): pure, no I/O.

While ``cordons/<host>`` exists the host gets no new grant, at any revision: every round's transaction compares
the key as its snapshot read it (``Round._guards``), so a cordon that commits between a round's snapshot and
its commit fails the round, which is decided again and sees it. What a request that would be granted, or
would wait, does on a cordoned host (``wait_for_cordon``):

* a new call that asked for no wait is refused at once: FAILED_PRECONDITION naming ``host``, with the
  cordon's reason (waiting cannot help it), whether or not it would fit;
* a new call that waits takes a place in the queue (within its agent's and the host's bounds), and a queued
  request keeps its place, without choosing victims (its own notices are withdrawn: evicting for a request
  that cannot be granted ends leases for nothing), until the host is uncordoned (the round that sees the
  key deleted grants in rank order, as ever) or its wait ends: then it is answered FAILED_PRECONDITION
  naming ``host`` and the reason (``Plan.cordon_waits``);
* a retry of a request already granted is answered with its lease (G6), and a request that can never fit is
  refused as anywhere: neither needs a grant.

A session is opened on one host, so a request cannot move to another host: its caller decides (a client
that can use another host opens a session there).
"""
from __future__ import annotations

from coordinator import errors
from coordinator.host_records import CordonRecord
from coordinator.limits import quote
from coordinator.policy.decide import Grant, Item, Refuse, Waits, agent_queue_full
from coordinator.policy.plan import C
from coordinator.policy.writes import Round


def cordon_reason(host: str, cordon: CordonRecord) -> str:
    """Why nothing is granted on ``host``, naming ``host`` and the operator's reason."""
    what = "draining" if cordon.drain else "cordoned"
    because = f": {quote(cordon.reason)}" if cordon.reason else ""
    return f"host: host {quote(host)} is {what}{because}; no new lease there until 'gpucoord host uncordon'"


def cordon_wait_over(reason: str, wait_s: float) -> errors.FailedPrecondition:
    """The answer to a request whose wait ended while its host was cordoned."""
    return errors.FailedPrecondition(f"{reason} (waited {round(wait_s, 1):g} s)", "host")


def held_by_cordon(view_cordoned: bool, decision: object) -> bool:
    """Whether a decision needs a grant the cordon forbids: a new grant, a wait for one, or a refusal that says
    "not now" (RESOURCE_EXHAUSTED: on a cordoned host the cordon is the reason that counts)."""
    return view_cordoned and (isinstance(decision, Waits)
                              or (isinstance(decision, Grant) and decision.existing is None)
                              or (isinstance(decision, Refuse) and isinstance(decision.error, errors.CapacityError)))


def wait_for_cordon(r: Round[C], n: int, it: Item[C]) -> None:
    """The request ``r.items[n]`` on a cordoned host (see the module's docstring)."""
    cordon = r.view.cordon
    assert cordon is not None
    reason = cordon_reason(r.host, cordon)
    plan = r.out
    if it.entry is None:
        c = it.call
        assert c is not None
        refusal: errors.GpucoordError | None
        if c.deadline <= r.ctx.now:
            refusal = errors.FailedPrecondition(reason, "host")
        else:
            refusal = agent_queue_full(c, r.host, r.ctx, r.per_agent[it.agent]) or r._bound_queue(n, it)
        if refusal is not None:
            plan.refusals.append((c, refusal))
            return
    plan.cordon_waits[it.req.lease_id] = reason
    r._write_wait(it, r._kept(it.entry, ()) if it.entry is not None else ())
