"""The exit codes of docs/cli.md "Command-line conventions", walked over every command: a bad value exits 2 with
one ``gpucoord: error:`` line, nothing sent (the coordinator and etcd named are a closed port: a value that
got past the command's own checks would meet exit 3 there); the line says "nothing was changed" exactly for
the commands that change something, never for a read."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coordinator.cli.main import WRITE_COMMANDS, build_parser, command_words, main
from coordinator.security import certs

pytestmark = pytest.mark.unit

NOWHERE = "127.0.0.1:1"     # nothing listens: a call that is sent fails with exit 3, not 2


def _walk(tmp: Path) -> list[list[str]]:
    bad_spec = tmp / "bad.toml"
    bad_spec.write_text('host = "h1"\nmode = "shared"\n[reserved]\nvram_headroom = 100000\n')
    certs.init_ca(tmp / "pki")
    c, e = ["--coordinator", NOWHERE], ["--etcd", NOWHERE]
    return [
        ["up", "--fake-mem", "lots"],
        ["up", "--label", "Rack=r1"],
        ["coordinator", *e, "--session-ttl", "1"],
        ["node", *e, "--fake-gpus", "1x16GiB", "--over-use-tolerance", "100KiB"],
        ["node", *e, "--fake-gpus", "1x16GiB", "--host", "bad/name"],
        ["node", *e, "--fake-gpus", "1x16GiB", "--label", "rack=r1", "--label", "rack=r2"],
        ["node", *e, "--fake-gpus", "1x16GiB", "--ttl", "0"],
        ["node", *e, "--fake-gpus", "1x16GiB", "--heartbeat", "nan"],
        ["node", *e, "--fake-gpus", "1x16GiB", "--untracked-grace", "inf"],
        ["status", *c, "--host", "bad/name"],
        ["status", *c, "--watch", "0"],
        ["queue", *c, "--host", "bad/name"],
        ["keys", *e, "--etcd-cert", str(tmp / "c.pem")],
        ["partition", "apply", str(bad_spec), *c],
        ["partition", "show", "bad/name", *c],
        ["lease", "evict", "x", "--grace", "-1", *c],
        ["lease", "evict", "bad/id", *c],
        ["lease", "revoke", "bad/id", *c],
        ["lease", "revoke", "x", "--bogus", *c],
        ["lease", "show", "bad/id", *c],
        ["run", "--agent", "a", "--vram", "1GiB", "--priority", "99999999", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "100KiB", *c, "--", "true"],
        ["run", "--agent", "a", "--exclusive", "--min-runtime", "-5", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "1GiB", "--ttl", "1", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "1GiB", "--hosts", "0", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "1GiB", "--hosts", "65", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "1GiB", "--hosts", "2", "--same", "Rack", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "1GiB", "--prefer", "rack", *c, "--", "true"],
        ["run", "--agent", "a", "--vram", "1GiB", "--hosts", "2", "--gpu", "0", *c, "--", "true"],
        ["run", "--agent", "a", "--join", "x", "--vram", "1GiB", *c, "--", "true"],
        ["run", "--agent", "a", "--join", "x", "--rank", "-1", *c, "--", "true"],
        ["run", "--agent", "a", "--join", "bad/id", *c, "--", "true"],
        ["run", "--agent", "a", "--rank", "1", *c, "--", "true"],
        ["bench", "acquire", "--n", "0"],
        ["bench", "reclaim", "--reporting-hosts", "-1"],
        ["bench", "reclaim", "--reporting-hosts", "100001"],
        ["certs", "init", "--dir", str(tmp / "pki2"), "--days", "0"],
        ["certs", "init", "--dir", str(tmp / "pki"), "--days", "99999999"],
        ["certs", "issue", "--dir", str(tmp / "pki"), "--role", "agent", "--name", "a/b"],
        ["certs", "issue", "--dir", str(tmp / "pki"), "--role", "agent", "--name", "a", "--days", "99999999"],
        ["certs", "list", "--dir", str(tmp / "pki"), "--etcd-user", "root", *c],
        ["certs", "revoke", "not-a-serial", *e],
        ["certs", "revoke", "not-a-serial", *c],
        ["etcd-setup", *e, "--etcd-cert", str(tmp / "c.pem")],
        ["team", "set", "t", "--weight", "0", *c],
        ["team", "set", "t", "--quota", "100KiB", *c],
        ["team", "set", "t", "--members", "a,,b", *c],
        ["team", "set", "bad/name", *c],
        ["team", "show", "bad/name", *c],
        ["team", "delete", "bad/name", *c],
        ["team", "list", "--bogus", *c],
        ["usage", *e, "--since", "last week"],
        ["usage", *e, "--since", "1d", "--until", "2d"],
        ["usage", *e, "--since", "99999999d"],
        ["usage", *e, "--by", "gpu"],
        ["usage", *e, "--lease", "bad/id"],
        ["host", "drain", "h1", "--grace", "-1", *c],
        ["host", "drain", "h1", "--reason", "x" * 300, *c],
        ["host", "cordon", "bad/name", *c],
        ["host", "uncordon", "h1", "--grace", "2", *c],
    ]


def test_every_command_exits_2_on_a_bad_value_saying_nothing_was_changed_only_where_it_could_have_been(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    walked = set()
    for argv in _walk(tmp_path):
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, (argv, rc, err)
        assert len(err) == 1 and err[0].startswith("gpucoord: error: ") and "; " in err[0], (argv, err)
        writes = command_words(argv) in WRITE_COMMANDS
        assert ("nothing was changed" in err[0]) == writes, (argv, err)
        walked.add(command_words(argv))
    assert not (tmp_path / "pki2").exists(), "a refused certs init made its directory"
    commands = set()
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        groups = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        commands |= {(name, word) for word in groups[0].choices} if groups else {(name, "")}
    assert commands <= walked, f"commands the walk leaves out: {sorted(commands - walked)}"


def test_command_words_reads_past_global_options() -> None:
    assert command_words(["--coordinator", "x", "team", "set", "t"]) == ("team", "set")
    assert command_words(["-v", "status", "--host", "h"]) == ("status", "")
    assert command_words(["run", "--agent", "a", "--", "team"]) == ("run", "")
    assert command_words([]) == ("", "")


def test_a_refusal_quotes_at_most_32_characters_of_a_long_value(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A 200-digit value is refused (exit 2) quoting a prefix of it, never the whole (G9: 32 characters)."""
    long = "1" + "0" * 199
    c, e = ["--coordinator", NOWHERE], ["--etcd", NOWHERE]
    for argv in (["run", "--agent", "a", "--vram", "1GiB", "--gpu", long, *c, "--", "true"],
                 ["run", "--agent", "a", "--vram", "1GiB", "--hosts", long, *c, "--", "true"],
                 ["run", "--agent", "a", "--vram", "1GiB", "--hosts", "2", "--same", long, *c, "--", "true"],
                 ["coordinator", *e, "--session-ttl", long], ["bench", "acquire", "--n", long],
                 ["usage", *e, "--lease", long], ["node", *e, "--fake-gpus", "1x16GiB", "--ttl", long],
                 ["node", *e, "--fake-gpus", "1x16GiB", "--heartbeat", long],
                 ["certs", "init", "--dir", str(tmp_path / "pki"), "--days", long]):
        rc = main(argv)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("gpucoord: error: "), (argv[:2], rc, err[:300])
        assert long[:33] not in err, (argv[:2], err[:300])
