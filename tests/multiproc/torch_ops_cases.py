"""The collectives of ``hora.torch``'s job (test_torch_ops.py): every rank's inputs, the
oracle (torch itself on the gathered inputs), the cases, and the sections that run them.

Every rank's inputs come from (SEED, case, rank), so the test process rebuilds them and
computes the expected values with torch.  The gradients, gradcheck, process sets and bad
input sections are in torch_ops_grads.py.
"""
import functools
import time
import zlib

import numpy as np
import torch

from tests.multiproc.collective_job import value_kind

SEED = 20261124
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool"]
FLOATS = ("float16", "bfloat16", "float32", "float64")
_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-10}
FP16_TOL = 2e-2                   # Compression.fp16: values of magnitude ~1, N <= 4 terms
_REDUCE = {"Sum": torch.add, "Average": torch.add, "Min": torch.minimum,
           "Max": torch.maximum, "Product": torch.mul}
_SCALINGS = [("Sum", 0.5, 3.0), ("Average", 2.0, 0.5), ("Average", 1.0, 1.5),
             ("Min", 0.5, 1.0), ("Max", -2.0, 0.5)]


# -- deterministic inputs (used by the workers and by the oracle) ----------------------------
def rng_for(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def values(key, dtype, shape, kind="small"):
    """Values that keep the oracle exact where it can be: full-range integers for wrapping
    sums, small integers where results are scaled, powers of two for float products,
    integer-valued float16/bfloat16."""
    rng, dt = rng_for(*key), getattr(torch, dtype)
    if dtype == "bool":
        x = rng.random(shape) < (0.85 if kind == "and" else 0.25)
    elif not dt.is_floating_point:
        info = torch.iinfo(dt)
        lo, hi = {"wrap": (info.min, info.max), "prod": (-3, 3)}.get(kind, (-10, 10))
        x = rng.integers(max(lo, info.min), hi, size=shape, endpoint=True, dtype=np.int64)
    elif kind == "prod":
        x = rng.choice(np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]), size=shape)
    elif dtype in ("float16", "bfloat16"):
        x = rng.integers(-8, 9, size=shape).astype(np.float64)
    else:
        x = rng.standard_normal(shape)
    return torch.from_numpy(np.array(x).reshape(shape)).to(dt)


def _ops_for(dtype):
    if dtype == "bool":
        return ["Sum", "Min", "Max", "Product"]
    return ["Sum", "Average", "Min", "Max", "Product", "default"]


def _nc(x):
    """The same values in a non-contiguous tensor."""
    if x.dim() >= 2:
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if x.dim() == 1:
        y = torch.zeros(2 * x.shape[0], dtype=x.dtype)
        y[::2] = x
        return y[::2]
    return x


# -- the oracle ------------------------------------------------------------------------------
def _iscale(x, factor, divisor):
    """Documented integer scaling: in float64, truncated toward zero."""
    if factor == 1 and divisor == 1:
        return x
    return torch.trunc(x.double() * factor / divisor).to(x.dtype)


def reduce_expected(xs, op, pre=1.0, post=1.0):
    op = "Average" if op == "default" else op
    n, dt = len(xs), xs[0].dtype
    if dt == torch.bool:
        return functools.reduce(torch.logical_or if op in ("Sum", "Max") else torch.logical_and,
                                xs)
    if not dt.is_floating_point:          # torch integer arithmetic wraps, like the dtype
        red = functools.reduce(_REDUCE[op], [_iscale(x, pre, 1) for x in xs])
        return _iscale(red, post, n if op == "Average" else 1)
    red = functools.reduce(_REDUCE[op], [x.double() * pre for x in xs]) * post
    return (red / n if op == "Average" else red).to(dt)


def assert_tensor(got, exp, what, tol=None):
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == exp.dtype and got.shape == exp.shape, \
        f"{what}: got {got.dtype}{tuple(got.shape)}, expected {exp.dtype}{tuple(exp.shape)}"
    if exp.dtype.is_floating_point:
        tol = _TOL[str(exp.dtype)[6:]] if tol is None else tol
        torch.testing.assert_close(got.double(), exp.double(), rtol=tol, atol=tol,
                                   msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, exp), f"{what}: got {got}, expected {exp}"


def _blocks(rows, n):
    """Row bounds of each rank's reducescatter block: the first rows % n get one more."""
    q, extra = divmod(rows, n)
    return np.cumsum([0] + [q + 1 if k < extra else q for k in range(n)]).tolist()


def op_named(hvd, name):
    return None if name == "default" else getattr(hvd, name)


# -- allreduce -------------------------------------------------------------------------------
def allreduce_cases(n):
    """(dtype, op, shape, prescale, postscale, variant)."""
    cases = []
    for dt in DTYPES:
        for op in _ops_for(dt):
            cases += [(dt, op, s, 1.0, 1.0, "sync") for s in [(), (0,), (3, 4)]]
            cases += [(dt, op, (3, 4), 1.0, 1.0, v) for v in ("nc", "inplace")]
        cases += [(dt, "Sum", (7,), 1.0, 1.0, "inplace_nc"), (dt, "Max", (2, 3), 1.0, 1.0,
                                                              "inplace_nc")]
        if dt != "bool":
            cases += [(dt, op, (5,), pre, post, v) for op, pre, post in _SCALINGS
                      for v in ("sync", "inplace") if pre > 0 or dt != "uint8"]
        if dt in FLOATS:
            cases += [(dt, "Sum", (2, 3), 1.0, 1.0, "grad"), (dt, "Average", (), 1.0, 1.0, "grad")]
    for dt in ("float32", "int32", "bfloat16"):
        cases += [(dt, "Average", (4,), 1.0, 1.0, "average=True"),
                  (dt, "Sum", (4,), 1.0, 1.0, "average=False")]
    return cases + [("float32", "Sum", (), 1.0, 1.0, "inplace"),
                    ("int16", "Max", (0, 3), 1.0, 1.0, "inplace")]


def allreduce_input(case, rank):
    dt, op, shape, pre, post, _ = case
    return values(("ar", case, rank), dt, shape, value_kind(dt, op, (pre, post) != (1, 1)))


def _flags(x, y, before):
    """(returned the input object, input unchanged, output shares the input's memory,
    output requires grad)."""
    shares = x.numel() > 0 and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return y is x, torch.equal(x.detach(), before), shares, y.requires_grad


def _sec_allreduce(hvd, n):
    out = {}
    for case in allreduce_cases(n):
        dt, op, shape, pre, post, variant = case
        x = allreduce_input(case, hvd.rank())
        x = _nc(x) if variant.endswith("nc") else x
        x = x.requires_grad_() if variant == "grad" else x
        before = x.detach().clone()
        kw = {"prescale_factor": pre, "postscale_factor": post}
        if variant.startswith("average="):
            kw["average"] = variant == "average=True"
        else:
            kw["op"] = op_named(hvd, op)
        y = (hvd.allreduce_ if variant.startswith("inplace") else hvd.allreduce)(x, **kw)
        out[case] = (y.detach().clone(), _flags(x, y, before))
    return out


# -- allgather, broadcast, alltoall, reducescatter -------------------------------------------
def allgather_cases(n):
    cases = [(dt, t, "varied", "sync") for dt in DTYPES for t in [(), (2, 3)]]
    cases += [(dt, (3,), "varied", "nc") for dt in ("float32", "int8", "bool", "bfloat16")]
    return cases + [("float64", (2,), "varied", "grad"), ("float32", (), "scalar", "sync"),
                    ("int64", (4,), "empty", "sync"), ("float16", (2, 2), "one", "sync")]


def allgather_input(case, rank):
    dt, trailing, how, _ = case
    rows = {"varied": (rank + len(trailing)) % 3, "empty": 0, "one": 1, "scalar": None}[how]
    return values(("ag", case, rank), dt, () if rows is None else (rows,) + trailing, "wrap")


def broadcast_cases(n):
    cases = []
    for root in range(n):
        cases += [(dt, (3, 4), root, "sync") for dt in DTYPES]
        cases += [("float32", (), root, "inplace"), ("int8", (0,), root, "sync"),
                  ("bool", (5,), root, "inplace"), ("float64", (3, 4), root, "inplace_nc"),
                  ("bfloat16", (3, 4), root, "nc"), ("float64", (2,), root, "grad"),
                  ("uint8", (6,), root, "inplace"), ("int64", (2, 0), root, "inplace")]
    return cases


def broadcast_input(case, rank):
    return values(("bc", case, rank), case[0], case[1], "wrap")


def alltoall_cases(n):
    cases = [(dt, (), "list") for dt in DTYPES]
    return cases + [("float64", (3,), "tensor"), ("int32", (2, 2), "list"), ("float32", (), "none"),
                    ("uint8", (3,), "none"), ("float32", (4,), "zeros"), ("bfloat16", (2,), "nc"),
                    ("float64", (2,), "grad"), ("float64", (), "grad_none")]


def alltoall_plan(case, rank, n):
    """(input, the splits argument, the splits it means)."""
    dt, trailing, how = case
    if how in ("none", "grad_none"):
        used, arg = [2] * n, None
    elif how == "zeros":
        used = arg = [0] * n
    else:
        rng = rng_for("a2a-splits", case, rank)
        used = [int(v) for v in rng.integers(0, 4, n) * (rng.random(n) > 0.3)]
        arg = torch.tensor(used, dtype=torch.int32) if how == "tensor" else used
    return values(("a2a", case, rank), dt, (sum(used),) + trailing, "wrap"), arg, used


def alltoall_expected(xs, used, r):
    """What rank r receives, and its received splits, given every rank's input and splits."""
    starts = [np.cumsum([0] + u).tolist() for u in used]
    got = [x[s[r]:s[r + 1]] for x, s in zip(xs, starts)]
    return torch.cat(got), torch.tensor([u[r] for u in used], dtype=torch.int32)


def reducescatter_cases(n):
    cases = []
    for dt in DTYPES:
        cases += [(dt, op, shape, 1.0, 1.0, "sync") for op in _ops_for(dt)
                  for shape in [(n,), (2 * n + 1, 3)]]
        if dt != "bool":
            cases += [(dt, "Average", (2 * n + 1,), 2.0, 0.5, "sync"),
                      (dt, "Sum", (n + 1, 2), 0.5, 3.0, "sync")]
    for dt in ("float32", "int32"):
        cases += [(dt, "Sum", (1,), 1.0, 1.0, "sync"), (dt, "Sum", (0, 2), 1.0, 1.0, "sync"),
                  (dt, "Average", (2 * n + 1, 2), 1.0, 1.0, "nc")]
    return cases + [("float64", "Sum", (2 * n + 1,), 1.0, 1.0, "grad"),
                    ("bfloat16", "Average", (3 * n,), 1.0, 1.0, "grad")]


def reducescatter_input(case, rank):
    dt, op, shape, pre, post, _ = case
    return values(("rs", case, rank), dt, shape, value_kind(dt, op, (pre, post) != (1, 1)))


def reducescatter_expected(xs, r, op, pre=1.0, post=1.0):
    b = _blocks(xs[0].shape[0], len(xs))
    return reduce_expected([x[b[r]:b[r + 1]] for x in xs], op, pre, post)


def _sec_collectives(hvd, n):
    r, out = hvd.rank(), {}
    for case in allgather_cases(n):
        x = allgather_input(case, r)
        x = _nc(x) if case[3] == "nc" else x.requires_grad_() if case[3] == "grad" else x
        before = x.detach().clone()
        y = hvd.allgather(x)
        out["ag", case] = (y.detach().clone(), _flags(x, y, before))
    for case in broadcast_cases(n):
        dt, shape, root, variant = case
        x = broadcast_input(case, r)
        x = _nc(x) if variant.endswith("nc") else x.requires_grad_() if variant == "grad" else x
        before = x.detach().clone()
        y = (hvd.broadcast_ if variant.startswith("inplace") else hvd.broadcast)(x, root)
        out["bc", case] = (y.detach().clone(), _flags(x, y, before))
    for case in alltoall_cases(n):
        x, arg, _ = alltoall_plan(case, r, n)
        x = _nc(x) if case[2] == "nc" else x.requires_grad_() if "grad" in case[2] else x
        before = x.detach().clone()
        res = hvd.alltoall(x, splits=arg)
        y, splits = res if isinstance(res, tuple) else (res, None)
        out["a2a", case] = (isinstance(res, tuple), y.detach().clone(), splits,
                            _flags(x, y, before))
    for case in reducescatter_cases(n):
        dt, op, shape, pre, post, variant = case
        x = reducescatter_input(case, r)
        x = _nc(x) if variant == "nc" else x.requires_grad_() if variant == "grad" else x
        before = x.detach().clone()
        kw = {} if op == "default" else {"op": getattr(hvd, op)}   # Horovod's default: Average
        y = hvd.reducescatter(x, prescale_factor=pre, postscale_factor=post, **kw)
        out["rs", case] = (y.detach().clone(), _flags(x, y, before))
    return out


# -- grouped ops -----------------------------------------------------------------------------
GROUPS = [("Sum", 1.0, 1.0, [("float32", (5,)), ("float32", (2, 3)), ("float32", ())]),
          ("Average", 1.0, 1.0, [("float64", (3,)), ("int32", (4,)), ("bfloat16", (2,))]),
          ("Max", 1.0, 1.0, [("bool", (4,)), ("uint8", (3,))]),
          ("Sum", 0.5, 3.0, [("float32", (4,)), ("int16", (4,))]),
          ("default", 1.0, 1.0, [("float16", (3,)), ("float64", (0,))])]


def grouped_input(i, j, rank):
    op, pre, post, items = GROUPS[i]
    dt, shape = items[j]
    return values(("grp", i, j, rank), dt, shape, value_kind(dt, op, (pre, post) != (1, 1)))


def grouped_gather_input(j, rank):
    dt, trailing = [("float32", (2,)), ("int8", ()), ("bool", (1,))][j]
    return values(("ggat", j, rank), dt, ((rank + j) % 3,) + trailing, "wrap")


GROUPED_RS = [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 0.5, 3.0)]


def grouped_rs_input(i, j, rank, n):
    dt, shape = [("float32", (2 * n + 1,)), ("int32", (n, 2))][j]
    return values(("grs", i, j, rank), dt, shape, "small")


def _sec_grouped(hvd, n):
    r, out = hvd.rank(), {}
    for i, (op, pre, post, items) in enumerate(GROUPS):
        for variant in ("sync", "inplace", "inplace_nc"):
            xs = [grouped_input(i, j, r) for j in range(len(items))]
            xs = [_nc(x) for x in xs] if variant == "inplace_nc" else xs
            fn = hvd.grouped_allreduce if variant == "sync" else hvd.grouped_allreduce_
            ys = fn(xs, op=op_named(hvd, op), prescale_factor=pre, postscale_factor=post)
            out["ar", i, variant] = ([y.clone() for y in ys], [y is x for x, y in zip(xs, ys)],
                                     isinstance(ys, list))
    ys = hvd.grouped_allgather([grouped_gather_input(j, r) for j in range(3)])
    out["ag"] = [y.clone() for y in ys]
    for i, (op, pre, post) in enumerate(GROUPED_RS):
        xs = [grouped_rs_input(i, j, r, n) for j in range(2)]
        out["rs", i] = hvd.grouped_reducescatter(xs, op=getattr(hvd, op), prescale_factor=pre,
                                                 postscale_factor=post)
    return out


# -- everything outstanding at once: poll(), synchronize() in reverse order ------------------
def async_inputs(key, rank, n):
    spec = {"ar": [("float32", (3, 4))], "ar_": [("int32", (5,))],
            "gar": [("float64", (2,)), ("int16", (3,))], "gar_": [("float32", (3,)),
                                                                  ("float32", (2, 2))],
            "ag": [("float64", (rank % 3, 2))], "gag": [("int8", (rank + 1,)),
                                                         ("float32", (rank % 2, 3))],
            "bc": [("bfloat16", (4,))], "bc_": [("int64", (2, 3))], "a2a": [("float32", (2 * n,))],
            "a2a_s": [("int32", (sum((rank + j) % 3 for j in range(n)),))],
            "rs": [("float32", (2 * n + 1,))],
            "grs": [("float64", (n + 1,)), ("int32", (2 * n, 2))]}
    return [values(("async", key, j, rank), dt, s) for j, (dt, s) in enumerate(spec[key])]


def _sec_async(hvd, n):
    r, h, xs = hvd.rank(), {}, {}
    a = lambda key: xs.setdefault(key, async_inputs(key, r, n))  # noqa: E731
    h["ar"] = hvd.allreduce_async(a("ar")[0], name="async.ar", op=hvd.Sum)
    h["ar_"] = hvd.allreduce_async_(a("ar_")[0], name="async.ar_")
    h["gar"] = hvd.grouped_allreduce_async(a("gar"), name="async.gar", op=hvd.Sum)
    h["gar_"] = hvd.grouped_allreduce_async_(a("gar_"), name="async.gar_", op=hvd.Max)
    h["ag"] = hvd.allgather_async(a("ag")[0], name="async.ag")
    h["gag"] = hvd.grouped_allgather_async(a("gag"), name="async.gag")
    h["bc"] = hvd.broadcast_async(a("bc")[0], n - 1, name="async.bc")
    h["bc_"] = hvd.broadcast_async_(a("bc_")[0], 0, name="async.bc_")
    h["a2a"] = hvd.alltoall_async(a("a2a")[0], name="async.a2a")
    h["a2a_s"] = hvd.alltoall_async(a("a2a_s")[0], splits=[(r + j) % 3 for j in range(n)],
                                    name="async.a2a_s")
    h["rs"] = hvd.reducescatter_async(a("rs")[0], name="async.rs", op=hvd.Sum)
    h["grs"] = hvd.grouped_reducescatter_async(a("grs"), name="async.grs")
    poll_types = {type(hvd.poll(x)).__name__ for x in h.values()}
    deadline = time.monotonic() + 30
    while not all(hvd.poll(x) for x in h.values()):
        assert time.monotonic() < deadline, "poll() never reported every handle done"
        time.sleep(0.001)
    res = {k: hvd.synchronize(h[k]) for k in reversed(list(h))}
    same = {"ar_": res["ar_"] is xs["ar_"][0], "bc_": res["bc_"] is xs["bc_"][0],
            "gar_": [y is x for x, y in zip(xs["gar_"], res["gar_"])]}
    return res, poll_types, same


def async_expected(key, n, r):
    ins = [async_inputs(key, k, n) for k in range(n)]
    col = lambda j: [x[j] for x in ins]  # noqa: E731
    if key in ("ar", "ar_", "gar", "gar_"):
        op = {"ar": "Sum", "ar_": "Average", "gar": "Sum", "gar_": "Max"}[key]
        out = [reduce_expected(col(j), op) for j in range(len(ins[0]))]
        return out if key.startswith("g") else out[0]
    if key in ("ag", "gag"):
        out = [torch.cat(col(j)) for j in range(len(ins[0]))]
        return out if key == "gag" else out[0]
    if key in ("bc", "bc_"):
        return ins[n - 1 if key == "bc" else 0][0]
    if key in ("a2a", "a2a_s"):
        used = [[2] * n if key == "a2a" else [(k + j) % 3 for j in range(n)] for k in range(n)]
        return alltoall_expected(col(0), used, r)
    out = [reducescatter_expected(col(j), r, "Sum" if key == "rs" else "Average")
           for j in range(len(ins[0]))]
    return out if key == "grs" else out[0]


# -- Compression.fp16, join, barrier ---------------------------------------------------------
def compression_cases(n):
    cases = [("allreduce", dt, op, (6,)) for dt in ("float32", "float64", "bfloat16", "float16",
                                                    "int32") for op in ("Sum", "Average")]
    return cases + [("reducescatter", "float32", "Sum", (2 * n + 1,)),
                    ("reducescatter", "float64", "Average", (n, 2)),
                    ("grouped_allreduce", "float64", "Average", (3,)),
                    ("grouped_reducescatter", "float32", "Average", (2 * n + 1,))]


def compression_input(case, rank, j=0):
    return values(("fp16", case, j, rank), case[1], case[3], "small")


def _sec_compression(hvd, n):
    r, out, fp16 = hvd.rank(), {}, hvd.Compression.fp16
    for case in compression_cases(n):
        fn, dt, op, shape = case
        xs = [compression_input(case, r, j) for j in range(2)]
        kw = {"op": getattr(hvd, op), "compression": fp16}
        out[case] = (getattr(hvd, fn)(xs, **kw) if fn.startswith("grouped")
                     else getattr(hvd, fn)(xs[0], **kw))
    return out


def _sec_join_barrier(hvd, n):
    r = hvd.rank()
    hvd.barrier()
    if r == 0:            # rank 0 has no data: it joins at once and adds zeros to the others'
        return hvd.join(), None
    y = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name="join.sum")
    return hvd.join(device=-1), y


# the job's sections, in the order they run (torch_ops_grads.SECTIONS follow them)
SECTIONS = {"info": lambda hvd, n: (hvd.rank(), hvd.size(), hvd.mpi_built()),
            "allreduce": _sec_allreduce, "collectives": _sec_collectives,
            "grouped": _sec_grouped, "async": _sec_async, "compression": _sec_compression,
            "join": _sec_join_barrier}
