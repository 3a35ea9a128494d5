"""One admission round's decision, as a pure function: a host snapshot and the replica's calls in, a plan out.

``plan_round(view, calls, waiting, ...)`` walks every request of the host in rank order (priority, then
arrival): the host's whole queue in etcd (with the replica's own waiting calls attached to their entries)
and the replica's new calls. It decides, for each:

* a grant (the lease, under the holder's session, and the bumped ledger: the next fencing token);
* a refusal that needs no write (answered at once);
* a wait: a new queue entry under the waiter's session, after choosing eviction victims (G3) if evicting
  makes it fit;
* leaving the queue (its request can never be granted any more, it was displaced by a higher-priority
  arrival, or it was granted).

A round runs in named steps: ``_order`` (the requests in rank order, answering at once the calls that cannot
take part), then for each request ``decide`` (``policy/decide.py``: a small typed result, ``Grant``,
``Refuse``, ``Leave`` or ``Waits``), ``_bound_queue`` (a new waiter on a full queue displaces a lower-ranked
one or is refused), ``_plan_evictions`` (G3), ``_write_wait``/``_write_grant``; and at the end
``_write_transaction`` (the leases, the ledgers and the guards).

The plan carries the transaction (``coordinator.txn`` compares and operations) and what to tell each
caller once it has committed. The transaction compares every ledger of the host, the partition, the host's
registration, the new callers' sessions and the queue condition (no entry written since the snapshot), so a
plan made from a stale snapshot fails as a whole and is made again.

Guarantees, checked by the property tests in ``tests/unit/test_planner.py``:
* G1: no GPU and no partition cap is over-committed by the grants.
* G2: a request is only placed on GPUs that no request ranked before it is still waiting for.
* Gangs (issue 21; ``policy/placement.py``, ``policy/gang.py``, ``policy/victims.py``): a request for several GPUs,
  whole GPUs, a topology or exact GPUs is placed over GPU sets (best fit, topology, exclusive) and granted all or
  nothing: one record per GPU with that GPU's next token, all in the round's transaction, which compares every ledger
  of the host. **G2 with gangs**: a waiting request, gang or not, blocks every GPU it could ever use
  (``gang.could_use``: every GPU of some set that could hold it once leases go and meets its topology); no request
  ranked after it is granted on any of them. The rule's cost: the free room of those GPUs idles for later requests
  until the gang is granted (a waiting ``any`` gang of 4 on an 8-GPU host holds back all 8 GPUs), and a round may
  grant less than it could; its gain: a big request is never starved by a stream of small ones. A gang's victims are
  chosen over GPU sets (``victims.choose_gang_victims``: G3's order over all candidates, minimal); a gang victim frees
  all its GPUs, and its notice compares each of its records. ``_fits_budget`` counts a gang's k lease puts and k
  ledger puts.
* **G2 with teams** (G11, ``_wait_for_team``): a request that its team's limit holds back (its grant would take its
  team above its limit; for one that does not fit yet, even the least it could be charged would) waits for its team
  alone: it holds no GPU back and chooses no victims, so the requests ranked after it, of every team, are decided as
  if it were not there. It is not waiting for GPU room: blocking GPUs for it would idle them for a request that cannot
  be granted anyway, and evicting for it would end leases for nothing. Its own team's requests behind it are not held
  back either: one that the limit still allows (a smaller one) is granted first, so the team's room goes to whichever
  of its requests fits first in rank order, and a big request of a team at its limit may be passed by its team's
  smaller ones (the team's own business; across teams nothing changes). Once its team has room it is decided as any
  request (it may then block GPUs and choose victims). Unless its own team's lower-priority preemptible leases here
  free room under the limit (``_evicts_for_team``: G3 within the team's limit): then it evicts them and waits as any
  waiter. A new call that asked for no wait is refused at once naming ``team`` and the limit; a wait that ends while
  the limit holds it back is answered so too (``Plan.team_waits``). A grant past its team's fair share of the idle
  capacity while another team waits here waits so too (``team_holds.py``).
* G3: victims are preemptible, of lower priority, chosen over every GPU (``admission.plan_eviction``, the same rule as
  ``victims.choose_gang_victims``: lowest priority first, then newest, over all candidates; minimal); a request with
  victims is admitted only once they are gone: their leases, and the processes of those bound to processes while the
  node still reports them and the kill margin has not passed (``HostView.departing``, whose VRAM also counts as held
  for everyone else).
* etcd's limits: at most ``TXN_OPS_BUDGET`` operations and ``TXN_COMPARES_BUDGET`` compares
  (``policy/txn_budget.py``); the rest is decided in the next round.

It does no I/O and changes nothing it is given: it works on copies of the snapshot's GPUs and leases, and
reads the calls (``Caller``) without touching them. Time comes in as arguments (``now``: the monotonic clock
the callers' deadlines use, ``wall``: seconds since the epoch, for what is stored).
"""
from __future__ import annotations

from typing import Collection, Mapping, Sequence

from coordinator import errors
from coordinator.keys import Keys
from coordinator.policy.admission import plan_eviction, room_for
from coordinator.policy.backfill import blocked_for, hold_for_gang
from coordinator.policy.cordon import held_by_cordon, wait_for_cordon
from coordinator.policy.decide import (
    Grant,
    Item,
    Leave,
    Refuse,
    Request,
    Waits,
    decide,
    eligible,
    left_the_queue,
    may_not_wait_for_team,
)
from coordinator.policy.decide import (
    wait_over as wait_over,  # the admitter answers a wait that ended with it
)
from coordinator.policy.gang import holders_from_views, slots_from_views
from coordinator.policy.host import HostView
from coordinator.policy.plan import C, Context, Plan
from coordinator.policy.reclaim import (
    choose_reclaim_victims,
    own_team_only,
    protected_until,
)
from coordinator.policy.reclaim_guard import reclaim_guards
from coordinator.policy.team_admission import (
    beyond_limit,
    charged_teams,
    fleet_charges,
    team_writes,
)
from coordinator.policy.team_holds import over_share, over_team_limit
from coordinator.policy.teams import Charge
from coordinator.policy.txn_budget import TXN_COMPARES_BUDGET, TXN_OPS_BUDGET
from coordinator.policy.victims import choose_gang_victims
from coordinator.policy.writes import Round
from coordinator.records import VramLease, dumps
from coordinator.txn import Absent, ModRevisionIs, NothingWrittenSince, Put


def plan_round(view: HostView, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str],
               ctx: Context) -> Plan[C]:
    """Decide one round on ``view.host`` (see the module's docstring).

    ``batch``: new calls; ``waiting``: this replica's calls already queued in etcd, by lease id; ``live``: the
    session ids of ``batch`` that the snapshot shows alive.
    """
    planner: _Planner[C] = _Planner(view, ctx)
    return planner.plan(batch, waiting, live)


class _Planner(Round[C]):
    """One round. Made for one ``plan`` call: it holds the round's state (``Round``) as it decides."""

    def plan(self, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str]) -> Plan[C]:
        plan = self.out
        self._charges: list[Charge] | None = None
        self.items = self._order(batch, waiting, live)
        staying = [it.entry for it in self.items if it.entry is not None and not self._leaving(it)]
        self.queued = len(staying)
        self.per_agent.update(e.agent for e in staying)
        for n, it in enumerate(self.items):
            if it.rank in self.displaced or self._leaving(it):
                continue
            if it.entry is not None and it.entry.multi_host:   # a multi-host gang's reservation: G2, backfill
                hold_for_gang(self, it.entry)
                continue
            # k lease puts, k ledger puts (counted for every GPU of the host in _fits_budget), the entry's delete.
            if not self._fits_budget(2 + it.req.gpu_count, 2):
                # The rest waits for the next round: new callers go back to the front of the line.
                plan.deferred = [x.call for x in self.items[n:] if x.call is not None and x.entry is None]
                plan.more = True
                break
            decision = decide(it, self.view, self.ctx, self.departing_held, blocked_for(
                self, it.req.time_limit_s, self.ctx.wall, self.cfg.eviction_kill_margin_s), self.per_agent[it.agent],
                              self._team_room(it.req) if it.req.exclusive else None)
            if held_by_cordon(self.view.cordon is not None, decision):
                wait_for_cordon(self, n, it)   # issue 31: no grant on a cordoned host (``policy/cordon.py``)
                continue
            over = over_team_limit(self, it, decision)
            if over is not None:
                if not self._evicts_for_team(n, it, decision):
                    self._wait_for_team(n, it, over)
                continue
            if (share := over_share(self, it, decision)) is not None:
                self._wait_for_team(n, it, share)    # its fair share of the idle capacity (docs/teams.md)
                continue
            if isinstance(decision, Grant):
                self._write_grant(it, decision)
            elif isinstance(decision, Refuse):
                assert it.call is not None
                plan.refusals.append((it.call, decision.error))
            elif isinstance(decision, Leave):
                assert it.entry is not None
                self._leaves(it.entry, it.call, decision.error)
            else:
                if decision.held_by_processes:
                    assert it.entry is not None
                    plan.held_by_processes.append(it.entry.lease_id)
                if it.entry is None:
                    refusal = self._bound_queue(n, it)
                    if refusal is not None:
                        assert it.call is not None
                        plan.refusals.append((it.call, refusal))
                        continue
                self._write_wait(it, self._plan_evictions(it, decision))
                self.block({g.uuid for g in decision.candidates})
        self._write_transaction()
        if self.ctx.teams is not None:
            compares, ops = team_writes(self.ctx.teams, self.keys, plan.new_leases)
            plan.compares += compares
            plan.ops += ops
        elif self.ctx.no_teams_since and plan.new_leases:
            plan.compares.append(NothingWrittenSince(self.keys.teams(), self.ctx.no_teams_since))
        return plan

    def _evicts_for_team(self, n: int, it: Item[C], decision: object) -> bool:
        """G3 within the team's limit: a request that its team's limit holds back evicts its own team's
        preemptible leases of lower priority on this host (``victims.choose_gang_victims`` with the team's room)
        when that frees room under the limit and on a GPU, and then waits for them as any waiter does (it holds
        its GPUs back, G2); it also waits so for the team's leases already being evicted when they will make
        room. True when it does; False: it waits for its team alone (``_wait_for_team``)."""
        req, ctx = it.req, self.ctx
        if isinstance(decision, Grant) and decision.existing is None:
            if it.call is not None and it.entry is None and it.call.deadline <= ctx.now:
                return False                   # asked for no wait: refused naming the team
            candidates, caps = eligible(self.view, self.cfg, req, count_leases=it.entry is None)
            decision = Waits(candidates, [g for g in candidates if g.uuid not in self.blocked], caps, False, False,
                             req.gang(caps) if req.is_gang else None)
        if not isinstance(decision, Waits):
            return False
        room = self._team_room(req, going=True)
        gpus = list(self.view.gpus.values())
        g3 = own_team_only(ctx.teams, req.agent, gpus)
        choice = choose_gang_victims(slots_from_views(g3, req.agent, self.view.inventory, self.evicting),
                                     decision.gang or req.gang(decision.caps), req.priority, req.agent,
                                     holders_from_views(g3, self.evicting, self.ctx.idle),
                                     {g.index for g in gpus if g.uuid in self.blocked}, room)
        if choice is None or (decision.victims_pending and choice.victims):
            return False          # nothing to evict, or its victims first: it waits for its team
        if it.entry is None:
            refusal = self._bound_queue(n, it)
            if refusal is not None:
                assert it.call is not None
                self.out.refusals.append((it.call, refusal))
                return True
        self._write_wait(it, self._plan_evictions(it, decision, [self.parts(h.id)[0] for h in choice.victims]))
        self.block({g.uuid for g in decision.candidates})
        return True

    def _wait_for_team(self, n: int, it: Item[C], reason: str) -> None:
        """G11: a request that its team's limit holds back (``reason`` names ``team`` and the limit). A new call
        that asked for no wait is refused at once; one that waits takes a place in the queue (within its
        agent's and the host's bounds) and a queued one keeps its place, without holding any GPU back (G2) or
        choosing victims (G3: those that would free room under the limit too are ``_evicts_for_team``'s), until
        its team's use over the fleet leaves room for it or its wait ends (``team_waits``: the admitter
        answers that end naming ``team``)."""
        plan, req = self.out, it.req   # one whose charge alone passes the limit is refused, or leaves the queue
        never = beyond_limit(self.ctx.teams, self.view, req.agent, req.vram_mb, req.gpu_count, req.exclusive)
        if never is not None and it.entry is not None:
            return self._leaves(it.entry, it.call, left_the_queue(never))
        if it.entry is None:
            assert it.call is not None
            refusal = never or may_not_wait_for_team(it.call, self.host, self.ctx, reason, self.per_agent[it.agent])
            if refusal is None:
                refusal = self._bound_queue(n, it)
            if refusal is not None:
                plan.refusals.append((it.call, refusal))
                return
        plan.team_waits[it.req.lease_id] = reason
        self._write_wait(it, self._kept(it.entry, ()) if it.entry is not None else ())   # it keeps no victim

    # -- order the calls -------------------------------------------------------------------------------
    def _order(self, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str]) -> list[Item[C]]:
        """Every request of the host in rank order: the queue's entries (with our calls attached) and the new
        calls. Answers at once what takes no part: our waiters whose entry vanished, calls of dead sessions,
        retries from another session than the one that waits."""
        plan, view = self.out, self.view
        by_lease = {e.lease_id: e for e in view.entries}
        # Our waiters whose entry vanished: granted (by any replica), or removed by someone else.
        for lease_id, c in waiting.items():
            if lease_id not in by_lease:
                lease = view.leases.get(lease_id)
                if lease is not None:
                    parts = self.parts(lease_id)
                    if len(parts) > 1 or parts[0].format > 1:
                        plan.gangs[lease_id] = parts
                        lease = parts[0]
                    plan.grants.append((c, lease))
                else:
                    plan.refusals.append((c, self._why_removed(c)))
        attached: dict[str, C] = {}
        fresh: list[Item[C]] = []
        for c in batch:
            if c.session.session_id not in live:
                plan.refusals.append((c, errors.SessionGone(
                    f"session: no live session {c.session.session_id} of agent {c.session.agent!r} "
                    "(unknown or expired)", "session")))
                continue
            entry = by_lease.get(c.lease_id)
            if entry is not None:      # a retry of a request that is already waiting: keep its place
                if entry.session_id != c.session.session_id:
                    plan.refusals.append((c, errors.FailedPrecondition(
                        "request_id: already waiting in another session of this agent", "request_id")))
                    continue
                prior = waiting.get(c.lease_id)
                if prior is not None and prior is not c and not prior.gone:
                    plan.superseded.append(prior)
                attached[c.lease_id] = c
                continue
            fresh.append(Item(Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id), None, c))
        items: list[Item[C]] = [Item(e.rank, e, attached.get(e.lease_id) or waiting.get(e.lease_id))
                                 for e in view.entries]
        items += fresh
        items.sort(key=lambda it: it.rank)
        self.attached_calls = {id(c) for c in attached.values()}
        return items

    def _fits_budget(self, ops: int, compares: int) -> bool:
        """Whether ``ops`` more operations and ``compares`` more compares stay within etcd's limits."""
        plan, view = self.out, self.view
        used_ops = len(plan.ops) + len(plan.new_leases) + len(view.gpus)   # + one ledger put per GPU at most
        # Guards: host, leases, departing, partition, cordon, queue, every ledger, one per caller's session (+1).
        guards = 6 + len(view.gpus) + len(plan.sessions) + 1
        if self.ctx.teams is not None:   # teams/ unchanged, and a ledger (compare and put) per charged team
            charged = len(charged_teams(self.ctx.teams, plan.new_leases)) + 1
            guards += 1 + charged
            used_ops += charged
        elif self.ctx.no_teams_since:    # still no team
            guards += 1
        return (used_ops + ops <= TXN_OPS_BUDGET
                and len(plan.compares) + guards + compares <= TXN_COMPARES_BUDGET)

    # -- plan evictions (G3) ---------------------------------------------------------------------------
    def _plan_evictions(self, it: Item[C], w: Waits, chosen: list[VramLease] | None = None) -> tuple[str, ...]:
        """The victims this waiter waits for: those it already chose, or new ones if evicting makes it fit on
        a GPU nobody ahead waits for (``chosen``, when the caller chose them; their notices go into this
        transaction)."""
        plan = self.out
        victims = it.entry.victims if it.entry is not None else ()
        if w.victims_pending:
            return self._serve(it, w.free_of_queue, w.caps, w.gang) if it.entry is not None else victims
        new, reclaim = (chosen, "") if chosen is not None else self._victims(it, w)
        parts = [x for v in new for x in self.parts(v.id)]
        # Reclaim commits only while its victims are over quota (``reclaim_guard``), compared once a transaction.
        guards = ([] if not (reclaim and new) or self.ctx.teams is None or self._charges is None else
                  [c for c in reclaim_guards(self.ctx.teams, self.view, self.keys, reclaim, [v.id for v in new],
                                             self._charges) if c not in plan.compares])
        if new and not self._fits_budget(len(new) + 2, len(new) + len(parts) + 2 + len(guards)):
            new = []              # too many for this transaction: evict in the next round
            plan.more = True
        elif new:
            plan.compares += guards
        for victim in new:
            record = self._eviction(victim, it, reclaim)
            plan.ops.append(Put(self.keys.eviction(victim.id), dumps(record.to_json()), victim.etcd_lease))
            for part in self.parts(victim.id):    # a gang victim: each of its GPUs' records
                plan.compares.append(ModRevisionIs(
                    self.keys.lease(self.host, part.gpu_uuid, part.id), part.mod_revision))
            plan.compares.append(Absent(self.keys.eviction(victim.id)))
            self.evicting.add(victim.id)
            plan.evictions.append(record)
        return tuple(v.id for v in new) if new else victims

    def _victims(self, it: Item[C], w: Waits) -> tuple[list[VramLease], str]:
        """New victims (G3): for a single-GPU request over single GPUs (``admission.plan_eviction``); for a
        gang over the GPU sets free of earlier waiters (``victims.choose_gang_victims``; both take G3's order
        over all candidates, then prune; a gang victim frees all its GPUs). Each as its first GPU's record. With teams, G3 takes only
        leases of the request's own team, and when it finds nothing the request may reclaim other teams'
        over-quota leases (``policy/reclaim.py``); then the second value names the reclaiming team."""
        req, teams = it.req, self.ctx.teams
        gpus = list(self.view.gpus.values())
        blocked = {g.index for g in gpus if g.uuid in self.blocked}
        if w.gang is None:
            g3 = own_team_only(teams, req.agent, w.free_of_queue)
            new = plan_eviction(list(g3), w.caps, req.vram_mb, req.priority, req.agent, self.evicting, self.ctx.idle)
            if new or teams is None or self._fits_once_evicted(req, w):
                return new, ""
        else:
            g3 = own_team_only(teams, req.agent, gpus)
            choice = choose_gang_victims(slots_from_views(g3, req.agent, self.view.inventory, self.evicting), w.gang,
                                         req.priority, req.agent, holders_from_views(g3, self.evicting, self.ctx.idle),
                                         blocked, self._team_room(req, going=True) if req.exclusive else None)
            if choice is not None or teams is None:
                return ([self.parts(h.id)[0] for h in choice.victims] if choice is not None else []), ""
        # This round's grants are not reclaimed in it (their leases are not in etcd yet): in the next one they can be.
        reclaim = choose_reclaim_victims(teams, self.view, req, w.free_of_queue, w.caps, self.evicting, self.ctx.wall,
                                         blocked, self._fleet_charges, {x.id for x in self.out.new_leases},
                                         self.ctx.idle)
        if reclaim is None and self._charges is not None:
            # Maybe held back only by a minimum runtime: decide again once the first one ends.
            until = protected_until(teams, self.view, req, self._charges, self.ctx.wall, self.evicting)
            if until is not None:
                left = max(0.0, until - self.ctx.wall)
                self.out.wake_after = left if self.out.wake_after is None else min(self.out.wake_after, left)
        if reclaim is None or not reclaim.victims:
            return [], ""
        return [self.parts(v)[0] for v in reclaim.victims], reclaim.team

    def _fits_once_evicted(self, req: Request, w: Waits) -> bool:
        """A single-GPU request that fits on one of its GPUs once the leases already being evicted are gone."""
        return any(req.vram_mb <= room_for(g.without(self.evicting), req.agent, w.caps[g.uuid])
                   for g in w.free_of_queue if g.uuid in w.caps)

    def _fleet_charges(self) -> list[Charge]:
        """Every lease of the fleet as the teams see it (built once a round, when a request may reclaim)."""
        if self._charges is None:
            assert self.ctx.teams is not None
            self._charges = fleet_charges(self.ctx.teams, self.view)
        return self._charges

    # -- write the ops: ``policy/writes.py`` -----------------------------------------------------------
