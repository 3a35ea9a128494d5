"""What ends a server stream's reader of requests is logged by what it means: a caller that left (CANCELLED), or
a stream that its writer had already ended with a status, at debug level; anything else, which nothing
expects, at warning with its stack."""
from __future__ import annotations

import logging

import grpc
import pytest

from coordinator.rpc.answers import reader_ended

pytestmark = pytest.mark.unit


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


def _raised(e: Exception) -> Exception:
    try:
        raise e
    except Exception as caught:   # noqa: BLE001 - the test hands on what it raised, with its traceback
        return caught


def test_a_caller_that_left_is_logged_at_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="coordinator.rpc.answers"):
        try:
            raise _rpc_error(grpc.StatusCode.CANCELLED)
        except grpc.aio.AioRpcError as e:
            reader_ended("session", e)
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and "the caller left" in record.getMessage()


def test_a_read_after_the_writer_ended_the_stream_with_a_status_is_logged_at_debug_level(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica that loses etcd ends every stream with UNAVAILABLE (its writer aborts the call); a reader that
    a request wakes before the handler cancels it reads gRPC's "Locally aborted". The nemesis found that as a
    warning with a traceback in a replica's log."""
    with caplog.at_level(logging.DEBUG, logger="coordinator.rpc.answers"):
        reader_ended("keepalive", _raised(grpc.aio.AbortError("Locally aborted.")))
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and record.exc_info is None, (record.levelname, record.getMessage())


@pytest.mark.parametrize("error", [RuntimeError("boom"), _rpc_error(grpc.StatusCode.INTERNAL)],
                         ids=["an exception", "an rpc error other than CANCELLED"])
def test_an_unexpected_error_is_logged_at_warning_with_its_stack(error: Exception,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="coordinator.rpc.answers"):
        reader_ended("keepalive", _raised(error))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "keepalive stream ended" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[1] is error
