"""Prometheus metrics of a coordinator replica (``REGISTRY``) and of a node daemon (``NODE_REGISTRY``), text
format over HTTP. Each process serves its own registry: a node exports its own families (and the few both
kinds count: refusals, etcd errors, failed handshakes), never the coordinator's as zeros."""
from __future__ import annotations

import re
import ssl
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from coordinator import errors, metrics_http
from coordinator.metrics_http import MetricsGate

if TYPE_CHECKING:
    from coordinator.security.tls import TlsFiles

MIB = 1 << 20   # gpucoord counts VRAM in MiB; its metrics say bytes, Prometheus's base unit

REGISTRY = CollectorRegistry()        # a coordinator replica's
NODE_REGISTRY = CollectorRegistry()   # a node daemon's

ADMISSIONS = Counter("gpucoord_admissions_total", "VRAM leases admitted", ["host"], registry=REGISTRY)
REFUSALS = Counter("gpucoord_refusals_total",
                   "RPCs answered with an error, by RPC, reason (the kind of error) and the request field at fault",
                   ["rpc", "reason", "field"], registry=REGISTRY)
RELEASE_REASONS = ("release", "close", "expiry", "eviction", "revoke", "reclaim")
RELEASES = Counter("gpucoord_releases_total", "VRAM leases that ended, by how (coordinator.replica.ends): release, "
                   "close, expiry, eviction, revoke, reclaim; each counted by the replica that ended it", ["reason"],
                   registry=REGISTRY)
for _reason in RELEASE_REASONS:
    RELEASES.labels(_reason)
EVICTIONS = Counter("gpucoord_evictions_total", "Eviction notices issued (notice), leases revoked (revoke), and "
                    "leases revoked at the kill margin while the node still reported their processes (margin)",
                    ["kind"], registry=REGISTRY)
VICTIM_PROCESS_WAITS = Histogram(
    "gpucoord_victim_process_wait_seconds",
    "Grants of evicting requests that waited on a victim's processes (past its deadline, or after its lease "
    "ended, while the node still reported them): seconds from the first round held back for them to the grant",
    buckets=(.01, .05, .1, .25, .5, 1, 2, 5, 10, 30), registry=REGISTRY)
CONFLICTS = Counter("gpucoord_txn_conflicts_total", "Admission compare-and-set transactions that lost", registry=REGISTRY)
FORWARDS = Counter("gpucoord_forwarded_acquires_total", "Acquires sent to the host's owning replica, and those "
                   "decided here because the owner could not answer", ["outcome"], registry=REGISTRY)
BATCH_SIZE = Histogram("gpucoord_group_commit_size", "Acquires decided from one snapshot",
                       buckets=(1, 2, 4, 8, 16, 32, 64), registry=REGISTRY)
ETCD_ERRORS = Counter("gpucoord_etcd_errors_total", "etcd calls that failed, by error", ["error"], registry=REGISTRY)
ETCD_NOSPACE = Counter("gpucoord_etcd_nospace_total", "etcd writes refused because etcd is out of space "
                       "(alarm NOSPACE): compact, defrag and disarm it", registry=REGISTRY)
ACQUIRE_LATENCY = Histogram("gpucoord_acquire_seconds", "Acquire RPC latency, wait included",
                            buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .5, 1, 5, 30), registry=REGISTRY)
SESSIONS = Gauge("gpucoord_keepalive_streams", "KeepAlive and KeepAliveSessions streams open on this replica",
                 registry=REGISTRY)
QUEUE_DEPTH = Gauge("gpucoord_queue_depth", "Waiting requests served by this replica", ["host"], registry=REGISTRY)
LEASES = Gauge("gpucoord_leases", "Live VRAM leases per host (a gang counts once), from the replica's watch", ["host"], registry=REGISTRY)
VRAM = Gauge("gpucoord_vram_bytes", "VRAM per GPU, leased and free, from the replica's watch", ["host", "gpu", "kind"],
             registry=REGISTRY)
TEAM_VRAM = Gauge("gpucoord_team_vram_bytes", "VRAM per team over the fleet (quota, limit, used, borrowed, waiting), "
                  "from the replica's watch", ["team", "kind"], registry=REGISTRY)
# Usage accounting (coordinator.replica.accountant): counted by the replica whose accountant wrote the record,
# once per ended lease; sum over the replicas for the fleet's totals.
TEAM_GPU_SECONDS = Counter("gpucoord_team_gpu_seconds", "GPU-seconds of the team's ended leases (usage records)",
                           ["team"], registry=REGISTRY)
TEAM_VRAM_MIB_SECONDS = Counter("gpucoord_team_vram_mib_seconds", "VRAM MiB-seconds of the team's ended leases "
                                "(usage records)", ["team"], registry=REGISTRY)
TEAM_EVICTIONS_SUFFERED = Counter("gpucoord_team_evictions_suffered", "The team's leases that ended by an "
                                  "eviction, reclaim or revoke notice (usage records)", ["team"], registry=REGISTRY)
TEAM_EVICTIONS_CAUSED = Counter("gpucoord_team_evictions_caused", "Leases of other agents (any team) that ended by "
                                "a notice the team's requests asked for: eviction by priority or reclaim (usage "
                                "records)", ["team"], registry=REGISTRY)
TEAM_IDLE_GPU_SECONDS = Counter("gpucoord_team_idle_gpu_seconds", "GPU-seconds of the team's ended leases during "
                                "which their GPUs stayed below the idle threshold (usage records' idle_gpu_seconds)",
                                ["team"], registry=REGISTRY)
USAGE_RECORDS = Counter("gpucoord_usage_records", "Usage records written, by how the lease ended: release, session, "
                        "eviction, reclaim, revoke", ["reason"], registry=REGISTRY)
USAGE_RESYNCS = Counter("gpucoord_usage_resyncs", "Times the accountant found etcd's history compacted past its "
                        "cursor (leases that ended in the gap have no record)", registry=REGISTRY)
INVALID_RECORDS = Counter("gpucoord_invalid_records_total", "Malformed values read from etcd, by key kind (each "
                          "value once): their host is INVALID and gets no admission", ["kind"], registry=REGISTRY)
NODE_WRITES = Counter("gpucoord_node_etcd_writes_total", "etcd writes by the node daemon", ["key"], registry=NODE_REGISTRY)
NODE_VRAM_USED = Gauge("gpucoord_node_vram_used_bytes", "NVML used VRAM per GPU", ["gpu"], registry=NODE_REGISTRY)
NODE_GPU_UTILIZATION = Gauge("gpucoord_node_gpu_utilization_percent", "NVML GPU utilization per GPU, -1 when unknown",
                             ["gpu"], registry=NODE_REGISTRY)
GPU_UTILIZATION = Gauge("gpucoord_gpu_utilization_percent", "GPU utilization from the node's last usage report, -1 "
                        "when unknown or stale", ["host", "gpu"], registry=REGISTRY)
IDLE_LEASES = Gauge("gpucoord_idle_leases", "Leases idle for their policy's window (docs/policies.md \"Idle GPUs\"), by team "
                    "and action (warn, evict), as this replica tracks them", ["team", "action"], registry=REGISTRY)
NODE_LEASE_VRAM_USED = Gauge("gpucoord_node_lease_vram_used_bytes", "VRAM used by the processes of each lease (NVML)",
                             ["gpu", "lease"], registry=NODE_REGISTRY)
NODE_LEASE_OVER_USE = Gauge("gpucoord_node_lease_over_use_bytes",
                            "VRAM a lease's processes use above the lease, when beyond the tolerance (else 0)",
                            ["gpu", "lease"], registry=NODE_REGISTRY)
NODE_GPU_PROCESSES = Gauge("gpucoord_node_gpu_processes",
                           "Processes on each GPU by attribution: leased, leased_elsewhere, orphaned, untracked",
                           ["gpu", "state"], registry=NODE_REGISTRY)
NODE_ENFORCE_KILLS = Counter("gpucoord_node_enforce_kills_total", "GPU processes the node SIGKILLed, by reason",
                             ["reason"], registry=NODE_REGISTRY)
METRICS_REFUSALS = Counter("gpucoord_metrics_refusals_total", "Scrapes of /metrics refused (403), by why: "
                           "certificate, identity, role, revocations (not read yet), revoked", ["why"],
                           registry=REGISTRY)
HANDSHAKE_FAILURES = Counter("gpucoord_tls_handshake_failures_total", "gRPC connections whose TLS handshake failed "
                             "(no certificate, another CA's, expired): logged at most once a minute, with the count",
                             registry=REGISTRY)

# Counted by both kinds of server.
for _shared in (REFUSALS, ETCD_ERRORS, ETCD_NOSPACE, METRICS_REFUSALS, HANDSHAKE_FAILURES):
    NODE_REGISTRY.register(_shared)

# Label values known in advance start at 0, so that a scrape (and a dashboard panel) says "none yet" instead of
# having no series at all until the first one: evictions, forwards, kills, refused scrapes and the etcd errors
# of an admission round (type names of coordinator.errors; another one still counts under its own name).
for _counter, _values in ((EVICTIONS, ("notice", "revoke", "margin")), (FORWARDS, ("forwarded", "fallback")),
                          (NODE_ENFORCE_KILLS, ("orphaned", "untracked")),
                          (METRICS_REFUSALS, ("certificate", "identity", "role", "revocations", "revoked")),
                          (ETCD_ERRORS, ("Unavailable", "Timeout", "OutcomeUnknown", "EtcdNoSpace"))):
    for _value in _values:
        _counter.labels(_value)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removesuffix("Error")).lower() or "error"


def count_refusal(rpc: str, error: BaseException) -> None:
    """Count one error answer of ``rpc``. The reason is the error's kind (``capacity``, ``wait_timeout``,
    ``invalid_argument``, ``session_gone``, ``not_owner``, ..., ``internal`` for a bug) and the field is the
    top-level request field it names (``vram_mb``, ``allocations``, ...), so the label sets stay small."""
    if isinstance(error, errors.GpucoordError):
        reason = _snake(type(error).__name__)
        field = re.split(r"[.\[]", error.field or "", maxsplit=1)[0]
    else:
        reason, field = "internal", ""
    REFUSALS.labels(rpc, reason, field).inc()


def serve(listen: str, tls: TlsFiles | None = None, registry: CollectorRegistry = REGISTRY,
          gate: MetricsGate | None = None) -> int:
    """Serve ``registry`` at /metrics on ``host:port`` (port 0 picks one); returns the port. With TLS, over
    HTTPS, only to clients with a certificate from the CA, and (``gate``) only to a live operator or metrics
    identity (``coordinator.metrics_http``)."""
    host, _, port = listen.rpartition(":")
    if tls is not None:
        tls.read()   # an unreadable file is named as such (TlsError), not reported as an address problem
    try:
        return metrics_http.start(host.strip("[]") or "127.0.0.1", int(port), registry,
                                  (tls.ca, tls.cert, tls.key) if tls is not None else None,
                                  gate if gate is not None else MetricsGate(),
                                  lambda why: METRICS_REFUSALS.labels(why).inc())
    except (OSError, ValueError, ssl.SSLError) as e:
        raise OSError(f"metrics_listen: cannot listen on {listen}: {getattr(e, 'strerror', None) or e}") from e
