"""etcd's RBAC with password users (``gpucoord etcd-setup --password-dir``), on an etcd of this module's own
(auth is cluster-wide, so not the shared one): each party is confined to its keys, the token is fetched
again after etcd forgets it, and a node daemon process registers with a password it never echoes."""
from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
from typing import Any, Awaitable, Iterator, TypeVar

import pytest

from coordinator import errors
from coordinator.etcd.auth import setup_roles
from coordinator.etcd.process import EtcdCluster, etcd_binary
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.security.etcd_auth import EtcdSecurity
from tests.support import REPO
from tests.support.processes import child_env

pytestmark = pytest.mark.integration
T = TypeVar("T")
PREFIX = "/gpucoord/"
OLD_OPERATOR_PASSWORD = "an-earlier-release"
KEYS = Keys(PREFIX)


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdCluster, pathlib.Path]]:
    base = tmp_path_factory.mktemp("etcd-auth")
    cluster = EtcdCluster(1, base_dir=base / "etcd").start()
    try:
        passwords = base / "passwords"
        # An install set up by an earlier release had an operator user: etcd-setup deletes it (and its role).
        for argv in (["user", "add", f"gpucoord-operator:{OLD_OPERATOR_PASSWORD}"], ["role", "add", "gpucoord-operator"],
                     ["role", "grant-permission", "gpucoord-operator", "readwrite", "--prefix", PREFIX],
                     ["user", "grant-role", "gpucoord-operator", "gpucoord-operator"]):
            old = subprocess.run([etcd_binary("etcdctl"), f"--endpoints={cluster.endpoints[0]}", *argv],
                                 capture_output=True, text=True, timeout=30)
            assert old.returncode == 0, (argv, old.stderr)
        files = run(setup_roles(cluster.endpoints[0], EtcdSecurity(), PREFIX, ["h1"], password_dir=str(passwords)))
        assert set(files) == {"root", "gpucoord-coordinator", "gpucoord-node-h1"}
        yield cluster, passwords
    finally:
        cluster.stop()


def creds(passwords: pathlib.Path, user: str) -> EtcdSecurity:
    return EtcdSecurity(user=user, password=(passwords / f"{user}.password").read_text().strip())


async def attempt(endpoint: str, security: EtcdSecurity, op: str, key: bytes) -> str:
    store = Store([endpoint], timeout=3, retry_for=0.5, security=security)
    try:
        await store.connect()
        if op == "put":
            await store.put(key, b"{}")
        else:
            await store.get_prefix(key)
        return "ok"
    except errors.GpucoordError as e:
        denied = ("permission denied", "user name", "authentication failed")
        return "denied" if any(d in e.message for d in denied) else f"error: {e.message}"
    finally:
        await store.close()


def test_each_etcd_user_is_confined_to_its_keys(secured: tuple[EtcdCluster, pathlib.Path]) -> None:
    cluster, passwords = secured
    ep = cluster.endpoints[0]
    node, coordinator = (creds(passwords, u) for u in ("gpucoord-node-h1", "gpucoord-coordinator"))
    operator = EtcdSecurity(user="gpucoord-operator", password=OLD_OPERATOR_PASSWORD)   # deleted by etcd-setup
    cases: list[tuple[EtcdSecurity, str, bytes, str]] = [
        (node, "put", KEYS.host("h1"), "ok"),
        (node, "put", KEYS.usage("h1"), "ok"),
        (node, "get", KEYS.leases("h1"), "ok"),
        (node, "put", KEYS.lease("h1", "GPU-0", "forged"), "denied"),
        (node, "put", KEYS.host("h2"), "denied"),
        (node, "get", KEYS.root(), "denied"),
        (coordinator, "put", KEYS.lease("h1", "GPU-0", "real"), "ok"),
        (coordinator, "get", KEYS.root(), "ok"),
        (coordinator, "put", b"/elsewhere/x", "denied"),
        (operator, "get", KEYS.root(), "denied"),   # operators act through a coordinator: no etcd user
        (operator, "put", KEYS.revoked("abc"), "denied"),
        (EtcdSecurity(), "get", KEYS.root(), "denied"),
    ]
    outcomes = [run(attempt(ep, sec, op, key)) for sec, op, key, _ in cases]
    assert outcomes == [want for *_, want in cases], list(zip([c[1:3] for c in cases], outcomes))


def test_the_token_is_fetched_again_after_etcd_restarts(secured: tuple[EtcdCluster, pathlib.Path]) -> None:
    cluster, passwords = secured

    async def scenario() -> None:
        store = Store(cluster.endpoints, timeout=3, retry_for=15, security=creds(passwords, "gpucoord-coordinator"))
        await store.connect()
        try:
            await store.put(KEYS.host("restart"), b"1")
            member = cluster.members[0]
            await asyncio.to_thread(member.stop)
            await asyncio.to_thread(cluster.start)   # same data dir: etcd forgets its simple tokens
            kv = await store.get(KEYS.host("restart"))   # retried through the restart, with a fresh token
            assert kv is not None and kv.value == b"1"
            await store.put(KEYS.host("restart"), b"2")
        finally:
            await store.close()
    run(scenario())


def test_node_process_with_a_password_registers_and_never_echoes_it(
        secured: tuple[EtcdCluster, pathlib.Path]) -> None:
    cluster, passwords = secured
    pw_file = passwords / "gpucoord-node-h1.password"
    secret = pw_file.read_text().strip()
    env = {**child_env(), "GPUCOORD_ETCD_PASSWORD": secret}

    async def clear() -> None:   # the confinement test wrote hosts/h1 by hand: a daemon would take it as taken
        async with Store(cluster.endpoints, security=creds(passwords, "gpucoord-coordinator")) as store:
            await store.delete(KEYS.host("h1"))
    run(clear())
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "-v", "node", "--etcd", cluster.endpoints[0], "--host", "h1",
         "--etcd-user", "gpucoord-node-h1", "--fake-gpus", "1x16GiB", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("READY node"), (line, proc.stderr.read().decode()[-3000:] if proc.stderr else "")
        async def registered() -> Any:
            async with Store(cluster.endpoints, security=creds(passwords, "gpucoord-coordinator")) as store:
                return await store.get(KEYS.host("h1"))
        assert run(registered()) is not None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert secret not in err.decode()

