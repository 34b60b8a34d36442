"""``from hora.ray import RayExecutor``: Horovod's import path for :mod:`hora.integrations.ray`.

Ray Tune: :mod:`hora.ray.tune` (``DistributedTrainableCreator``).
"""
from ..integrations.ray import BaseHoraWorker, BaseHorovodWorker, RayExecutor, RaySettings, report

__all__ = ["RayExecutor", "RaySettings", "BaseHoraWorker", "BaseHorovodWorker", "report"]
