"""The stall inspector's words: the warning, the hints, and where each missing rank is stuck.

Rank 0's engine decides *when* to warn (HORA_STALL_CHECK_TIME_SECONDS, repeated at that
interval while the stall lasts); this module decides *what* to say, from the coordinator's
bookkeeping, with no sockets and no clock of its own:

- :func:`warning_text`: Horovod's warning ("Missing ranks:" then ``rank: [names]``), followed
  by one hint line for each cause it recognises: a rank that has submitted nothing for a
  while (out of data, or stuck in its input pipeline: see ``join``), or a rank that
  submitted other names than the ranks waiting for it (rank-dependent control flow).
- :func:`main_thread_stack`: what a missing rank's engine thread answers when rank 0 asks
  where its main thread is; :func:`main_thread_waits`: the collective it waits for, if any
  (rank 0 ends a stall in which every rank waits for a name no other rank submitted).
- :class:`StackRequests`: rank 0's record of those questions, so that it asks each rank once
  at a time, waits a bounded time for answers without blocking, and reports what came back
  (and who did not answer: a stopped process, or one busy outside Python).
- :func:`set_activity` / :func:`activity`: a framework binding declares what this rank's
  main thread is doing outside collectives (Keras: validation inside ``fit()``), with
  advice for a stall it causes.  Setting it is one assignment; it is read only when a stall
  is reported: rank 0 reads its own, and a worker sends its own with its stack
  (:class:`~hora.core.wire.Stack`).  The hint then says what the missing rank is doing
  while the others wait, and what to do.

Layer: core.
"""
import contextlib
import sys
import threading
import traceback
from typing import Iterator, Optional, Tuple

from .handles import Handle

__all__ = ["warning_text", "hints", "activity_hints", "main_thread_stack", "main_thread_waits",
           "StackRequests",
           "STACK_WAIT_S", "set_activity", "current_activity", "activity", "VALIDATION_ADVICE"]

STACK_WAIT_S = 1.0          # how long rank 0 gathers stack answers before logging them
_MAX_STACK_CHARS = 6000
_MAX_NAMES = 6


# (what, advice) while a binding says this rank is busy outside collectives, else None
_doing: Optional[Tuple[str, str]] = None

VALIDATION_ADVICE = (
    "only the ranks given validation data validate at the end of each epoch, and the others "
    "have gone on into the next epoch and wait for them (a hang if the validation never "
    "ends, or submits collectives of its own). Give every rank validation data (its own "
    "shard or channel, e.g. validation_{rank}) or give it to none, or validate after fit() "
    "returns (on rank 0 alone if you like)")


def set_activity(what: Optional[str], advice: str = "") -> None:
    """Declare what this rank's main thread is doing now, for the stall inspector's hints;
    ``None`` clears it.  Costs one assignment: call it freely around loops.

    Args:
        what: a phrase that completes "rank 3 is ...", e.g. "running validation inside fit()".
        advice: what to do when this activity holds the other ranks up (one sentence or two).
    """
    global _doing
    _doing = None if what is None else (what, advice)


def current_activity() -> Optional[Tuple[str, str]]:
    """``(what, advice)`` as last declared by :func:`set_activity`, or None."""
    return _doing


@contextlib.contextmanager
def activity(what: str, advice: str = "") -> Iterator[None]:
    """``with activity("running validation", advice): ...``: declared for the block, then
    what was declared before it is restored."""
    global _doing
    before = _doing
    _doing = (what, advice)
    try:
        yield
    finally:
        _doing = before


def _names(names):
    shown = ", ".join(names[:_MAX_NAMES])
    return f"[{shown}{' ...' if len(names) > _MAX_NAMES else ''}]"


def _ranks(ranks):
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def missing_lines(missing):
    """Horovod's listing: ``rank: [first names ...]`` per missing rank."""
    return "\n".join(f"{rank}: {_names(names)}" for rank, names in sorted(missing.items()))


def activity_hints(stalled, doing):
    """One line per missing rank that declared what it is doing (:func:`set_activity`):
    what it does, who waits for it in which collectives, and the advice it declared.

    Args:
        stalled: as for :func:`hints`.
        doing: ``{rank: (what, advice)}``.
    """
    waiting = {}            # missing rank -> ([names], {ranks waiting in them})
    for name, have, lack in stalled:
        for r in lack:
            if r in doing:
                names, ranks = waiting.setdefault(r, ([], set()))
                names.append(name)
                ranks.update(have)
    lines = []
    for r, (names, ranks) in sorted(waiting.items()):
        what, advice = doing[r]
        who = _ranks(ranks) + (" waits" if len(ranks) == 1 else " wait")
        line = f"Hint: rank {r} is {what} while {who} for it in {_names(names)}"
        lines.append(f"{line}: {advice.rstrip('.')}." if advice else f"{line}.")
    return lines


def hints(stalled, last_submit, now, after, doing=None):
    """One line per missing rank whose stall has a recognisable cause.

    Args:
        stalled: ``[(name, submitted_ranks, missing_ranks)]`` of the collectives older
            than ``after`` seconds (:meth:`Coordinator.stalled_collectives`).
        last_submit: ``{rank: time of its latest submission}`` (absent: never submitted).
        now, after: the current time and the stall threshold, in seconds.
        doing: ``{rank: (what, advice)}``: what missing ranks declared they are doing
            (:func:`set_activity`); their hint says so instead of guessing.
    """
    doing = doing or {}
    lacking = {}            # missing rank -> names the others wait for from it
    submitted = {}          # rank -> stalled names it submitted (others lack them)
    for name, have, lack in stalled:
        for r in lack:
            lacking.setdefault(r, []).append(name)
        for r in have:
            submitted.setdefault(r, []).append(name)
    lines = []
    if any(r in submitted for r in lacking):
        groups = {}
        for r, names in sorted(submitted.items()):
            groups.setdefault(tuple(names), []).append(r)
        said = "; ".join(f"{_ranks(ranks)} submitted {_names(list(names))}"
                         for names, ranks in groups.items())
        lines.append(f"Hint: names differ between ranks: {said}; rank-dependent control "
                     f"flow? Every rank must submit the same collective names.")
    for r in sorted(lacking):
        if r in submitted or r in doing:
            continue
        last = last_submit.get(r)
        if last is None or now - last >= after:
            quiet = ("has not submitted any collective yet" if last is None else
                     f"has submitted no collective for {now - last:.0f} s")
            lines.append(
                f"Hint: rank {r} {quiet}: it may have run out of data or be stuck in its "
                f"input pipeline or in user code; a rank with fewer batches can call "
                f"hora.join() (hvd.join()) so that the others' allreduces complete.")
    return lines + activity_hints(stalled, doing)


def warning_text(missing, hint_lines, after):
    """Horovod's stall warning, then the hints."""
    text = (
        f"One or more tensors were submitted to be reduced, gathered or broadcasted by subset "
        f"of ranks and are waiting for remainder of ranks for more than {after:g} seconds. "
        f"This may indicate that different ranks are trying to submit different tensors or "
        f"that only subset of ranks is submitting tensors, which will cause deadlock. \n"
        f"Missing ranks:\n{missing_lines(missing)}")
    if hint_lines:
        text += "\n" + "\n".join(hint_lines)
    return text


def main_thread_stack():
    """The Python stack of this process's main thread right now, as text."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(the main thread has exited)\n"
    text = "".join(traceback.format_stack(frame, limit=40))
    if len(text) > _MAX_STACK_CHARS:
        text = "...\n" + text[-_MAX_STACK_CHARS:]
    return text


_WAIT = Handle.wait.__code__


def main_thread_waits() -> Optional[str]:
    """The name of the collective this process's main thread waits for right now (in
    :meth:`Handle.wait <hora.core.handles.Handle.wait>`), or None.  Read from its stack, so
    that the waits themselves keep no record."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code is _WAIT:
            name = getattr(frame.f_locals.get("self"), "name", None)
            return name if isinstance(name, str) else None
        frame = frame.f_back
    return None


class StackRequests:
    """Rank 0's outstanding questions "where is your main thread?" and their answers.

    A stall warning calls :meth:`ask` with the missing ranks; it returns the ranks to ask
    (those not already asked and silent) and a token to send them.  :meth:`answer` records
    a reply; :meth:`report` returns the text to log once every rank of the round has
    answered or ``wait_s`` has passed, naming those that stayed silent.  A reply that comes
    after its round was reported is returned by :meth:`answer` on its own.
    """

    def __init__(self, wait_s=STACK_WAIT_S):
        self.wait_s = wait_s
        self._token = 0
        self._asked = {}            # rank -> (token, time asked), until it answers
        self._round = None          # (deadline, ranks, {rank: (text, doing)})

    def ask(self, ranks, now):
        """Start a round for ``ranks``; returns (token, ranks to send the question to)."""
        self._token += 1
        fresh = [r for r in sorted(ranks) if r not in self._asked]
        for r in fresh:
            self._asked[r] = (self._token, now)
        self._round = (now + self.wait_s, sorted(ranks), {})
        return self._token, fresh

    def answer(self, rank, token, text, now, doing=None):
        """Record ``rank``'s reply (``doing``: its declared activity, if any); returns text
        to log now for a late reply, else None."""
        asked = self._asked.pop(rank, None)
        if asked is None:
            return None
        if self._round is not None and rank in self._round[1]:
            self._round[2][rank] = (text, doing)
            return None
        busy = f"it is {doing[0]}; " if doing else ""
        return (f"Stall inspector: rank {rank} answered {now - asked[1]:.1f} s after it was "
                f"asked; {busy}its main thread is at:\n{_indent(text)}")

    def report(self, now):
        """The round's text once complete or past its deadline (then forgotten), else None."""
        if self._round is None:
            return None
        deadline, ranks, answers = self._round
        if len(answers) < len(ranks) and now < deadline:
            return None
        self._round = None
        parts = ["Stall inspector: where each missing rank's main thread is:"]
        for r in ranks:
            if r in answers:
                text, doing = answers[r]
                busy = f", {doing[0]}" if doing else ""
                parts.append(f"rank {r}{busy}:\n{_indent(text)}")
            else:
                since = now - self._asked[r][1] if r in self._asked else 0.0
                parts.append(f"rank {r}: no answer after {since:.1f} s (the process may be "
                             f"stopped, swapping, or busy outside Python; a late answer will "
                             f"be logged)")
        return "\n".join(parts)


def _indent(text):
    return "".join(f"    {line}\n" for line in text.rstrip("\n").split("\n"))
