"""etcd's failures become gpucoord errors in one place (``coordinator.etcd.translate``): the ones that need care."""
from __future__ import annotations

import grpc
import pytest

from coordinator import errors, metrics
from coordinator.etcd.translate import translate as _translate

pytestmark = pytest.mark.unit


def _err(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, details, write, expected", [
    # etcd reports a deadline that passed while it served the call as UNKNOWN.
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", False, errors.Timeout),
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", True, errors.OutcomeUnknown),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False, errors.Timeout),
    (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted", False,
     errors.Compacted),
    (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", True, errors.SessionGone),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded", True, errors.EtcdNoSpace),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (14339783 vs. 4194304)", False,
     errors.Unavailable),
])
def test_translate(code: grpc.StatusCode, details: str, write: bool, expected: type) -> None:
    assert type(_translate(_err(code, details), write)) is expected


def test_nospace_names_the_repair_and_is_counted() -> None:
    before = metrics.REGISTRY.get_sample_value("gpucoord_etcd_nospace_total") or 0.0
    err = _translate(_err(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded"), True)
    assert err.code == "UNAVAILABLE" and "alarm disarm" in err.message and "defrag" in err.message
    assert metrics.REGISTRY.get_sample_value("gpucoord_etcd_nospace_total") == before + 1
