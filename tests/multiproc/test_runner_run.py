"""``hora.runner.run`` (and ``hora.run``, its Horovod name) with real processes: results by
rank, the workers' imports, a failing, killed or hung worker, Horovod's keyword names."""
import importlib
import os
import signal
import sys
import time

import pytest

import hora
import hora.runner
from hora.errors import CollectiveTimeoutError, WorkerFailedError
from hora.runner import run


# -- hora.runner.run ---------------------------------------------------------------------------
def _rank_times(k):
    return int(os.environ["HORA_RANK"]) * k, os.environ["HORA_SIZE"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np", [1, 2, 4])
def test_run_returns_results_by_rank(np):
    assert run(_rank_times, args=(10,), np=np) == [(10 * r, str(np)) for r in range(np)]


def _where_hora_is():
    import hora
    return hora.__file__


@pytest.mark.timeout(60)
def test_run_workers_import_what_the_caller_imports_whatever_the_working_directory(
        tmp_path, monkeypatch):
    """A package of the same name in the working directory does not shadow the caller's:
    the workers' path is the caller's (a script's, which does not hold the working
    directory; ``python -m pytest`` puts it there as '')."""
    import hora
    fake = tmp_path / "hora"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the working directory\\'s hora')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    assert run(_where_hora_is, np=2) == [hora.__file__] * 2


def _raise_on_rank_one():
    if os.environ["HORA_RANK"] == "1":
        raise ValueError("bad rank 1")
    return "fine"


@pytest.mark.timeout(60)
def test_run_raises_with_the_remote_traceback():
    with pytest.raises(WorkerFailedError) as info:
        run(_raise_on_rank_one, np=3)
    error = info.value
    assert (error.rank, error.exitcode, error.host) == (1, 1, "localhost")
    assert "ValueError: bad rank 1" in error.detail
    assert "_raise_on_rank_one" in error.detail               # the remote traceback
    assert "ValueError: bad rank 1" in str(error)


def _killed_on_rank_zero():
    import time
    if os.environ["HORA_RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.timeout(60)
def test_run_reports_a_killed_worker():
    with pytest.raises(WorkerFailedError) as info:
        run(_killed_on_rank_zero, np=2, grace_s=1.0)
    assert info.value.rank == 0
    assert info.value.exitcode == -signal.SIGKILL
    assert "was killed by signal SIGKILL" in info.value.detail


def _hang():
    import time
    time.sleep(60)


@pytest.mark.timeout(60)
def test_run_timeout_dumps_tracebacks_and_names_ranks(capsys):
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        run(_hang, np=2, timeout_s=2)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "[rank 0] still running" in message and "[rank 1] still running" in message
    err = capsys.readouterr().err
    for rank in range(2):
        assert f"[{rank}]<stderr>:" in err
    assert "most recent call first" in err and "in _hang" in err, err


def _report(tag):
    return (int(os.environ["HORA_RANK"]), os.environ.get("HORA_IFACE"),
            os.environ.get("VIA_WRAPPER"), os.environ.get("HORA_START_TIMEOUT"), tag)


@pytest.mark.timeout(60)
def test_hora_run_takes_horovods_keyword_names(tmp_path, caplog):
    # a Python "executable" of our own: it marks the environment, then runs this Python
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\nVIA_WRAPPER=yes exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    logs = tmp_path / "logs"
    results = hora.run(_report, args=("t",), num_proc=3, hosts="localhost:2,127.0.0.1:2",
                       start_timeout=20, output_filename=str(logs), verbose=True,
                       network_interfaces=["lo"], executable=str(wrapper),
                       disable_cache=True, use_gloo=True, ssh_port=2222)
    assert results == [(r, "lo", "yes", "20.0", "t") for r in range(3)]
    assert sorted(p.name for p in logs.iterdir()) == ["rank.0", "rank.1", "rank.2"]
    # verbose: the launcher's progress, through the logging pytest configured
    assert any(r.name == "hora.runner.launcher" and r.levelname == "DEBUG"
               and r.getMessage().startswith("started rank 2") for r in caplog.records)
    # same value under both names: fine
    assert hora.run(_report, args=("u",), np=2, num_proc=2)[1][0] == 1


def test_public_api():
    # (the names of hora.runner are imported on first use)
    for module in (hora.runner, importlib.import_module("hora.runner.launcher")):
        for name in module.__all__:
            assert hasattr(module, name)
    assert hora.runner.run is run
