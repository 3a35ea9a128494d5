"""A reader for the subset of YAML that docker-compose.yml is written in, so that the suite needs no YAML
library: block mappings and sequences by indentation, flow sequences and mappings of plain or quoted
scalars, comments. Anything else (anchors, multi-line strings, tags) raises, so the file cannot drift into
YAML this reader would misread."""
from __future__ import annotations

import json
import re
from typing import Any

_UNSUPPORTED = re.compile(r"^\s*(?:-\s+)?(?:[\w.-]+:\s+)?[&*!|>]")


def _strip_comment(line: str) -> str:
    out, quote = [], ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            break
        out.append(ch)
    return "".join(out).rstrip()


def _split_flow(text: str) -> list[str]:
    """Split the inside of a flow collection at top-level commas."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith("["):
        assert text.endswith("]"), text
        return [scalar(x) for x in _split_flow(text[1:-1])]
    if text.startswith("{"):
        assert text.endswith("}"), text
        out = {}
        for item in _split_flow(text[1:-1]):
            key, _, value = item.partition(":")
            out[key.strip()] = scalar(value)
        return out
    if text.startswith('"'):
        return json.loads(text)
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    if text in ("", "~", "null"):
        return None
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def load(text: str) -> Any:
    lines: list[tuple[int, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if _UNSUPPORTED.match(raw):
            raise ValueError(f"line {n}: YAML beyond the supported subset: {raw.strip()}")
        line = _strip_comment(raw)
        if line.strip():
            lines.append((len(line) - len(line.lstrip(" ")), line.strip()))
    # Flow collections that continue over several lines are joined into one logical line.
    joined: list[tuple[int, str]] = []
    for indent, line in lines:
        if joined and joined[-1][1].count("[") + joined[-1][1].count("{") > \
                joined[-1][1].count("]") + joined[-1][1].count("}"):
            joined[-1] = (joined[-1][0], joined[-1][1] + " " + line)
        else:
            joined.append((indent, line))
    value, rest = _block(joined, 0, joined[0][0] if joined else 0)
    assert not rest, f"unparsed: {rest[:3]}"
    return value


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, list[tuple[int, str]]]:
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        items: list[Any] = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("-"):
            body = lines[i][1][1:].strip()
            if re.match(r"^[\w.-]+:(\s|$)", body):
                # "- key: value" starts a mapping whose other keys are indented to the key's column.
                sub = [(indent + 2, body)] + lines[i + 1:]
                value, rest = _block(sub, 0, indent + 2)
                items.append(value)
                i = len(lines) - len(rest)
            else:
                items.append(scalar(body))
                i += 1
        return items, lines[i:]
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        key, sep, value = lines[i][1].partition(":")
        assert sep, f"expected 'key: value', got {lines[i][1]!r}"
        key = key.strip().strip("\"'")
        if value.strip():
            mapping[key] = scalar(value)
            i += 1
        elif i + 1 < len(lines) and lines[i + 1][0] > indent:
            mapping[key], rest = _block(lines, i + 1, lines[i + 1][0])
            i = len(lines) - len(rest)
        else:
            mapping[key] = None
            i += 1
    return mapping, lines[i:]
