"""The one hook both gRPC servers install: identity, revocation, fair-service limits, authorization, bounds,
malformed bytes, audit.

For every call, before the handler runs: the peer's identity is read from its verified certificate, a
revoked certificate is refused (``revocation``), the identity's call budget is taken (``limits``: a token
bucket, and a cap on its open streams), ``authz.authorize`` decides, and ``bounds.check_request`` checks the
request's size and counts. Bytes that are not a valid message of the method's type are answered
INVALID_ARGUMENT (one log line at debug level, not a traceback per request). Streams are checked message
by message. Operator actions, every refusal of authorization and every revoked certificate's call are
audited (``authz.audit``; a limit's refusal only counts in the metrics, so that a flood cannot fill the
log). The handler can read the caller through ``current_caller()``.

A refusal sets the call's status and returns (no exception): an aborted call's exception would hold the
request in a reference cycle until the garbage collector runs, and a flood of large refused requests
would grow the process meanwhile.

A message of the ``Session`` stream is checked as the call it carries (``authz.unwrap``). A refused one does
not end the stream: the handler receives it as ``Refused`` and answers its call with the refusal, and
``audit_call`` audits the outcome of each carried call as the unary call's would be.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
from typing import AsyncIterator, Awaitable, Callable, Protocol, cast

import grpc
from google.protobuf.message import Message

from coordinator import errors
from coordinator.security import authz, bounds
from coordinator.security.identity import Identity, peer_identity, peer_serial
from coordinator.security.limits import TARPIT_S, Limits, cost
from coordinator.security.revocation import Revocations
from coordinator.security.status import refuse

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Caller:
    identity: Identity | None
    tls: bool
    peer: str
    serial: str = ""   # of the verified certificate (lowercase hex); "" without TLS

    def __str__(self) -> str:
        """Who asked, as an eviction record names it."""
        if self.identity is not None:
            return str(self.identity)
        return f"unauthenticated {self.peer}" if not self.tls else f"no identity {self.peer}"


# Set once per call and never reset: gRPC runs every call in a task of its own (a context of its own), and
# the tasks a handler starts copy it. A reset would have to happen in the same context, which a stream's
# generator finalized after its client went away does not have.
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("gpucoord_caller", default=None)


def current_caller() -> Caller | None:
    """The caller of the RPC being handled (None outside one)."""
    return _CALLER.get()


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """What the deserializer hands on for bytes that are not a valid message."""

    error: str


@dataclasses.dataclass(frozen=True)
class Refused:
    """A Session stream message that the checks refused: answered with ``error``, never handled."""

    request: Message
    error: errors.GpucoordError


def audit_call(method: str, request: Message | None, code: grpc.StatusCode) -> None:
    """Audit the outcome of a call carried by a Session stream message (``method`` and ``request`` unwrapped),
    as the interceptor audits a unary call's."""
    caller = _CALLER.get()
    if caller is None or not authz.needs_audit(caller.identity, method):
        return
    outcome = "ok" if code == grpc.StatusCode.OK else f"failed: {code.name}"
    authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request), outcome)


STREAMS_CAPPED = frozenset({authz.COORDINATOR + "KeepAlive", authz.COORDINATOR + "KeepAliveSessions",
                            authz.SESSION_STREAM, authz.REGISTRY + "Register"})

# What a handler returns: the response of a unary call, or the responses of a streaming one.
Answer = Awaitable[object] | AsyncIterator[object]


class _Behavior(Protocol):
    """A method handler's behavior: (request or request iterator, context) -> its answer."""

    def __call__(self, request: object, context: grpc.aio.ServicerContext, /) -> Answer: ...


class SecurityInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, tls: bool, count_refusal: Callable[[str, BaseException], None],
                 agent_hosts: authz.AgentHosts | None = None, limits: Limits | None = None,
                 revocations: Revocations | None = None) -> None:
        """``count_refusal(rpc, error)`` counts a call refused here, before its handler (the servers pass
        ``metrics.count_refusal``: security sits below the metrics and does not import them)."""
        self.tls = tls
        self.count_refusal = count_refusal
        self.agent_hosts = agent_hosts
        self.limits = limits
        self.revocations = revocations
        # The wrapped handler of each served method: the same for every call, so built once. Only methods
        # that have a handler are kept (a finite set), whatever names callers send.
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None:
            return None
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = wrapped
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer

        def safe_deserialize(data: bytes) -> object:
            try:
                return deserialize(data) if deserialize is not None else data
            except Exception as e:   # noqa: BLE001 - any decoding failure is the caller's bad bytes
                log.debug("%s: malformed request bytes: %r", method, e)
                return _Malformed(type(e).__name__)

        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=safe_deserialize,
                                    unary_unary=self._unary(method, handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(request_deserializer=safe_deserialize,
                                    unary_stream=self._unary(method, handler.unary_stream))
        if handler.stream_unary is not None:
            return handler._replace(request_deserializer=safe_deserialize,
                                    stream_unary=self._stream(method, handler.stream_unary))
        return handler._replace(request_deserializer=safe_deserialize,
                                stream_stream=self._stream(method, handler.stream_stream))

    # -- checks ------------------------------------------------------------------------------------
    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        if not self.tls:
            return Caller(None, False, context.peer())
        return Caller(peer_identity(context), True, context.peer(), peer_serial(context))

    async def _check(self, caller: Caller, method: str, request: object) -> None:
        """Raise the error that refuses ``request`` (None: the opening of a stream), if any."""
        if isinstance(request, _Malformed):
            raise errors.InvalidArgument(f"request: not a valid message for {authz.rpc_name(method)} "
                                         f"({request.error})", "request")
        method, request = authz.unwrap(method, request)
        if caller.tls:
            if self.revocations is not None and not self.revocations.ready.is_set():
                raise errors.Unavailable("this server has not read the list of revoked certificates yet; retry")
            if self.revocations is not None and caller.serial and self.revocations.is_revoked(caller.serial):
                who = str(caller.identity) if caller.identity is not None else f"no identity {caller.peer}"
                why = f"its certificate (serial {caller.serial[:40]}) is revoked"
                authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request),
                            f"denied: {why}")
                raise authz.Denied(who, f"call {authz.rpc_name(method)}", why)
            if self.limits is not None:   # health checks too: they count against the caller's rate
                await self._take(caller, method, request)
        try:
            await authz.authorize(caller.identity, caller.tls, method, request, self.agent_hosts)
        except authz.Denied as e:
            authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request),
                        f"denied: {e.why}")
            raise
        if request is not None:
            bounds.check_request(method, request)

    async def _take(self, caller: Caller, method: str, request: Message | None) -> None:
        """The call's tokens of its identity's bucket; a refusal is held for a while first (``limits``)."""
        assert self.limits is not None
        who = self._who(caller)
        try:
            self.limits.take(who, cost(authz.rpc_name(method), request))
        except errors.CapacityError:
            size = request.ByteSize() if request is not None and hasattr(request, "ByteSize") else 0
            if self.limits.hold(who, size):
                try:
                    await asyncio.sleep(TARPIT_S)
                finally:
                    self.limits.release_held(who)
            raise

    @staticmethod
    def _who(caller: Caller) -> str:
        return str(caller.identity) if caller.identity is not None else f"serial {caller.serial[:40]}"

    async def _refusal(self, caller: Caller, method: str, request: object) -> errors.GpucoordError | None:
        """The error that refuses the call (counted in the metrics), or None when it may go on."""
        try:
            await self._check(caller, method, request)
        except errors.GpucoordError as e:
            self.count_refusal(authz.rpc_name(method), e)   # refused before the handler: counted here
            return e
        return None

    def _audit_outcome(self, caller: Caller, method: str, request: Message, context: grpc.aio.ServicerContext,
                       exc: BaseException | None) -> None:
        if not authz.needs_audit(caller.identity, method):
            return
        code = None
        try:
            code = context.code()
        except Exception:   # noqa: BLE001 - not every context can tell
            pass
        if exc is None and code in (None, grpc.StatusCode.OK):
            outcome = "ok"
        else:
            outcome = f"failed: {code.name if isinstance(code, grpc.StatusCode) else type(exc).__name__}"
        authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request), outcome)

    # -- wrappers --------------------------------------------------------------------------------
    def _unary(self, method: str, behavior: _Behavior) -> _Behavior:
        """A unary request (unary-unary, or unary-stream such as health's Watch)."""
        interceptor = self

        if inspect.isasyncgenfunction(behavior):
            async def gen(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                caller = interceptor._caller(context)
                error = await interceptor._refusal(caller, method, request)
                if error is not None:
                    refuse(context, error)
                    return
                _CALLER.set(caller)
                async for item in cast(AsyncIterator[object], behavior(request, context)):
                    yield item
            return gen

        async def call(request: object, context: grpc.aio.ServicerContext) -> object:
            caller = interceptor._caller(context)
            error = await interceptor._refusal(caller, method, request)
            if error is not None:
                refuse(context, error)
                return None
            _CALLER.set(caller)
            try:
                response = await cast(Awaitable[object], behavior(request, context))
            except BaseException as e:
                self._audit_outcome(caller, method, request, context, e)
                raise
            self._audit_outcome(caller, method, request, context, None)
            return response
        return call

    def _stream(self, method: str, behavior: _Behavior) -> _Behavior:
        """A request stream: the caller is checked at the opening and each message as it arrives. A
        refused message ends the stream with the refusal (the handler's read raises it); on the Session
        stream it is answered on its own and the stream goes on."""
        interceptor = self
        capped = method in STREAMS_CAPPED

        async def opening(context: grpc.aio.ServicerContext) -> tuple[Caller, str | None]:
            """The caller, and the identity whose open streams it holds (None: not counted)."""
            caller = interceptor._caller(context)
            error = await interceptor._refusal(caller, method, None)
            if error is None and capped and caller.tls and interceptor.limits is not None:
                try:
                    who = interceptor._who(caller)
                    interceptor.limits.open_stream(who)
                    return caller, who
                except errors.GpucoordError as e:
                    interceptor.count_refusal(authz.rpc_name(method), e)
                    error = e
            if error is not None:
                refuse(context, error)
                raise _Refused()
            return caller, None

        own = method.startswith("/gpucoord.")

        async def checked(caller: Caller, requests: AsyncIterator[object],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            async for request in requests:
                try:
                    await interceptor._check(caller, method, request)
                except errors.GpucoordError as e:
                    interceptor.count_refusal(authz.rpc_name(method), e)
                    if own:
                        # Our handlers answer a GpucoordError with its status, whichever of their tasks reads
                        # the stream (KeepAlive's reader, the registry's): it goes to them.
                        raise
                    # Another service's handler (server reflection) would answer UNKNOWN with a traceback:
                    # the stream ends with the refusal's status (RESOURCE_EXHAUSTED naming rate, ...), quietly.
                    refuse(context, e)
                    raise _StreamRefused() from None
                yield request

        async def checked_calls(caller: Caller, requests: AsyncIterator[object],
                                context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            # Session: a refused message is answered on its own; the stream goes on.
            async for request in requests:
                if isinstance(request, _Malformed):
                    await interceptor._check(caller, method, request)   # raises: bytes without a call id
                try:
                    await interceptor._check(caller, method, request)
                except errors.GpucoordError as e:
                    interceptor.count_refusal(authz.rpc_name(authz.unwrap(method, request)[0]), e)
                    yield Refused(request, e)
                    continue
                yield request

        if method == authz.SESSION_STREAM:
            checked = checked_calls

        def release(who: str | None) -> None:
            if who is not None and interceptor.limits is not None:
                interceptor.limits.close_stream(who)

        if inspect.isasyncgenfunction(behavior):
            async def gen(requests: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                try:
                    caller, who = await opening(context)
                except _Refused:
                    return
                _CALLER.set(caller)
                try:
                    calls = checked(caller, cast(AsyncIterator[object], requests), context)
                    async for item in cast(AsyncIterator[object], behavior(calls, context)):
                        yield item
                except _StreamRefused:
                    return
                finally:
                    release(who)
            return gen

        async def call(requests: object, context: grpc.aio.ServicerContext) -> object:
            try:
                caller, who = await opening(context)
            except _Refused:
                return None
            _CALLER.set(caller)
            try:
                calls = checked(caller, cast(AsyncIterator[object], requests), context)
                return await cast(Awaitable[object], behavior(calls, context))
            except _StreamRefused:
                return None
            finally:
                release(who)
        return call


class _Refused(Exception):
    """The opening of a stream was refused (its status is set)."""


class _StreamRefused(BaseException):
    """A stream's message was refused and its status set: the wrapper ends the call without a traceback. Not an
    Exception, so that no handler's ``except Exception`` takes it for its own failure."""
