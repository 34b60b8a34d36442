"""Forward workers' output to the launcher's stdout/stderr, line by line, tagged by rank.

One thread (:class:`OutputPump`) multiplexes every worker pipe with a selector, so the number of
threads does not grow with ``-np`` and the thread can always be stopped by a deadline even when
some escaped process holds a pipe open.  Lines look like ``[1]<stdout>:text`` (Horovod's gloo
format); with ``output_dir`` each rank's raw output is also written to
``<output_dir>/rank.<r>/stdout`` and ``.../stderr``.

Layer: runner.  Imports nothing from hora.
"""
import logging
import os
import selectors
import sys
import threading
import time

__all__ = ["OutputPump", "rank_dir_name"]

log = logging.getLogger(__name__)

_CHUNK = 65536


def rank_dir_name(rank, size):
    """``rank.<rank>``, zero-padded to the width of ``size - 1`` (Horovod's layout)."""
    return f"rank.{rank:0{len(str(max(size - 1, 0)))}d}"


class _Stream:
    """One worker pipe: its tag, its unfinished line, its optional copy on disk."""

    def __init__(self, rank, name, pipe, copy):
        self.rank = rank
        self.name = name            # "stdout" or "stderr"
        self.pipe = pipe
        self.copy = copy            # binary file or None
        self.partial = b""


class OutputPump:
    """Reads every registered worker pipe and writes its lines to our stdout/stderr.

    Args:
        size: ranks in the job (for the padding of per-rank directories).
        prefix: tag each line with ``[<rank>]<stdout>:`` / ``[<rank>]<stderr>:``.
        output_dir: also write raw output to ``output_dir/rank.<r>/{stdout,stderr}``.
    """

    def __init__(self, size, prefix=True, output_dir=None):
        self._size = size
        self._prefix = prefix
        self._output_dir = output_dir
        self._selector = selectors.DefaultSelector()
        self._streams = []
        self._thread = None
        self._stop_at = None        # monotonic deadline for draining, set by close()
        self._broken = set()        # our own stdout/stderr that failed to write
        # close() wakes the thread through this pipe: it needs no timeout to notice, so it
        # sleeps until there is output (a periodic wake-up would take a CPU from a rank)
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

    def add(self, rank, stdout_pipe, stderr_pipe):
        """Take ownership of one worker's pipes (before :meth:`start`)."""
        for name, pipe in (("stdout", stdout_pipe), ("stderr", stderr_pipe)):
            copy = None
            if self._output_dir is not None:
                folder = os.path.join(self._output_dir, rank_dir_name(rank, self._size))
                os.makedirs(folder, exist_ok=True)
                copy = open(os.path.join(folder, name), "wb")
            stream = _Stream(rank, name, pipe, copy)
            self._streams.append(stream)
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe.fileno(), selectors.EVENT_READ, stream)

    def start(self):
        self._thread = threading.Thread(target=self._run, name="hora-output", daemon=True)
        self._thread.start()

    def close(self, drain_s=2.0):
        """Drain until every pipe reaches EOF or ``drain_s`` passes, then close everything."""
        self._stop_at = time.monotonic() + drain_s
        try:
            os.write(self._wake_w, b"x")
        except (OSError, TypeError):        # closed already
            pass
        if self._thread is not None:
            self._thread.join(drain_s + 5.0)
            if self._thread.is_alive():
                log.warning("output thread did not stop in %.1f s (our stdout blocked?)",
                            drain_s + 5.0)
                return
        self._close_all()

    # -- the thread ----------------------------------------------------------------------
    def _run(self):
        try:
            while len(self._selector.get_map()) > 1:      # a worker pipe besides the wake
                timeout = None if self._stop_at is None else self._stop_at - time.monotonic()
                if timeout is not None and timeout <= 0:
                    break
                for key, _ in self._selector.select(timeout):
                    if key.data is None:                    # close(): drain from now on
                        os.read(self._wake_r, 512)
                    else:
                        self._read(key.data)
        except Exception:  # noqa: BLE001 - a forwarding bug must not hang the job
            log.exception("forwarding worker output failed")

    def _read(self, stream):
        try:
            data = os.read(stream.pipe.fileno(), _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:                                  # EOF: flush the unfinished line
            self._selector.unregister(stream.pipe.fileno())
            self._flush(stream)
            return
        if stream.copy is not None:
            stream.copy.write(data)
        *lines, stream.partial = (stream.partial + data).split(b"\n")
        for line in lines:
            self._emit(stream, line)

    def _flush(self, stream):
        if stream.partial:
            self._emit(stream, stream.partial)
            stream.partial = b""

    def _emit(self, stream, line):
        text = line.decode("utf-8", errors="replace")
        if self._prefix:
            text = f"[{stream.rank}]<{stream.name}>:{text}"
        # look the stream up each time: it may be redirected (pytest capture, contextlib)
        target = sys.stdout if stream.name == "stdout" else sys.stderr
        if target is None or stream.name in self._broken:
            return
        try:
            try:
                target.write(text + "\n")
            except UnicodeEncodeError:
                encoding = getattr(target, "encoding", None) or "ascii"
                target.write(text.encode(encoding, "replace").decode(encoding) + "\n")
            target.flush()
        except (OSError, ValueError) as e:            # closed or broken: keep draining pipes
            self._broken.add(stream.name)
            log.warning("cannot write worker %s to our %s: %s", stream.name, stream.name, e)

    def _close_all(self):
        for stream in self._streams:
            self._flush(stream)
            if stream.copy is not None:
                stream.copy.close()
            stream.pipe.close()
        self._streams = []
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None
