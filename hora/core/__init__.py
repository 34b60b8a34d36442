"""The core: init and topology, the background engine, negotiation, and the NumPy API."""
from .handles import Handle
from .messages import Adasum, Average, Max, Min, Product, Sum
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _ops_all
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .state import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                    local_size, rank, shutdown, size)

__all__ = ["Handle", "Average", "Sum", "Adasum", "Min", "Max", "Product", "init", "shutdown",
           "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", *_ops_all]
