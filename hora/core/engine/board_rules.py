"""The board's decisions, as pure state: which calls it takes, how a round is answered, when
rank 0 (or a host's leader) sends the posts to the engine instead, and when a leader vetoes
a host round.  Every function here reads only its arguments (and the clock readings passed
in), so that tests/unit/test_board_rules.py checks each rule without processes; the loops
that wait and look are :mod:`.board_calls` and :mod:`.host_rounds`.

The one principle behind every rule: the board settles a collective only when it is
certain that every rank is in that very call and nothing else is under way; in every other
case the posts go to the engine, where the call behaves exactly as if the board did not
exist (errors and stall reports included).

Layer: core.
"""
from ...backends.board_segment import GO, RESULT, SHARED, STRIPE_BYTES
from ..messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST

__all__ = ["PATIENCE_S", "NUDGE_S", "malformed", "declined", "round_answer", "rank0_verdict", "stale",
           "leader_verdict", "idle_verdict", "round_outcome", "waited"]

PATIENCE_S = 1.0    # a post waits this long for its partners, then goes to the engine: long
#                     enough for a rank delayed by the scheduler, short against the stall
#                     inspector's first report (60 s), which then names the ranks as usual
NUDGE_S = 1e-3      # a post unanswered this long wakes rank 0's engine (it may sleep)


def malformed(kind, root, size, row_items):
    """Why a blocking call (a ``kind``; ``root`` of a broadcast, ``row_items``: elements of
    an allgather's row) of a job of ``size`` ranks goes to the engine whatever its size:
    the engine names the error of a root out of range, and an allgather's row of no elements
    would not tell its rows from its bytes.  None when neither."""
    if kind == BROADCAST and not 0 <= root < size:
        return "root"
    if kind == ALLGATHER and not row_items:
        return "empty rows"
    return None


def declined(kind, nbytes, root, size, row_items, capacity, hosts, sig_len, sig_max):
    """Why the board does not take a blocking call (a ``kind`` of ``nbytes`` bytes; see
    :func:`malformed`) on a job of ``size`` ranks whose board takes ``capacity`` bytes over
    ``hosts`` hosts, its signature ``sig_len`` bytes of the slot's ``sig_max``; None when
    it does."""
    why = malformed(kind, root, size, row_items)
    if why is not None:
        return why
    if kind in (BROADCAST, ALLGATHER) and (nbytes >= STRIPE_BYTES or hosts > 1):
        return "size"           # they take a SHARED round: small, on one host
    if nbytes > capacity:       # (across hosts the capacity stops short of the stripes)
        return "size"
    if sig_len > sig_max:
        return "signature"
    return None


def round_answer(kind, nbytes):
    """Rank 0's answer when every post matches: GO (each rank reduces a stripe) from
    STRIPE_BYTES, RESULT for a barrier (it carries nothing), else SHARED (each rank reduces
    every input itself)."""
    if kind == BARRIER:
        return RESULT
    if kind == ALLREDUCE and nbytes >= STRIPE_BYTES:
        return GO
    return SHARED


def rank0_verdict(busy, all_in, matches, waited_s):
    """Rank 0's look at the posts of a call of its own: ``"busy"`` (its engine has work under
    way, which the call must not overtake), ``"differ"`` (every rank posted, not all this
    call: ``matches()`` is asked only then), ``"patience"`` (a rank did not come within
    PATIENCE_S: it is elsewhere in its program), True (answer the round) or None (look
    again)."""
    return leader_verdict(None, None, busy, all_in, matches, waited_s)   # (nobody to veto)


def stale(posts, busy, seen, now):
    """Rank 0 outside a call of its own: the posts of ``posts`` (``{rank: seq}``) to send to
    the engine: all of them while ``busy``, else those that waited PATIENCE_S (``seen``:
    see :func:`waited`)."""
    return {r: seq for r, seq in posts.items()
            if busy or waited(seen, r, seq, now) >= PATIENCE_S}


def leader_verdict(vetoed, urged, busy, all_in, matches, waited_s):
    """A host's leader in a call, before it posts the host round: the reason to veto it
    (another leader vetoed it, another urged this one to, this one is busy, its host's posts
    differ or did not come within PATIENCE_S), True (play it) or None (look again).
    ``vetoed``, ``urged`` and ``busy`` are None when not looked at this time."""
    if vetoed:
        return "vetoed"
    if urged:
        return "urged"
    if busy:
        return "busy"
    if all_in:
        return True if matches() else "differ"
    if waited_s > PATIENCE_S:
        return "patience"
    return None


def idle_verdict(vetoed, busy, urged, waited_s):
    """A leader outside a call, seeing another leader's post of the next host round: why it
    vetoes the round (its host's ranks may wait on the engine, or are elsewhere in their
    program), ``"idle vetoed"`` when another leader already did, or None (wait)."""
    if vetoed:
        return "idle vetoed"
    if busy:
        return "idle busy"
    if urged:
        return "idle urged"
    if waited_s >= PATIENCE_S:
        return "idle patience"
    return None


def round_outcome(msgs, sig, want):
    """A host round once every other leader has posted or one vetoed (``msgs``: their
    :class:`~hora.core.wire.HostPost` of it): True when each posted ``sig`` with ``want``
    bytes of partial result, else why the hosts go to the engine."""
    if all(m.sig == sig and len(m.data) == want for m in msgs.values()):
        return True
    return "vetoed" if any(not m.sig for m in msgs.values()) else "differ"


def waited(seen, r, seq, now):
    """How long rank ``r``'s open post ``seq`` has waited at ``now``, counted from when it
    was first seen (``seen``: ``{r: (seq, when first seen)}``, updated here)."""
    first = seen.get(r)
    if first is None or first[0] != seq:
        seen[r] = first = (seq, now)
    return now - first[1]
