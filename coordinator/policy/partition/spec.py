"""Parsing a partition spec (TOML or JSON) into ``PartitionSpec``: every rejection names its field."""
from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping, Sequence

from coordinator.keys import valid_name
from coordinator.policy.partition.caps import PriorityCap, parse_caps
from coordinator.policy.partition.units import (
    _ALLOC_KEYS,
    _RESERVED_KEYS,
    _SPEC_KEYS,
    KINDS,
    MAX_AGENTS,
    MAX_INT,
    MAX_ITEMS,
    MODES,
    PartitionError,
    _key,
    _show,
    parse_mib,
    parse_size,
)

# -- the spec -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reserved:
    """Taken off the top before splitting. ``cpu`` in cores, ``mem``/``disk`` in bytes, headroom in MiB per GPU."""

    cpu: int = 0
    mem: int = 0
    disk: int = 0
    vram_headroom_mb: int = 0

    def to_json(self) -> dict[str, object]:
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

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {}
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
    # The highest priority each agent (name or pattern) may ask for (partition.caps), sorted by name.
    priority_caps: tuple[tuple[str, PriorityCap], ...] = ()

    def to_json(self) -> dict[str, object]:
        """JSON-able; ``parse_spec(spec.to_json()) == spec``."""
        d: dict[str, object] = {
            "host": self.host,
            "mode": self.mode,
            "agents": list(self.agents),
            "reserved": self.reserved.to_json(),
            "allocations": {agent: a.to_json() for agent, a in self.allocations},
        }
        if self.priority_caps:
            d["priority_caps"] = {name: cap.to_json() for name, cap in self.priority_caps}
        return d


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


def _parse_list(v: object, field: str, what: str) -> Sequence[object]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise PartitionError(field, f"expected a list of {what}, got {_type_name(v)}")
    if len(v) > MAX_ITEMS:
        raise PartitionError(field, f"too many entries ({len(v)}, at most {MAX_ITEMS})")
    return v


def _parse_table(v: object, field: str) -> Mapping[object, object]:
    if not isinstance(v, Mapping):
        raise PartitionError(field, f"expected a table, got {_type_name(v)}")
    return v


def _check_keys(table: Mapping[object, object], allowed: Sequence[str], prefix: str | None) -> None:
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
    headroom = parse_mib(table.get("vram_headroom", 0), "reserved.vram_headroom")
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
            mb = parse_mib(size, f)
            if mb < 1:
                raise PartitionError(f, f"a VRAM cap must be at least 1MiB, got {_show(size)} "
                                        "(a plain number is bytes: write e.g. '20GiB')")
            caps[ref] = mb
        vram = tuple(sorted(caps.items(), key=lambda kv: _ref_sort_key(kv[0])))

    return AllocationSpec(cpu=cpu, cores=cores, mem=mem, disk=disk, gpus=gpus, vram=vram)


def parse_spec(data: object) -> PartitionSpec:
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

    caps = parse_caps(table["priority_caps"]) if "priority_caps" in table else ()
    return PartitionSpec(host=host, mode=mode, agents=tuple(agents), reserved=reserved, allocations=allocations,
                         priority_caps=caps)


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
