"""``from hora.ray.tune import DistributedTrainableCreator``: Horovod-style import path for
:mod:`hora.integrations.ray_tune`."""
from ..integrations.ray_tune import DistributedTrainableCreator, report

__all__ = ["DistributedTrainableCreator", "report"]
