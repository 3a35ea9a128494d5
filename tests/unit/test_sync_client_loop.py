"""A sync ``Client``'s private loop, once closed, drops what another thread hands it: gRPC delivers the
completion of a cancelled call (a closed client's keepalive stream) from whichever loop polls its completion
queue, and on a closed loop asyncio raised "Event loop is closed" inside that other loop (the bench's main loop
printed the traceback in CI)."""
from __future__ import annotations

import asyncio
import threading

from agent_client import Client


def test_a_completion_handed_to_a_closed_client_loop_is_dropped_without_an_error() -> None:
    client = Client("127.0.0.1:1", agent="a", host="h")     # lazy: nothing is dialled before a call
    loop = client._loop
    client.close()
    assert loop.is_closed()
    ran: list[int] = []
    errors: list[BaseException] = []

    def another_loop_hands_it_over() -> None:     # as gRPC's poller does, from another thread's loop
        async def main() -> None:
            try:
                handle = loop.call_soon_threadsafe(ran.append, 1)
                assert handle.cancelled()
            except BaseException as e:   # noqa: BLE001 - the test reports whatever the call raised
                errors.append(e)
        asyncio.run(main())

    t = threading.Thread(target=another_loop_hands_it_over)
    t.start()
    t.join(60)
    assert errors == [] and ran == []


def test_an_open_client_loop_still_runs_what_another_thread_hands_it() -> None:
    client = Client("127.0.0.1:1", agent="a", host="h")
    try:
        done = threading.Event()
        client._loop.call_soon_threadsafe(done.set)
        assert done.wait(60)
    finally:
        client.close()
