"""Settings: HORA_* names, HOROVOD_* aliases, defaults, bad values."""
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
