"""What the boards' tests (test_board.py, test_board_hosts.py) expect, computed here: Horovod's
CPU scaling, the reduction in the boards' order, and the calls of every allreduce API the
boards serve."""
import os
import signal
import threading
import time

import numpy as np

import hora
import hora.core.engine.board as _board
from hora.backends.board_segment import board_capacity

NP_OPS = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum,
          "Product": np.multiply}


def scaled(a, factor):
    """``a * factor`` rounded as Horovod rounds on the CPU: float16 in float32, float32 by a
    float32 factor, float64 in float64, integers in float64 truncated toward zero."""
    a = np.array(a, copy=True)
    if factor == 1:
        return a
    if a.dtype == np.float16:
        return (a.astype(np.float32) * np.float32(factor)).astype(np.float16)
    if a.dtype == np.float32:
        return np.asarray(a * np.float32(factor), dtype=np.float32)
    if a.dtype.kind == "f":
        return np.asarray(a * factor, dtype=a.dtype)
    return np.trunc(a.astype(np.float64) * factor).astype(a.dtype)


def expected(inputs, op, pre=1.0, post=1.0, groups=None):
    """The boards' reduction of ``inputs`` (one array per rank, rank order): the prescaled
    inputs of each group of ranks (a host: ``groups``, in host order; default one group of
    every rank) left to right in rank order, then the groups' partials left to right, then
    the postscale (divided by the job's size for an average)."""
    fn = NP_OPS[op]
    groups = groups or [list(range(len(inputs)))]
    total = None
    for g in groups:
        part = scaled(inputs[g[0]], pre)
        for r in g[1:]:
            part = np.asarray(fn(part, scaled(inputs[r], pre))).astype(part.dtype)
        total = part if total is None else np.asarray(fn(total, part)).astype(part.dtype)
    return scaled(total, post / (len(inputs) if op == "Average" else 1))


def same_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes(), f"{what}:\n{a!r}\n!=\n{b!r}"


def close(got, want, what):
    """Equal for integers and bools; for floats within a few units of the last place of the
    largest value (another order of the same additions)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype.kind in "biu":
        same_bits(got, want, what)
    else:
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                     want.dtype, want.shape)
        tol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[got.dtype.itemsize]
        scale = float(np.abs(want.astype(np.float64)).max(initial=1.0))
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=tol, atol=tol * scale, err_msg=what)


def board_count():
    return hora.metrics()["data_plane"].get("board", 0)


def fallbacks():
    """This rank's board fallbacks so far, by reason (``metrics()["board_fallbacks"]``)."""
    return dict(hora.metrics()["board_fallbacks"])


def fallbacks_since(before):
    """The board fallbacks, by reason, since ``before`` (a :func:`fallbacks`)."""
    now = fallbacks()
    return {why: n - before.get(why, 0) for why, n in now.items() if n != before.get(why, 0)}


def case_input(i, dtype, shape, op, rank):
    """Case ``i``'s input on ``rank``: random, but the same in every run."""
    rng = np.random.default_rng([i, rank])
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind == "i":
        lo, hi = (-3, 4) if op == "Product" else (-50, 50)
        return rng.integers(lo, hi, size=shape).astype(dtype)
    if op == "Product":
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 10).astype(dtype)


def nbytes(dtype, shapes):
    return sum(int(np.prod(s, dtype=np.int64)) for s in shapes) * np.dtype(dtype).itemsize


def call(api, xs, kw):
    """Allreduce ``xs`` through ``api`` with the keywords ``kw``: ``(results, whether an
    in-place call wrote into (and returned) the caller's arrays)``."""
    same = True
    if api == "allreduce":
        got = [hora.allreduce(xs[0], **kw)]
    elif api == "allreduce_":
        res = hora.allreduce_(xs[0], **kw)
        same, got = res is xs[0], [xs[0]]
    elif api == "allreduce_T":                  # a non-contiguous array, in place
        a = np.ascontiguousarray(xs[0].T).T
        res = hora.allreduce_(a, **kw)
        same, got = res is a, [a]
    elif api == "allreduce_strided":            # every other element of a longer one
        a = np.zeros(2 * xs[0].size, xs[0].dtype)
        a[::2] = xs[0]
        got = [hora.allreduce(a[::2], **kw)]
        same = not a[1::2].any()
    elif api == "grouped":
        got = hora.grouped_allreduce(xs, **kw)
    elif api == "grouped_":
        # as the framework bindings' blocking grouped_allreduce_ do
        from hora.core.ops import wait_now
        res = wait_now(lambda: hora.grouped_allreduce_async_(xs, **kw))
        same, got = all(r is x for r, x in zip(res, xs)), xs
    else:
        raise AssertionError(api)
    return got, same


def hora_files(pids):
    """hora's segments in /dev/shm made by the processes ``pids``."""
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith("hora-") and n.split("-")[1].isdigit()
                  and int(n.split("-")[1]) in pids)


OFF = {"HORA_SHM_BOARD": "0"}

# The board's limits, read from it (they moved while it was written: 8 KiB, then more, a
# capacity that may depend on the job's size, stripes from some size on).
BOARD_BYTES = _board.BOARD_BYTES        # the largest allreduce the board takes
STRIPE_BYTES = _board.STRIPE_BYTES     # from here every rank reduces a part


def capacity(n):
    """The largest input the board of an ``n``-rank job takes."""
    return board_capacity(n)


F32 = BOARD_BYTES // 4                  # float32 elements of the largest board input


def step_input(i, rank, n=3):
    """Rank ``rank``'s float64 input of step ``i`` (``n`` elements), distinct on every rank."""
    return np.arange(n, dtype=np.float64) + 10.0 * rank + i


# mismatch cases whose ranks differ only in a scale factor: not an error in Horovod (each rank
# scales its own input), so the board and the engine give the same values
SCALE_ONLY = ("m.prescale", "m.postscale")


def attempt(call, as_list=False):
    """``call()``'s outcome and how long it took: ``(("ok", value), s)`` or
    ``(("error", class name, message), s)``."""
    t = time.monotonic()
    try:
        value = np.asarray(call())
        got = ("ok", value.tolist() if as_list else value.copy())
    except Exception as e:  # noqa: BLE001 - compared with the engine's by the tests
        got = ("error", type(e).__name__, str(e))
    return got, time.monotonic() - t


def check_as_engine(rank, key, res, ref):
    """A mismatch case ``key`` on ``rank``: its outcome with the board (``res``) is the
    engine's (``ref``, the board off): the same values or error where only a scale factor
    differs, else the engine's CollectiveMismatchError naming the call."""
    if key in SCALE_ONLY:
        assert res[0] == ref[0], (rank, key, res, ref)
        if res[0] == "ok":
            same_bits(res[1], ref[1], f"rank {rank} {key} vs engine")
        else:
            assert res[1] == ref[1], (rank, key, res, ref)
        return
    assert ref[0] == "error" and ref[1] == "CollectiveMismatchError", (rank, key, ref)
    assert res[0] == "error", f"rank {rank} {key}: no error with the board: {res}"
    assert res[1] == ref[1], (rank, key, res, ref)
    assert repr(key) in res[2], (rank, key, res)


def die_in_a_call(delay):
    """Kill this rank (SIGKILL) ``delay`` seconds from now, from a thread, while its main
    thread goes on into a board call; the time of death goes to the file DEATH_FILE names."""
    def die_soon():
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.environ["DEATH_FILE"], "w") as f:
        f.write(repr(time.time() + delay))
    threading.Thread(target=die_soon, daemon=True).start()
