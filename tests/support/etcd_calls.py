"""The etcd boundary: ``record_etcd_calls`` (every unary etcd call of the Stores given its channel factory,
through a client interceptor: etcd stays real) and ``read_only`` (etcd's own rule for a read-only Txn)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc

from coordinator.etcd.store import CHANNEL_OPTIONS


class EtcdCalls(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Every unary etcd call of every Store built with ``channel`` as its channel factory
    (``Store(endpoints, channel=calls.channel)``, ``Cluster(..., etcd_channel=calls.channel)``): (method
    name, request). A client interceptor on the Store's own channel: etcd stays real."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        # Awaited before a call goes out, to act between two calls of one operation.
        self.before: Callable[[str, Any], Awaitable[None]] | None = None

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = method.rsplit("/", 1)[-1]
        self.calls.append((name, request))
        if self.before is not None:
            await self.before(name, request)
        return await continuation(details, request)

    def of(self, name: str) -> list[Any]:
        return [req for n, req in self.calls if n == name]

    def channel(self, target: str) -> grpc.aio.Channel:
        """A ``Store`` channel factory: the store's own options, with this recorder on every call."""
        return grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS.items()), interceptors=[self])


def record_etcd_calls() -> EtcdCalls:
    return EtcdCalls()


def read_only(txn: Any) -> bool:
    """etcd's own rule (isTxnReadonly): every op of both branches is a range."""
    return all(op.WhichOneof("request") == "request_range" for op in (*txn.success, *txn.failure))
