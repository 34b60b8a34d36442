"""A rank that dies, exits or stops in the middle of a board call: the survivors fail naming
it within seconds (a stopped rank: after HORA_TRANSPORT_TIMEOUT), and nothing stays in
/dev/shm."""
import os
import signal
import time

import numpy as np
import pytest

import hora
import hora.core.engine.board as _board
from tests.helpers import die_in, run_ranks, until_one_dies
from tests.multiproc.board_oracle import die_in_a_call as _die_in_a_call
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import hora_files as _hora_files
from tests.multiproc.board_oracle import STRIPE_BYTES, capacity as _capacity

pytestmark = pytest.mark.timeout(60)


# -- failures: a dead rank, while the others wait on the board ---------------------------
def _die_during_board(victim, how):
    """``victim`` dies while the others wait on the board: before its call (``kill``,
    ``exit``), or in it (``posted``: 0.3 s into the call, which the rank ``late`` joins only
    1 s after the others; a worker's post is on the board then)."""
    hora.init()
    rank = hora.rank()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    warm_board = _board_count()
    if how == "posted":
        late = 1 if victim == 0 else 0
        if rank == victim:
            _die_in_a_call(0.3)
        elif rank == late:
            time.sleep(1.0)
    elif rank == victim:
        time.sleep(0.5)                 # the others are waiting in the next call by now
        with open(os.environ["DEATH_FILE"], "w") as f:
            f.write(repr(time.time()))
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hora.allreduce(np.ones(4), op=hora.Sum, name="lost")
        return ("finished", warm_board)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time(), warm_board)


@pytest.mark.parametrize("n,victim,how", [(2, 1, "kill"), (3, 0, "kill"), (3, 1, "exit"),
                                          (3, 2, "posted"), (3, 0, "posted")])
def test_survivors_of_a_dead_rank_fail_naming_it_within_seconds(tmp_path, n, victim, how):
    job, killed_at, survived = until_one_dies(_die_during_board, n, tmp_path, victim,
                                              args=(victim, how))
    for r, got in survived.items():
        kind, rank, message, at, warm_board = got
        assert warm_board == 1, f"rank {r}: the warm-up did not go through the board"
        assert kind == "HoraRankFailedError" and rank == victim, got
        assert f"rank {victim}" in message, message
        assert at - killed_at < 5.0, f"rank {r} took {at - killed_at:.1f} s to notice"
    pids = {p.pid for p in job.procs}
    assert _hora_files(pids) == [], "segments left in /dev/shm"


def _die_in_a_loop(victim, delay, repeat=False):
    """Every rank loops over board allreduces (small ones and, where the board stripes its
    large ones, striped ones); ``victim`` dies ``delay`` s into the loop, at no particular
    point of one.  ``repeat``: each step calls the same two names (their lanes)."""
    hora.init()
    rank = hora.rank()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    big = STRIPE_BYTES // 4 + 5 if STRIPE_BYTES and STRIPE_BYTES <= _capacity(hora.size()) \
        else 1000
    if rank == victim:
        die_in(delay)
    steps = 0
    try:
        while True:
            small = hora.allreduce(np.full(3, steps + 1.0), op=hora.Sum,
                                   name="s" if repeat else f"s.{steps}")
            large = hora.allreduce(np.full(big, steps + 1.0, np.float32), op=hora.Max,
                                   name="l" if repeat else f"l.{steps}")
            if small[0] != hora.size() * (steps + 1.0) or large[-1] != steps + 1.0:
                return ("wrong", steps, small, large[-1])
            steps += 1
            if steps > 100_000:
                return ("finished", steps)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time(), steps,
                _board_count())


@pytest.mark.parametrize("victim,repeat", [(1, False), (0, False), (1, True), (0, True)])
def test_a_rank_dying_at_any_point_of_a_board_loop(tmp_path, victim, repeat):
    n = 3
    job, killed_at, survived = until_one_dies(_die_in_a_loop, n, tmp_path, victim,
                                              args=(victim, 0.4, repeat))
    for r, got in survived.items():
        assert got[0] == "HoraRankFailedError", got
        kind, rank, message, at, steps, board = got
        assert rank == victim and f"rank {victim}" in message, got
        assert steps > 0 and board > 0, f"rank {r}: {steps} steps, {board} on the board"
        assert at - killed_at < 5.0, f"rank {r} took {at - killed_at:.1f} s to notice"
    assert _hora_files({p.pid for p in job.procs}) == []


def _stopped_in_a_call(victim, where, pid_file):
    """``victim`` stops itself (SIGSTOP) in the middle of a board call: ``"stripe"`` before
    reducing its stripe of a striped allreduce, ``"answer"`` (rank 0) while every worker's
    post waits for its answer.  The others wait until HORA_TRANSPORT_TIMEOUT, then raise;
    then they let the victim go on (SIGCONT)."""
    hora.init()
    rank = hora.rank()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    if rank == victim:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        from hora.core.engine.lanes import Lane
        # (a striped call reduces through its lane, or through the board's general path)
        methods = ([(Lane, "reduce_stripe"), (_board.Board, "reduce_stripe")]
                   if where == "stripe" else [(_board.Board, "open_posts")])
        reals = {(c, m): getattr(c, m) for c, m in methods}

        def stopping(method):
            def stop_once(self, *args):
                for (c, m), real in reals.items():
                    setattr(c, m, real)
                with open(os.environ["STOP_FILE"], "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return reals[method](self, *args)
            return stop_once
        for c, m in methods:
            setattr(c, m, stopping((c, m)))
    n = STRIPE_BYTES // 4 + 5 if where == "stripe" else 3
    try:
        hora.allreduce(np.ones(n, np.float32), op=hora.Sum, name="stalled")
        return ("finished",)
    except Exception as e:      # noqa: BLE001 - which error is what the test looks at
        at = time.time()
        if rank != victim:          # once every other rank has raised too
            time.sleep(1.0)
            os.kill(int(open(pid_file).read()), signal.SIGCONT)
        return (type(e).__name__, str(e), at)


@pytest.mark.skipif(not STRIPE_BYTES, reason="the board does not stripe")
@pytest.mark.parametrize("victim,where", [(2, "stripe"), (0, "stripe"), (0, "answer")])
def test_a_rank_stopped_in_a_board_call_times_out_the_others(tmp_path, victim, where):
    """A rank alive but stopped in the middle of a board call: the others raise the
    transport's CollectiveTimeoutError after HORA_TRANSPORT_TIMEOUT, naming it, as a
    transfer stalled by a stopped peer does."""
    stop_file = tmp_path / "stopped"
    n = 3
    results = run_ranks(_stopped_in_a_call, n, timeout_s=40,
                        args=(victim, where, str(tmp_path / "pid")),
                        env={"HORA_TRANSPORT_TIMEOUT": "2", "STOP_FILE": str(stop_file)})
    stopped_at = float(stop_file.read_text())
    for r, got in enumerate(results):
        if r == victim:
            continue
        kind, message, at = got
        assert kind == "CollectiveTimeoutError", got
        assert "'stalled'" in message and "HORA_TRANSPORT_TIMEOUT" in message, message
        named = "rank 0 did not answer" if where == "answer" else f"[{victim}]"
        assert named in message, message
        assert 1.5 < at - stopped_at < 8.0, f"rank {r} raised {at - stopped_at:.1f} s after"
