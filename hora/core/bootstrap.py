"""Forming the job at init(): rendezvous, then one authenticated connection per pair of ranks.

Every rank binds a listener, registers ``(address, port, hostname, local_rank)`` in the
rendezvous store, and reads everybody else's.  Rank r then connects to every lower rank (and,
unless it is rank 0, opens a control connection to rank 0) and accepts from every higher rank.
Rank 0 only accepts, so the connection order has no cycle.  Each connection opens with the
HMAC handshake; a connection that fails it is logged and dropped, and the job carries on.

Layer: core.
"""
import dataclasses
import logging
import queue
import select
import socket
import struct
import threading
import time

from ..backends.tcp import TcpTransport
from ..errors import (AuthenticationError, HoraError, HoraRankFailedError,
                      RendezvousTimeoutError, TransportBrokenError)
from ..rendezvous import RendezvousClient, RendezvousServer, connect_with_retry
from ..rendezvous.netif import interface_address, routable_addresses
from ..rendezvous.protocol import client_handshake, new_secret, recv_exact, server_handshake
from .topology import Topology, build_topology

__all__ = ["Job", "form_job"]

log = logging.getLogger(__name__)

_RANK = struct.Struct("!I")
_SLICE_S = 0.5           # how often a rank waiting for connections looks for news of a death
_generation = 0          # how many times this process has called init(); keys stay fresh


@dataclasses.dataclass
class Job:
    """What init() leaves behind: the shape of the job and its open connections."""
    topology: Topology
    transport: TcpTransport
    ctrl: object                   # rank 0: {rank: socket}; others: socket to rank 0
    server: RendezvousServer = None
    client: RendezvousClient = None

    def close(self):
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()


def form_job(placement, settings):
    """Connect this process to the rest of its job (see module docstring)."""
    global _generation
    _generation += 1
    size = placement.size
    if size == 1:
        topo = Topology(0, 1, 0, 1, 0, 1, True, (placement.hostname,))
        return Job(topo, TcpTransport(0, 1, {}, settings.transport_timeout), {})
    deadline = time.monotonic() + settings.start_timeout
    addr, port, secret, server = _rendezvous_endpoint(placement, settings)
    client = RendezvousClient(addr, port, secret, timeout=settings.start_timeout)
    try:
        return _connect_mesh(placement, settings, client, server, secret, deadline)
    except BaseException:
        client.close()
        if server is not None:
            server.stop()
        raise


def _rendezvous_endpoint(placement, settings):
    """(addr, port, secret, server-or-None) of the store this job meets at."""
    if placement.source == "mpirun":
        return _mpi_endpoint(placement, settings)
    if placement.secret is None:
        raise HoraError("no job secret: start the job with `hora run`, or set HORA_SECRET")
    server = None
    if placement.serve_rendezvous and placement.rank == 0:
        try:
            server = RendezvousServer(placement.secret, host="0.0.0.0",
                                      port=placement.rendezvous_port).start()
        except OSError as e:
            raise HoraError(f"rank 0 could not serve the rendezvous on port "
                            f"{placement.rendezvous_port}: {e}; set HORA_RENDEZVOUS_PORT") from e
    return placement.rendezvous_addr, placement.rendezvous_port, placement.secret, server


def _mpi_endpoint(placement, settings):
    """Under mpirun there is no launcher: rank 0 serves the rendezvous and tells the others
    where (its addresses, port and a fresh secret) through MPI itself, as Horovod's MPI
    controller does; each rank then takes the first of those addresses it can reach."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise HoraError("under mpirun hora exchanges its addresses through MPI and needs "
                        "mpi4py: pip install 'hora[mpi]' (or launch with `hora run`)") from e
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (placement.rank, placement.size):
        raise HoraError(f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()}, Open MPI's "
                        f"environment says {placement.rank} of {placement.size}")
    server = info = None
    if comm.Get_rank() == 0:
        try:
            secret = placement.secret or new_secret()
            server = RendezvousServer(secret, host="0.0.0.0",
                                      port=placement.rendezvous_port or 0).start()
            addrs = routable_addresses(settings.iface)
            if placement.local_size == placement.size:      # one host: stay on loopback
                addrs.insert(0, "127.0.0.1")
            info = (addrs, server.port, secret)
        except OSError as e:
            info = e                       # every rank must leave the bcast, then fail
    info = comm.bcast(info, root=0)
    if isinstance(info, OSError):
        if server is not None:
            server.stop()
        raise HoraError(f"rank 0 could not serve the rendezvous: {info}")
    addrs, port, secret = info
    deadline = time.monotonic() + min(settings.start_timeout, 10.0)
    for addr in addrs:
        try:       # a full client, not a bare connect: the server logs half-open probes
            RendezvousClient(addr, port, secret,
                             timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return addr, port, secret, server
        except (OSError, HoraError):
            continue
    if server is not None:
        server.stop()
    raise HoraError(f"rank {placement.rank} on {placement.hostname} reaches none of rank 0's "
                    f"addresses {addrs} (port {port}); set HORA_IFACE to the interface to use")


def _bind_address(settings, client):
    if settings.iface:
        # an interface name, else an address
        return interface_address(settings.iface) or settings.iface
    return client.local_address


def _connect_mesh(placement, settings, client, server, secret, deadline):
    rank, size = placement.rank, placement.size
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((_bind_address(settings, client), 0))
        listener.listen(size * 2 + 8)
        me = (listener.getsockname()[0], listener.getsockname()[1], placement.hostname,
              placement.local_rank)
        prefix = f"init{_generation}/rank/"
        client.put(f"{prefix}{rank}", me)
        complete, found = client.wait_prefix(prefix, size, max(0.0, deadline - time.monotonic()))
        if not complete:
            arrived = {int(k[len(prefix):]) for k in found}
            missing = sorted(set(range(size)) - arrived)
            raise RendezvousTimeoutError(
                f"rank {rank}: ranks {missing} never arrived at hora.init() within "
                f"{settings.start_timeout:g} s (HORA_START_TIMEOUT)")
        entries = [found[f"{prefix}{r}"] for r in range(size)]
        data, ctrl = {}, None
        # a rank that finds a registered peer dead says so in the store, so that the ranks
        # waiting for that peer to connect fail at once instead of at the start timeout
        dead = f"init{_generation}/dead/"
        try:
            for peer in range(rank):
                data[peer] = _dial(entries[peer], secret, b"data", rank, peer, deadline)
            if rank != 0:
                ctrl = _dial(entries[0], secret, b"ctrl", rank, 0, deadline)
        except HoraRankFailedError as e:
            try:
                client.put(f"{dead}{e.rank}", str(e))
            except HoraError:
                pass
            raise
        want_data = size - 1 - rank
        want_ctrl = size - 1 if rank == 0 else 0
        ctrl_in = {}
        acceptor = _Acceptor(listener, secret, rank, deadline)
        try:
            while len(data) < rank + want_data or len(ctrl_in) < want_ctrl:
                got = acceptor.next(time.monotonic() + _SLICE_S)
                if got is not None:
                    purpose, peer, sock = got
                    (data if purpose == b"data" else ctrl_in)[peer] = sock
                    continue
                _check_deaths(client, dead, rank)
                if time.monotonic() >= deadline:
                    missing = set(range(rank + 1, size)) - set(data)
                    if rank == 0:
                        missing |= set(range(1, size)) - set(ctrl_in)
                    raise RendezvousTimeoutError(
                        f"rank {rank}: ranks {sorted(missing)} did not connect within "
                        f"{settings.start_timeout:g} s (HORA_START_TIMEOUT); they may have "
                        f"died during hora.init()")
        except BaseException:
            for sock in (*data.values(), *ctrl_in.values()):
                sock.close()
            raise
        finally:
            acceptor.close()
    finally:
        listener.close()
    topo = build_topology(rank, [(e[2], e[3]) for e in entries])
    transport = TcpTransport(rank, size, data, settings.transport_timeout)
    return Job(topo, transport, ctrl_in if rank == 0 else ctrl, server, client)


def _dial(entry, secret, purpose, rank, peer, deadline):
    try:
        sock = socket.create_connection((entry[0], entry[1]),
                                        timeout=max(0.5, min(5.0, deadline - time.monotonic())))
    except ConnectionRefusedError as e:
        # its listener was open before it registered: a refusal means the process is gone
        raise HoraRankFailedError(
            f"rank {rank}: rank {peer} registered at hora.init() but its listener at "
            f"{entry[0]}:{entry[1]} refuses connections: the process exited, was killed or gave up "
            f"during init", rank=peer) from e
    except OSError:
        sock = connect_with_retry(entry[0], entry[1], deadline,
                                  f"rank {peer} at {entry[0]}:{entry[1]}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(max(1.0, deadline - time.monotonic()))
    try:
        client_handshake(sock, secret, purpose)
    except TransportBrokenError as e:       # reset or closed: it died as we connected
        sock.close()
        raise HoraRankFailedError(
            f"rank {rank}: rank {peer} dropped our connection during hora.init() ({e}): the "
            f"process exited, was killed or gave up", rank=peer) from e
    sock.sendall(_RANK.pack(rank))
    return sock


def _check_deaths(client, prefix, rank):
    """Raise HoraRankFailedError if another rank reported a peer dead during init."""
    _, found = client.wait_prefix(prefix, 1, 0.0)
    for key, message in sorted(found.items()):
        peer = int(key[len(prefix):])
        raise HoraRankFailedError(f"rank {rank}: during hora.init(), {message}", rank=peer)


class _Acceptor:
    """Accepts connections on ``listener`` and runs each one's handshake in a thread of its
    own, so that a connection that opens and then says nothing (a port scanner, a stalled
    peer) delays nobody: the handshakes of the real ranks complete beside it."""

    _MAX_IN_FLIGHT = 64         # beyond this, connections wait in the listen backlog

    def __init__(self, listener, secret, rank, deadline):
        self._listener, self._secret, self._rank = listener, secret, rank
        listener.setblocking(False)
        self._deadline = deadline
        self._done = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = set()         # sockets whose handshake runs now
        self._closed = False

    def next(self, wait_until):
        """One authenticated ``(purpose, peer, socket)``, or None if none came by
        ``wait_until`` (connections that fail the handshake are logged and dropped)."""
        while True:
            try:
                return self._done.get_nowait()
            except queue.Empty:
                pass
            left = min(wait_until, self._deadline) - time.monotonic()
            if left <= 0:
                return None
            with self._lock:
                busy = len(self._in_flight)
            # with handshakes running, look at their results often; else wait on the listener
            wait = min(left, 0.01) if busy else left
            if busy >= self._MAX_IN_FLIGHT:
                try:
                    return self._done.get(timeout=wait)
                except queue.Empty:
                    continue
            ready, _, _ = select.select([self._listener], [], [], wait)
            if ready:
                self._accept_one()

    def _accept_one(self):
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        with self._lock:
            self._in_flight.add(sock)
        threading.Thread(target=self._handshake, args=(sock, addr), daemon=True,
                         name="hora-init-handshake").start()

    def _handshake(self, sock, addr):
        sock.settimeout(min(5.0, max(0.5, self._deadline - time.monotonic())))
        try:
            purpose = server_handshake(sock, self._secret, (b"data", b"ctrl"))
            (peer,) = _RANK.unpack(recv_exact(sock, _RANK.size, "peer"))
        except (AuthenticationError, TransportBrokenError, OSError) as e:
            with self._lock:
                self._in_flight.discard(sock)
                closed = self._closed
            if not closed:
                log.warning("rank %d: refused a connection from %s: %s", self._rank, addr[0], e)
            sock.close()
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._in_flight.discard(sock)
            if self._closed:            # init is over (or failed): nobody takes it
                sock.close()
                return
        self._done.put((purpose, peer, sock))

    def close(self):
        """Stop: handshakes still running are cut off, authenticated sockets nobody took
        are closed."""
        with self._lock:
            self._closed = True
            for sock in self._in_flight:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        while True:
            try:
                self._done.get_nowait()[2].close()
            except queue.Empty:
                break
