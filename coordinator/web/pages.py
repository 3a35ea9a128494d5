"""The console's pages as HTML, from the status document (``gpucoord status --json``) and the feed's events.

Every number on a page is a field of that document (or a sum of its fields); nothing is read elsewhere. Each
page is a ``<main>`` that the server renders again when the document changes and pushes to the open page
(``coordinator.web.app``), so the browser's script only swaps it in.
"""
from __future__ import annotations

import html
import time
from typing import Any, Iterable

from coordinator.web.gangs import lease_hosts, lease_rank, reservation

Doc = dict[str, Any]

NAV = (("/", "Summary"), ("/hosts", "Hosts"), ("/leases", "Leases and queue"), ("/teams", "Teams"),
       ("/events", "Events"))


def e(value: object) -> str:
    return html.escape(str(value), quote=True)


def gib(mb: int | float) -> str:
    return f"{mb / 1024:.1f} GiB"


def _pct(part: float, whole: float) -> str:
    return f"{max(0.0, min(100.0, 100.0 * part / whole)) if whole > 0 else 0.0:.1f}%"


def _table(head: Iterable[str], rows: list[list[str]], cls: str, empty: str) -> str:
    if not rows:
        return f'<p class="empty {cls}">{e(empty)}</p>'
    th = "".join(f"<th>{e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


def gpu_bar(host: str, g: dict[str, Any]) -> str:
    """One GPU: leased, untracked and free VRAM as parts of its usable VRAM."""
    usable = int(g.get("usable_mb") or g.get("total_mb") or 0)
    leased, untracked = int(g.get("leased_mb", 0)), int(g.get("untracked_mb", 0))
    free = max(0, int(g.get("free_mb", 0)))
    used = int(g.get("used_mb", -1))
    util = utilization(g)
    title = (f"GPU {g.get('index')} {g.get('name', '')}: leased {gib(leased)}, untracked {gib(untracked)}, "
             f"free {gib(free)} of {gib(usable)} usable" + (f"; NVML used {gib(used)}" if used >= 0 else "")
             + f"; utilization {util}")
    return (f'<div class="gpu" data-host="{e(host)}" data-gpu="{e(g.get("index"))}" data-leased-mb="{leased}" '
            f'data-untracked-mb="{untracked}" data-free-mb="{free}" data-util="{e(util)}" title="{e(title)}">'
            f'<span class="seg leased" style="width:{_pct(leased, usable)}"></span>'
            f'<span class="seg untracked" style="width:{_pct(untracked, usable)}"></span>'
            f'<span class="seg free" style="width:{_pct(free, usable)}"></span>'
            f'<span class="label">{e(g.get("index"))}: {gib(leased)} / {gib(usable)}</span>'
            f'<span class="util">util {e(util)}</span></div>')


def utilization(g: dict[str, Any]) -> str:
    """NVML's utilization of a GPU as status has it: ``-1`` (or absent) is unknown, never 0%."""
    pct = int(g.get("utilization_percent", -1))
    return f"{pct}%" if pct >= 0 else "unknown"


def _host_state(h: dict[str, Any]) -> str:
    return _liveness(h) + cordon_mark(h)


def _liveness(h: dict[str, Any]) -> str:
    if h.get("invalid"):
        return f'<span class="state bad" title="{e(h["invalid"])}">invalid</span>'
    if not h.get("alive"):
        return '<span class="state bad">lost</span>'
    return '<span class="state ok">up</span>' + (' <span class="state warn">usage stale</span>'
                                                 if h.get("usage_stale") else "")


def cordon_mark(h: dict[str, Any]) -> str:
    """A host's cordon as status has it (``cordoned``, ``cordon``, ``draining``); "" when not cordoned."""
    if not h.get("cordoned"):
        return ""
    c = h.get("cordon") or {}
    state = "draining" if h.get("draining") else "drained" if c.get("drain") else "cordoned"
    by = f" by {c['asked_by']}" if c.get("asked_by") else ""
    return (f' <span class="state warn cordon" data-cordon="{state}" title="{e(state + by)}">'
            f'{state}: {e(c.get("reason") or "no reason given")}</span>')


def labels(h: dict[str, Any]) -> str:
    """A host's labels (``gpucoord node --label``), one ``key=value`` mark each."""
    marks = "".join(f'<span class="hostlabel">{e(k)}={e(v)}</span>' for k, v in sorted(h.get("labels", {}).items()))
    return f'<div class="labels">{marks}</div>' if marks else ""


def _host_link(name: str) -> str:
    return f'<a href="/hosts/{e(name)}">{e(name)}</a>'


def summary(doc: Doc, events: list[dict[str, Any]]) -> str:
    hosts = doc.get("hosts", [])
    gpus = [g for h in hosts for g in h.get("gpus", [])]
    usable = sum(int(g.get("usable_mb", 0)) for g in gpus)
    leased = sum(int(g.get("leased_mb", 0)) for g in gpus)
    free = sum(max(0, int(g.get("free_mb", 0))) for g in gpus)
    idle = sum(1 for g in gpus if not int(g.get("leased_mb", 0)))
    leases = len({lease["id"] for h in hosts for lease in h.get("leases", [])})   # a multi-host lease once
    queue = sum(len(h.get("queue", [])) for h in hosts)
    members = doc.get("etcd_members", [])
    etcd_leader = next((m.get("name") or m.get("id") for m in members if m.get("leader")), "none")
    tiles = [("hosts-up", "Hosts up", f"{sum(1 for h in hosts if h.get('alive'))} / {len(hosts)}"),
             ("hosts-cordoned", "Hosts cordoned or draining", str(sum(1 for h in hosts if h.get("cordoned")))),
             ("gpus", "GPUs", str(len(gpus))), ("gpus-idle", "GPUs idle (no lease)", str(idle)),
             ("leased", "VRAM leased", f"{gib(leased)} / {gib(usable)}"), ("free", "VRAM free", gib(free)),
             ("leases", "Leases", str(leases)), ("queue-depth", "Queue depth", str(queue)),
             ("leader", "Replica leader", doc.get("leader") or "none"),
             ("etcd", "etcd members (leader)", f"{len(members)} ({etcd_leader})"),
             ("revision", "etcd revision", str(doc.get("revision", 0)))]
    cards = "".join(f'<div class="tile" id="tile-{k}"><div class="k">{e(label)}</div>'
                    f'<div class="v" data-value="{e(v)}">{e(v)}</div></div>' for k, label, v in tiles)
    return f'<h1>Fleet</h1><div class="tiles">{cards}</div><h2>Hosts</h2>{_host_rows(hosts)}'


def _host_rows(hosts: list[dict[str, Any]]) -> str:
    rows = [[_host_link(h["host"]) + labels(h), _host_state(h), e(h.get("partition_mode", "")),
             '<div class="gpus">' + "".join(gpu_bar(h["host"], g) for g in h.get("gpus", [])) + "</div>",
             str(len(h.get("leases", []))), str(len(h.get("queue", [])))] for h in hosts]
    return _table(("Host", "State", "Partition", "GPUs (leased / untracked / free)", "Leases", "Queue"), rows,
                  "hosts", "No host has registered.")


def hosts(doc: Doc, events: list[dict[str, Any]]) -> str:
    legend = ('<p class="legend"><span class="seg leased"></span> leased <span class="seg untracked"></span> '
              'untracked (used by no lease) <span class="seg free"></span> free</p>')
    return f"<h1>Hosts</h1>{legend}{_host_rows(doc.get('hosts', []))}"


def _lease_rows(hosts: list[dict[str, Any]], with_host: bool) -> list[list[str]]:
    rows = []
    shown: set[str] = set()   # a multi-host lease: one row over its hosts where hosts are shown
    for h in hosts:
        for lease in h.get("leases", []):
            gpus = ",".join(str(g.get("index")) for g in lease.get("gpus", [])) or str(lease.get("gpu_index"))
            over = lease_hosts(lease)
            if over and with_host:
                if lease["id"] in shown:
                    continue
                shown.add(lease["id"])
                gpus = over
            elif over:
                gpus += f" (rank {lease_rank(lease)} of {over})"
            notice = lease.get("eviction") or {}
            state = ("revoking" if notice.get("revoke") else "evicting: " + e(notice.get("reason", ""))) \
                if notice.get("lease_id") and not notice.get("withdrawn") else "held"
            state += idle_mark(lease)
            where = ", ".join(_host_link(x) for x in lease["hosts"]) if over else _host_link(h["host"])
            rows.append([*([where] if with_host else []), e(lease["id"]), e(lease.get("agent", "")),
                         e(gpus), gib(int(lease.get("vram_mb", 0))), str(lease.get("priority", 0)),
                         "yes" if lease.get("over_quota") else "", state,
                         e(",".join(str(p) for p in lease.get("pids", []))),
                         _clock(float(lease.get("created_at", 0)))])
    return rows


def _clock(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(unix)) + " UTC"


def idle_mark(lease: dict[str, Any]) -> str:
    """A lease's idle mark as status has it (``idle``, ``idle_since``, ``idle_action``); "" when not idle."""
    if not lease.get("idle"):
        return ""
    since = float(lease.get("idle_since") or 0)
    action = lease.get("idle_action") or ""
    return (f' <span class="state warn idle" data-idle-action="{e(action)}">idle'
            f'{" since " + _clock(since) if since > 0 else ""}{" (" + e(action) + ")" if action else ""}</span>')


def blockers(q: dict[str, Any]) -> str:
    """Why a waiter waits: its reason line, then what holds it back (status's ``reason`` and ``blockers``)."""
    items = "".join(f'<li data-kind="{e(b.get("kind", ""))}">{e(b.get("kind", ""))}: {e(b.get("detail", ""))}'
                    f'{" (ends " + _clock(float(b["ends_at_unix"])) + ")" if b.get("ends_at_unix") else ""}</li>'
                    for b in q.get("blockers", []))
    return f'<span class="reason">{e(q.get("reason", ""))}</span>' + (f'<ul class="blockers">{items}</ul>'
                                                                      if items else "")


def estimate(q: dict[str, Any]) -> str:
    """A waiter's estimated start: a time where status has one (``has_estimate``), else unknown."""
    return _clock(float(q.get("estimated_start_unix", 0))) if q.get("has_estimate") else "unknown"


def _queue_rows(hosts: list[dict[str, Any]], with_host: bool) -> list[list[str]]:
    rows = []
    for h in hosts:
        index_of = {g.get("uuid"): g.get("index") for g in h.get("gpus", [])}
        for position, q in enumerate(sorted(h.get("queue", []), key=lambda q: str(q.get("rank", ""))), 1):
            count = max(1, int(q.get("gpu_count", 1)))
            held = reservation(q, index_of)
            rows.append([*([_host_link(h["host"])] if with_host else []), str(q.get("position") or position),
                         e(q.get("agent", "")), gib(int(q.get("vram_mb", 0))) + (f" x {count}" if count > 1 else ""),
                         str(q.get("priority", 0)),
                         e(held or q.get("gpu") or ",".join(q.get("gpus", [])) or "any"),
                         blockers(q), estimate(q)])
    return rows


LEASE_HEAD = ("Lease", "Agent", "GPUs", "VRAM each", "Priority", "Borrowed", "State", "Processes", "Granted")
QUEUE_HEAD = ("Position", "Agent", "VRAM", "Priority", "GPU", "Why it waits", "Estimated start")


def leases(doc: Doc, events: list[dict[str, Any]]) -> str:
    hs = doc.get("hosts", [])
    gangs = [[str(g.get("position", 0)), e(g.get("agent", "")), str(g.get("priority", 0)),
              f'<span class="reason">{e(g.get("reason", ""))}</span>'] for g in doc.get("gang_queue", [])]
    return ("<h1>Leases</h1>" + _table(("Host", *LEASE_HEAD), _lease_rows(hs, True), "leases", "No lease is held.")
            + "<h2>Queue</h2>" + _table(("Host", *QUEUE_HEAD), _queue_rows(hs, True), "queue", "Nobody waits.")
            + "<h2>Multi-host gangs waiting</h2>" + _table(("Position", "Agent", "Priority", "Reservation"), gangs,
                                                           "gangqueue", "No multi-host gang waits."))


def host(doc: Doc, events: list[dict[str, Any]], name: str) -> str | None:
    found = [h for h in doc.get("hosts", []) if h["host"] == name]
    if not found:
        return None
    h = found[0]
    procs = [[e(g.get("index")), e(p.get("pid")), gib(int(p.get("used_mb", 0))), e(p.get("state", "")),
              e(p.get("lease_id", ""))] for g in h.get("gpus", []) for p in g.get("processes", [])]
    agents = [[e(a.get("agent", "")), e(", ".join(f"{k}={v}" for k, v in sorted(a.get("allocation", {}).items()))),
               gib(int(a.get("leased_mb", 0))), str(a.get("leases", 0))] for a in h.get("agents", [])]
    facts = (f'<p class="facts">{_host_state(h)} {e(h.get("address", ""))} · {e(h.get("cpu_count", 0))} CPUs · '
             f'{gib(int(h.get("mem_bytes", 0)) / 1048576)} memory · partition {e(h.get("partition_mode", ""))}'
             f'{" · simulated GPUs" if h.get("simulated") else ""}</p>{labels(h)}')
    bars = '<div class="gpus wide">' + "".join(gpu_bar(name, g) for g in h.get("gpus", [])) + "</div>"
    return (f"<h1>Host {e(name)}</h1>{facts}{bars}<h2>Leases</h2>"
            + _table(LEASE_HEAD, _lease_rows([h], False), "leases", "No lease is held here.")
            + "<h2>Queue</h2>" + _table(QUEUE_HEAD, _queue_rows([h], False), "queue", "Nobody waits here.")
            + "<h2>Processes</h2>" + _table(("GPU", "PID", "Used", "State", "Lease"), procs, "processes",
                                            "The node reports no process on its GPUs.")
            + "<h2>Partition</h2>" + _table(("Agent", "Allocation", "Leased", "Leases"), agents, "partition",
                                            "No agent has an allocation here."))


def teams(doc: Doc, events: list[dict[str, Any]]) -> str:
    rows = []
    most = max((float(t.get("usage", {}).get("decayed_gpu_hours", 0.0)) for t in doc.get("teams", [])), default=0.0)
    for t in doc.get("teams", []):
        team, usage = t.get("team", {}), t.get("usage", {})
        quota, used = int(team.get("quota_mb", 0)), int(usage.get("used_mb", 0))
        limit = int(team.get("limit_mb", 0)) if team.get("has_limit") else -1
        scale = max(quota, limit, used, 1)
        marks = f'<span class="mark quota" style="left:{_pct(quota, scale)}" title="quota"></span>' + (
            f'<span class="mark limit" style="left:{_pct(limit, scale)}" title="limit"></span>' if limit >= 0 else "")
        bar = (f'<div class="teambar" data-team="{e(team.get("name", ""))}" data-used-mb="{used}" '
               f'data-quota-mb="{quota}" data-borrowed-mb="{int(usage.get("borrowed_mb", 0))}">'
               f'<span class="seg leased" style="width:{_pct(used, scale)}"></span>{marks}</div>')
        decayed = float(usage.get("decayed_gpu_hours", 0.0))
        dbar = (f'<div class="teambar decayed" data-team="{e(team.get("name", ""))}" '
                f'data-decayed-gpu-hours="{decayed:g}" title="{decayed:.1f} GPU-hours, decayed">'
                f'<span class="seg decayed" style="width:{_pct(decayed, most)}"></span></div>')
        rows.append([e(team.get("name", "")), gib(quota), gib(limit) if limit >= 0 else "none", gib(used),
                     gib(int(usage.get("borrowed_mb", 0))), f'{usage.get("leases", 0)} / {usage.get("waiting", 0)}',
                     bar, f"{decayed:.1f} h" + dbar])
    return "<h1>Teams</h1>" + _table(("Team", "Quota", "Limit", "Used", "Borrowed", "Leases / waiting",
                                      "Used against quota (|) and limit (|)",
                                      "Decayed usage (GPU-hours, against the most)"), rows, "teams",
                                     "No team is configured ('gpucoord team set').") + usage_chart(doc)


def usage_chart(doc: Doc) -> str:
    """GPU-hours per team per UTC day, the last days (status's ``usage_days``: the hourly rollups of the leases
    that ended), as one column of bars a day, each bar against the largest of the chart."""
    days = doc.get("usage_days", [])
    if not days:
        return ""
    teams = sorted({t for d in days for t in d.get("gpu_seconds", {})})
    most = max((float(s) for d in days for s in d.get("gpu_seconds", {}).values()), default=0.0)
    cols = []
    for d in days:
        secs = d.get("gpu_seconds", {})
        bars = "".join(f'<span class="bar t{n % 6}" data-team="{e(t)}" data-gpu-seconds="{float(secs.get(t, 0.0)):g}" '
                       f'style="height:{_pct(float(secs.get(t, 0.0)), most)}" '
                       f'title="{e(t)}: {float(secs.get(t, 0.0)) / 3600:.2f} GPU-hours"></span>'
                       for n, t in enumerate(teams))
        cols.append(f'<div class="day" data-day="{e(d.get("day", ""))}"><div class="bars">{bars}</div>'
                    f'<div class="k">{e(str(d.get("day", ""))[5:])}</div></div>')
    legend = "".join(f'<span class="bar t{n % 6}"></span> {e(t)} ' for n, t in enumerate(teams))
    return (f'<h2>Usage, GPU-hours per day (UTC)</h2><p class="legend">{legend or "no lease has ended yet"}</p>'
            f'<div class="usagechart">{"".join(cols)}</div>')


def event_items(events: list[dict[str, Any]]) -> str:
    return "".join(event_item(ev) for ev in reversed(events))


def event_item(ev: dict[str, Any]) -> str:
    at = time.strftime("%H:%M:%S", time.gmtime(float(ev.get("time", 0))))
    return (f'<li class="event {e(ev.get("kind", ""))}" data-seq="{e(ev.get("seq", 0))}" '
            f'data-kind="{e(ev.get("kind", ""))}" data-lease="{e(ev.get("lease", ""))}">'
            f'<time>{at}</time> <b>{e(ev.get("kind", ""))}</b> {e(ev.get("text", ""))}</li>')


def events_page(doc: Doc, events: list[dict[str, Any]]) -> str:
    body = event_items(events) or '<li class="none">Nothing yet: events appear here as they happen.</li>'
    return f'<h1>Events</h1><ul class="events all">{body}</ul>'


def main(view: str, doc: Doc | None, error: str, events: list[dict[str, Any]]) -> str | None:
    """The ``<main>`` content of ``view`` (a page's path); None: no such page."""
    if doc is None:
        return f'<h1>Unavailable</h1><p class="error">{e(error or "no status read yet")}</p>'
    pages = {"/": summary, "/hosts": hosts, "/leases": leases, "/teams": teams, "/events": events_page}
    if view in pages:
        out = pages[view](doc, events)
    elif view.startswith("/hosts/"):
        found = host(doc, events, view[len("/hosts/"):])
        if found is None:
            return None
        out = found
    else:
        return None
    return out + (f'<p class="error">the last read failed: {e(error)}</p>' if error else "")


def layout(view: str, inner: str, events: list[dict[str, Any]], title: str = "gpucoord") -> str:
    """A whole page: navigation, ``<main>`` and the recent events beside it."""
    nav = "".join(f'<a href="{href}"{" class=on" if href == view else ""}>{e(label)}</a>' for href, label in NAV)
    last = events[-1]["seq"] if events else 0
    recent = event_items(events[-30:]) or '<li class="none">Nothing yet.</li>'
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f'<title>{e(title)}</title><link rel=stylesheet href="/static/console.css"></head>'
            f'<body data-view="{e(view)}" data-seq="{last}"><header><b>gpucoord</b><nav>{nav}</nav>'
            '<span id="live" title="live updates">connecting</span></header>'
            f'<div class="page"><main id="main">{inner}</main><aside><h2>Events</h2>'
            f'<ul id="recent" class="events">{recent}</ul></aside></div>'
            '<script src="/static/console.js"></script></body></html>')


__all__ = ["event_item", "layout", "main"]
