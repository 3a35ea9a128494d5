"""The JSON value of a watch event, as the history checker's rules read it."""
from __future__ import annotations

import json
from typing import Any

from coordinator.etcd.store import WatchEvent

MALFORMED: Any = object()   # a PUT whose value is not a JSON object (the G1 and INVALID rules report it)


def put_doc(kind: str, ev: WatchEvent, kinds: tuple[str, ...] = ("leases", "evictions", "usage")) -> Any:
    """The value a PUT of one of ``kinds`` wrote, parsed; ``MALFORMED`` when it is not a JSON object; None for a
    delete or another kind."""
    if ev.kind != "PUT" or kind not in kinds:
        return None
    try:
        doc = json.loads(ev.kv.value)
    except ValueError:
        return MALFORMED
    return doc if isinstance(doc, dict) else MALFORMED
