"""Pure parts of remote launching: ssh command lines, ssh failure reasons, mpirun's argv."""
import os
import subprocess
import sys

import pytest

from hora.errors import HostCheckError
from hora.runner.hosts import parse_hosts
from hora.runner.mpi_run import mpirun_command
from hora.runner.remote import (HostReport, Multiplex, SshSettings, _ssh_failure,
                                agent_shell_command, choose_address, remote_argv)


def test_default_ssh_argv_has_port_key_and_batch_mode():
    argv = remote_argv(SshSettings(port=2222, identity_file="/k"), "hostA", "echo hi")
    assert argv[0] == "ssh" and argv[-2:] == ["hostA", "echo hi"]
    assert "BatchMode=yes" in argv and argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/k"


def test_ssh_command_template_places_host_and_command():
    netns = SshSettings(command="ip netns exec {host} sh -c {command}")
    assert remote_argv(netns, "ns1", "cd /x && run") == [
        "ip", "netns", "exec", "ns1", "sh", "-c", "cd /x && run"]
    # without placeholders: host, then the command line, appended as ssh takes them
    plain = SshSettings(command="ssh -o Foo=bar", port=7)
    assert remote_argv(plain, "h", "ls") == ["ssh", "-p", "7", "-o", "Foo=bar", "h", "ls"]
    with pytest.raises(ValueError, match="apply to ssh"):
        remote_argv(SshSettings(command="ip netns exec {host}", port=7), "h", "ls")
    with pytest.raises(ValueError, match="1..65535"):
        SshSettings(port=0)


def _control_path(argv):
    return next(a.split("=", 1)[1] for a in argv if a.startswith("ControlPath="))


def test_a_hosts_sessions_share_a_connection_for_every_sessions_of_them():
    shared = Multiplex(2, {"a": 5, "b": 1})
    try:
        check = remote_argv(SshSettings(), "a", "check", shared.options("a", count=False))
        assert "ControlMaster=auto" in check and check[-2:] == ["a", "check"]
        # the check's connection is the first two ranks'; the next two share a second one,
        # opened with the check (spare), the fifth rank a third
        spare = [_control_path(o) for o in shared.spare("a")]
        ranks = [_control_path(shared.options("a")) for _ in range(5)]
        assert ranks[0] == ranks[1] == _control_path(check)
        assert ranks[2] == ranks[3] == spare[0] and ranks[4] == spare[1]
        assert len(set(ranks)) == 3 and shared.spare("b") == []
        b = _control_path(shared.options("b"))
        assert b not in ranks and len(b) < 100      # a Unix socket's path is < 108 bytes
    finally:
        shared.close()
    assert os.stat(shared.dir).st_mode & 0o777 == 0o700     # the user's alone


def test_agent_command_carries_no_environment_but_pythonpath():
    line = agent_shell_command("/work dir", "/usr/bin/python3", "/src")
    assert line == ("cd '/work dir' && PYTHONPATH=/src exec /usr/bin/python3 -u -m "
                    "hora.runner.remote_agent")


def test_the_agent_imports_no_more_of_hora_than_it_runs():
    """A remote rank's agent starts once a rank: it loads the runner's process helpers, not
    the launcher, the rendezvous or the engine (``hora.runner`` imports its names on first
    use), while the package's names still resolve."""
    code = ("import sys, hora.runner.remote_agent\n"
            "print(sorted(m for m in sys.modules if m.startswith('hora.')))\n"
            "from hora.runner import launch, run, LaunchConfig\n"
            "import hora.runner.cli, hora.runner\n"
            "print(callable(hora.runner.launch), launch is hora.runner.launch)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True)
    loaded, resolved = out.stdout.splitlines()
    assert "'hora.runner.proc'" in loaded, loaded
    for heavy in ("hora.runner.launcher", "hora.runner.hosts", "hora.rendezvous",
                  "hora.config", "hora.core"):
        assert f"'{heavy}" not in loaded, loaded
    assert resolved == "True True", out.stdout


@pytest.mark.parametrize("stderr, reason", [
    ("ssh: connect to host a port 22: Connection refused", "ssh refused"),
    ("root@a: Permission denied (publickey).", "ssh authentication failed"),
    ("ssh: connect to host a port 22: No route to host", "unreachable"),
    ("ssh: Could not resolve hostname nohost: Name or service not known", "unreachable"),
    ("ssh: connect to host a port 22: Connection timed out", "unreachable"),
])
def test_ssh_failures_are_named(stderr, reason):
    assert _ssh_failure(stderr, SshSettings(), "a").startswith(reason)


def test_address_every_host_reaches_is_chosen():
    reports = {"a": HostReport("a", "1", "3", ("10.0.0.1", "10.1.0.1"), 0.1),
               "b": HostReport("b", "1", "3", ("10.1.0.1",), 0.1)}
    assert choose_address(reports, ["10.0.0.1", "10.1.0.1"]) == "10.1.0.1"
    assert choose_address(reports, ["10.0.0.1"]) is None


def test_host_check_error_names_every_host():
    error = HostCheckError({"b": "unreachable: x", "c": "ssh refused: y"})
    assert (error.host, error.reason) == ("b", "unreachable: x")
    assert "  b: unreachable: x\n  c: ssh refused: y" in str(error)


def test_mpirun_command_uses_horovods_flags_and_exports_names_only():
    env = {"HORA_SECRET": "s3cr3t", "PATH": "/bin", "HOME": "/root", "OMPI_X": "1",
           "BAD-NAME": "1"}
    argv = mpirun_command(["python", "t.py"], 4, parse_hosts("a:2,b:2"), env,
                          ssh=SshSettings(port=2222), network_interface="eth1", as_root=True)
    text = " ".join(argv)
    assert argv[:2] == ["mpirun", "--allow-run-as-root"] and argv[-2:] == ["python", "t.py"]
    for flags in ("-np 4", "-H a:2,b:2", "--bind-to none", "--map-by slot", "--mca pml ob1",
                  "--mca btl ^openib", "--mca btl_tcp_if_include eth1",
                  "--mca plm_rsh_args -p 2222", "-x HORA_SECRET", "-x PATH"):
        assert flags in text
    assert "s3cr3t" not in text                       # values stay in the environment
    assert "-x HOME" not in text and "OMPI_X" not in text and "BAD-NAME" not in text


# -- the start-up check against a "host" that is this machine (any --ssh-command works) ------
def _local_ssh():
    from hora.runner.remote import SshSettings
    return SshSettings(command="env CHECKED_HOST={host} sh -c {command}")


def test_check_names_the_host_and_a_hora_version_mismatch(tmp_path):
    import sys
    from hora.errors import HostCheckError
    from hora.runner.remote import check_hosts
    fake = tmp_path / "other" / "hora"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.0.0-elsewhere'\n")
    with pytest.raises(HostCheckError) as err:
        check_hosts(["fakehost"], _local_ssh(), str(tmp_path), sys.executable,
                    pythonpath=str(tmp_path / "other"), timeout=20)
    assert "fakehost" in str(err.value) and "hora version mismatch" in str(err.value)
    assert "0.0.0-elsewhere" in str(err.value)


def test_check_names_a_missing_python_and_passes_a_good_host(tmp_path):
    import sys
    from hora.errors import HostCheckError
    from hora.runner.remote import check_hosts
    with pytest.raises(HostCheckError) as err:
        check_hosts(["fakehost"], _local_ssh(), str(tmp_path), "/nonexistent/python3",
                    timeout=20)
    assert "python /nonexistent/python3 is missing on fakehost" in str(err.value)
    import hora
    reports = check_hosts(["goodhost"], _local_ssh(), str(tmp_path), sys.executable,
                          timeout=20)
    assert reports["goodhost"].version == hora.__version__
    # its kernel and CPUs, as this machine's own (the check ran here)
    from hora.core.topology import kernel_id, usable_cpus
    assert kernel_id()
    assert (reports["goodhost"].kernel, reports["goodhost"].cpus) == (kernel_id(),
                                                                     usable_cpus())
    # and whether ranks there may have one address layout, as here
    from hora.runner.proc import fixed_layout_refused
    assert reports["goodhost"].layout_refused == (fixed_layout_refused() or "")


@pytest.mark.parametrize("policy, ranks, machines, fixed", [
    # two namespaces of one 2-CPU machine, 2 ranks each: 4 ranks take turns on 2 CPUs
    ("auto", {"a": 2, "b": 2}, {"a": ("k", 2), "b": ("k", 2)}, {"a", "b"}),
    # the same layout on two machines: each rank has a CPU
    ("auto", {"a": 2, "b": 2}, {"a": ("k1", 2), "b": ("k2", 2)}, set()),
    # one machine crowded, the other not
    ("auto", {"a": 3, "b": 1}, {"a": ("k1", 2), "b": ("k2", 2)}, {"a"}),
    # an unknown kernel id: the host is a machine of its own, never merged with another
    ("auto", {"a": 2, "b": 2}, {"a": ("", 2), "b": ("", 2)}, set()),
    ("auto", {"a": 2, "b": 2}, {"a": ("", 3), "b": ("", 1)}, {"b"}),
    # hosts of one machine may report different affinities: the most CPUs count
    ("auto", {"a": 2, "b": 2}, {"a": ("k", 4), "b": ("k", 2)}, set()),
    # CPUs unknown: left as the system has it
    ("auto", {"a": 4}, {"a": ("", 0)}, set()),
    ("on", {"a": 8}, {"a": ("k", 1)}, set()),
    ("off", {"a": 1, "b": 1}, {"a": ("k1", 64), "b": ("k2", 64)}, {"a", "b"}),
])
def test_layout_hosts_counts_the_ranks_of_every_host_under_one_kernel(policy, ranks, machines,
                                                                     fixed):
    from hora.runner.proc import layout_hosts
    assert layout_hosts(policy, ranks, machines) == fixed
