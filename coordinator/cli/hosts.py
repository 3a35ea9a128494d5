"""``gpucoord host cordon|uncordon|drain HOST``: take a host out of service and back (operator only;
docs/policies.md "Cordon and drain"). Each is one call to the coordinator (``CordonHost``, ``UncordonHost``); ``drain --wait``
then polls the host's status until no lease is left on it."""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from coordinator.cli.common import (
    UsageError,
    _client_tls,
    _stub,
    check_name,
    rpc_error,
)
from coordinator.rpc.status_json import message_to_json

_TLS = ("tls-ca", "tls-cert", "tls-key")
POLL_S = 0.5     # how often ``drain --wait`` reads the host's status


def add_parsers(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """``host`` on ``sub``; ``command(sub, name, uses, **kw)`` makes a subcommand (coordinator.cli.main)."""
    uses = ("coordinator", *_TLS)
    ho = command(sub, "host", uses, help="operator actions on hosts: cordon, uncordon, drain")
    hsub = ho.add_subparsers(dest="host_cmd", required=True, metavar="cordon|uncordon|drain")
    co = command(hsub, "cordon", uses, help="no new lease on the host (its leases and waiters stay)")
    un = command(hsub, "uncordon", uses, help="the host grants again (its waiters first, in their order)")
    dr = command(hsub, "drain", uses, help="cordon, and an eviction notice (reason drain) to every lease on it")
    for p in (co, un, dr):
        p.add_argument("host")
    for p in (co, dr):
        p.add_argument("--reason", default="", help="why, shown in 'gpucoord status' and to refused requests")
    dr.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                    help="the notices' grace period (default: the coordinator's eviction grace)")
    dr.add_argument("--wait", action="store_true", help="return once no lease is left on the host")
    ho.set_defaults(fn=cmd_host)


def _left(host: dict[str, Any]) -> list[str]:
    """What keeps a host from being empty: its leases, and ended leases whose processes still hold VRAM."""
    leases = [f"{x['id']} ({x['agent']})" for x in host.get("leases", [])]
    held = [f"{d['lease_id']} ({d['agent']}, processes still running)" for g in host.get("gpus", [])
            for d in g.get("departing", []) if d.get("held")]
    return leases + held


def _wait_empty(stub: Any, host: str) -> None:
    from agent_client.api import coordinator_pb2 as pb
    shown = None
    while True:
        doc = message_to_json(stub.GetStatus(pb.GetStatusRequest(host=host), timeout=10))
        left = [x for h in doc.get("hosts", []) if h.get("host") == host for x in _left(h)]
        if not left:
            print(f"host {host} drained: no lease left", flush=True)
            return
        if left != shown:
            print(f"draining {host}: {len(left)} lease{'s' if len(left) != 1 else ''} left: {', '.join(left)}",
                  flush=True)
            shown = left
        time.sleep(POLL_S)


def cmd_host(args: argparse.Namespace) -> int:
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    from coordinator.limits import MAX_GRACE_S, MAX_REASON_BYTES
    check_name("host", args.host, f"host {args.host_cmd}")
    hint = f"see 'gpucoord host {args.host_cmd} --help'"
    if args.host_cmd != "uncordon" and len(args.reason.encode("utf-8", "surrogatepass")) > MAX_REASON_BYTES:
        raise UsageError(f"--reason: at most {MAX_REASON_BYTES} bytes", hint)
    grace = getattr(args, "grace", None)
    if grace is not None and not 0 <= grace <= MAX_GRACE_S:
        raise UsageError(f"--grace: must be within [0, {MAX_GRACE_S:g}] seconds", hint)
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        if args.host_cmd == "uncordon":
            done = stub.UncordonHost(pb.UncordonHostRequest(host=args.host), timeout=10).uncordoned
            print(f"host {args.host} uncordoned" if done else f"host {args.host} was not cordoned")
            return 0
        drain = args.host_cmd == "drain"
        resp = stub.CordonHost(pb.CordonHostRequest(host=args.host, reason=args.reason, drain=drain,
                                                    grace_seconds=grace or 0.0), timeout=30)
        what = f"{'cordoned' if resp.created else 'already cordoned'}: no new lease on it"
        print(f"host {args.host} {what}; {resp.leases} lease{'s' if resp.leases != 1 else ''} on it"
              + (f", {resp.notices} eviction notice{'s' if resp.notices != 1 else ''} sent (reason drain)"
                 if drain else ""), flush=True)
        if drain and args.wait:
            _wait_empty(stub, args.host)
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
    return 0
