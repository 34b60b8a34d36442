"""When a rank's requests go to the coordinator: at once when alone, once a cycle in a burst.

Requests go out at most once per cycle (HORA_CYCLE_TIME) while a burst lasts, that is while
earlier requests of this rank are in flight or went out less than a cycle ago (gradients
arriving during backward): the burst then travels, completes and is fused in fewer, larger
collectives.  A request made while nothing is in flight and nothing was sent for a cycle
goes at once, so a lone collective pays no delay.  A rank that is leaving sends at once.

Layer: core.
"""

__all__ = ["Pacer"]


class Pacer:
    """The requests taken from the queue and not yet sent.

    Args:
        cycle_s: the cycle time in seconds (autotune may change :attr:`cycle_s`).
        clock: the engine's monotonic clock.

    Attributes:
        unsent: requests held back to travel together, oldest first.
        hold_until: when the held requests go (None: none held).
        last_send: when requests last went out.
    """

    def __init__(self, cycle_s, clock):
        self.cycle_s = cycle_s
        self.unsent = []
        self.hold_until = None
        self.last_send = float("-inf")
        self._clock = clock

    def take(self, pending, leaving):
        """The requests to send now (maybe none).

        Args:
            pending: this rank's collectives that wait for an answer, the unsent among them.
            leaving: this rank is leaving the job: send everything now.
        """
        if not self.unsent:
            return []
        now = self._clock()
        if self.cycle_s > 0 and not leaving:
            in_flight = len(pending) > len(self.unsent)
            if in_flight or now - self.last_send < self.cycle_s:
                if self.hold_until is None:
                    self.hold_until = max(now, self.last_send) + self.cycle_s
                if now < self.hold_until:
                    return []
        send, self.unsent, self.hold_until = self.unsent, [], None
        self.last_send = now
        return send
