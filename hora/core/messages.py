"""The vocabulary the engine and the coordinator share: collective kinds, reduce ops, requests.

Requests and responses are plain tuples (namedtuples) so that they pickle small and fast.
Layer: core.
"""
import collections

__all__ = ["ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER",
           "JOIN", "ADD_SET", "REMOVE_SET", "KIND_NAMES", "Average", "Sum", "Adasum", "Min",
           "Max", "Product", "OP_NAMES", "AMONG", "Request"]

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, ADD_SET, \
    REMOVE_SET = range(9)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
              ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter", BARRIER: "barrier",
              JOIN: "join", ADD_SET: "add_process_set", REMOVE_SET: "remove_process_set"}

# Horovod's ReduceOp values, so that scripts that compare ops keep working.
Average, Sum, Adasum, Min, Max, Product = range(6)
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}

# One rank's description of one collective.  ``shapes`` is a tuple of shapes (several for a
# grouped allreduce; the member ranks for ADD_SET, whose ``root`` is AMONG when only those
# ranks submit it, else -1), ``splits`` the alltoall split sizes (or None for an even
# split), ``process_set`` the id of the set it runs in (0: every rank),
# ``device`` where its data lives: "" for host memory (numpy arrays), else the device type of
# the framework tensors that a device plane reduces in place (hora.backends.nccl: "cuda").
# ``error`` is None, except in the stand-in a rank submits when its own call of the collective
# failed its argument checks ("TypeError: ..."): the coordinator then fails the collective on
# every rank that submitted it, naming that rank and its error, instead of letting them stall.
AMONG = 1
Request = collections.namedtuple(
    "Request",
    "name kind dtype shapes op root prescale postscale splits process_set device error",
    defaults=(0, "", None))
