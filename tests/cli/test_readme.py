"""The README and the docs/ pages run as written. Every fenced block in README.md and docs/*.md carries a
marker, ``<!-- test: KIND [ARG] -->``, and is run here by its kind against one ``gpucoord up`` started from
the README's own command. The order is ``tests.support.docs.DOCS``: README.md's blocks first, then each
page's, in the order their text had when it was all one README (a block may use what an earlier one made);
every docs/*.md must be in that list, so that none is skipped. The ``up`` runs on free ports: the README's
default addresses are rewritten to them, and GPUCOORD_COORDINATOR and GPUCOORD_ETCD point the CLI's
defaults there. The kinds:

- ``up``: the command the module fixture starts; ``background``: a command started and kept running;
- ``python``: run as a script; ``sh``: run with bash -e -o pipefail; ``file NAME``: written to the working
  directory; ``output``: ``$ command`` lines whose combined stdout and stderr must be exactly the lines after;
- ``synopsis``: every subcommand and ``--flag`` named exists in that command's --help (gpucoord's or etcd's);
- ``demo``: the first README command, ``gpucoord up --demo``, run to its end; ``ci``: the second README command
  is .ci/run's main line; ``diagram``: a picture, nothing to run; ``measured``: a recorded run of
  ``gpucoord bench all`` (machine-dependent, so not rerun here): it must name every target P1-P8.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from coordinator.etcd.process import etcd_binary, free_port
from tests.support import REPO
from tests.support.docs import DOCS, ROOT, on_disk
from tests.support.noise import assert_no_asyncio_noise
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

MARKER = re.compile(r"^(?P<indent> *)<!-- test: (?P<kind>[a-z]+)(?: (?P<arg>[^ ]+))? -->\n(?P=indent)```(?P<lang>\w*)\n"
                    r"(?P<body>.*?)^(?P=indent)```$", re.M | re.S)
KINDS = {"up", "background", "python", "sh", "file", "output", "synopsis", "demo", "ci", "diagram", "measured"}
# The addresses the README uses (the defaults of `up` and of the CLI), and the second node's.
DEFAULT_ADDRESSES = ("127.0.0.1:7070", "127.0.0.1:7071", "127.0.0.1:7170", "127.0.0.1:7171", "127.0.0.1:2379",
                     "127.0.0.1:7180")
PRODUCTION_ETCD = "10.0.0.5:2379,10.0.0.6:2379,10.0.0.7:2379"
UP_FLAGS = ("--listen", "--metrics-listen", "--node-listen", "--node-metrics-listen", "--etcd-listen")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str          # README.md or docs/NAME.md
    kind: str
    arg: str
    lang: str
    body: str
    line: int

    @property
    def id(self) -> str:
        return f"{self.path}:L{self.line}-{self.kind}" + (f"-{self.arg}" if self.arg else "")

    @property
    def where(self) -> str:
        return f"{self.path} line {self.line}"


def file_blocks(path: str) -> list[Block]:
    text = (ROOT / path).read_text()
    out = []
    for m in MARKER.finditer(text):
        body = "\n".join(x[len(m["indent"]):] for x in m["body"].splitlines()) + "\n"
        out.append(Block(path, m["kind"], m["arg"] or "", m["lang"], body, text.count("\n", 0, m.start()) + 1))
    return out


def blocks() -> list[Block]:
    """Every block of README.md and docs/, in the order of ``DOCS``."""
    return [b for path in DOCS for b in file_blocks(path)]


def test_every_docs_page_is_run_in_its_place() -> None:
    """No page is skipped: every docs/*.md (and README.md) is in ``DOCS``, once, and nothing listed is missing."""
    assert len(set(DOCS)) == len(DOCS) and DOCS[0] == "README.md"
    assert not on_disk() - set(DOCS), f"pages the README test does not run (add them to DOCS): {on_disk() - set(DOCS)}"
    assert not set(DOCS) - on_disk(), f"DOCS lists files that do not exist: {set(DOCS) - on_disk()}"
    index = (ROOT / "docs" / "README.md").read_text()
    listed = re.findall(r"^\d+\. \[[^]]+\]\(([\w-]+\.md)\)", index, re.M)
    assert ["docs/" + x for x in listed] == [x for x in DOCS if x not in ("README.md", "docs/README.md")], \
        "docs/README.md lists the pages in another order than tests/support/docs.py's DOCS"


@pytest.mark.parametrize("path", [*DOCS, *sorted(on_disk() - set(DOCS))])
def test_every_code_block_is_marked_and_run(path: str) -> None:
    lines = (ROOT / path).read_text().splitlines()
    fences = [i for i, x in enumerate(lines) if x.strip().startswith("```")]
    openings = fences[0::2]
    assert len(fences) % 2 == 0, f"{path}: a code block is not closed"
    marked = {b.line for b in file_blocks(path)}
    for i in openings:
        assert i in marked, f"{path} line {i + 1}: a code block without a '<!-- test: KIND -->' marker"
    assert {b.kind for b in file_blocks(path)} <= KINDS
    assert len(file_blocks(path)) == len(openings)


def test_every_kind_of_block_is_run() -> None:
    for kind in ("up", "python", "sh", "output", "synopsis", "demo", "ci"):
        assert any(b.kind == kind for b in blocks()), f"no block of kind {kind} in README.md or docs/"
    for kind in ("up", "demo", "ci"):
        assert any(b.kind == kind for b in file_blocks("README.md")), f"README.md has no block of kind {kind}"


@dataclasses.dataclass
class Env:
    workdir: Path
    addresses: dict[str, str]          # README address -> the address this run uses
    env: dict[str, str]
    up_output: str
    background: list[subprocess.Popen[str]] = dataclasses.field(default_factory=list)

    def rewrite(self, text: str) -> str:
        for readme, actual in self.addresses.items():
            text = text.replace(readme, actual)
        return text

    def run(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=self.env, cwd=self.workdir,
                              timeout=timeout)


def _venv_bin() -> Path:
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "gpucoord").exists() and (bin_dir / "etcdctl").exists(), \
        f"run the suite from the virtual environment that the README installs ({bin_dir} has no gpucoord/etcdctl)"
    return bin_dir


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    (up_block,) = [b for b in blocks() if b.kind == "up"]
    argv = shlex.split(up_block.body)
    assert argv[0].endswith("gpucoord") and argv[1] == "up", up_block.body
    ports = {flag: f"127.0.0.1:{free_port()}" for flag in UP_FLAGS}
    workdir = tmp_path_factory.mktemp("readme")
    (workdir / ".venv").symlink_to(_venv_bin().parent)
    (workdir / "train.py").write_text("print('training')\n")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *argv[1:], "--data-dir", str(workdir / "up"),
                             *[x for kv in ports.items() for x in kv]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=workdir)
    try:
        assert proc.stdout is not None
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if "gpucoord is up" in line:
                break
        out = "".join(printed)
        assert "gpucoord is up" in out, out
        # The production examples' etcd cluster (docs/etcd.md, "Production: etcd") is this run's etcd.
        addresses = {PRODUCTION_ETCD: ports["--etcd-listen"], PRODUCTION_ETCD.split(",")[0]: ports["--etcd-listen"]}
        addresses |= dict(zip(DEFAULT_ADDRESSES, [ports[f] for f in UP_FLAGS] + [f"127.0.0.1:{free_port()}"]))
        process_env = child_env() | {
            "PATH": f"{_venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}",
            "GPUCOORD_COORDINATOR": addresses["127.0.0.1:7070"], "GPUCOORD_ETCD": addresses["127.0.0.1:2379"]}
        e = Env(workdir, addresses, process_env, out)
        yield e
    finally:
        for p in [*getattr(locals().get("e"), "background", []), proc]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def test_up_prints_every_address_and_its_metrics(env: Env) -> None:
    out = env.up_output
    coordinator, etcd = env.addresses["127.0.0.1:7070"], env.addresses["127.0.0.1:2379"]
    assert f"coordinator: {coordinator}" in out and f"etcd:        {etcd}" in out
    assert f"node:        {env.addresses['127.0.0.1:7170']} host=gpu-node-1" in out
    (line,) = [x for x in out.splitlines() if x.startswith("metrics:")]
    urls = re.findall(r"http://\S+/metrics", line)
    assert urls[:2] == [f"http://{env.addresses['127.0.0.1:7071']}/metrics",
                        f"http://{env.addresses['127.0.0.1:7171']}/metrics"]
    for url, expect in zip(urls, ("gpucoord_refusals_total", "gpucoord_node_vram_used_bytes", "etcd_server_has_leader")):
        with urllib.request.urlopen(url, timeout=10) as r:
            assert expect in r.read().decode(), url
    (console,) = [x for x in out.splitlines() if x.startswith("console:")]
    assert console == f"console:     http://{env.addresses['127.0.0.1:7071']}/", console
    with urllib.request.urlopen(console.split()[1] + "hosts/gpu-node-1", timeout=10) as r:
        page = r.read().decode()
    assert '<div class="gpu" data-host="gpu-node-1" data-gpu="3"' in page, page[:2000]


def _placeholders(env: Env, text: str) -> str:
    """The <...> placeholders of README.md and docs/, filled with values of this run; an unknown one fails the test."""
    if "<etcd lease id in hex>" in text:
        keys = env.run("gpucoord keys").stdout
        lease = re.search(r"/gpucoord/hosts/gpu-node-1 +\(mod_revision=\d+ etcd_lease=([0-9a-f]+)\)", keys)
        assert lease, keys
        text = text.replace("<etcd lease id in hex>", lease[1])
    unknown = re.findall(r"<[^<>\n]+>", text)
    assert not unknown, f"placeholders this test does not know: {unknown}"
    return text


def _help(words: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", *words, "--help"], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, f"gpucoord {' '.join(words)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def check_synopsis(body: str) -> int:
    checked = 0
    for line in body.replace("\\\n", " ").splitlines():
        for alternative in line.split(" | "):
            words = alternative.split()
            if words and words[0] == "etcd":
                text = subprocess.run([etcd_binary(), "--help"], capture_output=True, text=True, timeout=60)
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", alternative.split("#")[0]):
                    assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text.stdout + text.stderr), f"etcd has no {flag}"
                    checked += 1
            if not words or Path(words[0]).name != "gpucoord":   # gpucoord, or .venv/bin/gpucoord
                continue
            command = [words[1]]
            if len(words) > 2 and words[1] in ("partition", "lease", "team", "host") and not words[2].startswith("-"):
                command.append(words[2])
            text = _help(command)
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", alternative.split(" -- ")[0]):
                assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text), f"gpucoord {' '.join(command)} has no {flag}"
                checked += 1
    return checked


@pytest.mark.parametrize("block", blocks(), ids=lambda b: b.id)
def test_readme_block(block: Block, env: Env) -> None:
    where = block.where
    if block.kind == "diagram":
        assert not re.search(r"^\s*(\$|gpucoord |python)", block.body, re.M), f"{where}: a diagram with commands"
    elif block.kind == "measured":
        ids = {line.split()[0] for line in block.body.splitlines() if re.match(r"P[1-8] ", line)}
        assert ids == {f"P{i}" for i in range(1, 9)}, f"{where}: a bench run without every target: {sorted(ids)}"
    elif block.kind == "ci":
        (command,) = block.body.strip().splitlines()
        assert command in (Path(REPO) / ".ci" / "run").read_text().splitlines(), \
            f"{where}: .ci/run does not run the README's command {command!r}"
    elif block.kind == "demo":
        _run_demo(block, env)
    elif block.kind == "up":
        assert "gpucoord is up" in env.up_output
    elif block.kind == "synopsis":
        assert check_synopsis(block.body) > 0, where
    elif block.kind == "file":
        (env.workdir / block.arg).write_text(block.body)
    elif block.kind == "python":
        script = env.workdir / f"snippet_{Path(block.path).stem}_{block.line}.py"
        script.write_text(env.rewrite(block.body))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env.env,
                              cwd=env.workdir, timeout=180)
        assert proc.returncode == 0, f"{where}:\n{proc.stdout}\n{proc.stderr}"
    elif block.kind == "sh":
        proc = env.run("set -e\n" + _placeholders(env, env.rewrite(block.body)))
        assert proc.returncode == 0 and proc.stdout.strip(), f"{where}:\n{proc.stdout}\n{proc.stderr}"
    elif block.kind == "background":
        proc = subprocess.Popen(["bash", "-c", "exec " + env.rewrite(block.body).replace("\\\n", " ").strip()],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env.env,
                                cwd=env.workdir)
        env.background.append(proc)
        host = re.search(r"--host (\S+)", block.body)
        assert host, where
        wait_for(lambda: f"host {host[1]} alive" in env.run(f"gpucoord status --host {host[1]}").stdout, 60,
                 f"{where}: host {host[1]} to register")
    elif block.kind == "output":
        _check_output(block, env)
    else:
        raise AssertionError(f"{where}: unknown kind {block.kind}")


def _check_output(block: Block, env: Env) -> None:
    commands: list[str] = []
    expected: list[str] = []
    for line in block.body.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:])
        else:
            expected.append(line)
    script = "exec 2>&1\n" + "\n".join(env.rewrite(c) for c in commands)
    proc = env.run(script)
    assert proc.stdout.splitlines() == expected, \
        f"{block.where}: the output printed there is stale; now:\n{proc.stdout}"


def _run_demo(block: Block, env: Env) -> None:
    last = block.body.strip().split("&&")[-1].split()
    assert last[0].endswith("gpucoord") and last[1:] == ["up", "--demo"], block.body
    ports = [x for flag in UP_FLAGS for x in (flag, "127.0.0.1:0")]
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", *last[1:], *ports, "--data-dir",
                           str(env.workdir / "demo")], capture_output=True, text=True, env=child_env(),
                          cwd=env.workdir, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # up, and the coordinator, node and agents it ran (their stderr is in the data dir's logs), leave no task
    # pending and use nothing after their loop closed.
    logs = "".join(p.read_text(errors="replace") for p in sorted((env.workdir / "demo").glob("*.log")))
    assert logs, "up --demo wrote no log to its data dir"
    assert_no_asyncio_noise(proc.stdout + proc.stderr + logs, "gpucoord up --demo and its children")
    assert out.count("GRANTED") == 4 and "REFUSED (RESOURCE_EXHAUSTED)" in out
    assert "released by etcd itself" in out and "demo finished" in out
    assert "=== every agent released and closed its session" in out
