"""The rendezvous server: a small authenticated key-value store.

The launcher (``hora run``) serves one per job; without a launcher, rank 0 serves it.  Workers
register their data-plane addresses under ``rank/<r>`` and read each other's.  Each client
connection gets a thread; every connection must pass the HMAC handshake
(:mod:`hora.rendezvous.protocol`) within ``handshake_timeout`` seconds, or it is dropped with a
log line and the store is untouched.  At most ``MAX_HANDSHAKES`` handshakes run at once;
further connections wait in the listen backlog, so a flood of unauthenticated connections
cannot exhaust the process's threads.

Requests (pickled tuples, authenticated connections only):
    ("put", key, value)                   -> ("ok",)
    ("get", key, timeout_s)               -> ("ok", value) | ("timeout",)
    ("wait_prefix", prefix, n, timeout_s) -> ("ok", {key: value}) | ("timeout", {key: value})
    ("delete", key)                       -> ("ok",)
"""
import logging
import socket
import threading
import time

from ..errors import AuthenticationError, TransportBrokenError
from .protocol import recv_obj, send_obj, server_handshake

__all__ = ["RendezvousServer"]

log = logging.getLogger(__name__)

PURPOSE = b"rdzv"
MAX_HANDSHAKES = 128
_ACCEPT_LOOK_S = 1.0         # see start()


class RendezvousServer:
    """A threaded key-value server.  ``start()`` binds and serves in the background.

    Args:
        secret: the job secret (hex text or bytes).
        host: address to bind ("0.0.0.0" for every interface).
        port: port to bind (0 picks a free one).
        handshake_timeout: seconds an unauthenticated client may take to prove itself.
    """

    def __init__(self, secret, host="127.0.0.1", port=0, handshake_timeout=5.0):
        self._secret = secret
        self._bind = (host, port)
        self._handshake_timeout = handshake_timeout
        self._store = {}
        self._cond = threading.Condition()
        self._sock = None
        self._thread = None
        self._closed = threading.Event()
        self.rejected = 0          # connections refused at the handshake (for tests)
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._bind)
        sock.listen(512)
        # stop() wakes a blocked accept() at once on Linux; the timeout bounds it elsewhere,
        # and is long because every wake-up of this thread takes a CPU from a training rank
        sock.settimeout(_ACCEPT_LOOK_S)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="hora-rendezvous",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def port(self):
        return self._sock.getsockname()[1]

    def stop(self):
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        if self._sock is not None:
            try:                        # wakes a blocked accept() at once (Linux), rather
                self._sock.shutdown(socket.SHUT_RDWR)   # than at its next timeout
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

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
            while key not in self._store and not self._closed.is_set():
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
                if left <= 0 or self._closed.is_set():
                    return False, found
                self._cond.wait(min(left, 0.5))

    # -- serving --------------------------------------------------------------------------
    def _accept_loop(self):
        while not self._closed.is_set():
            if not self._handshakes.acquire(timeout=0.2):
                continue                # every handshake slot is taken: leave it queued
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                self._handshakes.release()
                continue
            except OSError:
                self._handshakes.release()
                return
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name="hora-rendezvous-conn").start()

    def _serve(self, conn, peer):
        with conn:
            conn.settimeout(self._handshake_timeout)
            try:
                server_handshake(conn, self._secret, (PURPOSE,))
            except (AuthenticationError, TransportBrokenError, OSError) as e:
                self.rejected += 1
                log.warning("rendezvous: refused connection from %s:%s: %s", peer[0], peer[1], e)
                return
            finally:
                self._handshakes.release()
            conn.settimeout(None)
            while not self._closed.is_set():
                try:
                    request = recv_obj(conn, "rendezvous client")
                except (TransportBrokenError, OSError):
                    return
                except Exception as e:  # noqa: BLE001 - an undecodable frame
                    log.warning("rendezvous: dropped %s:%s: undecodable request: %r",
                                peer[0], peer[1], e)
                    return
                try:
                    reply = self._handle(request)
                except Exception as e:  # noqa: BLE001 - a malformed request, not our bug
                    log.warning("rendezvous: dropped %s:%s: malformed request: %r",
                                peer[0], peer[1], e)
                    return
                try:
                    send_obj(conn, reply)
                except OSError:
                    return

    def _handle(self, request):
        if not isinstance(request, tuple) or not request:
            raise ValueError(f"expected a request tuple, got {type(request).__name__}")
        op = request[0]
        if op == "put":
            self.put(request[1], request[2])
            return ("ok",)
        if op == "get":
            found, value = self.wait(request[1], request[2])
            return ("ok", value) if found else ("timeout",)
        if op == "wait_prefix":
            ok, found = self._wait_prefix(request[1], request[2], request[3])
            return ("ok" if ok else "timeout", found)
        if op == "delete":
            with self._cond:
                self._store.pop(request[1], None)
            return ("ok",)
        return ("error", f"unknown request {op!r}")
