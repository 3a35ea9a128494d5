"""The certificate RPCs (operator only): RevokeCertificate writes ``revoked/<serial>``, the deny list that
every replica and node daemon follows (``coordinator.security.revocation``); ListRevokedCertificates reads
it. ``gpucoord certs revoke`` and ``certs list`` call them, so an operator needs no etcd credentials: only
coordinators talk to etcd (docs/security.md "Running securely"; the break-glass path with etcd's root is
``certs revoke --etcd``)."""
from __future__ import annotations

import datetime
import json
import re

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors
from coordinator.etcd.store import Store
from coordinator.keys import Keys, last_segment
from coordinator.limits import quote
from coordinator.record_fields import dumps
from coordinator.rpc.validate import check_text
from coordinator.txn import Absent, Put

MAX_SERIAL_HEX = 64          # an X.509 serial is at most 20 bytes (40 hex digits); some slack
MAX_REASON_BYTES = 256
MAX_FIELD_BYTES = 128        # role, name, not_after: copied from pki/issued.jsonl
_STORED = ("serial", "role", "name", "not_after", "reason", "revoked_at", "revoked_by")


def serial(value: str) -> str:
    """The serial as the deny list keys it: lowercase hex without leading zeros (INVALID_ARGUMENT naming
    ``certificate.serial`` otherwise)."""
    if not re.fullmatch(f"[0-9a-fA-F]{{1,{MAX_SERIAL_HEX}}}", value):
        raise errors.InvalidArgument(f"certificate.serial: {quote(value)} is not a certificate serial (1 to "
                                     f"{MAX_SERIAL_HEX} hex digits)", "certificate.serial")
    return value.lower().lstrip("0") or "0"


def record(request: pb.RevokeCertificateRequest, revoked_by: str, now: datetime.datetime) -> dict[str, str]:
    """The JSON document of ``revoked/<serial>`` that ``request`` asks for; every field checked first."""
    c = request.certificate
    for field in ("revoked_at", "revoked_by"):
        if getattr(c, field):
            raise errors.InvalidArgument(f"certificate.{field}: the coordinator sets it; leave it empty",
                                         f"certificate.{field}")
    doc = {"serial": serial(c.serial),
           "role": check_text("certificate.role", c.role, MAX_FIELD_BYTES),
           "name": check_text("certificate.name", c.name, MAX_FIELD_BYTES),
           "not_after": check_text("certificate.not_after", c.not_after, MAX_FIELD_BYTES),
           "reason": check_text("certificate.reason", c.reason, MAX_REASON_BYTES)}
    return {**doc, "revoked_at": now.isoformat(timespec="seconds"), "revoked_by": revoked_by}


def message(doc: object, key_serial: str) -> pb.RevokedCertificate:
    """A stored record as a message; a malformed value (it still revokes: the key is what counts) gives the
    serial alone."""
    fields = {k: str(doc.get(k, "")) for k in _STORED} if isinstance(doc, dict) else {}
    fields["serial"] = key_serial
    return pb.RevokedCertificate(**fields)


def _parse(value: bytes) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return None


async def revoke(store: Store, keys: Keys, request: pb.RevokeCertificateRequest,
                 revoked_by: str) -> pb.RevokeCertificateResponse:
    doc = record(request, revoked_by, datetime.datetime.now(datetime.timezone.utc))
    key = keys.revoked(doc["serial"])
    result = await store.commit([Absent(key)], [Put(key, dumps(doc))])
    if result.succeeded:
        return pb.RevokeCertificateResponse(created=True, certificate=message(doc, doc["serial"]))
    existing = await store.get(key)   # revoked before: the first record stays
    first = _parse(existing.value) if existing is not None else doc
    return pb.RevokeCertificateResponse(created=False, certificate=message(first, doc["serial"]))


async def list_revoked(store: Store, keys: Keys) -> pb.ListRevokedCertificatesResponse:
    read = await store.get_prefix(keys.revocations())
    return pb.ListRevokedCertificatesResponse(
        certificates=[message(_parse(kv.value), last_segment(kv.key)) for kv in read.kvs])
