"""Frames to throw at hora's control listeners, shared by the fuzz tests and the report.

A *probe* opens one TCP connection to a listener, sends bytes (possibly after completing the
HMAC handshake with the right or a wrong secret), half-closes, and reads until the listener
drops it.  The hypothesis strategies below describe the malformed, truncated, oversized and
unauthenticated openings; :data:`COUNTS` records how many of each were thrown (for
``docs/reliability.md``).  ``HORA_FUZZ_EXAMPLES`` raises the number of examples per strategy
(default: a CI-friendly 60).
"""
import collections
import os
import pickle
import socket
import struct

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hora.rendezvous.protocol import MAGIC, client_handshake

__all__ = ["EXAMPLES", "FUZZ", "COUNTS", "probe", "openings", "after_auth", "replay_bytes"]

EXAMPLES = int(os.environ.get("HORA_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COUNTS = collections.Counter()
_LEN = struct.Struct("!I")

# -- what an unauthenticated peer may send ------------------------------------------------
_purpose = st.one_of(st.sampled_from([b"rdzv", b"data", b"ctrl"]),
                     st.binary(min_size=4, max_size=4))
openings = st.one_of(
    st.binary(max_size=256).map(lambda b: ("random bytes", b)),
    st.tuples(_purpose, st.binary(max_size=40)).map(            # truncated or wrong-length
        lambda t: ("magic + purpose + nonce", MAGIC + t[0] + t[1])),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=64)).map(   # oversized claims
        lambda t: ("length prefix", _LEN.pack(t[0]) + t[1])),
    st.tuples(st.binary(min_size=1, max_size=5), _purpose, st.binary(min_size=32, max_size=32),
              st.binary(max_size=40)).map(                      # bad magic, full hello
        lambda t: ("bad magic", t[0] + t[1] + t[2] + t[3])),
    st.tuples(_purpose, st.binary(min_size=32, max_size=32), st.binary(max_size=64)).map(
        lambda t: ("hello then garbage answer", MAGIC + t[0] + t[1] + t[2])),
)

# -- what an authenticated peer may send (a buggy client, not an attacker) ----------------
_requests = st.one_of(
    st.binary(max_size=64),                                          # not a pickle
    st.builds(lambda o: pickle.dumps(o), st.one_of(                 # pickles of wrong shapes
        st.none(), st.integers(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
        st.tuples(), st.tuples(st.sampled_from(["get", "put", "wait_prefix", "delete", "x"])),
        st.tuples(st.sampled_from(["get", "wait_prefix"]), st.integers(), st.text(max_size=4)))),
)
after_auth = st.one_of(
    _requests.map(lambda p: ("malformed request", _LEN.pack(len(p)) + p)),
    st.tuples(st.one_of(st.sampled_from([1 << 28, (1 << 31) - 1, 1 << 31, 2**32 - 1]),
                        st.integers(65, 2**32 - 1)),
              st.binary(max_size=64)).map(                           # lies about length
        lambda t: ("oversized/truncated frame", _LEN.pack(t[0]) + t[1])),
)


def probe(addr, payload, secret=None, purpose=b"rdzv", timeout=10.0):
    """Connect, optionally authenticate with ``secret``, send ``payload``, half-close, and
    read until the listener drops us.  Returns True when it did (within ``timeout``)."""
    with socket.create_connection(addr, timeout=timeout) as s:
        if secret is not None:
            client_handshake(s, secret, purpose)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return True                 # dropped while we were still writing
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        except socket.timeout:
            return False
    return True


class _Recorder:
    """A socket stand-in that records what a client sends and plays the server's replies."""

    def __init__(self, sock):
        self.sock = sock
        self.sent = bytearray()

    def sendall(self, data):
        self.sent += data
        self.sock.sendall(data)

    def recv_into(self, buf, n=0):
        return self.sock.recv_into(buf, n)


def replay_bytes(addr, secret, request):
    """Authenticate with ``secret`` and send one framed ``request``; return every byte we
    sent, as an eavesdropper would have captured them."""
    with socket.create_connection(addr, timeout=10) as s:
        rec = _Recorder(s)
        client_handshake(rec, secret, b"rdzv")
        payload = pickle.dumps(request)
        rec.sendall(_LEN.pack(len(payload)) + payload)
        s.recv(4096)
        return bytes(rec.sent)
