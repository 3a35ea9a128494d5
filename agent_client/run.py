"""Binding leases: a command that runs under a VRAM lease and stops when the lease ends.

``gpucoord run`` and ``client.run(...)`` both use :class:`AsyncBoundProcess`. It

1. acquires a VRAM lease on the client's session (queueing up to ``wait`` seconds);
2. starts the command in its own process group, held before ``exec`` until the lease records the
   group (``AttachProcesses``), so the node daemon can attribute the GPU's processes before the
   command has touched the GPU, and the command never runs without a lease;
3. gives it ``CUDA_VISIBLE_DEVICES=<GPU uuid>`` (a uuid, so numbering cannot drift),
   ``GPUCOORD_LEASE_ID``, ``GPUCOORD_TOKEN``, ``GPUCOORD_GPU_UUID``, ``GPUCOORD_VRAM_MB`` and
   ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<N>M`` (device 0 is the only one the command sees, so an
   MPS-enabled host caps its VRAM in the driver);
4. applies the agent's partition where the host allows it: CPU affinity to the partition's cores, and
   ``memory.max`` / ``cpu.max`` in a cgroup v2 directory under ``cgroup_root`` when one is given and
   writable. What cannot be enforced is said once, with the reason (``not_enforced``);
5. on an eviction notice sends SIGTERM to the group at once and SIGKILL at the notice's deadline, as
   this machine measures it (the grace the coordinator had left when it sent the notice, added to our
   clock when it came), or ``kill_after`` seconds after the SIGTERM if that comes first. The leader
   revokes the lease only a kill margin (``eviction_kill_margin_s``, 2 s) after the deadline, unless the
   node reports none of its processes first; the margin absorbs the notice's transit and the process's
   exit, and the evicting request is granted only once the processes are gone (G3);
6. on an operator's revoke (a notice marked ``revoke``) sends SIGKILL at once; on losing the lease (the
   session expired or closed) sends SIGKILL at once: a process without a lease must not hold the GPU;
7. when the command exits, kills what is left of its process group, releases the lease (only now, once
   the group has exited: the release is what tells the coordinator the processes are gone) and reports
   why it ended (``reason``: exited, evicted, revoked, lease lost, stopped, interrupted; ``message``: one
   readable line saying what happened, by whom, and the exit status).

The session stays the client's: ``gpucoord run`` opens one for the command and closes it afterwards.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import IO, Any, Awaitable, Callable, Mapping, Protocol, Sequence, TypeVar

from agent_client import errors
from agent_client.process import (
    LimitPlan,
    child_env,
    core_ranges,
    describe_exit,
    exit_status,
    plan_limits,
    prepare_cgroup,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class SessionClient(Protocol):
    """What a bound process needs of its client (``AsyncClient`` is one; this module does not import it,
    so that the client can import this module)."""

    agent: str
    keepalive_interval: float
    done: asyncio.Event
    expired: bool

    async def acquire(self, vram_mb: int = 0, gpu: int | str | None = None, priority: int = 0,
                      preemptible: bool = True, wait: float = 0.0, request_id: str | None = None, *,
                      gpu_count: int = 1, exclusive: bool = False, topology: str = "any",
                      gpus: Sequence[int | str] = ()) -> Any: ...

    async def partition(self) -> dict[str, Any]: ...

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool: ...


class LoopRunner(Protocol):
    """The sync ``Client``: runs a coroutine on its event loop and waits for it."""

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T: ...

GROUP_EXIT_WAIT_S = 10.0
"""How long the release waits for the rest of the command's process group to exit after its SIGKILL."""

DEFAULT_STOP_GRACE_S = 10.0
"""``stop()`` (and leaving the ``with`` block early): SIGTERM, then SIGKILL after this long."""


# Runs between fork and the command's exec: waits for the supervisor's go (the lease has recorded the
# process group by then), then execs. EOF instead of a go (the supervisor died) means: never run.
_TRAMPOLINE = (
    "import os,sys\n"
    "r=int(sys.argv[1])\n"
    "go=os.read(r,1)\n"
    "os.close(r)\n"
    "if go!=b'g':os._exit(125)\n"
    "try:os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:\n"
    " sys.stderr.write('gpucoord run: cannot run %r: %s\\n'%(sys.argv[2],e.strerror))\n"
    " os._exit(127 if e.errno==2 else 126)\n"
)


class AsyncBoundProcess:
    """A command bound to a VRAM lease of ``client``'s session. ``async with client.run(cmd, vram_mb=...)
    as proc: await proc.wait()``; see the module's docstring for what binds it.

    Options: ``gpu``, ``priority``, ``preemptible``, ``wait``, ``request_id``, ``gpu_count``, ``exclusive``,
    ``topology`` (as ``acquire``; a gang's GPUs all go into ``CUDA_VISIBLE_DEVICES``);
    ``kill_after`` (seconds from SIGTERM to SIGKILL on eviction, never past the deadline; and on
    ``stop()``); ``cgroup_root``; ``env`` (default: this process's), ``cwd``, ``stdin``, ``stdout``,
    ``stderr`` (as ``subprocess.Popen``); ``check_interval`` (how often the lease's existence is
    checked; default the session's keepalive interval); ``say`` (where the one-line notes go; default
    the log).
    """

    def __init__(self, client: SessionClient, cmd: Sequence[str], vram_mb: int, *, gpu: int | str | None = None,
                 priority: int = 0, preemptible: bool = True, wait: float = 0.0, request_id: str | None = None,
                 kill_after: float | None = None, cgroup_root: str | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 stdin: int | IO[Any] | None = None, stdout: int | IO[Any] | None = None,
                 stderr: int | IO[Any] | None = None, check_interval: float | None = None,
                 say: Callable[[str], None] | None = None, foreground: bool = False, gpu_count: int = 1,
                 exclusive: bool = False, topology: str = "any") -> None:
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError("cmd: a non-empty list of strings is needed")
        if kill_after is not None and not 0 <= kill_after <= 3600:
            raise ValueError("kill_after: must be within [0, 3600] seconds")
        self.client, self.cmd, self.vram_mb = client, list(cmd), vram_mb
        self._acquire = dict(gpu=gpu, priority=priority, preemptible=preemptible, wait=wait, request_id=request_id,
                             gpu_count=gpu_count, exclusive=exclusive, topology=topology)
        self.kill_after, self.cgroup_root = kill_after, cgroup_root
        self._env = dict(os.environ if env is None else env)
        self._popen = dict(cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
        self.check_interval = check_interval
        self.foreground = foreground
        self._tty = -1   # the terminal whose foreground process group we handed to the command
        self._say = say or (lambda msg: log.warning("%s", msg))
        self.lease: Any = None   # the AsyncLease, once acquired
        self.pid = 0
        self.pgid = 0
        self.limits: LimitPlan | None = None
        self.cgroup: pathlib.Path | None = None
        self.not_enforced: list[str] = []
        self.returncode: int | None = None   # shell style: 128+N for signal N
        self.reason = ""                     # exited | evicted | lease lost | stopped
        self.message = ""
        self.notice: Any = None   # the EvictionNotice, once one came (the latest, if one superseded it)
        self.killed_by = ""                  # "the deadline", "--kill-after" or "the revoke", when SIGKILL ended it
        self._term_at: float | None = None   # when the eviction's SIGTERM went (monotonic)
        self._forwarded: list[int] = []      # signals forwarded to the command (send_signal)
        self._proc: subprocess.Popen[bytes] | None = None
        self._task: asyncio.Task[int] | None = None
        self._evicted = asyncio.Event()
        self._lost = asyncio.Event()
        self._lost_why = ""
        self._stop = asyncio.Event()

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def finished(self) -> bool:
        return self.returncode is not None

    # -- start ---------------------------------------------------------------------------------
    async def start(self) -> AsyncBoundProcess:
        if self._task is not None:
            return self
        if shutil.which(self.cmd[0], path=self._env.get("PATH", os.defpath)) is None:
            raise FileNotFoundError(errno.ENOENT, f"command not found or not executable: {self.cmd[0]!r}")
        lease = await self.client.acquire(self.vram_mb, **self._acquire)  # type: ignore[arg-type]
        self.lease = lease
        go = -1
        try:
            lease.on_evict(self._on_notice)
            mine = (await self.client.partition()).get("mine")
            self.limits = plan_limits(mine, os.sched_getaffinity(0))
            name = f"gpucoord-{self.client.agent}-{lease.id}"
            self.cgroup, cg_notes = prepare_cgroup(self.cgroup_root, name, self.limits.mem_bytes, self.limits.cpu_max)
            self.not_enforced = [*self.limits.notes, *cg_notes]
            read_end, go = os.pipe()
            try:
                self._proc = subprocess.Popen(  # noqa: ASYNC220 - Popen returns once the child is forked; run waits on it asynchronously
                    [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(read_end), *self.cmd],
                    pass_fds=(read_end,), process_group=0, env=child_env(self._env, lease),
                    **self._popen)  # type: ignore[call-overload]
            finally:
                os.close(read_end)
            assert self._proc is not None
            self.pid = self.pgid = self._proc.pid
            self._apply_limits()
            self._take_terminal()
            for note in self.not_enforced:
                self._say(f"not enforced: {note}")
            # The lease names the group before the command runs: the node never sees it unattributed.
            await self.client.attach_processes(lease.id, [self.pid], self.pgid)
            os.write(go, b"g")
        except BaseException:
            if self._proc is not None:
                self._kill(signal.SIGKILL)
                await asyncio.to_thread(self._proc.wait)
            self._give_terminal_back()
            await self._release_and_clean()
            raise
        finally:
            if go >= 0:
                os.close(go)
        where = (f"GPUs {','.join(str(g.index) for g in lease.gpus)}" if len(lease.gpus) > 1
                 else f"GPU {lease.gpu_index} ({lease.gpu_uuid})")
        self._say(f"lease {lease.id}: {where}, {lease.vram_mb} MiB{' each' if len(lease.gpus) > 1 else ''}, "
                  f"token {lease.token}; started {self.cmd[0]} as pid {self.pid}")
        self._task = asyncio.get_running_loop().create_task(self._supervise())
        return self

    def _apply_limits(self) -> None:
        assert self.limits is not None
        if self.limits.cores:
            try:
                os.sched_setaffinity(self.pid, self.limits.cores)
            except OSError as e:
                self.not_enforced.append(f"CPU affinity (cores {core_ranges(self.limits.cores)}) is not enforced: "
                                         f"sched_setaffinity failed ({e.strerror or e})")
        if self.cgroup is not None:
            try:
                (self.cgroup / "cgroup.procs").write_text(str(self.pid))
            except OSError as e:
                self.not_enforced.append(f"the cgroup limits in {self.cgroup} are not enforced: cannot move the "
                                         f"process into it ({e.strerror or e})")

    def _take_terminal(self) -> None:
        """``foreground``: when stdin is our terminal and we are its foreground, the command becomes the
        foreground (so it may read the terminal, and Ctrl-C reaches it directly)."""
        if not self.foreground or self._popen.get("stdin") is not None:
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
    def _on_notice(self, notice: Any) -> None:
        if self.notice is None or notice.supersedes(self.notice):
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

    def send_signal(self, sig: int) -> None:
        """Forward a signal to the command's process group (``gpucoord run`` does this for SIGINT, SIGTERM
        and SIGHUP)."""
        if self.started and not self.finished:
            if sig not in self._forwarded:
                self._forwarded.append(sig)
            self._kill(sig)

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

    async def _supervise(self) -> int:
        assert self._proc is not None and self.lease is not None
        loop = asyncio.get_running_loop()
        exited = loop.create_task(self._wait_exit())
        watcher = loop.create_task(self._watch_lease())
        waits: dict[str, asyncio.Future[Any]] = {
            n: loop.create_task(e.wait()) for n, e in (("evicted", self._evicted), ("lost", self._lost),
                                                       ("stop", self._stop))}
        killer: asyncio.TimerHandle | None = None
        try:
            while not exited.done():
                await asyncio.wait({exited, *waits.values()}, return_when=asyncio.FIRST_COMPLETED)
                if waits["lost"].done() and not exited.done():
                    self._kill(signal.SIGKILL)
                    waits["lost"] = loop.create_future()   # handled
                if waits["evicted"].done() and not exited.done():
                    # Handled now; a notice that supersedes this one (a revoke, an earlier deadline) sets
                    # the event again.
                    self._evicted.clear()
                    waits["evicted"] = loop.create_task(self._evicted.wait())
                    assert self.notice is not None
                    if killer is not None:
                        killer.cancel()
                        killer = None
                    killer = self._on_eviction(loop)
                if waits["stop"].done() and not exited.done():
                    waits["stop"] = loop.create_future()
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
            for t in (watcher, *waits.values()):
                t.cancel()
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

    def _on_eviction(self, loop: asyncio.AbstractEventLoop) -> asyncio.TimerHandle | None:
        """SIGTERM now and SIGKILL at the notice's deadline (or ``kill_after`` after the SIGTERM), or, for an
        operator's revoke, SIGKILL now. Returns the SIGKILL's timer."""
        n = self.notice
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

    # -- waiting and stopping ------------------------------------------------------------------
    async def wait(self) -> int:
        """The command's exit status (128+N for signal N), once it has exited and the lease is released."""
        if self._task is None:
            raise RuntimeError("the process was not started")
        return await asyncio.shield(self._task)

    async def stop(self) -> int:
        """SIGTERM now, SIGKILL after ``kill_after`` (default 10 s); then release. Returns the status."""
        if self._task is None:
            raise RuntimeError("the process was not started")
        self._stop.set()
        return await self.wait()

    async def __aenter__(self) -> AsyncBoundProcess:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None and not self._task.done():
            await self.stop()
        elif self._task is not None:
            await self._task


__all__ = ["AsyncBoundProcess", "LimitPlan", "LoopRunner", "SessionClient", "child_env", "exit_status",
           "plan_limits", "prepare_cgroup"]
