"""What the board's calls may touch of the engine (:class:`Port`), and how a call ends.

The board's calls (:mod:`.board_calls`, :mod:`.host_rounds`) run in the caller's thread
beside the engine; they reach it only through the port the engine makes for them, never
through its attributes.

Layer: core.
"""
from .. import stats
from .board import FALLBACK

__all__ = ["Port", "DONE", "STOPPED", "ENGINE", "passed"]

DONE, STOPPED, ENGINE = "done", "stopped", "engine"     # how a board call ended


class Port:
    """What the engine lends its board calls, and nothing else of it.

    ``taking()``: the engine takes collectives (RUNNING); ``running()``: it has not stopped
    (a waiter gives up otherwise); ``busy()``: rank 0's engine has work under way, which a
    board call must not overtake; ``step()``: one engine step from a board call, True when
    the job ended or broke meanwhile; ``idle(limit, listen)``: sleep on the engine's
    sockets; ``crashed(e)``: fail the engine with ``e``; ``nudge()``: wake rank 0's engine;
    ``drive``: the lock of whoever runs the engine's steps; ``inflight``: the names in
    flight (``{(process set, name): mark}``); ``take_name(req)`` and ``release(key)``: mark
    a name in flight (or raise the refusal) and let it go; ``to_engine(req, arrays, inplace,
    stopped)``: the call through the engine (its failure when ``stopped``), its result;
    ``every_rank_came(now)``: tell the stall inspector; ``side``: the engine's control side
    (host rounds' messages); ``clock``, ``spin_s`` and ``crowded``: the engine's.
    """

    __slots__ = ("taking", "running", "busy", "step", "idle", "crashed", "nudge", "drive",
                 "inflight", "take_name", "release", "to_engine", "every_rank_came", "side",
                 "clock", "spin_s", "crowded")

    def __init__(self, **parts):
        for name in self.__slots__:
            setattr(self, name, parts[name])



def passed(why, board=None, posts=None):
    """A board call goes to the engine (``why``: counted in the metrics' board_fallbacks);
    ``board``: its open ``posts`` go too.  Returns ENGINE."""
    stats.counters.fallbacks[why] += 1
    if board is not None:
        board.answer(posts, FALLBACK)
    return ENGINE
