"""The console's pure parts: the events between two status documents, and the pages rendered from one."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from coordinator.web import pages
from coordinator.web.events import Feed, changes


def doc(*leases: dict[str, Any], alive: bool = True, queue: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    gpu = {"index": 0, "uuid": "GPU-0", "name": "sim", "total_mb": 16384, "usable_mb": 16384,
           "leased_mb": sum(x["vram_mb"] for x in leases), "used_mb": -1, "untracked_mb": 1024,
           "free_mb": 16384 - 1024 - sum(x["vram_mb"] for x in leases), "processes": []}
    return {"revision": 7, "leader": "c1", "hosts": [{"host": "h1", "alive": alive, "gpus": [gpu],
                                                      "leases": list(leases), "queue": list(queue), "agents": []}],
            "teams": []}


def lease(lid: str, notice: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": lid, "host": "h1", "agent": "agent-a", "gpu_index": 0, "vram_mb": 4096,
            "gpus": [{"index": 0}], **({"eviction": notice} if notice else {})}


def kinds(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["kind"], e["lease"]) for e in events]


def test_the_first_document_has_no_events_and_an_unchanged_one_none() -> None:
    assert changes(None, doc(lease("a"))) == []
    assert changes(doc(lease("a")), doc(lease("a"))) == []


def test_grants_notices_and_ends_are_told_apart() -> None:
    evict = {"lease_id": "a", "reason": "disk swap", "requested_by": "operator"}
    assert kinds(changes(doc(), doc(lease("a")))) == [("grant", "a")]
    events = changes(doc(lease("a")), doc(lease("a", evict)))
    assert kinds(events) == [("evict", "a")] and "disk swap (by operator)" in events[0]["text"]
    revoke = changes(doc(lease("a")), doc(lease("a", {**evict, "revoke": True})))
    assert kinds(revoke) == [("revoke", "a")]
    # A notice already seen is not an event again; a withdrawn one is none.
    assert changes(doc(lease("a", evict)), doc(lease("a", evict))) == []
    assert changes(doc(lease("a")), doc(lease("a", {**evict, "withdrawn": True}))) == []
    end = changes(doc(lease("a", evict)), doc())
    assert kinds(end) == [("end", "a")] and "after its eviction notice" in end[0]["text"]


def test_a_lost_host_and_a_new_waiter_are_events() -> None:
    assert kinds(changes(doc(), doc(alive=False))) == [("host-lost", "")]
    assert kinds(changes(doc(alive=False), doc())) == [("host", "")]
    q = {"rank": "r1", "agent": "agent-b", "vram_mb": 2048}
    assert [e["kind"] for e in changes(doc(), doc(queue=(q,)))] == ["queue"]


def test_the_feed_numbers_the_events_it_keeps() -> None:
    docs = [doc(), doc(lease("a")), doc(lease("a"), lease("b")), doc()]
    feed = Feed(lambda: copy.deepcopy(docs.pop(0) if len(docs) > 1 else docs[0]), interval=0.0, keep=2,
                clock=lambda: 100.0)
    with feed.watching():
        version = 0
        while feed.last_seq() < 4:          # grant a, grant b, end a, end b
            version = feed.wait_past(version, 10.0)
    kept = feed.events()
    assert [(e["seq"], e["kind"]) for e in kept] == [(3, "end"), (4, "end")] and feed.events(3) == kept[1:]


def test_the_feed_reads_at_its_interval_but_spends_at_most_a_fifth_of_the_time_reading() -> None:
    feed = Feed(lambda: doc(), interval=0.5)
    assert feed.pause_after(0.01) == 0.5              # a small fleet: every half second
    assert feed.pause_after(2.0) == pytest.approx(8.0)   # 10,000 hosts: a status of seconds, a fifth of the time


def test_a_gpu_bar_shows_leased_untracked_and_free_as_parts_of_its_usable_vram() -> None:
    bar = pages.gpu_bar("h1", doc(lease("a"))["hosts"][0]["gpus"][0])
    assert 'data-leased-mb="4096" data-untracked-mb="1024" data-free-mb="11264"' in bar
    assert 'class="seg leased" style="width:25.0%"' in bar and 'class="seg untracked" style="width:6.2%"' in bar


def test_pages_escape_what_they_show_and_know_their_paths() -> None:
    d = doc(lease("<script>x</script>"))
    hosts = pages.main("/leases", d, "", [])
    assert hosts is not None and "<script>x" not in hosts and "&lt;script&gt;x" in hosts
    assert pages.main("/hosts/h1", d, "", []) is not None
    assert pages.main("/hosts/nope", d, "", []) is None and pages.main("/nope", d, "", []) is None
    down = pages.main("/", None, "etcd unreachable", [])
    assert down is not None and "etcd unreachable" in down
    summary = pages.main("/", d, "", [])
    assert summary is not None and 'data-value="4.0 GiB / 16.0 GiB"' in summary and 'data-value="1 / 1"' in summary


def test_a_teams_bar_is_used_against_the_larger_of_quota_limit_and_use() -> None:
    d = doc()
    d["teams"] = [{"team": {"name": "research", "quota_mb": 8192, "has_limit": True, "limit_mb": 16384},
                   "usage": {"used_mb": 4096, "borrowed_mb": 0, "leases": 1, "waiting": 0}}]
    page = pages.main("/teams", d, "", [])
    assert page is not None and 'data-team="research" data-used-mb="4096" data-quota-mb="8192"' in page
    assert 'style="width:25.0%"' in page and 'class="mark quota" style="left:50.0%"' in page


def test_hosts_show_labels_cordon_and_utilization_escaped_and_unknown_is_not_zero() -> None:
    d = doc(lease("a"))
    h = d["hosts"][0]
    h.update(labels={"rack": "<b>r4</b>", "zone": "eu"}, cordoned=True, draining=True,
             cordon={"reason": "<i>disk</i> swap", "drain": True, "asked_by": "op"})
    h["gpus"][0]["utilization_percent"] = 37
    h["gpus"].append({**h["gpus"][0], "index": 1, "utilization_percent": -1})
    page = pages.main("/hosts", d, "", [])
    assert page is not None and "<b>r4" not in page and "<i>disk" not in page
    assert '<span class="hostlabel">rack=&lt;b&gt;r4&lt;/b&gt;</span>' in page and "zone=eu" in page
    assert 'data-cordon="draining"' in page and "draining: &lt;i&gt;disk&lt;/i&gt; swap" in page
    assert 'data-gpu="0"' in page and 'data-util="37%"' in page and 'data-util="unknown"' in page
    assert 'data-util="0%"' not in page and "util 37%</span>" in page and "util unknown</span>" in page
    h.update(draining=False)
    assert 'data-cordon="drained"' in pages.cordon_mark(h)
    h.update(cordon={"reason": "", "drain": False})
    assert 'data-cordon="cordoned"' in pages.cordon_mark(h) and "no reason given" in pages.cordon_mark(h)
    h.update(cordoned=False)
    assert pages.cordon_mark(h) == "" and "data-cordon" not in (pages.main("/hosts/h1", d, "", []) or "x data-cordon")
    assert pages.utilization({}) == "unknown"     # absent: unknown, never 0%


def test_leases_show_idle_marks_and_the_queue_why_and_when() -> None:
    idle = {**lease("a"), "idle": True, "idle_since": 3600.0, "idle_action": "<evict>"}
    waiter = {"rank": "r1", "agent": "agent-b", "vram_mb": 2048, "position": 2, "reason": "waits for <GPU 0>",
              "blockers": [{"kind": "lease", "detail": "lease a holds <4 GiB>", "ends_at_unix": 7200.0},
                           {"kind": "ahead", "detail": "r0 is ahead"}],
              "estimated_start_unix": 7200.0, "has_estimate": True}
    unknown = {"rank": "r2", "agent": "agent-c", "vram_mb": 1024, "position": 3, "reason": "no GPU fits",
               "blockers": [], "estimated_start_unix": 0.0, "has_estimate": False}
    page = pages.main("/leases", doc(idle, lease("b"), queue=(waiter, unknown)), "", [])
    assert page is not None and "<evict>" not in page and "<GPU 0>" not in page and "<4 GiB>" not in page
    assert page.count('class="state warn idle"') == 1 and "idle since 01:00:00 UTC (&lt;evict&gt;)" in page
    assert '<span class="reason">waits for &lt;GPU 0&gt;</span>' in page
    assert '<li data-kind="lease">lease: lease a holds &lt;4 GiB&gt; (ends 02:00:00 UTC)</li>' in page
    assert '<li data-kind="ahead">ahead: r0 is ahead</li>' in page
    rows = page.split('<table class="queue">')[1].split("<tr>")[2:]
    assert rows[0].startswith("<td>" + pages._host_link("h1") + "</td><td>2</td>") and "<td>02:00:00 UTC</td>" in rows[0]
    assert "<td>3</td>" in rows[1] and rows[1].split("<h2>")[0].endswith("<td>unknown</td></tr></tbody></table></div>")
    assert '<p class="empty gangqueue">No multi-host gang waits.</p>' in page


def test_a_cordon_and_an_uncordon_are_events() -> None:
    cordoned = doc()
    cordoned["hosts"][0].update(cordoned=True, cordon={"reason": "disk swap", "drain": True, "asked_by": "op"})
    events = changes(doc(), cordoned)
    assert [e["kind"] for e in events] == ["cordon"] and events[0]["text"] == "host h1 cordoned for a drain: disk swap (by op)"
    assert [e["kind"] for e in changes(cordoned, doc())] == ["uncordon"] and changes(cordoned, cordoned) == []


def test_the_usage_chart_draws_each_teams_gpu_seconds_a_day_against_the_largest() -> None:
    doc = {"usage_days": [{"day": "2026-12-05", "gpu_seconds": {"<a>": 3600.0}},
                          {"day": "2026-12-06", "gpu_seconds": {"<a>": 900.0, "b": 7200.0}}]}
    chart = pages.usage_chart(doc)
    assert chart.count('class="day"') == 2 and "&lt;a&gt;" in chart and "<a>" not in chart
    assert 'data-team="b" data-gpu-seconds="7200" style="height:100.0%"' in chart
    assert 'data-team="&lt;a&gt;" data-gpu-seconds="900" style="height:12.5%"' in chart
    assert 'data-team="b" data-gpu-seconds="0" style="height:0.0%"' in chart      # no usage on the 5th
    assert pages.usage_chart({}) == ""
