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


# -- multi-host gangs (issue 30) ---------------------------------------------------------------------------
@pytest.mark.parametrize("fields,field", [
    ({"hosts": -1}, "hosts"),
    ({"hosts": 65}, "hosts"),
    ({"hosts": 2, "gpu": "0"}, "gpu"),                          # a GPU index or uuid is one host's
    ({"hosts": 2, "gpus": ["0", "1"], "gpu_count": 2}, "gpus"),
    ({"hosts": 1, "same": "rack"}, "same"),                     # a label key the hosts share: two hosts or more
    ({"same": "rack"}, "same"),
    ({"hosts": 0, "prefer": "rack"}, "prefer"),
    ({"hosts": 2, "same": "Rack"}, "same"),
    ({"hosts": 2, "same": "rack=r1"}, "same"),
    ({"hosts": 2, "prefer": "-rack"}, "prefer"),
    ({"hosts": 2, "prefer": "a" * 100}, "prefer"),
    ({"hosts": 2, "same": "bad_prefix!/rack"}, "same"),
])
def test_a_bad_multi_host_field_is_refused_naming_it(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        validate.acquire(req(**fields))
    assert e.value.field == field and e.value.message.startswith(f"{field}: ")


def test_a_refused_label_key_is_quoted_short() -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        validate.acquire(req(hosts=2, same="X" * 10_000))
    assert "X" * 33 not in e.value.message and "10000 characters" in e.value.message


@pytest.mark.parametrize("fields", [
    {"hosts": 0}, {"hosts": 1}, {"hosts": 2}, {"hosts": 64, "gpu_count": 8, "exclusive": True, "vram_mb": 0},
    {"hosts": 2, "same": "rack"}, {"hosts": 3, "prefer": "topology.example.com/block", "topology": "nvlink"},
    {"hosts": 2, "same": "rack", "prefer": "block", "gpu_count": 4},
])
def test_good_multi_host_fields_pass(fields: dict[str, Any]) -> None:
    validate.acquire(req(**fields))
