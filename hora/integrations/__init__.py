"""Running hora inside the systems people already run jobs on.

    k8s         ``hora k8s mpijob``: a Kubeflow MPI Operator MPIJob manifest for a hora script
    sagemaker   SageMaker training containers: the job's hosts, per-host launch, rank-0 model dir

Top layer: uses the runner's Python API and the core; nothing below imports it.  Heavy or
optional dependencies (PyYAML) are imported lazily.
"""

__all__ = ["commands"]


def commands():
    """The ``add(subparsers)`` callables that register the integrations' subcommands."""
    from . import k8s, sagemaker
    return (k8s.add_command, sagemaker.add_command)
