"""``gpucoord status --json`` as a document: the GetStatus message (or any message) as JSON, with numbers
as numbers. The CLI and the console (``coordinator.web``) both make their documents here, so that what an
operator reads in either comes from one code path."""
from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message


def status_objects(doc: dict[str, Any]) -> dict[str, Any]:
    """``status --json`` as a machine reads it: each agent's allocation as an object (``allocation``, not JSON
    in a string) and an unknown NUMA node as null, as in ``hosts/<host>`` (the wire's -1)."""
    for h in doc.get("hosts", []):
        for a in h.get("agents", []):
            if "allocation_json" in a:
                a["allocation"] = json.loads(a.pop("allocation_json") or "{}")
        for g in h.get("gpus", []):
            if int(g.get("numa_node", -1)) < 0:
                g["numa_node"] = None
    return doc


def message_to_json(message: Message) -> dict[str, Any]:
    """A protobuf message as JSON with numbers as numbers (protobuf's JSON mapping writes 64-bit integers as
    strings), field names as in the .proto and every field present."""
    from google.protobuf import json_format

    doc: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True)
    _int64_as_numbers(message.DESCRIPTOR, doc)
    return doc


def _int64_as_numbers(descriptor: Descriptor, doc: dict[str, Any]) -> None:
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = (F.CPPTYPE_INT64, F.CPPTYPE_UINT64)
    for field in descriptor.fields:
        if field.name not in doc:
            continue
        value = doc[field.name]
        repeated = isinstance(value, list)
        items = value if repeated else [value]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            if isinstance(value, dict):     # a map: its values, as any field (its keys stay strings in JSON)
                for key, item in value.items():
                    if entry.cpp_type in wide:
                        value[key] = int(item)
                    elif entry.cpp_type == F.CPPTYPE_MESSAGE and isinstance(item, dict):
                        _int64_as_numbers(entry.message_type, item)
        elif field.cpp_type in wide:
            converted = [int(x) for x in items]
            doc[field.name] = converted if repeated else converted[0]
        elif field.cpp_type == F.CPPTYPE_MESSAGE:
            for item in items:
                if isinstance(item, dict):
                    _int64_as_numbers(field.message_type, item)


__all__ = ["message_to_json", "status_objects"]
