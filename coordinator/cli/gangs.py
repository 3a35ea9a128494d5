"""Multi-host gangs on the command line (issue 30): ``--hosts N``, ``--same KEY`` and ``--prefer KEY`` of the
commands that acquire, checked by argparse before anything is sent (exit 2, docs/cli.md "Exit codes")."""
from __future__ import annotations

import argparse

from coordinator.host_records import label_error
from coordinator.limits import quote
from coordinator.records import MAX_GANG_HOSTS


def hosts_count(text: str) -> int:
    """``--hosts``: a whole number of hosts within [1, MAX_GANG_HOSTS]."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a number of hosts") from None
    if not 1 <= n <= MAX_GANG_HOSTS:
        raise argparse.ArgumentTypeError(f"must be within [1, {MAX_GANG_HOSTS}], got {quote(text)}")
    return n


def label_key(text: str) -> str:
    """``--same``/``--prefer``: a host label key (NAME or PREFIX/NAME, as ``--label KEY=VALUE`` takes it); ""
    (the default, which argparse passes through here too): none."""
    if text and label_error(text, "x"):
        raise argparse.ArgumentTypeError(f"{quote(text)} is not a label key (NAME or PREFIX/NAME, e.g. rack)")
    return text


def add_gang_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=hosts_count, default=1, metavar="N",
                   help=f"a multi-host gang: --gpus GPUs (or --exclusive) on each of N distinct hosts, all or nothing "
                        f"(1 to {MAX_GANG_HOSTS}; default 1, this host)")
    p.add_argument("--same", type=label_key, default="", metavar="KEY",
                   help="with --hosts: every host has the same value of this label (e.g. rack)")
    p.add_argument("--prefer", type=label_key, default="", metavar="KEY",
                   help="with --hosts: prefer hosts that share this label's value")


def check_gang_flags(args: argparse.Namespace) -> None:
    """What the flags allow only together: ValueError naming the flag."""
    for flag, value in (("--same", args.same), ("--prefer", args.prefer)):
        if value and args.hosts < 2:
            raise ValueError(f"{flag}: only with --hosts 2 or more")
    if args.hosts >= 2 and args.gpu is not None:
        raise ValueError(f"--gpu: names one host's GPU, not with --hosts {args.hosts} (the GPUs are chosen)")
