"""Every metric is documented with its type and labels (the table after ``<!-- test: metrics -->``, in
docs/operations.md, "Metrics"), and the Grafana dashboard that ships with the package queries only metrics
(and labels) that exist, and shows every one of them."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from coordinator import metrics
from coordinator.deploy import DASHBOARD
from tests.support import REPO
from tests.support.docs import all_text, doc_with

PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "rate", "increase", "histogram_quantile", "le", "without"}


def registered() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Metric name as documented (counters with _total) -> (type, label names)."""
    out = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            name = value._name + ("_total" if value._type == "counter" else "")
            out[name] = (value._type, tuple(value._labelnames))
    return out


def exposed(name: str, kind: str) -> set[str]:
    """The series names Prometheus sees for a documented metric."""
    return {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}


def test_the_docs_list_every_metric_with_its_type_and_labels() -> None:
    name, text = doc_with("<!-- test: metrics -->")
    assert name == "docs/operations.md", name
    table = text.split("<!-- test: metrics -->", 1)[1].strip().split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:   # after the header and its rule
        cells = [c.strip() for c in line.strip("|").split("|")]
        labels = tuple(re.findall(r"`(\w+)`", cells[2]))
        rows[cells[0].strip("`")] = (cells[1], labels)
    assert rows == registered()


def test_the_dashboard_queries_only_metrics_and_labels_that_exist_and_shows_them_all() -> None:
    doc = json.loads(DASHBOARD.read_text())
    series = {s: (name, labels) for name, (kind, labels) in registered().items() for s in exposed(name, kind)}
    shown = set()
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        used = set(re.findall(r"\bgpucoord_\w+", expr))
        assert used, expr
        for s in used:
            assert s in series, f"the dashboard queries {s}, which gpucoord does not export: {expr}"
            shown.add(series[s][0])
        labels = {x for (_, ls) in (series[s] for s in used) for x in ls} | {"le", "instance", "job"}
        grouped = {x.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for x in group.split(",")}
        matched = set(re.findall(r"(\w+)=~?\"", expr))
        assert grouped | matched <= labels, f"unknown labels {(grouped | matched) - labels} in {expr}"
    assert shown == set(registered()), f"metrics missing from the dashboard: {set(registered()) - shown}"


def test_the_dashboard_ships_as_package_data() -> None:
    pyproject = (Path(REPO) / "pyproject.toml").read_text()
    assert '"deploy/*.json"' in pyproject and DASHBOARD.is_file()
    assert DASHBOARD.relative_to(Path(REPO)).as_posix() in all_text()
