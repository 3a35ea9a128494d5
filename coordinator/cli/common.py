"""What the commands share: defaults, logging, signals, the coordinator stub, errors and exit codes."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from coordinator.rpc.status_json import message_to_json, status_objects

if TYPE_CHECKING:
    import argparse

    import grpc

    from agent_client.api import coordinator_pb2_grpc as pb_grpc
    from coordinator.security.tls import TlsFiles

DEFAULT_COORDINATOR = "127.0.0.1:7070"
DEFAULT_ETCD = "127.0.0.1:2379"
DEFAULT_PREFIX = "/gpucoord/"

# Exit codes of every command (docs/cli.md, "Exit codes"). ``gpucoord run`` passes its command's status through and
# so keeps the 125/126/127 convention of env(1) and docker run for its own failures.
EXIT_REFUSED = 1        # the operation was refused (bad input, not found, does not fit, ...) or failed
EXIT_USAGE = 2          # the command line is wrong
EXIT_UNREACHABLE = 3    # a coordinator, etcd or the GPUs (NVML) could not be reached
EXIT_HOST_TAKEN = 4     # gpucoord node: another live daemon serves this host


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """A duration as the CLI takes it (docs/policies.md "Time limits"): seconds (``90``, ``1.5``) or a number with a unit
    ``s``, ``m``, ``h`` or ``d`` (``90s``, ``5m``, ``2h``). ValueError for anything else (argparse says which flag)."""
    raw = text.strip().lower()
    scale = _UNITS.get(raw[-1:], 0.0)
    number = raw[:-1] if scale else raw
    scale = scale or 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (90, 90s, 5m, 2h)") from None
    if value != value or value < 0 or value == float("inf"):
        raise ValueError(f"{text!r} is not a duration (90, 90s, 5m, 2h)")
    return value


def _insecure_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow plaintext on a non-loopback address (logged as a warning; docs/security.md, \"Running securely\")")


class CliError(Exception):
    """A failure that the CLI reports as one line, ``gpucoord: error: MESSAGE; HINT``, and an exit code.

    ``refused``: the coordinator answered with a refusal (nothing of the call took effect). ``writes`` (set by
    ``main`` from the command line): the command is one that changes something; then a bad command line
    (exit 2) and a refusal say "nothing was changed", and a read never says it."""

    def __init__(self, message: str, hint: str = "", code: int = EXIT_REFUSED, refused: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code
        self.refused = refused
        self.writes = False

    def line(self) -> str:
        hint = self.hint
        if self.writes and (self.code == EXIT_USAGE or self.refused) and "nothing was changed" not in hint:
            hint = "nothing was changed" + (f": {hint}" if hint else "")
        return f"gpucoord: error: {self.message}" + (f"; {hint}" if hint else "")


class UsageError(CliError):
    def __init__(self, message: str, hint: str = "see 'gpucoord --help'") -> None:
        super().__init__(message, hint, EXIT_USAGE)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"GPUCOORD_{name}", default)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop_event)`` until SIGINT/SIGTERM sets the event."""
    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner_:
        runner_.run(runner())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed: a gRPC call costs the coordinator about a sixth less CPU
    on it (measured with an empty unary RPC). asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _ready_line(kind: str, port: int) -> None:
    print(f"READY {kind} port={port}", flush=True)


# The largest answer the operator's commands take (gRPC's default, 4 MiB, is a fleet status of about 1,700 hosts
# with 10 leases each: 10,000 hosts with 100,000 leases are 24 MB).
ANSWER_MAX_BYTES = 1 << 30


def _stub(address: str, tls: TlsFiles | None = None) -> pb_grpc.CoordinatorStub:
    from agent_client.api import coordinator_pb2_grpc as pb_grpc
    from coordinator.security.tls import TlsError, sync_channel
    try:
        # The first of several comma-separated replicas: an operator's one-shot call needs no failover.
        return pb_grpc.CoordinatorStub(sync_channel(address.split(",")[0].strip(), tls,
                                                    [("grpc.max_receive_message_length", ANSWER_MAX_BYTES)]))
    except TlsError as e:   # a certificate or key that cannot be read
        raise CliError(str(e), "give readable PEM files with --tls-ca, --tls-cert and --tls-key") from e


def _client_tls(args: argparse.Namespace) -> TlsFiles | None:
    """The operator's TLS files: --tls-* flags, else GPUCOORD_TLS_CA/CERT/KEY; None for plaintext."""
    from coordinator.security.tls import TlsError, from_args
    try:
        return from_args(args)
    except TlsError as e:   # one or two of the three
        raise UsageError(str(e), f"see 'gpucoord {args.cmd} --help'") from e


_HINTS = {
    "INVALID_ARGUMENT": "fix the field named and try again",
    "NOT_FOUND": "'gpucoord status' lists the live hosts and leases",
    "FAILED_PRECONDITION": "what the message names must change first",
    "RESOURCE_EXHAUSTED": "it does not fit now: retry later, or wait in the queue",
    "PERMISSION_DENIED": "this identity may not do that (docs/security.md, \"Running securely\")",
}


def rpc_error(e: grpc.RpcError, address: str) -> CliError:
    """A gRPC error of a call to the coordinator at ``address`` as a ``CliError``: exit 3 when it could not
    be reached, 1 when it answered with a refusal."""
    code = e.code().name
    details = e.details() or code
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return CliError(f"cannot reach the coordinator at {address} ({code}: {details})",
                        "is it running? 'gpucoord up' starts one; give its address with --coordinator ADDR (and "
                        "--tls-ca/--tls-cert/--tls-key if it serves TLS)", EXIT_UNREACHABLE)
    return CliError(f"{code}: {details}", _HINTS.get(code, ""), EXIT_REFUSED, refused=True)


def check_name(flag: str, value: str, command: str) -> str:
    """A name given on the command line (a host, a lease id, a team): refused here, exit 2, as the coordinator
    would refuse it."""
    from coordinator.keys import valid_name
    from coordinator.limits import quote
    if not valid_name(value):
        raise UsageError(f"{flag}: {quote(value)} is not a valid name (letters, digits, '.', '_', ':', '@', '-'; "
                         "at most 128)", f"see 'gpucoord {command} --help'")
    return value


def host_overrides(cpus: int | None, mem: str | None, disk: str | None) -> dict[str, object]:
    """``--fake-cpus/--fake-mem/--fake-disk`` as inventory overrides; ValueError naming the flag."""
    from coordinator.policy.partition import PartitionError, parse_size

    overrides: dict[str, object] = {}
    try:
        if cpus is not None:
            if cpus < 1:
                raise ValueError("--fake-cpus: must be >= 1")
            overrides.update(cpu_count=cpus, core_ids=tuple(range(cpus)))
        if mem is not None:
            overrides["mem_bytes"] = parse_size(mem, "--fake-mem")
        if disk is not None:
            overrides["disk_bytes"] = parse_size(disk, "--fake-disk")
    except PartitionError as e:
        raise ValueError(str(e)) from None
    return overrides


def fetch_status(address: str, host: str = "", tls: TlsFiles | None = None) -> dict[str, Any]:
    from agent_client.api import coordinator_pb2 as pb
    resp = _stub(address, tls).GetStatus(pb.GetStatusRequest(host=host), timeout=10)
    return status_objects(message_to_json(resp))


