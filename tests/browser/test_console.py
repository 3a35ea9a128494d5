"""The fleet console in a real browser (chromium, headless): a page follows the fleet over Server-Sent
Events without reload (an acquire on its host's bar, an eviction in the events, a drain's mark on its host, a
waiter and why it waits, a team's bar), and its pages lay out at 1400 and 800 pixels wide. Each test saves a
screenshot under its tmp dir and prints its path.

Every wait polls the page with a deadline (``WebDriverWait``); none sleeps.
"""
from __future__ import annotations

import json
import pathlib
import threading
import time
import urllib.request
from typing import Any, Iterator

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import metrics
from coordinator.cli.common import fetch_status
from coordinator.metrics_http import MetricsGate
from coordinator.rpc.coordinator_server import create_server
from tests.support import browser as chromium
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]
if chromium.missing():   # one line for the whole tier, as the Docker tier says it
    pytest.skip(f"browser tier: no browser: {chromium.missing()}", allow_module_level=True)

DEADLINE_S = 10.0   # the page's deadline; the push comes within the feed's interval (0.5 s) on an idle machine
MARK = "window.__gpucoordNoReload"


class Fleet:
    def __init__(self, cluster: Cluster, addr: str, web: str) -> None:
        self.cluster, self.addr, self.web = cluster, addr, web
        self.stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))


@pytest.fixture
def fleet(cluster: Cluster) -> Iterator[Fleet]:
    """Host h1 (two simulated 16 GiB GPUs), a coordinator and its console on a free loopback port."""
    cluster.start_node("h1", "2x16GiB")
    gate = MetricsGate()
    server, port, svc = cluster.lt.run(create_server(cluster.config(), metrics_gate=gate))
    addr = f"127.0.0.1:{port}"
    cluster.coordinators[addr] = (server, svc)
    web = metrics.serve("127.0.0.1:0", None, gate=gate)
    wait_for(lambda: any(h["host"] == "h1" and h["gpus"] for h in fetch_status(addr)["hosts"]), 15, "h1 in status")
    yield Fleet(cluster, addr, f"http://127.0.0.1:{web}")


def open_live(browser: Any, url: str) -> None:
    """Open ``url`` and wait until its stream has pushed the page once; mark the window (a reload clears it)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, DEADLINE_S, poll_frequency=0.05).until(
        lambda d: d.execute_script("return document.body.getAttribute('data-live')") == "1")
    browser.execute_script(f"{MARK} = 42;")


def until(browser: Any, what: str, script: str) -> Any:
    """Poll ``script`` (JavaScript returning a value) until it is truthy, with the deadline; its value."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, DEADLINE_S, poll_frequency=0.05).until(lambda d: d.execute_script(script))
    except TimeoutException:
        raise AssertionError(f"{what}: not on the page within {DEADLINE_S:g} s") from None


def not_reloaded(browser: Any) -> None:
    assert browser.execute_script(f"return {MARK}") == 42, "the page was reloaded"


def shot(browser: Any, tmp_path: pathlib.Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    assert browser.save_screenshot(str(path))
    print(f"screenshot: {path}")


def leased_mb(browser: Any, gpu: int) -> int:
    return int(browser.execute_script(
        f"var b = document.querySelector('.gpu[data-host=\"h1\"][data-gpu=\"{gpu}\"]');"
        "return b ? b.getAttribute('data-leased-mb') : -1;"))


def wait_in_background(c: Client, got: list[Any]) -> threading.Thread:
    """``c`` asks for 1 GiB and waits; its lease, or the error it got, is appended to ``got``."""
    def wait() -> None:
        try:
            got.append(c.acquire(vram_mb=1024, wait=120.0))
        except Exception as e:   # noqa: BLE001 - the test asserts what the thread got
            got.append(e)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    return waiter


def test_an_acquire_appears_on_the_hosts_bar_without_reload(browser: Any, fleet: Fleet,
                                                            tmp_path: pathlib.Path) -> None:
    browser.set_window_size(1400, 900)
    open_live(browser, fleet.web + "/hosts")
    assert leased_mb(browser, 0) == 0 and leased_mb(browser, 1) == 0
    with Client(fleet.addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=4096, gpu="1")
        pushed = time.monotonic()
        until(browser, "the lease on GPU 1's bar",
              "var b = document.querySelector('.gpu[data-host=\"h1\"][data-gpu=\"1\"]');"
              "return b && b.getAttribute('data-leased-mb') === '4096';")
        print(f"the acquire reached the page {time.monotonic() - pushed:.2f} s after it was granted")
        not_reloaded(browser)
        width = browser.execute_script(
            "return document.querySelector('.gpu[data-gpu=\"1\"] .seg.leased').style.width")
        assert width == "25%", width     # 4 GiB of 16 GiB usable (no headroom on simulated GPUs)
        until(browser, "the grant in the events", f"return !!document.querySelector("
              f"'#recent li[data-kind=\"grant\"][data-lease=\"{lease.id}\"]')")
        shot(browser, tmp_path, "hosts-acquired")
        lease.release()
        until(browser, "the released VRAM back on the bar", "return document.querySelector("
              "'.gpu[data-host=\"h1\"][data-gpu=\"1\"]').getAttribute('data-leased-mb') === '0'")
        not_reloaded(browser)


def test_an_eviction_appears_in_the_events_with_its_reason(browser: Any, fleet: Fleet,
                                                           tmp_path: pathlib.Path) -> None:
    browser.set_window_size(1400, 900)
    with Client(fleet.addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=2048)
        open_live(browser, fleet.web + "/hosts/h1")
        fleet.stub.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=60, reason="disk swap in rack 4"),
                              timeout=10)
        text = until(browser, "the eviction in the events", "var li = document.querySelector("
                     f"'#recent li[data-kind=\"evict\"][data-lease=\"{lease.id}\"]'); return li && li.textContent;")
        assert "disk swap in rack 4" in text and "operator" in text, text
        until(browser, "the lease marked as evicting", "return document.querySelector('table.leases')"
              ".textContent.indexOf('evicting: disk swap in rack 4') >= 0")
        not_reloaded(browser)
        shot(browser, tmp_path, "host-evicting")
        lease.release()
        until(browser, "the lease's end in the events", "return !!document.querySelector("
              f"'#recent li[data-kind=\"end\"][data-lease=\"{lease.id}\"]')")


def test_a_drained_host_is_marked_without_reload(browser: Any, fleet: Fleet, tmp_path: pathlib.Path) -> None:
    """A drain through the API marks the host on the open hosts page (draining, with its reason), its lease's
    notice shows as an eviction, and the mark goes with the uncordon: all pushed, none reloaded."""
    browser.set_window_size(1400, 900)
    mark = "var m = document.querySelector('table.hosts .cordon');"
    with Client(fleet.addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=2048)
        open_live(browser, fleet.web + "/hosts")
        assert browser.execute_script(f"{mark} return m === null")
        util = browser.execute_script("return document.querySelector('.gpu[data-gpu=\"0\"]').getAttribute('data-util')")
        assert util == "unknown" or util.endswith("%"), util
        fleet.stub.CordonHost(pb.CordonHostRequest(host="h1", reason="driver <upgrade>", drain=True,
                                                   grace_seconds=60), timeout=10)
        text = until(browser, "the host marked as draining",
                     f"{mark} return m && m.getAttribute('data-cordon') === 'draining' && m.textContent;")
        assert text == "draining: driver <upgrade>", text
        until(browser, "the drain's notice in the events", "return !!document.querySelector("
              f"'#recent li[data-kind=\"evict\"][data-lease=\"{lease.id}\"]')")
        until(browser, "the drain in the events", "return !!document.querySelector('#recent li[data-kind=\"cordon\"]')")
        not_reloaded(browser)
        shot(browser, tmp_path, "hosts-draining")
        lease.release()
        until(browser, "the host marked as drained", f"{mark} return m && m.getAttribute('data-cordon') === 'drained'")
        fleet.stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)
        until(browser, "the mark gone with the uncordon", f"{mark} return m === null")
        not_reloaded(browser)


def test_a_waiter_shows_why_it_waits_in_the_queue(browser: Any, fleet: Fleet, tmp_path: pathlib.Path) -> None:
    """h1 cordoned: a request waits; the open leases page shows it, pushed, with its position, the reason
    status gives (naming the cordon's reason), its blocker and no estimated start; the uncordon grants it."""
    browser.set_window_size(1400, 900)
    fleet.stub.CordonHost(pb.CordonHostRequest(host="h1", reason="driver upgrade"), timeout=10)
    open_live(browser, fleet.web + "/leases")
    got: list[Any] = []
    with Client(fleet.addr, agent="agent-b", host="h1") as c:
        waiter = wait_in_background(c, got)
        row = until(browser, "the waiter in the queue", "var r = document.querySelector('table.queue tbody tr');"
                    " return r && Array.prototype.map.call(r.cells, function (c) { return c.textContent; });")
        assert row[1:3] == ["1", "agent-b"], row
        assert "driver upgrade" in row[6] and "cordon:" in row[6] and row[7] == "unknown", row
        not_reloaded(browser)
        shot(browser, tmp_path, "queue-waiting")
        fleet.stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)
        until(browser, "the queue empty once granted", "return !!document.querySelector('p.empty.queue')")
        waiter.join(60.0)
        assert got and not isinstance(got[0], Exception), got
        got[0].release()


def test_a_teams_bar_moves(browser: Any, fleet: Fleet, tmp_path: pathlib.Path) -> None:
    fleet.stub.SetTeam(pb.SetTeamRequest(name="research", quota_mb=8192, limit_mb=16384,
                                         members=pb.TeamMembers(patterns=["research-*"])), timeout=10)
    browser.set_window_size(1400, 900)
    open_live(browser, fleet.web + "/teams")
    bar = "document.querySelector('.teambar[data-team=\"research\"]')"
    assert browser.execute_script(f"return {bar}.getAttribute('data-used-mb')") == "0"
    with Client(fleet.addr, agent="research-1", host="h1") as c:
        with c.acquire(vram_mb=4096):
            until(browser, "research's used VRAM on its bar",
                  f"return {bar}.getAttribute('data-used-mb') === '4096'")
            width = browser.execute_script(f"return {bar}.querySelector('.seg.leased').style.width")
            assert width == "25%", width    # 4 GiB against a scale of its 16 GiB limit
            decayed = browser.execute_script("return document.querySelector("
                                             "'.teambar.decayed[data-team=\"research\"]').getAttribute('data-decayed-gpu-hours')")
            assert float(decayed) >= 0.0, decayed   # status's decayed_gpu_hours (nothing ended yet: ~0)
            not_reloaded(browser)
            shot(browser, tmp_path, "teams-used")
    # The lease ended: the leader's accountant charges its GPU-seconds to research's rollup of this hour, and the
    # usage chart's bar of today (the last day) shows them, pushed.
    today = "document.querySelector('.usagechart .day:last-child .bar[data-team=\"research\"]')"
    secs = until(browser, "research's GPU-seconds of today on the usage chart",
                 f"var b = {today}; return b && parseFloat(b.getAttribute('data-gpu-seconds')) > 0 && "
                 "b.getAttribute('data-gpu-seconds');")
    assert float(secs) > 0, secs
    not_reloaded(browser)
    shot(browser, tmp_path, "teams-usage-chart")


@pytest.mark.parametrize("width", [1400, 800])
def test_every_page_lays_out_at_this_width(browser: Any, fleet: Fleet, tmp_path: pathlib.Path, width: int) -> None:
    """No page scrolls sideways; the events sit beside the page when wide and below it when narrow. h1 holds a
    lease and is cordoned, with a request waiting, so the cordon's mark and the queue's reasons are laid out."""
    browser.set_window_size(width, 900)
    got: list[Any] = []
    with Client(fleet.addr, agent="agent-a", host="h1") as c, c.acquire(vram_mb=1024), \
            Client(fleet.addr, agent="agent-b", host="h1") as b:
        fleet.stub.CordonHost(pb.CordonHostRequest(host="h1", reason="driver upgrade in rack 4"), timeout=10)
        waiter = wait_in_background(b, got)
        wait_for(lambda: bool(fetch_status(fleet.addr)["hosts"][0]["queue"]), 15, "agent-b's request to wait")
        for path in ("/", "/hosts", "/hosts/h1", "/leases", "/teams", "/events"):
            open_live(browser, fleet.web + path)
            overflow = browser.execute_script("var d = document.documentElement; return d.scrollWidth - d.clientWidth")
            assert overflow <= 0, f"{path} at {width} px scrolls sideways by {overflow} px"
            main, aside = browser.execute_script(
                "function r(s) { var b = document.querySelector(s).getBoundingClientRect();"
                " return {left: b.left, right: b.right, top: b.top, bottom: b.bottom}; }"
                "return [r('main'), r('aside')];")
            if width >= 1400:
                assert aside["left"] >= main["right"], (path, main, aside)
            else:
                assert aside["top"] >= main["bottom"], (path, main, aside)
            shot(browser, tmp_path, f"{path.strip('/').replace('/', '-') or 'summary'}-{width}")
        fleet.stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)
        waiter.join(60.0)
        assert got and not isinstance(got[0], Exception), got
        got[0].release()


def test_the_console_shows_what_status_json_shows(browser: Any, fleet: Fleet) -> None:
    """/api/status is 'gpucoord status --json' (one code path), and the summary's numbers are its sums."""
    with Client(fleet.addr, agent="agent-a", host="h1") as c, c.acquire(vram_mb=3072):
        with urllib.request.urlopen(fleet.web + "/api/status", timeout=10) as resp:
            console = json.loads(resp.read())
        cli = fetch_status(fleet.addr)
        volatile = ("usage_age_seconds", "ttl_remaining", "revision", "grace_left_seconds")

        def strip(doc: Any) -> Any:
            if isinstance(doc, dict):
                return {k: strip(v) for k, v in doc.items() if k not in volatile}
            return [strip(x) for x in doc] if isinstance(doc, list) else doc
        assert strip(console) == strip(cli)
        open_live(browser, fleet.web + "/")
        value = until(browser, "the leased VRAM tile", "var v = document.querySelector('#tile-leased .v');"
                      " return v && v.getAttribute('data-value').indexOf('3.0 GiB') === 0 && v.textContent;")
        assert value == "3.0 GiB / 32.0 GiB"
        assert browser.execute_script("return document.querySelector('#tile-hosts-up .v').textContent") == "1 / 1"
        members = cli["etcd_members"]
        leader = next(m.get("name") or m.get("id") for m in members if m.get("leader"))
        assert browser.execute_script("return document.querySelector('#tile-etcd .v').textContent") == \
            f"{len(members)} ({leader})"
        tile = "return document.querySelector('#tile-hosts-cordoned .v').textContent"
        assert browser.execute_script(tile) == "0"
        fleet.stub.CordonHost(pb.CordonHostRequest(host="h1", reason="rack power work"), timeout=10)
        until(browser, "the cordoned host counted", "var v = document.querySelector('#tile-hosts-cordoned .v');"
              " return v && v.textContent === '1'")
        fleet.stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)
        until(browser, "the count back to 0", "var v = document.querySelector('#tile-hosts-cordoned .v');"
              " return v && v.textContent === '0'")
