"""``from hora.ray import RayExecutor``: Horovod's import path for :mod:`hora.integrations.ray`
and (``ElasticRayExecutor``, ``RayHostDiscovery``) :mod:`hora.integrations.ray_elastic`.

Ray Tune: :mod:`hora.ray.tune` (``DistributedTrainableCreator``).
"""
from ..integrations.ray import BaseHoraWorker, BaseHorovodWorker, RayExecutor, RaySettings, report
from ..integrations.ray_elastic import ElasticRayExecutor, ElasticRaySettings, RayHostDiscovery

__all__ = ["RayExecutor", "RaySettings", "BaseHoraWorker", "BaseHorovodWorker", "report",
           "ElasticRayExecutor", "ElasticRaySettings", "RayHostDiscovery"]
