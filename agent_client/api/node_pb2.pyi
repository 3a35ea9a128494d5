from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInventoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeGpuProcess(_message.Message):
    __slots__ = ("pid", "used_mb")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MB_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_mb: int
    def __init__(self, pid: _Optional[int] = ..., used_mb: _Optional[int] = ...) -> None: ...

class NodeGpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "vram_total_mb", "vram_used_mb", "vram_free_mb", "processes", "utilization_percent")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VRAM_TOTAL_MB_FIELD_NUMBER: _ClassVar[int]
    VRAM_USED_MB_FIELD_NUMBER: _ClassVar[int]
    VRAM_FREE_MB_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    vram_total_mb: int
    vram_used_mb: int
    vram_free_mb: int
    processes: _containers.RepeatedCompositeFieldContainer[NodeGpuProcess]
    utilization_percent: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., vram_total_mb: _Optional[int] = ..., vram_used_mb: _Optional[int] = ..., vram_free_mb: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[NodeGpuProcess, _Mapping]]] = ..., utilization_percent: _Optional[int] = ...) -> None: ...

class GetInventoryResponse(_message.Message):
    __slots__ = ("host", "address", "cpu_count", "core_ids", "mem_bytes", "disk_path", "disk_bytes", "gpus", "version", "simulated")
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    CORE_IDS_FIELD_NUMBER: _ClassVar[int]
    MEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_PATH_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    host: str
    address: str
    cpu_count: int
    core_ids: _containers.RepeatedScalarFieldContainer[int]
    mem_bytes: int
    disk_path: str
    disk_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[NodeGpu]
    version: str
    simulated: bool
    def __init__(self, host: _Optional[str] = ..., address: _Optional[str] = ..., cpu_count: _Optional[int] = ..., core_ids: _Optional[_Iterable[int]] = ..., mem_bytes: _Optional[int] = ..., disk_path: _Optional[str] = ..., disk_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[NodeGpu, _Mapping]]] = ..., version: _Optional[str] = ..., simulated: _Optional[bool] = ...) -> None: ...

class CheckTokenRequest(_message.Message):
    __slots__ = ("gpu_uuid", "token")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    token: int
    def __init__(self, gpu_uuid: _Optional[str] = ..., token: _Optional[int] = ...) -> None: ...

class CheckTokenResponse(_message.Message):
    __slots__ = ("live", "lease_id", "highest_token")
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    live: bool
    lease_id: str
    highest_token: int
    def __init__(self, live: _Optional[bool] = ..., lease_id: _Optional[str] = ..., highest_token: _Optional[int] = ...) -> None: ...

class ConfirmProcessesRequest(_message.Message):
    __slots__ = ("lease_id", "pids", "pgid", "peer")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    PGID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    pids: _containers.RepeatedScalarFieldContainer[int]
    pgid: int
    peer: str
    def __init__(self, lease_id: _Optional[str] = ..., pids: _Optional[_Iterable[int]] = ..., pgid: _Optional[int] = ..., peer: _Optional[str] = ...) -> None: ...

class ConfirmProcessesResponse(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, refused: _Optional[_Iterable[int]] = ...) -> None: ...
