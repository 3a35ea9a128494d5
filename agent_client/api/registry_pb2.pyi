from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HostRegistration(_message.Message):
    __slots__ = ("host", "address", "inventory_json", "ttl_seconds", "pid", "started_at", "version", "etcd_lease")
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_JSON_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ETCD_LEASE_FIELD_NUMBER: _ClassVar[int]
    host: str
    address: str
    inventory_json: str
    ttl_seconds: int
    pid: int
    started_at: float
    version: str
    etcd_lease: int
    def __init__(self, host: _Optional[str] = ..., address: _Optional[str] = ..., inventory_json: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ..., version: _Optional[str] = ..., etcd_lease: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UsageReport(_message.Message):
    __slots__ = ("usage_json",)
    USAGE_JSON_FIELD_NUMBER: _ClassVar[int]
    usage_json: str
    def __init__(self, usage_json: _Optional[str] = ...) -> None: ...

class Deregister(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("register", "heartbeat", "usage", "deregister")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DEREGISTER_FIELD_NUMBER: _ClassVar[int]
    register: HostRegistration
    heartbeat: Heartbeat
    usage: UsageReport
    deregister: Deregister
    def __init__(self, register: _Optional[_Union[HostRegistration, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., usage: _Optional[_Union[UsageReport, _Mapping]] = ..., deregister: _Optional[_Union[Deregister, _Mapping]] = ...) -> None: ...

class StoredKey(_message.Message):
    __slots__ = ("key", "value", "create_revision", "mod_revision", "version", "etcd_lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ETCD_LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    etcd_lease: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., create_revision: _Optional[int] = ..., mod_revision: _Optional[int] = ..., version: _Optional[int] = ..., etcd_lease: _Optional[int] = ...) -> None: ...

class KeyChange(_message.Message):
    __slots__ = ("deleted", "kv")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    kv: StoredKey
    def __init__(self, deleted: _Optional[bool] = ..., kv: _Optional[_Union[StoredKey, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("etcd_lease", "ttl_seconds", "taken")
    ETCD_LEASE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    etcd_lease: int
    ttl_seconds: int
    taken: str
    def __init__(self, etcd_lease: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., taken: _Optional[str] = ...) -> None: ...

class KeySnapshot(_message.Message):
    __slots__ = ("prefix", "revision", "kvs", "more")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KVS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    revision: int
    kvs: _containers.RepeatedCompositeFieldContainer[StoredKey]
    more: bool
    def __init__(self, prefix: _Optional[str] = ..., revision: _Optional[int] = ..., kvs: _Optional[_Iterable[_Union[StoredKey, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class KeyChanges(_message.Message):
    __slots__ = ("prefix", "revision", "changes")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    revision: int
    changes: _containers.RepeatedCompositeFieldContainer[KeyChange]
    def __init__(self, prefix: _Optional[str] = ..., revision: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[KeyChange, _Mapping]]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("registered", "snapshot", "changes")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    snapshot: KeySnapshot
    changes: KeyChanges
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., snapshot: _Optional[_Union[KeySnapshot, _Mapping]] = ..., changes: _Optional[_Union[KeyChanges, _Mapping]] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("host", "gpu_uuid")
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    host: str
    gpu_uuid: str
    def __init__(self, host: _Optional[str] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("revision", "kvs")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KVS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    kvs: _containers.RepeatedCompositeFieldContainer[StoredKey]
    def __init__(self, revision: _Optional[int] = ..., kvs: _Optional[_Iterable[_Union[StoredKey, _Mapping]]] = ...) -> None: ...
