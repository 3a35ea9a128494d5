"""The synchronous client: an ``AsyncClient`` on a private event loop in a background thread, so the sync
API awaits exactly what the async one does (no sync fake that could hide an un-awaited call)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from typing import Any, Awaitable, Callable, Sequence, TypeVar, TypeVarTuple, Unpack

from agent_client import errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.client import AsyncClient, ClientOptions
from agent_client.lease import AsyncLease, EvictionNotice
from agent_client.run import AsyncBoundProcess, LoopRunner, RunOptions

T = TypeVar("T")
_Ts = TypeVarTuple("_Ts")


class _ClientLoop(asyncio.SelectorEventLoop):
    """The private loop of one sync ``Client``: once closed, it drops what another thread hands it.

    gRPC's asyncio layer completes a cancelled call (a closed client's keepalive stream, say) a moment after
    the call was cancelled, from whichever loop of the process polls gRPC's completion queue, by handing the
    completion to the call's own loop with ``call_soon_threadsafe``. When the client has closed its loop by
    then, asyncio raises "Event loop is closed" inside that other loop's poller, which logs a traceback (the
    bench's main loop, a test's loop). Nothing waits for such a completion: the call was cancelled and its
    loop is gone, so it is dropped instead. How long gRPC takes to deliver it is not ours to wait for.
    """

    def call_soon_threadsafe(self, callback: Callable[[Unpack[_Ts]], object], *args: Unpack[_Ts],
                             context: contextvars.Context | None = None) -> asyncio.Handle:
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if not self.is_closed():
                raise
            # A handle that was never scheduled: cancelled at once, as a closed loop will never run it.
            handle = asyncio.Handle(callback, args, self, context)
            handle.cancel()
            return handle


class Lease:
    """A VRAM lease held through the sync ``Client``; a context manager that releases on exit.

    It reads through to the ``AsyncLease`` that receives the notices: ``id``, ``gpu_uuid``, ``gpu_index``,
    ``token``, ``vram_mb``, ``evicting`` (a threading.Event), ``notice``, ``on_evict(callback)``.
    """

    def __init__(self, client: Client, inner: AsyncLease) -> None:
        self._inner = inner
        self._sync = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def on_evict(self, callback: Callable[[EvictionNotice], object]) -> None:
        """``callback(notice)`` runs in its own thread, so it may call ``release()`` (which waits on the
        client's event loop) without blocking the loop that delivers notices."""
        def in_thread(notice: EvictionNotice) -> None:
            threading.Thread(target=callback, args=(notice,), name=f"on-evict-{self.id}", daemon=True).start()
        self._inner.on_evict(in_thread)

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncLease", "Lease")

    def release(self) -> bool:
        return self._sync._run(self._inner.release())

    def attach(self, pids: Sequence[int] | None = None, pgid: int = 0) -> bool:
        """Record the processes this lease covers (default: this process)."""
        return self._sync._run(self._inner.attach(pids, pgid))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Client:
    """The sync API: ``with Client(addr, agent=..., host=...) as c: with c.acquire(4096) as lease: ...``.

    ``with`` is optional: the first call that needs a session opens it, and ``close()`` ends it."""

    def __init__(self, addresses: str | Sequence[str], agent: str, host: str, ttl: int | None = None,
                 **kw: Unpack[ClientOptions]) -> None:
        self._loop = _ClientLoop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"gpucoord-{agent}", daemon=True)
        self._thread.start()
        self._async: AsyncClient = self._run(self._make(addresses, agent, host, ttl, kw))

    async def _make(self, addresses: str | Sequence[str], agent: str, host: str, ttl: int | None,
                    kw: ClientOptions) -> AsyncClient:
        return AsyncClient(addresses, agent, host, ttl, **kw)

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        if self._loop.is_closed() or not self._thread.is_alive():
            if asyncio.iscoroutine(coro):
                coro.close()
            raise errors.Unavailable("the client is closed")
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except concurrent.futures.CancelledError:
            raise errors.Unavailable("the client was closed while the call was in flight") from None

    @property
    def session_id(self) -> str:
        return self._async.session_id

    @property
    def expired(self) -> bool:
        return self._async.expired

    def connect(self) -> Client:
        try:
            self._run(self._async.connect())
        except BaseException:
            self.close()   # do not leave the event-loop thread behind
            raise
        return self

    def acquire(self, vram_mb: int = 0, gpu: int | str | None = None, priority: int = 0, preemptible: bool = True,
                wait: float = 0.0, request_id: str | None = None, *, gpu_count: int = 1, exclusive: bool = False,
                topology: str = "any", gpus: Sequence[int | str] = (), min_runtime: float = 0.0,
                time_limit: float = 0.0, time_limit_warning: float = 0.0, hosts: int = 1, same: str = "",
                prefer: str = "") -> Lease:
        """See ``AsyncClient.acquire``: one GPU, or a gang (``gpu_count``, ``exclusive``, ``topology``,
        ``gpus``) as one lease over its GPUs (``lease.gpus``), on each of ``hosts`` hosts (``same``,
        ``prefer``: label keys; ``lease.hosts``, ``lease.part(rank)``)."""
        inner = self._run(self._async.acquire(vram_mb, gpu, priority, preemptible, wait, request_id,
                                              gpu_count=gpu_count, exclusive=exclusive, topology=topology, gpus=gpus,
                                              min_runtime=min_runtime, time_limit=time_limit,
                                              time_limit_warning=time_limit_warning, hosts=hosts, same=same,
                                              prefer=prefer))
        return Lease(self, inner)

    def release(self, lease_id: str) -> bool:
        return self._run(self._async.release(lease_id))

    def status(self, host: str | None = None) -> pb.GetStatusResponse:
        return self._run(self._async.status(host))

    def run(self, cmd: Sequence[str], vram_mb: int, **options: Unpack[RunOptions]) -> BoundProcess:
        """``with client.run(["python", "train.py"], vram_mb=4096) as proc: proc.wait()``: the command runs
        under a new VRAM lease of this session (see :mod:`agent_client.run`)."""
        return BoundProcess(self, self._async.run(cmd, vram_mb, **options))

    def partition(self) -> dict[str, object]:
        return self._run(self._async.partition())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._async.close(), timeout=15)
        finally:
            # Nothing may hang on a closed client: calls still in flight end with an error now.
            self._run(self._cancel_all(), timeout=15)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    async def _cancel_all(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def orphan(self) -> None:
        self._run(self._async.orphan())

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


class BoundProcess:
    """The sync face of :class:`AsyncBoundProcess`, from ``Client.run``:
    ``with client.run(["python", "train.py"], vram_mb=4096, wait=60) as proc: status = proc.wait()``."""

    def __init__(self, client: LoopRunner, inner: AsyncBoundProcess) -> None:
        self._client = client
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        # pid, pgid, lease, returncode, reason, message, notice, limits, cgroup, not_enforced, send_signal
        return getattr(self.inner, name)

    def start(self) -> BoundProcess:
        self._client._run(self.inner.start())
        return self

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; TimeoutError if it is still running after ``timeout`` seconds."""
        return self._client._run(self.inner.wait(), timeout)

    def stop(self) -> int:
        return self._client._run(self.inner.stop())

    def __enter__(self) -> BoundProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self._client._run(self.inner.__aexit__(*exc))
