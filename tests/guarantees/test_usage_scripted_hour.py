"""A scripted hour of usage (issue 33 acceptance), time compressed: the coordinator's and the node's wall clock
(``coordinator.clock.wall``, which every record's times come from) runs 120 times faster than real time, so the
hour takes 30 s, against a real etcd, a replica and a node. Three teams' leases of several lengths and GPU
counts start and end at scripted minutes of the hour, some across a UTC hour's edge (their GPU-seconds split
over two hourly rollups). ``gpucoord usage --by team`` then says, in GPU-hours, what the checker computes from
etcd's history (records against the history: none missing, none twice, GPU-seconds to the millisecond); its
``--csv`` loads with a header naming each column's unit."""
from __future__ import annotations

import csv
import io
import json
import time
from typing import Any

import pytest

from agent_client import Client
from coordinator import clock
from coordinator.cli.main import main as cli_main
from coordinator.policy.accounting import hour_of
from tests.history import read_history
from tests.support.cluster import Cluster
from tests.support.history_usage import check_usage
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
SPEED = 120.0      # wall seconds per real second: the hour in 30 s
# (start minute, end minute, team, MiB per GPU (0: whole GPUs), GPUs)
SCRIPT = [(0, 40, "t1", 4000, 1), (5, 60, "t2", 0, 2), (10, 25, "t3", 1000, 1), (30, 55, "t3", 3000, 1),
          (45, 58, "t1", 2000, 1)]


def test_a_scripted_hour_of_three_teams_gives_the_gpu_hours_the_history_gives(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real0, wall0 = time.monotonic(), time.time()
    monkeypatch.setattr(clock, "wall", lambda: wall0 + (time.monotonic() - real0) * SPEED)
    cluster.start_node("h1", "4x16GiB")
    addr = cluster.start_coordinator()
    for team in ("t1", "t2", "t3"):
        assert cli_main(["team", "set", team, "--members", f"{team}-*", "--coordinator", addr]) == 0
    wait_for(lambda: cluster.get_prefix(cluster.keys.accounting_cursor()), LIVENESS_S, "the accountant's cursor")
    clients = {team: Client(addr, agent=f"{team}-a", host="h1") for team in ("t1", "t2", "t3")}
    try:
        start = clock.wall()
        events = sorted([(s, "acquire", n) for n, (s, *_rest) in enumerate(SCRIPT)] +
                        [(e, "release", n) for n, (_s, e, *_rest) in enumerate(SCRIPT)], key=lambda x: (x[0], x[1]))
        held: dict[int, Any] = {}
        for minute, what, n in events:     # each at its minute of the compressed hour (a deadline, not a sleep)
            wait_for(lambda m=minute: clock.wall() >= start + 60 * m, LIVENESS_S, f"minute {minute}")
            _, _, team, mib, gpus = SCRIPT[n]
            if what == "acquire":
                held[n] = clients[team].acquire(mib, gpu_count=gpus, exclusive=mib == 0)
            else:
                held.pop(n).release()
    finally:
        for c in clients.values():
            c.close()
    wait_for(lambda: len(cluster.get_prefix(cluster.keys.usage_records())) >= len(SCRIPT), LIVENESS_S,
             "a record of every lease")
    rep = check_usage(cluster.lt.run(read_history(cluster.store, cluster.keys.root()), timeout=120), cluster.keys)
    rep.assert_ok()
    assert rep.records == rep.ended == len(SCRIPT)
    hours = sorted({hour_of(start + 60 * m) for s, e, *_ in SCRIPT for m in (s, e)})
    window = ["--since", hours[0], "--until", hour_of(start + 2 * 3600)]
    etcd = ["--etcd", ",".join(cluster.endpoints), "--prefix", cluster.prefix]
    capsys.readouterr()
    assert cli_main(["usage", "--by", "team", *window, "--json", *etcd]) == 0
    rows = {r["team"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    with capsys.disabled():
        print(f"\nhours {hours}; GPU-hours by team: { {t: r['gpu_hours'] for t, r in sorted(rows.items())} }; "
              f"the history's: { {t: round(s / 3600, 3) for t, s in sorted(rep.gpu_seconds.items())} }")
    assert set(rows) == {"t1", "t2", "t3"}
    for team, secs in rep.gpu_seconds.items():
        assert rows[team]["gpu_seconds"] == pytest.approx(secs, abs=0.01)
        assert rows[team]["gpu_hours"] == pytest.approx(secs / 3600, abs=0.001)
    assert cli_main(["usage", "--by", "team", *window, "--csv", *etcd]) == 0
    table = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert table[0][:2] == ["team", "GPU-hours [GPU*h]"] and all("[" in col for col in table[0][1:])
    assert {r[0]: float(r[1]) for r in table[1:]} == {t: r["gpu_hours"] for t, r in rows.items()}
