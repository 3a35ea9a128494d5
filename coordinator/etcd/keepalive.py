"""One LeaseKeepAlive stream for every etcd_lease of a process (etcd's Go client does the same)."""
from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from typing import Callable

import grpc
from aetcd import rpc

from coordinator import errors
from coordinator.aio import cancel_and_wait, drain, spawn
from coordinator.etcd.translate import translate


class KeepAliveStream:
    """One LeaseKeepAlive stream for every etcd_lease of the process (etcd's Go client does the same)."""

    def __init__(self, lease_stub: Callable[[], rpc.LeaseStub], timeout: float) -> None:
        self._lease_stub = lease_stub   # etcd's Lease stub of the store's current channel
        self._timeout = timeout
        self._requests: asyncio.Queue[rpc.LeaseKeepAliveRequest | None] | None = None
        self._waiters: dict[int, deque[asyncio.Future[int]]] = defaultdict(deque)
        self._task: asyncio.Task[None] | None = None
        self._last_response = 0.0

    @property
    def last_response(self) -> float:
        """``loop.time()`` of the stream's last answer."""
        return self._last_response

    def _ensure_running(self) -> asyncio.Queue[rpc.LeaseKeepAliveRequest | None]:
        if self._task is None or self._task.done():
            self._requests = asyncio.Queue()
            self._task = spawn(self._run(self._requests), "the etcd LeaseKeepAlive stream")
        assert self._requests is not None
        return self._requests

    async def _run(self, requests: asyncio.Queue[rpc.LeaseKeepAliveRequest | None]) -> None:
        call = self._lease_stub().LeaseKeepAlive(drain(requests), wait_for_ready=True)
        try:
            async for resp in call:
                self._last_response = asyncio.get_running_loop().time()
                q = self._waiters.get(resp.ID)
                if q:
                    fut = q.popleft()
                    if not fut.done():
                        fut.set_result(int(resp.TTL))
        except grpc.aio.AioRpcError as e:
            err = translate(e, write=False)
            for q in self._waiters.values():
                while q:
                    fut = q.popleft()
                    if not fut.done():
                        fut.set_exception(err)
        finally:
            # The request generator ends too: a call that has already ended ignores cancel(), and its
            # consumer of the generator would otherwise wait on the queue until collected (asyncio then
            # reports a task destroyed while pending, and an aclose() of a running generator).
            requests.put_nowait(None)
            call.cancel()

    async def refresh(self, etcd_lease: int, timeout: float | None = None) -> int:
        requests = self._ensure_running()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters[etcd_lease].append(fut)
        requests.put_nowait(rpc.LeaseKeepAliveRequest(ID=etcd_lease))
        sent_at = asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(fut, self._timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            # A stuck stream (no answer to anyone since we asked): drop it, so that the next refresh opens
            # a fresh one. A stream that answers others is left alone.
            if self._task is not None and self._last_response < sent_at:
                self._task.cancel()
            raise errors.Timeout(f"etcd keepalive of etcd_lease {etcd_lease:x} timed out") from None
        finally:
            q = self._waiters.get(etcd_lease)
            if q is not None:
                if fut in q:
                    q.remove(fut)
                if not q:
                    self._waiters.pop(etcd_lease, None)

    async def close(self) -> None:
        if self._requests is not None:
            self._requests.put_nowait(None)
        if self._task is not None:
            await cancel_and_wait([self._task])
