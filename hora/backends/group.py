"""A view of a transport restricted to a subset of ranks (a process set).

The schedules in :mod:`hora.backends.ring` see ranks ``0..len(members)-1``; this view maps
them to the members' global ranks.  It satisfies :class:`~hora.backends.base.Transport` and
shares its parent's connections and :class:`~hora.backends.base.WaitPolicy`.
Layer: backends.
"""

__all__ = ["SubsetTransport"]


class SubsetTransport:
    """``transport`` seen from inside ``members`` (global ranks, this rank among them)."""

    def __init__(self, transport, members):
        self._t = transport
        self.members = tuple(members)   # the global rank of each member
        self.rank = self.members.index(transport.rank)
        self.size = len(self.members)
        self.policy = transport.policy

    @property
    def timeout(self):
        """The parent's timeout: seconds a wait may make no progress while peers live."""
        return getattr(self._t, "timeout", 300.0)

    def _g(self, peer):
        return None if peer is None else self.members[peer]

    def sendrecv(self, send_peer, send_buf, recv_peer, recv_buf, on_recv=None, step=1 << 18):
        self._t.sendrecv(self._g(send_peer), send_buf, self._g(recv_peer), recv_buf, on_recv,
                         step)

    def send(self, peer, buf):
        self._t.send(self._g(peer), buf)

    def recv(self, peer, buf, on_recv=None, step=1 << 18):
        self._t.recv(self._g(peer), buf, on_recv, step)

    def exchange(self, sends, recvs):
        self._t.exchange([(self._g(p), b) for p, b in sends],
                         [(self._g(p), b) for p, b in recvs])

    def watch(self, fds=(), timeout=None, sends=(), recvs=()):
        """The parent's watch: a hang-up of any rank of the job counts, not only the
        members' (a dead rank breaks the job)."""
        return self._t.watch(fds, timeout, [self._g(p) for p in sends],
                             [self._g(p) for p in recvs])

    def close(self):
        """Nothing: the view owns no connections (its parent's close ends it)."""
