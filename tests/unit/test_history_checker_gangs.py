"""tests/history.check_history on synthetic etcd histories with gangs (issue 21): a gang lease is wholly present
or wholly absent at every revision, and an exclusive GPU is never shared."""
from __future__ import annotations

from coordinator.keys import lease_id_for
from tests.history import check_history
from tests.support.history_builder import G0, G1, HOST, SESSION, History, K

# -- gangs (issue 21): a gang lease is wholly present or absent at every revision; an exclusive GPU is not shared
GANG = [G0, G1]


def gang_part(h: History, gpu: str, request_id: str = "g", *, gang: list[str] | None = None,
              exclusive: bool = False, vram_mb: int = 4000, agent: str = "a") -> str:
    lease_id = lease_id_for(agent, request_id, HOST)
    token = h.seq.get(gpu, 0) + 1
    h.put(K.lease(HOST, gpu, lease_id), {
        "id": lease_id, "host": HOST, "gpu_uuid": gpu, "gpu_index": int(gpu.rsplit("-", 1)[1]), "agent": agent,
        "session_id": format(SESSION, "x"), "vram_mb": vram_mb, "priority": 0, "preemptible": True,
        "request_id": request_id, "token": token, "created_at": 1.0, "format": 2, "gang": gang or GANG,
        "exclusive": exclusive, "topology": "any"}, etcd_lease=SESSION)
    h.ledger(gpu, token)
    return lease_id


def test_a_gang_granted_and_released_whole_passes() -> None:
    h = History()
    with h.txn():
        gang_part(h, G0)
        lid = gang_part(h, G1)
    with h.txn():
        h.release(lid, G0)
        h.release(lid, G1)
    rep = check_history(h.events, K)
    assert not rep.violations, rep.violations


def test_a_gang_granted_in_two_revisions_is_caught() -> None:
    h = History()
    gang_part(h, G0)
    gang_part(h, G1)
    rep = check_history(h.events, K)
    assert any("partly held" in v for v in rep.violations), rep.violations


def test_a_gang_released_one_gpu_at_a_time_is_caught() -> None:
    h = History()
    with h.txn():
        gang_part(h, G0)
        lid = gang_part(h, G1)
    h.release(lid, G0)
    rep = check_history(h.events, K)
    assert any("partly held" in v for v in rep.violations), rep.violations


def test_the_same_lease_id_on_two_gpus_without_a_gang_is_caught() -> None:
    h = History()
    with h.txn():
        h.lease("a", "r1", 1000, G0)
        h.lease("a", "r1", 1000, G1)
    rep = check_history(h.events, K)
    assert any("G6" in v or "partly held" in v for v in rep.violations), rep.violations


def test_an_exclusive_gpu_shared_is_caught() -> None:
    h = History()
    with h.txn():
        gang_part(h, G0, exclusive=True, vram_mb=8000)
        gang_part(h, G1, exclusive=True, vram_mb=8000)
    h.lease("b", "r1", 1000, G0)
    rep = check_history(h.events, K)
    assert any("exclusive GPU" in v for v in rep.violations), rep.violations
