"""A lease as the teams see it (G11): what it is charged on each GPU it holds, and of which GPU model. Pure
data, no I/O (``teams.py`` classifies charges into quota; ``team_admission.charge_of`` builds them).

Charges and frees are per GPU: a gang is charged, on each of its GPUs, that GPU's own record (an exclusive
gang over a 32 GiB and a 16 GiB GPU: 32 GiB on the first, 16 GiB on the second), counted against the quota of
that GPU's own model; reclaiming it frees, on each GPU, what it holds there.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Charge:
    """One live lease as the teams see it: ``vram_mb`` on each of ``gpus`` (uuids), charged to ``team``;
    ``per_gpu``, when given, says what each GPU's own record holds and of which model (a gang's GPUs differ)."""

    id: str
    team: str
    vram_mb: int
    gpus: tuple[str, ...]
    created_at: float
    token: int = 0
    model: str = ""              # the GPU model ("" unknown): of every GPU without ``per_gpu``
    preemptible: bool = True
    min_runtime_s: float = 0.0   # as the lease declared it (capped by its team's max_min_runtime_s)
    total_mb: int | None = None  # the records' vram_mb summed when they differ (an exclusive gang's GPUs)
    per_gpu: tuple[tuple[str, int, str], ...] = ()   # (GPU uuid, MiB of its record, its model), per GPU

    @property
    def charge_mb(self) -> int:
        if self.per_gpu:
            return sum(mb for _, mb, _ in self.per_gpu)
        return self.total_mb if self.total_mb is not None else self.vram_mb * len(self.gpus)

    def on(self, gpu: str) -> int:
        """What the lease holds on ``gpu`` (what reclaiming it frees there)."""
        if self.per_gpu:
            return sum(mb for u, mb, _ in self.per_gpu if u == gpu)
        return self.vram_mb if gpu in self.gpus else 0

    def by_model(self) -> dict[str, int]:
        """What the lease is charged per GPU model: each GPU's record to that GPU's model."""
        if not self.per_gpu:
            return {self.model: self.charge_mb}
        out: dict[str, int] = {}
        for _, mb, model in self.per_gpu:
            out[model] = out.get(model, 0) + mb
        return out

    def age_order(self) -> tuple[float, int, str]:
        """Oldest first: the order in which a team's leases fill its quota."""
        return (self.created_at, self.token, self.id)
