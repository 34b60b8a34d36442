"""The job behind the collective suite (test_collectives.py and its gloo, TCP and MPI runs):
every rank's inputs, the numpy oracle, the cases, and the worker that runs every section.

Each worker builds its inputs deterministically from (case, rank) (see ``_rng``), so the test
process can rebuild every rank's input and compute the expected result itself.  Starting
processes is the expensive part (about 0.3 s each on a 2-core CI machine), so there is one
job per N: the worker runs every section (allreduce matrix, reducescatter, allgather, ...)
and returns all results.  N = 1..4 run the broad matrix (every dtype x op x shape), larger N
a smaller one.  The 2-rank job ends with one big buffer (``big``), and ``plane_worker``'s
3-rank job with the check of which collectives the backend's plane carried (``carried``):
each was a job of its own, for the same ranks and backend.
"""
import functools
import hashlib
import time
import traceback
import zlib

import numpy as np

import hora
from hora.errors import DuplicateNameError

SEED = 20261122
DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool", "complex64", "complex128"]
SMALL_DTYPES = ["float16", "float64", "int8", "uint32", "int64", "bool", "complex64"]
OPS = {"Sum": hora.Sum, "Average": hora.Average, "Min": hora.Min, "Max": hora.Max,
       "Product": hora.Product, "default": None}
_UFUNC = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum,
          "Product": np.multiply}
# N = 3: small fusion buffers, and shared-memory slots of 8 KiB, so that every
# collective above ring.SMALL goes through the segment in many chunks
SMALL_FUSION_ENV = {"HORA_FUSION_THRESHOLD": "4096", "HORA_SHM_SLOT_BYTES": "8192"}


# -- deterministic inputs (used by the workers and by the oracle) ----------------------------
def _rng(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _values(rng, dtype, shape, kind):
    """Inputs that keep the oracle exact where it can be: wrap-around integer sums, small
    integers where results are scaled or averaged, powers of two for float products."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        x = rng.random(shape) < (0.85 if kind == "and" else 0.25)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        bound = min(50, info.max // 32)
        lo, hi = {"wrap": (info.min, info.max), "prod": (-3, 3)}.get(kind, (-bound, bound))
        x = rng.integers(max(lo, info.min), hi, size=shape, dtype=dt, endpoint=True)
    elif kind == "prod":
        choices = [1, -1, 1j, -1j, 1 + 1j, 1 - 1j] if dt.kind == "c" else [-2, -1, -.5, .5, 1, 2]
        x = rng.choice(np.array(choices), size=shape)
    elif dt == np.float16:
        x = rng.integers(-8, 9, size=shape)            # integer-valued: float16 sums exact
    else:
        x = rng.standard_normal(shape)
        if dt.kind == "c":
            x = x + 1j * rng.standard_normal(shape)
    return np.asarray(x).astype(dt).reshape(shape)


def value_kind(dtype, op, scaled):
    """The kind of values an input of ``dtype`` takes for ``op`` (``scaled``: a scale
    factor applies), chosen so that the result is exact in any order of the reduction:
    and/or for bool, small values when scaled or averaged, products that stay exact, and
    integers that wrap otherwise."""
    if dtype == "bool":
        return "and" if op in ("Min", "Product") else "or"
    if op == "Product":
        return "prod"
    return "small" if scaled or op in ("Average", "default") else "wrap"


def _layout(x, layout):
    """The same values in a non-C-contiguous array."""
    if layout == "F":
        return np.asfortranarray(x)
    if layout == "strided":
        y = np.zeros((2 * x.shape[0],) + x.shape[1:], x.dtype)
        y[::2] = x
        return y[::2]
    return x


# -- the oracle ------------------------------------------------------------------------------
def _int_scale(x, factor, divisor):
    """Horovod's integer scaling: one float64 factor (an average folded into the postscale),
    the product in float64, truncated toward zero."""
    if factor == 1 and divisor == 1:
        return x
    return np.trunc(x.astype(np.float64) * (factor / divisor)).astype(x.dtype)


def reduce_oracle(xs, dtype, op, pre=1.0, post=1.0):
    """(expected, exact): exact results have ``dtype``; inexact ones are float64/complex128."""
    n, dt = len(xs), np.dtype(dtype)
    op = "Average" if op == "default" else op
    div = n if op == "Average" else 1
    if dt == np.bool_:
        return functools.reduce(np.logical_or if op in ("Sum", "Max") else np.logical_and,
                                xs), True
    if dt.kind in "iu":
        red = functools.reduce(_UFUNC[op], [_int_scale(x, pre, 1) for x in xs])
        return _int_scale(red, post, div), True
    exact = pre == post == 1 and (op in ("Min", "Max", "Product") or
                                  (op == "Sum" and dt == np.float16))
    hi = np.complex128 if dt.kind == "c" else np.float64
    red = functools.reduce(_UFUNC[op], [x.astype(hi) * pre for x in xs]) * post / div
    return (red.astype(dt) if exact else red), exact


def assert_reduced(got, xs, dtype, op, pre=1.0, post=1.0, what=""):
    """``got`` is the reduction of ``xs``: exact where the oracle is, else within a bound
    that grows with N and the dtype's epsilon."""
    expected, exact = reduce_oracle(xs, dtype, op, pre, post)
    assert isinstance(got, np.ndarray), f"{what}: got {type(got).__name__}"
    assert got.dtype == np.dtype(dtype) and got.shape == xs[0].shape, \
        f"{what}: got {got.dtype}{got.shape}, expected {np.dtype(dtype)}{xs[0].shape}"
    if exact:
        np.testing.assert_array_equal(got, expected, err_msg=what)
        return
    n, eps = len(xs), np.finfo(np.dtype(dtype)).eps
    div = n if op in ("Average", "default") else 1
    magnitude = sum(np.abs(x.astype(expected.dtype)) for x in xs) * abs(pre * post) / div
    bound = 4 * (n + 2) * eps * magnitude + 4 * np.finfo(np.dtype(dtype)).tiny
    err = np.abs(got.astype(expected.dtype) - expected)
    assert np.all(err <= bound), f"{what}: max error {err.max()} > bound; got {got}, " \
                                 f"expected {expected}"


# -- the cases -------------------------------------------------------------------------------
def _ops_for(dtype):
    if dtype == "bool":
        return ["Sum", "Min", "Max", "Product"]
    if dtype.startswith("complex"):
        return ["Sum", "Average", "Product"]
    return ["Sum", "Average", "Min", "Max", "Product"]


_SCALINGS = [("Sum", 0.5, 3.0), ("Average", 2.0, 0.5), ("Average", 1.0, 1.5),
             ("Sum", 1.0, 0.25), ("Max", -2.0, 0.5), ("Min", 0.5, 1.0)]


def allreduce_cases(n):
    """(dtype, op, shape, prescale, postscale, layout) tuples."""
    broad = n <= 4
    # (4099,) is below ring.SMALL (64 KiB) for most dtypes: the direct path; (20_011,) and
    # (9_001, 3) are above it for 4-byte and larger dtypes: the ring (uneven segments).
    shapes = ([(), (1,), (0,), (0, 3), (max(n - 1, 1),), (7,), (13, 3), (2, 3, 4), (4099,),
               (20_011,)] if broad else [(), (0,), (n - 1,), (13, 3), (9_001, 3)])
    cases = [(dt, op, shape, 1.0, 1.0, "C")
             for dt in DTYPES for op in _ops_for(dt) for shape in shapes]
    for dt in (DTYPES if broad else SMALL_DTYPES):
        for op, pre, post in _SCALINGS:
            if dt == "bool" or (op in ("Min", "Max") and dt.startswith("complex")) or (
                    pre < 0 and dt.startswith("uint")):
                continue
            cases += [(dt, op, shape, pre, post, "C") for shape in [(), (11,)]]
    for dt in ("float32", "int32", "complex128"):
        cases += [(dt, "Sum", (6, 4), 1.0, 1.0, "F"), (dt, "Product", (9,), 1.0, 1.0, "strided"),
                  (dt, "default", (5,), 1.0, 1.0, "C")]
    return cases


def allreduce_input(case, rank):
    dt, op, shape, pre, post, _ = case
    return _values(_rng("allreduce", case, rank), dt, shape, value_kind(dt, op, (pre, post) != (1, 1)))


def reducescatter_cases(n):
    rows = sorted({0, 1, max(n - 1, 1), n, 2 * n + 1, 13}) if n <= 4 else [n - 1, 2 * n + 1]
    cases = [(dt, op, (r,) + ((3,) if i % 2 else ()), 1.0, 1.0)
             for dt in (DTYPES if n <= 4 else SMALL_DTYPES) for op in _ops_for(dt)
             for i, r in enumerate(rows)]
    for dt in ("float16", "float32", "int8", "int32", "uint8", "complex64"):
        cases += [(dt, "Average", (2 * n + 1, 2), 2.0, 0.5), (dt, "Sum", (n + 1,), 0.5, 3.0)]
    # above ring.SMALL: the ring, or shared memory in chunks (uneven blocks across chunks)
    return cases + [("float64", "default", (2 * n + 1,), 1.0, 1.0),
                    ("int16", "default", (3 * n + 2,), 1.0, 1.0),
                    ("float32", "Sum", (4_000 * n + 3, 5), 1.0, 1.0),
                    ("int64", "Max", (2_000 * n + 1, 3), 1.0, 1.0)]


def reducescatter_input(case, rank):
    dt, op, shape, pre, post = case
    return _values(_rng("rs", case, rank), dt, shape, value_kind(dt, op, (pre, post) != (1, 1)))


def allgather_cases(n):
    cases = [(dt, trailing, "varied") for dt in (DTYPES if n <= 4 else SMALL_DTYPES)
             for trailing in [(), (3,), (2, 2)]]
    return cases + [("float32", (), "zero_all"), ("float64", (3,), "zero_all"),
                    ("int32", (), "scalar"), ("bool", (), "scalar"), ("uint16", (4,), "strided"),
                    ("float64", (5000,), "varied")]


def allgather_input(case, rank):
    dt, trailing, how = case
    if how == "scalar":
        return _values(_rng("ag", case, rank), dt, (), "wrap")
    rows = {"varied": (rank + len(trailing)) % 4, "zero_all": 0, "strided": rank + 1}[how]
    return _values(_rng("ag", case, rank), dt, (rows,) + trailing, "wrap")


def broadcast_cases(n):
    specs = [(dt, (5,)) for dt in (DTYPES if n <= 4 else SMALL_DTYPES)]
    specs += [("int8", ()), ("bool", (3, 2)), ("complex128", (0,)), ("float16", (0, 3)),
              ("float64", (400_001,))]           # > 1 MiB: pipelined in chunks along the chain
    return [(dt, shape, root) for root in range(n) for dt, shape in specs]


def broadcast_input(case, rank):
    dt, shape, root = case
    return _values(_rng("bcast", case, rank), dt, shape, "wrap")


def alltoall_cases(n):
    cases = [(dt, (), "explicit") for dt in (DTYPES if n <= 4 else SMALL_DTYPES)]
    return cases + [("float64", (3,), "explicit"), ("int32", (2, 2), "explicit"),
                    ("float32", (), "none"), ("uint8", (3,), "none"), ("int64", (), "none_few"),
                    ("float64", (2,), "mixed"), ("float32", (4,), "zeros"),
                    ("int8", (), "array_splits")]


# without splits, a rank's rows must divide evenly among the ranks (Horovod's rule)
_EVEN_ROWS = {"none": lambda rank, n: (2 + rank) * n, "none_few": lambda rank, n: rank % 2 * n,
              "mixed": lambda rank, n: rank % 3 * n}


def alltoall_plan(case, rank, n):
    """(input, splits argument, the splits actually used) for one rank."""
    dt, trailing, how = case
    explicit = None
    if how in ("explicit", "array_splits") or (how == "mixed" and rank % 2 == 0):
        rng = _rng("a2a-splits", case, rank)
        explicit = rng.integers(0, 4, n) * (rng.random(n) > 0.3)     # zeros included
    elif how == "zeros":
        explicit = np.zeros(n, dtype=np.int64)
    if explicit is not None:
        rows, used = int(explicit.sum()), [int(s) for s in explicit]
        arg = explicit.astype(np.int32) if how == "array_splits" else used
    else:
        rows = _EVEN_ROWS[how](rank, n)
        used, arg = [rows // n] * n, None
    x = _values(_rng("a2a", case, rank), dt, (rows,) + trailing, "wrap")
    return x, arg, used


def grouped_cases():
    """(op, prescale, postscale, [(dtype, shape), ...])."""
    return [
        ("Sum", 1.0, 1.0, [("float32", (5,)), ("int32", (3, 2)), ("float64", ()), ("uint8", (0,)),
                           ("float16", (7,)), ("complex64", (2,)), ("int32", (4,))]),
        ("Average", 1.0, 1.0, [("float64", (3,)), ("int16", (5,)), ("float32", (0, 3))]),
        ("Max", 1.0, 1.0, [("int8", (9,)), ("bool", (4,)), ("float32", ())]),
        ("Product", 1.0, 1.0, [("bool", (6,)), ("complex128", (2,)), ("uint16", (3,))]),
        ("Min", 1.0, 1.0, [("float64", (1000,)), ("float64", (3,))]),
        ("Sum", 0.5, 3.0, [("float32", (4,)), ("int32", (4,)), ("int64", ())]),
        ("Sum", 1.0, 1.0, [("bool", (4,))]),
    ]


def grouped_input(i, j, rank):
    op, pre, post, items = grouped_cases()[i]
    dt, shape = items[j]
    return _values(_rng("grouped", i, j, rank), dt, shape, value_kind(dt, op, (pre, post) != (1, 1)))


# -- the worker: every section on every rank, one job per N ----------------------------------
def _sec_info(n):
    return (hora.rank(), hora.size(), hora.local_rank(), hora.local_size(), hora.cross_rank(),
            hora.cross_size(), hora.is_homogeneous())


def _sec_allreduce(n):
    out, modified = {}, []
    for case in allreduce_cases(n):
        x = _layout(allreduce_input(case, hora.rank()), case[5])
        out[case] = hora.allreduce(x, op=OPS[case[1]], prescale_factor=case[3],
                                   postscale_factor=case[4])
        if not np.array_equal(x, allreduce_input(case, hora.rank())):
            modified.append(case)
    return out, modified


def _sec_reducescatter(n):
    return {case: hora.reducescatter(reducescatter_input(case, hora.rank()), op=OPS[case[1]],
                                     prescale_factor=case[3], postscale_factor=case[4])
            for case in reducescatter_cases(n)}


def _sec_allgather(n):
    return {case: hora.allgather(_layout(allgather_input(case, hora.rank()),
                                         "strided" if case[2] == "strided" else "C"))
            for case in allgather_cases(n)}


def _sec_broadcast(n):
    out, modified = {}, []
    for case in broadcast_cases(n):
        x = broadcast_input(case, hora.rank())
        out[case] = hora.broadcast(x, root_rank=case[2])
        if not np.array_equal(x, broadcast_input(case, hora.rank())):
            modified.append(case)
    return out, modified


def _sec_alltoall(n):
    out = {}
    for case in alltoall_cases(n):
        x, arg, _ = alltoall_plan(case, hora.rank(), n)
        out[case] = hora.alltoall(x, splits=arg)
    return out


def _sec_grouped(n):
    out = {}
    for i, (op, pre, post, items) in enumerate(grouped_cases()):
        xs = [grouped_input(i, j, hora.rank()) for j in range(len(items))]
        out[i, "sync"] = hora.grouped_allreduce(xs, op=OPS[op], prescale_factor=pre,
                                                postscale_factor=post)
        h = hora.grouped_allreduce_async(xs, op=OPS[op], name=f"grouped.{i}",
                                         prescale_factor=pre, postscale_factor=post)
        out[i, "async"] = hora.synchronize(h)
    return out


def _sec_async(n):
    """Everything outstanding at once, waited for by poll(), synchronized in reverse order."""
    r, handles = hora.rank(), {}
    for i, case in enumerate(allreduce_cases(n)[::7]):
        handles["allreduce", case] = hora.allreduce_async(
            allreduce_input(case, r), op=OPS[case[1]], name=f"async.ar.{i}",
            prescale_factor=case[3], postscale_factor=case[4])
    for case in reducescatter_cases(n)[::11]:
        handles["reducescatter", case] = hora.reducescatter_async(
            reducescatter_input(case, r), op=OPS[case[1]], prescale_factor=case[3],
            postscale_factor=case[4])
    for case in allgather_cases(n)[:3]:
        handles["allgather", case] = hora.allgather_async(allgather_input(case, r))
    for case in broadcast_cases(n)[-3:]:
        handles["broadcast", case] = hora.broadcast_async(broadcast_input(case, r), case[2])
    for case in alltoall_cases(n)[-3:]:
        x, arg, _ = alltoall_plan(case, r, n)
        handles["alltoall", case] = hora.alltoall_async(x, splits=arg, name=f"async.a2a.{case}")
    polls = {type(hora.poll(h)) for h in handles.values()}
    deadline = time.monotonic() + 30
    while not all(hora.poll(h) for h in handles.values()):
        assert time.monotonic() < deadline, "poll() never reported every handle done"
        time.sleep(0.002)
    out = {key: hora.synchronize(h) for key, h in reversed(list(handles.items()))}
    return out, polls, all(hora.poll(h) for h in handles.values())


def _sec_naming(n):
    """Unnamed calls agree by order; named ones may be submitted in any order."""
    r = hora.rank()
    a, b = np.full(3, r + 1.0), np.arange(5) + r
    ha, hb = hora.allreduce_async(a, op=hora.Sum), hora.allreduce_async(b, op=hora.Sum)
    unnamed = (hora.synchronize(hb), hora.synchronize(ha))
    names = [f"order.{k}" for k in range(6)]
    if r % 2:
        names.reverse()
    handles = {name: hora.allreduce_async(np.full(k + 1, float(r)), op=hora.Max, name=name)
               for name in names for k in [int(name.split(".")[1])]}
    ordered = {name: hora.synchronize(h) for name, h in handles.items()}
    # "dup.r" stays in flight until every other rank submits it, which they do only after
    # the "dup.tried" barrier, so a second "dup.r" here must be refused (N >= 2)
    held = {r: hora.allreduce_async(np.ones(2), name=f"dup.{r}")}
    try:
        again = hora.allreduce_async(np.ones(2), name=f"dup.{r}")
        dup = None
    except DuplicateNameError:
        again, dup = None, "DuplicateNameError"
    hora.barrier(name="dup.tried")
    held.update({j: hora.allreduce_async(np.ones(2), name=f"dup.{j}") for j in range(n) if j != r})
    for h in (*held.values(), *([again] if again is not None else [])):
        hora.synchronize(h)     # (N = 1: the first one may be done before the second call)
    reused = hora.allreduce(np.ones(2) * r, op=hora.Sum, name="dup.0")   # free again once done
    return unnamed, ordered, dup if n > 1 else "racy at N=1", reused


# name -> (the exception every rank must raise, the bad call)
BAD_CALLS = {
    "bool_average": ("TypeError", lambda: hora.allreduce(np.ones(3, bool), op=hora.Average)),
    "bool_default_op": ("TypeError", lambda: hora.allreduce(np.ones(3, bool))),
    "bool_prescale": ("TypeError", lambda: hora.allreduce(np.ones(3, bool), op=hora.Sum,
                                                          prescale_factor=2.0)),
    "bool_postscale": ("TypeError", lambda: hora.allreduce(np.ones(3, bool), op=hora.Max,
                                                           postscale_factor=0.5)),
    "grouped_bool_average": ("TypeError", lambda: hora.grouped_allreduce(
        [np.ones(2), np.ones(2, bool)], op=hora.Average)),
    "reducescatter_bool_average": ("TypeError", lambda: hora.reducescatter(np.ones(4, bool))),
    "adasum": ("NotImplementedError", lambda: hora.allreduce(np.ones(3), op=hora.Adasum)),
    # rows that do not divide among the ranks (N > 1; at N = 1 every count divides)
    "alltoall_uneven_rows": ("InvalidArgumentError", lambda: hora.alltoall(
        np.arange(hora.size() + 1 if hora.size() > 1 else 1))),
}


def _sec_errors(n):
    """Bad arguments raise at the API edge on every rank, and the job carries on."""
    got = {}
    for key, (_, attempt) in BAD_CALLS.items():
        try:
            attempt()
            got[key] = None
        except Exception as e:
            got[key] = type(e).__name__
    return got, hora.allreduce(np.array([hora.rank(), 1.0]), op=hora.Sum)


def obj_for(rank):
    return {"rank": rank, "nested": [1, (2.5, "x" * rank), {"s": frozenset({rank, 7})}, None,
                                     b"\x00\xff" * rank],
            "text": "héllo ✓", "big": list(range(rank * 3000)), ("tuple", "key"): {rank: [rank]},
            "array": np.arange(rank + 2, dtype=np.int16)}


def _sec_objects(n):
    r = hora.rank()
    roots = {root: hora.broadcast_object(obj_for(r) if r == root else {"junk": r},
                                         root_rank=root)
             for root in range(n)}
    default = hora.broadcast_object(obj_for(r) if r == 0 else None)
    return roots, default, hora.allgather_object(obj_for(r)), hora.allgather_object(None)


def _sec_barrier(n):
    if hora.rank() == 0:
        time.sleep(0.3)
    entered = time.monotonic()              # CLOCK_MONOTONIC is system-wide on Linux
    hora.barrier()
    left = time.monotonic()
    for _ in range(20):
        hora.barrier()
    return entered, left


_SECTIONS = {"info": _sec_info, "allreduce": _sec_allreduce,
             "reducescatter": _sec_reducescatter, "allgather": _sec_allgather,
             "broadcast": _sec_broadcast, "alltoall": _sec_alltoall, "grouped": _sec_grouped,
             "async": _sec_async, "naming": _sec_naming, "errors": _sec_errors,
             "objects": _sec_objects, "barrier": _sec_barrier}


def _run_section(out, name, run):
    started = time.monotonic()
    try:
        out[name] = ("ok", run(), time.monotonic() - started)
    except Exception:
        out[name] = ("error", traceback.format_exc(), time.monotonic() - started)


def worker(n):
    out = {}
    for name, run in _SECTIONS.items():
        _run_section(out, name, functools.partial(run, n))
    if n == 2:                  # last: its 128 MiB buffers come after every other section
        _run_section(out, "big", big_worker)
    return out


def plane_worker(n):
    """:func:`worker`, and on 3 ranks then which collectives the backend's plane carried
    (tests/multiproc/planes.py; it counts from its own start)."""
    out = worker(n)
    if n == 3:
        from tests.multiproc.planes import carried_by_plane
        _run_section(out, "carried", carried_by_plane)
    return out




# -- one big buffer: chunking, pipelining and partial reductions in flight -------------------
BIG = (1 << 25) + 3             # float32 elements: 128 MiB and 12 bytes, uneven segments


def big_input(rank):
    return _rng("big", rank).integers(-4, 5, BIG, dtype=np.int8).astype(np.float32)


def big_worker():
    x = big_input(hora.rank())
    out = {}
    for what, call in (("allreduce", lambda: hora.allreduce(x, op=hora.Sum, name="big.sum")),
                       ("broadcast", lambda: hora.broadcast(x, root_rank=1, name="big.bcast"))):
        y = call()
        out[what] = (y.dtype, y.shape, hashlib.sha256(y).hexdigest(), y[::65_537].copy())
        del y
    return out


def check_big_buffer(results):
    xs = [big_input(r) for r in range(2)]
    expected = {"allreduce": xs[0] + xs[1], "broadcast": xs[1]}   # integer-valued: exact
    for what, exp in expected.items():
        for r, res in enumerate(results):
            dtype, shape, digest, sample = res[what]
            assert (dtype, shape) == (exp.dtype, exp.shape), (what, r)
            np.testing.assert_array_equal(sample, exp[::65_537], err_msg=f"{what} rank {r}")
            assert digest == hashlib.sha256(exp).hexdigest(), f"{what} rank {r}"
