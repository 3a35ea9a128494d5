"""The one table of errors (``errors.TABLE``): every error class maps to a real gRPC status code and a reason,
and the wire translation (``coordinator.security.status``) carries both, with the field, for every class."""
from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from agent_client import errors as client_errors
from coordinator import errors
from coordinator.rpc.forward import Relayed
from coordinator.security import status
from coordinator.security.authz import Denied


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


# Every error class, wherever defined (Relayed carries the owner's status instead of a row).
ERRORS = [c for c in _subclasses(errors.GpucoordError) if c is not Relayed]
assert Denied in ERRORS


def _make(cls: type[errors.GpucoordError], field: str | None) -> errors.GpucoordError:
    if cls is errors.Compacted:
        return errors.Compacted("compacted", 7)
    if cls is Denied:
        return Denied("who", "act", "why")
    return cls("m", field)


def test_every_error_class_of_the_tree_has_a_row_of_its_own() -> None:
    tree = {c for c in ERRORS if c.__module__ == errors.__name__}
    assert set(errors.TABLE) == tree, tree ^ set(errors.TABLE)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_maps_to_a_grpc_status_code_and_a_reason_on_the_wire(cls: type[errors.GpucoordError]) -> None:
    error = _make(cls, "vram_mb")
    code = grpc.StatusCode[error.code]
    assert error.reason and error.reason.isupper()
    wire = status.wire_status(error)
    assert wire.code == code and wire.message == error.message
    sent = status_pb2.Status.FromString(wire.details)
    assert sent.code == code.value[0] and sent.message == error.message
    info = error_details_pb2.ErrorInfo()
    assert sent.details[0].Unpack(info)
    assert (info.reason, info.domain) == (error.reason, "gpucoord")
    assert status.error_info(wire.trailing_metadata) == (error.reason, error.field or "")


def test_reasons_a_client_tells_apart() -> None:
    assert errors.SessionGone("m", "session").status == errors.Status("NOT_FOUND", "SESSION_GONE", "session")
    assert errors.SessionGone("m").reason == client_errors.SESSION_GONE
    assert errors.NotFound("m", "lease_id").reason == "NOT_FOUND"
    assert errors.CapacityError("m", "vram_mb").reason == "NO_FIT"
    assert errors.CapacityError("m", "queue").reason == "QUEUE_FULL"
    assert errors.WaitTimeout("m", "vram_mb").reason == "WAIT_TIMEOUT"
    assert errors.InvalidArgument("m", "pids[2]").status == errors.Status("INVALID_ARGUMENT", "INVALID_FIELD",
                                                                         "pids[2]")
    assert errors.FailedPrecondition("m", "host").reason == "HOST_UNUSABLE"


def test_an_unexpected_exception_is_internal_and_a_malformed_record_a_failed_precondition() -> None:
    from coordinator.records import InvalidRecord
    assert status.as_error(ValueError("x")) is None
    assert status.internal(ValueError("x")).code == grpc.StatusCode.INTERNAL
    error = status.as_error(InvalidRecord("leases/x: bad"))
    assert error is not None and (error.code, error.reason, error.field) == ("FAILED_PRECONDITION",
                                                                            "RECORD_MALFORMED", "record")


def test_a_relayed_answer_keeps_the_owners_code_reason_and_field() -> None:
    relayed = Relayed(errors.Status("NOT_FOUND", "SESSION_GONE", "session"), "session: gone")
    wire = status.wire_status(relayed)
    assert wire.code == grpc.StatusCode.NOT_FOUND
    assert status.error_info(wire.trailing_metadata) == ("SESSION_GONE", "session")
