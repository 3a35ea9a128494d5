"""The scripted scene of ``gpucoord up --demo``, played by real agent processes.

1. Agents acquire VRAM on GPU 0 until it is full.
2. One more agent is refused (RESOURCE_EXHAUSTED).
3. One holder is killed with SIGKILL; etcd expires its session after the TTL and its VRAM comes back.
4. The refused agent tries again and is granted.
The status table is printed after each step.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import IO

from coordinator.security.tls import TlsFiles

AGENT_TTL = 3


class AgentProcess:
    """``python -m coordinator.cli.demo agent ...``: acquires once, reports on stdout, holds until told to go."""

    def __init__(self, addr: str, host: str, agent: str, vram_mb: int, log: IO[bytes],
                 tls: TlsFiles | None = None) -> None:
        self.agent = agent
        # With TLS, the agent's own certificate reaches it the way it reaches any agent: GPUCOORD_TLS_*.
        env = {**os.environ, **tls.env()} if tls is not None else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli.demo", "agent", "--coordinator", addr, "--host", host,
             "--agent", agent, "--vram-mb", str(vram_mb), "--ttl", str(AGENT_TTL)],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=log, env=env)

    def outcome(self, timeout: float = 30) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if not line:
            raise RuntimeError(f"agent {self.agent} exited with {self.proc.wait(timeout)} before answering")
        return line

    def finish(self) -> None:
        """Ask the agent to release and close its session (by closing its stdin), then reap it."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


DEMO_AGENTS = ("agent-a", "agent-b", "agent-c", "agent-d")


def run_demo(addr: str, host: str, data_dir: pathlib.Path, tls: TlsFiles | None = None,
             agent_tls: dict[str, TlsFiles] | None = None) -> None:
    """The scene; with ``tls`` (the operator's certificate, for the status tables) and ``agent_tls`` (one
    certificate per agent) it plays over mTLS."""
    from coordinator.cli.common import fetch_status
    from coordinator.cli.render import render_status

    def _status(addr: str, host: str, title: str) -> None:
        print(f"\n=== {title}")
        print(render_status(fetch_status(addr, host, tls)), flush=True)

    def _gpu0(addr: str, host: str) -> tuple[int, int]:
        g = fetch_status(addr, host, tls)["hosts"][0]["gpus"][0]
        return int(g["usable_mb"]), int(g["free_mb"])

    def spawn(agent: str, vram_mb: int) -> AgentProcess:
        return AgentProcess(addr, host, agent, vram_mb, log, (agent_tls or {}).get(agent))

    log = open(data_dir / "demo-agents.log", "ab")
    usable, free = _gpu0(addr, host)
    share = max(1, usable // 3)
    print(f"\n--- demo: GPU 0 has {usable} MiB usable; three agents take {share} MiB each, a fourth asks too",
          flush=True)
    agents: list[AgentProcess] = []
    try:
        for name in ("agent-a", "agent-b", "agent-c"):
            a = spawn(name, share)
            agents.append(a)
            print(f"{name}: {a.outcome()}", flush=True)
        _status(addr, host, "GPU 0 is full")
        d = spawn("agent-d", share)
        agents.append(d)
        print(f"agent-d: {d.outcome()}", flush=True)
        victim = agents[0]
        print(f"\n--- demo: kill -9 {victim.agent} (pid {victim.proc.pid}); its session TTL is {AGENT_TTL}s",
              flush=True)
        t0 = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        deadline = t0 + AGENT_TTL + 5
        while _gpu0(addr, host)[1] < share:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{victim.agent}'s VRAM did not come back within TTL + 5 s")
            time.sleep(0.1)
        print(f"{victim.agent}'s VRAM came back {time.monotonic() - t0:.1f}s after the kill "
              f"(TTL {AGENT_TTL}s), released by etcd itself", flush=True)
        _status(addr, host, f"after {victim.agent} died")
        retry = spawn("agent-d", share)
        agents.append(retry)
        print(f"agent-d (again): {retry.outcome()}", flush=True)
        _status(addr, host, "agent-d holds the freed VRAM")
    finally:
        for a in agents:
            a.finish()
        log.close()
    _status(addr, host, "every agent released and closed its session")


def agent_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="coordinator.cli.demo agent")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--vram-mb", type=int, required=True)
    p.add_argument("--ttl", type=int, default=AGENT_TTL)
    p.add_argument("--gpu", default="0")
    p.add_argument("--wait", type=float, default=0.0)
    p.add_argument("--priority", type=int, default=0)
    args = p.parse_args(argv)
    from agent_client import Client, errors
    with Client(args.coordinator, agent=args.agent, host=args.host, ttl=args.ttl) as c:
        try:
            lease = c.acquire(args.vram_mb, gpu=args.gpu, wait=args.wait, priority=args.priority)
        except errors.ResourceExhausted as e:
            print(f"REFUSED (RESOURCE_EXHAUSTED): {e.message}", flush=True)
            return 0
        print(f"GRANTED lease {lease.id} on GPU {lease.gpu_index}, {lease.vram_mb} MiB, token {lease.token}",
              flush=True)
        with lease:
            sys.stdin.read()  # hold until the parent closes our stdin (or kills us)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        sys.exit(agent_main(sys.argv[2:]))
    sys.exit("usage: python -m coordinator.cli.demo agent ...")
