"""The gang fields of an acquire are checked at the RPC edge (issue 21): a bad one is INVALID_ARGUMENT naming
the field, before anything is read or written."""
from __future__ import annotations

from typing import Any

import pytest

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors
from coordinator.limits import MAX_GANG_GPUS
from coordinator.rpc import validate

pytestmark = pytest.mark.unit


def req(**kw: Any) -> pb.AcquireRequest:
    base: dict[str, Any] = {"vram_mb": 1024, "request_id": "r"}
    base.update(kw)
    return pb.AcquireRequest(**base)


@pytest.mark.parametrize("fields,field", [
    ({"gpu_count": -1}, "gpu_count"),
    ({"gpu_count": MAX_GANG_GPUS + 1}, "gpu_count"),
    ({"topology": "ring"}, "topology"),
    ({"topology": "NVLINK"}, "topology"),
    ({"exclusive": True, "vram_mb": 1024}, "vram_mb"),
    ({"vram_mb": 0, "gpu_count": 2}, "vram_mb"),
    ({"gpus": ["0", "1"], "gpu_count": 3}, "gpus"),
    ({"gpus": ["0", "0"], "gpu_count": 2}, "gpus"),
    ({"gpus": ["0", "a b"], "gpu_count": 2}, "gpus"),
    ({"gpus": ["0", "1"], "gpu_count": 2, "gpu": "0"}, "gpus"),
    ({"gpu": "0", "gpu_count": 2}, "gpu"),     # one GPU named for a gang of 2: name them all in gpus
    ({"gpus": [str(i) for i in range(MAX_GANG_GPUS + 1)], "gpu_count": MAX_GANG_GPUS}, "gpus"),
])
def test_a_bad_gang_field_is_refused_naming_it(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        validate.acquire(req(**fields))
    assert e.value.field == field and e.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize("fields", [
    {}, {"gpu_count": 0}, {"gpu_count": 8, "topology": "nvlink"}, {"exclusive": True, "vram_mb": 0, "gpu_count": 4},
    {"topology": "numa", "gpu_count": 2}, {"topology": "any"}, {"gpus": ["0", "GPU-x"], "gpu_count": 2},
    {"gpus": ["3"]},
])
def test_good_gang_fields_pass(fields: dict[str, Any]) -> None:
    validate.acquire(req(**fields))
