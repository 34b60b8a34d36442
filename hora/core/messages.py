"""The vocabulary the engine and the coordinator share: collective kinds, reduce ops, requests.

Requests and responses are plain tuples (namedtuples) so that they pickle small and fast.
Layer: core.
"""
import collections

__all__ = ["ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER",
           "KIND_NAMES", "Average", "Sum", "Adasum", "Min", "Max", "Product", "OP_NAMES",
           "Request"]

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER = range(6)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
              ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter", BARRIER: "barrier"}

# Horovod's ReduceOp values, so that scripts that compare ops keep working.
Average, Sum, Adasum, Min, Max, Product = range(6)
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}

# One rank's description of one collective.  ``shapes`` is a tuple of shapes (several for a
# grouped allreduce), ``splits`` the alltoall split sizes (or None for an even split).
Request = collections.namedtuple(
    "Request", "name kind dtype shapes op root prescale postscale splits")
