from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRef(_message.Message):
    __slots__ = ("agent", "session_id")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    agent: str
    session_id: str
    def __init__(self, agent: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("agent", "host", "ttl_seconds", "pid", "client_version")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    agent: str
    host: str
    ttl_seconds: int
    pid: int
    client_version: str
    def __init__(self, agent: _Optional[str] = ..., host: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., pid: _Optional[int] = ..., client_version: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_seconds", "keepalive_interval_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_seconds: int
    keepalive_interval_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., keepalive_interval_seconds: _Optional[float] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class KeepAliveSessionsRequest(_message.Message):
    __slots__ = ("seq", "sessions", "left")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionRef]
    left: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionRef, _Mapping]]] = ..., left: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionNotKept(_message.Message):
    __slots__ = ("session_id", "code", "message", "reason", "field")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    code: int
    message: str
    reason: str
    field: str
    def __init__(self, session_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class SessionNotice(_message.Message):
    __slots__ = ("session_id", "notice")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    notice: EvictionNotice
    def __init__(self, session_id: _Optional[str] = ..., notice: _Optional[_Union[EvictionNotice, _Mapping]] = ...) -> None: ...

class KeepAliveSessionsResponse(_message.Message):
    __slots__ = ("seq", "not_kept", "notices")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NOT_KEPT_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    not_kept: _containers.RepeatedCompositeFieldContainer[SessionNotKept]
    notices: _containers.RepeatedCompositeFieldContainer[SessionNotice]
    def __init__(self, seq: _Optional[int] = ..., not_kept: _Optional[_Iterable[_Union[SessionNotKept, _Mapping]]] = ..., notices: _Optional[_Iterable[_Union[SessionNotice, _Mapping]]] = ...) -> None: ...

class EvictionNotice(_message.Message):
    __slots__ = ("lease_id", "gpu_uuid", "reason", "requested_by", "deadline_unix", "grace_left_seconds", "revoke", "processes", "reclaim_team", "withdrawn", "asked_by")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    GRACE_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_TEAM_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    ASKED_BY_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    gpu_uuid: str
    reason: str
    requested_by: str
    deadline_unix: float
    grace_left_seconds: float
    revoke: bool
    processes: str
    reclaim_team: str
    withdrawn: bool
    asked_by: str
    def __init__(self, lease_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., reason: _Optional[str] = ..., requested_by: _Optional[str] = ..., deadline_unix: _Optional[float] = ..., grace_left_seconds: _Optional[float] = ..., revoke: _Optional[bool] = ..., processes: _Optional[str] = ..., reclaim_team: _Optional[str] = ..., withdrawn: _Optional[bool] = ..., asked_by: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_seconds", "notices")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    notices: _containers.RepeatedCompositeFieldContainer[EvictionNotice]
    def __init__(self, ttl_seconds: _Optional[int] = ..., notices: _Optional[_Iterable[_Union[EvictionNotice, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "host", "gpu_uuid", "gpu_index", "vram_mb", "priority", "preemptible", "token", "agent", "session_id", "request_id", "created_at", "ttl_remaining", "pids", "pgid", "eviction", "gpus", "exclusive", "topology", "min_runtime_seconds", "over_quota", "time_limit_seconds", "idle", "idle_since", "idle_action", "hosts")
    ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TTL_REMAINING_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    PGID_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    MIN_RUNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVER_QUOTA_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    IDLE_SINCE_FIELD_NUMBER: _ClassVar[int]
    IDLE_ACTION_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    host: str
    gpu_uuid: str
    gpu_index: int
    vram_mb: int
    priority: int
    preemptible: bool
    token: int
    agent: str
    session_id: str
    request_id: str
    created_at: float
    ttl_remaining: int
    pids: _containers.RepeatedScalarFieldContainer[int]
    pgid: int
    eviction: EvictionNotice
    gpus: _containers.RepeatedCompositeFieldContainer[LeaseGpu]
    exclusive: bool
    topology: str
    min_runtime_seconds: float
    over_quota: bool
    time_limit_seconds: float
    idle: bool
    idle_since: float
    idle_action: str
    hosts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., host: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., gpu_index: _Optional[int] = ..., vram_mb: _Optional[int] = ..., priority: _Optional[int] = ..., preemptible: _Optional[bool] = ..., token: _Optional[int] = ..., agent: _Optional[str] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., created_at: _Optional[float] = ..., ttl_remaining: _Optional[int] = ..., pids: _Optional[_Iterable[int]] = ..., pgid: _Optional[int] = ..., eviction: _Optional[_Union[EvictionNotice, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[LeaseGpu, _Mapping]]] = ..., exclusive: _Optional[bool] = ..., topology: _Optional[str] = ..., min_runtime_seconds: _Optional[float] = ..., over_quota: _Optional[bool] = ..., time_limit_seconds: _Optional[float] = ..., idle: _Optional[bool] = ..., idle_since: _Optional[float] = ..., idle_action: _Optional[str] = ..., hosts: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseGpu(_message.Message):
    __slots__ = ("index", "uuid", "token", "vram_mb", "host", "rank")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    token: int
    vram_mb: int
    host: str
    rank: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., token: _Optional[int] = ..., vram_mb: _Optional[int] = ..., host: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session", "vram_mb", "gpu", "priority", "preemptible", "request_id", "wait_seconds", "gpu_count", "exclusive", "topology", "gpus", "min_runtime_seconds", "time_limit_seconds", "time_limit_warning_seconds", "hosts", "same", "prefer")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MIN_RUNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_WARNING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    SAME_FIELD_NUMBER: _ClassVar[int]
    PREFER_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    vram_mb: int
    gpu: str
    priority: int
    preemptible: bool
    request_id: str
    wait_seconds: float
    gpu_count: int
    exclusive: bool
    topology: str
    gpus: _containers.RepeatedScalarFieldContainer[str]
    min_runtime_seconds: float
    time_limit_seconds: float
    time_limit_warning_seconds: float
    hosts: int
    same: str
    prefer: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., vram_mb: _Optional[int] = ..., gpu: _Optional[str] = ..., priority: _Optional[int] = ..., preemptible: _Optional[bool] = ..., request_id: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., gpu_count: _Optional[int] = ..., exclusive: _Optional[bool] = ..., topology: _Optional[str] = ..., gpus: _Optional[_Iterable[str]] = ..., min_runtime_seconds: _Optional[float] = ..., time_limit_seconds: _Optional[float] = ..., time_limit_warning_seconds: _Optional[float] = ..., hosts: _Optional[int] = ..., same: _Optional[str] = ..., prefer: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease", "owner")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    owner: str
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., owner: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session", "lease_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    lease_id: str
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AttachProcessesRequest(_message.Message):
    __slots__ = ("session", "lease_id", "pids", "pgid")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    PGID_FIELD_NUMBER: _ClassVar[int]
    session: SessionRef
    lease_id: str
    pids: _containers.RepeatedScalarFieldContainer[int]
    pgid: int
    def __init__(self, session: _Optional[_Union[SessionRef, _Mapping]] = ..., lease_id: _Optional[str] = ..., pids: _Optional[_Iterable[int]] = ..., pgid: _Optional[int] = ...) -> None: ...

class AttachProcessesResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    def __init__(self, changed: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("host",)
    HOST_FIELD_NUMBER: _ClassVar[int]
    host: str
    def __init__(self, host: _Optional[str] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "used_mb")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MB_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_mb: int
    def __init__(self, pid: _Optional[int] = ..., used_mb: _Optional[int] = ...) -> None: ...

class ProcessUse(_message.Message):
    __slots__ = ("pid", "used_mb", "state", "lease_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_mb: int
    state: str
    lease_id: str
    def __init__(self, pid: _Optional[int] = ..., used_mb: _Optional[int] = ..., state: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class LeaseUse(_message.Message):
    __slots__ = ("lease_id", "agent", "vram_mb", "used_mb", "over_use", "pids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    USED_MB_FIELD_NUMBER: _ClassVar[int]
    OVER_USE_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    agent: str
    vram_mb: int
    used_mb: int
    over_use: bool
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., agent: _Optional[str] = ..., vram_mb: _Optional[int] = ..., used_mb: _Optional[int] = ..., over_use: _Optional[bool] = ..., pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GpuStatus(_message.Message):
    __slots__ = ("index", "uuid", "name", "total_mb", "usable_mb", "leased_mb", "used_mb", "untracked_mb", "free_mb", "seq", "processes", "lease_use", "numa_node", "nvlink_peers", "departing_mb", "departing", "utilization_percent", "process_utilization")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MB_FIELD_NUMBER: _ClassVar[int]
    USABLE_MB_FIELD_NUMBER: _ClassVar[int]
    LEASED_MB_FIELD_NUMBER: _ClassVar[int]
    USED_MB_FIELD_NUMBER: _ClassVar[int]
    UNTRACKED_MB_FIELD_NUMBER: _ClassVar[int]
    FREE_MB_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    LEASE_USE_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    NVLINK_PEERS_FIELD_NUMBER: _ClassVar[int]
    DEPARTING_MB_FIELD_NUMBER: _ClassVar[int]
    DEPARTING_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    total_mb: int
    usable_mb: int
    leased_mb: int
    used_mb: int
    untracked_mb: int
    free_mb: int
    seq: int
    processes: _containers.RepeatedCompositeFieldContainer[ProcessUse]
    lease_use: _containers.RepeatedCompositeFieldContainer[LeaseUse]
    numa_node: int
    nvlink_peers: _containers.RepeatedScalarFieldContainer[int]
    departing_mb: int
    departing: _containers.RepeatedCompositeFieldContainer[DepartingLease]
    utilization_percent: int
    process_utilization: _containers.RepeatedCompositeFieldContainer[IdleProcessUtilization]
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., total_mb: _Optional[int] = ..., usable_mb: _Optional[int] = ..., leased_mb: _Optional[int] = ..., used_mb: _Optional[int] = ..., untracked_mb: _Optional[int] = ..., free_mb: _Optional[int] = ..., seq: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[ProcessUse, _Mapping]]] = ..., lease_use: _Optional[_Iterable[_Union[LeaseUse, _Mapping]]] = ..., numa_node: _Optional[int] = ..., nvlink_peers: _Optional[_Iterable[int]] = ..., departing_mb: _Optional[int] = ..., departing: _Optional[_Iterable[_Union[DepartingLease, _Mapping]]] = ..., utilization_percent: _Optional[int] = ..., process_utilization: _Optional[_Iterable[_Union[IdleProcessUtilization, _Mapping]]] = ...) -> None: ...

class IdleProcessUtilization(_message.Message):
    __slots__ = ("pid", "sm_percent")
    PID_FIELD_NUMBER: _ClassVar[int]
    SM_PERCENT_FIELD_NUMBER: _ClassVar[int]
    pid: int
    sm_percent: int
    def __init__(self, pid: _Optional[int] = ..., sm_percent: _Optional[int] = ...) -> None: ...

class DepartingLease(_message.Message):
    __slots__ = ("lease_id", "agent", "vram_mb", "pids", "held", "forced", "requested_by", "reason", "revoke")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    agent: str
    vram_mb: int
    pids: _containers.RepeatedScalarFieldContainer[int]
    held: bool
    forced: bool
    requested_by: str
    reason: str
    revoke: bool
    def __init__(self, lease_id: _Optional[str] = ..., agent: _Optional[str] = ..., vram_mb: _Optional[int] = ..., pids: _Optional[_Iterable[int]] = ..., held: _Optional[bool] = ..., forced: _Optional[bool] = ..., requested_by: _Optional[str] = ..., reason: _Optional[str] = ..., revoke: _Optional[bool] = ...) -> None: ...

class AgentUse(_message.Message):
    __slots__ = ("agent", "allocation_json", "leased_mb", "leases")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASED_MB_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    agent: str
    allocation_json: str
    leased_mb: int
    leases: int
    def __init__(self, agent: _Optional[str] = ..., allocation_json: _Optional[str] = ..., leased_mb: _Optional[int] = ..., leases: _Optional[int] = ...) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("rank", "agent", "vram_mb", "priority", "gpu", "request_id", "gpu_count", "exclusive", "gpus", "topology", "position", "reason", "blockers", "estimated_start_unix", "has_estimate", "hosts", "same", "prefer", "reserve", "start_after_unix")
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCKERS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_START_UNIX_FIELD_NUMBER: _ClassVar[int]
    HAS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    SAME_FIELD_NUMBER: _ClassVar[int]
    PREFER_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_UNIX_FIELD_NUMBER: _ClassVar[int]
    rank: str
    agent: str
    vram_mb: int
    priority: int
    gpu: str
    request_id: str
    gpu_count: int
    exclusive: bool
    gpus: _containers.RepeatedScalarFieldContainer[str]
    topology: str
    position: int
    reason: str
    blockers: _containers.RepeatedCompositeFieldContainer[WaitBlocker]
    estimated_start_unix: float
    has_estimate: bool
    hosts: int
    same: str
    prefer: str
    reserve: _containers.RepeatedScalarFieldContainer[str]
    start_after_unix: float
    def __init__(self, rank: _Optional[str] = ..., agent: _Optional[str] = ..., vram_mb: _Optional[int] = ..., priority: _Optional[int] = ..., gpu: _Optional[str] = ..., request_id: _Optional[str] = ..., gpu_count: _Optional[int] = ..., exclusive: _Optional[bool] = ..., gpus: _Optional[_Iterable[str]] = ..., topology: _Optional[str] = ..., position: _Optional[int] = ..., reason: _Optional[str] = ..., blockers: _Optional[_Iterable[_Union[WaitBlocker, _Mapping]]] = ..., estimated_start_unix: _Optional[float] = ..., has_estimate: _Optional[bool] = ..., hosts: _Optional[int] = ..., same: _Optional[str] = ..., prefer: _Optional[str] = ..., reserve: _Optional[_Iterable[str]] = ..., start_after_unix: _Optional[float] = ...) -> None: ...

class WaitBlocker(_message.Message):
    __slots__ = ("kind", "detail", "lease_id", "agent", "gpus", "vram_mb", "ends_at_unix", "rank", "priority")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VRAM_MB_FIELD_NUMBER: _ClassVar[int]
    ENDS_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    kind: str
    detail: str
    lease_id: str
    agent: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    vram_mb: int
    ends_at_unix: float
    rank: str
    priority: int
    def __init__(self, kind: _Optional[str] = ..., detail: _Optional[str] = ..., lease_id: _Optional[str] = ..., agent: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., vram_mb: _Optional[int] = ..., ends_at_unix: _Optional[float] = ..., rank: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class HostStatus(_message.Message):
    __slots__ = ("host", "address", "alive", "simulated", "usage_age_seconds", "gpus", "partition_mode", "agents", "leases", "queue", "cpu_count", "mem_bytes", "disk_bytes", "usage_stale", "invalid", "labels", "cordoned", "cordon", "draining")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    USAGE_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_MODE_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    USAGE_STALE_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    CORDON_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    host: str
    address: str
    alive: bool
    simulated: bool
    usage_age_seconds: float
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStatus]
    partition_mode: str
    agents: _containers.RepeatedCompositeFieldContainer[AgentUse]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    queue: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    cpu_count: int
    mem_bytes: int
    disk_bytes: int
    usage_stale: bool
    invalid: str
    labels: _containers.ScalarMap[str, str]
    cordoned: bool
    cordon: Cordon
    draining: bool
    def __init__(self, host: _Optional[str] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., simulated: _Optional[bool] = ..., usage_age_seconds: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[GpuStatus, _Mapping]]] = ..., partition_mode: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[AgentUse, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., cpu_count: _Optional[int] = ..., mem_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., usage_stale: _Optional[bool] = ..., invalid: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., cordoned: _Optional[bool] = ..., cordon: _Optional[_Union[Cordon, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("hosts", "revision", "leader", "teams", "etcd_members", "gang_queue", "usage_days")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TEAMS_FIELD_NUMBER: _ClassVar[int]
    ETCD_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GANG_QUEUE_FIELD_NUMBER: _ClassVar[int]
    USAGE_DAYS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostStatus]
    revision: int
    leader: str
    teams: _containers.RepeatedCompositeFieldContainer[TeamStatus]
    etcd_members: _containers.RepeatedCompositeFieldContainer[EtcdMember]
    gang_queue: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    usage_days: _containers.RepeatedCompositeFieldContainer[UsageDay]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostStatus, _Mapping]]] = ..., revision: _Optional[int] = ..., leader: _Optional[str] = ..., teams: _Optional[_Iterable[_Union[TeamStatus, _Mapping]]] = ..., etcd_members: _Optional[_Iterable[_Union[EtcdMember, _Mapping]]] = ..., gang_queue: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., usage_days: _Optional[_Iterable[_Union[UsageDay, _Mapping]]] = ...) -> None: ...

class UsageDay(_message.Message):
    __slots__ = ("day", "gpu_seconds")
    class GpuSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DAY_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    day: str
    gpu_seconds: _containers.ScalarMap[str, float]
    def __init__(self, day: _Optional[str] = ..., gpu_seconds: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EtcdMember(_message.Message):
    __slots__ = ("name", "id", "client_urls", "leader")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_URLS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: str
    client_urls: _containers.RepeatedScalarFieldContainer[str]
    leader: bool
    def __init__(self, name: _Optional[str] = ..., id: _Optional[str] = ..., client_urls: _Optional[_Iterable[str]] = ..., leader: _Optional[bool] = ...) -> None: ...

class ApplyPartitionRequest(_message.Message):
    __slots__ = ("spec_json", "dry_run", "evict")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    dry_run: bool
    evict: bool
    def __init__(self, spec_json: _Optional[str] = ..., dry_run: _Optional[bool] = ..., evict: _Optional[bool] = ...) -> None: ...

class ApplyPartitionResponse(_message.Message):
    __slots__ = ("partition_json", "applied")
    PARTITION_JSON_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    partition_json: str
    applied: bool
    def __init__(self, partition_json: _Optional[str] = ..., applied: _Optional[bool] = ...) -> None: ...

class GetPartitionRequest(_message.Message):
    __slots__ = ("host",)
    HOST_FIELD_NUMBER: _ClassVar[int]
    host: str
    def __init__(self, host: _Optional[str] = ...) -> None: ...

class GetPartitionResponse(_message.Message):
    __slots__ = ("partition_json", "explicit")
    PARTITION_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_FIELD_NUMBER: _ClassVar[int]
    partition_json: str
    explicit: bool
    def __init__(self, partition_json: _Optional[str] = ..., explicit: _Optional[bool] = ...) -> None: ...

class EvictLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "grace_seconds", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    grace_seconds: float
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., grace_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class EvictLeaseResponse(_message.Message):
    __slots__ = ("deadline_unix",)
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    deadline_unix: float
    def __init__(self, deadline_unix: _Optional[float] = ...) -> None: ...

class RevokeLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RevokeLeaseResponse(_message.Message):
    __slots__ = ("revoked", "processes")
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    processes: bool
    def __init__(self, revoked: _Optional[bool] = ..., processes: _Optional[bool] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("call_id", "timeout_seconds", "acquire", "release", "keepalive", "cancel")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    timeout_seconds: float
    acquire: AcquireRequest
    release: ReleaseRequest
    keepalive: KeepAliveRequest
    cancel: int
    def __init__(self, call_id: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., acquire: _Optional[_Union[AcquireRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAliveRequest, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("call_id", "code", "message", "acquire", "release", "keepalive", "details")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    message: str
    acquire: AcquireResponse
    release: ReleaseResponse
    keepalive: KeepAliveResponse
    details: bytes
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., acquire: _Optional[_Union[AcquireResponse, _Mapping]] = ..., release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAliveResponse, _Mapping]] = ..., details: _Optional[bytes] = ...) -> None: ...

class Team(_message.Message):
    __slots__ = ("name", "quota_mb", "has_limit", "limit_mb", "weight", "members", "quota_by_model_mb", "max_min_runtime_seconds", "max_time_limit_seconds", "default_time_limit_seconds", "idle_after_seconds", "idle_below_percent", "idle_action")
    class QuotaByModelMbEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUOTA_MB_FIELD_NUMBER: _ClassVar[int]
    HAS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BY_MODEL_MB_FIELD_NUMBER: _ClassVar[int]
    MAX_MIN_RUNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BELOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    IDLE_ACTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    quota_mb: int
    has_limit: bool
    limit_mb: int
    weight: float
    members: _containers.RepeatedScalarFieldContainer[str]
    quota_by_model_mb: _containers.ScalarMap[str, int]
    max_min_runtime_seconds: float
    max_time_limit_seconds: float
    default_time_limit_seconds: float
    idle_after_seconds: float
    idle_below_percent: float
    idle_action: str
    def __init__(self, name: _Optional[str] = ..., quota_mb: _Optional[int] = ..., has_limit: _Optional[bool] = ..., limit_mb: _Optional[int] = ..., weight: _Optional[float] = ..., members: _Optional[_Iterable[str]] = ..., quota_by_model_mb: _Optional[_Mapping[str, int]] = ..., max_min_runtime_seconds: _Optional[float] = ..., max_time_limit_seconds: _Optional[float] = ..., default_time_limit_seconds: _Optional[float] = ..., idle_after_seconds: _Optional[float] = ..., idle_below_percent: _Optional[float] = ..., idle_action: _Optional[str] = ...) -> None: ...

class TeamUsage(_message.Message):
    __slots__ = ("used_mb", "borrowed_mb", "waiting_mb", "leases", "over_quota_leases", "waiting", "decayed_gpu_hours")
    USED_MB_FIELD_NUMBER: _ClassVar[int]
    BORROWED_MB_FIELD_NUMBER: _ClassVar[int]
    WAITING_MB_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    OVER_QUOTA_LEASES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DECAYED_GPU_HOURS_FIELD_NUMBER: _ClassVar[int]
    used_mb: int
    borrowed_mb: int
    waiting_mb: int
    leases: int
    over_quota_leases: int
    waiting: int
    decayed_gpu_hours: float
    def __init__(self, used_mb: _Optional[int] = ..., borrowed_mb: _Optional[int] = ..., waiting_mb: _Optional[int] = ..., leases: _Optional[int] = ..., over_quota_leases: _Optional[int] = ..., waiting: _Optional[int] = ..., decayed_gpu_hours: _Optional[float] = ...) -> None: ...

class TeamStatus(_message.Message):
    __slots__ = ("team", "usage", "stored")
    TEAM_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    team: Team
    usage: TeamUsage
    stored: bool
    def __init__(self, team: _Optional[_Union[Team, _Mapping]] = ..., usage: _Optional[_Union[TeamUsage, _Mapping]] = ..., stored: _Optional[bool] = ...) -> None: ...

class TeamMembers(_message.Message):
    __slots__ = ("patterns",)
    PATTERNS_FIELD_NUMBER: _ClassVar[int]
    patterns: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, patterns: _Optional[_Iterable[str]] = ...) -> None: ...

class TeamModelQuotas(_message.Message):
    __slots__ = ("mb",)
    class MbEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MB_FIELD_NUMBER: _ClassVar[int]
    mb: _containers.ScalarMap[str, int]
    def __init__(self, mb: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SetTeamRequest(_message.Message):
    __slots__ = ("name", "quota_mb", "limit_mb", "weight", "members", "quota_by_model", "max_min_runtime_seconds", "max_time_limit_seconds", "default_time_limit_seconds", "idle_after_seconds", "idle_below_percent", "idle_action")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUOTA_MB_FIELD_NUMBER: _ClassVar[int]
    LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BY_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MIN_RUNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIME_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BELOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    IDLE_ACTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    quota_mb: int
    limit_mb: int
    weight: float
    members: TeamMembers
    quota_by_model: TeamModelQuotas
    max_min_runtime_seconds: float
    max_time_limit_seconds: float
    default_time_limit_seconds: float
    idle_after_seconds: float
    idle_below_percent: float
    idle_action: str
    def __init__(self, name: _Optional[str] = ..., quota_mb: _Optional[int] = ..., limit_mb: _Optional[int] = ..., weight: _Optional[float] = ..., members: _Optional[_Union[TeamMembers, _Mapping]] = ..., quota_by_model: _Optional[_Union[TeamModelQuotas, _Mapping]] = ..., max_min_runtime_seconds: _Optional[float] = ..., max_time_limit_seconds: _Optional[float] = ..., default_time_limit_seconds: _Optional[float] = ..., idle_after_seconds: _Optional[float] = ..., idle_below_percent: _Optional[float] = ..., idle_action: _Optional[str] = ...) -> None: ...

class SetTeamResponse(_message.Message):
    __slots__ = ("team", "created")
    TEAM_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    team: Team
    created: bool
    def __init__(self, team: _Optional[_Union[Team, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetTeamRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetTeamResponse(_message.Message):
    __slots__ = ("team",)
    TEAM_FIELD_NUMBER: _ClassVar[int]
    team: TeamStatus
    def __init__(self, team: _Optional[_Union[TeamStatus, _Mapping]] = ...) -> None: ...

class ListTeamsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTeamsResponse(_message.Message):
    __slots__ = ("teams", "revision")
    TEAMS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    teams: _containers.RepeatedCompositeFieldContainer[TeamStatus]
    revision: int
    def __init__(self, teams: _Optional[_Iterable[_Union[TeamStatus, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class DeleteTeamRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTeamResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class RevokedCertificate(_message.Message):
    __slots__ = ("serial", "role", "name", "not_after", "reason", "revoked_at", "revoked_by")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_BY_FIELD_NUMBER: _ClassVar[int]
    serial: str
    role: str
    name: str
    not_after: str
    reason: str
    revoked_at: str
    revoked_by: str
    def __init__(self, serial: _Optional[str] = ..., role: _Optional[str] = ..., name: _Optional[str] = ..., not_after: _Optional[str] = ..., reason: _Optional[str] = ..., revoked_at: _Optional[str] = ..., revoked_by: _Optional[str] = ...) -> None: ...

class RevokeCertificateRequest(_message.Message):
    __slots__ = ("certificate",)
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    certificate: RevokedCertificate
    def __init__(self, certificate: _Optional[_Union[RevokedCertificate, _Mapping]] = ...) -> None: ...

class RevokeCertificateResponse(_message.Message):
    __slots__ = ("created", "certificate")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    created: bool
    certificate: RevokedCertificate
    def __init__(self, created: _Optional[bool] = ..., certificate: _Optional[_Union[RevokedCertificate, _Mapping]] = ...) -> None: ...

class ListRevokedCertificatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRevokedCertificatesResponse(_message.Message):
    __slots__ = ("certificates",)
    CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    certificates: _containers.RepeatedCompositeFieldContainer[RevokedCertificate]
    def __init__(self, certificates: _Optional[_Iterable[_Union[RevokedCertificate, _Mapping]]] = ...) -> None: ...

class Cordon(_message.Message):
    __slots__ = ("reason", "drain", "grace_seconds", "asked_by", "created_at_unix")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ASKED_BY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    reason: str
    drain: bool
    grace_seconds: float
    asked_by: str
    created_at_unix: float
    def __init__(self, reason: _Optional[str] = ..., drain: _Optional[bool] = ..., grace_seconds: _Optional[float] = ..., asked_by: _Optional[str] = ..., created_at_unix: _Optional[float] = ...) -> None: ...

class CordonHostRequest(_message.Message):
    __slots__ = ("host", "reason", "drain", "grace_seconds")
    HOST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    host: str
    reason: str
    drain: bool
    grace_seconds: float
    def __init__(self, host: _Optional[str] = ..., reason: _Optional[str] = ..., drain: _Optional[bool] = ..., grace_seconds: _Optional[float] = ...) -> None: ...

class CordonHostResponse(_message.Message):
    __slots__ = ("cordon", "created", "leases", "notices")
    CORDON_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    cordon: Cordon
    created: bool
    leases: int
    notices: int
    def __init__(self, cordon: _Optional[_Union[Cordon, _Mapping]] = ..., created: _Optional[bool] = ..., leases: _Optional[int] = ..., notices: _Optional[int] = ...) -> None: ...

class UncordonHostRequest(_message.Message):
    __slots__ = ("host",)
    HOST_FIELD_NUMBER: _ClassVar[int]
    host: str
    def __init__(self, host: _Optional[str] = ...) -> None: ...

class UncordonHostResponse(_message.Message):
    __slots__ = ("uncordoned",)
    UNCORDONED_FIELD_NUMBER: _ClassVar[int]
    uncordoned: bool
    def __init__(self, uncordoned: _Optional[bool] = ...) -> None: ...
