"""The job behind test_tf_ops.py: every rank's inputs, the NumPy oracle, the sections each
rank runs (each op eagerly and inside one ``tf.function``, gradients by ``tf.GradientTape``
both ways, compression, IndexedSlices, join, a shape mismatch, a bad argument on one rank,
the XLA refusal) and Horovod's signatures.  Every rank's inputs come from (SEED, case,
rank), so the test process rebuilds them and computes the expected values with NumPy.
"""
import time
import zlib

import numpy as np

from tests.helpers import call_case

SEED = 20261125
DTYPES = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "bool"]
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-10}
MODES = ["eager", "graph"]


# -- deterministic inputs (used by the workers and by the oracle) ----------------------------
def rng_for(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def values(key, dtype, shape):
    """Small integer values (exact in every dtype and under sums of <= 3 terms); bool for
    bool.  bfloat16 comes back as float64 (the worker casts)."""
    rng = rng_for(*key)
    if dtype == "bool":
        return rng.random(shape) < 0.4
    lo = 0 if dtype == "uint8" else -8
    x = rng.integers(lo, 9, size=shape)
    return x.astype("float64" if dtype == "bfloat16" else dtype)


def _floaty(dtype):
    return dtype.startswith("float") or dtype == "bfloat16"


def allreduce_cases():
    cases = []
    for dt in DTYPES:
        ops = ["Sum", "Min", "Max"] if dt == "bool" else ["Sum", "Average", "Min", "Max"]
        cases += [(dt, op, (3, 4), 1.0, 1.0) for op in ops]
    return cases + [("float32", "Product", (5,), 1.0, 1.0), ("int32", "Product", (5,), 1.0, 1.0),
                    ("float64", "Sum", (5,), 0.5, 3.0), ("float32", "Average", (), 2.0, 0.5),
                    ("int64", "Sum", (0,), 1.0, 1.0)]


def allgather_rows(rank):
    return (rank + 1) % 3          # 1, 2, 0 rows: one rank sends none when N = 3


def alltoall_splits(case, rank, n):
    return [int(v) for v in rng_for("a2a-splits", case, rank).integers(0, 3, n)]


# -- the worker's sections -----------------------------------------------------------------------
def _out(tf, t):
    """A result as plain NumPy: (dtype name, array; bfloat16 as float64)."""
    if isinstance(t, tf.IndexedSlices):
        return ("IndexedSlices", _out(tf, t.values), _out(tf, t.indices))
    name = t.dtype.name
    if name == "bfloat16":
        t = tf.cast(t, tf.float64)
    return (name, np.array(t.numpy()))


def _in(tf, key, dt, shape):
    return tf.cast(tf.constant(values(key, dt, shape)), getattr(tf, dt))


def _collectives(hvd, tf, n):
    """Every op over many dtypes; returns {key: tensor}.  Run eagerly and traced."""
    r, out = hvd.rank(), {}
    for case in allreduce_cases():
        dt, op, shape, pre, post = case
        out["ar", case] = hvd.allreduce(_in(tf, ("ar", case, r), dt, shape),
                                        op=getattr(hvd, op), prescale_factor=pre,
                                        postscale_factor=post)
    out["ar", "average=False"] = hvd.allreduce(_in(tf, ("avg", r), "int32", (4,)),
                                               average=False)
    out["ar", "default"] = hvd.allreduce(_in(tf, ("dflt", r), "float64", (4,)))
    grouped = [_in(tf, ("gar", j, r), dt, (2, j + 1))
               for j, dt in enumerate(["float32", "int32", "bfloat16"])]
    for j, y in enumerate(hvd.grouped_allreduce(grouped, op=hvd.Sum)):
        out["gar", j] = y
    for dt in DTYPES:
        out["ag", dt] = hvd.allgather(_in(tf, ("ag", dt, r), dt, (allgather_rows(r), 2)))
        out["bc", dt] = hvd.broadcast(_in(tf, ("bc", dt, r), dt, (2, 3)), root_rank=n - 1)
    gathered = hvd.grouped_allgather([_in(tf, ("gag", j, r), "float32", (allgather_rows(r), j))
                                      for j in range(2)])
    for j, y in enumerate(gathered):
        out["gag", j] = y
    for dt in ("float32", "int64", "bfloat16"):
        splits = alltoall_splits(dt, r, n)
        got, received = hvd.alltoall(_in(tf, ("a2a", dt, r), dt, (sum(splits), 2)),
                                     splits=splits)
        out["a2a", dt], out["a2a-splits", dt] = got, received
    out["a2a", "even"] = hvd.alltoall(_in(tf, ("a2a-even", r), "float64", (2 * n,)))
    for dt, op in [("float32", "Sum"), ("float64", "Average"), ("int32", "Sum")]:
        out["rs", dt, op] = hvd.reducescatter(_in(tf, ("rs", dt, op, r), dt, (2 * n + 1, 2)),
                                              op=getattr(hvd, op))
    scattered = hvd.grouped_reducescatter([_in(tf, ("grs", j, r), "float32", (n + j, 2))
                                           for j in range(2)], op=hvd.Sum)
    for j, y in enumerate(scattered):
        out["grs", j] = y
    out["fp16", "float32"] = hvd.allreduce(_in(tf, ("fp16", r), "float32", (6,)), op=hvd.Sum,
                                           compression=hvd.Compression.fp16)
    out["fp16", "int32"] = hvd.allreduce(_in(tf, ("fp16i", r), "int32", (6,)), op=hvd.Sum,
                                         compression=hvd.Compression.fp16)
    for op in ("Sum", "Average"):
        slices = tf.IndexedSlices(_in(tf, ("is", op, r), "float32", (r + 1, 3)),
                                  tf.constant(list(range(r + 1)), dtype=tf.int64),
                                  dense_shape=tf.constant([5, 3], dtype=tf.int64))
        out["is", op] = hvd.allreduce(slices, op=getattr(hvd, op))
    return out


def _traced(tf, fn):
    """``fn()`` (a dict) run as one tf.function (whose outputs are a list: nest cannot sort
    these keys)."""
    keys = []

    def outputs():
        res = fn()
        keys.extend(res)
        return list(res.values())
    return dict(zip(keys, tf.function(outputs)()))


def _sec_ops(hvd, tf, n, mode):
    fn = lambda: _collectives(hvd, tf, n)  # noqa: E731
    res = fn() if mode == "eager" else _traced(tf, fn)
    return {k: _out(tf, v) for k, v in res.items()}


# gradients: d/dx sum(w * op(x)) with rank-dependent weights w, checked against Horovod's
# definitions (see test_gradients_match_horovods_definitions)
GRAD_CASES = [("allreduce", "Sum"), ("allreduce", "Average"), ("grouped_allreduce", "Sum"),
              ("allgather", None), ("grouped_allgather", None), ("broadcast", None),
              ("alltoall", None), ("reducescatter", "Sum"), ("reducescatter", "Average"),
              ("grouped_reducescatter", "Average")]


def grad_shape(case, rank, n):
    kind = case[0]
    if "allgather" in kind:
        return (allgather_rows(rank), 2)
    if kind == "alltoall":
        return (sum(alltoall_splits("grad", rank, n)), 2)
    if "reducescatter" in kind:
        return (2 * n + 1, 2)
    return (3, 2)


def _sec_gradients(hvd, tf, n, mode):
    r = hvd.rank()

    def grads():
        out = {}
        for case in GRAD_CASES:
            x = tf.constant(values(("gx", case, r), "float64", grad_shape(case, r, n)))
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = call_case(hvd, case, x, n, alltoall_splits("grad", hvd.rank(), n))
                w = tf.cast(tf.reshape(tf.range(tf.size(y)), tf.shape(y)), tf.float64)
                loss = tf.reduce_sum(y * (w + 1.0) * float(r + 1))
            out[case] = (tape.gradient(loss, x), y)
        return out
    res = grads() if mode == "eager" else _traced(tf, grads)
    return {k: (np.array(g.numpy()), tuple(y.shape)) for k, (g, y) in res.items()}


def _sec_process_set(hvd, tf, n):
    """Ranks 0 and n-1 (one rank when N = 1), eagerly and traced; the others wait."""
    ps = hvd.add_process_set(sorted({0, n - 1}))
    r, out = hvd.rank(), {}
    if ps.included():
        def ops():
            x = tf.constant(values(("ps", r), "float32", (2 * ps.size(), 2)))
            return {"ar": hvd.allreduce(x, op=hvd.Sum, process_set=ps),
                    "ag": hvd.allgather(x, process_set=ps),
                    "bc": hvd.broadcast(x, root_rank=n - 1, process_set=ps),
                    "rs": hvd.reducescatter(x, op=hvd.Sum, process_set=ps)}
        out = {"eager": {k: v.numpy() for k, v in ops().items()},
               "graph": {k: v.numpy() for k, v in _traced(tf, ops).items()}}
    hvd.remove_process_set(ps)
    return out


def _sec_mismatch(hvd, tf, n):
    """Different shapes on each rank: every rank raises, eagerly and in a graph."""
    out = {}
    x = tf.ones([2 + hvd.rank()])
    try:
        hvd.allreduce(x, name="mismatched")
        out["eager"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        out["eager"] = ([c.__name__ for c in type(e).__mro__],
                        isinstance(e, tf.errors.FailedPreconditionError), str(e))
    try:
        tf.function(lambda: hvd.allgather(tf.ones([1, 1 + hvd.rank()])))()
        out["graph"] = None
    except Exception as e:  # noqa: BLE001
        out["graph"] = ([c.__name__ for c in type(e).__mro__], str(e))
    # a bad argument on rank 0 only: it raises TypeError, the others are told
    bad = tf.ones([2], dtype=tf.complex64) if hvd.rank() == 0 else tf.ones([2])
    try:
        hvd.allreduce(bad)
        out["bad"] = None
    except Exception as e:  # noqa: BLE001
        out["bad"] = ([c.__name__ for c in type(e).__mro__], str(e))
    # the automatic names are still in step
    out["after"] = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum).numpy()
    return out


def _sec_xla(hvd, tf, n):
    started = time.monotonic()
    try:
        tf.function(lambda x: hvd.allreduce(x), jit_compile=True)(tf.ones([2]))
        return None
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - started


def _sec_alltoall_arguments(hvd, tf, n):
    """Alltoalls this rank cannot submit (rows that do not divide without splits, splits
    that do not sum to the first dimension): each raises tf.errors.InvalidArgumentError on
    every rank from its own check, before anything is submitted."""
    caught = {}
    calls = {"uneven": lambda: hvd.alltoall(tf.ones([n + 1])),
             "sum": lambda: hvd.alltoall(tf.ones([n - 1]), tf.ones([n], tf.int32))}
    for key, call in calls.items():
        try:
            call()
            caught[key] = None
        except tf.errors.InvalidArgumentError as e:
            caught[key] = type(e).__name__
        except Exception as e:  # noqa: BLE001 - the wrong type is the result
            caught[key] = f"not tf.errors.InvalidArgumentError: {type(e).__mro__}"
    hvd.barrier()
    return caught


def _sec_misc(hvd, tf, n):
    return {"join": int(hvd.join().numpy()), "rank_op": int(hvd.rank_op().numpy()),
            "size_op": int(tf.function(lambda: hvd.size_op())().numpy()),
            "barrier": hvd.barrier(),
            "object": hvd.broadcast_object({"from": hvd.rank()}, root_rank=n - 1),
            "objects": hvd.allgather_object(hvd.rank())}


# Horovod's signatures, by hand from horovod/tensorflow/__init__.py, mpi_ops.py and
# functions.py at commit 2626dc87 (hora may add parameters after Horovod's)
_CMP = "compression=Compression.none"
_SET = "process_set=global_process_set"
HOROVOD = {
    "allreduce": f"tensor, average=None, device_dense='', device_sparse='', {_CMP}, op=None, "
                 f"prescale_factor=1.0, postscale_factor=1.0, name=None, {_SET}, "
                 f"ignore_name_scope=False",
    "grouped_allreduce": f"tensors, average=None, device_dense='', device_sparse='', {_CMP}, "
                         f"op=None, prescale_factor=1.0, postscale_factor=1.0, {_SET}, "
                         f"ignore_name_scope=False, name=None",
    "allgather": f"tensor, name=None, ignore_name_scope=False, {_SET}",
    "grouped_allgather": f"tensors, name=None, ignore_name_scope=False, {_SET}",
    "broadcast": f"tensor, root_rank, name=None, ignore_name_scope=False, {_SET}",
    "broadcast_": f"variables, root_rank, name=None, {_SET}",
    "alltoall": f"tensor, splits=None, name=None, ignore_name_scope=False, {_SET}",
    "reducescatter": f"tensor, device_dense='', {_CMP}, op=Average, name=None, {_SET}, "
                     f"ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter": f"tensors, device_dense='', {_CMP}, op=Average, {_SET}, "
                             f"prescale_factor=1.0, postscale_factor=1.0",
    "join": "", "size_op": "process_set_id=0, name=None", "local_size_op": "name=None",
    "process_set_included_op": "process_set_id=0, name=None",
    "rank_op": "name=None", "local_rank_op": "name=None",
    "broadcast_object": f"obj, root_rank=0, session=None, name=None, {_SET}",
    "allgather_object": f"obj, session=None, name=None, {_SET}",
    "PartialDistributedGradientTape": f"gradtape, device_dense='', device_sparse='', {_CMP}, "
                                      f"sparse_as_dense=False, op=Average, "
                                      f"gradient_predivide_factor=1.0, num_groups=0, "
                                      f"groups=None, {_SET}, local_layers=None, "
                                      f"scale_local_gradients=True",
}


def _signatures(hvd):
    """name -> [(parameter, its default as Horovod's source spells it, or None)]."""
    import inspect
    known = {id(hvd.Compression.none): "Compression.none",
             id(hvd.global_process_set): "global_process_set"}
    out = {}
    for name in HOROVOD:
        params = []
        for p in inspect.signature(getattr(hvd, name)).parameters.values():
            d = p.default
            if d is inspect.Parameter.empty:
                d = None
            elif id(d) in known:
                d = known[id(d)]
            elif p.name == "op" and d == hvd.Average:
                d = "Average"
            else:
                d = repr(d)
            params.append((p.name, d))
        out[name] = params
    return out


def sections(hvd, tf, n):
    """The job's sections on N ranks, in the order they run: name -> a call."""
    return {
        "info": lambda: (hvd.rank(), hvd.size()),
        "signatures": lambda: _signatures(hvd),
        **{f"ops_{m}": (lambda m=m: _sec_ops(hvd, tf, n, m)) for m in MODES},
        **{f"grad_{m}": (lambda m=m: _sec_gradients(hvd, tf, n, m)) for m in MODES},
        "misc": lambda: _sec_misc(hvd, tf, n),
        "xla": lambda: _sec_xla(hvd, tf, n),
        "alltoall_arguments": lambda: _sec_alltoall_arguments(hvd, tf, n),
        "mismatch": lambda: _sec_mismatch(hvd, tf, n),
        # a set's unnamed collectives are counted per set, so later global ones still
        # match (test_tf_variables.py and test_process_set_names.py check that)
        "process_set": lambda: _sec_process_set(hvd, tf, n),
    }
