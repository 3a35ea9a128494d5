"""A bound command's life once it runs: the events that end it (its exit, an eviction notice, the lease
lost, a stop), the signals each one sends, the terminal handed back, and the release once its whole
process group is gone. ``AsyncBoundProcess`` (``agent_client.run``) starts the command; this is the part
that supervises it (see that module's docstring, points 5 to 7)."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import signal
import subprocess
import time
from typing import Awaitable, Callable, Protocol, Sequence

from agent_client import errors
from agent_client._aio import first_of, spawn
from agent_client.lease import AsyncLease, EvictionNotice
from agent_client.process import describe_exit, exit_status

log = logging.getLogger(__name__)

GROUP_EXIT_WAIT_S = 10.0
"""How long the release waits for the rest of the command's process group to exit after its SIGKILL."""

DEFAULT_STOP_GRACE_S = 10.0
"""``stop()`` (and leaving the ``with`` block early): SIGTERM, then SIGKILL after this long."""


class WatchedSession(Protocol):
    """What supervision reads of the client's session (``AsyncClient``)."""

    keepalive_interval: float
    done: asyncio.Event
    expired: bool

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool: ...


class Supervised:
    """The supervision of a started command: mixed into ``AsyncBoundProcess``, whose ``start`` sets the
    state below and then runs ``_supervise`` as its task."""

    client: WatchedSession
    cmd: list[str]
    lease: AsyncLease | None
    pid: int
    pgid: int
    cgroup: pathlib.Path | None
    kill_after: float | None
    check_interval: float | None
    notice: EvictionNotice | None
    killed_by: str
    returncode: int | None
    reason: str
    message: str
    _proc: subprocess.Popen[bytes] | None
    _tty: int
    _term_at: float | None
    _forwarded: list[int]
    _evicted: asyncio.Event
    _lost: asyncio.Event
    _say: Callable[[str], None]
    _lost_why: str
    _stop: asyncio.Event

    # -- the terminal ------------------------------------------------------------------------------
    def _take_terminal(self, foreground: bool, stdin_given: bool) -> None:
        """``foreground``: when stdin is our terminal and we are its foreground, the command becomes the
        foreground (so it may read the terminal, and Ctrl-C reaches it directly)."""
        if not foreground or stdin_given:
            return
        try:
            if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
                os.tcsetpgrp(0, self.pgid)
                self._tty = 0
        except OSError as e:
            log.debug("the terminal stays ours: %s", e)

    def _give_terminal_back(self) -> None:
        if self._tty < 0:
            return
        # We are a background process now: tcsetpgrp would stop us with SIGTTOU unless it is blocked.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
        try:
            os.tcsetpgrp(self._tty, os.getpgrp())
        except OSError as e:
            log.debug("could not take the terminal back: %s", e)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            self._tty = -1

    # -- events --------------------------------------------------------------------------------
    def _on_notice(self, notice: EvictionNotice) -> None:
        if notice.withdrawn:
            if self.notice is not None and not self.notice.revoke:
                self.notice = notice
                self._evicted.set()
            return
        if self.notice is None or self.notice.withdrawn or notice.supersedes(self.notice):
            self.notice = notice
            self._evicted.set()

    def _lose(self, why: str) -> None:
        if not self._lost.is_set():
            self._lost_why = why
            self._lost.set()

    def _kill(self, sig: int) -> None:
        """Signal the whole process group (what is left of it once the leader is gone)."""
        if self.pgid:
            try:
                os.killpg(self.pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    async def _wait_exit(self) -> int:
        proc = self._proc
        assert proc is not None
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            return await asyncio.to_thread(proc.wait)
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)
        loop.add_reader(fd, on_readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return proc.wait()

    async def _watch_lease(self) -> None:
        """The lease can end without a notice (an operator's revoke, the session's expiry): check it."""
        assert self.lease is not None
        interval = self.check_interval or self.client.keepalive_interval
        while True:
            try:
                await asyncio.wait_for(self.client.done.wait(), interval)
            except asyncio.TimeoutError:
                pass
            if self.client.done.is_set():
                self._lose("the session expired or was revoked: the coordinator no longer keeps it alive"
                           if self.client.expired else "the session was closed")
                return
            try:
                await self.client.attach_processes(self.lease.id, [self.pid], self.pgid)
            except errors.NotFound as e:
                self._lose(f"the lease is gone: {e.message}")
                return
            except errors.GpucoordError as e:
                log.info("lease %s: cannot check it now (%s); the session's TTL decides", self.lease.id, e)

    # -- supervision -----------------------------------------------------------------------------
    async def _supervise(self) -> int:
        assert self._proc is not None and self.lease is not None
        loop = asyncio.get_running_loop()
        exited = loop.create_task(self._wait_exit())      # awaited below; never cancelled here
        watcher = spawn(self._watch_lease(), f"lease check of {self.cmd[0]}")   # cancelled below; a failure is logged
        killer: asyncio.TimerHandle | None = None
        lost_handled = stop_handled = False
        try:
            while not exited.done():
                # The exit, or an event not handled yet; each event is handled once (an eviction again
                # when a notice that supersedes it sets the event again).
                waits: list[Awaitable[object]] = [asyncio.shield(exited), self._evicted.wait()]
                if not lost_handled:
                    waits.append(self._lost.wait())
                if not stop_handled:
                    waits.append(self._stop.wait())
                await first_of(*waits)
                if self._lost.is_set() and not lost_handled and not exited.done():
                    self._kill(signal.SIGKILL)
                    lost_handled = True
                if self._evicted.is_set() and not exited.done():
                    # Handled now; a notice that supersedes this one (a revoke, an earlier deadline) sets
                    # the event again.
                    self._evicted.clear()
                    assert self.notice is not None
                    if killer is not None:
                        killer.cancel()
                        killer = None
                    if self.notice.withdrawn:   # no SIGKILL: the lease stays; the SIGTERM was sent already
                        self._say(f"lease {self.lease.id}: notice withdrawn: its requester no longer needs it; "
                                  "no SIGKILL will follow")
                        self.notice = None
                        continue
                    killer = self._on_eviction(loop, self.notice)
                if self._stop.is_set() and not stop_handled and not exited.done():
                    stop_handled = True
                    self._kill(signal.SIGTERM)
                    grace = DEFAULT_STOP_GRACE_S if self.kill_after is None else self.kill_after
                    if killer is None:
                        killer = loop.call_later(grace, self._kill, signal.SIGKILL)
            returncode = exited.result()
        except asyncio.CancelledError:
            # The client is shutting down under us: its session (and so the lease) is going away.
            self._kill(signal.SIGKILL)
            self._give_terminal_back()
            raise
        finally:
            if killer is not None:
                killer.cancel()
            watcher.cancel()
        self._kill(signal.SIGKILL)   # leftovers of the group: the lease is about to go
        self._give_terminal_back()
        # The release tells the coordinator that the processes are gone (G3): only once the whole group is.
        await self._wait_group_gone(GROUP_EXIT_WAIT_S)
        self.returncode = exit_status(returncode)
        self.reason, self.message = self._outcome(returncode)
        await self._release_and_clean()
        return self.returncode

    def _outcome(self, returncode: int) -> tuple[str, str]:
        """Why the command ended, and one line that says what happened, by whom, and the exit status."""
        what = f"{self.cmd[0]} (pid {self.pid}) {describe_exit(returncode)}"
        lost = f"lease lost ({self._lost_why})" if self._lost.is_set() else ""
        n = self.notice
        if n is not None and n.revoke:
            how = "SIGKILL at once" if self.killed_by == "the revoke" else "it had ended already"
            return "revoked", f"revoked by {n.requested_by or 'an operator'}: {how}; {what}"
        if n is not None:
            how = f"SIGKILL at {self.killed_by}" if self.killed_by else "it ended after SIGTERM"
            late = f"; {lost} before it exited" if lost else ""
            return "evicted", (f"evicted by {n.requested_by or 'unknown'} ({n.reason or 'no reason given'}): "
                               f"SIGTERM at the notice, {how}{late}; {what}")
        if lost:
            return "lease lost", f"{lost}: SIGKILL at once; {what}"
        if self._stop.is_set():
            return "stopped", f"stopped: {what}"
        if self._forwarded:
            sigs = ", ".join(signal.Signals(x).name for x in self._forwarded)
            return "interrupted", f"interrupted: {sigs} forwarded to the command; {what}"
        return "exited", what

    def _on_eviction(self, loop: asyncio.AbstractEventLoop, n: EvictionNotice) -> asyncio.TimerHandle | None:
        """SIGTERM now and SIGKILL at the notice's deadline (or ``kill_after`` after the SIGTERM), or, for an
        operator's revoke, SIGKILL now. Returns the SIGKILL's timer."""
        if n.revoke:
            self._kill_after_notice("the revoke")
            return None
        if self._term_at is None:
            self._term_at = time.monotonic()
            self._kill(signal.SIGTERM)
        delay, by = n.seconds_left, "the eviction deadline"
        if self.kill_after is not None:
            after = self._term_at + self.kill_after - time.monotonic()
            if after < delay:
                delay, by = after, "--kill-after"
        return loop.call_later(max(0.0, delay), self._kill_after_notice, by)

    async def _wait_group_gone(self, timeout: float) -> None:
        """Wait (polling, at most ``timeout``) until no process of the command's group is left."""
        until = time.monotonic() + timeout
        delay = 0.005
        while self.pgid:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass    # a member we may not signal (it changed its uid): still there
            if time.monotonic() >= until:
                log.warning("process group %d of %s is still there %.0f s after SIGKILL; releasing the lease "
                            "anyway", self.pgid, self.cmd[0], timeout)
                return
            await asyncio.sleep(delay)
            delay = min(0.05, delay * 2)

    def _kill_after_notice(self, by: str) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.killed_by = by
        self._kill(signal.SIGKILL)

    async def _release_and_clean(self) -> None:
        if self.lease is not None and not self._lost.is_set() and not self.client.done.is_set():
            try:
                await self.lease.release()
            except errors.GpucoordError as e:
                log.warning("could not release lease %s: %s (it goes with the session)", self.lease.id, e)
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError as e:
                log.debug("cgroup %s left in place: %s", self.cgroup, e)


__all__ = ["DEFAULT_STOP_GRACE_S", "GROUP_EXIT_WAIT_S", "Supervised", "WatchedSession"]
