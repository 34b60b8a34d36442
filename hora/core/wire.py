"""The control plane's vocabulary: the engines' messages and the coordinator's responses.

Every message is a typed tuple (a NamedTuple) whose first field, ``tag``, names its type;
code reads the other fields by name.  Between ranks a message travels as the plain tuple of
its fields (:func:`encode`, :func:`decode`), which pickles and unpickles with no class
lookup: the engine frames them (:mod:`hora.core.engine.conn`), and a job whose key is
derivable decodes them with the restricted decoder, which admits plain data and the classes
of :data:`ALLOWED` only.

A worker sends rank 0:

- :class:`Req`: new requests (``full``), the cache ids of cached ones (``ids``), the inputs
  of its small allreduces (``small``: ``{(set, name): bytes}``), and whether an offer was
  out when it sent them (``offered``: an offer the request crossed came too late).
- :class:`Accept`: it takes offer ``number`` and runs its answer now; the rest of its
  requests follow as in a Req.
- :class:`Bye`: it called shutdown().
- :class:`Nudge`: its post on the board waits (:mod:`hora.core.engine.board`).
- :class:`HostPost`: a host leader's (global rank ``src``) post of host round ``seq``: the
  collective's signature (``sig``) and its host's partial result (``data``), or a veto
  (empty ``sig``: every host sends that round's posts to the engine; ``data``: then the
  signature of the vetoing leader's own call, or nothing); rank 0 relays it to
  the other leaders (:mod:`hora.core.engine.board`).
- :class:`Stack`: where its main thread is, answering a :class:`StackQuestion`, and what
  it declared it is doing (``doing``: ``(what, advice)`` or None; see
  :func:`hora.core.stall.set_activity`), and the name of the collective it waits for
  (``waits``, or None).
- :class:`Trace`: its timeline events since the last (:mod:`hora.core.timeline`), while a
  timeline runs: plain tuples ``(row, phase, start, duration, args)`` on rank 0's clock.
- :class:`Stats`: its ``hora.metrics()``, while rank 0 writes them (HORA_METRICS_DIR).

In a job on several hosts the ranks of every host but rank 0's send those to their host's
*leader* (its lowest rank; :func:`hora.core.links.ctrl_parent`), which sends rank 0:

- :class:`HostIds`: every rank of ``ranks`` (the host's, the leader's own among them) has
  submitted the cached requests ``ids``; ``small``: ``{(set, name): bytes}``, the host's
  partial result of each small allreduce among them (:mod:`hora.core.engine.relay`).
- :class:`Fwd`: ``body``, one of the messages above that rank ``src`` sent (any that is not
  aggregated), as if it came on ``src``'s own connection; and rank 0 sends a leader a
  :class:`StackQuestion` for ``src`` so wrapped.

Rank 0 sends a worker:

- :class:`Resp`: responses, which every rank runs in the order given.
- :class:`Offer`: the answer to requests the worker has not sent yet (see
  :mod:`hora.core.engine.offer`); ``heard`` counts the worker's Req/Accept/Bye that rank 0
  had read when it made the offer.
- :class:`StackQuestion`: the stall inspector asks where the worker's main thread is.
- :class:`Abort`: rank 0 ends the job (a stall shutdown, or a rank's slot claimed twice at the
  rendezvous), with this text.
- :class:`HostPost`: rank 0's own posts of host rounds, and the other leaders' (relayed),
  to a host leader.

Either way: :class:`Dead`: ``rank`` died first, with this text (rank 0 relays it).

The responses (decided by :class:`hora.core.negotiation.Coordinator`, run by every rank):

- :class:`Run`: every member submitted these; ``extra`` is what the executors need, by
  ``kind`` (the one place it is defined):

  ============  ===================================================================
  ALLREDUCE     None; or :class:`Joined` when ranks that called join() contribute zeros
  ALLGATHER     the members' first dimensions, in member order
  ALLTOALL      the members' splits (rows each sends to each member), in member order
  JOIN          the last rank to join (every rank's join() returns it)
  ADD_SET       :class:`NewSet`: the new set's id and ranks
  REMOVE_SET    the id of the removed set
  otherwise     None
  ============  ===================================================================
- :class:`Error`: the collective cannot run; ``why`` is "mismatch", "aborted" (a rank's
  call failed its argument checks; ``detail``: ``{rank: its error}``), "shutdown" (a rank
  it needs has shut down) or "nonmember" (a rank submitted it on a process set without
  that rank; ``detail``: ``{rank: the error}``, and only that rank's call fails).
- :class:`Value`: small allreduces that rank 0 reduced itself: ``results`` holds each
  name's reduced bytes.
- :class:`Cache`: from now on a rank may send ``cache_id`` instead of this exact request.
- :class:`Tune`: autotune chose a new cycle time (ms).
- :class:`Shutdown`: every rank has called shutdown(): close the job.

Layer: core.
"""
from typing import Any, Dict, NamedTuple, Optional, Tuple

from .messages import Request

__all__ = ["Req", "Accept", "Bye", "Nudge", "HostPost", "Stack", "Trace", "Stats", "HostIds",
           "Fwd", "Resp", "Offer", "StackQuestion", "Abort", "Dead",
           "Run", "Error", "Value", "Cache", "Tune", "Shutdown", "Joined", "NewSet",
           "ALLOWED", "encode", "decode"]

_new = tuple.__new__


# Each message class takes its fields without the tag (``Run(kind, set_id, names, extra)``);
# the tag is filled in, so that a message always equals the tuple that travels.

class Req(NamedTuple("Req", [("tag", str), ("full", list), ("small", dict), ("ids", list),
                             ("offered", bool)])):
    __slots__ = ()

    def __new__(cls, full, small, ids, offered):
        return _new(cls, ("req", full, small, ids, offered))


class Accept(NamedTuple("Accept", [("tag", str), ("number", int), ("full", list),
                                   ("small", dict), ("ids", list)])):
    __slots__ = ()

    def __new__(cls, number, full, small, ids):
        return _new(cls, ("accept", number, full, small, ids))


class Nudge(NamedTuple("Nudge", [("tag", str)])):
    """A worker's post on the board waits: rank 0's engine should take a step and answer it
    (see :mod:`hora.core.engine.board`).  It carries nothing: arriving is its message."""
    __slots__ = ()

    def __new__(cls):
        return _new(cls, ("nudge",))


class HostPost(NamedTuple("HostPost", [("tag", str), ("src", int), ("seq", int),
                                         ("sig", bytes), ("data", bytes)])):
    __slots__ = ()

    def __new__(cls, src, seq, sig, data):
        return _new(cls, ("hpost", src, seq, sig, data))


class Bye(NamedTuple("Bye", [("tag", str)])):
    __slots__ = ()

    def __new__(cls):
        return _new(cls, ("bye",))


class Stack(NamedTuple("Stack", [("tag", str), ("token", int), ("text", str),
                                 ("doing", Optional[Tuple[str, str]]),
                                 ("waits", Optional[str])])):
    __slots__ = ()

    def __new__(cls, token, text, doing=None, waits=None):
        return _new(cls, ("stack", token, text, doing, waits))


class Trace(NamedTuple("Trace", [("tag", str), ("events", list)])):
    __slots__ = ()

    def __new__(cls, events):
        return _new(cls, ("trace", events))


class Stats(NamedTuple("Stats", [("tag", str), ("values", dict)])):
    __slots__ = ()

    def __new__(cls, values):
        return _new(cls, ("stats", values))


class HostIds(NamedTuple("HostIds", [("tag", str), ("ranks", tuple), ("ids", list),
                                       ("small", dict)])):
    __slots__ = ()

    def __new__(cls, ranks, ids, small):
        return _new(cls, ("hids", ranks, ids, small))


class Fwd(NamedTuple("Fwd", [("tag", str), ("src", int), ("body", Any)])):
    __slots__ = ()

    def __new__(cls, src, body):
        return _new(cls, ("fwd", src, body))


class Resp(NamedTuple("Resp", [("tag", str), ("responses", list)])):
    __slots__ = ()

    def __new__(cls, responses):
        return _new(cls, ("resp", responses))


class Offer(NamedTuple("Offer", [("tag", str), ("number", int), ("heard", int),
                                 ("ids", tuple), ("responses", tuple)])):
    __slots__ = ()

    def __new__(cls, number, heard, ids, responses):
        return _new(cls, ("offer", number, heard, ids, responses))


class StackQuestion(NamedTuple("StackQuestion", [("tag", str), ("token", int)])):
    __slots__ = ()

    def __new__(cls, token):
        return _new(cls, ("stack?", token))


class Abort(NamedTuple("Abort", [("tag", str), ("text", str)])):
    __slots__ = ()

    def __new__(cls, text):
        return _new(cls, ("abort", text))


class Dead(NamedTuple("Dead", [("tag", str), ("rank", int), ("text", str)])):
    __slots__ = ()

    def __new__(cls, rank, text):
        return _new(cls, ("dead", rank, text))


# -- responses ------------------------------------------------------------------------------
class Run(NamedTuple("Run", [("tag", str), ("kind", int), ("set_id", int), ("names", tuple),
                             ("extra", Any)])):
    __slots__ = ()

    def __new__(cls, kind, set_id, names, extra=None):
        return _new(cls, ("run", kind, set_id, names, extra))


class Error(NamedTuple("Error", [("tag", str), ("set_id", int), ("names", tuple),
                                 ("message", str), ("why", str), ("detail", Optional[dict])])):
    __slots__ = ()

    def __new__(cls, set_id, names, message, why, detail=None):
        return _new(cls, ("error", set_id, names, message, why, detail))


class Value(NamedTuple("Value", [("tag", str), ("set_id", int), ("names", tuple),
                                 ("results", tuple)])):
    __slots__ = ()

    def __new__(cls, set_id, names, results):
        return _new(cls, ("value", set_id, names, results))


class Cache(NamedTuple("Cache", [("tag", str), ("cache_id", int), ("request", Request)])):
    __slots__ = ()

    def __new__(cls, cache_id, request):
        return _new(cls, ("cache", cache_id, request))


class Tune(NamedTuple("Tune", [("tag", str), ("cycle_ms", float)])):
    __slots__ = ()

    def __new__(cls, cycle_ms):
        return _new(cls, ("tune", cycle_ms))


class Shutdown(NamedTuple("Shutdown", [("tag", str)])):
    __slots__ = ()

    def __new__(cls):
        return _new(cls, ("shutdown",))


# -- a Run's extra, where it is more than a number (rare: they travel as their class) -------
class Joined(NamedTuple):
    """An allreduce that ranks which called join() join with zeros."""
    ranks: tuple            # the joined ranks, which did not submit it
    request: Request        # what a joined rank needs to make its zeros


class NewSet(NamedTuple):
    """A process set the coordinator added."""
    set_id: int
    ranks: tuple


# the classes a restricted decoder admits in a control frame, beside plain data: each is
# built by its own __new__ from the frame's fields, which runs no code of the sender's choice
ALLOWED = (Request, Joined, NewSet)


def _by_tag(classes: Dict[str, Any]) -> Dict[str, Tuple[Any, int]]:
    """tag -> (class, length of its tuple)"""
    return {tag: (cls, len(cls._fields)) for tag, cls in classes.items()}


_MESSAGES = _by_tag({"req": Req, "accept": Accept, "bye": Bye, "nudge": Nudge, "stack": Stack,
                     "resp": Resp, "offer": Offer, "stack?": StackQuestion, "abort": Abort,
                     "dead": Dead, "trace": Trace, "stats": Stats, "hpost": HostPost,
                     "hids": HostIds, "fwd": Fwd})
# what a Fwd may carry: a worker's own messages up, a stack question down
_CARRIED = {"req", "bye", "stack", "trace", "stats", "stack?"}
_RESPONSES = _by_tag({"run": Run, "error": Error, "value": Value, "cache": Cache,
                      "tune": Tune, "shutdown": Shutdown})


def encode(msg):
    """``msg`` as the plain tuple that travels (the responses it carries too)."""
    cls = msg.__class__
    if cls is Resp:
        return ("resp", [tuple(r) for r in msg.responses])
    if cls is Offer:
        return ("offer", msg.number, msg.heard, msg.ids, [tuple(r) for r in msg.responses])
    if cls is Fwd:
        return ("fwd", msg.src, encode(msg.body))
    return tuple(msg)


def decode(obj):
    """The message that :func:`encode` turned into ``obj``.

    Raises:
        ValueError: ``obj`` is not a message (an unknown tag, a wrong number of fields).
    """
    try:
        cls, n = _MESSAGES[obj[0]]
        if len(obj) != n or obj.__class__ is not tuple:
            raise ValueError
        if cls is Resp:
            return _new(Resp, ("resp", _responses(obj[1])))
        if cls is Offer:
            return _new(Offer, ("offer", obj[1], obj[2], tuple(obj[3]),
                                tuple(_responses(obj[4]))))
        if cls is Fwd:
            if obj[2][0] not in _CARRIED:
                raise ValueError
            return _new(Fwd, ("fwd", obj[1], decode(obj[2])))
        if cls is HostIds:
            return _new(HostIds, ("hids", tuple(obj[1]), obj[2], obj[3]))
        return _new(cls, obj)
    except (ValueError, LookupError, TypeError) as e:
        raise ValueError(f"not a control message: {obj!r:.200}") from e


def _responses(items):
    out = []
    for r in items:
        cls, n = _RESPONSES[r[0]]
        if len(r) != n or r.__class__ is not tuple:
            raise ValueError
        out.append(_new(cls, r))
    return out
