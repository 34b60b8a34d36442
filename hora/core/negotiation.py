"""The coordinator's bookkeeping: which ranks submitted which collective, in what order.

Pure logic, no sockets and no clock of its own (callers pass ``now``).  Rank 0's engine feeds
it every rank's requests; it answers with the ordered list of responses every rank executes:

    ("run", kind, names, extra)   all ranks submitted these; ``extra`` is per-rank data the
                                  executors need (allgather: first dims; alltoall: splits)
    ("error", names, message, why) the collective cannot run; ``why`` is "mismatch" or
                                  "shutdown" (a rank it needs has shut down)
    ("shutdown",)                 every rank has called shutdown(): close the job

Layer: core.
"""
import collections
import math

import numpy as np

from .messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, KIND_NAMES,
                       OP_NAMES, REDUCESCATTER)

__all__ = ["Coordinator", "validate"]


def _by_value(values):
    """'ranks [0, 2]: x; ranks [1]: y' for the ranks' differing values."""
    groups = collections.defaultdict(list)
    for rank, value in values.items():
        groups[repr(value)].append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                     for v, r in groups.items())


def _differs(reqs, key, label, what):
    values = {rank: key(req) for rank, req in reqs.items()}
    if len(set(map(repr, values.values()))) > 1:
        return f"Mismatched {label} for {what}: {_by_value(values)}"
    return None


def validate(reqs, size):
    """Return an error message if the ranks' requests for one name disagree, else None."""
    first = reqs[min(reqs)]
    what = f"{KIND_NAMES.get(first.kind, 'collective')} {first.name!r}"
    err = _differs(reqs, lambda q: KIND_NAMES[q.kind], "collective kinds", f"{first.name!r}")
    if err or first.kind == BARRIER:
        return err
    checks = [(lambda q: q.dtype, "data types")]
    if first.kind in (ALLREDUCE, REDUCESCATTER):
        checks += [(lambda q: q.shapes if len(q.shapes) > 1 else q.shapes[0], "shapes"),
                   (lambda q: OP_NAMES.get(q.op, q.op), "reduce ops"),
                   (lambda q: (q.prescale, q.postscale), "prescale and/or postscale factors")]
    elif first.kind == BROADCAST:
        checks += [(lambda q: q.root, "root ranks"), (lambda q: q.shapes[0], "shapes")]
    elif first.kind in (ALLGATHER, ALLTOALL):
        checks += [(lambda q: len(q.shapes[0]), "ranks (number of dimensions)"),
                   (lambda q: q.shapes[0][1:], "shapes beyond the first dimension")]
    for key, label in checks:
        err = _differs(reqs, key, label, what)
        if err:
            return err
    if first.kind == BROADCAST and not 0 <= first.root < size:
        return f"Invalid root rank {first.root} for {what}: the job has {size} ranks"
    if first.kind == ALLTOALL:
        for rank, q in sorted(reqs.items()):
            if q.splits is not None and len(q.splits) != size:
                return (f"Invalid splits for {what} on rank {rank}: {len(q.splits)} entries "
                        f"for {size} ranks")
    return None


class Coordinator:
    """Collects requests from every rank and decides what runs, in one global order.

    Args:
        size: number of ranks.
        fusion_threshold: allreduces of the same dtype/op/scaling that become ready together
            are fused into one response while their total bytes stay within this.
    """

    def __init__(self, size, fusion_threshold=128 << 20):
        self.size = size
        self.fusion_threshold = fusion_threshold
        self._pending = {}                       # name -> {rank: Request}
        self._first_seen = {}                    # name -> time of the first submission
        self._ready = []                         # Requests ready to run, in order
        self._out = []                           # responses not yet taken
        self._departed = set()                   # ranks that called shutdown()
        self._shutdown_sent = False

    # -- input ----------------------------------------------------------------------------
    def submit(self, rank, requests, now):
        for req in requests:
            if self._departed - {rank}:
                gone = sorted(self._departed - {rank})
                self._out.append(("error", (req.name,), _shutdown_message(req, gone), "shutdown"))
                continue
            entry = self._pending.setdefault(req.name, {})
            if not entry:
                self._first_seen[req.name] = now
            entry[rank] = req
            if len(entry) == self.size:
                self._complete(req.name)

    def depart(self, rank):
        """``rank`` called shutdown(): fail what can no longer complete."""
        self._departed.add(rank)
        for name in list(self._pending):
            entry = self._pending[name]
            missing = set(range(self.size)) - set(entry)
            if missing & self._departed:
                del self._pending[name]
                del self._first_seen[name]
                req = next(iter(entry.values()))
                self._out.append(("error", (name,),
                                  _shutdown_message(req, sorted(missing & self._departed)),
                                  "shutdown"))

    def _complete(self, name):
        reqs = self._pending.pop(name)
        del self._first_seen[name]
        err = validate(reqs, self.size)
        if err:
            self._flush_ready()
            self._out.append(("error", (name,), err, "mismatch"))
            return
        first = reqs[0]
        if first.kind == ALLREDUCE:
            self._ready.append(first)
            return
        self._flush_ready()
        extra = None
        if first.kind == ALLGATHER:
            extra = tuple(reqs[r].shapes[0][0] if reqs[r].shapes[0] else 1
                          for r in range(self.size))
        elif first.kind == ALLTOALL:
            extra = tuple(reqs[r].splits if reqs[r].splits is not None else
                          _even(reqs[r].shapes[0][0] if reqs[r].shapes[0] else 1, self.size)
                          for r in range(self.size))
        self._out.append(("run", first.kind, (name,), extra))

    def _flush_ready(self):
        """Turn ready allreduces into responses, fusing neighbours that can share a buffer."""
        group, group_key, group_bytes = [], None, 0
        for req in self._ready:
            nbytes = np.dtype(req.dtype).itemsize * sum(math.prod(s) for s in req.shapes)
            key = (req.dtype, req.op, req.prescale, req.postscale)
            if group and (key != group_key or group_bytes + nbytes > self.fusion_threshold):
                self._out.append(("run", ALLREDUCE, tuple(q.name for q in group), None))
                group, group_bytes = [], 0
            group.append(req)
            group_key = key
            group_bytes += nbytes
        if group:
            self._out.append(("run", ALLREDUCE, tuple(q.name for q in group), None))
        self._ready = []

    # -- output ---------------------------------------------------------------------------
    def take_responses(self):
        """The responses decided since the last call, in the order every rank must run them."""
        self._flush_ready()
        if len(self._departed) == self.size and not self._pending and not self._shutdown_sent:
            self._out.append(("shutdown",))
            self._shutdown_sent = True
        out, self._out = self._out, []
        return out

    def stalled(self, now, after):
        """``{rank: [names]}`` of ranks missing from collectives older than ``after`` s."""
        missing = collections.defaultdict(list)
        for name, entry in self._pending.items():
            if now - self._first_seen[name] >= after:
                for rank in range(self.size):
                    if rank not in entry:
                        missing[rank].append(name)
        return dict(missing)


def _even(n, size):
    q, r = divmod(n, size)
    return tuple(q + 1 if i < r else q for i in range(size))


def _shutdown_message(req, gone):
    ranks = ", ".join(map(str, gone))
    return (f"{KIND_NAMES.get(req.kind, 'collective')} {req.name!r} cannot complete: rank"
            f"{'s' if len(gone) > 1 else ''} {ranks} ha{'ve' if len(gone) > 1 else 's'} "
            f"shut down (hora.shutdown() or the end of its script) before submitting it")
