"""Ray Tune: every trial a hora job of several workers (Horovod's ``DistributedTrainableCreator``).

    from ray import tune
    from hora.ray.tune import DistributedTrainableCreator, report

    def train(config):                  # runs on every worker of a trial
        import hora.torch as hvd
        hvd.init()
        ...
        report({"accuracy": acc})       # rank 0's values reach Tune

    trainable = DistributedTrainableCreator(train, num_workers=2)
    tune.Tuner(trainable, param_space={"lr": tune.grid_search([0.01, 0.1])}).fit()

:func:`DistributedTrainableCreator` returns a function trainable wrapped in
``tune.with_resources``: the trial reserves an empty head bundle for itself (the trial's
driver only waits) and one bundle per worker (``PACK``), or per host with ``num_hosts``
(``STRICT_SPREAD``).  The trial then runs a :class:`~hora.integrations.ray.RayExecutor` in
that placement group, calls ``func(config)`` on every worker, and passes each value rank 0
gives to :func:`report` on to ``ray.tune.report``.  A failed worker fails the trial with a
:class:`~hora.errors.WorkerFailedError`, which Tune records as the trial's error.

Layer: integrations.  ``ray.tune`` is imported lazily.
"""
from .ray import RayExecutor, RaySettings, report

__all__ = ["DistributedTrainableCreator", "report"]


def DistributedTrainableCreator(func, num_workers=None, num_hosts=None,  # noqa: N802
                                num_workers_per_host=1, cpus_per_worker=1, use_gpu=False,
                                gpus_per_worker=None, timeout_s=30, grace_s=5.0):
    """A Ray Tune trainable whose trials each run ``func(config)`` on a hora job.

    Args:
        func: ``func(config)``, run on every worker; it calls ``hora.init()`` (or a framework's
            ``init()``) itself and reports metrics with :func:`report`.  What rank 0 returns,
            if a dict and nothing was reported, becomes the trial's one result.
        num_workers: workers per trial (default 1; exclusive with ``num_hosts``).
        num_hosts, num_workers_per_host: or that many nodes with that many workers each.
        cpus_per_worker, use_gpu, gpus_per_worker: each worker's resources.
        timeout_s: seconds for a trial's workers to start and meet at ``init()``.
        grace_s: seconds the other workers get to end after one fails.

    Returns:
        A trainable for ``tune.Tuner`` (its resources already attached).
    """
    from ray import tune
    if num_workers is None and num_hosts is None:
        num_workers = 1
    # checks the arguments now, not in the first trial
    RayExecutor(RaySettings(), num_workers=num_workers, num_hosts=num_hosts,
                num_workers_per_host=num_workers_per_host, cpus_per_worker=cpus_per_worker,
                use_gpu=use_gpu, gpus_per_worker=gpus_per_worker)
    settings = RayExecutor.create_settings(timeout_s=timeout_s, grace_s=grace_s)

    def trainable(config):
        executor = RayExecutor(settings, num_workers=num_workers, num_hosts=num_hosts,
                               num_workers_per_host=num_workers_per_host,
                               cpus_per_worker=cpus_per_worker, use_gpu=use_gpu,
                               gpus_per_worker=gpus_per_worker)
        reported = []

        def forward(metrics):
            reported.append(metrics)
            tune.report(dict(metrics))

        executor.start()
        try:
            results = executor.run(func, args=[config], callbacks=[forward])
        finally:
            executor.shutdown()
        if not reported and isinstance(results[0], dict):
            tune.report(dict(results[0]))

    trainable.__name__ = getattr(func, "__name__", "hora_trainable")
    per_unit = num_workers_per_host if num_hosts else 1
    bundle = {"CPU": cpus_per_worker * per_unit}
    if use_gpu:
        bundle["GPU"] = (gpus_per_worker or 1) * per_unit
    units = num_hosts or num_workers
    resources = tune.PlacementGroupFactory(
        [{}] + [dict(bundle) for _ in range(units)],
        strategy="STRICT_SPREAD" if num_hosts else "PACK")
    return tune.with_resources(trainable, resources)
