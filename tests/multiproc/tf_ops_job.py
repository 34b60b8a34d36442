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


def assert_refused_on_rank0(bad, r, what):
    """Rank ``r``'s ``(exception's classes, message)`` after a call that only rank 0 made
    with a bad argument (``what``, a complex dtype): rank 0 raised TypeError naming it; the
    others' call was aborted, naming rank 0 and it."""
    mro, message = bad
    if r == 0:
        assert mro[0] == "TypeError" and what in message, (mro, message)
    else:
        assert "CollectiveAbortedError" in mro and "FailedPreconditionError" in mro, mro
        assert "rank 0" in message and what in message, message


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
        # match (test_tf_training.py and test_process_set_names.py check that)
        "process_set": lambda: _sec_process_set(hvd, tf, n),
    }


# -- where Horovod's own TensorFlow tests found hora differing (issue 60) ----------------------
# At N = 3 only, after the sections above (whose process set is gone by then): uint16 through
# every collective, tf.errors types from inside a graph, process-set ops and errors (ranks
# {0, 2} and {1}), the tf.compat.v1 DistributedOptimizer with backward_passes_per_step, a Keras
# optimizer handed to hora.tensorflow.DistributedOptimizer.  (test_tf_ops.py's "compat" tests)
COMPAT_N = 3
EVEN, ODD = [0, 2], [1]


def compat_values(key, dtype, shape):
    """Small non-negative integers (exact in every dtype, and in sums of 3 of them)."""
    rng = np.random.default_rng([20261204, zlib.crc32(repr(key).encode())])
    return rng.integers(0, 9, size=shape).astype(dtype)


def _compat_dtypes(hvd, tf):
    """uint16 through every collective, eagerly and in one tf.function, and hora's NumPy API."""
    import hora
    r, n = hvd.rank(), COMPAT_N

    def ops():
        x = tf.constant(compat_values(("x", r), "uint16", (n, 2)))
        return {"ar": hvd.allreduce(x, op=hvd.Sum),
                "gar": hvd.grouped_allreduce([x, x], op=hvd.Max)[1],
                "ag": hvd.allgather(x), "gag": hvd.grouped_allgather([x])[0],
                "bc": hvd.broadcast(x, root_rank=2), "a2a": hvd.alltoall(x),
                "rs": hvd.reducescatter(x, op=hvd.Sum),
                "grs": hvd.grouped_reducescatter([x], op=hvd.Sum)[0]}
    out = {"eager": {k: v.numpy() for k, v in ops().items()}}
    keys = sorted(out["eager"])
    f = tf.function(lambda: [ops()[k] for k in keys])
    out["graph"] = {k: v.numpy() for k, v in zip(keys, f())}
    a = compat_values(("x", r), "uint16", (n, 2))
    out["numpy"] = {"ar": hora.allreduce(a, op=hora.Sum), "ag": hora.allgather(a),
                    "bc": hora.broadcast(a, root_rank=2)}
    return out


def _caught(fn):
    """What ``fn()`` raised: (class names of its type, message), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests check the type
        return [c.__name__ for c in type(e).__mro__], str(e)
    return None


def _compat_graph_errors(hvd, tf):
    """Mismatched shape, dtype and root inside tf.function and a tf.compat.v1 session."""
    r = hvd.rank()
    out = {
        "shape": _caught(tf.function(lambda: hvd.allreduce(tf.ones([2 + r]), name="sh"))),
        "dtype": _caught(tf.function(lambda: hvd.allgather(
            tf.ones([2], tf.float32 if r else tf.float64), name="dt"))),
        "root": _caught(tf.function(lambda: hvd.broadcast(tf.ones([2]), root_rank=r,
                                                          name="rt"))),
    }
    with tf.Graph().as_default():
        y = hvd.allreduce(tf.ones([1 + r]), name="v1")
        with tf.compat.v1.Session() as session:
            out["session"] = _caught(lambda: session.run(y))
    # the job goes on: the names are still in step
    out["after"] = float(tf.function(lambda: hvd.allreduce(tf.ones([1]), op=hvd.Sum))()[0])
    return out


def _compat_process_sets(hvd, tf, even, odd):
    r = hvd.rank()
    mine, other = (even, odd) if r in EVEN else (odd, even)
    ops = tf.function(lambda: [hvd.size_op(process_set_id=even.process_set_id),
                               hvd.process_set_included_op(process_set_id=even.process_set_id),
                               hvd.rank_op(process_set_id=even.process_set_id),
                               hvd.size_op(process_set_id=99), hvd.size_op()])
    out = {"topology": [int(t) for t in ops()],
           "eager_included": int(hvd.process_set_included_op(odd.process_set_id))}
    x = tf.ones([4])
    out["foreign_eager"] = _caught(lambda: hvd.allreduce(x, process_set=other))
    # traced on a non-member, it raises when it runs, not when it is traced
    traced = tf.function(lambda: hvd.allgather(x, process_set=other))
    concrete = _caught(lambda: traced.get_concrete_function())
    out["foreign_graph"] = (concrete, _caught(traced))
    fake = hvd.ProcessSet([0, 1, 2])
    fake.process_set_id = 10        # never registered: the job registers fewer sets than that
    out["unknown"] = _caught(lambda: hvd.allreduce(x, process_set=fake))
    # the reducescatter gradient on a set, float16 (Horovod's test_..._grad_cpu_process_sets)
    grads = {}
    for op in ("Sum", "Average"):
        v = tf.Variable(tf.cast(compat_values(("rsg", r), "float32", (mine.size() * 4, 2)),
                                tf.float16))
        with tf.GradientTape() as tape:
            y = hvd.reducescatter(v, op=getattr(hvd, op), process_set=mine)
        dy = tf.cast(tf.constant(compat_values(("dy", op, r), "float32", (4, 2))), tf.float16)
        g = tape.gradient(tf.cast(y, v.dtype), v, dy)
        grads[op] = (g.dtype.name, g.numpy().astype(np.float64))
    out["rs_grad"] = grads
    return out


def _v1_optimizer_job(hvd, tf, steps, average, process_set, sparse=False):
    """Horovod's legacy-optimizer check: a variable that adds its gradient (this rank's
    number, squared) each applied step; returns its value and the global step after every run."""
    values, global_steps = [], []
    with tf.Graph().as_default():
        class AddGradient(tf.compat.v1.train.Optimizer):
            def __init__(self):
                super().__init__(use_locking=False, name="add")
                self.variable = tf.compat.v1.Variable([0.0])

            def compute_gradients(self, *args, **kwargs):
                g = tf.constant([float(hvd.rank() ** 2)])
                if sparse:
                    g = tf.IndexedSlices(g, tf.constant([0]), tf.constant([1]))
                return [(g, self.variable)]

            def _resource_apply_dense(self, grad, var):
                return var.assign_add(grad)

        opt = hvd.DistributedOptimizer(AddGradient(), backward_passes_per_step=steps,
                                       average_aggregated_gradients=average,
                                       process_set=process_set, sparse_as_dense=sparse)
        global_step = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False)
        update = opt.apply_gradients(opt.compute_gradients(), global_step=global_step)
        with tf.compat.v1.Session() as session:
            session.run([tf.compat.v1.global_variables_initializer(),
                         tf.compat.v1.local_variables_initializer()])
            for _ in range(6):
                session.run(update)
                values.append(float(session.run(opt._optimizer.variable)[0]))
                global_steps.append(int(session.run(global_step)))
    return values, global_steps


def _compat_optimizers(hvd, tf, even):
    import keras

    import hora.keras
    out = {"bpps3_avg": _v1_optimizer_job(hvd, tf, 3, True, hvd.global_process_set),
           "bpps2_sum_sparse": _v1_optimizer_job(hvd, tf, 2, False, hvd.global_process_set,
                                                 sparse=True),
           "even_set": _v1_optimizer_job(hvd, tf, 1, True, even),
           "eager_bpps": _caught(lambda: hvd.DistributedOptimizer(
               tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2))}
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    out["keras"] = isinstance(wrapped, hora.keras.DistributedOptimizer)
    out["util"] = (hvd._executing_eagerly(), hvd.util._executing_eagerly())
    return out


def compat_sections(hvd, tf):
    """The issue-60 sections (N = 3), in the order they run: name -> a call.  The sets
    {0, 2} and {1} are registered first, as Horovod's tests do."""
    sets = {}

    def register():
        sets["even"], sets["odd"] = hvd.add_process_set(EVEN), hvd.add_process_set(ODD)
    return {
        "compat_sets": register,
        "compat_dtypes": lambda: _compat_dtypes(hvd, tf),
        "compat_graph_errors": lambda: _compat_graph_errors(hvd, tf),
        "compat_process_sets": lambda: _compat_process_sets(hvd, tf, sets["even"], sets["odd"]),
        # after compat_process_sets, which built different numbers of graphs on different
        # ranks: a collective in a tf.cond branch of a tf.compat.v1 graph (the aggregation's)
        # was named after the branch's graph, whose name counts them, and the ranks hung
        "compat_optimizers": lambda: _compat_optimizers(hvd, tf, sets["even"]),
    }
