"""The one hook both gRPC servers install: identity, authorization, bounds, malformed bytes, audit.

For every call, before the handler runs: the peer's identity is read from its verified certificate,
``authz.authorize`` decides, and ``bounds.check_request`` checks the request's size and counts. Bytes that
are not a valid message of the method's type are answered INVALID_ARGUMENT (one log line at debug level,
not a traceback per request). Streams are checked message by message. Operator actions and every
refusal are audited (``authz.audit``). The handler can read the caller through ``current_caller()``.

A message of the ``Session`` stream is checked as the call it carries (``authz.unwrap``). A refused one does
not end the stream: the handler receives it as ``Refused`` and answers its call with the refusal, and
``audit_call`` audits the outcome of each carried call as the unary call's would be.
"""
from __future__ import annotations

import contextvars
import dataclasses
import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from coordinator import errors, metrics
from coordinator.security import authz, bounds
from coordinator.security.identity import Identity, peer_identity

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Caller:
    identity: Identity | None
    tls: bool
    peer: str

    def __str__(self) -> str:
        """Who asked, as an eviction record names it."""
        if self.identity is not None:
            return str(self.identity)
        return f"unauthenticated {self.peer}" if not self.tls else f"no identity {self.peer}"


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

    request: Any
    error: errors.GpucoordError


def audit_call(method: str, request: Any, code: grpc.StatusCode) -> None:
    """Audit the outcome of a call carried by a Session stream message (``method`` and ``request`` unwrapped),
    as the interceptor audits a unary call's."""
    caller = _CALLER.get()
    if caller is None or not authz.needs_audit(caller.identity, method):
        return
    outcome = "ok" if code == grpc.StatusCode.OK else f"failed: {code.name}"
    authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request), outcome)


class SecurityInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, tls: bool, agent_hosts: authz.AgentHosts | None = None) -> None:
        self.tls = tls
        self.agent_hosts = agent_hosts
        # The wrapped handler of each served method: the same for every call, so built once. Only methods
        # that have a handler are kept (a finite set), whatever names callers send.
        self._wrapped: dict[str, Any] = {}

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
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

    def _wrap(self, method: str, handler: Any) -> Any:
        deserialize = handler.request_deserializer

        def safe_deserialize(data: bytes) -> Any:
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
    def _caller(self, context: Any) -> Caller:
        return Caller(peer_identity(context) if self.tls else None, self.tls, context.peer())

    async def _check(self, caller: Caller, method: str, request: Any) -> None:
        """Raise the error that refuses ``request`` (None: the opening of a stream), if any."""
        if isinstance(request, _Malformed):
            raise errors.InvalidArgument(f"request: not a valid message for {authz.rpc_name(method)} "
                                         f"({request.error})", "request")
        method, request = authz.unwrap(method, request)
        try:
            await authz.authorize(caller.identity, caller.tls, method, request, self.agent_hosts)
        except authz.Denied as e:
            authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request),
                        f"denied: {e.why}")
            raise
        if request is not None:
            bounds.check_request(method, request)

    def _audit_outcome(self, caller: Caller, method: str, request: Any, context: Any,
                       exc: BaseException | None) -> None:
        if not authz.needs_audit(caller.identity, method):
            return
        if exc is None:
            outcome = "ok"
        else:
            code = None
            try:
                code = context.code()
            except Exception:   # noqa: BLE001 - not every context can tell
                pass
            outcome = f"failed: {code.name if isinstance(code, grpc.StatusCode) else type(exc).__name__}"
        authz.audit(caller.identity, caller.tls, caller.peer, method, authz.target_of(method, request), outcome)

    # -- wrappers --------------------------------------------------------------------------------
    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """A unary request (unary-unary, or unary-stream such as health's Watch)."""
        interceptor = self

        async def admit(request: Any, context: Any) -> Caller:
            caller = interceptor._caller(context)
            try:
                await interceptor._check(caller, method, request)
            except errors.GpucoordError as e:
                metrics.count_refusal(authz.rpc_name(method), e)   # refused before the handler: counted here
                await context.abort(grpc.StatusCode[e.code], e.message)
            return caller

        if inspect.isasyncgenfunction(behavior):
            async def gen(request: Any, context: Any) -> AsyncIterator[Any]:
                caller = await admit(request, context)
                token = _CALLER.set(caller)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    _CALLER.reset(token)
            return gen

        async def call(request: Any, context: Any) -> Any:
            caller = await admit(request, context)
            token = _CALLER.set(caller)
            try:
                response = await behavior(request, context)
            except BaseException as e:
                self._audit_outcome(caller, method, request, context, e)
                raise
            finally:
                _CALLER.reset(token)
            self._audit_outcome(caller, method, request, context, None)
            return response
        return call

    def _stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """A request stream: the caller is checked at the opening and each message as it arrives. A
        refused message ends the stream with the refusal (the handler's read raises it)."""
        interceptor = self

        async def opening(context: Any) -> Caller:
            caller = interceptor._caller(context)
            try:
                await interceptor._check(caller, method, None)
            except errors.GpucoordError as e:
                metrics.count_refusal(authz.rpc_name(method), e)
                await context.abort(grpc.StatusCode[e.code], e.message)
            return caller

        async def checked(caller: Caller, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for request in requests:
                await interceptor._check(caller, method, request)
                yield request

        async def checked_calls(caller: Caller, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            # Session: a refused message is answered on its own; the stream goes on.
            async for request in requests:
                if isinstance(request, _Malformed):
                    await interceptor._check(caller, method, request)   # raises: bytes without a call id
                try:
                    await interceptor._check(caller, method, request)
                except errors.GpucoordError as e:
                    metrics.count_refusal(authz.rpc_name(authz.unwrap(method, request)[0]), e)
                    yield Refused(request, e)
                    continue
                yield request

        if method == authz.SESSION_STREAM:
            checked = checked_calls

        if inspect.isasyncgenfunction(behavior):
            async def gen(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                caller = await opening(context)
                token = _CALLER.set(caller)
                try:
                    async for item in behavior(checked(caller, requests), context):
                        yield item
                finally:
                    _CALLER.reset(token)
            return gen

        async def call(requests: AsyncIterator[Any], context: Any) -> Any:
            caller = await opening(context)
            token = _CALLER.set(caller)
            try:
                return await behavior(checked(caller, requests), context)
            finally:
                _CALLER.reset(token)
        return call
