"""Partitions: what each agent on a host may use. Pure logic; the only I/O is ``load_spec_file``.

A **partition spec** (a TOML file for ``gpucoord partition apply``, or the same structure as JSON
through the API) names a host, a mode, the agents and a ``reserved`` table; ``compute_partition``
checks it against the host's inventory and turns it into one concrete ``AgentAllocation`` per
agent: core ids, memory and disk bytes, whole GPUs and a VRAM cap (MiB) on every GPU the agent may
lease on.

``reserved`` is taken off the top before anything is split:

- ``cpu``: a number of cores. The reserved cores are the *first* ``reserved.cpu`` core ids of the
  host, in ascending order (``cpu = 1`` keeps core 0 for the system). Reserving every core is
  rejected: an empty cpuset cannot run anything.
- ``mem``, ``disk``: sizes in bytes (``"16GiB"``, ``"512MB"``, or a plain number of bytes).
- ``vram_headroom``: a size kept free on *every* GPU; stored in MiB (rounded down).
  ``usable = max(0, vram_total - headroom)``.

A ``reserved`` value larger than what the host has is rejected (``reserved.<kind>``); the headroom is
compared with the smallest GPU.

Modes
-----

``shared``
    Every agent sees the whole host minus ``reserved``: every non-reserved core, all the remaining
    memory and disk, and every GPU with a cap of ``usable``. The agents compete for the same GPU
    capacity. ``agents`` is optional and informative only: any agent is allowed. A host with no spec
    at all gets this mode with no reservation (``default_partition``).

``auto-split``
    Cores, memory and disk are divided with ``divmod``; the remainder goes to the first agents in
    list order. Cores are handed out as disjoint sets of consecutive available core ids. If there
    are at least as many GPUs as agents, whole GPUs are dealt out in index order by ``divmod``
    (5 GPUs over 3 agents: [0, 1], [2, 3], [4]); otherwise every GPU is shared and each agent's cap
    on each GPU is ``floor(usable / N)``. Fewer available cores than agents is rejected (field
    ``agents``) rather than handing out empty core sets.

``manual``
    ``[allocations.<agent>]`` gives each agent's share explicitly: ``cpu`` (a count) or ``cores``
    (explicit ids), ``mem``, ``disk``, ``gpus`` (whole devices, by index or uuid) and ``vram``
    (``{gpu = size}``: a cap on a shared device). Every agent needs an allocation, and every agent
    must name the same resource kinds (cpu and cores count as one kind, ``cpu``; the kinds are
    cpu, mem, disk, gpus, vram). Checked against the host:

    - the sum of a kind over all agents must not exceed ``total - reserved`` (Backend.AI wrongly
      allowed up to ``total + (N-1) * reserved``);
    - explicit core ids must exist, must not be reserved and must not overlap between agents;
      ``cpu`` counts are then turned into concrete core ids, in agent order, from the available
      cores not named explicitly;
    - a GPU is given whole to at most one agent, and a GPU given whole cannot also be capped;
    - a VRAM cap must not exceed ``usable``; GPUs must exist (index or uuid).

    **A kind that no agent names is not partitioned**: every agent gets the whole available amount
    of it (all non-reserved cores, all of ``mem - reserved.mem``, ...). For GPUs, ``gpus`` decides
    the whole devices and ``vram`` the shared ones: when ``vram`` is not named, every GPU that is not
    given whole to some agent is shared by all agents with a cap of ``usable``; when it is named, an
    agent may lease on its whole GPUs and on the GPUs of its ``vram`` table only.

VRAM caps are ceilings, not reservations: caps of different agents on one shared GPU may add up to
more than ``usable`` (as they do in shared mode); admission keeps the sum of the live leases within
``usable`` (G1). CPU, memory and disk shares are recorded and reported; agents or their runtimes
enforce them (cgroups, cpusets). GPU device sets and VRAM caps are enforced by admission.

Input limits: at most ``MAX_AGENTS`` agents, lists of at most ``MAX_ITEMS`` entries, integers up to
``2**63 - 1`` (protobuf int64), size strings up to 64 characters. A plain ``vram`` cap below 1 MiB
is rejected: a plain number is bytes, so ``vram = { 2 = 20480 }`` is almost certainly a unit mistake.

Every rejection is a ``PartitionError`` whose ``field`` names the offending entry, e.g. ``host``,
``reserved.cpu``, ``agents[2]``, ``allocations.agent-a.cpu``, ``allocations.agent-b.gpus[0]``,
``allocations.agent-b.vram.2``.
"""
from coordinator.policy.partition.compute import compute_partition
from coordinator.policy.partition.model import (
    AgentAllocation,
    Partition,
    default_partition,
)
from coordinator.policy.partition.spec import (
    AllocationSpec,
    PartitionSpec,
    Reserved,
    load_spec_file,
    parse_spec,
)
from coordinator.policy.partition.units import (
    KINDS,
    MAX_AGENTS,
    MAX_ITEMS,
    MODES,
    PartitionError,
    parse_mib,
    parse_size,
    show_bytes,
    show_mib,
)

__all__ = [
    "KINDS",
    "MAX_AGENTS",
    "MAX_ITEMS",
    "MODES",
    "AgentAllocation",
    "AllocationSpec",
    "Partition",
    "PartitionError",
    "PartitionSpec",
    "Reserved",
    "compute_partition",
    "default_partition",
    "load_spec_file",
    "parse_mib",
    "parse_size",
    "parse_spec",
    "show_bytes",
    "show_mib",
]
