"""The console's pure parts: the events between two status documents, and the pages rendered from one."""
from __future__ import annotations

import copy
from typing import Any

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
