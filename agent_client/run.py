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
from typing import (
    IO,
    Awaitable,
    Callable,
    Mapping,
    Protocol,
    Sequence,
    TypedDict,
    TypeVar,
)

from agent_client._aio import spawn
from agent_client.lease import AsyncLease
from agent_client.process import (
    LimitPlan,
    child_env,
    core_ranges,
    exit_status,
    plan_limits,
    prepare_cgroup,
)
from agent_client.supervise import DEFAULT_STOP_GRACE_S, GROUP_EXIT_WAIT_S, Supervised

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
                      gpus: Sequence[int | str] = (), min_runtime: float = 0.0, time_limit: float = 0.0,
                      time_limit_warning: float = 0.0) -> AsyncLease: ...

    async def partition(self) -> dict[str, object]: ...

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool: ...


class LoopRunner(Protocol):
    """The sync ``Client``: runs a coroutine on its event loop and waits for it."""

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T: ...


# A command's standard stream, as subprocess.Popen takes it: a file descriptor, a file, or None.
Stdio = int | IO[bytes] | IO[str] | None


class CommandOptions(TypedDict, total=False):
    """The options of ``gpucoord run``'s command (``agent_client.command``; see ``AsyncBoundProcess``)."""

    gpu: int | str | None
    priority: int
    preemptible: bool
    wait: float
    request_id: str | None
    gpu_count: int
    exclusive: bool
    topology: str
    min_runtime: float
    time_limit: float
    time_limit_warning: float
    kill_after: float | None
    cgroup_root: str | None
    env: Mapping[str, str] | None
    cwd: str | None
    stdin: Stdio
    stdout: Stdio
    stderr: Stdio
    check_interval: float | None


class RunOptions(CommandOptions, total=False):
    """The options of ``client.run`` (see ``AsyncBoundProcess``)."""

    say: Callable[[str], None] | None
    foreground: bool


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


class AsyncBoundProcess(Supervised):
    """A command bound to a VRAM lease of ``client``'s session. ``async with client.run(cmd, vram_mb=...)
    as proc: await proc.wait()``; see the module's docstring for what binds it.

    Options: ``gpu``, ``priority``, ``preemptible``, ``wait``, ``request_id``, ``gpu_count``, ``exclusive``,
    ``topology``, ``min_runtime``, ``time_limit``, ``time_limit_warning`` (as ``acquire``; a gang's GPUs all go
    into ``CUDA_VISIBLE_DEVICES``; the time limit's notice is an eviction notice like any other: SIGTERM, then
    SIGKILL at its deadline, the lease's end);
    ``kill_after`` (seconds from SIGTERM to SIGKILL on eviction, never past the deadline; and on
    ``stop()``); ``cgroup_root``; ``env`` (default: this process's), ``cwd``, ``stdin``, ``stdout``,
    ``stderr`` (as ``subprocess.Popen``); ``check_interval`` (how often the lease's existence is
    checked; default the session's keepalive interval); ``say`` (where the one-line notes go; default
    the log).
    """

    client: SessionClient

    def __init__(self, client: SessionClient, cmd: Sequence[str], vram_mb: int, *, gpu: int | str | None = None,
                 priority: int = 0, preemptible: bool = True, wait: float = 0.0, request_id: str | None = None,
                 kill_after: float | None = None, cgroup_root: str | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 stdin: Stdio = None, stdout: Stdio = None, stderr: Stdio = None, check_interval: float | None = None,
                 say: Callable[[str], None] | None = None, foreground: bool = False,
                 gpu_count: int = 1, exclusive: bool = False, topology: str = "any",
                 min_runtime: float = 0.0, time_limit: float = 0.0, time_limit_warning: float = 0.0) -> None:
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError("cmd: a non-empty list of strings is needed")
        if kill_after is not None and not 0 <= kill_after <= 3600:
            raise ValueError("kill_after: must be within [0, 3600] seconds")
        self.client, self.cmd, self.vram_mb = client, list(cmd), vram_mb
        self._acquire = dict(gpu=gpu, priority=priority, preemptible=preemptible, wait=wait, request_id=request_id,
                             gpu_count=gpu_count, exclusive=exclusive, topology=topology, min_runtime=min_runtime,
                             time_limit=time_limit, time_limit_warning=time_limit_warning)
        self.kill_after, self.cgroup_root = kill_after, cgroup_root
        self._env = dict(os.environ if env is None else env)
        self._popen = dict(cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
        self.check_interval = check_interval
        self.foreground = foreground
        self._tty = -1   # the terminal whose foreground process group we handed to the command
        self._say = say or (lambda msg: log.warning("%s", msg))
        self.lease: AsyncLease | None = None   # once acquired
        self.pid = 0
        self.pgid = 0
        self.limits: LimitPlan | None = None
        self.cgroup: pathlib.Path | None = None
        self.not_enforced: list[str] = []
        self.returncode: int | None = None   # shell style: 128+N for signal N
        self.reason = ""                     # exited | evicted | lease lost | stopped
        self.message = ""
        self.notice = None   # the EvictionNotice, once one came (the latest, if one superseded it)
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
        lease = await self._lease()
        self.lease = lease
        go = -1
        try:
            lease.on_evict(self._on_notice)
            lease.on_withdrawn(self._on_notice)
            mine = (await self.client.partition()).get("mine")
            self.limits = plan_limits(mine if isinstance(mine, Mapping) else None, os.sched_getaffinity(0))
            name = f"gpucoord-{self.client.agent}-{lease.id}"
            self.cgroup, cg_notes = prepare_cgroup(self.cgroup_root, name, self.limits.mem_bytes, self.limits.cpu_max)
            self.not_enforced = [*self.limits.notes, *cg_notes]
            read_end, go = os.pipe()
            try:
                self._proc = subprocess.Popen(  # noqa: ASYNC220 - Popen returns once the child is forked; run waits on it asynchronously
                    [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(read_end), *self.cmd],
                    pass_fds=(read_end,), process_group=0, env=self._child_env(lease),
                    **self._popen)  # type: ignore[call-overload]
            finally:
                os.close(read_end)
            assert self._proc is not None
            self.pid = self.pgid = self._proc.pid
            self._apply_limits()
            self._take_terminal(self.foreground, self._popen.get("stdin") is not None)
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
        # Held until it ends even if the caller drops this object: the command must stay supervised.
        self._task = spawn(self._supervise(), f"supervision of {self.cmd[0]} (pid {self.pid})")
        return self

    async def _lease(self) -> AsyncLease:
        """The lease the command runs under: a new one of the client's session (``agent_client.join``: one
        that another session holds)."""
        return await self.client.acquire(self.vram_mb, **self._acquire)  # type: ignore[arg-type]

    def _child_env(self, lease: AsyncLease) -> dict[str, str]:
        return child_env(self._env, lease)

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

    def send_signal(self, sig: int) -> None:
        """Forward a signal to the command's process group (``gpucoord run`` does this for SIGINT, SIGTERM
        and SIGHUP)."""
        if self.started and not self.finished:
            if sig not in self._forwarded:
                self._forwarded.append(sig)
            self._kill(sig)

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

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None and not self._task.done():
            await self.stop()
        elif self._task is not None:
            await self._task


__all__ = ["DEFAULT_STOP_GRACE_S", "GROUP_EXIT_WAIT_S", "AsyncBoundProcess", "CommandOptions", "LimitPlan",
           "LoopRunner", "RunOptions", "SessionClient", "child_env", "exit_status", "plan_limits", "prepare_cgroup"]
