"""The ``hora`` command line as a Horovod user meets it: horovodrun's flags, ``--version``,
usage errors that name what is wrong.  Every case runs the real command (``python -m hora``
or the ``hora`` console script) as a process; none starts a worker.
"""
import os
import shutil
import subprocess
import sys

import pytest

import hora
from hora import config

pytestmark = pytest.mark.timeout(60)


def _env(**extra):
    """This environment without any job's placement or hora settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    return dict(env, **extra)


def _hora(*argv, env=None, exe=(sys.executable, "-m", "hora")):
    return subprocess.run([*exe, *argv], capture_output=True, text=True, timeout=30,
                          env=env or _env(), stdin=subprocess.DEVNULL)


# -- --version -------------------------------------------------------------------------------
def test_version_from_the_module_and_the_console_script():
    out = _hora("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"hora {hora.__version__}\n", "")
    script = shutil.which("hora", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the hora console script is not installed beside this python")
    out = _hora("--version", exe=(script,))
    assert (out.returncode, out.stdout) == (0, f"hora {hora.__version__}\n")


# -- unknown flags ---------------------------------------------------------------------------
def test_unknown_run_flag_shows_run_usage_and_the_closest_flag():
    out = _hora("run", "-np", "2", "--timline-filename", "t.json", "python", "train.py")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: hora run "), out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("hora run: error: unrecognized arguments: --timline-filename "
                    "(did you mean --timeline-filename?)"), out.stderr


def test_unknown_flag_far_from_any_says_only_that():
    out = _hora("run", "-np", "2", "--zzzzzz", "python", "train.py")
    assert out.returncode == 2 and out.stderr.startswith("usage: hora run ")
    assert out.stderr.strip().endswith("unrecognized arguments: --zzzzzz"), out.stderr


def test_unknown_top_level_flag_suggests_too():
    out = _hora("--versoin")
    assert out.returncode == 2 and out.stderr.startswith("usage: hora ")
    assert "(did you mean --version?)" in out.stderr


# -- horovodrun's elastic flags ----------------------------------------------------------------
def _elastic(argv):
    """The ElasticSettings ``hora run ARGV python train.py`` would launch with (None: a fixed
    job), without launching."""
    from hora.runner import cli
    parser = cli.build_parser()
    args = parser.parse_args(["run", *argv, "python", "train.py"])
    return cli._elastic_settings(args, parser._subparsers._group_actions[0].choices["run"])


def test_horovodrun_elastic_flags_are_parsed():
    s = _elastic(["-np", "2", "--min-num-proc", "1", "--max-num-proc", "8",
                  "--host-discovery-script", "./discover.sh", "--reset-limit", "3",
                  "--blacklist-cooldown-range", "10", "100", "--slots-per-host", "2",
                  "--elastic-timeout", "60"])
    assert (s.min_np, s.max_np, s.discovery_script, s.reset_limit, s.cooldown, s.slots,
            s.timeout_s) == (1, 8, "./discover.sh", 3, (10.0, 100.0), 2, 60.0)


def test_elastic_defaults_follow_np():
    assert _elastic(["-np", "4"]) is None
    s = _elastic(["-np", "4", "--min-np", "2"])
    assert (s.min_np, s.max_np, s.discovery_script, s.cooldown, s.timeout_s) == \
        (2, 4, None, None, 600.0)
    assert _elastic(["-np", "3", "--host-discovery-script", "d.sh"]).max_np is None


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--min-np", "3", "--max-np", "2"], "--max-np 2 is less than --min-np 3"),
    (["-np", "2", "--min-np", "0"], "--min-np must be at least 1"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "0.5", "10"],
     "expected 1 <= MIN <= MAX <= 3600"),
    (["-np", "2", "--reset-limit", "3"], "--reset-limit is for elastic jobs"),
])
def test_bad_elastic_flags_exit_2_naming_them(argv, message):
    out = _hora("run", *argv, "python", "train.py")
    assert out.returncode == 2, out.stderr
    assert message in out.stderr


def test_discovery_script_and_hosts_exclude_each_other():
    out = _hora("run", "-np", "2", "--host-discovery-script", "d.sh", "-H", "a:2",
                "python", "train.py")
    assert out.returncode == 2
    assert "--host-discovery-script and -H/--hostfile exclude each other" in out.stderr


# -- usage errors that name the culprit --------------------------------------------------------
def test_missing_hostfile_is_named_and_exits_2(tmp_path):
    missing = tmp_path / "missing.txt"
    out = _hora("run", "-np", "2", "--hostfile", str(missing), "python", "train.py")
    assert out.returncode == 2, out.stderr
    assert f"hostfile {str(missing)!r}: cannot read it: No such file or directory" in out.stderr
    assert "cannot start" not in out.stderr


def test_gloo_and_mpi_exclude_each_other():
    out = _hora("run", "-np", "2", "--gloo", "--mpi", "python", "train.py")
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_bad_log_level_flag_lists_the_levels():
    out = _hora("run", "-np", "1", "--log-level", "verbose", "true")
    assert out.returncode == 2
    assert "invalid choice: 'VERBOSE'" in out.stderr and "TRACE" in out.stderr


@pytest.mark.parametrize("name", ["HORA_LOG_LEVEL", "HOROVOD_LOG_LEVEL"])
def test_bad_log_level_in_the_environment_fails_the_launch(name):
    out = _hora("run", "-np", "1", "true", env=_env(**{name: "verbose"}))
    assert out.returncode == 2
    assert out.stderr == (f"hora: {name}='verbose': expected one of "
                          f"{', '.join(config.LOG_LEVELS)}\n")


# -- HORA_LOG_LEVEL as a setting ---------------------------------------------------------------
@pytest.mark.parametrize("raw,value", [("debug", "DEBUG"), (" Trace ", "TRACE"),
                                       ("warn", "WARN"), ("FATAL", "FATAL")])
def test_log_level_accepts_horovods_and_pythons_names(raw, value):
    assert config.env_value("LOG_LEVEL", {"HOROVOD_LOG_LEVEL": raw}) == value
    assert config.settings_from_env({"HORA_LOG_LEVEL": raw}).log_level == value


@pytest.mark.parametrize("raw", ["verbose", "1", "warnings", "info debug"])
def test_log_level_rejects_what_it_does_not_know(raw):
    with pytest.raises(ValueError, match=f"HORA_LOG_LEVEL={raw!r}: expected one of TRACE"):
        config.settings_from_env({"HORA_LOG_LEVEL": raw})


def test_timeline_is_a_declared_setting():
    assert config.env_value("TIMELINE", {}) is None
    assert config.env_value("TIMELINE", {"HOROVOD_TIMELINE": "/tmp/t.json"}) == "/tmp/t.json"


# -- settings are checked before any rank starts -----------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--fusion-threshold-mb", "-1"], "argument --fusion-threshold-mb: '-1' sets "
     "HORA_FUSION_THRESHOLD='-1048576': expected a whole number of bytes >= 0"),
    (["--cycle-time-ms", "nan"], "argument --cycle-time-ms: expected a number of "
     "milliseconds >= 0"),
    (["--cache-capacity", "-3"], "argument --cache-capacity: expected a whole number >= 0"),
    (["--autotune-steps-per-sample", "0"], "argument --autotune-steps-per-sample: expected "
     "a whole number >= 1"),
    (["--stall-check-warning-time-seconds", "-1"], "argument "
     "--stall-check-warning-time-seconds: expected a number of seconds > 0"),
    (["--start-timeout", "inf"], "argument --start-timeout: expected a number of seconds > 0 "
     "and <= 1000000, got 'inf'"),
    (["--timeout", "0"], "argument --timeout: expected a number of seconds > 0"),
    (["--check-timeout", "nan"], "argument --check-timeout: expected a number of seconds"),
    (["--min-np", "1", "--elastic-timeout", "inf"], "argument --elastic-timeout: expected"),
])
def test_bad_setting_flags_exit_2_naming_flag_and_range(argv, message):
    out = _hora("run", "-np", "2", *argv, "python", "train.py")
    assert out.returncode == 2, out.stderr
    assert message in out.stderr, out.stderr


def test_zero_flags_keep_horovods_meaning():
    """--fusion-threshold-mb 0 turns fusion off and --cache-capacity 0 the cache, as
    horovodrun's do; both pass the checks."""
    from hora.runner import cli
    args = cli.build_parser().parse_args(["run", "-np", "1", "--fusion-threshold-mb", "0",
                                          "--cache-capacity", "0", "true"])
    env = cli._worker_settings(args)
    assert (env["HORA_FUSION_THRESHOLD"], env["HORA_CACHE_CAPACITY"]) == ("0", "0")
    assert config.settings_from_env(env).fusion_threshold == 0


@pytest.mark.parametrize("name,raw", [("HORA_TRANSPORT_TIMEOUT", "-5"),
                                      ("HORA_TRANSPORT_TIMEOUT", "nan"),
                                      ("HOROVOD_START_TIMEOUT", "inf"),
                                      ("HORA_SHM_SLOT_BYTES", "1"),
                                      ("HOROVOD_CACHE_CAPACITY", "-3")])
def test_bad_setting_in_the_environment_fails_the_launch(name, raw):
    out = _hora("run", "-np", "2", sys.executable, "-c", "print('started')",
                env=_env(**{name: raw}))
    assert out.returncode == 2 and "started" not in out.stdout
    assert out.stderr.startswith(f"hora: {name}={raw!r}: expected a "), out.stderr


def test_unwritable_timeline_file_fails_the_launch_naming_it(tmp_path):
    """Rank 0 could not write the file (its directory would be under a file): hora run
    says so before any rank starts, whether the flag or the environment names it."""
    (tmp_path / "f").write_text("")
    path = str(tmp_path / "f" / "d" / "t.json")
    for argv, env in (((("--timeline-filename", path)), None),
                      ((), _env(HOROVOD_TIMELINE=path))):
        for how in ((), ("--min-np", "1")):
            out = _hora("run", "-np", "2", *how, *argv, sys.executable, "-c",
                        "print('started')", env=env)
            assert out.returncode == 2 and "started" not in out.stdout, out.stderr
            assert f"TIMELINE={path!r}: expected a file in a directory" in out.stderr
            assert ("--timeline-filename: " in out.stderr) == bool(argv)
    assert not (tmp_path / "f" / "d").exists()


def test_double_dash_separates_the_command():
    from hora.runner import cli
    args = cli.build_parser().parse_args(["run", "-np", "2", "--", "python", "x.py", "--",
                                          "-np"])
    assert args.command == ["python", "x.py", "--", "-np"] and args.np == 2
    args = cli.build_parser().parse_args(["run", "-np", "2", "python", "--", "x"])
    assert args.command == ["python", "--", "x"]


def test_mpi_args_replace_the_defaults_they_name():
    """hora run --mpi: an option of --mpi-args replaces hora's default of that option (a
    mapping option replaces --map-by; an MCA parameter, hora's value of it); others stay."""
    from hora.runner.hosts import parse_hosts
    from hora.runner.mpi_run import mpirun_command

    def argv(mpi_args):
        return " ".join(mpirun_command(["python", "t.py"], 2, parse_hosts("a:2"), {},
                                       network_interface="eth1", mpi_args=mpi_args,
                                       as_root=False))
    plain = argv(None)
    for default in ("--bind-to none", "--map-by slot", "--mca pml ob1", "--mca btl ^openib",
                    "--mca btl_tcp_if_include eth1", "--tag-output"):
        assert plain.count(default) == 1, plain
    both = argv("--bind-to core --map-by node --mca pml ucx --oversubscribe")
    for option in ("--bind-to", "--map-by", "--mca pml"):
        assert both.count(option) == 1, both
    assert "--bind-to core --map-by node --mca pml ucx --oversubscribe python t.py" in both
    assert "--mca btl ^openib" in both and "--tag-output" in both
    assert "--map-by" not in argv("-npernode 1")
    assert "btl_tcp_if_include eth1" not in argv("--mca btl_tcp_if_include eth0")


# -- torchrun's habits: a .py first word, --nproc-per-node -----------------------------------
def _script(path, text, executable):
    path.write_text(text)
    path.chmod(0o755 if executable else 0o644)
    return path


def test_a_py_first_word_runs_with_this_python_unless_it_runs_by_itself(tmp_path, monkeypatch):
    from hora.runner.launch_config import LaunchConfig, script_command
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    (tmp_path / "bin").mkdir()
    _script(tmp_path / "plain.py", "print(1)\n", executable=False)
    _script(tmp_path / "nobang.py", "print(1)\n", executable=True)
    _script(tmp_path / "bang.py", "#!/bin/sh\necho 1\n", executable=True)
    _script(tmp_path / "bin" / "tool.py", "#!/bin/sh\necho 1\n", executable=True)
    py = sys.executable
    cases = {
        ("plain.py", "--lr", "0.1"): [py, "plain.py", "--lr", "0.1"],     # no execute bit
        ("nobang.py",): [py, "nobang.py"],                      # exec would fail: no #!
        ("bang.py",): [py, "bang.py"],                          # not on PATH: exec won't find it
        ("./bang.py", "x"): ["./bang.py", "x"],                 # runs by itself
        (str(tmp_path / "bang.py"),): [str(tmp_path / "bang.py")],
        ("tool.py",): ["tool.py"],                              # on PATH, runs by itself
        ("missing.py",): [py, "missing.py"],                    # python names the missing file
        ("python", "plain.py"): ["python", "plain.py"],         # not a .py first word
        ("train.pyc",): ["train.pyc"],
    }
    for command, expected in cases.items():
        assert script_command(command) == expected, command
    assert script_command(["plain.py"], python="/opt/py") == ["/opt/py", "plain.py"]
    # the one place every launch path reads (hora run, --mpi, elastic, the Python API)
    assert LaunchConfig(["plain.py", "a"], 2).command == [py, "plain.py", "a"]


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "4"], "--nproc-per-node is torchrun's flag: hora run takes -np N, "
                                "the number of processes in all (here, -np 4 for one host)"),
    (["--nproc_per_node=gpu"], "--nproc_per_node is torchrun's flag: hora run takes -np N, "
                               "the number of processes in all; on several hosts"),
    (["--nnodes", "2", "-np", "4"], "--nnodes is torchrun's flag: hora run takes the hosts "
                                    "with -H"),
])
def test_torchruns_flags_exit_2_pointing_to_np(argv, message):
    out = _hora("run", *argv, "train.py")
    assert out.returncode == 2 and out.stderr.startswith("usage: hora run "), out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"hora run: error: {message}"), \
        out.stderr


def test_run_help_says_how_a_py_runs_and_ends_with_examples():
    out = _hora("run", "--help")
    assert out.returncode == 0, out.stderr
    assert "first word ends in .py runs with this Python" in out.stdout
    examples = out.stdout.split("\nexamples:\n", 1)[1].splitlines()
    assert examples[0].split() == ["hora", "run", "-np", "4", "python", "train.py", "4",
                                   "processes", "on", "this", "machine"]
    assert any("train.py --lr" in line and "python" not in line for line in examples)
    assert "--nproc" not in out.stdout          # the torchrun hints stay out of the help
