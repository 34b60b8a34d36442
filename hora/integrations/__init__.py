"""Running hora inside the systems people already run jobs on.

    k8s         ``hora k8s mpijob`` / ``katib`` / ``discover-hosts``: Kubeflow manifests
    sagemaker   SageMaker training containers: the job's hosts, per-host launch, rank-0 model dir
    ray         ``RayExecutor``: a hora job on Ray actors (``hora.ray``); ``ray_tune``: Tune
    spark       ``run``: a hora job as a Spark barrier stage (``hora.spark``)

Top layer: uses the runner's Python API and the core; nothing below imports it.  Heavy or
optional dependencies (PyYAML, ray, pyspark) are imported lazily.
"""

__all__ = ["commands"]


def commands():
    """The ``add(subparsers)`` callables that register the integrations' subcommands."""
    from . import k8s, katib, sagemaker

    def add_k8s(subparsers):
        k8s.add_command(subparsers, more_kinds=(katib.add_katib,))
    return (add_k8s, sagemaker.add_command)
