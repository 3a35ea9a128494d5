"""Authorization in one place: ``authorize(identity, method, request, sessions)``.

It runs before any handler logic, from the server interceptor (``coordinator.security.interceptor``), for
every RPC of both servers (health and reflection included) and for every message of a stream.

=================================  =============================  ==========  =====  ===========
RPC                                agent                          operator    node   coordinator
=================================  =============================  ==========  =====  ===========
Coordinator.OpenSession            as itself (``agent``)          yes         no     no
Coordinator.KeepAlive, Acquire,    on its own sessions            yes         no     no
  Release, CloseSession,           (``session.agent``)
  AttachProcesses
Coordinator.KeepAliveSessions      each message: on its own       yes         no     no
                                   sessions (every ``sessions[]
                                   .agent``)
Coordinator.GetStatus,             one host it has a live         yes         no     no
  GetPartition                     session on (``host``); GetStatus
                                   of every host: those hosts
Coordinator.ApplyPartition,        no                             yes         no     no
  EvictLease, RevokeLease,
  SetTeam, GetTeam, ListTeams,
  DeleteTeam, RevokeCertificate,
  ListRevokedCertificates, CordonHost,
  UncordonHost
Coordinator.Ping                   yes                            yes         no     no
Coordinator.Session (the stream)   yes; each message as its call  yes         no     no
Node.GetInventory, CheckToken      yes                            yes         no     yes
Node.ConfirmProcesses              no                             no          no     yes
Registry.Register (the stream),    no                             no          its    no
  Registry.ListLeases                                                         own
                                                                              host
grpc.health.v1.Health              yes                            yes         yes    yes
server reflection                  yes                            yes         no     no
=================================  =============================  ==========  =====  ===========

A session's leases are the session's own (``release`` compares the lease's session), and a session key
is ``sessions/<agent>/<id>``: naming another agent's session id under one's own name finds nothing. So
"its own sessions and leases" follows from checking ``session.agent`` here.

With TLS off there is no identity and every caller is trusted (loopback dev mode). With TLS on, a
certificate that carries no ``gpucoord://`` identity is refused like any other unauthorized caller.
Refusals are PERMISSION_DENIED naming the identity and the action, and are audited.

``Registry`` is what node daemons call on a coordinator (``coordinator.rpc.registry_server``): only a node
identity, and only for the host it is named after (``gpucoord://node/HOST``): the ``register`` message that
opens a ``Register`` stream, and ``ListLeases``, must name that host; every later message of the stream acts
on the host its first message registered.

A message of the ``Session`` stream carries one Acquire, Release or KeepAlive request: ``unwrap`` gives the
interceptor that call, which is then authorized, bounded and audited exactly as the unary call of that name.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from coordinator import errors
from coordinator.limits import quote
from coordinator.security.identity import Identity

if TYPE_CHECKING:
    from google.protobuf.message import Message

audit_log = logging.getLogger("gpucoord.audit")

COORDINATOR = "/gpucoord.v1.Coordinator/"
NODE = "/gpucoord.v1.Node/"
REGISTRY = "/gpucoord.v1.Registry/"
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")

SESSION_RPCS = frozenset({"KeepAlive", "Acquire", "Release", "CloseSession", "AttachProcesses"})
HOST_READ_RPCS = frozenset({"GetStatus", "GetPartition"})
OPERATOR_RPCS = frozenset({"ApplyPartition", "EvictLease", "RevokeLease",
                           "SetTeam", "GetTeam", "ListTeams", "DeleteTeam",    # teams: docs/teams.md "Teams"
                           "RevokeCertificate", "ListRevokedCertificates",     # the deny list
                           "CordonHost", "UncordonHost"})   # docs/policies.md "Cordon and drain"

# The hosts on which an agent has a live session (read from etcd by the coordinator).
AgentHosts = Callable[[str], Awaitable[set[str]]]


class Denied(errors.NotOwner):
    """PERMISSION_DENIED for an authorization refusal (always audited)."""

    def __init__(self, who: str, action: str, why: str) -> None:
        super().__init__(f"permission denied: {who} may not {action}: {why}")
        self.who, self.action, self.why = who, action, why


SESSION_STREAM = COORDINATOR + "Session"
# The calls a Session stream message may carry: its oneof field -> the RPC it stands for.
SESSION_STREAM_CALLS = {"acquire": "Acquire", "release": "Release", "keepalive": "KeepAlive"}


def rpc_name(method: str) -> str:
    return method.rpartition("/")[2]


def unwrap(method: str, request: Message | None) -> tuple[str, Message | None]:
    """The call a request stands for: a Session stream message is its Acquire, Release or KeepAlive request,
    under that RPC's method name; anything else (a message with no call set included) is itself."""
    if method != SESSION_STREAM or request is None:
        return method, request
    name = SESSION_STREAM_CALLS.get(request.WhichOneof("call") or "")
    if name is None:
        return method, request   # no call, or a cancel of one of the stream's own calls
    return COORDINATOR + name, getattr(request, request.WhichOneof("call"))


def target_of(method: str, request: Message | None) -> str:
    """What a call acts on, for messages and the audit log. Every field is quoted through ``quote``: at most
    32 characters of it, so a refusal stays small whatever the caller sent."""
    name = rpc_name(method)
    if request is None:
        return ""
    if name == "OpenSession":
        return f"agent {quote(request.agent)} on host {quote(request.host)}"
    if name in SESSION_RPCS:
        what = f"session {quote(request.session.session_id)} of agent {quote(request.session.agent)}"
        return what + (f", lease {quote(request.lease_id)}" if name in ("Release", "AttachProcesses") else "")
    if name == "KeepAliveSessions":
        return f"{len(request.sessions)} sessions"
    if name in ("EvictLease", "RevokeLease"):
        return f"lease {quote(request.lease_id)}"
    if name in HOST_READ_RPCS:
        return f"host {quote(request.host)}" if request.host else "every host"
    if name == "ApplyPartition":
        try:
            host = json.loads(request.spec_json).get("host", "?")
        except (ValueError, AttributeError, RecursionError):
            host = "?"
        return f"partition of host {quote(str(host))}"
    if name in ("CordonHost", "UncordonHost"):
        return f"host {quote(request.host)}"
    if name in ("SetTeam", "GetTeam", "DeleteTeam"):
        return f"team {quote(request.name)}"
    if name == "RevokeCertificate":
        return f"certificate {quote(request.certificate.serial)}"
    if name == "CheckToken":
        return f"token {request.token} on GPU {quote(request.gpu_uuid)}"
    if name == "ListLeases":
        return f"host {quote(request.host)}"
    if name == "Register" and request.WhichOneof("call") == "register":
        return f"host {quote(request.register.host)}"
    return ""


async def authorize(identity: Identity | None, tls: bool, method: str, request: Message | None,
                    agent_hosts: AgentHosts | None = None) -> None:
    """Raise ``Denied`` unless ``identity`` may call ``method`` with ``request``. Writes nothing."""
    if not tls:
        return   # loopback dev mode: every caller is trusted, as docs/security.md says
    name = rpc_name(method)
    who = str(identity) if identity is not None else "a certificate without a gpucoord:// identity"
    action = f"call {name}" + (f" on {target_of(method, request)}" if request is not None else "")

    def deny(why: str) -> Denied:
        return Denied(who, action, why)

    if identity is None:
        raise deny("the certificate carries no gpucoord://ROLE/NAME URI")
    role = identity.role
    if method.startswith(HEALTH):
        return
    if method.startswith(REFLECTION):
        if role in ("agent", "operator"):
            return
        raise deny(f"the {role} role may call only health")
    if method.startswith(NODE):
        if name == "ConfirmProcesses":
            if role == "coordinator":
                return
            raise deny("only a coordinator asks whose processes these are")
        if role in ("agent", "operator", "coordinator"):
            return
        raise deny(f"the {role} role may call only health")
    if method.startswith(REGISTRY):
        if role != "node":
            raise deny("only a node identity may register a host")
        host = None
        if request is not None and name == "ListLeases":
            host = request.host
        elif request is not None and name == "Register" and request.WhichOneof("call") == "register":
            host = request.register.host
        if host is not None and host != identity.name:
            raise deny(f"a node acts only on its own host ({quote(identity.name)})")
        return
    if not method.startswith(COORDINATOR):
        raise deny("unknown service")
    if role == "operator":
        return
    if role != "agent":
        raise deny(f"the {role} role may call only health on the coordinator")
    if name == "Ping":
        return
    if name == "Session":
        return   # the stream's opening, a cancel, or a message with no call (refused by the handler)
    if name in OPERATOR_RPCS:
        raise deny("it needs the operator role")
    if request is None:
        return   # a stream: each message is authorized as it arrives
    if name == "OpenSession":
        if request.agent != identity.name:
            raise deny(f"an agent opens sessions only as itself ({quote(identity.name)})")
        return
    if name in SESSION_RPCS:
        if request.session.agent != identity.name:
            raise deny(f"an agent acts only on its own sessions ({quote(identity.name)})")
        return
    if name == "KeepAliveSessions":
        other = next((ref for ref in request.sessions if ref.agent != identity.name), None)
        if other is not None:
            raise deny(f"an agent acts only on its own sessions ({quote(identity.name)}), not on session "
                       f"{quote(other.session_id)} of agent {quote(other.agent)}")
        return
    if name in HOST_READ_RPCS:
        if not request.host and name == "GetStatus":
            return   # its own view: the servicer answers with the hosts it has a live session on, redacted
        if not request.host:
            raise deny("an agent sees only a host it has a session on: name it in host "
                       "(every host needs the operator role)")
        hosts = await agent_hosts(identity.name) if agent_hosts is not None else set()
        if request.host not in hosts:
            raise deny(f"agent {quote(identity.name)} has no live session on host {quote(request.host)}")
        return
    raise deny("unknown method")


def audit(identity: Identity | None, tls: bool, peer: str, method: str, target: str, outcome: str) -> None:
    """One structured line per operator action and per authorization refusal."""
    who = str(identity) if identity is not None else (f"unauthenticated {peer}" if not tls else f"no identity {peer}")
    audit_log.info(json.dumps({"audit": True, "identity": who, "action": rpc_name(method), "target": target,
                               "outcome": outcome}, sort_keys=True))


def needs_audit(identity: Identity | None, method: str) -> bool:
    """Operator-only RPCs always; and anything an operator identity does besides reading."""
    name = rpc_name(method)
    if method.startswith(COORDINATOR) and name in OPERATOR_RPCS:
        return True
    return (identity is not None and identity.role == "operator" and method.startswith(COORDINATOR)
            and name not in ("GetStatus", "GetPartition", "Ping", "KeepAlive", "KeepAliveSessions"))
