"""etcd's per-transaction limits as budgets (``policy/txn_budget.py``): the bound on a multi-host gang's grant
in bytes holds for real records (so a gang the precheck admits never meets etcd's --max-request-bytes), and the
operations budget follows etcd_max_txn_ops."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.keys import Keys
from coordinator.limits import MAX_REQUEST_ID_LEN
from coordinator.policy.txn_budget import (
    TXN_BYTES_BUDGET,
    beyond,
    gang_budgets,
    gang_txn_bytes,
)
from coordinator.records import VramLease, dumps


@settings(max_examples=200, deadline=None)
@given(hosts=st.integers(2, 12), gpus=st.integers(1, 8), host_len=st.integers(3, 128), uuid_len=st.integers(8, 64))
def test_the_byte_bound_of_a_gang_is_at_least_what_its_grant_puts(hosts: int, gpus: int, host_len: int,
                                                                  uuid_len: int) -> None:
    """Every record (the longest agent, request id and prefix a coordinator takes) and every ledger, keys too."""
    keys = Keys("/" + "p" * 62 + "/")
    parts = tuple((f"h{h}".ljust(host_len, "x"), tuple(f"GPU-{h}-{i}".ljust(uuid_len, "u") for i in range(gpus)))
                  for h in range(hosts))
    longest_host = max(len(h) for h, _ in parts)
    longest_uuid = max(len(u) for _, us in parts for u in us)
    total = 0
    for host, uuids in parts:
        for index, uuid in enumerate(uuids):
            lease = VramLease(
                id="l" * 20, host=host, gpu_uuid=uuid, gpu_index=index, agent="a" * 128,
                session_id="s" * 32, vram_mb=1 << 20, priority=100, preemptible=True, request_id="r" * MAX_REQUEST_ID_LEN,
                token=1 << 40, created_at=1796571825.4236312, gang=uuids if len(uuids) > 1 else (), exclusive=True,
                topology="nvlink", over_quota=True, time_limit_s=2592000.0, time_limit_warning_s=120.0, hosts=parts,
                etcd_lease=1)
            total += len(keys.lease(host, uuid, lease.id)) + len(dumps(lease.to_json()))
            total += len(keys.gpu(host, uuid)) + len(dumps({"capacity_mb": 1 << 20, "seq": 1 << 40}))
    assert total <= gang_txn_bytes(hosts, gpus, longest_host, longest_uuid)


def test_a_gang_past_any_limit_names_it_and_one_within_them_passes() -> None:
    ops, compares = gang_budgets(128)
    assert beyond(ops, compares, TXN_BYTES_BUDGET, 128) == ""
    assert "etcd_max_txn_ops 128" in beyond(ops + 1, compares, 0, 128)
    assert "etcd_max_txn_ops 128" in beyond(ops, compares + 1, 0, 128)
    assert beyond(ops + 1, compares, 0, 1024) == ""
    assert "bytes" in beyond(1, 1, TXN_BYTES_BUDGET + 1, 16384)
