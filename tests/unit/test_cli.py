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
