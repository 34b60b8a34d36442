"""The gradient sections of ``hora.torch``'s job (test_torch_ops.py): gradients against their
definitions, torch.autograd.gradcheck across ranks, process sets and bad input.

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

import numpy as np
import torch
from torch.autograd.gradcheck import GradcheckError

from tests.multiproc.torch_ops_cases import op_named, reduce_expected, rng_for, values

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
    return [values(("ad", case, i, rank), "float64", s, "normal")
            for i, s in enumerate(ad_shapes(case, rank, n))]


def ad_grads(case, rank, shapes):
    return [values(("ad-g", case, i, rank), "float64", s, "normal") for i, s in enumerate(shapes)]


def _ad_apply(hvd, case, xs, n, process_set=None):
    """The op of ``case`` on this rank's inputs: a list of outputs."""
    kind, ps = case[0], {} if process_set is None else {"process_set": process_set}
    if kind in ("allreduce", "grouped_allreduce", "allreduce_fp16"):
        op, pre, post = case[1:]
        kw = dict(prescale_factor=pre, postscale_factor=post, **ps)
        if op.startswith("average="):
            kw["average"] = op == "average=True"
        else:
            kw["op"] = op_named(hvd, op)
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
    return [values(("gad", case, i, rank), "float64", s, "normal") for i, s in enumerate(shapes)]


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
    xs = [values(("gc", case, active, i), "float64", s, "normal").requires_grad_()
          for i, s in enumerate(shapes(active if active is not None else 0))]
    consts = [values(("gc", case, r, i), "float64", s, "normal")
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
        w = torch.from_numpy(rng_for("gc-w", case, active, r if active is not None else 0)
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
    v = lambda what, dt, shape: values(("ps", what, r), dt, shape)  # noqa: E731
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


# the job's sections after torch_ops_cases.SECTIONS, in the order they run
SECTIONS = {"autograd": _sec_autograd, "grouped_autograd": _sec_grouped_autograd,
            "gradcheck": _sec_gradcheck, "process_sets": _sec_process_sets,
            "errors": _sec_errors}
