"""Collectives through MPI (mpi4py's buffer API) for a job started by mpirun
(``HORA_BACKEND=mpi``).

hora's ranks are MPI_COMM_WORLD's ranks there (init() checks that they agree), so a
duplicate of COMM_WORLD serves the global process set: the duplicate keeps hora's traffic
apart from any MPI calls of the user's own.  numpy buffers go to MPI as they are (mpi4py
derives the MPI datatype from the dtype): Allreduce and Allgatherv in place, Bcast,
Reduce_scatter (in place: the result lands at the start of the buffer and is moved to this
rank's block), Alltoallv.  Bool sums and maxima are logical ors, products and minima
logical ands (MPI defines only LOR/LAND on C_BOOL); MPI has no MIN/MAX on complex numbers,
so those calls return False and the engine uses TCP.

Layer: backends.  Knows nothing of names or requests; imports mpi4py lazily (``hora[mpi]``).
"""
import numpy as np

from ..errors import HoraError, HoraInternalError
from .ring import segment_bounds

__all__ = ["MpiGroup", "require_mpi4py"]

# the numpy dtypes hora reduces, each with a predefined MPI datatype (mpi4py maps them)
_DTYPES = frozenset(np.dtype(d) for d in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool", "complex64", "complex128"))


def require_mpi4py(what="HORA_BACKEND=mpi"):
    """Import mpi4py's MPI (initializing MPI), or raise HoraError naming the extra."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise HoraError(f"{what} needs mpi4py and an MPI library: pip install 'hora[mpi]'") \
            from e
    return MPI


class MpiGroup:
    """Collectives on a duplicate of MPI_COMM_WORLD (see the module docstring): a
    :class:`~hora.backends.base.Plane`.

    Collective: every rank constructs it at the same point.

    Args:
        rank, size: this process's place in the job, which must be MPI's.
    """

    name = "mpi"      # how the timeline and the metrics call this plane

    def __init__(self, rank, size):
        MPI = self._MPI = require_mpi4py()
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (rank, size):
            raise HoraError(f"HORA_BACKEND=mpi: MPI_COMM_WORLD has rank {world.Get_rank()} of "
                            f"{world.Get_size()}, hora's job rank {rank} of {size}; start the "
                            f"job with mpirun (or hora run --mpi)")
        self._comm = world.Dup()
        self.rank, self.size = rank, size
        self._ops = {np.add: MPI.SUM, np.multiply: MPI.PROD, np.minimum: MPI.MIN,
                     np.maximum: MPI.MAX}
        self._bool_ops = {np.add: MPI.LOR, np.maximum: MPI.LOR, np.multiply: MPI.LAND,
                          np.minimum: MPI.LAND}

    def _op(self, dtype, reduce_fn):
        """The MPI op for ``reduce_fn`` on ``dtype``, or None where MPI has none."""
        if dtype == np.bool_:
            return self._bool_ops.get(reduce_fn)
        if dtype.kind == "c" and reduce_fn in (np.minimum, np.maximum):
            return None
        return self._ops.get(reduce_fn)

    def _call(self, what, dtype, run):
        """Run one MPI call; False (nothing sent) for a dtype outside ``_DTYPES``,
        HoraInternalError if MPI fails."""
        if dtype not in _DTYPES:
            return False
        try:
            run()
        except self._MPI.Exception as e:
            raise HoraInternalError(f"rank {self.rank}: MPI {what} failed: "
                                    f"{e.Get_error_string()}") from e
        return True

    # -- collectives (flat, contiguous arrays; every rank calls with the same dtype) ------
    def allreduce(self, flat, reduce_fn):
        op = self._op(flat.dtype, reduce_fn)
        return op is not None and self._call(
            "Allreduce", flat.dtype, lambda: self._comm.Allreduce(self._MPI.IN_PLACE, flat, op))

    def broadcast(self, flat, root):
        return self._call("Bcast", flat.dtype, lambda: self._comm.Bcast(flat, root))

    def allgather(self, out, counts):
        counts = [int(c) for c in counts]
        return self._call("Allgatherv", out.dtype, lambda: self._comm.Allgatherv(
            self._MPI.IN_PLACE, [out, (counts, segment_bounds(counts)[:-1])]))

    def reducescatter(self, flat, counts, reduce_fn):
        op = self._op(flat.dtype, reduce_fn)
        counts = [int(c) for c in counts]
        if op is None or not self._call("Reduce_scatter", flat.dtype, lambda: (
                self._comm.Reduce_scatter(self._MPI.IN_PLACE, flat, counts, op))):
            return False
        lo, hi = segment_bounds(counts)[self.rank:self.rank + 2]
        if lo:
            flat[lo:hi] = flat[:hi - lo].copy()
        return True

    def alltoall(self, send, send_counts, recv, recv_counts):
        """Send block p of ``send`` (``send_counts``) to rank p; receive rank p's block for
        us into block p of ``recv`` (``recv_counts``).  Sizes differ per rank."""
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        return self._call("Alltoallv", send.dtype, lambda: self._comm.Alltoallv(
            [send, (sc, segment_bounds(sc)[:-1])], [recv, (rc, segment_bounds(rc)[:-1])]))

    def close(self):
        comm, self._comm = self._comm, None
        if comm is not None and not self._MPI.Is_finalized():
            comm.Free()
