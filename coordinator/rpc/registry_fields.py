"""The fields of the Registry service's messages, checked before anything is read or written: each refusal
is INVALID_ARGUMENT naming the field (and quoting at most 32 characters of it). Pure: no I/O."""
from __future__ import annotations

import dataclasses
import json

from agent_client.api import registry_pb2 as pb
from coordinator import errors
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.limits import quote
from coordinator.record_fields import InvalidRecord, check_usage
from coordinator.records import HostInventory, dumps
from coordinator.rpc.validate import check_name

MIN_TTL_S, MAX_TTL_S = 2, 300
MAX_ADDRESS = 256
MAX_VERSION = 64
MAX_INVENTORY_BYTES = 256 << 10
MAX_USAGE_BYTES = 512 << 10


@dataclasses.dataclass(frozen=True)
class Registration:
    """A checked ``register`` message: what ``hosts/<host>`` will hold, and the registration's terms."""

    host: str
    ttl_s: int
    value: bytes          # hosts/<host>'s value
    resume_etcd_lease: int


def _json(field: str, text: str, limit: int) -> object:
    if not text:
        raise errors.InvalidArgument(f"{field}: is required", field)
    if len(text) > limit:
        raise errors.InvalidArgument(f"{field}: {len(text)} bytes, above the limit of {limit}", field)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise errors.InvalidArgument(f"{field}: not valid JSON", field) from None


def registration(msg: pb.HostRegistration) -> Registration:
    host = check_name("host", msg.host)
    if not 0 < len(msg.address) <= MAX_ADDRESS or not msg.address.isprintable():
        raise errors.InvalidArgument(f"address: {quote(msg.address)} is not a HOST:PORT of at most "
                                     f"{MAX_ADDRESS} characters", "address")
    if not MIN_TTL_S <= msg.ttl_seconds <= MAX_TTL_S:
        raise errors.InvalidArgument(f"ttl_seconds: must be in [{MIN_TTL_S}, {MAX_TTL_S}], got {msg.ttl_seconds}",
                                     "ttl_seconds")
    if not 0 <= msg.pid < 1 << 32:
        raise errors.InvalidArgument(f"pid: must be in [0, 2^32), got {msg.pid}", "pid")
    if not 0 <= msg.started_at < 1e11:
        raise errors.InvalidArgument("started_at: must be Unix seconds >= 0", "started_at")
    if len(msg.version) > MAX_VERSION or not msg.version.isprintable():
        raise errors.InvalidArgument(f"version: {quote(msg.version)} is not a version", "version")
    if msg.etcd_lease < 0:
        raise errors.InvalidArgument("etcd_lease: must be >= 0", "etcd_lease")
    doc = _json("inventory_json", msg.inventory_json, MAX_INVENTORY_BYTES)
    try:
        inventory = HostInventory.from_json(doc)  # type: ignore[arg-type]
    except InvalidRecord as e:
        raise errors.InvalidArgument(f"inventory_json: {str(e)[:200]}", "inventory_json") from None
    if inventory.host != host:
        raise errors.InvalidArgument(f"inventory_json: its host {quote(inventory.host)} is not the registered "
                                     f"host {quote(host)}", "inventory_json")
    if len({g.uuid for g in inventory.gpus}) != len(inventory.gpus) \
            or len({g.index for g in inventory.gpus}) != len(inventory.gpus):
        raise errors.InvalidArgument("inventory_json: two GPUs with one index or uuid", "inventory_json")
    inventory = dataclasses.replace(inventory, address=msg.address)
    value = dumps({"address": msg.address, "inventory": inventory.to_json(), "version": msg.version,
                   "pid": msg.pid, "started_at": msg.started_at})
    return Registration(host, msg.ttl_seconds, value, msg.etcd_lease)


def usage(msg: pb.UsageReport) -> bytes:
    """``usage/<host>``'s value: the report, checked as every reader of it checks it."""
    doc = _json("usage_json", msg.usage_json, MAX_USAGE_BYTES)
    try:
        check_usage(doc)
    except InvalidRecord as e:
        raise errors.InvalidArgument(f"usage_json: {str(e)[:200]}", "usage_json") from None
    return dumps(doc)


def list_leases(msg: pb.ListLeasesRequest) -> tuple[str, str]:
    return check_name("host", msg.host), check_name("gpu_uuid", msg.gpu_uuid)


def stored_key(keys: Keys, kv: KV) -> pb.StoredKey:
    """A key as a node gets it: below the installation's prefix (the node adds its own)."""
    return pb.StoredKey(key=keys.relative(kv.key), value=kv.value, create_revision=kv.create_revision,
                        mod_revision=kv.mod_revision, version=kv.version, etcd_lease=kv.etcd_lease)
