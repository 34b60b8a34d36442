"""The contracts between the engine and the backends.

- :class:`Transport`: point-to-point bytes between the ranks of one group (TCP:
  :class:`~hora.backends.tcp.TcpTransport`; a process set's view of it:
  :class:`~hora.backends.group.SubsetTransport`; in-process threads for unit tests:
  :mod:`hora.backends.loopback`).  :class:`NetworkTransport` adds the IP addresses its
  connections use, for planes that open connections of their own (gloo, nccl).
- :class:`Plane`: the five collectives on flat numpy buffers (shared memory, hierarchical,
  gloo, mpi; the ring over a transport itself: :class:`~hora.backends.ring.RingPlane`).
- :class:`WaitPolicy`: what the owner of a transport decides about its waits (busy-poll
  or sleep, whom to blame for a lost peer), created with the transport and shared by
  every view of it.

The classes are :class:`typing.Protocol`\\ s: a backend satisfies them by having the methods,
without inheriting.  Peers are ranks ``0..size-1`` of the transport's own group; buffers
are byte ``memoryview``\\ s (transports) or flat, contiguous numpy arrays (planes).

Errors every transport raises, and only these, for a failed transfer:

- :class:`~hora.errors.TransportBrokenError` (``.rank``: the peer) when a peer's end went
  away (its process exited or was killed, its host vanished), also while the call was
  waiting on some other peer;
- :class:`~hora.errors.TransportClosedError` when this process closed the transport,
  before or during the call;
- :class:`~hora.errors.CollectiveTimeoutError` when a transfer made no progress for the
  transport's ``timeout`` seconds while every peer was alive (a hung, not a dead, peer).

Layer: backends.  Imports nothing from hora.
"""
import dataclasses
import os
from typing import Callable, Iterable, Optional, Protocol, Sequence, Tuple, runtime_checkable

__all__ = ["NetworkTransport", "Plane", "Transport", "WaitPolicy"]


@dataclasses.dataclass(slots=True)
class WaitPolicy:
    """How a transport waits, decided by its owner (the engine) and read on every wait.

    One policy per connected transport: whoever builds the transport makes it (or lets the
    transport make a fresh one), and every view of that transport (a process set's
    :class:`~hora.backends.group.SubsetTransport`, the shared-memory plane's barriers)
    reads and writes the same object.

    Attributes:
        spin_until: a ``time.monotonic()`` value; until then a transfer waiting for its
            peer retries at once instead of sleeping (a caller spinning for the answer of
            a small collective, a shared-memory barrier).  0.0: always sleep.
        crowded: more ranks than CPUs share this rank's CPUs: a retry first yields the
            CPU (:meth:`spin`), which a peer may need to make the progress waited for.
        blame: ``blame(peers) -> rank or None``: asked, when ``peers`` hung up, which of
            them died first (when one rank dies its survivors exit, so several hang-ups
            arrive at once; the control plane may know the first).  None: the lowest rank.
    """
    spin_until: float = 0.0
    blame: Optional[Callable[[Sequence[int]], Optional[int]]] = None
    crowded: bool = False

    def spin(self, now):
        """Whether a transfer that made no progress at ``now`` retries at once (yielding
        the CPU first where it is crowded) rather than sleeping."""
        if now >= self.spin_until:
            return False
        if self.crowded:
            os.sched_yield()
        return True

    def first_lost(self, peers):
        """The rank to name for ``peers`` that hung up: ``blame``'s answer, else the lowest."""
        named = self.blame(peers) if self.blame is not None else None
        return min(peers) if named is None else named


@runtime_checkable
class Transport(Protocol):
    """Point-to-point byte movement among ``size`` ranks, this one being ``rank``.

    Every call blocks until its transfer is complete or raises (see the module docstring
    for the errors).  A call never waits unbounded: it fails after ``timeout`` seconds
    without progress (a limit each transport takes when it is built), and within about a
    second of any peer's end going away.  Bytes between two ranks arrive in the order they
    were sent; transfers with one peer are made by one thread at a time (``watch`` may
    run in several threads at once).

    Attributes:
        rank, size: this rank and the group's size.
        policy: the :class:`WaitPolicy` read on every wait (shared with every view).
        ring: (optional) the ranks in the order the ring schedules walk them
            (:mod:`hora.backends.ring`); a transport without it walks rank order.
    """
    rank: int
    size: int
    policy: WaitPolicy

    def sendrecv(self, send_peer: Optional[int], send_buf: Optional[memoryview],
                 recv_peer: Optional[int], recv_buf: Optional[memoryview],
                 on_recv: Optional[Callable[[int], None]] = None, step: int = 1 << 18) -> None:
        """Send all of ``send_buf`` to ``send_peer`` while receiving exactly
        ``len(recv_buf)`` bytes from ``recv_peer`` into ``recv_buf``, full duplex.

        Either side may be None or empty (its peer is then ignored).  ``on_recv(n)`` is
        called in this thread each time at least ``step`` more bytes have arrived, and once
        at the end, with the bytes received so far, so the caller can reduce what arrived
        while the rest still flows.  Returns when both sides are done.
        """

    def send(self, peer: int, buf: memoryview) -> None:
        """``sendrecv(peer, buf, None, None)``."""

    def recv(self, peer: int, buf: memoryview, on_recv: Optional[Callable[[int], None]] = None,
             step: int = 1 << 18) -> None:
        """``sendrecv(None, None, peer, buf, on_recv, step)``."""

    def exchange(self, sends: Iterable[Tuple[int, memoryview]],
                 recvs: Iterable[Tuple[int, memoryview]]) -> None:
        """Send and receive with several peers at once, all in flight together.

        ``sends``/``recvs`` are ``(peer, buffer)`` pairs, at most one of each per peer;
        each receive fills its buffer exactly.  For small messages, where a round trip
        costs more than the bytes.  Returns when every transfer is done.
        """

    def watch(self, fds: Iterable[int] = (), timeout: Optional[float] = None,
              sends: Iterable[int] = (), recvs: Iterable[int] = ()) -> set:
        """Wait until one of the file descriptors ``fds`` is readable, something changes on
        the connections of the ``sends``/``recvs`` peers, or ``timeout`` seconds pass
        (None: one slice of at most a second).

        Returns the readable fds among ``fds`` (empty on timeout or when only a
        connection changed).  Raises TransportBrokenError when any peer's end has gone
        away and no fd is ready, so a thread that waits here notices a dead rank even
        while it talks to nobody; TransportClosedError after :meth:`close`.
        """

    def close(self) -> None:
        """End this process's side of every connection (idempotent).  Calls running or
        made afterwards raise TransportClosedError; the peers see this rank's end go away
        (TransportBrokenError naming it).  A view (SubsetTransport) owns no connections:
        closing it does nothing; its parent's close ends it."""


@runtime_checkable
class NetworkTransport(Transport, Protocol):
    """A transport over IP connections, which other planes can meet on."""

    def addresses(self, peer: int) -> Tuple[str, str]:
        """(this end's, the peer's) IP address of the connection to ``peer``."""


@runtime_checkable
class Plane(Protocol):
    """The collectives of one group of ranks on flat, contiguous numpy buffers, in place.

    Every rank of the group calls each collective at the same point with the same dtype,
    op, sizes and root.  Each returns True when it ran the collective, or False when it
    declines it (a dtype or op it lacks, shared memory that could not be had): then it has
    sent nothing and changed nothing, every rank declines alike (they all see the same
    arguments), and the caller runs the collective another way (the ring over the job's
    transport, :class:`~hora.backends.ring.RingPlane`).  Errors are the transport's (a lost
    peer is TransportBrokenError naming it) or HoraInternalError.

    ``reduce_fn`` is one of ``np.add``, ``np.multiply``, ``np.minimum``, ``np.maximum``,
    applied as ``reduce_fn(mine, theirs, out=mine)``.  ``counts`` give the elements of each
    rank's block, in rank order (they may differ, and be zero).  A plane's class attribute
    ``name`` is what the timeline and the metrics call it ("shm", "gloo", ...).
    """

    def allreduce(self, flat, reduce_fn) -> bool:
        """Every rank's ``flat`` becomes the reduction of all of them, with the same bits
        on every rank."""

    def reducescatter(self, flat, counts, reduce_fn) -> bool:
        """Rank r's block of ``flat`` becomes the reduction of every rank's block r; the
        rest of ``flat`` is unspecified afterwards."""

    def allgather(self, out, counts) -> bool:
        """Every rank's block of ``out`` (filled in by its owner) is copied to every rank."""

    def broadcast(self, flat, root: int) -> bool:
        """Every rank's ``flat`` becomes ``root``'s."""

    def alltoall(self, send, send_counts, recv, recv_counts) -> bool:
        """Block p of ``send`` (``send_counts``) goes to rank p; rank p's block for this rank
        lands in block p of ``recv`` (``recv_counts``).  Counts differ per rank."""

    def close(self) -> None:
        """Release what the plane holds (local; every rank has passed its last
        collective).  The transport it was built on stays open: its owner closes it."""
