"""Forming the job at init(): rendezvous, then the first authenticated connections.

Every rank binds a listener, registers ``(address, port, hostname, local_rank, token)`` in
the rendezvous store, and reads everybody else's.  Rank r then connects to its ring
neighbours (:mod:`hora.core.links`: the higher rank of a pair dials, the lower accepts; any
other pair connects when a collective first needs it) and, unless it is rank 0, opens its
control connection: to rank 0, or in a job on several hosts to its host's leader, which
alone connects to rank 0, or in a job of many hosts to a leader above it (a tree:
:func:`hora.core.links.ctrl_parents`).  Rank 0 only accepts.
Each connection opens with the HMAC handshake under the *mesh key*, ``HMAC(job key, every
rank's token)``: the tokens are fresh random values each rank makes at init, so only a
process that took part in the rendezvous can connect, even where the job key itself is
derivable.  A connection that fails the handshake, or claims a rank that is not expected or
already connected, is logged and dropped, and the job carries on.

A rank that dies in init() is named, not waited for until HORA_START_TIMEOUT: a rank whose
dial to it is refused leaves a note in the store (``dead/<r>``), and every rank leaves its
own as a *will* the store writes should its connection close before the rank has made its
first connections (withdrawn once it has): that tells the ranks waiting for its dial,
whom no refusal would reach.

Trust.  The job key is a real secret under ``hora run``, mpirun, HORA_SECRET/HORA_SECRET_FILE
and the per-user secret (:mod:`hora.core.topology`).  Otherwise it is derivable from public
job values (``Placement.secret_is_real`` is False): rank 0 says so in one log line, and its
rendezvous server runs under a :class:`~hora.rendezvous.policy.SlotPolicy`: a client must
claim one rank's slot (write-once) before it may read anything, and can store nothing else.
A slot claimed twice means a process outside the job has the key and may hold a rank's
place: the store stops, so that every rank still in init() fails with the reason (naming
the slot and both claimants), and once the job runs, rank 0's engine ends it the same way.
Every control frame, in either case, is decoded as plain data only.  Rank 0's rendezvous
binds the address the job meets at when it is this host's, not every interface.

Layer: core.
"""
import dataclasses
import hashlib
import hmac
import logging
import os
import re
import socket
import time

from ..backends.base import WaitPolicy
from ..backends.tcp import TcpTransport
from ..errors import (AuthenticationError, HoraError, HoraRankFailedError,
                      RendezvousTimeoutError, TransportBrokenError)
from ..rendezvous import RendezvousClient, RendezvousServer, connect_with_retry
from ..rendezvous.host import open_files
from ..rendezvous.netif import interface_address, routable_addresses
from ..rendezvous.policy import SlotPolicy
from ..rendezvous.protocol import client_handshake, new_secret, secret_key
from . import membership
from .links import (RANK as _RANK, Links, ctrl_children, ctrl_parent, eager_peers,
                    ring_order)
from .topology import Topology, build_topology, cpu_identity

__all__ = ["Ctrl", "Job", "form_job"]

log = logging.getLogger(__name__)

_SLICE_S = 0.5           # how often a rank waiting for connections looks for news of a death
_TOKEN_BYTES = 32
_FILES_BESIDE = 256      # a rank's open files beside its connections: the user's, its loaders'
_CPU_ID = re.compile(r"([0-9a-f-]{1,64}/[0-9a-f]{1,1024})?")   # topology.cpu_identity()
# Per process, never reset by init(): each job's rendezvous keys carry its own generation,
# since a launcher's store outlives a job and a second init() must not read the first one's
# registrations; and the derivable-key line is a note about the process's setup, said once.
_generation = 0          # how many times this process has called init()
_told_trust = False      # the derivable-key line has been said


@dataclasses.dataclass
class Ctrl:
    """A rank's control connections (:func:`hora.core.links.ctrl_parent`): ``up`` to rank
    ``parent`` (None on rank 0), and ``down``, ``{rank: socket}`` of the ranks whose control
    connections come to this one (every rank's on a one-host job's rank 0; a host's other
    ranks and the leaders below it on a leader; none on the others)."""
    parent: object
    up: object
    down: dict


@dataclasses.dataclass
class Job:
    """What init() leaves behind: the shape of the job and its open connections.

    ``policy`` is the transport's :class:`~hora.backends.base.WaitPolicy` (the same object
    as ``transport.policy``), for the engine to set: how its waits spin, whom they blame.
    """
    topology: Topology
    transport: TcpTransport
    ctrl: Ctrl
    server: RendezvousServer = None
    client: RendezvousClient = None
    policy: WaitPolicy = None

    def close(self):
        self.transport.close()          # (idempotent: the engine closes it first)
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
        policy = WaitPolicy()
        return Job(topo, TcpTransport(0, 1, {}, settings.transport_timeout, policy),
                   Ctrl(None, None, {}), policy=policy)
    # at most: the rendezvous's connections (rank 0 may serve it), control connections from
    # every rank (rank 0 of a one-host job), data connections to every rank (an alltoall)
    open_files(3 * size + _FILES_BESIDE)
    deadline = time.monotonic() + settings.start_timeout
    addr, port, secret, server = _rendezvous_endpoint(placement, settings)
    try:
        client = RendezvousClient(addr, port, secret, timeout=settings.start_timeout)
    except AuthenticationError as e:
        if server is not None:
            server.stop()
        raise AuthenticationError(
            f"rank {placement.rank}: the rendezvous at {addr}:{port} does not share this "
            f"rank's job key ({placement.secret_note or 'from its launcher'}): {e}.  Every "
            f"rank must have the same HORA_SECRET / HORA_SECRET_FILE, or see the same home "
            f"directory") from e
    except BaseException:
        if server is not None:
            server.stop()
        raise
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
    _tell_trust(placement)
    server = None
    if placement.serve_rendezvous and placement.rank == 0:
        policy = None if placement.secret_is_real else SlotPolicy(
            placement.size, f"{_keys(placement)}rank/", f"{_keys(placement)}dead/",
            _entry_problem)
        try:
            server = RendezvousServer(placement.secret, host=_serving_address(placement),
                                      port=placement.rendezvous_port, policy=policy).start()
        except OSError as e:
            raise HoraError(f"rank 0 could not serve the rendezvous on port "
                            f"{placement.rendezvous_port}: {e}; set HORA_RENDEZVOUS_PORT") from e
    return placement.rendezvous_addr, placement.rendezvous_port, placement.secret, server


def _keys(placement):
    """The prefix of this job's keys in the store: the elastic round it forms, else this
    process's count of init() calls (a launcher's store outlives one job of a process)."""
    return f"init{_generation}/" if placement.round is None else f"round{placement.round}/"


def _superseded_check(placement, client):
    """In an elastic job, a function that raises JobSupersededError once the launcher has
    formed a newer round than the one this process is joining (a member died, or workers
    came): the ranks joining it would otherwise wait for members that went elsewhere."""
    if placement.round is None:
        return lambda: None

    def check():
        newer = membership.newer_round(client)
        if newer is not None:
            raise membership.JobSupersededError(
                f"rank {placement.rank}: the launcher formed job round {newer} while this "
                f"worker was joining round {placement.round}")
    return check


def _tell_trust(placement):
    """Rank 0 says once whether the job key is a secret (INFO) or derivable (WARNING)."""
    global _told_trust
    if placement.rank != 0 or _told_trust:
        return
    _told_trust = True
    if placement.secret_is_real:
        log.info("rank 0: the job key comes from %s", placement.secret_note or "the launcher")
        return
    log.warning(
        "hora: no job secret under %s (%s): the job key is derived from the job's public "
        "identity, so anyone who can reach %s:%s could compute it; the control plane takes "
        "plain data only and each rank's slot goes to the first process that claims it.  "
        "For a real secret set HORA_SECRET (the same text on every rank) or HORA_SECRET_FILE "
        "(a file of mode 0600)", placement.source, placement.secret_note,
        placement.rendezvous_addr, placement.rendezvous_port)


def _serving_address(placement):
    """The address rank 0's rendezvous binds: the one the job meets at, when it is this
    host's (a loopback address only when every rank is on this host), else every
    interface, with a log line."""
    addr = placement.rendezvous_addr
    try:
        ips = list(dict.fromkeys(
            info[4][0] for info in socket.getaddrinfo(addr, None, socket.AF_INET,
                                                      socket.SOCK_STREAM)))
    except OSError as e:
        log.warning("rank 0: cannot resolve the rendezvous address %r (%s); serving it on "
                    "every interface", addr, e)
        return "0.0.0.0"
    for ip in ips:
        if ip.startswith("127.") and placement.local_size != placement.size:
            continue                    # the other hosts cannot reach our loopback
        if _is_local(ip):
            return ip
    log.warning("rank 0: the rendezvous address %s (%s) is not one this host can serve the "
                "other ranks at; serving it on every interface", addr, ", ".join(ips))
    return "0.0.0.0"


def _is_local(ip):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def _entry_problem(rank, entry):
    """Why ``entry`` is not a rank's registration ``(address, port, hostname, local_rank,
    token, cpus)``, or None.  The store's schema under a derivable key, and what every rank
    checks of what it reads."""
    if type(entry) is not tuple or len(entry) != 6:
        return (f"expected (address, port, hostname, local_rank, token, cpus), "
                f"got {entry!r:.100}")
    addr, port, host, local_rank, token, cpus = entry
    if type(addr) is not str or not 0 < len(addr) <= 255:
        return f"bad address {addr!r:.100}"
    if type(port) is not int or not 0 < port < 65536:
        return f"bad port {port!r:.100}"
    if type(host) is not str or len(host) > 255:
        return f"bad hostname {host!r:.100}"
    if type(local_rank) is not int or local_rank < 0:
        return f"bad local rank {local_rank!r:.100}"
    if (type(token) is not str or len(token) != 2 * _TOKEN_BYTES
            or not all(c in "0123456789abcdef" for c in token)):
        return f"bad token {token!r:.100}"
    if type(cpus) is not str or not _CPU_ID.fullmatch(cpus):
        return f"bad cpu identity {cpus!r:.100}"
    return None


def _mesh_secret(secret, entries):
    """The key of the job's own connections: the job key and every rank's fresh token."""
    tokens = "".join(e[4] for e in entries).encode()
    return hmac.new(secret_key(secret), b"hora mesh|" + tokens, hashlib.sha256).hexdigest()


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
              placement.local_rank, os.urandom(_TOKEN_BYTES).hex(), cpu_identity())
        prefix = f"{_keys(placement)}rank/"
        superseded = _superseded_check(placement, client)
        client.put(f"{prefix}{rank}", me)
        # should this process end before its connections are made, the store tells the
        # ranks that wait for it (the will is withdrawn once they are made)
        client.will(f"{_keys(placement)}dead/{rank}",
                    f"rank {rank} registered, then its connection to the rendezvous store "
                    f"closed before it had connected to its peers: the process exited, was "
                    f"killed or gave up")
        while True:
            left = max(0.0, deadline - time.monotonic())
            complete, found = client.wait_prefix(
                prefix, size, left if placement.round is None else min(left, _SLICE_S))
            if complete or left <= 0:
                break
            superseded()
        entries = [found.get(f"{prefix}{r}") for r in range(size)]
        if not complete or None in entries:
            missing = [r for r in range(size) if entries[r] is None]
            raise RendezvousTimeoutError(
                f"rank {rank}: ranks {missing} never arrived at hora.init() within "
                f"{settings.start_timeout:g} s (HORA_START_TIMEOUT)")
        for r, entry in enumerate(entries):
            problem = _entry_problem(r, entry)
            if problem is not None:
                raise HoraError(f"rank {rank}: the rendezvous holds a malformed registration "
                                f"for rank {r}: {problem}")
        mesh = _mesh_secret(secret, entries)
        hosts = tuple(e[2] for e in entries)
        ring = ring_order(hosts)
        links = Links(listener, mesh, rank, size,
                      lambda peer, purpose, until: _dial(entries[peer], mesh, purpose, rank,
                                                         peer, until),
                      ctrl_children(rank, hosts, settings.control_fanout),
                      share=len(set(hosts)) > 1)
        listener = None                 # the links own it now
        try:
            data, ctrl = _first_connections(placement, settings, client, links, hosts,
                                            ring, deadline)
        except BaseException:
            links.close()
            raise
    finally:
        if listener is not None:
            listener.close()
    topo = build_topology(rank, [(e[2], e[3]) for e in entries], [e[5] for e in entries])
    policy = WaitPolicy(crowded=topo.crowded)
    transport = TcpTransport(rank, size, data, settings.transport_timeout, policy, links,
                             ring)
    return Job(topo, transport, ctrl, server, client, policy)


def _first_connections(placement, settings, client, links, hosts, ring, deadline):
    """The connections a rank opens at init: to its neighbours on the job's ``ring``
    (:func:`.links.eager_peers`; the higher rank of a pair dials) and the control connections
    (:func:`.links.ctrl_parent`; every rank's but rank 0's to its parent, a lower rank);
    in a job on several hosts, a parent that is also a ring neighbour gets one connection,
    for both (:mod:`hora.backends.mux`).  Returns ``(data, ctrl)``: ``{peer: socket}``, and the
    :class:`Ctrl`."""
    rank = placement.rank
    neighbours = eager_peers(rank, ring)
    parent = ctrl_parent(rank, hosts, settings.control_fanout)
    children = ctrl_children(rank, hosts, settings.control_fanout)
    # ring neighbours that are also a rank and its parent: one connection, for both (a job
    # on several hosts, as links.Links shares them)
    both = (set(neighbours) & {parent, *children}) if links.share else set()
    data, ctrl, ctrl_in = {}, None, {}
    # a rank that finds a registered peer dead says so in the store, so that the ranks
    # waiting for that peer to connect fail at once instead of at the start timeout
    dead = f"{_keys(placement)}dead/"
    superseded = _superseded_check(placement, client)
    try:
        try:
            for peer in neighbours:
                if peer < rank and peer not in both:
                    data[peer] = links.dial(peer, b"data", deadline)
            if parent is not None:
                up = links.dial(parent, b"both" if parent in both else b"ctrl", deadline)
                if parent in both:
                    data[parent] = up.data
                ctrl = getattr(up, "ctrl", up)
        except HoraRankFailedError as e:
            try:
                client.put(f"{dead}{e.rank}", str(e))
            except HoraError:
                pass
            raise
        awaited = [(b"data", p) for p in neighbours if p > rank and p not in both]
        awaited += [(b"both" if p in both else b"ctrl", p) for p in children]
        while awaited:
            purpose, peer = awaited[0]
            if _took(links, purpose, peer, data, ctrl_in,
                     max(0.0, min(_SLICE_S, deadline - time.monotonic()))):
                awaited.pop(0)
                continue
            _check_deaths(client, dead, rank)
            superseded()
            if time.monotonic() >= deadline:
                missing = sorted({p for purpose, p in awaited
                                  if not _took(links, purpose, p, data, ctrl_in)})
                raise RendezvousTimeoutError(
                    f"rank {rank}: ranks {missing} did not connect within "
                    f"{settings.start_timeout:g} s (HORA_START_TIMEOUT); they may have "
                    f"died during hora.init()")
        # a last look: a store that stopped while the job formed fails init() here
        _check_deaths(client, dead, rank)
        client.will(None, None)
    except BaseException as e:
        for sock in (*data.values(), *ctrl_in.values(), *([ctrl] if ctrl else [])):
            sock.close()            # (a shared connection's two sides: closed twice)
        if isinstance(e, HoraRankFailedError):
            _withdraw_will(client)      # a peer died, not this process: name only the peer
        raise
    return data, Ctrl(parent, ctrl, ctrl_in)


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
        sock.sendall(_RANK.pack(rank))
    except (TransportBrokenError, AuthenticationError, OSError) as e:
        sock.close()
        if isinstance(e, AuthenticationError) and not isinstance(e.__cause__,
                                                                 TransportBrokenError):
            raise
        # reset or closed (after it proved it has the mesh key: it did not refuse us, its
        # process ended as we connected)
        raise HoraRankFailedError(
            f"rank {rank}: rank {peer} dropped our connection ({e}): the process exited, was "
            f"killed or gave up", rank=peer) from e
    return sock


def _took(links, purpose, peer, data, ctrl_in, wait_s=0.0):
    """Take ``peer``'s ``purpose`` connection if it comes within ``wait_s`` (into ``data``
    or ``ctrl_in``); whether it did."""
    sock = links.take(purpose, peer, wait_s)
    if sock is None:
        return False
    if purpose == b"data":
        data[peer] = sock
        return True
    if purpose == b"both":
        data[peer] = sock.data
    ctrl_in[peer] = getattr(sock, "ctrl", sock)
    return True


def _withdraw_will(client):
    try:
        client.will(None, None)
    except HoraError:
        pass


def _check_deaths(client, prefix, rank):
    """Raise HoraRankFailedError if another rank reported a peer dead during init."""
    _, found = client.wait_prefix(prefix, 1, 0.0)
    for key, message in sorted(found.items()):
        peer = int(key[len(prefix):])
        raise HoraRankFailedError(f"rank {rank}: during hora.init(), {message}", rank=peer)
