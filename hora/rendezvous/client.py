"""The rendezvous client every worker (and the launcher's helpers) uses.

Layer: rendezvous.
"""
import socket
import threading
import time

from ..errors import (RendezvousClosedError, RendezvousError, RendezvousTimeoutError,
                      TransportBrokenError)
from .protocol import client_handshake, recv_obj, send_obj
from .safepickle import PayloadRefusedError
from .server import PURPOSE

__all__ = ["RendezvousClient", "connect_with_retry"]


def connect_with_retry(addr, port, deadline, what):
    """Open a TCP connection, retrying refused attempts until ``deadline`` (monotonic)."""
    delay = 0.02
    last = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeoutError(f"could not connect to {what} at {addr}:{port}: {last}")
        try:
            sock = socket.create_connection((addr, port), timeout=min(left, 5.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            last = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)


class RendezvousClient:
    """A connection to the job's :class:`~hora.rendezvous.server.RendezvousServer`.

    Replies are decoded as plain data only: a server that passed the handshake with a
    derivable key (a process squatting on the port, say) cannot get code run here.

    Args:
        addr, port: where the server listens.
        secret: the job secret (hex text or bytes).
        timeout: seconds to keep retrying the first connection (the server may start late).
    """

    def __init__(self, addr, port, secret, timeout=30.0):
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout
        self._sock = connect_with_retry(addr, port, deadline, "the rendezvous server")
        self._sock.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            client_handshake(self._sock, secret, PURPOSE)
        except Exception:
            self._sock.close()
            raise
        self._sock.settimeout(None)

    @property
    def local_address(self):
        """The local IP this process used to reach the server (reachable by the job)."""
        return self._sock.getsockname()[0]

    def _call(self, *request, timeout=None):
        with self._lock:
            # the server answers within the request's own wait; allow a margin on top
            self._sock.settimeout(None if timeout is None else timeout + 10.0)
            try:
                send_obj(self._sock, request)
                reply = recv_obj(self._sock, "the rendezvous server")
            except PayloadRefusedError as e:
                # the server passed the handshake, so it knows the key; with a derivable key
                # that is no proof it is our job's: its reply is never run, only refused
                self._sock.close()
                raise RendezvousError(f"the rendezvous server sent a reply that is not plain "
                                      f"data: {e}") from e
            except (TransportBrokenError, OSError) as e:
                raise RendezvousClosedError(f"lost the rendezvous server: {e}") from e
        if type(reply) is not tuple or not reply:
            raise RendezvousError(f"malformed reply from the rendezvous server: {reply!r:.100}")
        if reply[0] == "stopped":     # a rank slot was claimed twice: see the server
            raise RendezvousError(f"the job's rendezvous stopped: "
                                  f"{reply[1] if len(reply) > 1 else ''}")
        if reply[0] == "error":
            raise RendezvousError(f"the rendezvous server refused {request[0]} "
                                  f"{request[1]!r}: {reply[1] if len(reply) > 1 else ''}")
        return reply

    def put(self, key, value):
        """Store ``value`` (plain data) under ``key``.

        Raises:
            RendezvousError: the server refused it (with a derivable job key it takes only
                this connection's rank slot, then notes: see :mod:`hora.rendezvous.policy`),
                or it has stopped (a rank slot was claimed twice).
            RendezvousClosedError: the server went away.
        """
        self._call("put", key, value, timeout=10.0)

    def get(self, key, timeout):
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear."""
        reply = self._call("get", key, timeout, timeout=timeout)
        if reply[0] != "ok" or len(reply) != 2:
            raise RendezvousTimeoutError(f"rendezvous key {key!r} did not appear in {timeout:g} s")
        return reply[1]

    def wait_prefix(self, prefix, n, timeout):
        """Wait for ``n`` keys starting with ``prefix``; returns (complete, {key: value})."""
        reply = self._call("wait_prefix", prefix, n, timeout, timeout=timeout)
        if len(reply) != 2 or type(reply[1]) is not dict:
            raise RendezvousError(f"malformed reply from the rendezvous server: {reply!r:.100}")
        return reply[0] == "ok", reply[1]

    def will(self, key, value):
        """Have the server put ``value`` under ``key`` when this connection closes (the
        process exited, was killed or closed it), unless withdrawn first with
        ``will(None, None)``.  One will a connection: a new one replaces the last."""
        self._call("will", key, value, timeout=10.0)

    def delete(self, key):
        """Remove ``key`` (refused, RendezvousError, with a derivable job key)."""
        self._call("delete", key, timeout=10.0)

    def close(self):
        self._sock.close()

