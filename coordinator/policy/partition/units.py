"""Sizes and the errors of partition specs: parsing "16GiB", readable numbers, ``PartitionError``."""
from __future__ import annotations

import math
import re
from fractions import Fraction

from coordinator.limits import QUOTE_CHARS

MODES: tuple[str, ...] = ("shared", "auto-split", "manual")
KINDS: tuple[str, ...] = ("cpu", "mem", "disk", "gpus", "vram")
MAX_AGENTS = 256
MAX_ITEMS = 4096
MAX_INT = 2**63 - 1
MAX_SIZE_STR = 64
MIB = 1 << 20

_SPEC_KEYS = ("host", "mode", "agents", "reserved", "allocations", "priority_caps")
_RESERVED_KEYS = ("cpu", "mem", "disk", "vram_headroom")
_ALLOC_KEYS = ("cpu", "cores", "mem", "disk", "gpus", "vram")


class PartitionError(ValueError):
    """A spec that cannot be applied. ``field`` names the entry, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field or "spec"
        self.message = message or "invalid"
        super().__init__(f"{self.field}: {self.message}")

    def __reduce__(self) -> tuple[object, ...]:
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


def parse_mib(value: object, field: str, round_up: bool = False) -> int:
    """A size in whole MiB (docs/cli.md, "Sizes"): ``parse_size``'s grammar (a number without a unit is bytes),
    rounded down (``round_up``: up) to MiB. ``0`` is 0; any other size under 1 MiB is refused naming
    ``field``, never rounded to 0 (``100KiB``, ``100000``)."""
    n = parse_size(value, field)
    if 0 < n < MIB:
        raise PartitionError(field, f"{_show(value)} is less than 1 MiB (a number without a unit is bytes): "
                                    "give a size such as '512MiB' or '16GiB'")
    return -(-n // MIB) if round_up else n // MIB


_DISPLAY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB")


def show_bytes(n: int) -> str:
    """A size for a person (the one display rule of the CLI's tables: binary units, at most 4 significant
    digits): ``81408 MiB`` is ``79.5GiB``, ``2**50`` bytes ``1PiB``, 512 bytes ``512B``."""
    value, unit = float(n), 0
    while unit < len(_DISPLAY_UNITS) - 1 and (abs(value) >= 1024 or float(f"{abs(value):.4g}") >= 1024):
        value /= 1024
        unit += 1
    text = f"{value:.4g}"
    return f"{text}{_DISPLAY_UNITS[unit]}"


def show_mib(mb: int) -> str:
    """A size in MiB for a person: ``show_bytes`` of it (``0`` is ``0MiB``)."""
    return "0MiB" if mb == 0 else show_bytes(mb * MIB)


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


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.@-]+")


def _show(v: object) -> str:
    """A user-supplied value for a message: repr, cut short (and safe for huge integers)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length()} bits>"
    r = repr(v)
    return r if len(r) <= QUOTE_CHARS else r[:QUOTE_CHARS] + "..."   # a refusal quotes <= 32 characters


def _key(k: object) -> str:
    """A key of the input as part of a field name, cut short; quoted unless it reads as a plain name
    (an empty or blank key, or one with spaces or ':', would make the field name unreadable)."""
    s = _show(k) if not isinstance(k, str) or not _PLAIN_KEY.fullmatch(k) else k
    return s if len(s) <= QUOTE_CHARS else s[:QUOTE_CHARS] + "..."


def _human(n: int) -> str:
    """Bytes for a message: '17179869184 bytes (16GiB)'."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            q = n / mult
            return f"{n} bytes ({q:.4g}{unit})"
    return f"{n} bytes"
