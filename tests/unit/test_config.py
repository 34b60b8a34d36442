"""Settings: HORA_* names, HOROVOD_* aliases, defaults, bad values."""
import os
import subprocess
import sys

import pytest

from hora.config import env_value, settings_from_env


def test_defaults_are_horovods():
    s = settings_from_env({})
    assert s.fusion_threshold == 128 * 1024 * 1024 and s.cycle_time_ms == 0.0
    assert s.cache_capacity == 1024 and s.stall_warning_s == 60 and s.stall_shutdown_s == 0
    assert s.start_timeout == 30 and s.stall_check


def test_horovod_names_are_accepted_and_hora_names_win():
    env = {"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5",
           "HORA_CYCLE_TIME": "2.5", "HOROVOD_STALL_CHECK_DISABLE": "1",
           "HOROVOD_GLOO_IFACE": "eth1"}
    s = settings_from_env(env)
    assert s.fusion_threshold == 1024 and s.cycle_time_ms == 2.5
    assert not s.stall_check and s.iface == "eth1"


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="HORA_START_TIMEOUT='soon'"):
        env_value("START_TIMEOUT", {"HORA_START_TIMEOUT": "soon"})


@pytest.mark.parametrize("name,raw", [
    ("TRANSPORT_TIMEOUT", "-5"), ("TRANSPORT_TIMEOUT", "0"), ("TRANSPORT_TIMEOUT", "nan"),
    ("START_TIMEOUT", "inf"), ("START_TIMEOUT", "1e300"), ("ELASTIC_TIMEOUT", "-1"),
    ("FUSION_THRESHOLD", "-1"), ("FUSION_THRESHOLD", "1.5"), ("CYCLE_TIME", "-1"),
    ("CACHE_CAPACITY", "-3"), ("SHM_SLOT_BYTES", "1"), ("HIERARCHICAL_PIECE_BYTES", "100"),
    ("SPIN_TIME_US", "-1"), ("AUTOTUNE_STEPS_PER_SAMPLE", "0"),
    ("AUTOTUNE_WARMUP_SAMPLES", "-1"), ("BUCKET_CAP_MB", "-2"), ("FIRST_BUCKET_CAP_MB", "nan"),
    ("STALL_CHECK_TIME_SECONDS", "0"), ("STALL_SHUTDOWN_TIME_SECONDS", "-1"),
    ("METRICS_PERIOD", "0"), ("TIMELINE_MAX_EVENTS", "0"), ("RENDEZVOUS_PORT", "70000"),
    ("RANK", "-1"), ("SIZE", "0"), ("AUTOTUNE", "maybe"), ("SHM_BOARD", "-1"),
    ("BACKEND", "carrier-pigeon"), ("RANK_ASLR", "sometimes"),
])
def test_out_of_range_values_are_refused_naming_variable_value_and_range(name, raw):
    from hora.errors import SettingError
    for prefix in ("HORA_", "HOROVOD_"):
        with pytest.raises(SettingError) as info:
            env_value(name, {prefix + name: raw})
        e = info.value
        assert isinstance(e, ValueError)
        assert (e.variable, e.value) == (prefix + name, raw)
        assert str(e).startswith(f"{prefix}{name}={raw!r}: expected ") and e.allowed in str(e)


def test_the_message_says_what_is_allowed():
    from hora.errors import SettingError
    with pytest.raises(SettingError, match=r"HORA_TRANSPORT_TIMEOUT='-5': expected a number "
                                           r"of seconds > 0 and <= 1000000"):
        env_value("TRANSPORT_TIMEOUT", {"HORA_TRANSPORT_TIMEOUT": "-5"})
    with pytest.raises(SettingError, match=r"HORA_HIERARCHICAL_PIECE_BYTES='1': expected 0 "
                                           r"or a whole number of bytes >= 4096"):
        env_value("HIERARCHICAL_PIECE_BYTES", {"HORA_HIERARCHICAL_PIECE_BYTES": "1"})


def test_horovods_zero_meanings_and_spellings_are_kept():
    """0 turns fusion and the cache off (Horovod's meaning); booleans take Horovod's numbers
    and the usual words; choices ignore case."""
    s = settings_from_env({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CACHE_CAPACITY": "0",
                           "HORA_CYCLE_TIME": "0", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "0",
                           "HORA_HIERARCHICAL_PIECE_BYTES": "0", "HORA_SPIN_TIME_US": "0",
                           "HORA_BACKEND": "TCP", "HORA_LOG_LEVEL": "warn",
                           "HORA_AUTOTUNE": "2", "HOROVOD_STALL_CHECK_DISABLE": "True"})
    assert (s.fusion_threshold, s.cache_capacity, s.cycle_time_ms, s.stall_shutdown_s) == (
        0, 0, 0.0, 0.0)
    assert s.hierarchical_piece_bytes == 0 and s.spin_time_us == 0.0
    assert (s.backend, s.log_level, s.autotune, s.stall_check) == ("tcp", "WARN", True, False)
    assert not env_value("SHM_BOARD", {"HORA_SHM_BOARD": "off"})
    assert env_value("SHM_SLOT_BYTES", {"HORA_SHM_SLOT_BYTES": "4096"}) == 4096


def test_settings_check_every_variable_at_once():
    """init() reads every setting when it starts, those read later (the optimizer's bucket
    size, the metrics period) included; a launcher checks all but the placement it writes."""
    from hora.config import check_settings
    from hora.errors import SettingError
    with pytest.raises(SettingError, match="HORA_BUCKET_CAP_MB='-1'"):
        settings_from_env({"HORA_BUCKET_CAP_MB": "-1"})
    with pytest.raises(SettingError, match="HORA_METRICS_PERIOD='0'"):
        check_settings({"HORA_METRICS_PERIOD": "0"})
    check_settings({"HORA_RANK": "-1"})                     # the launcher writes it over
    with pytest.raises(SettingError, match="HORA_RANK='-1'"):
        check_settings({"HORA_RANK": "-1"}, placement=True)
    # the name that wins is the one checked, as it is the one read
    s = settings_from_env({"HORA_CYCLE_TIME": "1", "HOROVOD_CYCLE_TIME": "x"})
    assert s.cycle_time_ms == 1


def _init_alone(env):
    """Run ``hora.init()`` in a fresh process of its own (a job of one) with ``env`` over a
    clean environment; its stderr's last line, or "ok"."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    code = ("import hora\ntry:\n    hora.init()\nexcept hora.errors.SettingError as e:\n"
            "    print(type(e).__name__, e)\nelse:\n    hora.shutdown()\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**base, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(120)
def test_init_refuses_a_bad_setting_naming_it():
    assert _init_alone({"HORA_TRANSPORT_TIMEOUT": "-5"}) == (
        "SettingError HORA_TRANSPORT_TIMEOUT='-5': expected a number of seconds > 0 and "
        "<= 1000000")
    assert _init_alone({"HOROVOD_START_TIMEOUT": "inf"}).startswith(
        "SettingError HOROVOD_START_TIMEOUT='inf': expected")
    assert _init_alone({"HORA_CYCLE_TIME": "-1"}).startswith("SettingError HORA_CYCLE_TIME")


@pytest.mark.timeout(120)
def test_init_refuses_a_timeline_file_it_could_not_write(tmp_path):
    """HORA_TIMELINE set without hora run: init() fails at once, naming the file, where the
    file could not be made (a directory of its path is a file) or is a directory."""
    (tmp_path / "f").write_text("")
    bad = str(tmp_path / "f" / "d" / "t.json")
    for name in ("HORA_TIMELINE", "HOROVOD_TIMELINE"):
        assert _init_alone({name: bad}) == (
            f"SettingError HORA_TIMELINE={bad!r}: expected a file in a directory "
            f"({tmp_path / 'f'} is not one)")
    assert _init_alone({"HORA_TIMELINE": str(tmp_path)}).startswith(
        f"SettingError HORA_TIMELINE={str(tmp_path)!r}: expected a file, not a directory")
    good = tmp_path / "new" / "t.json"          # missing directories are made
    assert _init_alone({"HORA_TIMELINE": str(good)}) == "ok" and good.exists()
    assert _init_alone({"HORA_TIMELINE": "DYNAMIC"}) == "ok"


def test_writable_file_check_creates_nothing(tmp_path):
    from hora.config import check_writable_file
    check_writable_file("HORA_TIMELINE", str(tmp_path / "a" / "b" / "t.json"))
    assert list(tmp_path.iterdir()) == []
