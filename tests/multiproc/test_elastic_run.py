"""Elastic jobs end to end: ``hora run --min-np ...`` with real worker processes, killed with
SIGKILL mid-epoch, added by a discovery script, blacklisted and re-admitted.

Jobs share where one job can show several things: the two killed-worker cases are one job
(rank 0 dies in round 0, another worker in round 1), and so are the host added by discovery
and the worker replaced after the blacklist cooldown; each test checks its own part.  The
tests that check only what the launcher does when workers die (--elastic-timeout,
--reset-limit) run a NumPy job (``_LIGHT``) whose workers do not import torch.

The other jobs run tests/elastic_main.py: a small MLP trained with ``hvd.elastic.run`` over an
ElasticSampler with a fixed *global* batch (each rank takes ``12 / size()`` samples a step), so
that whatever the number of workers each step averages the gradient of the same 12 samples
in the same order.  The checks are against numbers computed independently:

- the final weights equal one process training on those global batches
  (``elastic_main.reference_weights``) to float tolerance: no committed step was lost and no
  step after the last commit was applied twice;
- each epoch's processed samples, gathered from every rank at every step and committed with
  the state, are exactly the dataset once: nothing skipped or seen twice after the commit
  point;
- the surviving workers kept their process ids across the re-formation: they recovered
  in-process, nothing restarted them.
"""
import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from tests import elastic_main
from tests.helpers import TF_EXTRAS, survivors, without

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "elastic_main.py")
SAMPLES = elastic_main.SAMPLES


@pytest.fixture(scope="module")
def reference():
    return elastic_main.reference_weights()


# A job for the tests that check only what the launcher does when workers die (no report
# comes back): 20 steps of an allreduce in hvd.elastic.run, committing every 2, on NumPy,
# so that its workers do not import torch.  argv[1]: "R:S[,R:S...]", the worker that is
# rank R in the first round (``w<N>``: the worker named N) kills itself before step S.
_LIGHT = """\
import json, os, signal, sys
import numpy as np
import hora, hora.elastic
from hora.core import membership
kills = [item.split(":") for item in sys.argv[1].split(",")]
hora.init()
me = os.environ["HORA_ELASTIC_ID"]
state = hora.elastic.ObjectState(hora.broadcast_object, hora.rank, step=0)

@hora.elastic.run
def train(state):
    while state.step < 20:
        first = membership.current_round() == 0
        for who, step in kills:
            if int(step) == state.step and (who == "w" + me or first and who == str(hora.rank())):
                os.kill(os.getpid(), signal.SIGKILL)
        hora.allreduce(np.ones(1), name="s")
        state.step += 1
        if state.step % 2 == 0:
            state.commit()

train(state)
if hora.rank() == 0:
    with open(os.environ["ELASTIC_OUT"], "w") as f:
        json.dump({"steps": state.step}, f)
hora.shutdown()
"""


def _run(tmp_path, flags, env=None, timeout=60, light_kills=None):
    """``hora run FLAGS python elastic_main.py`` (with ``light_kills``: the NumPy job
    :data:`_LIGHT` with those kills); returns (CompletedProcess, report or None,
    seconds)."""
    out = tmp_path / "report.json"
    marker = f"hora-elastic-{uuid.uuid4().hex}"
    full_env = dict(os.environ, ELASTIC_OUT=str(out), **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, full_env.get("PYTHONPATH", "")])
    command = [SCRIPT, marker]
    if light_kills is not None:
        light = tmp_path / "light.py"
        light.write_text(_LIGHT)
        command = [str(light), light_kills, marker]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hora", "run", *flags, sys.executable,
                           *command], capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    assert survivors(marker, 5.0) == [], "processes of the job were left alive"
    report = json.loads(out.read_text()) if out.exists() else None
    return done, report, took


_check_training = elastic_main.check_training
_kept_pids = elastic_main.check_kept_pids


@pytest.fixture(scope="module")
def two_kills(tmp_path_factory, reference):
    """One job for both killed-worker cases: worker 0 (rank 0, the coordinator) dies at
    epoch 0 batch 3 in round 0, then worker 2 (rank 1 of the 3 left: not the coordinator)
    at epoch 1 batch 3 in round 1.  Each leaving takes its own path through the same job,
    as it did in a job of its own, and one job starts 4 torch workers instead of 8."""
    return _run(tmp_path_factory.mktemp("two_kills"), ["-np", "4", "--min-np", "2"],
                {"ELASTIC_KILL": "0:0:3,w2:1:3"}, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", ["worker", "rank0"])
def test_killed_worker_leaves_and_the_others_finish_in_process(two_kills, reference, victim):
    done, report, _ = two_kills
    assert done.returncode == 0, done.stderr[-3000:]
    killed = "0" if victim == "rank0" else "2"
    assert any(line.startswith(f"[hora] ERROR: worker {killed} (pid") and
               line.endswith("was killed by signal SIGKILL")
               for line in done.stderr.splitlines()), done.stderr[-3000:]
    _check_training(report, reference)
    assert report["final_size"] == 2 and report["round"] == 2
    steps_per_epoch = SAMPLES // 12
    sizes = report["sizes"]
    assert len(sizes) == 3 * steps_per_epoch
    if victim == "rank0":
        # epoch 0 batch 3 is where rank 0 died: batches 0-1 were committed at 4 workers,
        # the rest (from the commit at batch 2) ran at 3 until the second kill's commit
        assert "round 1 (removed): 3 worker(s)" in done.stderr
        assert sizes[:steps_per_epoch + 2] == [4] * 2 + [3] * steps_per_epoch
    else:
        # epoch 1 batch 3 is where the worker died: from the commit at epoch 1 batch 2 on,
        # the job ran at 2
        assert "round 2 (removed): 2 worker(s)" in done.stderr
        assert sizes[steps_per_epoch + 2:] == [2] * (2 * steps_per_epoch - 2)
    _kept_pids(report)
    assert all(len(entries) == 3 for entries in report["pids"])    # all three rounds


@pytest.fixture(scope="module")
def grown_and_replaced(tmp_path_factory, reference):
    """One job for a host added by discovery and a killed worker replaced after the
    blacklist cooldown, each in rounds of its own, as each was in a job of its own (one
    job starts 4 torch workers instead of 3 and 4).  The discovery script lists localhost:2;
    rank 0 makes it localhost:3 at epoch 0 batch 2, and the job holds at epoch 0 batch 4
    until the third worker is in (round 1, added).  Worker 1 dies at epoch 1 batch 3
    (round 2, removed); localhost is blacklisted for 1 s, then a new worker starts there
    and the job holds at epoch 2 batch 2 until it is in (round 3, added)."""
    tmp_path = tmp_path_factory.mktemp("grown_and_replaced")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    return _run(
        tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                   f"cat {hosts}", "--blacklist-cooldown-range", "1", "1"],
        {"ELASTIC_GROW": f"0:2:{hosts}:localhost:3\\n", "ELASTIC_HOLD": "0:4:3,2:2:3",
         "ELASTIC_KILL": "w1:1:3"}, timeout=120)


@pytest.mark.timeout(150)
def test_host_added_by_discovery_joins_at_a_commit(grown_and_replaced, reference):
    done, report, _ = grown_and_replaced
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round 1 (added): 3 worker(s)" in done.stderr
    _check_training(report, reference)
    sizes = report["sizes"]
    # 2 workers up to the hold at epoch 0 batch 4, then 3 up to the kill
    assert sizes[:5] == [2] * 4 + [3], sizes
    # worker 0 was never restarted, and the first joiner not after it joined in round 1
    _kept_pids(report)
    assert sorted(len(entries) for entries in report["pids"]) == [1, 3, 4]


@pytest.mark.timeout(150)
def test_killed_worker_is_replaced_after_the_blacklist_cooldown(grown_and_replaced, reference):
    done, report, _ = grown_and_replaced
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round 2 (removed): 2 worker(s)" in done.stderr
    assert "no new worker starts on localhost for 1.0 s" in done.stderr
    assert "round 3 (added): 3 worker(s)" in done.stderr
    _check_training(report, reference)
    # 3 workers up to the kill, 2 from the commit before it, 3 again from the replacement
    sizes = report["sizes"]
    first3 = sizes.index(3)
    back2 = sizes.index(2, first3)
    assert set(sizes[first3:back2]) == {3} and 3 in sizes[back2:], sizes
    assert report["final_size"] == 3


@pytest.mark.timeout(60)
def test_below_min_np_fails_after_the_elastic_timeout(tmp_path):
    done, report, took = _run(tmp_path, ["-np", "2", "--min-np", "2", "--elastic-timeout", "2"],
                              light_kills="1:3")
    assert done.returncode == 1, done.stderr[-3000:]
    assert ("the elastic job has 1 worker(s), fewer than --min-np 2, and not enough came "
            "back within 2 s (--elastic-timeout)") in done.stderr
    assert report is None
    assert took < 30


@pytest.mark.timeout(60)
def test_reset_limit_stops_the_job(tmp_path):
    # 3 workers, 2 re-formations: the second one passes the limit with one worker left
    done, report, _ = _run(tmp_path, ["-np", "3", "--min-np", "1", "--reset-limit", "1"],
                           light_kills="2:3,w1:7")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "round 1 (removed): 2 worker(s)" in done.stderr
    assert "re-formed 2 times, more than --reset-limit 1" in done.stderr
    assert report is None


@pytest.mark.timeout(60)
def test_a_failing_script_ends_the_job_with_its_status(tmp_path):
    script = tmp_path / "bad.py"
    # hora, not hora.torch: the launcher sees an exit status, whatever the workers imported
    script.write_text("import hora\nhora.init()\nraise SystemExit(3)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", "--min-np", "1",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=50, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "every worker of the elastic job has exited" in done.stderr
    assert time.monotonic() - started < 30


@pytest.mark.timeout(120)
def test_keras_fit_recovers_from_a_killed_worker(tmp_path):
    """Horovod's elastic Keras recipe (KerasState, the elastic callbacks, fit inside
    hvd.elastic.run) on the TensorFlow backend: rank 1 of 3 dies in the second epoch; the
    two others restore the last commit and finish every epoch at N=2 in the same processes,
    with equal weights."""
    out = tmp_path / "report.json"
    env = dict(os.environ, ELASTIC_OUT=str(out), ELASTIC_KILL="1:1:3",
               KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
               **without(TF_EXTRAS, {"PYTHONPATH": os.pathsep.join(
                   [ROOT, os.environ.get("PYTHONPATH", "")])}))
    done = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "3", "--min-np", "2",
                           sys.executable, os.path.join(ROOT, "tests", "elastic_keras_main.py")],
                          capture_output=True, text=True, timeout=110, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round 1 (removed): 2 worker(s)" in done.stderr
    report = json.loads(out.read_text())
    assert report["epoch"] == 3 and report["final_size"] == 2
    first, second = report["weights"]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    _kept_pids(report)


def _count_steps(kill_rank):
    """20 steps each adding the job's size to a committed total; the worker that is
    ``kill_rank`` in the first round dies at step 7 (after the commit at step 6)."""
    import os
    import signal

    import numpy as np

    import hora
    import hora.elastic
    from hora.core import membership
    hora.init()
    state = hora.elastic.ObjectState(hora.broadcast_object, hora.rank, step=0, total=0.0)

    @hora.elastic.run
    def train(state):
        while state.step < 20:
            if membership.current_round() == 0 and hora.rank() == kill_rank and \
                    state.step == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            state.total += float(hora.allreduce(np.ones(1), op=hora.Sum, name="s")[0])
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
        return state.total, hora.size()

    return train(state)


@pytest.mark.timeout(60)
def test_hora_run_python_api_runs_an_elastic_job():
    import hora
    results = hora.run(_count_steps, args=(1,), np=3, min_num_proc=2, timeout_s=50,
                       env={"PYTHONPATH": ROOT})
    # steps 0-5 committed at 3 workers, 6-19 (from the commit at 6) at 2: 6*3 + 14*2
    assert results == [(6 * 3 + 14 * 2, 2)] * 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("refused", [False, True], ids=["allowed", "seccomp-refused"])
def test_elastic_workers_get_the_fixed_layout_or_one_warning_why_not(tmp_path, refused):
    """``--rank-aslr off`` in an elastic job: its workers start without address-space
    randomization, or, where a seccomp profile refuses the personality (as a container's
    default does: tests/refuse_personality.py), randomized, the launcher saying why once."""
    from hora.runner.proc import fixed_layout_refused
    if not sys.platform.startswith("linux") or refused and os.uname().machine != "x86_64":
        pytest.skip("Linux personalities; the seccomp filter is x86-64's")
    if not refused and fixed_layout_refused():
        pytest.skip(f"this machine refuses the fixed layout: {fixed_layout_refused()}")
    script = tmp_path / "layout.py"
    script.write_text("import hora\nhora.init()\n"
                      "with open('/proc/self/personality') as f:\n"
                      "    print('fixed', int(int(f.read(), 16) & 0x0040000 != 0))\n"
                      "hora.shutdown()\n")
    wrap = [sys.executable, os.path.join(ROOT, "tests", "refuse_personality.py")] * refused
    done = subprocess.run([*wrap, sys.executable, "-m", "hora", "run", "-np", "2",
                           "--min-np", "1", "--rank-aslr", "off", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=50,
                          env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    fixed = [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if "fixed " in line]
    assert fixed == ["0" if refused else "1"] * 2, done.stdout
    said = done.stderr.count("HORA_RANK_ASLR=off: the ranks on localhost keep randomized")
    assert said == (1 if refused else 0), done.stderr
