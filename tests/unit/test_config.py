"""Tests of coordinator.config: sources and their precedence, coercion, validation with field names."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.keys import DEFAULT_PREFIX
from coordinator.limits import MAX_TTL_S, MIN_TTL_S

NO_ENV: dict[str, str] = {}


def write_toml(tmp_path: Path, body: str, name: str = "gpucoord.toml") -> str:
    p = tmp_path / name
    p.write_text(body)
    return str(p)


def load(file: str | None = None, env: dict[str, str] | None = None,
         flags: dict[str, Any] | None = None) -> CoordinatorConfig:
    return CoordinatorConfig.load(file=file, env=NO_ENV if env is None else env, flags=flags)


def field_error(**values: Any) -> str:
    with pytest.raises(ConfigError) as ei:
        load(flags=values)
    return ei.value.field


# -- defaults -----------------------------------------------------------------------------------

def test_defaults() -> None:
    c = load()
    assert c == CoordinatorConfig().validate()
    assert c.etcd == ("127.0.0.1:2379",)
    assert c.prefix == DEFAULT_PREFIX
    assert c.listen == "127.0.0.1:7070"
    assert c.session_ttl_s == 10
    assert c.keepalive_interval_s == 3.0
    assert c.etcd_timeout_s == 3.0
    assert c.untracked_vram is True
    assert c.batch_max == 64


def test_defaults_are_valid() -> None:
    c = CoordinatorConfig().validate()
    assert c.validate() == c
    assert (c.keepalive_interval_s, c.etcd_timeout_s) == (3.0, 3.0)   # derived from the TTL of 10 s


def test_config_is_frozen() -> None:
    c = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.session_ttl_s = 20  # type: ignore[misc]


def test_explicit_env_dict_isolates_from_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCOORD_SESSION_TTL_S", "60")
    assert load(env={}).session_ttl_s == 10
    assert CoordinatorConfig.load(env=None).session_ttl_s == 60     # None: os.environ


# -- file ---------------------------------------------------------------------------------------

def test_toml_file(tmp_path: Path) -> None:
    f = write_toml(tmp_path, """
[coordinator]
etcd = ["10.0.0.1:2379", "10.0.0.2:2379"]
prefix = "/prod/"
session_ttl_s = 30
keepalive_interval_s = 5.5
etcd_timeout_s = 4
untracked_vram = false
metrics_listen = "0.0.0.0:9100"
insecure = true
""")
    c = load(file=f)
    assert c.etcd == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert c.prefix == "/prod/"
    assert c.session_ttl_s == 30 and isinstance(c.session_ttl_s, int)
    assert c.keepalive_interval_s == 5.5
    assert c.etcd_timeout_s == 4.0 and isinstance(c.etcd_timeout_s, float)
    assert c.untracked_vram is False
    assert c.metrics_listen == "0.0.0.0:9100"
    assert c.listen == "127.0.0.1:7070"          # untouched: default


def test_toml_file_without_coordinator_table(tmp_path: Path) -> None:
    f = write_toml(tmp_path, '[node]\nhost = "x"\n\n[other]\nsession_ttl_s = 99\n')
    assert load(file=f) == CoordinatorConfig().validate()


def test_toml_etcd_as_string(tmp_path: Path) -> None:
    f = write_toml(tmp_path, '[coordinator]\netcd = "a:1, b:2,"\n')
    assert load(file=f).etcd == ("a:1", "b:2")


def test_toml_unknown_setting(tmp_path: Path) -> None:
    f = write_toml(tmp_path, "[coordinator]\nsession_ttl = 30\n")
    with pytest.raises(ConfigError) as ei:
        load(file=f)
    assert ei.value.field == "session_ttl"
    assert "unknown setting" in str(ei.value)


def test_toml_uncoercible_value(tmp_path: Path) -> None:
    f = write_toml(tmp_path, '[coordinator]\nsession_ttl_s = "ten"\n')
    with pytest.raises(ConfigError) as ei:
        load(file=f)
    assert ei.value.field == "session_ttl_s"
    assert str(ei.value).startswith("session_ttl_s:")


def test_toml_wrong_shape_for_tuple(tmp_path: Path) -> None:
    f = write_toml(tmp_path, "[coordinator]\netcd = 5\n")
    with pytest.raises(ConfigError) as ei:
        load(file=f)
    assert ei.value.field == "etcd"


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load(file=str(tmp_path / "nope.toml"))


# -- env ----------------------------------------------------------------------------------------

def test_env_values_are_coerced() -> None:
    c = load(env={
        "GPUCOORD_ETCD": "a:1,b:2",
        "GPUCOORD_SESSION_TTL_S": "20",
        "GPUCOORD_KEEPALIVE_INTERVAL_S": "2.5",
        "GPUCOORD_UNTRACKED_VRAM": "no",
        "GPUCOORD_PREFIX": "/env/",
        "GPUCOORD_MAX_QUEUE_PER_HOST": "7",
    })
    assert c.etcd == ("a:1", "b:2")
    assert c.session_ttl_s == 20
    assert c.keepalive_interval_s == 2.5
    assert c.untracked_vram is False
    assert c.prefix == "/env/"
    assert c.max_queue_per_host == 7


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
    ("0", False), ("false", False), ("False", False), ("no", False), ("off", False),
])
def test_env_bool(raw: str, value: bool) -> None:
    assert load(env={"GPUCOORD_UNTRACKED_VRAM": raw}).untracked_vram is value


@pytest.mark.parametrize(("var", "raw", "field"), [
    ("GPUCOORD_UNTRACKED_VRAM", "maybe", "untracked_vram"),
    ("GPUCOORD_UNTRACKED_VRAM", "", "untracked_vram"),
    ("GPUCOORD_SESSION_TTL_S", "10s", "session_ttl_s"),
    ("GPUCOORD_SESSION_TTL_S", "10.0", "session_ttl_s"),
    ("GPUCOORD_ETCD_TIMEOUT_S", "fast", "etcd_timeout_s"),
    ("GPUCOORD_BATCH_MAX", "", "batch_max"),
])
def test_env_uncoercible(var: str, raw: str, field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(env={var: raw})
    assert ei.value.field == field
    assert field in str(ei.value)


def test_env_ignores_unrelated_variables() -> None:
    assert load(env={"GPUCOORD_NO_SUCH_THING": "1", "PATH": "/bin", "gpucoord_session_ttl_s": "99"}) == \
        CoordinatorConfig().validate()


# -- precedence ---------------------------------------------------------------------------------

def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    f = write_toml(tmp_path, """
[coordinator]
session_ttl_s = 30
listen = "127.0.0.1:1111"
prefix = "/file/"
batch_max = 8
""")
    env = {"GPUCOORD_LISTEN": "127.0.0.1:2222", "GPUCOORD_PREFIX": "/env/", "GPUCOORD_BATCH_MAX": "16"}
    flags = {"prefix": "/flag/", "batch_max": None}          # None: the flag was not given
    c = load(file=f, env=env, flags=flags)
    assert c.prefix == "/flag/"              # flag > env > file
    assert c.listen == "127.0.0.1:2222"      # env > file
    assert c.batch_max == 16                 # env, the None flag does not override it
    assert c.session_ttl_s == 30             # file > default
    assert c.keepalive_interval_s == 3.0     # default


@settings(max_examples=50, deadline=None)
@given(file_v=st.none() | st.integers(20, 300), env_v=st.none() | st.integers(20, 300),
       flag_v=st.none() | st.integers(20, 300))
def test_precedence_property(tmp_path_factory: pytest.TempPathFactory, file_v: int | None, env_v: int | None,
                             flag_v: int | None) -> None:
    file = None
    if file_v is not None:
        file = write_toml(tmp_path_factory.mktemp("cfg"), f"[coordinator]\nsession_ttl_s = {file_v}\n")
    env = {} if env_v is None else {"GPUCOORD_SESSION_TTL_S": str(env_v)}
    c = load(file=file, env=env, flags={"session_ttl_s": flag_v})
    expected = next((v for v in (flag_v, env_v, file_v) if v is not None), 10)
    assert c.session_ttl_s == expected


def test_validation_sees_the_merged_values(tmp_path: Path) -> None:
    # The file's TTL is too short for the keepalive given by a flag; a shorter flag fixes it.
    f = write_toml(tmp_path, "[coordinator]\nsession_ttl_s = 6\n")
    with pytest.raises(ConfigError):
        load(file=f, flags={"keepalive_interval_s": 3})
    assert load(file=f, flags={"keepalive_interval_s": 2, "etcd_timeout_s": 2}).session_ttl_s == 6


@settings(max_examples=100, deadline=None)
@given(ttl=st.integers(MIN_TTL_S, MAX_TTL_S))
def test_a_short_ttl_works_without_setting_the_keepalive_or_the_etcd_timeout(ttl: int) -> None:
    c = load(flags={"session_ttl_s": ttl})
    assert c.keepalive_interval_s * 3 <= ttl and c.etcd_timeout_s < ttl / 2
    assert c.keepalive_interval_s == c.etcd_timeout_s == min(3.0, ttl / 3)


def test_flags_are_coerced() -> None:
    c = load(flags={"session_ttl_s": "20", "etcd": "x:1,y:2", "untracked_vram": "off",
                    "keepalive_interval_s": 1})
    assert c.session_ttl_s == 20
    assert c.etcd == ("x:1", "y:2")
    assert c.untracked_vram is False
    assert c.keepalive_interval_s == 1.0 and isinstance(c.keepalive_interval_s, float)


def test_flags_etcd_list() -> None:
    assert load(flags={"etcd": ["a:1", "b:2"]}).etcd == ("a:1", "b:2")


def test_unknown_flag() -> None:
    assert field_error(bogus=1) == "bogus"


# -- validation ---------------------------------------------------------------------------------

def test_config_error_is_value_error_with_field() -> None:
    e = ConfigError("prefix", "bad")
    assert isinstance(e, ValueError)
    assert e.field == "prefix"
    assert str(e) == "prefix: bad"


@pytest.mark.parametrize("ttl", [MIN_TTL_S - 1, 0, -5, MAX_TTL_S + 1, 10_000])
def test_ttl_out_of_range(ttl: int) -> None:
    assert field_error(session_ttl_s=ttl, keepalive_interval_s=0.1, etcd_timeout_s=0.1) == "session_ttl_s"


@pytest.mark.parametrize("ttl", [MIN_TTL_S, 3, MAX_TTL_S])
def test_ttl_bounds_inclusive(ttl: int) -> None:
    c = load(flags={"session_ttl_s": ttl, "keepalive_interval_s": ttl / 3, "etcd_timeout_s": ttl / 2 - 0.01})
    assert c.session_ttl_s == ttl


def test_keepalive_times_three_must_not_exceed_ttl() -> None:
    assert load(flags={"session_ttl_s": 9, "keepalive_interval_s": 3}).keepalive_interval_s == 3  # 9 == 9
    assert field_error(session_ttl_s=9, keepalive_interval_s=3.01) == "keepalive_interval_s"
    assert field_error(keepalive_interval_s=3.5) == "keepalive_interval_s"   # default TTL 10


def test_etcd_timeout_must_be_below_half_ttl() -> None:
    assert load(flags={"etcd_timeout_s": 4.99}).etcd_timeout_s == 4.99
    assert field_error(etcd_timeout_s=5) == "etcd_timeout_s"                 # == TTL / 2
    assert field_error(etcd_timeout_s=6) == "etcd_timeout_s"
    assert field_error(session_ttl_s=30, keepalive_interval_s=1, etcd_timeout_s=15) == "etcd_timeout_s"


@pytest.mark.parametrize("ep", ["localhost", ":2379", "host:", "host:port", "http://", "[::1]", "a:1x"])
def test_bad_endpoint(ep: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(flags={"etcd": [ep]})
    assert ei.value.field == "etcd"
    assert repr(ep) in str(ei.value)


def test_bad_endpoint_among_good_ones() -> None:
    with pytest.raises(ConfigError) as ei:
        load(env={"GPUCOORD_ETCD": "a:1,nope,b:2"})
    assert ei.value.field == "etcd"


def test_no_endpoint() -> None:
    assert field_error(etcd=[]) == "etcd"
    assert field_error(etcd=" , ") == "etcd"


@pytest.mark.parametrize("ep", ["127.0.0.1:2379", "http://10.0.0.1:2379", "etcd-0.svc:2379", "[::1]:2379"])
def test_good_endpoint(ep: str) -> None:
    assert load(flags={"etcd": [ep]}).etcd == (ep,)


@pytest.mark.parametrize("prefix", ["gpucoord/", "/gpucoord", "", "x"])
def test_bad_prefix(prefix: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(flags={"prefix": prefix})
    assert ei.value.field == "prefix"
    assert repr(prefix) in str(ei.value)


def test_other_limits() -> None:
    assert field_error(election_ttl_s=1) == "election_ttl_s"
    assert field_error(eviction_grace_s=-1) == "eviction_grace_s"
    assert field_error(max_queue_per_host=0) == "max_queue_per_host"
    assert field_error(max_queue_per_agent=0) == "max_queue_per_agent"
    assert load(flags={"max_queue_per_agent": "5"}).max_queue_per_agent == 5
    assert load(flags={"eviction_grace_s": 0}).eviction_grace_s == 0.0


def test_the_eviction_kill_margin_defaults_to_2s_and_is_bounded() -> None:
    assert load().eviction_kill_margin_s == 2.0
    assert load(flags={"eviction_kill_margin_s": "0"}).eviction_kill_margin_s == 0.0
    assert load(env={"GPUCOORD_EVICTION_KILL_MARGIN_S": "5.5"}).eviction_kill_margin_s == 5.5
    for bad in (-0.1, 601):
        assert field_error(eviction_kill_margin_s=bad) == "eviction_kill_margin_s"


def test_etcd_max_txn_ops_defaults_to_etcds_own_128_and_is_bounded() -> None:
    assert load().etcd_max_txn_ops == 128
    assert load(env={"GPUCOORD_ETCD_MAX_TXN_OPS": "1024"}).etcd_max_txn_ops == 1024
    for bad in (127, 16385, 0):
        assert field_error(etcd_max_txn_ops=bad) == "etcd_max_txn_ops"


def test_a_sessions_etcd_lease_lives_600_s_by_default_within_30_s_to_a_day() -> None:
    assert load().session_etcd_ttl_s == 600
    for bad in (29, 86401):
        assert field_error(session_etcd_ttl_s=bad) == "session_etcd_ttl_s"


def test_shared_commits_default_to_64_parts_and_1_turns_them_off() -> None:
    assert load().shared_commit_max == 64
    assert load(env={"GPUCOORD_SHARED_COMMIT_MAX": "1"}).shared_commit_max == 1


@pytest.mark.parametrize("field", ["batch_max", "commit_attempts", "shared_commit_max"])
def test_limit_errors_name_their_own_field(field: str) -> None:
    assert field_error(**{field: 0}) == field


@pytest.mark.parametrize("var", ["GPUCOORD_KEEPALIVE_INTERVAL_S", "GPUCOORD_ETCD_TIMEOUT_S",
                                 "GPUCOORD_EVICTION_GRACE_S", "GPUCOORD_EVICTION_KILL_MARGIN_S"])
def test_nan_is_rejected(var: str) -> None:
    with pytest.raises(ConfigError):
        load(env={var: "nan"})


@pytest.mark.parametrize(("field", "value"), [("keepalive_interval_s", -1), ("etcd_timeout_s", -3),
                                              ("max_leases_per_agent", 0)])
def test_non_positive_durations_and_limits_are_rejected(field: str, value: float) -> None:
    assert field_error(**{field: value}) == field


@settings(max_examples=200, deadline=None)
@given(ttl=st.integers(MIN_TTL_S, MAX_TTL_S), ka=st.floats(0.01, 200, allow_nan=False),
       to=st.floats(0.01, 200, allow_nan=False))
def test_validation_property(ttl: int, ka: float, to: float) -> None:
    flags = {"session_ttl_s": ttl, "keepalive_interval_s": ka, "etcd_timeout_s": to}
    if ka * 3 > ttl:
        assert field_error(**flags) == "keepalive_interval_s"
    elif to >= ttl / 2:
        assert field_error(**flags) == "etcd_timeout_s"
    else:
        c = load(flags=flags)
        assert (c.session_ttl_s, c.keepalive_interval_s, c.etcd_timeout_s) == (ttl, ka, to)


@pytest.mark.parametrize("address", ["10.0.0.5:7070", "gpucoord-0.svc:7070", "[::1]:7070"])
def test_advertise_is_host_and_port(address: str) -> None:
    assert load(flags={"advertise": address}).advertise == address


@pytest.mark.parametrize("address", ["10.0.0.5", ":7070", "host:port", "host:0", "host:70000"])
def test_a_bad_advertise_names_the_field(address: str) -> None:
    assert field_error(advertise=address) == "advertise"


@pytest.mark.parametrize("value", [0.0, -1.0, 86401.0, float("inf"), float("nan")])
def test_fair_share_every_s_must_be_a_positive_time_of_at_most_a_day(value: float) -> None:
    with pytest.raises(ConfigError) as ei:
        CoordinatorConfig(fair_share_every_s=value).validate()
    assert ei.value.field == "fair_share_every_s"
