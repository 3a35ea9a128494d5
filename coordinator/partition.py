"""Partitions: what each agent on a host may use. Pure logic; the only I/O is ``load_spec_file``.

A **partition spec** (a TOML file for ``gpucoord partition apply``, or the same structure as JSON
through the API) names a host, a mode, the agents and a ``reserved`` table; ``compute_partition``
checks it against the host's inventory and turns it into one concrete ``AgentAllocation`` per
agent: core ids, memory and disk bytes, whole GPUs and a VRAM cap (MiB) on every GPU the agent may
lease on.

``reserved`` is taken off the top before anything is split:

- ``cpu``: a number of cores. The reserved cores are the *first* ``reserved.cpu`` core ids of the
  host, in ascending order (``cpu = 1`` keeps core 0 for the system). Reserving every core is
  rejected: an empty cpuset cannot run anything.
- ``mem``, ``disk``: sizes in bytes (``"16GiB"``, ``"512MB"``, or a plain number of bytes).
- ``vram_headroom``: a size kept free on *every* GPU; stored in MiB (rounded down).
  ``usable = max(0, vram_total - headroom)``.

A ``reserved`` value larger than what the host has is rejected (``reserved.<kind>``); the headroom is
compared with the smallest GPU.

Modes
-----

``shared``
    Every agent sees the whole host minus ``reserved``: every non-reserved core, all the remaining
    memory and disk, and every GPU with a cap of ``usable``. The agents compete for the same GPU
    capacity. ``agents`` is optional and informative only: any agent is allowed. A host with no spec
    at all gets this mode with no reservation (``default_partition``).

``auto-split``
    Cores, memory and disk are divided with ``divmod``; the remainder goes to the first agents in
    list order. Cores are handed out as disjoint sets of consecutive available core ids. If there
    are at least as many GPUs as agents, whole GPUs are dealt out in index order by ``divmod``
    (5 GPUs over 3 agents: [0, 1], [2, 3], [4]); otherwise every GPU is shared and each agent's cap
    on each GPU is ``floor(usable / N)``. Fewer available cores than agents is rejected (field
    ``agents``) rather than handing out empty core sets.

``manual``
    ``[allocations.<agent>]`` gives each agent's share explicitly: ``cpu`` (a count) or ``cores``
    (explicit ids), ``mem``, ``disk``, ``gpus`` (whole devices, by index or uuid) and ``vram``
    (``{gpu = size}``: a cap on a shared device). Every agent needs an allocation, and every agent
    must name the same resource kinds (cpu and cores count as one kind, ``cpu``; the kinds are
    cpu, mem, disk, gpus, vram). Checked against the host:

    - the sum of a kind over all agents must not exceed ``total - reserved`` (Backend.AI wrongly
      allowed up to ``total + (N-1) * reserved``);
    - explicit core ids must exist, must not be reserved and must not overlap between agents;
      ``cpu`` counts are then turned into concrete core ids, in agent order, from the available
      cores not named explicitly;
    - a GPU is given whole to at most one agent, and a GPU given whole cannot also be capped;
    - a VRAM cap must not exceed ``usable``; GPUs must exist (index or uuid).

    **A kind that no agent names is not partitioned**: every agent gets the whole available amount
    of it (all non-reserved cores, all of ``mem - reserved.mem``, ...). For GPUs, ``gpus`` decides
    the whole devices and ``vram`` the shared ones: when ``vram`` is not named, every GPU that is not
    given whole to some agent is shared by all agents with a cap of ``usable``; when it is named, an
    agent may lease on its whole GPUs and on the GPUs of its ``vram`` table only.

VRAM caps are ceilings, not reservations: caps of different agents on one shared GPU may add up to
more than ``usable`` (as they do in shared mode); admission keeps the sum of the live leases within
``usable`` (G1). CPU, memory and disk shares are recorded and reported; agents or their runtimes
enforce them (cgroups, cpusets). GPU device sets and VRAM caps are enforced by admission.

Input limits: at most ``MAX_AGENTS`` agents, lists of at most ``MAX_ITEMS`` entries, integers up to
``2**63 - 1`` (protobuf int64), size strings up to 64 characters. A plain ``vram`` cap below 1 MiB
is rejected: a plain number is bytes, so ``vram = { 2 = 20480 }`` is almost certainly a unit mistake.

Every rejection is a ``PartitionError`` whose ``field`` names the offending entry, e.g. ``host``,
``reserved.cpu``, ``agents[2]``, ``allocations.agent-a.cpu``, ``allocations.agent-b.gpus[0]``,
``allocations.agent-b.vram.2``.
"""
from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from coordinator.keys import valid_name
from coordinator.models import GpuInfo, HostInventory

__all__ = [
    "KINDS",
    "MAX_AGENTS",
    "MAX_ITEMS",
    "MODES",
    "AgentAllocation",
    "AllocationSpec",
    "Partition",
    "PartitionError",
    "PartitionSpec",
    "Reserved",
    "compute_partition",
    "default_partition",
    "load_spec_file",
    "parse_size",
    "parse_spec",
]

MODES: tuple[str, ...] = ("shared", "auto-split", "manual")
KINDS: tuple[str, ...] = ("cpu", "mem", "disk", "gpus", "vram")
MAX_AGENTS = 256
MAX_ITEMS = 4096
MAX_INT = 2**63 - 1
MAX_SIZE_STR = 64
MIB = 1 << 20

_SPEC_KEYS = ("host", "mode", "agents", "reserved", "allocations")
_RESERVED_KEYS = ("cpu", "mem", "disk", "vram_headroom")
_ALLOC_KEYS = ("cpu", "cores", "mem", "disk", "gpus", "vram")


class PartitionError(ValueError):
    """A spec that cannot be applied. ``field`` names the entry, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field or "spec"
        self.message = message or "invalid"
        super().__init__(f"{self.field}: {self.message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.message))


# -- sizes ----------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+) *([A-Za-z]*)")
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10, "ki": 1 << 10,
    "mib": 1 << 20, "mi": 1 << 20,
    "gib": 1 << 30, "gi": 1 << 30,
    "tib": 1 << 40, "ti": 1 << 40,
    "pib": 1 << 50, "pi": 1 << 50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
_AMBIGUOUS_UNITS = {"k": ("KiB", "KB"), "m": ("MiB", "MB"), "g": ("GiB", "GB"), "t": ("TiB", "TB"),
                    "p": ("PiB", "PB")}


def parse_size(value: object, field: str) -> int:
    """A size in bytes.

    Accepts a plain non-negative number of bytes (an int, a float rounded down, or a numeric string)
    or a number with a unit, case-insensitive, with an optional space: IEC ``KiB MiB GiB TiB PiB``
    (also ``Ki``..``Pi``) and SI ``KB MB GB TB PB``. Decimals round down: ``"1.5GiB"`` is
    1610612736. Bare ``K/M/G/T`` are rejected as ambiguous. Anything else, a negative value or more
    than ``2**63 - 1`` raises ``PartitionError(field, ...)``.
    """
    if isinstance(value, bool):
        raise PartitionError(field, f"expected a size such as '16GiB' or a number of bytes, got {_show(value)}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise PartitionError(field, f"expected a finite size, got {_show(value)}")
        if value < 0:
            raise PartitionError(field, f"must not be negative, got {_show(value)}")
        if value >= 2.0**63:
            raise PartitionError(field, f"too large: {_show(value)} (at most {MAX_INT} bytes)")
        n = math.floor(value)
    elif isinstance(value, str):
        n = _parse_size_str(value, field)
    else:
        raise PartitionError(
            field, f"expected a size such as '16GiB' or a number of bytes, got {type(value).__name__}")
    if n < 0:
        raise PartitionError(field, f"must not be negative, got {_show(value)}")
    if n > MAX_INT:
        raise PartitionError(field, f"too large: {_show(value)} (at most {MAX_INT} bytes)")
    return n


def _parse_size_str(value: str, field: str) -> int:
    if len(value) > MAX_SIZE_STR:
        raise PartitionError(field, f"size string too long ({len(value)} characters)")
    s = value.strip()
    if s.startswith("-"):
        raise PartitionError(field, f"must not be negative, got {_show(value)}")
    m = _SIZE_RE.fullmatch(s)
    if m is None:
        raise PartitionError(field, f"expected a size such as '16GiB', '512MB' or '1048576', got {_show(value)}")
    number, unit = m.group(1), m.group(2).lower()
    if unit in _AMBIGUOUS_UNITS:
        iec, si = _AMBIGUOUS_UNITS[unit]
        raise PartitionError(field, f"ambiguous unit in {_show(value)}: write {iec} (binary) or {si} (decimal)")
    if unit not in _UNITS:
        raise PartitionError(field, f"unknown unit {_show(m.group(2))} in {_show(value)} (use KiB, MiB, GiB, TiB, "
                                    "KB, MB, GB, TB or plain bytes)")
    if number.startswith("."):
        number = "0" + number
    if number.endswith("."):
        number = number[:-1]
    return math.floor(Fraction(number) * _UNITS[unit])


def _show(v: object) -> str:
    """A user-supplied value for a message: repr, cut short (and safe for huge integers)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length()} bits>"
    r = repr(v)
    return r if len(r) <= 64 else r[:60] + "..."


def _key(k: object) -> str:
    """A key of the input as part of a field name, cut short."""
    s = _show(k) if not isinstance(k, str) else k
    return s if len(s) <= 64 else s[:60] + "..."


def _human(n: int) -> str:
    """Bytes for a message: '17179869184 bytes (16GiB)'."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            q = n / mult
            return f"{n} bytes ({q:.4g}{unit})"
    return f"{n} bytes"


# -- the spec -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reserved:
    """Taken off the top before splitting. ``cpu`` in cores, ``mem``/``disk`` in bytes, headroom in MiB per GPU."""

    cpu: int = 0
    mem: int = 0
    disk: int = 0
    vram_headroom_mb: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "mem": self.mem, "disk": self.disk,
                "vram_headroom": f"{self.vram_headroom_mb}MiB"}


GpuRef = int | str


@dataclasses.dataclass(frozen=True)
class AllocationSpec:
    """One ``[allocations.<agent>]`` table, as written (manual mode). ``None`` means not named."""

    cpu: int | None = None
    cores: tuple[int, ...] | None = None
    mem: int | None = None  # bytes
    disk: int | None = None  # bytes
    gpus: tuple[GpuRef, ...] | None = None  # whole devices, by index or uuid
    vram: tuple[tuple[GpuRef, int], ...] | None = None  # (gpu ref, cap in MiB) on shared devices

    def kinds(self) -> frozenset[str]:
        """The resource kinds this allocation names (``cpu`` and ``cores`` are both ``cpu``)."""
        named = {
            "cpu": self.cpu is not None or self.cores is not None,
            "mem": self.mem is not None,
            "disk": self.disk is not None,
            "gpus": self.gpus is not None,
            "vram": self.vram is not None,
        }
        return frozenset(k for k, v in named.items() if v)

    def cpu_count(self) -> int | None:
        if self.cpu is not None:
            return self.cpu
        if self.cores is not None:
            return len(self.cores)
        return None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.cpu is not None:
            d["cpu"] = self.cpu
        if self.cores is not None:
            d["cores"] = list(self.cores)
        if self.mem is not None:
            d["mem"] = self.mem
        if self.disk is not None:
            d["disk"] = self.disk
        if self.gpus is not None:
            d["gpus"] = list(self.gpus)
        if self.vram is not None:
            d["vram"] = {str(ref): f"{mb}MiB" for ref, mb in self.vram}
        return d


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """A parsed, structurally valid spec. ``allocations`` follow the order of ``agents``."""

    host: str
    mode: str  # "shared" | "auto-split" | "manual"
    agents: tuple[str, ...]
    reserved: Reserved
    allocations: tuple[tuple[str, AllocationSpec], ...]

    def to_json(self) -> dict[str, Any]:
        """JSON-able; ``parse_spec(spec.to_json()) == spec``."""
        return {
            "host": self.host,
            "mode": self.mode,
            "agents": list(self.agents),
            "reserved": self.reserved.to_json(),
            "allocations": {agent: a.to_json() for agent, a in self.allocations},
        }


def _fld(*parts: object) -> str:
    return ".".join(str(p) for p in parts)


def _type_name(v: object) -> str:
    return type(v).__name__


def _parse_int(v: object, field: str, *, minimum: int = 0, what: str = "an integer") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        got = _show(v) if isinstance(v, (bool, float, str)) else _type_name(v)
        raise PartitionError(field, f"expected {what}, got {got}")
    if v < 0 and minimum >= 0:
        raise PartitionError(field, f"must not be negative, got {_show(v)}")
    if v < minimum:
        raise PartitionError(field, f"must be at least {minimum}, got {_show(v)}")
    if v > MAX_INT:
        raise PartitionError(field, f"too large: {_show(v)} (at most {MAX_INT})")
    return v


def _parse_list(v: object, field: str, what: str) -> Sequence[Any]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise PartitionError(field, f"expected a list of {what}, got {_type_name(v)}")
    if len(v) > MAX_ITEMS:
        raise PartitionError(field, f"too many entries ({len(v)}, at most {MAX_ITEMS})")
    return v


def _parse_table(v: object, field: str) -> Mapping[Any, Any]:
    if not isinstance(v, Mapping):
        raise PartitionError(field, f"expected a table, got {_type_name(v)}")
    return v


def _check_keys(table: Mapping[Any, Any], allowed: Sequence[str], prefix: str | None) -> None:
    for k in table:
        if k not in allowed:
            name = _key(k)
            raise PartitionError(_fld(prefix, name) if prefix else name,
                                 f"unknown key (expected one of: {', '.join(allowed)})")


def _parse_gpu_ref(v: object, field: str) -> GpuRef:
    """An index (int, or an all-digit string) or a uuid (any other non-empty string)."""
    if isinstance(v, bool):
        raise PartitionError(field, f"expected a GPU index or uuid, got {_show(v)}")
    if isinstance(v, int):
        return _parse_int(v, field, what="a GPU index")
    if isinstance(v, str):
        s = v.strip()
        if not s:
            raise PartitionError(field, "expected a GPU index or uuid, got an empty string")
        if len(s) > 256:
            raise PartitionError(field, "GPU uuid too long")
        if s.isascii() and s.isdigit():
            return _parse_int(int(s), field, what="a GPU index")
        return s
    raise PartitionError(field, f"expected a GPU index or uuid, got {_type_name(v)}")


def _ref_sort_key(ref: GpuRef) -> tuple[int, int, str]:
    return (0, ref, "") if isinstance(ref, int) else (1, 0, ref)


def _parse_reserved(v: object) -> Reserved:
    table = _parse_table(v, "reserved")
    _check_keys(table, _RESERVED_KEYS, "reserved")
    cpu = _parse_int(table.get("cpu", 0), "reserved.cpu", what="a number of cores")
    mem = parse_size(table.get("mem", 0), "reserved.mem")
    disk = parse_size(table.get("disk", 0), "reserved.disk")
    headroom = parse_size(table.get("vram_headroom", 0), "reserved.vram_headroom") // MIB
    return Reserved(cpu=cpu, mem=mem, disk=disk, vram_headroom_mb=headroom)


def _parse_allocation(v: object, agent: str) -> AllocationSpec:
    base = _fld("allocations", agent)
    table = _parse_table(v, base)
    _check_keys(table, _ALLOC_KEYS, base)

    cpu: int | None = None
    cores: tuple[int, ...] | None = None
    if "cpu" in table and "cores" in table:
        raise PartitionError(_fld(base, "cores"), "give either cpu (a number of cores) or cores (core ids), not both")
    if "cpu" in table:
        cpu = _parse_int(table["cpu"], _fld(base, "cpu"), what="a number of cores")
        if cpu == 0:
            raise PartitionError(_fld(base, "cpu"), "must be at least 1 core (an empty cpuset cannot run anything)")
    if "cores" in table:
        raw = _parse_list(table["cores"], _fld(base, "cores"), "core ids")
        if not raw:
            raise PartitionError(_fld(base, "cores"), "must name at least one core id")
        seen: set[int] = set()
        ids: list[int] = []
        for i, c in enumerate(raw):
            f = f"{base}.cores[{i}]"
            cid = _parse_int(c, f, what="a core id")
            if cid in seen:
                raise PartitionError(f, f"core {cid} is listed twice")
            seen.add(cid)
            ids.append(cid)
        cores = tuple(ids)

    mem = parse_size(table["mem"], _fld(base, "mem")) if "mem" in table else None
    disk = parse_size(table["disk"], _fld(base, "disk")) if "disk" in table else None

    gpus: tuple[GpuRef, ...] | None = None
    if "gpus" in table:
        raw = _parse_list(table["gpus"], _fld(base, "gpus"), "GPU indexes or uuids")
        refs: list[GpuRef] = []
        for i, g in enumerate(raw):
            f = f"{base}.gpus[{i}]"
            ref = _parse_gpu_ref(g, f)
            if ref in refs:
                raise PartitionError(f, f"GPU {_show(ref)} is listed twice")
            refs.append(ref)
        gpus = tuple(refs)

    vram: tuple[tuple[GpuRef, int], ...] | None = None
    if "vram" in table:
        vt = _parse_table(table["vram"], _fld(base, "vram"))
        if len(vt) > MAX_ITEMS:
            raise PartitionError(_fld(base, "vram"), f"too many entries ({len(vt)}, at most {MAX_ITEMS})")
        caps: dict[GpuRef, int] = {}
        for key, size in vt.items():
            f = _fld(base, "vram", _key(key))
            ref = _parse_gpu_ref(key, f)
            if ref in caps:
                raise PartitionError(f, f"GPU {_show(ref)} is listed twice")
            mb = parse_size(size, f) // MIB
            if mb < 1:
                raise PartitionError(f, f"a VRAM cap must be at least 1MiB, got {_show(size)} "
                                        "(a plain number is bytes: write e.g. '20GiB')")
            caps[ref] = mb
        vram = tuple(sorted(caps.items(), key=lambda kv: _ref_sort_key(kv[0])))

    return AllocationSpec(cpu=cpu, cores=cores, mem=mem, disk=disk, gpus=gpus, vram=vram)


def parse_spec(data: Mapping[str, Any]) -> PartitionSpec:
    """A ``PartitionSpec`` from a TOML-loaded dict or the same structure as JSON.

    Structural validation only (types, unknown keys, negative values, names, duplicate agents, mode,
    allocations vs mode, allocation kinds); ``compute_partition`` checks the spec against a host.
    ``mode`` defaults to ``shared``, ``agents`` to none, ``reserved`` to nothing.
    """
    table = _parse_table(data, "spec")
    _check_keys(table, _SPEC_KEYS, None)

    if "host" not in table:
        raise PartitionError("host", "missing: the spec must name its host")
    host = table["host"]
    if not isinstance(host, str) or not valid_name(host):
        raise PartitionError("host", f"not a valid host name: {_show(host)}")

    mode = table.get("mode", "shared")
    if not isinstance(mode, str) or mode not in MODES:
        raise PartitionError("mode", f"must be one of {', '.join(MODES)}; got {_show(mode)}")

    raw_agents = _parse_list(table.get("agents", []), "agents", "agent names")
    if len(raw_agents) > MAX_AGENTS:
        raise PartitionError("agents", f"too many agents ({len(raw_agents)}, at most {MAX_AGENTS})")
    agents: list[str] = []
    for i, a in enumerate(raw_agents):
        f = f"agents[{i}]"
        if not isinstance(a, str) or not valid_name(a):
            raise PartitionError(f, f"not a valid agent name: {_show(a)}")
        if a in agents:
            raise PartitionError(f, f"duplicate agent {_show(a)}")
        agents.append(a)
    if mode != "shared" and not agents:
        raise PartitionError("agents", f"mode {mode} needs at least one agent")

    reserved = _parse_reserved(table.get("reserved", {}))

    raw_allocs = _parse_table(table.get("allocations", {}), "allocations")
    if raw_allocs and mode != "manual":
        first = _key(next(iter(raw_allocs)))
        raise PartitionError(_fld("allocations", first),
                             f"allocations are only allowed in manual mode (mode is {mode})")
    parsed: dict[str, AllocationSpec] = {}
    for name, v in raw_allocs.items():
        if name not in agents:
            raise PartitionError(_fld("allocations", _key(name)), f"{_show(name)} is not in agents")
        parsed[name] = _parse_allocation(v, name)

    allocations: tuple[tuple[str, AllocationSpec], ...] = ()
    if mode == "manual":
        for a in agents:
            if a not in parsed:
                raise PartitionError(_fld("allocations", a), "missing: manual mode needs an allocation for every agent")
        allocations = tuple((a, parsed[a]) for a in agents)
        first_agent, first_alloc = allocations[0]
        want = first_alloc.kinds()
        for a, alloc in allocations[1:]:
            got = alloc.kinds()
            if got != want:
                raise PartitionError(
                    _fld("allocations", a),
                    f"names {_kinds_str(got)} but allocations.{first_agent} names {_kinds_str(want)}: "
                    "every agent must name the same resource kinds")

    return PartitionSpec(host=host, mode=mode, agents=tuple(agents), reserved=reserved, allocations=allocations)


def _kinds_str(kinds: frozenset[str]) -> str:
    return "{" + ", ".join(k for k in KINDS if k in kinds) + "}"


def load_spec_file(path: str) -> PartitionSpec:
    """Read and parse a TOML spec file. Invalid TOML is a ``PartitionError`` (field: the path);
    a missing or unreadable file raises the usual ``OSError``."""
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise PartitionError(path, f"not valid TOML: {e}") from e
        except UnicodeDecodeError as e:
            raise PartitionError(path, f"not valid UTF-8: {e}") from e
    return parse_spec(data)


# -- the computed partition ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentAllocation:
    """One agent's concrete share of a host."""

    agent: str
    cores: tuple[int, ...]
    mem_bytes: int
    disk_bytes: int
    whole_gpus: tuple[str, ...]  # uuids given whole to this agent
    vram_caps_mb: tuple[tuple[str, int], ...]  # (gpu uuid, cap MiB) for every GPU the agent may lease on

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "cores": list(self.cores),
            "mem_bytes": self.mem_bytes,
            "disk_bytes": self.disk_bytes,
            "whole_gpus": list(self.whole_gpus),
            # A list of pairs, not an object: the order (GPU index) survives sorted-key JSON.
            "vram_caps_mb": [[uuid, mb] for uuid, mb in self.vram_caps_mb],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AgentAllocation:
        t = _parse_table(d, "allocation")
        agent = t.get("agent")
        if not isinstance(agent, str):
            raise PartitionError("allocation.agent", f"expected a string, got {_show(agent)}")
        base = f"allocation[{agent}]"
        caps: list[tuple[str, int]] = []
        for i, pair in enumerate(_parse_list(t.get("vram_caps_mb", []), f"{base}.vram_caps_mb", "pairs")):
            f = f"{base}.vram_caps_mb[{i}]"
            p = _parse_list(pair, f, "[uuid, MiB]")
            if len(p) != 2 or not isinstance(p[0], str):
                raise PartitionError(f, "expected [uuid, MiB]")
            caps.append((p[0], _parse_int(p[1], f)))
        whole = _parse_list(t.get("whole_gpus", []), f"{base}.whole_gpus", "uuids")
        if not all(isinstance(u, str) for u in whole):
            raise PartitionError(f"{base}.whole_gpus", "expected a list of uuids")
        return cls(
            agent=agent,
            cores=tuple(_parse_int(c, f"{base}.cores")
                        for c in _parse_list(t.get("cores", []), f"{base}.cores", "core ids")),
            mem_bytes=_parse_int(t.get("mem_bytes", 0), f"{base}.mem_bytes"),
            disk_bytes=_parse_int(t.get("disk_bytes", 0), f"{base}.disk_bytes"),
            whole_gpus=tuple(whole),
            vram_caps_mb=tuple(caps),
        )


@dataclasses.dataclass(frozen=True)
class Partition:
    """What each agent on a host may use. ``agents`` and ``spec`` are empty for the implicit default."""

    host: str
    mode: str
    agents: tuple[str, ...]
    headroom_mb: int  # per GPU
    allocations: tuple[AgentAllocation, ...]
    spec: PartitionSpec | None

    def allows(self, agent: str) -> bool:
        """Shared mode: any agent. Otherwise only the listed agents."""
        return self.mode == "shared" or agent in self.agents

    def allocation(self, agent: str) -> AgentAllocation | None:
        for a in self.allocations:
            if a.agent == agent:
                return a
        return None

    def usable_mb(self, gpu: GpuInfo) -> int:
        return max(0, gpu.vram_total_mb - self.headroom_mb)

    def gpu_caps(self, agent: str, inventory: HostInventory) -> dict[str, int]:
        """uuid -> cap (MiB) on every GPU of ``inventory`` that ``agent`` may lease on.

        Shared mode: every GPU at ``usable``, listed agent or not. Otherwise the agent's allocation,
        restricted to the GPUs still present and clamped to their current usable VRAM; ``{}`` for an
        agent that is not allowed.
        """
        if self.mode == "shared":
            return {g.uuid: self.usable_mb(g) for g in sorted(inventory.gpus, key=lambda g: g.index)}
        if not self.allows(agent):
            return {}
        alloc = self.allocation(agent)
        if alloc is None:
            return {}
        present = {g.uuid: g for g in inventory.gpus}
        return {uuid: min(cap, self.usable_mb(present[uuid]))
                for uuid, cap in alloc.vram_caps_mb if uuid in present}

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "mode": self.mode,
            "agents": list(self.agents),
            "headroom_mb": self.headroom_mb,
            "allocations": [a.to_json() for a in self.allocations],
            "spec": self.spec.to_json() if self.spec is not None else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Partition:
        """The inverse of ``to_json``. Malformed input raises ``PartitionError``."""
        t = _parse_table(d, "partition")
        host = t.get("host")
        if not isinstance(host, str):
            raise PartitionError("partition.host", f"expected a string, got {_show(host)}")
        mode = t.get("mode")
        if not isinstance(mode, str) or mode not in MODES:
            raise PartitionError("partition.mode", f"must be one of {', '.join(MODES)}; got {_show(mode)}")
        agents = _parse_list(t.get("agents", []), "partition.agents", "agent names")
        if not all(isinstance(a, str) for a in agents):
            raise PartitionError("partition.agents", "expected a list of agent names")
        allocs = _parse_list(t.get("allocations", []), "partition.allocations", "allocations")
        raw_spec = t.get("spec")
        return cls(
            host=host,
            mode=mode,
            agents=tuple(agents),
            headroom_mb=_parse_int(t.get("headroom_mb", 0), "partition.headroom_mb"),
            allocations=tuple(AgentAllocation.from_json(a) for a in allocs),
            spec=parse_spec(raw_spec) if raw_spec is not None else None,
        )


def default_partition(inventory: HostInventory) -> Partition:
    """The partition of a host with no spec: shared, no reservation, open to any agent."""
    return Partition(host=inventory.host, mode="shared", agents=(), headroom_mb=0, allocations=(), spec=None)


def _host_cores(inventory: HostInventory) -> tuple[int, ...]:
    """The host's core ids, ascending. ``core_ids`` is authoritative; ``range(cpu_count)`` if it is empty."""
    if inventory.core_ids:
        return tuple(sorted(set(inventory.core_ids)))
    return tuple(range(max(0, inventory.cpu_count)))


def _split(total: int, n: int) -> list[int]:
    """divmod split; the remainder goes to the first shares."""
    q, r = divmod(total, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _find_gpu(gpus: Sequence[GpuInfo], ref: GpuRef) -> GpuInfo | None:
    """A GPU by index (int) or uuid (str); refs come normalized from ``_parse_gpu_ref``."""
    for g in gpus:
        if (g.index == ref) if isinstance(ref, int) else (g.uuid == ref):
            return g
    return None


def _fmt_cores(cores: Sequence[int]) -> str:
    """'0-3,8,10-11'."""
    out: list[str] = []
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out) or "none"


def compute_partition(inventory: HostInventory, spec: PartitionSpec) -> Partition:
    """Check ``spec`` against ``inventory`` and compute every agent's allocation.

    Raises ``PartitionError`` naming the field (``host``, ``reserved.cpu``, ``agents``,
    ``allocations.agent-a.cpu``, ``allocations.agent-b.gpus[0]``, ...).
    """
    # Re-validate the structure, so that a hand-built PartitionSpec gets the same checks.
    spec = parse_spec(spec.to_json())
    if spec.host != inventory.host:
        raise PartitionError("host", f"the spec is for host {_show(spec.host)}, "
                                     f"but this inventory is {_show(inventory.host)}")

    r = spec.reserved
    cores = _host_cores(inventory)
    if r.cpu > len(cores):
        raise PartitionError("reserved.cpu", f"reserves {r.cpu} cores, but the host has only {len(cores)}")
    if cores and r.cpu == len(cores):
        raise PartitionError("reserved.cpu", f"reserves all {len(cores)} cores, leaving none for the agents")
    if r.mem > inventory.mem_bytes:
        raise PartitionError("reserved.mem",
                             f"reserves {_human(r.mem)}, but the host has only {_human(inventory.mem_bytes)}")
    if r.disk > inventory.disk_bytes:
        raise PartitionError("reserved.disk",
                             f"reserves {_human(r.disk)}, but the host has only {_human(inventory.disk_bytes)}")
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    if gpus:
        smallest = min(gpus, key=lambda g: g.vram_total_mb)
        if r.vram_headroom_mb > smallest.vram_total_mb:
            raise PartitionError("reserved.vram_headroom",
                                 f"{r.vram_headroom_mb} MiB per GPU is more than GPU {smallest.index} has "
                                 f"({smallest.vram_total_mb} MiB)")

    reserved_cores = cores[: r.cpu]
    avail_cores = cores[r.cpu:]
    avail_mem = max(0, inventory.mem_bytes - r.mem)
    avail_disk = max(0, inventory.disk_bytes - r.disk)
    headroom = r.vram_headroom_mb
    usable = {g.uuid: max(0, g.vram_total_mb - headroom) for g in gpus}

    if spec.mode == "shared":
        every_gpu = tuple((g.uuid, usable[g.uuid]) for g in gpus)
        allocations = tuple(
            AgentAllocation(agent=a, cores=avail_cores, mem_bytes=avail_mem, disk_bytes=avail_disk,
                            whole_gpus=(), vram_caps_mb=every_gpu)
            for a in spec.agents)
    elif spec.mode == "auto-split":
        allocations = _auto_split(spec, avail_cores, avail_mem, avail_disk, gpus, usable)
    else:
        allocations = _manual(inventory, spec, cores, reserved_cores, avail_cores, avail_mem, avail_disk,
                              gpus, usable)

    return Partition(host=spec.host, mode=spec.mode, agents=spec.agents, headroom_mb=headroom,
                     allocations=allocations, spec=spec)


def _auto_split(spec: PartitionSpec, avail_cores: tuple[int, ...], avail_mem: int, avail_disk: int,
                gpus: list[GpuInfo], usable: dict[str, int]) -> tuple[AgentAllocation, ...]:
    n = len(spec.agents)
    if n == 0:
        raise PartitionError("agents", "auto-split needs at least one agent")
    if len(avail_cores) < n:
        raise PartitionError("agents", f"{n} agents but only {len(avail_cores)} available cores: "
                                       "auto-split would hand out empty core sets")
    core_shares = _split(len(avail_cores), n)
    mem_shares = _split(avail_mem, n)
    disk_shares = _split(avail_disk, n)

    whole: list[list[GpuInfo]] = [[] for _ in range(n)]
    caps: list[list[tuple[str, int]]] = [[] for _ in range(n)]
    if len(gpus) >= n:
        start = 0
        for i, k in enumerate(_split(len(gpus), n)):
            whole[i] = gpus[start:start + k]
            caps[i] = [(g.uuid, usable[g.uuid]) for g in whole[i]]
            start += k
    else:
        for i in range(n):
            caps[i] = [(g.uuid, usable[g.uuid] // n) for g in gpus]

    out: list[AgentAllocation] = []
    start = 0
    for i, agent in enumerate(spec.agents):
        out.append(AgentAllocation(
            agent=agent,
            cores=avail_cores[start:start + core_shares[i]],
            mem_bytes=mem_shares[i],
            disk_bytes=disk_shares[i],
            whole_gpus=tuple(g.uuid for g in whole[i]),
            vram_caps_mb=tuple(caps[i]),
        ))
        start += core_shares[i]
    return tuple(out)


def _check_sum(allocs: Sequence[tuple[str, AllocationSpec]], amounts: Sequence[int | None], key: Sequence[str],
               available: int, describe: str) -> None:
    """Reject at the first agent whose share pushes the running sum above ``available``."""
    total = sum(a for a in amounts if a is not None)
    if total <= available:
        return
    running = 0
    for (agent, _), amount, k in zip(allocs, amounts, key):
        running += amount or 0
        if running > available:
            raise PartitionError(_fld("allocations", agent, k),
                                 f"the agents ask for {total} in all, more than the {describe}")


def _manual(inventory: HostInventory, spec: PartitionSpec, cores: tuple[int, ...], reserved_cores: tuple[int, ...],
            avail_cores: tuple[int, ...], avail_mem: int, avail_disk: int, gpus: list[GpuInfo],
            usable: dict[str, int]) -> tuple[AgentAllocation, ...]:
    allocs = spec.allocations
    if not allocs:
        raise PartitionError("agents", "manual mode needs at least one agent")
    r = spec.reserved
    kinds = allocs[0][1].kinds()  # parse_spec made sure every agent names the same kinds

    # -- cpu
    assigned_cores: dict[str, tuple[int, ...]] = {a: avail_cores for a, _ in allocs}
    if "cpu" in kinds:
        counts = [a.cpu_count() for _, a in allocs]
        keys = ["cpu" if a.cpu is not None else "cores" for _, a in allocs]
        total = sum(c or 0 for c in counts)
        if total > len(avail_cores):
            _check_sum(allocs, counts, keys, len(avail_cores),
                       f"{len(avail_cores)} available cores ({len(cores)} cores - {r.cpu} reserved)")
        host_set, reserved_set = set(cores), set(reserved_cores)
        taken: dict[int, str] = {}
        for agent, a in allocs:
            for i, c in enumerate(a.cores or ()):
                f = f"allocations.{agent}.cores[{i}]"
                if c not in host_set:
                    raise PartitionError(f, f"core {c} does not exist on the host (cores {_fmt_cores(cores)})")
                if c in reserved_set:
                    raise PartitionError(f, f"core {c} is reserved (reserved.cpu = {r.cpu} reserves core ids "
                                            f"{_fmt_cores(reserved_cores)})")
                if c in taken:
                    raise PartitionError(f, f"core {c} is already given to {taken[c]}")
                taken[c] = agent
        free = [c for c in avail_cores if c not in taken]
        pos = 0
        for agent, a in allocs:
            if a.cores is not None:
                assigned_cores[agent] = tuple(sorted(a.cores))
            else:
                n = a.cpu or 0
                assigned_cores[agent] = tuple(free[pos:pos + n])
                pos += n

    # -- mem, disk
    mem_of: dict[str, int] = {a: avail_mem for a, _ in allocs}
    disk_of: dict[str, int] = {a: avail_disk for a, _ in allocs}
    if "mem" in kinds:
        amounts = [a.mem for _, a in allocs]
        _check_sum(allocs, amounts, ["mem"] * len(allocs), avail_mem,
                   f"{_human(avail_mem)} available ({_human(inventory.mem_bytes)} - {_human(r.mem)} reserved)")
        mem_of = {agent: a.mem or 0 for agent, a in allocs}
    if "disk" in kinds:
        amounts = [a.disk for _, a in allocs]
        _check_sum(allocs, amounts, ["disk"] * len(allocs), avail_disk,
                   f"{_human(avail_disk)} available ({_human(inventory.disk_bytes)} - {_human(r.disk)} reserved)")
        disk_of = {agent: a.disk or 0 for agent, a in allocs}

    # -- GPUs
    known = ", ".join(f"{g.index}={g.uuid}" for g in gpus) or "none"
    owner: dict[str, str] = {}  # uuid -> agent it is given whole to
    whole_of: dict[str, list[GpuInfo]] = {a: [] for a, _ in allocs}
    for agent, a in allocs:
        for i, ref in enumerate(a.gpus or ()):
            f = f"allocations.{agent}.gpus[{i}]"
            g = _find_gpu(gpus, ref)
            if g is None:
                raise PartitionError(f, f"unknown GPU {_show(ref)} (the host has: {known})")
            if g.uuid in owner:
                who = "this agent already" if owner[g.uuid] == agent else owner[g.uuid]
                raise PartitionError(f, f"GPU {g.index} ({g.uuid}) is already given whole to {who}")
            owner[g.uuid] = agent
            whole_of[agent].append(g)

    shared_caps: dict[str, dict[str, int]] = {a: {} for a, _ in allocs}
    for agent, a in allocs:
        for ref, mb in a.vram or ():
            f = _fld("allocations", agent, "vram", ref)
            g = _find_gpu(gpus, ref)
            if g is None:
                raise PartitionError(f, f"unknown GPU {_show(ref)} (the host has: {known})")
            if g.uuid in owner:
                raise PartitionError(f, f"GPU {g.index} ({g.uuid}) is given whole to {owner[g.uuid]}; "
                                        "it cannot also carry a VRAM cap")
            if g.uuid in shared_caps[agent]:
                raise PartitionError(f, f"GPU {g.index} ({g.uuid}) is capped twice for this agent")
            if mb > usable[g.uuid]:
                raise PartitionError(f, f"cap {mb} MiB is above GPU {g.index}'s usable {usable[g.uuid]} MiB "
                                        f"({g.vram_total_mb} MiB - {r.vram_headroom_mb} MiB headroom)")
            shared_caps[agent][g.uuid] = mb
    if "vram" not in kinds:
        unowned = {g.uuid: usable[g.uuid] for g in gpus if g.uuid not in owner}
        shared_caps = {a: dict(unowned) for a, _ in allocs}

    out: list[AgentAllocation] = []
    for agent, _ in allocs:
        mine = {g.uuid for g in whole_of[agent]}
        caps = tuple((g.uuid, usable[g.uuid]) if g.uuid in mine else (g.uuid, shared_caps[agent][g.uuid])
                     for g in gpus if g.uuid in mine or g.uuid in shared_caps[agent])
        out.append(AgentAllocation(
            agent=agent,
            cores=assigned_cores[agent],
            mem_bytes=mem_of[agent],
            disk_bytes=disk_of[agent],
            whole_gpus=tuple(g.uuid for g in sorted(whole_of[agent], key=lambda g: g.index)),
            vram_caps_mb=caps,
        ))
    return tuple(out)
