"""Rank 0 waits on a lane for late posts (hora.core.engine.board_calls, ``BoardCalls.
_lane_wait``): the one test here runs while no other test does (``alone``: a post counts as
late by its microseconds, and other tests' ranks would make every post late), so it has a file
of its own, which runs last (tests/tiers.py): the other worker's wait for it then overlaps the
end of the suite."""
import time

import numpy as np
import pytest

import hora
from tests.helpers import run_ranks
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import same_bits as _same_bits

pytestmark = pytest.mark.timeout(60)


def _lane_late_workers(steps, flag_path):
    """Rank 0 calls a lane at once; the other rank posts as soon as rank 0 says, through
    the word at ``flag_path``, that it waits on its lane (every other call), or after a busy
    wait of 400 µs, so that rank 0 waits for its post (BoardCalls._lane_wait, then the general
    wait); returns each call's (input, result) and, on rank 0, how many of its waits the
    lane's own wait settled and how many it left to the general one.  (A fixed 25 µs
    instead of the word missed the lane's 50 µs wait on a loaded machine.)"""
    import mmap

    from hora.core.engine.board_calls import BoardCalls
    count = {"settled": 0, "left": 0, "call": 0}
    with open(flag_path, "r+b") as f:
        word = np.frombuffer(mmap.mmap(f.fileno(), 8), dtype=np.int64)
    wait = BoardCalls._lane_wait

    def counted(self, lane, what):
        word[0] = count["call"] + 1             # (rank 0 waits on its lane for this call)
        got = wait(self, lane, what)
        count["settled" if got else "left"] += 1
        return got
    BoardCalls._lane_wait = counted
    rank = hora.rank()
    out = []
    for i in range(steps):
        count["call"] = i
        x = (np.arange(8) * 0.37 + 1.3 * rank + i).astype(np.float32)
        if rank:
            until = time.perf_counter() + (0.05 if i % 2 else 400e-6)
            while time.perf_counter() < until and not (i % 2 and word[0] > i):
                pass
        out.append((x, hora.allreduce(x, op=hora.Sum, name="late")))
    return out, count["settled"], count["left"]


@pytest.mark.alone      # a post counts as late by its microseconds: other tests' ranks
def test_rank_0_waits_on_its_lane_for_late_posts(tmp_path):   # would make them late
    """Rank 0 comes first to a lane's call: its short wait settles the posts that come
    within BOARD_STEP_S, the general wait those that come later, and every result has
    NumPy's bits of the inputs in rank order."""
    steps = 200
    flag = tmp_path / "flag"
    flag.write_bytes(bytes(8))
    got = run_ranks(_lane_late_workers, 2, timeout_s=40, args=(steps, str(flag)))
    _, settled, left = got[0]
    assert settled >= steps // 10 and left >= steps // 10, (settled, left)
    for i in range(steps):
        want = _expected([got[r][0][i][0] for r in range(2)], "Sum")
        for r in range(2):
            _same_bits(got[r][0][i][1], want, f"rank {r} call {i}")
