"""Files for deploying gpucoord that ship with the package: a Grafana dashboard of its metrics.

``DASHBOARD`` is the path of ``grafana-dashboard.json`` (import it in Grafana and choose the Prometheus
data source that scrapes the coordinators and node daemons). The compose file lives at the top of the
repository (``docker-compose.yml``).
"""
from __future__ import annotations

import pathlib

DASHBOARD = pathlib.Path(__file__).with_name("grafana-dashboard.json")
