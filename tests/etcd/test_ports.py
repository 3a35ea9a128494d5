"""Test etcd processes get ports no other process on a busy machine takes between choice and bind."""
from __future__ import annotations

import pathlib
import socket

from coordinator.etcd.process import EtcdCluster, _ephemeral_start, free_port


def test_chosen_ports_lie_below_the_kernels_ephemeral_range_and_are_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(p < _ephemeral_start() for p in ports)


def test_a_new_cluster_whose_port_was_taken_after_the_choice_starts_on_fresh_ports(tmp_path: pathlib.Path) -> None:
    cluster = EtcdCluster(size=1, base_dir=tmp_path)
    taken = cluster.members[0].peer_port
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        cluster.start()
        try:
            assert cluster.members[0].peer_port != taken
            assert cluster.members[0].healthy()
        finally:
            cluster.stop()
    finally:
        squatter.close()
