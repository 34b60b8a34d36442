"""``hora.torch``'s collectives on real processes, checked against torch on the gathered inputs.

One job per N in 1..4 runs every section (allreduce, allgather, broadcast, alltoall,
reducescatter, grouped ops, async handles, compression, join, gradients, gradcheck, process
sets, bad input) and returns everything; the tests below check one section each.  Every
rank's inputs come from (SEED, case, rank), so this process rebuilds them and computes the
expected values with torch itself.

Gradcheck across ranks: gradcheck perturbs its input on every rank at once, and a collective
mixes those perturbations, so each check has one *active* rank whose op input is the gradcheck
variable; the other ranks feed constants tied to the variable only through ``0 * x``, so every
rank runs the same forward and backward collectives and each rank's Jacobian is exact.
Horovod's allgather and broadcast gradients are averaged over the ranks (1/size of the true
gradient) and its reducescatter gradient is size times the true one; ``_ScaleGrad`` undoes
that so that gradcheck sees the true Jacobian.

Unnamed collectives are matched by a per-process counter per kind, so sections that run on
process sets (which may do different amounts of work) or that may leave a collective behind
(bad input) come last.
"""
import functools
import time
import traceback
import warnings
import zlib

import numpy as np
import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

from tests.helpers import job_fixture, section

SEED = 20261124
SIZES = [1, 2, 3, 4]
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool"]
FLOATS = ("float16", "bfloat16", "float32", "float64")
_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-10}
_FP16_TOL = 2e-2                   # Compression.fp16: values of magnitude ~1, N <= 4 terms
_REDUCE = {"Sum": torch.add, "Average": torch.add, "Min": torch.minimum,
           "Max": torch.maximum, "Product": torch.mul}
_SCALINGS = [("Sum", 0.5, 3.0), ("Average", 2.0, 0.5), ("Average", 1.0, 1.5),
             ("Min", 0.5, 1.0), ("Max", -2.0, 0.5)]


# -- deterministic inputs (used by the workers and by the oracle) ----------------------------
def _rng(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _values(key, dtype, shape, kind="small"):
    """Values that keep the oracle exact where it can be: full-range integers for wrapping
    sums, small integers where results are scaled, powers of two for float products,
    integer-valued float16/bfloat16."""
    rng, dt = _rng(*key), getattr(torch, dtype)
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


def _kind(dtype, op, scaled):
    if dtype == "bool":
        return "and" if op in ("Min", "Product") else "or"
    if op == "Product":
        return "prod"
    return "small" if scaled or op in ("Average", "default") else "wrap"


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


def _op(hvd, name):
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
    return _values(("ar", case, rank), dt, shape, _kind(dt, op, (pre, post) != (1, 1)))


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
            kw["op"] = _op(hvd, op)
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
    return _values(("ag", case, rank), dt, () if rows is None else (rows,) + trailing, "wrap")


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
    return _values(("bc", case, rank), case[0], case[1], "wrap")


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
        rng = _rng("a2a-splits", case, rank)
        used = [int(v) for v in rng.integers(0, 4, n) * (rng.random(n) > 0.3)]
        arg = torch.tensor(used, dtype=torch.int32) if how == "tensor" else used
    return _values(("a2a", case, rank), dt, (sum(used),) + trailing, "wrap"), arg, used


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
    return _values(("rs", case, rank), dt, shape, _kind(dt, op, (pre, post) != (1, 1)))


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
    return _values(("grp", i, j, rank), dt, shape, _kind(dt, op, (pre, post) != (1, 1)))


def grouped_gather_input(j, rank):
    dt, trailing = [("float32", (2,)), ("int8", ()), ("bool", (1,))][j]
    return _values(("ggat", j, rank), dt, ((rank + j) % 3,) + trailing, "wrap")


GROUPED_RS = [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Sum", 0.5, 3.0)]


def grouped_rs_input(i, j, rank, n):
    dt, shape = [("float32", (2 * n + 1,)), ("int32", (n, 2))][j]
    return _values(("grs", i, j, rank), dt, shape, "small")


def _sec_grouped(hvd, n):
    r, out = hvd.rank(), {}
    for i, (op, pre, post, items) in enumerate(GROUPS):
        for variant in ("sync", "inplace", "inplace_nc"):
            xs = [grouped_input(i, j, r) for j in range(len(items))]
            xs = [_nc(x) for x in xs] if variant == "inplace_nc" else xs
            fn = hvd.grouped_allreduce if variant == "sync" else hvd.grouped_allreduce_
            ys = fn(xs, op=_op(hvd, op), prescale_factor=pre, postscale_factor=post)
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
    return [_values(("async", key, j, rank), dt, s) for j, (dt, s) in enumerate(spec[key])]


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
    return _values(("fp16", case, j, rank), case[1], case[3], "small")


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


# -- gradients against their definitions -----------------------------------------------------
def ad_cases(n):
    cases = [("allreduce", op, pre, post) for op in ("Sum", "Average", "default", "Min", "Max",
                                                     "Product")
             for pre, post in [(1.0, 1.0), (0.5, 3.0)]]
    cases += [("allreduce", "average=True", 1.0, 1.0), ("allreduce", "average=False", 1.0, 1.0),
              ("grouped_allreduce", "Sum", 1.0, 1.0), ("grouped_allreduce", "Average", 2.0, 0.5),
              ("allgather", "varied"), ("allgather", "scalar"), ("alltoall", "list"),
              ("alltoall", "none"), ("allreduce_fp16", "Sum", 1.0, 1.0),
              ("reducescatter_fp16", "Average", 1.0, 1.0)]
    cases += [("broadcast", root) for root in range(n)]
    return cases + [("reducescatter", op, pre, post) for op in ("Sum", "Average", "default")
                    for pre, post in [(1.0, 1.0), (0.5, 3.0)]]


def ad_shapes(case, rank, n):
    kind = case[0]
    if kind == "allgather":
        return [()] if case[1] == "scalar" else [((rank + 1) % 3, 2)]
    if kind == "alltoall":
        return [(sum(ad_splits(case, rank, n)), 2)]
    if kind.startswith("reducescatter"):
        return [(2 * n + 1, 2)]
    return [(2, 3), (4,)] if kind == "grouped_allreduce" else [(2, 3)]


def ad_splits(case, rank, n):
    return [2] * n if case[1] == "none" else [(rank + 2 * j) % 3 for j in range(n)]


def ad_inputs(case, rank, n):
    return [_values(("ad", case, i, rank), "float64", s, "normal")
            for i, s in enumerate(ad_shapes(case, rank, n))]


def ad_grads(case, rank, shapes):
    return [_values(("ad-g", case, i, rank), "float64", s, "normal") for i, s in enumerate(shapes)]


def _ad_apply(hvd, case, xs, n, process_set=None):
    """The op of ``case`` on this rank's inputs: a list of outputs."""
    kind, ps = case[0], {} if process_set is None else {"process_set": process_set}
    if kind in ("allreduce", "grouped_allreduce", "allreduce_fp16"):
        op, pre, post = case[1:]
        kw = dict(prescale_factor=pre, postscale_factor=post, **ps)
        if op.startswith("average="):
            kw["average"] = op == "average=True"
        else:
            kw["op"] = _op(hvd, op)
        if kind == "grouped_allreduce":
            return hvd.grouped_allreduce(xs, **kw)
        if kind == "allreduce_fp16":
            kw["compression"] = hvd.Compression.fp16
        return [hvd.allreduce(xs[0], **kw)]
    if kind in ("reducescatter", "reducescatter_fp16"):
        op, pre, post = case[1:]
        comp = hvd.Compression.fp16 if kind.endswith("fp16") else hvd.Compression.none
        if op != "default":
            ps["op"] = getattr(hvd, op)
        return [hvd.reducescatter(xs[0], compression=comp, prescale_factor=pre,
                                  postscale_factor=post, **ps)]
    if kind == "allgather":
        return [hvd.allgather(xs[0], **ps)]
    if kind == "broadcast":
        return [hvd.broadcast(xs[0], case[1], **ps)]
    if kind == "grouped_allgather":
        return hvd.grouped_allgather(xs, **ps)
    if kind == "grouped_reducescatter":
        return hvd.grouped_reducescatter(xs, op=getattr(hvd, case[1]), **ps)
    splits = None if case[1] == "none" else ad_splits(case, hvd.rank(), n)
    res = hvd.alltoall(xs[0], splits=splits, **ps)
    return [res[0] if splits is not None else res]


def _ad_run(hvd, case, n, xs, process_set=None):
    xs = [x.requires_grad_() for x in xs]
    ys = _ad_apply(hvd, case, xs, n, process_set)
    if not all(y.requires_grad for y in ys):
        return "not differentiable"
    shapes = [tuple(y.shape) for y in ys]
    torch.autograd.backward(ys, ad_grads(case, hvd.rank(), shapes))
    return [None if x.grad is None else x.grad.clone() for x in xs], shapes


def _sec_autograd(hvd, n):
    return {case: _ad_run(hvd, case, n, ad_inputs(case, hvd.rank(), n)) for case in ad_cases(n)}


def ad_expected(case, n, members, me, xs, gs):
    """This rank's input gradients by the documented definitions.  ``xs``/``gs``: every
    member's inputs / output gradients, ``me``: this rank's index among the members."""
    kind, m = case[0], len(members)
    if kind in ("allreduce", "grouped_allreduce", "allreduce_fp16"):
        op, pre, post = case[1:]
        op = {"average=True": "Average", "average=False": "Sum"}.get(op, op)
        return [reduce_expected([g[i] for g in gs], op, pre, post) for i in range(len(gs[0]))]
    if kind in ("reducescatter", "reducescatter_fp16", "grouped_reducescatter"):
        # Horovod's definition: the gathered gradient, times size for Sum, times the scales
        op, pre, post = (case[1], 1.0, 1.0) if kind.startswith("grouped") else case[1:]
        mult = m if op == "Sum" else 1
        return [torch.cat([g[i] for g in gs]) * pre * post * mult for i in range(len(gs[0]))]
    if kind in ("allgather", "grouped_allgather"):
        out = []
        for i, x in enumerate(xs[me]):
            avg = sum(g[i] for g in gs) / m
            rows = [1 if v[i].dim() == 0 else v[i].shape[0] for v in xs]
            out.append(avg[sum(rows[:me]):sum(rows[:me + 1])].reshape(x.shape))
        return out
    if kind == "broadcast":
        avg = sum(g[0] for g in gs) / m
        return [avg if members[me] == case[1] else torch.zeros_like(avg)]
    used = [ad_splits(case, k, n) for k in members]         # alltoall: the reverse exchange
    starts = [np.cumsum([0] + [u[j] for u in used]).tolist() for j in range(m)]
    return [torch.cat([gs[j][0][starts[j][me]:starts[j][me + 1]] for j in range(m)])]


def grouped_ad_cases(n):
    return [("grouped_allgather",), ("grouped_reducescatter", "Sum"),
            ("grouped_reducescatter", "Average")]


def grouped_ad_inputs(case, rank, n):
    shapes = ([((rank + 1) % 3, 2), (rank % 2 + 1,)] if case[0] == "grouped_allgather"
              else [(2 * n + 1,), (n, 2)])
    return [_values(("gad", case, i, rank), "float64", s, "normal") for i, s in enumerate(shapes)]


def _sec_grouped_autograd(hvd, n):
    return {case: _ad_run(hvd, case, n, grouped_ad_inputs(case, hvd.rank(), n))
            for case in grouped_ad_cases(n)}


# -- torch.autograd.gradcheck across ranks ---------------------------------------------------
class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``k`` (undoes Horovod's averaged gradients)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


def gc_cases(n):
    return [("allreduce", "Sum", 1.0, 1.0), ("allreduce", "Average", 1.0, 1.0),
            ("allreduce", "Sum", 0.5, 3.0), ("allreduce", "Average", 2.0, 0.25),
            ("allreduce", "average=False", 1.0, 1.0), ("grouped_allreduce", "Average", 1.0, 1.0),
            ("allgather", "varied"), ("broadcast", 0), ("broadcast", n - 1), ("alltoall", "list"),
            ("alltoall", "none"), ("reducescatter", "Sum", 1.0, 1.0),
            ("reducescatter", "Average", 2.0, 0.25)]


def gc_shapes(case, rank, n):
    if case[0] in ("allgather", "alltoall"):
        return [s[:1] for s in ad_shapes(case, rank, n)]
    if case[0] == "reducescatter":
        return [(n + 1,)]
    return [(2,), (1, 2)] if case[0] == "grouped_allreduce" else [(3,)]


def _gradcheck(hvd, case, n, active, shapes, process_set=None, scale=1.0):
    """gradcheck one op with ``active`` (a global rank; None: every rank, same perturbation)
    holding the variable.  Returns 'ok' or the failure."""
    r = hvd.rank()
    xs = [_values(("gc", case, active, i), "float64", s, "normal").requires_grad_()
          for i, s in enumerate(shapes(active if active is not None else 0))]
    consts = [_values(("gc", case, r, i), "float64", s, "normal")
              for i, s in enumerate(shapes(r))]
    first = []

    def f(*xs):
        if active is None:
            us = [x + b for x, b in zip(xs, consts)]
        elif r == active:
            us = [_ScaleGrad.apply(x, scale) for x in xs]
        else:
            anchor = 0 * sum(x.sum() for x in xs)      # in the graph, constant in value
            us = [b + anchor for b in consts]
        flat = torch.cat([y.reshape(-1) for y in _ad_apply(hvd, case, us, n, process_set)])
        w = torch.from_numpy(_rng("gc-w", case, active, r if active is not None else 0)
                             .standard_normal((3, flat.numel())))
        y = w @ flat
        if active is not None and r != active:
            y = 0 * y + sum(x.sum() for x in xs)
        first.append(y)
        return y

    try:
        torch.autograd.gradcheck(f, xs, atol=1e-6, rtol=1e-4, check_undefined_grad=False)
        return "ok"
    except GradcheckError as e:
        # gradcheck stops at its first failed comparison and skips its last backward pass
        # (of zeros), which the other ranks still run: run it here to keep them in step
        if "grad_output" not in str(e) and "grad is incorrect" not in str(e):
            torch.autograd.grad(first[0], xs, torch.zeros_like(first[0]), allow_unused=True)
        return f"GradcheckError: {e}"


def _sec_gradcheck(hvd, n):
    out = {}
    for case in gc_cases(n):
        scale = {"allgather": n, "broadcast": n, "reducescatter": 1.0 / n}.get(case[0], 1.0)
        shapes = functools.partial(gc_shapes, case, n=n)
        # every rank for the ops whose offsets depend on the rank, first and last for others
        actives = range(n) if case[0] in ("allgather", "alltoall") else sorted({0, n - 1})
        for active in actives:
            if all(s[0] > 0 for s in shapes(active)):
                out[case, active] = _gradcheck(hvd, case, n, active, shapes, scale=scale)
    for case in gc_cases(n)[:5]:           # every rank perturbed at once: valid for allreduce
        out[case, "all"] = _gradcheck(hvd, case, n, None, lambda k: [(3,)])
    return out


# -- process sets (last but one: the two sets do the same number of each collective) --------
def _sec_process_sets(hvd, n):
    r = hvd.rank()
    even = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odd = hvd.add_process_set([k for k in range(n) if k % 2]) if n > 1 else None
    ps = even if r % 2 == 0 else odd
    members, me, m = ps.ranks, ps.rank(), ps.size()
    v = lambda what, dt, shape: _values(("ps", what, r), dt, shape)  # noqa: E731
    out = {"members": members, "allreduce": hvd.allreduce(v("ar", "float32", (4,)), op=hvd.Sum,
                                                          process_set=ps)}
    x = v("ar_", "int32", (3,))
    out["allreduce_"] = (hvd.allreduce_(x, process_set=ps) is x, x)
    out["allgather"] = hvd.allgather(v("ag", "int16", (r % 3, 2)), process_set=ps)
    out["broadcast"] = hvd.broadcast(v("bc", "float64", (3,)), members[-1], process_set=ps)
    x = v("bc_", "uint8", (2,))
    hvd.broadcast_(x, members[0], process_set=ps)
    out["broadcast_"] = x
    out["alltoall"] = hvd.alltoall(v("a2a", "float32", (sum((me + j) % 3 for j in range(m)),)),
                                   splits=[(me + j) % 3 for j in range(m)], process_set=ps)
    out["reducescatter"] = hvd.reducescatter(v("rs", "float64", (2 * m + 1, 2)), op=hvd.Sum,
                                             process_set=ps)
    out["grouped"] = hvd.grouped_allreduce([v("g0", "float32", (2,)), v("g1", "int8", ())],
                                           op=hvd.Max, process_set=ps)
    hvd.barrier(process_set=ps)
    for case in ps_ad_cases(members):
        out["ad", case[:2]] = _ad_run(hvd, case, n, ad_inputs(case, r, n), process_set=ps)
    for case in [("allgather", "varied"), ("broadcast", members[-1]),
                 ("reducescatter", "Average", 1.0, 1.0)]:
        for active in (members[0], members[-1]):       # as many checks in both sets
            shapes = functools.partial(ps_gc_shapes, case, m=m, active=active)
            scale = m if case[0] != "reducescatter" else 1.0 / m
            out["gc", case[:2], members.index(active)] = _gradcheck(
                hvd, case, n, active, shapes, process_set=ps, scale=scale)
    hvd.barrier()
    hvd.remove_process_set(even)
    if odd is not None:
        hvd.remove_process_set(odd)
    return out


def ps_ad_cases(members):
    return [("allreduce", "Sum", 1.0, 1.0), ("allgather", "varied"),
            ("broadcast", members[0]), ("broadcast", members[-1]),
            ("reducescatter", "Average", 1.0, 1.0)]


def ps_gc_shapes(case, rank, m, active):
    if case[0] == "allgather":
        return [(2,)] if rank == active else [(rank % 3,)]
    return [(3,)]          # the same shapes in both sets: as many forward passes


# -- bad input (last: a bad call that left a collective behind would desync the counters) ----
def bad_calls(hvd):
    """name -> (the exception, the call); made on every rank."""
    f = torch.ones(4)
    c64, b = torch.ones(4, dtype=torch.complex64), torch.ones(4, dtype=torch.bool)
    return {
        "allreduce complex64": ("TypeError", lambda: hvd.allreduce(c64, op=hvd.Sum)),
        "allreduce complex128 requires_grad": ("TypeError", lambda: hvd.allreduce(
            torch.ones(2, dtype=torch.complex128, requires_grad=True))),
        "allreduce bool default op": ("TypeError", lambda: hvd.allreduce(b)),
        "allreduce bool Average": ("TypeError", lambda: hvd.allreduce(b, op=hvd.Average)),
        "allreduce bool average=True": ("TypeError", lambda: hvd.allreduce(b, average=True)),
        "allreduce bool prescale": ("TypeError", lambda: hvd.allreduce(
            b, op=hvd.Sum, prescale_factor=2.0)),
        "allreduce bool postscale": ("TypeError", lambda: hvd.allreduce(
            b, op=hvd.Max, postscale_factor=0.5)),
        "allreduce_ bool": ("TypeError", lambda: hvd.allreduce_(b.clone())),
        "allreduce_async complex": ("TypeError", lambda: hvd.allreduce_async(c64)),
        "allreduce_async_ complex": ("TypeError", lambda: hvd.allreduce_async_(c64.clone())),
        "allreduce list": ("TypeError", lambda: hvd.allreduce([1.0, 2.0])),
        "allreduce fp16 complex": ("TypeError", lambda: hvd.allreduce(
            c64, compression=hvd.Compression.fp16)),
        "grouped_allreduce complex": ("TypeError", lambda: hvd.grouped_allreduce([f, c64])),
        "grouped_allreduce_ bool": ("TypeError", lambda: hvd.grouped_allreduce_(
            [f.clone(), b.clone()])),
        "grouped_allreduce_async complex": ("TypeError", lambda: hvd.grouped_allreduce_async(
            [f, c64])),
        "allgather complex": ("TypeError", lambda: hvd.allgather(c64)),
        "grouped_allgather complex": ("TypeError", lambda: hvd.grouped_allgather([f, c64])),
        "broadcast complex": ("TypeError", lambda: hvd.broadcast(c64, 0)),
        "broadcast_ complex": ("TypeError", lambda: hvd.broadcast_(c64.clone(), 0)),
        "broadcast_async_ complex": ("TypeError", lambda: hvd.broadcast_async_(c64.clone(), 0)),
        "alltoall complex": ("TypeError", lambda: hvd.alltoall(c64)),
        "reducescatter complex": ("TypeError", lambda: hvd.reducescatter(c64)),
        "reducescatter bool Average": ("TypeError", lambda: hvd.reducescatter(b)),
        "grouped_reducescatter complex": ("TypeError", lambda: hvd.grouped_reducescatter(
            [f, c64])),
        "Adasum": ("NotImplementedError", lambda: hvd.allreduce(f, op=hvd.Adasum)),
        "average= and op=": ("ValueError", lambda: hvd.allreduce(f, average=True, op=hvd.Sum)),
        "alltoall bad splits": ("InvalidArgumentError",
                                lambda: hvd.alltoall(f, splits=[5] * hvd.size())),
        "reducescatter 0-d": ("ValueError", lambda: hvd.reducescatter(torch.tensor(1.0))),
    }


def _wait(hvd, handle, seconds):
    deadline = time.monotonic() + seconds
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            return "stuck"
        time.sleep(0.001)
    try:
        return hvd.synchronize(handle)
    except Exception as e:       # e.g. the peer gave up on a stuck collective and shut down
        return f"{type(e).__name__}: {e}"


def _verify_round(hvd, n):
    """One unnamed collective of every kind: they pair up only if no rank's counters moved."""
    r, out = hvd.rank(), {}
    one = torch.full((2 * n,), float(r))
    starts = [("allreduce", lambda: hvd.allreduce_async(one, op=hvd.Sum)),
              ("allreduce_", lambda: hvd.allreduce_async_(one.clone(), op=hvd.Sum)),
              ("grouped_allreduce", lambda: hvd.grouped_allreduce_async([one, one], op=hvd.Sum)),
              ("allgather", lambda: hvd.allgather_async(one[:1])),
              ("grouped_allgather", lambda: hvd.grouped_allgather_async([one[:1], one[:2]])),
              ("broadcast", lambda: hvd.broadcast_async(one, 0)),
              ("alltoall", lambda: hvd.alltoall_async(one)),
              ("reducescatter", lambda: hvd.reducescatter_async(one, op=hvd.Sum)),
              ("grouped_reducescatter", lambda: hvd.grouped_reducescatter_async([one, one],
                                                                               op=hvd.Sum))]
    for what, start in starts:
        out[what] = _wait(hvd, start(), 10)
        if isinstance(out[what], str):
            break
    return out


def _sec_errors(hvd, n):
    got = {}
    for key, (_, call) in bad_calls(hvd).items():
        started = time.monotonic()
        try:
            call()
            got[key] = None
        except Exception as e:
            got[key] = (type(e).__name__, str(e), time.monotonic() - started)
    after = _verify_round(hvd, n)
    if n != 2:
        return got, after, None, None
    # a bad tensor after a good one in grouped_reducescatter, on the last rank only: it
    # raises there, the others' calls fail naming it, and the unnamed calls stay in step
    last = hvd.rank() == n - 1
    try:
        hvd.grouped_reducescatter([torch.ones(4),
                                   torch.ones(4, dtype=torch.bool if last else torch.float32)])
        late = None
    except Exception as e:
        late = type(e).__name__
    return got, after, late, _wait(hvd, hvd.reducescatter_async(torch.ones(n), op=hvd.Sum), 3)


_SECTIONS = {"info": lambda hvd, n: (hvd.rank(), hvd.size(), hvd.mpi_built()),
             "allreduce": _sec_allreduce, "collectives": _sec_collectives,
             "grouped": _sec_grouped, "async": _sec_async, "compression": _sec_compression,
             "join": _sec_join_barrier, "autograd": _sec_autograd,
             "grouped_autograd": _sec_grouped_autograd, "gradcheck": _sec_gradcheck,
             "process_sets": _sec_process_sets, "errors": _sec_errors}


def _worker(n):
    import hora.torch as hvd
    torch.set_num_threads(1)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, run in _SECTIONS.items():
            started = time.monotonic()
            try:
                out[name] = ("ok", run(hvd, n), time.monotonic() - started)
            except Exception:
                out[name] = ("error", traceback.format_exc(), time.monotonic() - started)
    out["warnings"] = ("ok", [f"{w.category.__name__}: {w.message}" for w in caught], 0.0)
    return out


job = job_fixture(_worker)


def assert_flags(flags, inplace, grad, what):
    same, unchanged, shares, requires_grad = flags
    if inplace:
        assert same, f"{what}: the in-place op did not return its input tensor"
    else:
        assert not same and unchanged and not shares, \
            f"{what}: out-of-place op returned its input / modified it / shares its memory"
    assert requires_grad == grad, f"{what}: output requires_grad is {requires_grad}"


# -- the tests -------------------------------------------------------------------------------
pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("n", SIZES)
def test_job_runs_every_section_without_warnings(job, n):
    """The first test per N: its duration is the whole job's."""
    results = job(n)
    assert section(results, "info") == [(r, n, False) for r in range(n)]
    for r, caught in enumerate(section(results, "warnings")):
        assert caught == [], f"rank {r} warned: {caught}"


@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_dtype_op_variant(job, n):
    per_rank = section(job(n), "allreduce")
    for case in allreduce_cases(n):
        dt, op, shape, pre, post, variant = case
        exp = reduce_expected([allreduce_input(case, k) for k in range(n)], op, pre, post)
        for r in range(n):
            got, flags = per_rank[r][case]
            what = f"n={n} {case} rank {r}"
            assert_tensor(got, exp, what)
            assert_flags(flags, variant.startswith("inplace"), variant == "grad", what)


@pytest.mark.parametrize("n", SIZES)
def test_allgather_broadcast_alltoall_reducescatter(job, n):
    per_rank = section(job(n), "collectives")
    for case in allgather_cases(n):
        xs = [allgather_input(case, k) for k in range(n)]
        exp = torch.cat([x.reshape((-1,) + case[1]) for x in xs])
        for r in range(n):
            got, flags = per_rank[r]["ag", case]
            assert_tensor(got, exp, f"allgather n={n} {case} rank {r}")
            assert_flags(flags, False, case[3] == "grad", f"allgather {case}")
    for case in broadcast_cases(n):
        exp = broadcast_input(case, case[2])
        for r in range(n):
            got, flags = per_rank[r]["bc", case]
            assert_tensor(got, exp, f"broadcast n={n} {case} rank {r}")
            assert_flags(flags, case[3].startswith("inplace"), case[3] == "grad",
                         f"broadcast {case} rank {r}")
    for case in alltoall_cases(n):
        plans = [alltoall_plan(case, k, n) for k in range(n)]
        for r in range(n):
            is_tuple, got, splits, flags = per_rank[r]["a2a", case]
            exp, exp_splits = alltoall_expected([p[0] for p in plans], [p[2] for p in plans], r)
            assert is_tuple == (plans[r][1] is not None), f"alltoall {case}: return convention"
            assert_tensor(got, exp, f"alltoall n={n} {case} rank {r}")
            if is_tuple:
                assert_tensor(splits, exp_splits, f"alltoall {case} rank {r} received splits")
            assert_flags(flags, False, "grad" in case[2], f"alltoall {case}")
    for case in reducescatter_cases(n):
        xs = [reducescatter_input(case, k) for k in range(n)]
        for r in range(n):
            got, flags = per_rank[r]["rs", case]
            exp = reducescatter_expected(xs, r, case[1], case[3], case[4])
            assert_tensor(got, exp, f"reducescatter n={n} {case} rank {r}")
            assert_flags(flags, False, case[5] == "grad", f"reducescatter {case}")


@pytest.mark.parametrize("n", SIZES)
def test_grouped_ops(job, n):
    per_rank = section(job(n), "grouped")
    for r, res in enumerate(per_rank):
        for i, (op, pre, post, items) in enumerate(GROUPS):
            for variant in ("sync", "inplace", "inplace_nc"):
                got, same, is_list = res["ar", i, variant]
                assert is_list and len(got) == len(items), (i, variant)
                assert all(same) == (variant != "sync") and any(same) == all(same), (i, variant)
                for j in range(len(items)):
                    exp = reduce_expected([grouped_input(i, j, k) for k in range(n)], op, pre, post)
                    assert_tensor(got[j], exp, f"grouped_allreduce {i}.{j} {variant} rank {r}")
        for j in range(3):
            exp = torch.cat([grouped_gather_input(j, k) for k in range(n)])
            assert_tensor(res["ag"][j], exp, f"grouped_allgather {j} rank {r}")
        for i, (op, pre, post) in enumerate(GROUPED_RS):
            assert isinstance(res["rs", i], list) and len(res["rs", i]) == 2
            for j in range(2):
                xs = [grouped_rs_input(i, j, k, n) for k in range(n)]
                assert_tensor(res["rs", i][j], reducescatter_expected(xs, r, op, pre, post),
                              f"grouped_reducescatter {i}.{j} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_async_handles_poll_and_synchronize(job, n):
    for r, (res, poll_types, same) in enumerate(section(job(n), "async")):
        assert poll_types == {"bool"}, (r, poll_types)
        assert same == {"ar_": True, "bc_": True, "gar_": [True, True]}, (r, same)
        for key, got in res.items():
            exp = async_expected(key, n, r)
            if isinstance(exp, tuple):                       # alltoall_async: always a pair
                assert isinstance(got, tuple) and len(got) == 2, (key, type(got))
            if isinstance(exp, (list, tuple)):
                assert type(got) is type(exp) and len(got) == len(exp), (key, got)
                for j, (g, e) in enumerate(zip(got, exp)):
                    assert_tensor(g, e, f"{key}[{j}] rank {r}")
            else:
                assert_tensor(got, exp, f"{key} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_compression_fp16_keeps_dtype(job, n):
    per_rank = section(job(n), "compression")
    for case in compression_cases(n):
        fn, dt, op, _ = case
        for r in range(n):
            got = per_rank[r][case]
            for j in range(2 if fn.startswith("grouped") else 1):
                xs = [compression_input(case, k, j) for k in range(n)]
                exp = (reducescatter_expected(xs, r, op) if fn.endswith("reducescatter")
                       else reduce_expected(xs, op))
                assert_tensor(got[j] if fn.startswith("grouped") else got, exp,
                              f"{case}[{j}] rank {r}", tol=_FP16_TOL)


@pytest.mark.parametrize("n", SIZES)
def test_join_and_barrier(job, n):
    per_rank = section(job(n), "join")
    lasts = {last for last, _ in per_rank}
    assert len(lasts) == 1 and lasts <= set(range(n)), lasts
    if n > 1:
        assert lasts != {0}, "rank 0 joined first, yet join() says it was last"
    for r, (_, y) in enumerate(per_rank[1:], start=1):    # rank 0 joined: it adds zeros
        assert_tensor(y, torch.full((3,), float(sum(range(1, n)))), f"join rank {r}")


def _check_gradients(per_rank, cases, n, inputs):
    for case in cases:
        for r in range(n):
            assert per_rank[r][case] != "not differentiable", f"{case}: no grad_fn on rank {r}"
        xs = [inputs(case, k, n) for k in range(n)]
        gs = [ad_grads(case, k, per_rank[k][case][1]) for k in range(n)]
        for r in range(n):
            got, _ = per_rank[r][case]
            exp = ad_expected(case, n, list(range(n)), r, xs, gs)
            tol = _FP16_TOL if "fp16" in case[0] else None
            for i, (g, e) in enumerate(zip(got, exp)):
                assert_tensor(g, e, f"gradient of {case} input {i} rank {r}", tol=tol)


@pytest.mark.parametrize("n", SIZES)
def test_gradients_match_their_definitions(job, n):
    _check_gradients(section(job(n), "autograd"), ad_cases(n), n, ad_inputs)


@pytest.mark.parametrize("n", [2])
def test_grouped_allgather_and_reducescatter_are_differentiable(job, n):
    _check_gradients(section(job(n), "grouped_autograd"), grouped_ad_cases(n), n,
                     grouped_ad_inputs)


@pytest.mark.parametrize("n", SIZES)
def test_gradcheck_every_differentiable_op(job, n):
    per_rank = section(job(n), "gradcheck")
    assert len(per_rank[0]) >= len(gc_cases(n))
    for r, res in enumerate(per_rank):
        failed = {key: why for key, why in res.items() if why != "ok"}
        assert not failed, f"rank {r}: {failed}"


@pytest.mark.parametrize("n", SIZES)
def test_process_sets(job, n):
    per_rank = section(job(n), "process_sets")
    for r, out in enumerate(per_rank):
        members = [k for k in range(n) if k % 2 == r % 2]
        me, m = members.index(r), len(members)
        assert out["members"] == members
        v = lambda what, dt, shape, k: _values(("ps", what, k), dt, shape)  # noqa: E731
        assert_tensor(out["allreduce"], sum(v("ar", "float32", (4,), k) for k in members),
                      f"allreduce rank {r}")
        same, x = out["allreduce_"]
        assert same
        assert_tensor(x, reduce_expected([v("ar_", "int32", (3,), k) for k in members],
                                         "Average"), f"allreduce_ rank {r}")
        assert_tensor(out["allgather"], torch.cat([v("ag", "int16", (k % 3, 2), k)
                                                   for k in members]), f"allgather rank {r}")
        assert_tensor(out["broadcast"], v("bc", "float64", (3,), members[-1]), "broadcast")
        assert_tensor(out["broadcast_"], v("bc_", "uint8", (2,), members[0]), "broadcast_")
        used = [[(i + j) % 3 for j in range(m)] for i in range(m)]
        xs = [v("a2a", "float32", (sum(used[i]),), k) for i, k in enumerate(members)]
        exp, exp_splits = alltoall_expected(xs, used, me)
        assert_tensor(out["alltoall"][0], exp, f"alltoall rank {r}")
        assert_tensor(out["alltoall"][1], exp_splits, f"alltoall splits rank {r}")
        xs = [v("rs", "float64", (2 * m + 1, 2), k) for k in members]
        assert_tensor(out["reducescatter"], reducescatter_expected(xs, me, "Sum"), "rs")
        for j, (dt, shape) in enumerate([("float32", (2,)), ("int8", ())]):
            exp = reduce_expected([v(f"g{j}", dt, shape, k) for k in members], "Max")
            assert_tensor(out["grouped"][j], exp, f"grouped_allreduce {j} rank {r}")
        for case in ps_ad_cases(members):
            xs = [ad_inputs(case, k, n) for k in members]
            got, _ = out["ad", case[:2]]
            gs = [ad_grads(case, k, per_rank[k]["ad", case[:2]][1]) for k in members]
            for g, e in zip(got, ad_expected(case, n, members, me, xs, gs)):
                assert_tensor(g, e, f"set gradient of {case} rank {r}")
        failed = {k: why for k, why in out.items() if k[0] == "gc" and why != "ok"}
        assert not failed, f"rank {r}: {failed}"


@pytest.mark.parametrize("n", SIZES)
def test_bad_input_raises_at_once_and_the_names_stay_in_step(job, n):
    """Every rank makes the same bad calls: each raises its own error at once, and the
    unnamed collectives after them still pair up (the failed calls took their names)."""
    per_rank = section(job(n), "errors")
    for r, (got, _, _, _) in enumerate(per_rank):
        for key, (exc, _) in bad_calls(None).items():
            assert got[key] is not None, f"rank {r} {key}: no error"
            assert got[key][0] == exc, f"rank {r} {key}: {got[key][0]}: {got[key][1]}"
            assert got[key][2] < 1.0, f"rank {r} {key}: took {got[key][2]:.1f} s to fail"
    for r, (_, after, _, _) in enumerate(per_rank):
        stuck = [k for k, v in after.items() if isinstance(v, str)]
        assert not stuck, f"rank {r}: collectives after the bad calls never finished: {stuck}"
        assert len(after) == 9
        total = float(sum(range(n)))
        assert_tensor(after["allreduce"], torch.full((2 * n,), total), f"rank {r}")
        assert_tensor(after["allreduce_"], torch.full((2 * n,), total), f"rank {r}")
        assert_tensor(after["broadcast"], torch.zeros(2 * n), f"rank {r}")
        assert_tensor(after["allgather"], torch.arange(n, dtype=torch.float32), f"rank {r}")


@pytest.mark.parametrize("n", [2])
def test_grouped_reducescatter_bad_later_tensor_fails_the_other_ranks(job, n):
    per_rank = section(job(n), "errors")
    assert per_rank[-1][2] == "TypeError"
    assert [late for _, _, late, _ in per_rank[:-1]] == ["CollectiveAbortedError"] * (n - 1)
    for r, (_, _, _, after) in enumerate(per_rank):
        assert not isinstance(after, str), f"rank {r}: the next reducescatter never finished"
        assert_tensor(after, torch.full((1,), float(n)), f"rank {r}")
