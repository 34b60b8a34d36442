"""``hora.run``'s arguments as ``horovod.run`` names them: checked before any process starts.

(The jobs themselves run in tests/multiproc/test_launcher.py.)
"""
import inspect
import typing

import pytest

import hora
import hora.runner
from hora.runner import SshSettings
from hora.runner import run_func

pytestmark = pytest.mark.timeout(30)

# horovod.run's keyword names (horovod/runner/__init__.py), beside hora's own
HOROVOD_NAMES = ["num_proc", "hosts", "hostfile", "start_timeout", "ssh_port",
                 "ssh_identity_file", "output_filename", "verbose", "network_interface",
                 "executable", "disable_cache", "use_gloo", "use_mpi", "mpi_args",
                 "min_num_proc", "max_num_proc", "slots", "reset_limit", "cooldown_range"]


def _never_called():
    raise AssertionError("no worker should have run")


def test_horovods_names_are_parameters_of_both_entry_points():
    for fn in (hora.run, hora.runner.run):
        names = inspect.signature(fn).parameters
        missing = [n for n in [*HOROVOD_NAMES, "np", "network_interfaces"] if n not in names]
        assert missing == [], (fn, missing)


def test_hora_run_has_the_runners_signature():
    # hora.run is a light wrapper (the runner loads on first use): the two must not drift
    ours, runner = inspect.signature(hora.run), inspect.signature(hora.runner.run)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in runner.parameters.values()]


def test_the_runners_type_hints_resolve():
    hints = typing.get_type_hints(hora.runner.run)
    assert hints["np"] == typing.Optional[int] and hints["num_proc"] == typing.Optional[int]
    assert hints["ssh"] == typing.Optional[SshSettings]
    assert set(hints) == set(inspect.signature(hora.runner.run).parameters) | {"return"}


@pytest.mark.parametrize("kwargs,message", [
    ({"np": 2, "num_proc": 3}, r"run\(np=2, num_proc=3\): the two name the same setting"),
    ({"network_interface": "eth0", "network_interfaces": "eth1"},
     r"run\(network_interface='eth0', network_interfaces='eth1'\)"),
    ({"ssh": SshSettings(port=22), "ssh_port": 2222},
     r"run\(ssh.port=22, ssh_port=2222\)"),
    ({"ssh": SshSettings(identity_file="a"), "ssh_identity_file": "b"},
     r"run\(ssh.identity_file='a', ssh_identity_file='b'\)"),
    ({"use_gloo": True, "use_mpi": True}, "choose one launcher"),
    ({"num_proc": 0}, "positive integer, got 0"),
])
def test_conflicting_or_bad_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hora.run(_never_called, **kwargs)


@pytest.mark.parametrize("kwargs", [{"slots": 2}, {"reset_limit": 1},
                                    {"cooldown_range": (1, 10)}, {"elastic_timeout": 5}])
def test_elastic_details_without_an_elastic_job_are_value_errors(kwargs):
    with pytest.raises(ValueError, match="is for elastic jobs: give min_num_proc"):
        hora.run(_never_called, num_proc=2, **kwargs)


def test_bad_elastic_ranges_are_value_errors():
    with pytest.raises(ValueError, match="--max-np 1 is less than --min-np 2"):
        hora.run(_never_called, num_proc=2, min_num_proc=2, max_num_proc=1)


def test_use_mpi_names_the_alternative():
    with pytest.raises(NotImplementedError, match="hora run --mpi"):
        hora.run(_never_called, num_proc=2, use_mpi=True)


def test_ssh_settings_take_horovods_names():
    assert run_func._ssh(None, 2222, "/k") == SshSettings(port=2222, identity_file="/k")
    merged = run_func._ssh(SshSettings(command="ip netns exec {host}"), 2222, None)
    assert merged == SshSettings(port=2222, command="ip netns exec {host}")
    assert run_func._ssh(SshSettings(port=22), 22, None) == SshSettings(port=22)
    with pytest.raises(TypeError, match="SshSettings"):
        run_func._ssh({"port": 22}, None, None)
