"""``hora.mxnet`` where Horovod-based MXNet code reaches past ``import horovod.mxnet as hvd``,
on real ranks: the job's basics imported from ``horovod.mxnet.mpi_ops`` (Gluon trainers
written against Horovod do ``from horovod.mxnet.mpi_ops import size, rank, allreduce_``) and
``horovod.mxnet.compression``'s ``Compression``, which ``DistributedTrainer`` takes.

MXNet lives in a venv of its own (tests/mxnet_env.py): the workers run its interpreter.
"""
import traceback

import numpy as np
import pytest

from tests import mxnet_env
from tests.helpers import job_fixture, run_ranks, section

NP = 2
BASICS = ("init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
          "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
          "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
          "cuda_built", "rocm_built", "start_timeline", "stop_timeline")


def _sec_mpi_ops_basics(hvd, mx):
    from hora.mxnet import mpi_ops
    from hora.mxnet.mpi_ops import allreduce_, local_rank, rank, size
    x = mx.nd.array([float(rank() + 1)] * 3)
    allreduce_(x, average=False, name="basics", prescale_factor=1.0 / size())
    return {"same_objects": [n for n in BASICS if getattr(mpi_ops, n) is not getattr(hvd, n)],
            "values": (size(), rank(), local_rank()), "reduced": x.asnumpy().tolist()}


def _sec_compression(hvd, mx):
    from hora.mxnet.compression import Compression, FP16Compressor
    x = mx.nd.array([1.5, -2.25, 3.0], dtype="float32")
    sent, ctx = Compression.fp16.compress(x)
    back = Compression.fp16.decompress(sent, ctx)
    return {"same_class": hvd.Compression is Compression and Compression.fp16 is FP16Compressor,
            "sent": sent.asnumpy().dtype.name,
            "back": (back.asnumpy().dtype.name, back.asnumpy().tolist())}


def _worker(n):
    import mxnet as mx

    import hora.mxnet as hvd
    out = {}
    for name, run in {"mpi_ops_basics": _sec_mpi_ops_basics,
                      "compression": _sec_compression}.items():
        try:
            out[name] = ("ok", run(hvd, mx))
        except Exception:                    # reported per section; the ranks keep in step
            out[name] = ("error", traceback.format_exc())
    return out


job = job_fixture(_worker, env_for=lambda n: mxnet_env.worker_env(), timeout_s=60, sizes=[NP],
                  runner=lambda *a, **kw: run_ranks(*a, python=mxnet_env.python(), **kw))


@pytest.mark.timeout(mxnet_env.PIP_TIMEOUT_S + 180)
def test_mxnet_venv_is_made_or_skips_with_the_reason():
    """First: makes the cached venv (once per machine), so later tests time only their jobs."""
    assert mxnet_env.python()


@pytest.mark.timeout(90)
def test_mpi_ops_carries_the_basics_as_horovods_does(job):
    expected = np.full(3, sum(r + 1 for r in range(NP)) / NP).tolist()
    for rank, res in enumerate(section(job(NP), "mpi_ops_basics")):
        assert res["same_objects"] == [], f"rank {rank}: {res}"
        assert res["values"] == (NP, rank, rank), f"rank {rank}: {res}"
        assert res["reduced"] == expected, f"rank {rank}: {res}"


@pytest.mark.timeout(90)
def test_compression_module_has_horovods_names(job):
    for rank, res in enumerate(section(job(NP), "compression")):
        assert res["same_class"], f"rank {rank}"
        assert res["sent"] == "float16"
        assert res["back"] == ("float32", [1.5, -2.25, 3.0]), f"rank {rank}: {res}"
