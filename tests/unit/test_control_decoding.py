"""Control frames are decoded as plain data: a pickle that would run code is refused.

Real sockets; the decoders under test are the ones the rendezvous server and client and the
engine's control connections use.  Each hostile frame would, if unpickled, create a marker
file: the marker must stay absent.
"""
import copyreg
import os
import pickle
import socket
import struct

import numpy as np
import pytest

from hora.errors import HoraError, TransportBrokenError
from hora.rendezvous import RendezvousClient, RendezvousServer, new_secret
from hora.rendezvous.protocol import client_handshake

_LEN = struct.Struct("!I")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _frame(obj):
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(payload)) + payload


def _hostile(marker):
    """Pickles that would run a command, by different routes."""
    import subprocess
    cmd = f"touch {marker}"
    yield "os.system via __reduce__", pickle.dumps(_Evil(marker))
    yield "inside a request tuple", pickle.dumps(("put", "k", _Evil(marker)))
    yield "protocol 0 GLOBAL", pickle.dumps(_Evil(marker), protocol=0)
    yield "subprocess.Popen", pickle.dumps(_Reduce(subprocess.Popen, (["touch", str(marker)],)))
    yield "builtins.eval", pickle.dumps(_Reduce(eval, (f"__import__('os').system({cmd!r})",)))
    yield "builtins.getattr", (b"\x80\x04cbuiltins\ngetattr\n(cos\n" b"system\ntR.")


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_plain_data_and_numpy_round_trip():
    from hora.rendezvous.safepickle import safe_loads
    values = [None, True, 3, 2.5, 1 + 2j, "text", b"bytes", bytearray(b"ba"), (1, (2,)),
              [1, [2]], {"a": {1: 2}}, {1, 2}, frozenset({3}), 10 ** 40,
              np.dtype("float32"), np.float32(1.5), np.int64(7), np.arange(6.0).reshape(2, 3),
              np.array(["a", "b"])]
    for v in values:
        got = safe_loads(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(got, v)
        else:
            assert got == v and type(got) is type(v)
    # an array pickled with protocol 4 goes through numpy's _reconstruct
    np.testing.assert_array_equal(safe_loads(pickle.dumps(np.arange(3), protocol=4)),
                                  np.arange(3))


def test_hostile_pickles_are_refused_and_nothing_runs(tmp_path):
    from hora.rendezvous.safepickle import PayloadRefusedError, safe_loads
    marker = tmp_path / "ran"
    for what, data in _hostile(marker):
        with pytest.raises(PayloadRefusedError):
            safe_loads(data)
        assert not marker.exists(), what
    # an extension code registered for os.system resolves through the same check, and
    # one this process has resolved before (cached, no lookup) is refused as well
    copyreg.add_extension("posix", "system", 0x7ffff0)
    copyreg.add_extension("os", "getpid", 0x7ffff1)
    try:
        with pytest.raises(PayloadRefusedError, match="posix.system"):
            safe_loads(b"\x80\x02\x84\xf0\xff\x7f\x00X\x04\x00\x00\x00true\x85R.")
        getpid = b"\x80\x02\x84\xf1\xff\x7f\x00)R."
        assert pickle.loads(getpid) == os.getpid()          # now in copyreg's cache
        for frame in (getpid, bytearray(getpid), memoryview(getpid)):  # (as connections pass)
            with pytest.raises(PayloadRefusedError, match="extension"):
                safe_loads(frame)
    finally:
        copyreg.remove_extension("posix", "system", 0x7ffff0)
        copyreg.remove_extension("os", "getpid", 0x7ffff1)
    with pytest.raises(PayloadRefusedError, match="persistent"):
        safe_loads(b"\x80\x02X\x01\x00\x00\x00aQ.")
    with pytest.raises(PayloadRefusedError, match="undecodable"):
        safe_loads(b"not a pickle")
    # numpy's reconstructor, called as numpy never does: another type, a huge empty array
    rebuild = np._core.multiarray._reconstruct
    for args in ((np.dtype, (0,), b"b"), (np.ndarray, (10 ** 9,), b"b")):
        with pytest.raises(PayloadRefusedError, match="_reconstruct"):
            safe_loads(pickle.dumps(_Reduce(rebuild, args), protocol=4))


def test_only_the_classes_a_decoder_lists_are_built():
    from hora.core.messages import Request
    from hora.rendezvous.safepickle import PayloadRefusedError, SafeDecoder, safe_loads
    req = Request("g", 0, "float32", ((2,),), 1, -1, 1.0, 1.0, None, 0, "")
    data = pickle.dumps(("req", [req]), protocol=pickle.HIGHEST_PROTOCOL)
    assert SafeDecoder([Request]).loads(data) == ("req", [req])
    with pytest.raises(PayloadRefusedError, match="Request"):
        safe_loads(data)


@pytest.mark.timeout(30)
def test_the_engine_control_connection_refuses_a_frame_that_would_run_code(tmp_path):
    # with a derivable job key (plain_only): a peer that computed the key, or raced a rank
    # for its slot, may be anyone (with a real secret only the job's ranks can connect)
    from hora.core.engine.conn import Conn as _Conn
    marker = tmp_path / "ran"
    a, b = socket.socketpair()
    try:
        conn = _Conn(a, 1, timeout=5.0, plain_only=True)
        b.sendall(_frame(("dead", 1, "x")) + _frame(("stack", 7, _Evil(marker))))
        with pytest.raises(TransportBrokenError, match="rank 1"):
            for _ in range(100):
                conn.receive()
        assert not marker.exists(), "the control frame's pickle ran a command"
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_the_rendezvous_server_refuses_a_frame_that_would_run_code(tmp_path):
    # even for a client that knows the key (here the real secret; outside `hora run` it
    # may be derived from public values)
    marker = tmp_path / "ran"
    secret = new_secret()
    with RendezvousServer(secret, handshake_timeout=2.0) as server:
        for what, data in _hostile(marker):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                client_handshake(s, secret, b"rdzv")
                s.sendall(_LEN.pack(len(data)) + data)
                try:
                    assert s.recv(4096) in (b"",)   # dropped without an answer
                except ConnectionResetError:
                    pass
            assert not marker.exists(), what
        good = RendezvousClient("127.0.0.1", server.port, secret)
        good.put("k", "v")
        assert good.get("k", timeout=1) == "v"
        good.close()


@pytest.mark.timeout(30)
def test_a_client_refuses_a_reply_that_would_run_code(tmp_path):
    # a squatter on the rendezvous port that knows a derivable key answers with a pickle
    marker = tmp_path / "ran"
    secret = new_secret()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        import threading

        def fake_server():
            from hora.rendezvous.protocol import recv_frame, server_handshake
            conn, _ = listener.accept()
            with conn:
                server_handshake(conn, secret, (b"rdzv",))
                recv_frame(conn)
                conn.sendall(_frame(("ok", _Evil(marker))))
        t = threading.Thread(target=fake_server, daemon=True)
        t.start()
        client = RendezvousClient("127.0.0.1", listener.getsockname()[1], secret)
        with pytest.raises(HoraError, match="not plain data"):
            client.get("k", timeout=1)
        client.close()
        t.join(5)
    assert not marker.exists()
