"""Framing and the HMAC handshake shared by every hora connection.

Wire format: a frame is a 4-byte big-endian length followed by that many bytes.  Before a
connection is authenticated only fixed-size messages are read, so no length sent by an
unknown peer is ever trusted, and nothing from it is decoded.  After it, frames are decoded by
:mod:`hora.rendezvous.safepickle`, which accepts plain data only: a peer that knows the key
(which outside ``hora run`` may be derivable from public job values) still cannot get code run.

Handshake (mutual, challenge-response; a replay from another connection or another job's
secret fails because both nonces are fresh):

    client -> server   MAGIC | purpose(4) | client_nonce(32)
    server -> client   server_nonce(32) | HMAC(k, "S" | purpose | client_nonce | server_nonce)
    client -> server   HMAC(k, "C" | purpose | server_nonce | client_nonce)
    server -> client   ACK(1)

The server's half is also written as steps on bytes (:func:`open_hello`,
:func:`challenge`, :func:`check_answer`) so that :mod:`hora.rendezvous.gate` can run many
handshakes at once without a thread each.

Layer: rendezvous.  Imports only hora.errors.
"""
import hashlib
import hmac
import os
import socket
import struct

from ..errors import AuthenticationError, TransportBrokenError
from .safepickle import safe_dumps, safe_loads

__all__ = ["MAGIC", "MAX_FRAME", "HELLO", "client_handshake", "server_handshake", "open_hello",
           "challenge", "check_answer", "send_frame", "recv_frame", "recv_exact", "send_obj",
           "recv_obj", "new_secret", "secret_key"]

MAGIC = b"HORA\x01"
NONCE = 32
MAC = 32
ACK = b"\x06"
HELLO = len(MAGIC) + 4 + NONCE  # what a client sends first
MAX_FRAME = 1 << 31          # authenticated peers only
_LEN = struct.Struct("!I")
_GROW = 1 << 20              # recv_exact's first allocation; then it doubles as bytes arrive


def new_secret():
    """A fresh random job secret, as hex text (safe to pass in an environment variable)."""
    return os.urandom(32).hex()


def secret_key(secret):
    """The HMAC key of a job secret: bytes as they are, hex text as its bytes, and any other
    text (a passphrase in HORA_SECRET) as its UTF-8 encoding."""
    if isinstance(secret, bytes):
        return secret
    try:
        return bytes.fromhex(secret)
    except ValueError:
        return secret.encode()



def _mac(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock, n, what="peer"):
    """Read exactly ``n`` bytes or raise TransportBrokenError (EOF, reset).

    Memory grows with the bytes that actually arrive, never with ``n`` alone: a peer that
    announces a huge frame and sends nothing costs nothing.
    """
    buf = bytearray(min(n, _GROW))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n - got, len(buf))))     # at most double what arrived
        try:
            k = sock.recv_into(memoryview(buf)[got:])
        except socket.timeout:
            raise
        except OSError as e:
            raise TransportBrokenError(f"connection to {what} broke: {e}") from e
        if k == 0:
            raise TransportBrokenError(f"connection to {what} closed")
        got += k
    return bytes(buf)


def client_handshake(sock, secret, purpose):
    """Prove knowledge of ``secret`` to the server and check that it knows it too."""
    key = secret_key(secret)
    purpose = purpose.ljust(4)[:4]
    nonce_c = os.urandom(NONCE)
    sock.sendall(MAGIC + purpose + nonce_c)
    reply = recv_exact(sock, NONCE + MAC, "server")
    nonce_s, server_mac = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(server_mac, _mac(key, b"S", purpose, nonce_c, nonce_s)):
        raise AuthenticationError("the server does not know this job's secret")
    sock.sendall(_mac(key, b"C", purpose, nonce_s, nonce_c))
    try:
        ack = recv_exact(sock, 1, "server")
    except TransportBrokenError as e:
        raise AuthenticationError("the server refused our credentials") from e
    if ack != ACK:
        raise AuthenticationError("the server refused our credentials")


def open_hello(hello, purposes):
    """The purpose and client nonce of a client's first ``HELLO`` bytes.

    Raises:
        AuthenticationError: not a hora client, or a purpose this listener does not serve.
    """
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("not a hora client (bad magic)")
    purpose = hello[len(MAGIC):len(MAGIC) + 4]
    if purpose not in purposes:
        raise AuthenticationError(f"unexpected connection purpose {purpose!r}")
    return purpose, hello[len(MAGIC) + 4:]


def challenge(key, purpose, nonce_c):
    """(server nonce, the bytes the server answers a hello with)."""
    nonce_s = os.urandom(NONCE)
    return nonce_s, nonce_s + _mac(key, b"S", purpose, nonce_c, nonce_s)


def check_answer(key, purpose, nonce_c, nonce_s, client_mac):
    """Raise AuthenticationError unless ``client_mac`` proves the client knows ``key``."""
    if not hmac.compare_digest(client_mac, _mac(key, b"C", purpose, nonce_s, nonce_c)):
        raise AuthenticationError("client failed authentication (wrong job secret)")


def server_handshake(sock, secret, purposes):
    """Check that the client knows ``secret``; return the purpose it asked for.

    Raises AuthenticationError for any malformed or unauthenticated opening.
    """
    key = secret_key(secret)
    purpose, nonce_c = open_hello(recv_exact(sock, HELLO, "client"), purposes)
    nonce_s, reply = challenge(key, purpose, nonce_c)
    sock.sendall(reply)
    check_answer(key, purpose, nonce_c, nonce_s, recv_exact(sock, MAC, "client"))
    sock.sendall(ACK)
    return purpose


def send_frame(sock, payload):
    sock.sendall(_LEN.pack(len(payload)))
    sock.sendall(payload)


def recv_frame(sock, what="peer", max_len=MAX_FRAME):
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, what))
    if n > max_len:
        raise TransportBrokenError(f"frame of {n} bytes from {what} exceeds {max_len}")
    return recv_exact(sock, n, what)


def send_obj(sock, obj):
    send_frame(sock, safe_dumps(obj))


def recv_obj(sock, what="peer", max_len=MAX_FRAME):
    """Receive one frame of plain data (see :mod:`hora.rendezvous.safepickle`).

    Raises:
        PayloadRefusedError: the frame is not plain data (a pickle that would run code).
        TransportBrokenError: the connection broke, or the frame exceeds ``max_len``.
    """
    return safe_loads(recv_frame(sock, what, max_len))
