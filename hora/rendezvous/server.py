"""The rendezvous server: a small authenticated key-value store.

The launcher (``hora run``) serves one per job; without a launcher, rank 0 serves it.  Workers
register their data-plane addresses under ``init<g>/rank/<r>`` and read each other's.

One thread runs every unauthenticated connection through the HMAC handshake at once
(:mod:`hora.rendezvous.gate`): a connection that does not prove itself within
``handshake_timeout`` seconds is dropped with a log line and the store is untouched, and
connections that open and say nothing hold nobody back.  Each authenticated connection then
gets a thread of its own.  Frames are decoded as plain data only
(:mod:`hora.rendezvous.safepickle`); one that is not is refused, logged, and its connection
dropped.

With a ``policy`` (a :class:`~hora.rendezvous.policy.SlotPolicy`: the job's key is derivable
from public values) a connection's first request, read by the same thread before any is
spawned, must claim a rank slot, and only the requests the policy allows are served.  A
second claim of a slot is proof that a process outside the job holds the key (one of the two
claimants is not the rank): the store *stops*, answering every request with the reason from
then on, and tells whoever asked (:meth:`RendezvousServer.on_conflict`: rank 0's engine,
once the job runs), so that the job ends on every rank instead of running with a stranger.

Requests (tuples of plain data, authenticated connections only):
    ("put", key, value)                   -> ("ok",)
    ("get", key, timeout_s)               -> ("ok", value) | ("timeout",)
    ("wait_prefix", prefix, n, timeout_s) -> ("ok", {key: value}) | ("timeout", {key: value})
    ("delete", key)                       -> ("ok",)
    ("will", key, value)                  -> ("ok",)  (key None: no will)
    anything refused                      -> ("error", reason), then the connection is closed
    anything, once the store stopped      -> ("stopped", reason), then the connection is closed

A *will* is a put the server makes for a client when its connection closes, unless the
client withdrew it first (the last one set counts; the first value of a key wins, as for a
note): how a rank that is killed during ``hora.init()`` tells the ranks that wait for it.
"""
import logging
import socket
import threading
import time

from ..errors import TransportBrokenError
from .gate import HandshakeGate
from .policy import StoreRequestRefused
from .protocol import MAX_FRAME, recv_obj, send_obj
from .safepickle import PayloadRefusedError, safe_loads

__all__ = ["RendezvousServer", "PURPOSE"]

log = logging.getLogger(__name__)

PURPOSE = b"rdzv"
_LOOK_S = 1.0           # the gate thread's longest sleep; stop() wakes it at once
_REPLY_S = 5.0          # a reply a client does not take in this long drops it
# a stopped store (a slot claimed twice) still answers this long at stop(), until its
# clients are gone: ranks in init() look every half second, and should hear why it stopped
_LINGER_S = 2.0
# what serving a request of the wrong shape or types raises (a short tuple, an unhashable
# key, a timeout that is not a number or too large for a float)
_MALFORMED = (ValueError, TypeError, IndexError, OverflowError)


class RendezvousServer:
    """A threaded key-value server.  ``start()`` binds and serves in the background.

    Args:
        secret: the job secret (hex text or bytes).
        host: address to bind ("0.0.0.0" for every interface).
        port: port to bind (0 picks a free one).
        handshake_timeout: seconds an unauthenticated client may take to prove itself.
        policy: None (the key is a real secret: every request is served), or a
            :class:`~hora.rendezvous.policy.SlotPolicy` (the key is derivable).
    """

    def __init__(self, secret, host="127.0.0.1", port=0, handshake_timeout=5.0, policy=None):
        self._secret = secret
        self._bind = (host, port)
        self._handshake_timeout = handshake_timeout
        self._policy = policy
        self._store = {}
        self._cond = threading.Condition()
        self._sock = None
        self._gate = None
        self._thread = None
        self._closed = threading.Event()
        self._conns = set()        # authenticated connections being served
        self._claimants = {}       # slot key -> (address, port) of the process holding it
        self._stopped = None       # why the store stopped (a slot claimed twice), or None
        self._conflict_hooks = []
        self.rejected = 0          # connections refused at the handshake (for tests)
        self.refused = 0           # requests refused by the policy or the decoder (for tests)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(self._bind)
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._gate = HandshakeGate(
            sock, self._secret, (PURPOSE,), self._handshake_timeout,
            frame_limit=None if self._policy is None else self._policy.frame_limit,
            on_refuse=self._refused_connection)
        self._thread = threading.Thread(target=self._gate_loop, name="hora-rendezvous",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def port(self):
        return self._sock.getsockname()[1]

    @property
    def address(self):
        """The address the server is bound to."""
        return self._sock.getsockname()[0]

    def stop(self):
        if self._stopped is not None:
            deadline = time.monotonic() + _LINGER_S
            with self._cond:
                while self._conns and time.monotonic() < deadline:
                    self._cond.wait(0.05)
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
            conns = list(self._conns)
        for conn in conns:              # wakes the threads blocked reading a request
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._gate is not None:
            self._gate.wake()
        if self._thread is not None:
            self._thread.join(timeout=2.0)      # the thread closes the gate on its way out
        if self._sock is not None:
            self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def conflict(self):
        """Why the store stopped (a rank slot was claimed twice), or None."""
        return self._stopped

    def on_conflict(self, hook):
        """Call ``hook(reason)`` when a rank slot is claimed twice (from the server's thread;
        it must not block), or at once, here, if that has happened already."""
        with self._cond:
            reason = self._stopped
            if reason is None:
                self._conflict_hooks.append(hook)
        if reason is not None:
            hook(reason)

    # -- in-process access (the launcher) -------------------------------------------------
    def put(self, key, value):
        with self._cond:
            self._store[key] = value
            self._cond.notify_all()

    def get(self, key, default=None):
        with self._cond:
            return self._store.get(key, default)

    def items(self, prefix=""):
        with self._cond:
            return {k: v for k, v in self._store.items() if k.startswith(prefix)}

    def wait(self, key, timeout):
        """Block until ``key`` exists (or ``timeout`` seconds); return (found, value)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (key not in self._store and not self._closed.is_set()
                   and self._stopped is None):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, None
                self._cond.wait(min(left, 0.5))
            return key in self._store, self._store.get(key)

    def _wait_prefix(self, prefix, n, timeout):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = {k: v for k, v in self._store.items() if k.startswith(prefix)}
                if len(found) >= n:
                    return True, found
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set() or self._stopped is not None:
                    return False, found
                self._cond.wait(min(left, 0.5))

    # -- serving --------------------------------------------------------------------------
    def _gate_loop(self):
        while not self._closed.is_set():
            try:
                admitted = self._gate.poll(_LOOK_S)
            except OSError as e:            # the listener itself failed: nothing to serve
                if not self._closed.is_set():
                    log.error("rendezvous: stopped accepting connections: %s", e)
                return
            for adm in admitted:
                if self._closed.is_set():
                    adm.sock.close()
                elif self._policy is None:
                    self._spawn(adm.sock, adm.addr)
                else:
                    self._admit_claim(adm)
        self._gate.close()

    def _refused_connection(self, addr, reason):
        self.rejected += 1
        log.warning("rendezvous: refused connection from %s:%s: %s", addr[0], addr[1], reason)

    def _spawn(self, conn, peer):
        with self._cond:
            self._conns.add(conn)
        threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                         name="hora-rendezvous-conn").start()

    def _admit_claim(self, adm):
        """A derivable key: the first request (read by the gate) must claim a rank slot."""
        conn, peer = adm.sock, adm.addr
        conn.settimeout(_REPLY_S)
        try:
            key, value = self._policy.claim(safe_loads(adm.trailer))
        except (PayloadRefusedError, StoreRequestRefused) as e:
            self._refuse(conn, peer, e)
            return
        hooks = None
        with self._cond:
            refusal = self._stopped
            if refusal is None and key in self._store:
                refusal = self._stopped = _conflict_reason(
                    key, self._policy.slot_prefix, self._claimants.get(key), peer)
                hooks, self._conflict_hooks = self._conflict_hooks, []
                self._cond.notify_all()             # every wait ends, with the reason
            elif refusal is None:
                self._store[key] = value
                self._claimants[key] = peer[:2]
                self._cond.notify_all()
        if hooks is not None:
            self._tell_conflict(refusal, hooks)
        if refusal is not None:
            self._refuse(conn, peer, StoreRequestRefused(refusal))
            return
        try:
            send_obj(conn, ("ok",))
        except OSError:
            conn.close()
            return
        conn.settimeout(None)
        self._spawn(conn, peer)

    def _tell_conflict(self, reason, hooks):
        log.error("rendezvous: %s", reason)
        for hook in hooks:
            try:
                hook(reason)
            except Exception:  # noqa: BLE001 - the store has stopped all the same
                log.error("rendezvous: a conflict hook failed", exc_info=True)

    def _refuse(self, conn, peer, error):
        """Answer a refused request with its reason, log it, drop the connection."""
        self.refused += 1
        log.warning("rendezvous: refused a request from %s:%s and dropped it: %s",
                    peer[0], peer[1], error)
        try:
            conn.settimeout(1.0)
            send_obj(conn, ("error", str(error)))
        except OSError:
            pass
        conn.close()

    def _serve(self, conn, peer):
        limit = MAX_FRAME if self._policy is None else self._policy.frame_limit
        will = [None]           # (key, value) put when this connection closes
        try:
            while not self._closed.is_set():
                try:
                    request = recv_obj(conn, "rendezvous client", max_len=limit)
                except PayloadRefusedError as e:
                    self.refused += 1
                    log.warning("rendezvous: dropped %s:%s: undecodable request: %s",
                                peer[0], peer[1], e)
                    return
                except (TransportBrokenError, OSError):
                    return
                try:
                    if self._policy is not None:
                        self._policy.check(request)
                    reply = self._handle(request, will)
                except StoreRequestRefused as e:
                    self._refuse(conn, peer, e)
                    return
                except _MALFORMED as e:
                    log.warning("rendezvous: dropped %s:%s: malformed request: %r",
                                peer[0], peer[1], e)
                    return
                except Exception:  # noqa: BLE001 - a bug: drop this client, serve the others
                    log.error("rendezvous: dropped %s:%s: failed to serve %.100r",
                              peer[0], peer[1], request, exc_info=True)
                    return
                if self._stopped is not None:
                    reply = ("stopped", self._stopped)
                try:
                    send_obj(conn, reply)
                except OSError:
                    return
                if reply[0] == "stopped":
                    return
        finally:
            with self._cond:
                self._conns.discard(conn)
                if will[0] is not None and not self._closed.is_set() and self._stopped is None:
                    self._store.setdefault(*will[0])
                self._cond.notify_all()
            conn.close()

    def _handle(self, request, will):
        if not isinstance(request, tuple) or not request:
            raise ValueError(f"expected a request tuple, got {type(request).__name__}")
        op = request[0]
        if op == "put":
            if self._policy is not None:        # a note: the first one wins
                with self._cond:
                    self._store.setdefault(request[1], request[2])
                    self._cond.notify_all()
            else:
                self.put(request[1], request[2])
            return ("ok",)
        if op == "get":
            found, value = self.wait(request[1], request[2])
            return ("ok", value) if found else ("timeout",)
        if op == "wait_prefix":
            ok, found = self._wait_prefix(request[1], request[2], request[3])
            return ("ok" if ok else "timeout", found)
        if op == "will":
            _, key, value = request
            hash(key)       # (an unhashable key is refused now, not when the will is put)
            will[0] = None if key is None else (key, value)
            return ("ok",)
        if op == "delete":
            with self._cond:
                self._store.pop(request[1], None)
            return ("ok",)
        return ("error", f"unknown request {op!r}")


def _conflict_reason(key, slot_prefix, holder, claimant):
    """What every rank is told when ``key`` (a rank slot, held by ``holder``) is claimed
    again by ``claimant``."""
    def where(addr):
        return "an unknown address" if addr is None else f"{addr[0]}:{addr[1]}"
    return (f"rank {key[len(slot_prefix):]}'s slot {key!r} was claimed twice: by "
            f"{where(holder)} first, then by {where(claimant)}.  This job's key is derived "
            f"from public values (no HORA_SECRET), so a process outside the job can claim a "
            f"rank's slot; one of these two is not of this job, and rank 0 stopped the job "
            f"rather than run it with a stranger.  Set HORA_SECRET (or HORA_SECRET_FILE) on "
            f"every rank")
