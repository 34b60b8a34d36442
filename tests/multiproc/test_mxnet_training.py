"""``hora.mxnet``'s training hooks on real processes: N ranks training on shards of a batch end
with the weights one process reaches on the whole batch, and the digits example trains.

Each job (N = 3: the shards' rows interleave unevenly enough, and the bindings have no branch
on N past 1; MXNet's venv, tests/mxnet_env.py) trains a small MLP with SGD (momentum,
weight decay) for a few steps: rank r takes rows ``r::N`` of every global batch, and every
rank also trains the single-process reference on the whole batch with plain Gluon.  The
paths: ``DistributedTrainer`` (plain; with ``num_groups``, ``gradient_predivide_factor`` and
a prefix; with fp16 compression), ``DistributedOptimizer`` in a ``gluon.Trainer`` and in a
``Module``.  ``broadcast_parameters`` on a net whose parameters are initialised on the first
forward pass must leave every rank with rank 0's values.
"""
import re
import subprocess
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests import mxnet_env
from tests.helpers import job_fixture, run_ranks, section
from tests.mxnet_env import mxnet_python  # noqa: F401 - a fixture

SIZES = [3]
STEPS = 4
ROWS = 8                        # per rank per step
ROOT = Path(__file__).resolve().parents[2]


def _data(step, n):
    rng = np.random.default_rng([7, step, n])
    return (rng.normal(size=(ROWS * n, 5)).astype(np.float32),
            rng.integers(0, 3, ROWS * n).astype(np.float32))


def _init_values():
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(8, 5)) * 0.5, "b1": rng.normal(size=8) * 0.1,
            "w2": rng.normal(size=(3, 8)) * 0.5, "b2": rng.normal(size=3) * 0.1}


def _gluon_net(mx, prefix):
    """Dense(8, tanh) -> Dense(3), set to _init_values()."""
    from mxnet.gluon import nn
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(8, activation="tanh", in_units=5), nn.Dense(3, in_units=8))
    net.initialize(ctx=mx.cpu())
    v = _init_values()
    for layer, (w, b) in zip(net, [("w1", "b1"), ("w2", "b2")]):
        layer.weight.set_data(mx.nd.array(v[w]))
        layer.bias.set_data(mx.nd.array(v[b]))
    return net


def _weights(net):
    return {k: v.data().asnumpy().tolist() for k, v in sorted(net.collect_params().items())}


def _train_gluon(mx, net, trainer, xs, ys, batch):
    from mxnet import autograd, gluon
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for x, y in zip(xs, ys):
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        trainer.step(batch)


_OPT = {"learning_rate": 0.5, "momentum": 0.9, "wd": 1e-3}


def _reference(mx, n):
    from mxnet import gluon
    net = _gluon_net(mx, "ref_")
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(_OPT), kvstore=None)
    data = [_data(i, n) for i in range(STEPS)]
    _train_gluon(mx, net, trainer, [d[0] for d in data], [d[1] for d in data], ROWS * n)
    return [v for _, v in sorted(_weights(net).items())]


def _sec_trainer(hvd, mx, n, variant):
    r = hvd.rank()
    net = _gluon_net(mx, f"{variant}_")
    kwargs = {"plain": {}, "groups": {"num_groups": 2, "gradient_predivide_factor": 2.0,
                                      "prefix": "grouped."},
              "fp16": {"compression": hvd.Compression.fp16, "prefix": "fp16."}}[variant]
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(_OPT), **kwargs)
    data = [_data(i, n) for i in range(STEPS)]
    _train_gluon(mx, net, trainer, [d[0][r::n] for d in data], [d[1][r::n] for d in data], ROWS)
    return [v for _, v in sorted(_weights(net).items())]


def _sec_optimizer_in_trainer(hvd, mx, n):
    """``gluon.Trainer(params, DistributedOptimizer(sgd), kvstore=None)``; and a
    DistributedTrainer given a DistributedOptimizer unwraps it, with a warning."""
    from mxnet import gluon
    r = hvd.rank()
    net = _gluon_net(mx, "opt_")
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(**_OPT))
    trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    data = [_data(i, n) for i in range(STEPS)]
    _train_gluon(mx, net, trainer, [d[0][r::n] for d in data], [d[1][r::n] for d in data], ROWS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unwrapped = hvd.DistributedTrainer(_gluon_net(mx, "unwrap_").collect_params(),
                                           hvd.DistributedOptimizer(mx.optimizer.SGD()))
    return ([v for _, v in sorted(_weights(net).items())],
            type(unwrapped._optimizer).__name__, [str(w.message) for w in caught])


def _module(mx, optimizer, batch):
    """The same MLP as a Module (SoftmaxOutput: per-row gradients, summed), set to
    _init_values()."""
    data = mx.sym.Variable("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name="fc1"), "tanh")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=3, name="fc2"),
                               name="softmax")
    mod = mx.mod.Module(out, data_names=["data"], label_names=["softmax_label"])
    mod.bind(data_shapes=[("data", (batch, 5))], label_shapes=[("softmax_label", (batch,))])
    v = _init_values()
    names = {"fc1_weight": "w1", "fc1_bias": "b1", "fc2_weight": "w2", "fc2_bias": "b2"}
    mod.init_params(arg_params={k: mx.nd.array(v[key]) for k, key in names.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # "rescale_grad is not normalized to 1/batch"
        mod.init_optimizer(kvstore=None, optimizer=optimizer)
    return mod


def _train_module(mx, mod, xs, ys):
    for x, y in zip(xs, ys):
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]))
        mod.update()
    args, _ = mod.get_params()
    return [args[k].asnumpy().tolist() for k in ("fc1_bias", "fc1_weight", "fc2_bias",
                                                  "fc2_weight")]


def _sec_module(hvd, mx, n):
    """DistributedOptimizer in the Module API; rescale_grad is the per-rank 1/batch."""
    r = hvd.rank()
    data = [_data(i, n) for i in range(STEPS)]
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=1.0 / ROWS, **_OPT))
    mine = _train_module(mx, _module(mx, opt, ROWS), [d[0][r::n] for d in data],
                         [d[1][r::n] for d in data])
    ref = _train_module(mx, _module(mx, mx.optimizer.SGD(rescale_grad=1.0 / (ROWS * n), **_OPT),
                                    ROWS * n), [d[0] for d in data], [d[1] for d in data])
    return mine, ref


def _sec_deferred(hvd, mx, n):
    """Rank-dependent initial values; one layer's shape known at once, one deferred."""
    from mxnet.gluon import nn
    mx.random.seed(100 + hvd.rank())
    net = nn.HybridSequential(prefix="deferred_")
    with net.name_scope():
        net.add(nn.Dense(4, in_units=3), nn.Dense(2))          # the second is deferred
    net.initialize(mx.init.Uniform(1.0), ctx=mx.cpu())
    net.hybridize()
    before = net[0].weight.data().asnumpy().tolist()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="deferred.")
    net(mx.nd.ones((1, 3)))                                  # initialises (and broadcasts)
    values = {"a": mx.nd.array([hvd.rank(), 1.0])}
    hvd.broadcast_parameters(values, root_rank=n - 1, prefix="dict.")
    return before, _weights(net), values["a"].asnumpy().tolist()


def _worker(n):
    import mxnet as mx

    import hora.mxnet as hvd
    sections = {"reference": lambda: _reference(mx, n),
                "plain": lambda: _sec_trainer(hvd, mx, n, "plain"),
                "groups": lambda: _sec_trainer(hvd, mx, n, "groups"),
                "fp16": lambda: _sec_trainer(hvd, mx, n, "fp16"),
                "optimizer": lambda: _sec_optimizer_in_trainer(hvd, mx, n),
                "module": lambda: _sec_module(hvd, mx, n),
                "deferred": lambda: _sec_deferred(hvd, mx, n)}
    out = {}
    for name, run in sections.items():
        try:
            out[name] = ("ok", run())
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


job = job_fixture(_worker, env_for=lambda n: mxnet_env.worker_env(), timeout_s=60, sizes=SIZES,
                  runner=lambda *a, **kw: run_ranks(*a, python=mxnet_env.python(), **kw))
pytestmark = pytest.mark.timeout(90)


@pytest.mark.timeout(mxnet_env.PIP_TIMEOUT_S + 180)
def test_mxnet_venv_is_made_or_skips_with_the_reason():
    """First: makes the cached venv (once per machine), so later tests time only their jobs."""
    assert mxnet_env.python()


def _close(got, expected, tol, what):
    for k, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=tol, atol=tol,
                                   err_msg=f"{what}, array {k}")


@pytest.mark.parametrize("variant, tol", [("plain", 2e-5), ("groups", 2e-5), ("fp16", 1e-2)])
@pytest.mark.parametrize("n", SIZES)
def test_distributed_trainer_on_shards_equals_one_process_on_the_batch(job, n, variant, tol):
    results = job(n)
    reference = section(results, "reference")[0]
    start = _init_values()
    moved = max(float(np.abs(np.asarray(a) - start[k]).max())
                for a, k in zip(reference, ["b1", "w1", "b2", "w2"]))
    assert moved > 1e-2, f"the reference barely moved ({moved})"
    for r, weights in enumerate(section(results, variant)):
        _close(weights, reference, tol, f"n={n} {variant} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_distributed_optimizer_in_a_trainer_and_a_module(job, n):
    results = job(n)
    reference = section(results, "reference")[0]
    for r, (weights, inner, caught) in enumerate(section(results, "optimizer")):
        _close(weights, reference, 2e-5, f"n={n} gluon.Trainer rank {r}")
        assert inner == "SGD", inner
        assert any("DistributedOptimizer" in m for m in caught), caught
    for r, (mine, ref) in enumerate(section(results, "module")):
        _close(mine, ref, 2e-5, f"n={n} Module rank {r}")
        assert np.abs(np.asarray(ref[3]) - _init_values()["w2"]).max() > 1e-2


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_parameters_with_deferred_init(job, n):
    results = section(job(n), "deferred")
    root_before, root_after, _ = results[0]
    np.testing.assert_array_equal(root_after["deferred_dense0_weight"], root_before)
    assert any(np.abs(np.asarray(b) - np.asarray(root_before)).max() > 1e-3
               for b, _, _ in results[1:]), "the ranks started alike: nothing was tested"
    for r, (_, after, values) in enumerate(results):
        assert sorted(after) == sorted(root_after)
        for k in after:
            np.testing.assert_array_equal(after[k], root_after[k], err_msg=f"rank {r} {k}")
        assert values == [n - 1, 1.0], f"rank {r}: {values}"


@pytest.mark.timeout(150)
def test_digits_example_trains_on_two_ranks(tmp_path, mxnet_python):  # noqa: F811
    python = mxnet_python
    ckpt = tmp_path / "ckpt" / "digits.params"
    run = subprocess.run([python, "-m", "hora", "run", "-np", "2", "--timeout", "120", python,
                          str(ROOT / "examples" / "mxnet_digits.py"), "--epochs", "4",
                          "--checkpoint", str(ckpt)],
                         capture_output=True, text=True, timeout=140, cwd=tmp_path,
                         env=mxnet_env.full_env())
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.search(r"^\[0\]<stdout>:final test accuracy ([\d.]+), saved", run.stdout, re.M)
    assert found, run.stdout
    assert float(found.group(1)) > 0.9, run.stdout
    assert "[1]<stdout>:" not in run.stdout, run.stdout          # rank 1 prints nothing
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["digits.params",
                                                             "digits.params.states"]
