"""tests/history.check_history's registration rule on synthetic histories: one registration per host, and a
host's usage only on its registration's etcd lease."""
from __future__ import annotations

from tests.support.history_builder import HOST, History, K, assert_one_violation, check


def _registered(h: History, etcd_lease: int) -> None:
    h.put(K.host(HOST), {"address": "127.0.0.1:1"}, etcd_lease)


def test_a_registration_its_usage_and_a_new_one_after_it_ended_pass() -> None:
    h = History()
    _registered(h, 0x10)
    h.put(K.usage(HOST), {"gpus": []}, 0x10)
    _registered(h, 0x10)                   # the same registration, rewritten (a resumed one's new address)
    h.delete(K.usage(HOST))
    h.delete(K.host(HOST))                 # its etcd lease expired
    _registered(h, 0x20)
    h.put(K.usage(HOST), {"gpus": []}, 0x20)
    assert check(h).violations == []


def test_a_second_registration_over_a_live_one_is_flagged() -> None:
    h = History()
    _registered(h, 0x10)
    _registered(h, 0x20)
    assert_one_violation(check(h), "registration", "hosts/h1 moved from etcd lease 10 to 20")


def test_usage_on_another_etcd_lease_than_the_registration_is_flagged() -> None:
    h = History()
    _registered(h, 0x10)
    h.put(K.usage(HOST), {"gpus": []}, 0x30)
    assert_one_violation(check(h), "registration", "usage/h1 put on etcd lease 30")


def test_usage_of_an_unregistered_host_is_flagged() -> None:
    h = History()
    h.put(K.usage(HOST), {"gpus": []}, 0x30)
    assert_one_violation(check(h), "registration", "hosts/h1 is on 0")
