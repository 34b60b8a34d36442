"""The one supervisor of every set of processes hora starts: ``hora run``'s ranks (local, or
ssh to a remote agent), ``hora run --mpi``'s mpirun, a SageMaker host's ranks.

A :class:`Supervisor` watches the :class:`Worker` s added to it (each the leader of its own
process group) in a single-threaded loop, and ends them as one unit:

- :meth:`~Supervisor.wait` returns when every worker has exited, or tears the set down when
  the first one fails (by time of exit: the root cause) or when this process gets SIGINT,
  SIGTERM or SIGHUP, or returns at a deadline and leaves the teardown to the caller;
- a teardown (:meth:`~Supervisor.stop`) sends one signal to every worker, gives their process
  groups ``grace_s`` to exit, then SIGKILLs what is left (a second SIGINT: at once);
- :meth:`~Supervisor.close` kills what still runs, sweeps the processes the workers left in
  their groups, and restores the signal handlers.

Every wait is bounded: a process that survives SIGKILL (uninterruptible sleep) is reported
and given up on, never waited for without end.  Exits and signals wake the loop through
pidfds and a self-pipe, so an idle supervisor does not take CPU time from the ranks.

Layer: runner.  Imports nothing from hora but :mod:`hora.runner.proc`.
"""
import dataclasses
import enum
import logging
import os
import selectors
import signal
import subprocess
import threading
import time

from . import proc

__all__ = ["Supervisor", "Worker", "WorkerExit", "WorkerState", "Ending", "Outcome",
           "DEFAULT_GRACE_S", "FORWARDED_SIGNALS"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3.0       # SIGTERM -> SIGKILL; long enough for a clean Python exit
# What a user or a scheduler sends to stop a job; SIGHUP is left alone when it was ignored
# (``nohup``): a job started that way must outlive its terminal.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TICK_S = 0.05              # loop period while stopping, or without pidfds
_WATCH_S = 1.0              # ... while every worker has a pidfd: exits and signals wake the
                            # loop at once, and a wake-up takes a CPU from a training rank
_DUMP_WAIT_S = 1.0          # after SIGUSR1: time for tracebacks to be printed
_REAP_WAIT_S = 10.0         # after SIGKILL: a process in uninterruptible sleep may linger


class WorkerState(enum.Enum):
    """Life cycle of one worker as the supervisor sees it.

    RUNNING: started, not yet exited.
    SUCCEEDED: exited with code 0.
    FAILED: exited non-zero or by a signal on its own (or before we asked it to stop).
    STOPPED: exited after the supervisor signalled it (teardown of a failed or interrupted set).
    """
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclasses.dataclass
class WorkerExit:
    """How one worker ended.  ``returncode`` is Popen's: negative for a signal."""
    rank: int
    host: str
    pid: int
    returncode: int
    state: WorkerState
    time: float             # time.monotonic() when the supervisor saw the exit
    name: str = None        # how messages name it; None: "rank <rank>"

    def describe(self):
        """``"rank 1 (pid 42, host localhost) exited with code 3"``."""
        return (f"{self.name or f'rank {self.rank}'} (pid {self.pid}, host {self.host}) "
                f"{proc.describe_exit(self.returncode)}")


class Worker:
    """One supervised process: the leader of its own process group.

    Args:
        rank: the rank it runs (messages name it by it).
        host: where it runs (for messages).
        popen: its :class:`subprocess.Popen`.
        relay: delivers a signal other than SIGKILL in place of signalling the process
            group: ``relay(sig)`` returns False when it could not (then the group gets it).
            For ssh to a remote agent (the signal travels on stdin), or for a leader that
            stops its own children (mpirun).
        name: how messages name it (default ``"rank <rank>"``).
    """

    def __init__(self, rank, host, popen, relay=None, name=None):
        self.rank = rank
        self.host = host
        self.popen = popen
        self.relay = relay
        self.name = name or f"rank {rank}"
        self.state = WorkerState.RUNNING
        self.exit = None

    @property
    def pid(self):
        return self.popen.pid

    def signal(self, sig):
        """Send ``sig`` to the worker: through its relay, else to its process group.

        SIGKILL always goes to the group: a relay needs the process alive to pass it on.
        """
        if self.relay is not None and sig != signal.SIGKILL and self.relay(sig):
            return
        proc.signal_group(self.pid, sig)


class Ending(enum.Enum):
    """Why :meth:`Supervisor.wait` returned."""
    SUCCEEDED = "succeeded"     # every worker exited 0
    FAILED = "failed"           # a worker failed; the others were stopped
    INTERRUPTED = "interrupted"  # this process got a forwarded signal; workers were stopped
    TIMED_OUT = "timed out"     # the deadline passed; the workers still run


@dataclasses.dataclass
class Outcome:
    """What :meth:`Supervisor.wait` saw.

    Attributes:
        ending: why it returned.
        exitcode: 0; the first failed worker's status (128+signum for a signal); 128+signum
            of the signal that interrupted this process; 124 at the deadline (as timeout(1)).
        failure: the first worker to fail (by time of exit), or None.
        signal: the signal that interrupted this process, or None.
        exits: every worker's exit (None for one still running), in the order added.
        hung: the workers still running at the deadline (TIMED_OUT only).
    """
    ending: Ending
    exitcode: int
    failure: WorkerExit = None
    signal: int = None
    exits: list = dataclasses.field(default_factory=list)
    hung: list = dataclasses.field(default_factory=list)


class Supervisor:
    """Start, watch and stop a set of worker processes as one unit.

    Example:
        >>> with Supervisor(grace_s=3.0, output=pump) as sup:       # doctest: +SKIP
        ...     for rank, env in enumerate(envs):
        ...         sup.spawn(rank, "localhost", ["python", "train.py"], env)
        ...     outcome = sup.wait(timeout_s=600)
        ...     if outcome.ending is Ending.TIMED_OUT:
        ...         sup.stop(signal.SIGTERM)

    Args:
        grace_s: seconds between the stop signal and SIGKILL, for each worker's whole
            process group.
        output: an :class:`~hora.runner.output.OutputPump` that takes every spawned worker's
            stdout and stderr (started by :meth:`wait`, closed by :meth:`close`), or None.
        forward_signals: signals that interrupt :meth:`wait` and are sent on to the workers
            (handlers are installed from the main thread only).
    """

    def __init__(self, grace_s=DEFAULT_GRACE_S, output=None, forward_signals=FORWARDED_SIGNALS):
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")
        self.grace_s = grace_s
        self.workers = []
        self._output = output
        self._output_started = False
        self._forward = tuple(forward_signals)
        self._signals = []
        self._selector = None
        self._wake_r = self._wake_w = None      # the signal handler's wake-up pipe
        self._restore = lambda: None
        self._closed = False
        self._failure = None
        self._stopping = False      # set once we signal workers: later exits are our doing
        self._reported = set()      # id() of the workers whose exit watch() returned

    # -- life cycle ---------------------------------------------------------------------------
    def open(self):
        """Prepare to watch: the wake-up pipe and the signal handlers.  Called by ``with``."""
        if self._selector is not None:
            raise RuntimeError("a Supervisor is opened once; make a new one")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._restore = self._install_signal_handlers()
        return self

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc_info):
        self.close()

    def close(self):
        """Kill what still runs, sweep the workers' process groups, restore the signal
        handlers, close the output and every descriptor.  Bounded; idempotent."""
        if self._closed or self._selector is None:
            return
        self._closed = True
        try:
            if self.running():     # leaving on an exception (or a failed start)
                self.kill()
            self._sweep_groups()
        finally:
            self._restore()
            self._restore = lambda: None
            if self._output is not None:
                self._output.close()
                self._output = None
            for worker in self.workers:
                for pipe in (worker.popen.stdin, worker.popen.stdout, worker.popen.stderr):
                    if pipe is not None:
                        try:
                            pipe.close()
                        except OSError:       # stdin of an ssh that is gone
                            pass
            self._close_descriptors()

    # -- starting -----------------------------------------------------------------------------
    def spawn(self, rank, host, command, env, stdin=subprocess.DEVNULL, make_relay=None,
              name=None, fixed_layout=False):
        """Start ``command`` as a worker (:func:`hora.runner.proc.spawn`: its own process
        group, piped output, a parent-death signal) and watch it.

        Args:
            make_relay: ``make_relay(popen)`` returns the worker's relay (see
                :class:`Worker`); None: signals go to its process group.
            fixed_layout: start ``command`` without address-space randomization
                (:mod:`hora.runner.proc`).

        Returns:
            The :class:`Worker`.

        Raises:
            OSError: the command cannot be started.
        """
        popen = proc.spawn(command, env, stdin=stdin, fixed_layout=fixed_layout)
        relay = make_relay(popen) if make_relay is not None else None
        return self.add(Worker(rank, host, popen, relay, name))

    def add(self, worker):
        """Watch ``worker`` (started elsewhere, leading its own process group); its piped
        output goes to the output pump."""
        if self._selector is None:
            raise RuntimeError("open the Supervisor before adding workers")
        self.workers.append(worker)
        popen = worker.popen
        if self._output is not None and popen.stdout is not None:
            self._output.add(worker.rank, popen.stdout, popen.stderr)
        pidfd = proc.open_pidfd(popen.pid)
        if pidfd is not None:
            self._selector.register(pidfd, selectors.EVENT_READ, worker)
        return worker

    @property
    def pids(self):
        """Every worker's pid (also its process-group id), in the order added."""
        return [w.pid for w in self.workers]

    # -- watching -----------------------------------------------------------------------------
    def wait(self, timeout_s=None):
        """Watch until every worker exits, one fails, a forwarded signal comes, or
        ``timeout_s`` passes; return the :class:`Outcome`.

        On a failure the other workers are stopped (SIGTERM); on a signal every worker gets
        that signal; both then get SIGKILL after the grace period.  At the deadline nothing
        is stopped: the caller chooses how (:meth:`dump_tracebacks`, :meth:`stop`,
        :meth:`kill`).
        """
        if self._output is not None and not self._output_started:
            self._output.start()
            self._output_started = True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.running():
            if self._signals:
                return self._interrupted(self._signals[0])
            if self._failure is not None:
                return self._failed()
            if deadline is not None and time.monotonic() >= deadline:
                return Outcome(Ending.TIMED_OUT, 124, failure=self._failure,
                               exits=self._exits(), hung=self.running())
            tick = _WATCH_S if self._watched() else _TICK_S
            self._wait(tick if deadline is None
                       else min(tick, max(0.0, deadline - time.monotonic())))
        if self._failure is not None:
            return self._failed()
        return Outcome(Ending.SUCCEEDED, 0, exits=self._exits())

    def watch(self, timeout_s):
        """For launchers that outlive their workers (elastic jobs): sleep up to
        ``timeout_s`` (less when a worker exits or a signal comes) and return ``(exits,
        signum)``: the exits seen since the last call, and the first forwarded signal
        received (None if none).  Stops nobody: a failure is the caller's to handle."""
        if self._output is not None and not self._output_started:
            self._output.start()
            self._output_started = True
        if not self._signals:
            self._wait(timeout_s)
        exits = [w.exit for w in self.workers
                 if w.exit is not None and id(w) not in self._reported]
        self._reported.update(id(w) for w in self.workers if w.exit is not None)
        return exits, (self._signals[0] if self._signals else None)

    def running(self):
        """The workers not seen to exit yet."""
        return [w for w in self.workers if w.state is WorkerState.RUNNING]

    def _exits(self):
        return [w.exit for w in self.workers]

    def _watched(self):
        """Every running worker has a pidfd: its exit wakes the loop."""
        watched = {key.data for key in self._selector.get_map().values()}
        return all(w in watched for w in self.running())

    def _wait(self, seconds):
        """Sleep up to ``seconds`` (less when a worker exits or a signal comes), then record
        every exit."""
        for key, _ in self._selector.select(seconds):
            if key.fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 512):
                        pass
                except OSError:
                    pass
        self._reap()

    def _reap(self):
        for worker in self.running():
            returncode = worker.popen.poll()
            if returncode is None:
                continue
            if returncode == 0:
                state = WorkerState.SUCCEEDED
            elif not self._stopping:
                state = WorkerState.FAILED
            else:
                state = WorkerState.STOPPED
            worker.state = state
            worker.exit = WorkerExit(worker.rank, worker.host, worker.pid, returncode, state,
                                     time.monotonic(), name=worker.name)
            self._forget_pidfd(worker)
            if state is WorkerState.FAILED:
                if self._failure is None:     # the earliest exit is the root cause
                    self._failure = worker.exit
                log.error("%s", worker.exit.describe())

    def _failed(self):
        others = self.running()
        if others:
            log.error("stopping the %d other rank(s): %s", len(others),
                      ", ".join(str(w.rank) for w in others))
        self.stop(signal.SIGTERM)
        return Outcome(Ending.FAILED, proc.exit_status(self._failure.returncode),
                       failure=self._failure, exits=self._exits())

    def _interrupted(self, signum):
        log.error("received %s; stopping all ranks", signal.Signals(signum).name)
        self.stop(signum)
        return Outcome(Ending.INTERRUPTED, 128 + signum, failure=self._failure, signal=signum,
                       exits=self._exits())

    # -- stopping -----------------------------------------------------------------------------
    def stop(self, sig=signal.SIGTERM):
        """Send ``sig`` to every worker; after ``grace_s``, SIGKILL what is left.

        The grace covers each worker's whole process group, so a worker's own children get
        the same chance to exit cleanly as the worker.  A second SIGINT cuts it short.
        """
        self._stopping = True
        for worker in self.workers:
            worker.signal(sig)
        end = time.monotonic() + self.grace_s
        seen_signals = len(self._signals)
        while time.monotonic() < end:
            if len(self._signals) > seen_signals and self._signals[-1] == signal.SIGINT:
                log.error("second interrupt: killing all ranks now")
                break
            if not self.running() and not proc.live_groups(self.pids):
                return
            self._wait(min(_TICK_S, max(0.0, end - time.monotonic())))
        self.kill()

    def dump_tracebacks(self, sig=signal.SIGUSR1, wait_s=_DUMP_WAIT_S):
        """Ask every running worker for its threads' tracebacks (``sig``: the task runner and
        ``faulthandler.register`` users print them on SIGUSR1); wait up to ``wait_s`` for
        them to be printed.  Exits from now on count as stopped, not failed."""
        self._stopping = True
        for worker in self.running():
            worker.signal(sig)
        end = time.monotonic() + wait_s
        while self.running() and time.monotonic() < end:
            self._wait(min(_TICK_S, max(0.0, end - time.monotonic())))

    def kill(self):
        """SIGKILL every worker's process group that still has processes; reap (bounded)."""
        running = self.running()
        groups = proc.live_groups(self.pids) | {w.pid for w in running}
        if not groups:
            return
        self._stopping = True
        for worker in running:
            log.warning("killing %s (pid %d)", worker.name, worker.pid)
        for pgid in groups:
            proc.signal_group(pgid, signal.SIGKILL)
        end = time.monotonic() + _REAP_WAIT_S
        while self.running() and time.monotonic() < end:
            self._wait(min(_TICK_S, max(0.0, end - time.monotonic())))
        for worker in self.running():
            log.error("%s (pid %d) survived SIGKILL for %.0f s; giving up on it",
                      worker.name, worker.pid, _REAP_WAIT_S)

    def _sweep_groups(self):
        """Stop processes the workers left behind in their process groups (grandchildren)."""
        groups = proc.live_groups(self.pids)
        if not groups:
            return
        log.warning("terminating processes left behind by workers (process groups %s)",
                    ", ".join(map(str, sorted(groups))))
        for pgid in groups:
            proc.signal_group(pgid, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        while groups and time.monotonic() < end:
            threading.Event().wait(_TICK_S)
            groups = proc.live_groups(groups)
        for pgid in groups:
            proc.signal_group(pgid, signal.SIGKILL)

    # -- signals and descriptors ----------------------------------------------------------------
    def _install_signal_handlers(self):
        """Route the forwarded signals into the loop; return a function that undoes it."""
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: signals are not forwarded to workers")
            return lambda: None
        previous = {}
        for signum in self._forward:
            if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                continue                # nohup: the job outlives the terminal
            previous[signum] = signal.signal(signum, self._on_signal)

        def restore():
            for signum, handler in previous.items():
                # None: the old handler was not installed from Python; the default is closest
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        return restore

    def _on_signal(self, signum, frame):
        self._signals.append(signum)
        try:                        # a select() retried after the handler returns at once
            os.write(self._wake_w, b"s")
        except (OSError, TypeError):    # TypeError: the pipe is closed already
            pass

    def _forget_pidfd(self, worker):
        for key in list(self._selector.get_map().values()):
            if key.data is worker:
                self._selector.unregister(key.fd)
                os.close(key.fd)

    def _close_descriptors(self):
        if self._selector is None:
            return
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            if key.fd != self._wake_r:
                os.close(key.fd)
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None
