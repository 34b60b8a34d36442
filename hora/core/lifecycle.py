"""init() and shutdown(): forming this process's job and ending it.

``init()`` reads the placement, connects the job, starts the engine and hands the job's
context to :mod:`hora.core.state`, where every module reads it; ``shutdown()`` takes it back
and leaves the job (idempotent, also run at exit).  Also here: what init() sets up around
the job and shutdown() undoes (hora's log handler, the exit hooks, the timeline and the
metrics it starts), and the calls that need the job's parts (``start_timeline``,
``elastic_news``).  Layer: core, above the engine, the data planes and the bootstrap.
"""
import atexit
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence, Union

from .. import config
from ..errors import HoraError, HoraInternalError
from ..rendezvous import RendezvousClient
from . import membership, state, stats, timeline
from .bootstrap import form_job
from .dataplane import check_backend, make_board, make_device_planes, make_plane
from .engine import Engine
from .names import restart_names
from .process_sets import forget_sets, add_process_set
from .topology import detect_placement

__all__ = ["init", "shutdown"]

log = logging.getLogger("hora")

_lock = threading.RLock()       # one init() or shutdown() at a time
_abnormal_exit = False


def init(comm: Optional[Sequence[int]] = None,
         process_sets: Union[Sequence[Any], str, None] = None) -> None:
    """Join the job this process was launched into (a job of one without a launcher).

    Calling it again while initialized does nothing.

    Args:
        comm: None (all ranks), or the list of every rank; MPI communicators are not
            supported yet.
        process_sets: ProcessSet objects (or rank lists) to register now, on every rank in
            the same order; more can be added later with ``add_process_set``.

    Raises:
        RendezvousTimeoutError: some ranks did not arrive within HORA_START_TIMEOUT seconds.
        HoraError: the environment names a launcher but lacks what hora needs from it.
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise HoraError("init(comm=...) with an MPI communicator is not supported yet")
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): expected a list or "
                             f"'dynamic'")
        process_sets = None                 # sets can always be added later
    with _lock:
        if state.is_initialized():
            return
        _forget_last_job()
        settings = config.settings_from_env()
        placement = detect_placement()
        timeline_path = config.timeline_file()
        if timeline_path and placement.rank == 0:   # before the job forms, not after
            config.check_writable_file("HORA_TIMELINE", timeline_path)
        member_client = None
        if placement.elastic_id is not None:
            placement, member_client, (job, plane, device_planes, board) = _join_elastic(
                placement, settings)
        else:
            _configure_logging(settings.log_level, placement.rank)
            if comm is not None and sorted(comm) != list(range(placement.size)):
                raise HoraError(f"init(comm={list(comm)}): subsets of ranks are not "
                                f"supported yet")
            job, plane, device_planes, board = _connect(placement, settings)
        stats.started(placement.rank, placement.size, settings.fusion_threshold)
        engine = Engine(placement.rank, placement.size, job.transport, job.ctrl, settings,
                        crowded=job.topology.crowded, plane=plane,
                        device_planes=device_planes, board=board,
                        plain_only=not placement.secret_is_real, hosts=job.topology.hosts)
        engine.start()
        if job.server is not None:      # a rank slot claimed twice ends the job (rendezvous)
            job.server.on_conflict(engine.stop_job)
        state._begin(state._Context(job, engine, settings, placement, member_client))
        _install_exit_hooks()
        path = config.env_value("TIMELINE")
        if path and path.upper() != "DYNAMIC":      # Horovod's DYNAMIC: start_timeline() later
            if placement.round:                     # elastic: a file for each job after the first
                root, ext = os.path.splitext(path)
                path = f"{root}.round{placement.round}{ext}"
            timeline.start(placement.rank, placement.size, path,
                           config.env_value("TIMELINE_MARK_CYCLES"))
    metrics_dir = config.env_value("METRICS_DIR")
    if metrics_dir:
        stats.write_metrics(metrics_dir)
    if config.env_value("MONITOR") and placement.rendezvous_addr and placement.secret:
        stats.report_to_launcher(
            lambda: RendezvousClient(placement.rendezvous_addr, placement.rendezvous_port,
                                     placement.secret, timeout=5.0), placement.hostname)
    if process_sets:
        for ps in process_sets:
            add_process_set(ps)


def _connect(placement, settings):
    """Form the job and make its data planes and its board: ``(job, plane, device_planes,
    board)``."""
    job = form_job(placement, settings)
    plane, device_planes, board = None, {}, None
    try:
        if placement.size > 1:
            try:
                timeline.measure_offsets(placement.rank, job.topology, job.ctrl,
                                         settings.start_timeout)
            except OSError as e:
                raise HoraInternalError(f"rank {placement.rank}: comparing clocks with rank 0 "
                                        f"at init() failed: {e}") from e
        check_backend(settings.backend, job.topology, placement.source)
        plane = make_plane(settings, job.transport, job.topology)
        device_planes = make_device_planes(settings, job.transport, job.topology)
        board = make_board(settings, job.transport, job.topology, plane)
    except BaseException:
        for p in (plane, *device_planes.values()):
            if p is not None:
                p.close()
        job.close()
        raise
    return job, plane, device_planes, board


def _join_elastic(placement, settings):
    """An elastic worker joins the next job its launcher forms that names it: when that job
    breaks while it forms (a member died, or the launcher formed a newer one), the next.
    Returns ``(placement, member_client, (job, plane, device_planes, board))``."""
    def open_client():
        return RendezvousClient(placement.rendezvous_addr, placement.rendezvous_port,
                                placement.secret, timeout=settings.start_timeout)
    while True:
        placed, client = membership.join_next(placement, settings, open_client)
        _configure_logging(settings.log_level, placed.rank)
        try:
            return placed, client, _connect(placed, settings)
        except HoraInternalError as e:
            client.close()
            log.warning("elastic: job round %d did not form (%s); waiting for the next",
                        placed.round, e)
        except BaseException:
            client.close()
            raise


def start_timeline(file_path, mark_cycles=False):
    """Start the timeline on this rank (rank 0 writes ``file_path``): see
    :mod:`hora.core.timeline`."""
    ctx = state._require()
    timeline.start(ctx.placement.rank, ctx.placement.size, file_path, mark_cycles)


def elastic_news():
    """Elastic jobs, any rank: ``{"time", "change"}`` when the launcher has formed a newer
    job than this one (workers came or went), else None; None outside elastic jobs."""
    ctx = state._require()
    if ctx.member_client is None:
        return None
    return membership.pending_change(ctx.member_client)


def _forget_last_job():
    """Start a job from the state the first init() found: what the last job of this process
    left behind (automatic names' counts, its registered process sets, the mark of an
    uncaught exception) is not this job's."""
    global _abnormal_exit
    restart_names()
    forget_sets()
    _abnormal_exit = False


def shutdown() -> None:
    """Leave the job.  Waits until every rank has called shutdown (watching that they are
    alive), so that no rank closes connections others still need, for at most
    HORA_TRANSPORT_TIMEOUT seconds: a rank still alive but not there by then is left
    behind, with a warning.  Idempotent."""
    with _lock:
        ctx = state._end()
    if ctx is None:
        return
    # The bound is the transport's: how long hora lets a live peer make no progress.  A rank
    # that arrives later (a long final checkpoint on one rank) still leaves cleanly, as this
    # one has nothing left to run with it.  What the bound ends is a wait for a rank that
    # hangs, and, after it, collectives that other ranks go on running without this one (in
    # a process set): those fail, naming this rank.
    bound = ctx.settings.transport_timeout
    started = time.monotonic()
    try:
        ctx.engine.shutdown(abort=_abnormal_exit,
                            timeout=bound if bound < threading.TIMEOUT_MAX else None)
        timeline.stop()
        stats.stop_writing()
        stats.stop_reporting()
        if not _abnormal_exit and time.monotonic() - started >= bound:
            log.warning("shutdown(): not every rank had called shutdown() after %g s "
                        "(HORA_TRANSPORT_TIMEOUT); left without them", bound)
    finally:
        ctx.job.close()
        if ctx.member_client is not None:
            ctx.member_client.close()
        _release_logging()


_hooks_installed = False


def _install_exit_hooks():
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    # SIGUSR1 prints every thread's Python stack: the launcher sends it to a job it is about
    # to kill for a timeout, so the user sees where each rank was stuck
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    previous = sys.excepthook

    def excepthook(tp, value, tb):
        # an uncaught exception ends this rank: leave at once instead of waiting for the
        # others at exit, so the launcher sees the failure and stops the job promptly
        global _abnormal_exit
        _abnormal_exit = True
        previous(tp, value, tb)

    sys.excepthook = excepthook
    atexit.register(shutdown)


class _StderrHandler(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (as ``logging.lastResort`` does), so that a
    script or test that replaces ``sys.stderr`` after ``init()`` still sees hora's lines."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


_handler = None
_propagated = True          # the hora logger's propagate flag before init()


def _configure_logging(level, rank):
    """hora's records go to stderr as ``[hora rank N] LEVEL: message``, at HORA_LOG_LEVEL,
    through a handler of hora's own on the ``hora`` logger, which does not propagate.

    A library must not print what the application's logging prints already (with
    ``logging.basicConfig()`` in the script, a handler of hora's beside the root's would
    show every record twice), nor stay silent when the application configured nothing (a
    stall warning would go unseen).  So hora owns its output, once: an application that
    wants hora's records in its own handlers adds them to ``logging.getLogger("hora")`` (or
    sets its ``propagate`` back to True and removes hora's handler).
    """
    global _handler, _propagated
    logger = logging.getLogger("hora")
    logger.setLevel(config.log_level_number(level))
    if _handler is None:
        _handler = _StderrHandler()
        logger.addHandler(_handler)
        _propagated, logger.propagate = logger.propagate, False
    _handler.setFormatter(logging.Formatter(f"[hora rank {rank}] %(levelname)s: %(message)s"))


def _release_logging():
    """shutdown(): the ``hora`` logger as init() found it."""
    global _handler
    if _handler is not None:
        logger = logging.getLogger("hora")
        logger.removeHandler(_handler)
        logger.propagate = _propagated
        _handler = None
