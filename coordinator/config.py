"""Configuration: one frozen, validated object per process.

Sources, later ones winning: defaults, then a TOML file (``--config``), then ``GPUCOORD_*`` environment
variables, then command-line flags. Rules that tie values together are checked at start, and a bad value
fails with the field's name in the message.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import TYPE_CHECKING, Any, Mapping

from coordinator.keys import DEFAULT_PREFIX
from coordinator.limits import (
    MAX_KILL_MARGIN_S,
    MAX_TIME_LIMIT_S,
    MAX_TTL_S,
    MAX_TXN_OPS,
    MIN_TTL_S,
    MIN_TXN_OPS,
    quote,
)

# Config sits above security (and security imports nothing of config). Its imports of security are made
# where they are used: they load grpc and aetcd, which the pure policy (importing config) must not load.
if TYPE_CHECKING:
    from coordinator.security.etcd_auth import EtcdSecurity
    from coordinator.security.tls import TlsFiles


class ConfigError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    etcd: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = DEFAULT_PREFIX
    listen: str = "127.0.0.1:7070"
    # The address clients and the other replicas reach this replica at, published in coordinators/<id> (a
    # port mapping or a relay in front of it); empty: the listen host with the port bound.
    advertise: str = ""
    metrics_listen: str = ""             # "host:port" to serve Prometheus metrics; empty: off
    session_ttl_s: int = 10              # default TTL of an agent's session
    # The TTL of the etcd lease under each session's keys: sessions are kept alive in the replicas' memory, and
    # this etcd lease is refreshed once a third of it has passed (docs/guarantees.md, G4). With no replica
    # running at all, a dead agent's keys go when it passes.
    session_etcd_ttl_s: int = 600
    keepalive_interval_s: float = 0.0    # what clients are told to use; x3 must be <= the TTL (0: min(3, TTL/3))
    etcd_timeout_s: float = 0.0          # deadline of one etcd call; must be < TTL / 2 (0: min(3, TTL/3))
    election_ttl_s: int = 5
    eviction_grace_s: float = 10.0
    # A lease under an eviction notice is revoked by force this long after its deadline, and the VRAM of
    # a process-bound lease counts as held until then unless its processes are gone first (docs/guarantees.md, G3).
    eviction_kill_margin_s: float = 2.0
    # etcd's --max-txn-ops (its default 128): the largest multi-host gang is one transaction of a record and a
    # ledger per GPU, so a site that runs larger gangs raises both (docs/etcd.md; ``gpucoord up`` sets 1024).
    etcd_max_txn_ops: int = 128
    # Time limits (docs/policies.md "Time limits"): the warning notice goes this long before a lease's end (capped at its
    # limit; a request may ask another), a request with no limit gets the default (0: none), and no limit may
    # be above the maximum (0: only MAX_TIME_LIMIT_S).
    time_limit_warning_s: float = 120.0
    default_time_limit_s: float = 0.0
    max_time_limit_s: float = 0.0
    # Idle GPUs (docs/policies.md "Idle GPUs"): a lease whose GPUs all stay below idle_below_pct percent utilization for
    # idle_after_s (0: off) is idle; idle_action warn shows it, evict sends it a notice (reason idle).
    idle_after_s: float = 0.0
    idle_below_pct: float = 5.0
    idle_action: str = "warn"
    # Usage accounting (docs/teams.md, "Usage accounting"): raw records are kept this long after their lease ended,
    # hourly rollups this many days.
    usage_retention_s: float = 7 * 86400.0
    usage_rollup_days: int = 400
    # Decayed usage (docs/teams.md "Decayed usage"): the half-life of a team's GPU-seconds (0: no memory).
    usage_half_life_s: float = 7 * 86400.0
    # Fair share (docs/teams.md "Fair share"): how often each replica computes the teams' fair-share factors.
    fair_share_every_s: float = 60.0
    usage_export_dir: str = ""           # the leader appends every record to JSON-lines files here (empty: off)
    max_queue_per_host: int = 1024      # waiting requests per host (a higher-priority arrival displaces)
    max_queue_per_agent: int = 64       # waiting requests per agent per host
    max_leases_per_agent: int = 256
    untracked_vram: bool = True          # subtract NVML-used VRAM that no lease accounts for
    batch_max: int = 64                  # most acquires decided from one snapshot (group commit)
    commit_attempts: int = 32            # compare-and-set retries before UNAVAILABLE
    # Transactions of different hosts committed together as one etcd transaction, each nested with its own
    # compares (docs/etcd.md "Shared commits"); 1 commits each alone.
    shared_commit_max: int = 64
    max_sessions_per_agent: int = 64     # open sessions of one agent name (OpenSession past it: RESOURCE_EXHAUSTED)
    # A stream's answers its client has not read yet (KeepAlive, Session): past either bound the stream is
    # closed with RESOURCE_EXHAUSTED naming ``stream``.
    stream_answers_max: int = 1024
    stream_answer_bytes_max: int = 1 << 20
    # Per verified identity (TLS only; docs/security.md "Fair service"): a token bucket of calls (each stream message
    # counts as a call; 0 turns it off) and a cap on open KeepAlive and Session streams.
    calls_per_s_per_identity: float = 100.0
    call_burst_per_identity: int = 200
    max_streams_per_identity: int = 128
    # Identity (docs/security.md "Running securely"): mTLS for clients, TLS and auth towards etcd.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False               # serve a non-loopback address without TLS anyway
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password: str = dataclasses.field(default="", repr=False)
    etcd_password_file: str = ""

    def validate(self) -> CoordinatorConfig:
        """The checked config, with the values left at 0 derived from the session TTL (so a short TTL works
        without setting them)."""
        if not MIN_TTL_S <= self.session_ttl_s <= MAX_TTL_S:
            raise ConfigError("session_ttl_s", f"must be within [{MIN_TTL_S}, {MAX_TTL_S}], got {quote(self.session_ttl_s)}")
        derived: dict[str, Any] = {name: min(3.0, self.session_ttl_s / 3)
                                   for name in ("keepalive_interval_s", "etcd_timeout_s") if getattr(self, name) == 0}
        if derived:
            return dataclasses.replace(self, **derived).validate()
        if not self.etcd:
            raise ConfigError("etcd", "at least one endpoint is needed")
        for ep in self.etcd:
            host, _, port = ep.removeprefix("http://").rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("etcd", f"endpoint {ep!r} is not host:port")
        if self.advertise:
            host, _, port = self.advertise.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError("advertise", f"must be host:port, got {self.advertise!r}")
        if not (self.prefix.startswith("/") and self.prefix.endswith("/")):
            raise ConfigError("prefix", f"must start and end with '/', got {self.prefix!r}")
        for name in ("keepalive_interval_s", "etcd_timeout_s", "eviction_grace_s", "eviction_kill_margin_s"):
            value = getattr(self, name)
            if value != value or value in (float("inf"), float("-inf")):
                raise ConfigError(name, f"must be a finite number, got {value}")
        if self.keepalive_interval_s <= 0:
            raise ConfigError("keepalive_interval_s", f"must be > 0, got {self.keepalive_interval_s}")
        if self.keepalive_interval_s * 3 > self.session_ttl_s:
            raise ConfigError("keepalive_interval_s", "keepalive interval x 3 must be <= session_ttl_s")
        if self.etcd_timeout_s <= 0:
            raise ConfigError("etcd_timeout_s", f"must be > 0, got {self.etcd_timeout_s}")
        if self.etcd_timeout_s >= self.session_ttl_s / 2:
            raise ConfigError("etcd_timeout_s", "must be < session_ttl_s / 2")
        if self.election_ttl_s < MIN_TTL_S:
            raise ConfigError("election_ttl_s", f"must be >= {MIN_TTL_S}")
        if not 30 <= self.session_etcd_ttl_s <= 86400:
            raise ConfigError("session_etcd_ttl_s", f"must be within [30, 86400], got {quote(self.session_etcd_ttl_s)}")
        if not MIN_TXN_OPS <= self.etcd_max_txn_ops <= MAX_TXN_OPS:
            raise ConfigError("etcd_max_txn_ops", f"must be within [{MIN_TXN_OPS}, {MAX_TXN_OPS}] (etcd's "
                                                  f"--max-txn-ops), got {quote(self.etcd_max_txn_ops)}")
        if self.eviction_grace_s < 0:
            raise ConfigError("eviction_grace_s", "must be >= 0")
        if not 0 <= self.eviction_kill_margin_s <= MAX_KILL_MARGIN_S:
            raise ConfigError("eviction_kill_margin_s", f"must be within [0, {MAX_KILL_MARGIN_S:g}] seconds, got "
                                                        f"{self.eviction_kill_margin_s}")
        for name in ("time_limit_warning_s", "default_time_limit_s", "max_time_limit_s"):
            if not 0 <= getattr(self, name) <= MAX_TIME_LIMIT_S:
                raise ConfigError(name, f"must be within [0, {MAX_TIME_LIMIT_S:g}] seconds, got {getattr(self, name)}")
        if self.max_time_limit_s and self.default_time_limit_s > self.max_time_limit_s:
            raise ConfigError("default_time_limit_s", "must be <= max_time_limit_s")
        if not 0 <= self.idle_after_s <= 30 * 86400:
            raise ConfigError("idle_after_s", f"must be within [0, 30 days] seconds (0: off), got {self.idle_after_s}")
        if not 0 <= self.idle_below_pct <= 100:
            raise ConfigError("idle_below_pct", f"must be within [0, 100], got {self.idle_below_pct}")
        if self.idle_action not in ("warn", "evict"):
            raise ConfigError("idle_action", f"must be warn or evict, got {str(self.idle_action)[:32]!r}")
        if not 0 < self.usage_retention_s < float("inf"):
            raise ConfigError("usage_retention_s", f"must be a finite number of seconds > 0, got {self.usage_retention_s}")
        if not 0 <= self.usage_half_life_s < float("inf"):
            raise ConfigError("usage_half_life_s", f"must be a finite number of seconds >= 0, got {self.usage_half_life_s}")
        if not 0 < self.fair_share_every_s <= 86400:
            raise ConfigError("fair_share_every_s", f"must be within (0, 86400] seconds, got {self.fair_share_every_s}")
        if self.usage_rollup_days < 1:
            raise ConfigError("usage_rollup_days", f"must be >= 1, got {self.usage_rollup_days}")
        _validate_security(self)
        if not 0 <= self.calls_per_s_per_identity < float("inf"):
            raise ConfigError("calls_per_s_per_identity",
                              f"must be a finite number >= 0 (0: no limit), got {self.calls_per_s_per_identity}")
        for name in ("max_queue_per_host", "max_queue_per_agent", "max_leases_per_agent", "batch_max",
                     "commit_attempts", "shared_commit_max", "max_sessions_per_agent", "stream_answers_max", "stream_answer_bytes_max",
                     "call_burst_per_identity", "max_streams_per_identity"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        return self

    def tls_files(self) -> TlsFiles | None:
        from coordinator.security.tls import TlsFiles
        return TlsFiles(self.tls_ca, self.tls_cert, self.tls_key) if self.tls_ca else None

    def etcd_security(self) -> EtcdSecurity:
        from coordinator.security.etcd_auth import resolve
        return resolve(self.etcd_ca, self.etcd_cert, self.etcd_key, self.etcd_user, self.etcd_password,
                       self.etcd_password_file, env={})

    @classmethod
    def load(cls, file: str | None = None, env: Mapping[str, str] | None = None,
             flags: Mapping[str, Any] | None = None) -> CoordinatorConfig:
        values: dict[str, Any] = {}
        if file:
            with open(file, "rb") as f:
                doc = tomllib.load(f)
            values.update(doc.get("coordinator", {}))
            values.update({f"tls_{k}": v for k, v in doc.get("tls", {}).items()})
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in fields:
            v = env.get(f"GPUCOORD_{name.upper()}")
            if v is not None:
                values[name] = v
        values.update({k: v for k, v in (flags or {}).items() if v is not None})
        unknown = set(values) - set(fields)
        if unknown:
            raise ConfigError(sorted(unknown)[0], "unknown setting")
        return cls(**{k: _coerce(k, fields[k].type, v) for k, v in values.items()}).validate()


def _validate_security(c: CoordinatorConfig) -> None:
    from coordinator.security.etcd_auth import EtcdSecurityError
    from coordinator.security.tls import is_loopback
    tls = [n for n in ("tls_ca", "tls_cert", "tls_key") if getattr(c, n)]
    if tls and len(tls) < 3:
        missing = next(n for n in ("tls_ca", "tls_cert", "tls_key") if not getattr(c, n))
        raise ConfigError(missing, "TLS needs all of tls_ca, tls_cert and tls_key (--tls-ca, --tls-cert, --tls-key)")
    for name in ("listen", "metrics_listen"):
        address = getattr(c, name)
        if address and not tls and not c.insecure and not is_loopback(address):
            raise ConfigError(name, f"{address} is not a loopback address and no TLS is configured; give "
                                    "--tls-ca/--tls-cert/--tls-key, or pass --insecure to serve it in plaintext")
    try:
        c.etcd_security()
    except EtcdSecurityError as e:
        raise ConfigError("etcd", str(e)) from None


def _coerce(name: str, typ: Any, v: Any) -> Any:
    t = str(typ)
    try:
        if t.startswith("tuple"):
            if isinstance(v, str):
                return tuple(x.strip() for x in v.split(",") if x.strip())
            return tuple(v)
        if t == "bool":
            if isinstance(v, str):
                if v.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(v)
                return v.lower() in ("1", "true", "yes", "on")
            return bool(v)
        if t == "int":
            return int(v)
        if t == "float":
            return float(v)
        return str(v)
    except (TypeError, ValueError):
        raise ConfigError(name, f"cannot read {v!r} as {t}") from None
