"""A real Prometheus for tests (Debian's ``prometheus`` 2.42): ``tools`` finds it and promtool, ``Prometheus``
runs one on a free loopback port with its own config and data dir, scraping given targets every second, and
answers PromQL over its HTTP API (``query``, ``query_range``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from coordinator.etcd.process import free_port
from tests.support.processes import stop_process
from tests.support.waiting import wait_for

SCRAPE_S = 1


def tools() -> tuple[str, str] | None:
    """(prometheus, promtool): from ``$GPUCOORD_PROMETHEUS_DIR`` (where .ci/prometheus extracts Debian's
    package), else from PATH; None when either is missing."""
    found = []
    for name in ("prometheus", "promtool"):
        where = os.environ.get("GPUCOORD_PROMETHEUS_DIR", "")
        path = os.path.join(where, name) if where and os.access(os.path.join(where, name), os.X_OK) else None
        found.append(path or shutil.which(name))
    prometheus, promtool = found
    return (prometheus, promtool) if prometheus and promtool else None


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


class Prometheus:
    """``prometheus`` scraping ``targets`` (job name -> ``host:port``) every ``SCRAPE_S`` seconds."""

    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['{addr}']\n"
                       for job, addr in targets.items())
        config = workdir / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
                          f"scrape_configs:\n{jobs}")
        self.log_path = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"), stdin=subprocess.DEVNULL)
        wait_for(self._ready, 60, f"prometheus to be ready on {self.url} (its log: {self.log_path})", interval=0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
        try:
            http_get(f"{self.url}/-/ready", timeout=2)
            return True
        except OSError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        doc = json.loads(http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30))
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: its series."""
        return list(self.api("query", query=expr)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = SCRAPE_S) -> list[dict[str, Any]]:
        """A range query, as a Grafana panel makes one: its series, each with its ``values``."""
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def close(self) -> None:
        stop_process(self.proc)


def seen(prom: Prometheus, expr: str, what: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait until ``expr`` has a series in what Prometheus scraped (a deadline, never a sleep)."""
    return wait_for(lambda: prom.query(expr), timeout, f"prometheus to have scraped {what} ({expr})", interval=0.25)
