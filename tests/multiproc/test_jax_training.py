"""``hora.jax.DistributedOptimizer`` on real processes: N ranks training on shards of a batch
end with the parameters one process reaches on the whole batch.

Each job (N in 1 and 2) trains a small MLP with ``optax.sgd`` (momentum) inside ``jax.jit``:
rank r takes rows ``r::N`` of every global batch; its update averages the gradients over the
ranks, which is the whole batch's gradient (equal shards, mean losses).  Every rank also
runs the single-process reference locally (plain optax, no collective) and returns both.
With ``backward_passes_per_step=2`` each step is two micro-batches per rank, averaged
(``average_aggregated_gradients``).  A gradient whose shape differs by rank must raise
on every rank, eagerly and in jit, well before the job's deadline.

N=1 takes the optimizer's one-rank path (nothing to reduce) and N=2 the reducing one.  There
is no N=3: the update is the same code for every N above one (each rank's gradient averaged
over the set, the shards rows ``r::N``), and averaging over an odd number of ranks, with its
uneven blocks, is checked by test_jax_ops.py's job of 3 ranks.

The job of 2 ranks ends with examples/jax_digits.py, run as a script (``__main__``) on each
of its ranks rather than in a job of its own: it must learn, and only rank 0 may print.
``hora run`` starting a script is every other example test's.
"""
import contextlib
import importlib.util
import io
import os
import runpy
import sys
import time
import traceback

import numpy as np
import pytest

from tests.helpers import job_fixture, section

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
    pytest.skip("JAX or optax is not installed (pip install 'hora[jax]')",
                allow_module_level=True)

SIZES = [1, 2]
STEPS = 4
ROWS = 12                       # per rank per micro-batch


# The data and the first parameters come from NumPy: in JAX each eager random call of a new
# shape is compiled first, which costs a rank more CPU than the training it feeds.
def _data(rows, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, 5), dtype=np.float32),
            rng.integers(0, 3, rows, dtype=np.int32))


def _model(jax, jnp):
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((5, 8), dtype=np.float32) * 0.5),
              "b1": jnp.zeros(8),
              "w2": jnp.asarray(rng.standard_normal((8, 3), dtype=np.float32) * 0.5),
              "b2": jnp.zeros(3)}

    def loss(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    return params, loss


def _train(hvd, jax, jnp, optax, n, passes):
    """(params after STEPS steps on shards with hora, the same on the whole batch alone)."""
    params, loss = _model(jax, jnp)
    r = hvd.rank()
    tx = hvd.DistributedOptimizer(optax.sgd(0.1, momentum=0.9), backward_passes_per_step=passes,
                                  average_aggregated_gradients=True, name=f"opt{passes}")
    ref_tx = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def step(p, s, x, y):
        updates, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    @jax.jit                    # one compilation, not one per eager operation
    def ref_step(p, s, x, y):
        updates, s = ref_tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    p, s = hvd.broadcast_parameters(params, root_rank=0), tx.init(params)
    ref_p, ref_s = params, ref_tx.init(params)
    for i in range(STEPS):
        xs, ys = [], []
        for j in range(passes):
            x, y = _data(ROWS * n, seed=100 * i + j)
            p, s = step(p, s, x[r::n], y[r::n])
            xs.append(x)
            ys.append(y)
        ref_p, ref_s = ref_step(ref_p, ref_s, np.concatenate(xs), np.concatenate(ys))
    return ({k: np.asarray(v) for k, v in p.items()},
            {k: np.asarray(v) for k, v in ref_p.items()}, int(s.count),
            max(float(np.abs(np.asarray(p[k]) - np.asarray(params[k])).max()) for k in p))


def _mismatch(hvd, jax, jnp, optax):
    """Gradients of shape (2 + rank,): every rank must raise, eagerly and in jit."""
    out = {}
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), name="mismatched")
    p = {"w": jnp.ones(2 + hvd.rank())}
    s = tx.init(p)
    for mode in ("eager", "jit"):
        start = time.monotonic()
        try:
            update = tx.update if mode == "eager" else jax.jit(tx.update)
            np.asarray(update(p, s, p)[0]["w"])
            out[mode] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            out[mode] = ([c.__name__ for c in type(e).__mro__], str(e),
                         time.monotonic() - start)
    return out


def _worker(n):
    import jax
    import jax.numpy as jnp
    import optax

    import hora.jax as hvd
    sections = {"plain": lambda: _train(hvd, jax, jnp, optax, n, 1),
                "passes": lambda: _train(hvd, jax, jnp, optax, n, 2)}
    if n > 1:
        sections["mismatch"] = lambda: _mismatch(hvd, jax, jnp, optax)
    if n == 2 and importlib.util.find_spec("sklearn") is not None:
        sections["digits"] = _digits_example          # last: the example shuts hora down
    out = {}
    for name, run in sections.items():
        try:
            out[name] = ("ok", run())
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jax_digits.py")
EXAMPLE_EPOCHS = "5"


def _digits_example():
    """examples/jax_digits.py run as a script on this rank of the job: what it printed.  Its
    hvd.init() finds the job's hora running, and its hvd.shutdown() ends it."""
    printed, argv = io.StringIO(), sys.argv
    sys.argv = [EXAMPLE, "--epochs", EXAMPLE_EPOCHS]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(os.path.abspath(EXAMPLE), run_name="__main__")
    finally:
        sys.argv = argv
    return printed.getvalue()


_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
# the sum of the bounds of the two jobs the one of 2 ranks was (90 s, and 140 s for the
# example's run of its own)
job = job_fixture(_worker, env_for=lambda n: _ENV, timeout_s=90 + 140)
pytestmark = pytest.mark.timeout(120 + 150)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_n_ranks_on_shards_equal_one_process_on_the_batch(job, n, passes):
    for r, (params, reference, count, moved) in enumerate(
            section(job(n), "plain" if passes == 1 else "passes")):
        assert count == 0, f"rank {r}: {count} passes pending after whole steps"
        for k in reference:
            np.testing.assert_allclose(params[k], reference[k], rtol=2e-5, atol=2e-6,
                                       err_msg=f"n={n} passes={passes} rank {r} {k}")
        assert moved > 1e-3, f"rank {r}: the parameters barely moved ({moved})"


@pytest.mark.parametrize("n", [2])
def test_shape_mismatch_raises_on_every_rank(job, n):
    for r, res in enumerate(section(job(n), "mismatch")):
        mro, message, seconds = res["eager"]
        assert "CollectiveMismatchError" in mro, (r, mro, message)
        assert "mismatched.grads.0" in message and "shape" in message, message
        mro, message, seconds = res["jit"]
        assert "CollectiveMismatchError" in message, (r, mro, message)
        assert seconds < 30, f"rank {r} took {seconds:.1f} s to fail"


def test_jax_digits_example_learns_on_two_ranks(job):
    """The example on the job of 2 ranks, a few epochs: it learns, and only rank 0 reports."""
    pytest.importorskip("sklearn")
    printed = section(job(2), "digits")
    assert printed[1] == "", f"rank 1 printed: {printed[1][-2000:]}"
    final = [line for line in printed[0].splitlines() if "final test accuracy" in line]
    assert len(final) == 1, printed[0][-2000:]
    assert float(final[0].split("accuracy ")[1].split()[0]) > 0.9, final[0]
