"""What the rendezvous store accepts when the job's key is derivable from public values.

Outside ``hora run`` (torchrun across hosts, SageMaker, a Slurm job whose home directory is
unusable) the key may be computed by anyone who knows the job's public identity, so passing
the handshake proves nothing.  The store then serves exactly what ``hora.init()`` needs:

- a connection's first request claims one rank slot: a put of ``<slot prefix><r>`` for a
  rank ``r`` of the job, with a value the job's schema accepts, on a key nobody has
  claimed.  A slot is written once: it can be neither overwritten nor deleted, and one
  connection holds at most one.  A second claim of a slot means that a process outside
  the job knows the key, and it may be the first claimant: the server stops the store and
  rank 0 the job, on every rank, naming the slot and both claimants' addresses (a loud
  failure, never a silent member).
- then, and only then, that connection may read the slots and notes (``get``,
  ``wait_prefix`` on those prefixes) and put a note (``<note prefix><r>``, a short text,
  first one wins): how a rank tells the others that a peer died during init.
- everything else is refused: other keys, deletes, oversized frames, bad types.

Layer: rendezvous.  Imports nothing from hora.
"""
import math

__all__ = ["SlotPolicy", "StoreRequestRefused"]


class StoreRequestRefused(ValueError):
    """A request the policy does not allow; the server answers it with an error and drops
    the connection."""


def _is_rank(text, size):
    return text.isdigit() and text.isascii() and str(int(text)) == text and int(text) < size


def _is_wait(value, limit):
    return (type(value) in (int, float) and math.isfinite(value) and 0 <= value <= limit)


class SlotPolicy:
    """The rules above, for a job of ``size`` ranks.

    Args:
        size: the number of ranks (slot ``r`` exists for ``0 <= r < size``).
        slot_prefix: key prefix of the rank slots (``"init1/rank/"``).
        note_prefix: key prefix of the notes (``"init1/dead/"``).
        check_slot: ``check_slot(rank, value)`` returns a reason (str) to refuse a slot's
            value, or None to accept it.
        note_limit: the longest note, in characters.
        max_wait_s: the longest wait a request may ask for.
    """

    frame_limit = 64 * 1024      # the largest request frame (a slot is ~200 bytes)

    def __init__(self, size, slot_prefix, note_prefix, check_slot, note_limit=4096,
                 max_wait_s=24 * 3600.0):
        self.size = size
        self.slot_prefix = slot_prefix
        self.note_prefix = note_prefix
        self._check_slot = check_slot
        self._note_limit = note_limit
        self._max_wait = max_wait_s

    def claim(self, request):
        """``(key, value)`` of a connection's first request, a slot claim.

        Raises:
            StoreRequestRefused: it is anything else, or the value does not fit.
        """
        if (type(request) is not tuple or len(request) != 3 or request[0] != "put"
                or type(request[1]) is not str or not request[1].startswith(self.slot_prefix)):
            raise StoreRequestRefused(f"the first request must claim a rank slot "
                                      f"({self.slot_prefix}<rank>); got {_brief(request)}")
        rank = request[1][len(self.slot_prefix):]
        if not _is_rank(rank, self.size):
            raise StoreRequestRefused(f"{request[1]!r} is not the slot of a rank of this job "
                                      f"of {self.size}")
        reason = self._check_slot(int(rank), request[2])
        if reason is not None:
            raise StoreRequestRefused(f"slot {request[1]!r}: {reason}")
        return request[1], request[2]

    def check(self, request):
        """Raise StoreRequestRefused unless a slot holder may make ``request``; return its
        kind: "read" (get, wait_prefix) or "note" (a put of a note, or a will)."""
        if type(request) is not tuple or not request or type(request[0]) is not str:
            raise StoreRequestRefused(f"expected a request tuple, got {_brief(request)}")
        op = request[0]
        if op == "get" and len(request) == 3 and self._is_key(request[1]):
            if _is_wait(request[2], self._max_wait):
                return "read"
        elif op == "wait_prefix" and len(request) == 4:
            if (request[1] in (self.slot_prefix, self.note_prefix)
                    and type(request[2]) is int and 0 <= request[2] <= self.size
                    and _is_wait(request[3], self._max_wait)):
                return "read"
        elif op == "will" and len(request) == 3 and request[1:] == (None, None):
            return "note"
        elif op in ("put", "will") and len(request) == 3 and type(request[1]) is str:
            key = request[1]
            if (key.startswith(self.note_prefix)
                    and _is_rank(key[len(self.note_prefix):], self.size)
                    and type(request[2]) is str and len(request[2]) <= self._note_limit):
                return "note"
            if op == "put" and key.startswith(self.slot_prefix):
                raise StoreRequestRefused(f"{key!r}: a connection claims one rank slot, "
                                          f"once")
        raise StoreRequestRefused(f"not allowed with a derivable job key: {_brief(request)}")

    def _is_key(self, key):
        if type(key) is not str:
            return False
        for prefix in (self.slot_prefix, self.note_prefix):
            if key.startswith(prefix) and _is_rank(key[len(prefix):], self.size):
                return True
        return False


def _brief(obj):
    text = repr(obj)
    return text if len(text) <= 120 else text[:117] + "..."
