"""Start a job of worker processes, watch them, and tear the job down as one unit.

:func:`launch` is the Python API behind ``hora run``; :class:`Job` is its engine.  A job:

1. with remote hosts, checks every one of them first, in parallel (:mod:`hora.runner.remote`),
   and fails in seconds naming the host and the reason;
2. serves a :class:`~hora.rendezvous.RendezvousServer` with a fresh secret: on 127.0.0.1 for
   a one-host job, else on every interface, advertised at the address of this machine that
   every host reached during the check (logged);
3. starts one process per rank, each in its own process group (with a parent-death signal,
   so a killed launcher leaves nothing behind) and the ``HORA_*`` environment contract (the
   placement also under horovodrun's ``HOROVOD_*`` names); a remote rank is an ssh process
   whose remote agent gets its environment on stdin and stops the rank when that stdin
   closes (:mod:`hora.runner.remote_agent`);
4. runs a single-threaded monitor loop over :class:`WorkerState`: the first worker to fail
   (by time of exit) fails the job, and every other worker's process group gets SIGTERM,
   then SIGKILL after a grace period; SIGINT/SIGTERM sent to the launcher are forwarded the
   same way; an overall timeout first asks workers for a traceback dump (SIGUSR1), then kills;
5. stops the rendezvous server and the output thread on every exit path.

Layer: runner.  May import hora.errors, hora.config, hora.rendezvous; never hora.core or
hora.backends.
"""
import dataclasses
import enum
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

from ..backends.segments import remove_segments_of
from ..errors import CollectiveTimeoutError, HostCheckError
from ..rendezvous import RendezvousServer, new_secret
from ..rendezvous.netif import routable_addresses
from . import proc
from . import remote
from .hosts import assign_slots, is_local_host, resolve_hosts
from .output import OutputPump
from .remote import SshSettings

__all__ = ["launch", "Job", "JobResult", "WorkerExit", "WorkerState", "worker_env",
           "build_job", "interface_list", "DEFAULT_GRACE_S", "SshSettings"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3.0       # SIGTERM -> SIGKILL; long enough for a clean Python exit
_TICK_S = 0.05              # monitor loop period while stopping, or without pidfds
_WATCH_S = 1.0              # ... while every rank has a pidfd: exits and signals wake it at
                            # once, and a wake-up takes a CPU from a training rank
_DUMP_WAIT_S = 1.0          # after SIGUSR1 on timeout: time for tracebacks to be printed
_REAP_WAIT_S = 10.0         # after SIGKILL: a process in uninterruptible sleep may linger


class WorkerState(enum.Enum):
    """Life cycle of one worker as the monitor loop sees it.

    RUNNING: started, not yet exited.
    SUCCEEDED: exited with code 0.
    FAILED: exited non-zero or by a signal on its own (or before we asked it to stop).
    STOPPED: exited after the launcher signalled it (teardown of a failed or interrupted job).
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
    time: float             # time.monotonic() when the launcher saw the exit

    def describe(self):
        """``"rank 1 (pid 42, host localhost) exited with code 3"``."""
        return (f"rank {self.rank} (pid {self.pid}, host {self.host}) "
                f"{proc.describe_exit(self.returncode)}")


@dataclasses.dataclass
class JobResult:
    """The outcome of :meth:`Job.run`.

    Attributes:
        exitcode: 0, the first failed worker's status (128+signum for a signal), or 128+signum
            of the signal that interrupted the launcher.
        failure: the first worker to fail (by time of exit), or None.
        signal: the signal that interrupted the launcher, or None.
        exits: every worker's exit, by rank.
        store: the rendezvous store's contents when the job ended.
    """
    exitcode: int
    failure: WorkerExit = None
    signal: int = None
    exits: list = dataclasses.field(default_factory=list)
    store: dict = dataclasses.field(default_factory=dict)


class _Worker:
    def __init__(self, slot, popen, remote=False):
        self.slot = slot
        self.popen = popen
        self.remote = remote        # popen is ssh; its stdin reaches the remote agent
        self.state = WorkerState.RUNNING
        self.exit = None

    @property
    def pid(self):
        return self.popen.pid

    def signal(self, sig):
        """Signal the rank: its local process group, or, remotely, through the agent.

        SIGKILL is never relayed: it kills ssh here, and the agent, reading end of file,
        stops the remote rank itself.
        """
        if self.remote and sig != signal.SIGKILL and self.popen.stdin is not None:
            try:
                self.popen.stdin.write(f"signal {int(sig)}\n".encode())
                self.popen.stdin.flush()
                return
            except (OSError, ValueError):
                pass                     # ssh already gone: signal it below
        proc.signal_group(self.pid, sig)

# Variables that describe this machine or this login, not the job: a remote rank gets its
# own from its host and its ssh login.
_NOT_FORWARDED = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "USER", "LOGNAME",
                  "MAIL", "SHELL", "TERM", "DISPLAY", "TMUX", "TMUX_PANE", "SSH_AUTH_SOCK",
                  "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "XAUTHORITY"}


def _forwarded(env):
    return {k: v for k, v in env.items()
            if k not in _NOT_FORWARDED and not k.startswith(("XDG_", "BASH_FUNC_"))}


def worker_env(slot, base_env, addr, port, secret, job_id):
    """The environment of one worker: ``base_env`` plus the ``HORA_*`` contract.

    The placement is also written under ``horovodrun``'s names (``HOROVOD_RANK``, ...,
    ``HOROVOD_HOSTNAME``), which Horovod scripts and their test suites read.
    """
    env = dict(base_env)
    placement = {
        "RANK": str(slot.rank), "SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank), "LOCAL_SIZE": str(slot.local_size),
        "CROSS_RANK": str(slot.cross_rank), "CROSS_SIZE": str(slot.cross_size),
        "HOSTNAME": slot.hostname,
    }
    for name, value in placement.items():
        env[f"HORA_{name}"] = env[f"HOROVOD_{name}"] = value
    env.update({
        "HORA_RENDEZVOUS_ADDR": addr, "HORA_RENDEZVOUS_PORT": str(port),
        "HORA_SECRET": secret, "HORA_JOB_ID": job_id,
    })
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class Job:
    """One run of ``command`` on every slot.  Use once: ``Job(...).run()``.

    Args:
        command: argv of every worker.
        slots: the :class:`~hora.runner.hosts.SlotInfo` of each rank.
        env: extra environment for every worker (over ``os.environ``, under the contract).
        prefix_output: tag forwarded lines with ``[<rank>]<stdout>:``.
        output_filename: directory for per-rank copies of the output, or None.
        timeout_s: overall limit in seconds, or None for no limit.
        grace_s: seconds between SIGTERM and SIGKILL when the job is torn down.
        store: key/values put into the rendezvous store before any worker starts.
        ssh: :class:`SshSettings` for the remote hosts (default: plain ``ssh``).
        network_interface: the interface every rank's data plane binds to (``HORA_IFACE``);
            None: each host binds the address it reaches the rendezvous from.
        check_timeout: seconds for the start-up check of the remote hosts.
    """

    def __init__(self, command, slots, env=None, prefix_output=True, output_filename=None,
                 timeout_s=None, grace_s=DEFAULT_GRACE_S, store=None, ssh=None,
                 network_interface=None, check_timeout=remote.DEFAULT_CHECK_TIMEOUT_S):
        if not command:
            raise ValueError("no command to run")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")
        hosts = list(dict.fromkeys(s.hostname for s in slots))
        self.remote_hosts = [h for h in hosts if not is_local_host(h)]
        self.ssh = ssh or SshSettings()
        self.network_interface = network_interface
        self.check_timeout = check_timeout
        self.command = [os.fspath(c) for c in command]
        self.slots = list(slots)
        self.env = dict(env or {})
        self.prefix_output = prefix_output
        self.output_filename = output_filename
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.store = dict(store or {})
        self.job_id = uuid.uuid4().hex[:12]
        self._workers = []
        self._signals = []
        self._selector = None
        self._wake_r = self._wake_w = None      # the signal handler's wake-up pipe
        self._failure = None
        self._stopping = False      # set once we signal workers: later exits are our doing

    # -- the whole life of a job ---------------------------------------------------------------
    def run(self):
        """Start every worker, monitor them, tear down; return a :class:`JobResult`.

        Raises:
            CollectiveTimeoutError: ``timeout_s`` passed before the job ended (after the
                workers were asked for tracebacks and killed).
        """
        if self._selector is not None:
            raise RuntimeError("a Job runs once; make a new one")
        secret = new_secret()
        addr = self._meeting_address()       # checks the remote hosts first
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        pump = OutputPump(len(self.slots), self.prefix_output, self.output_filename)
        server = RendezvousServer(secret, host="0.0.0.0" if self.remote_hosts else addr,
                                  port=0).start()
        restore = lambda: None  # noqa: E731
        try:
            restore = self._install_signal_handlers()
            for key, value in self.store.items():
                server.put(key, value)
            if self.remote_hosts:
                log.info("rendezvous at %s:%d (reachable from every host); data plane: %s",
                         addr, server.port, f"interface {self.network_interface}"
                         if self.network_interface else "each host binds the address it "
                         "reaches the rendezvous from (--network-interface to choose)")
            self._start_workers(addr, server.port, secret, pump)
            pump.start()
            result = self._monitor()
            result.store = server.items()
            return result
        finally:
            try:
                if self._running():    # leaving on an exception (or a failed start)
                    self._kill_all()
                self._sweep_groups()
            finally:
                # shared-memory segments a rank killed during their set-up left behind
                for path in remove_segments_of([w.pid for w in self._workers]):
                    log.warning("removed %s, left behind by a worker", path)
                restore()
                pump.close()
                for worker in self._workers:
                    for pipe in (worker.popen.stdin, worker.popen.stdout, worker.popen.stderr):
                        if pipe is not None:
                            try:
                                pipe.close()
                            except OSError:       # stdin of an ssh that is gone
                                pass
                self._close_pidfds()
                server.stop()

    def _meeting_address(self):
        """Where every rank reaches the rendezvous; checks the remote hosts on the way.

        Raises:
            HostCheckError: a remote host failed its check, or none of this machine's
                addresses is reachable from every host.
        """
        if not self.remote_hosts:
            return "127.0.0.1"
        # the interface named for the data plane, where this machine has it, is tried first
        candidates = routable_addresses(self.network_interface)
        with socket.create_server(("0.0.0.0", 0)) as probe:   # never accepts: connect is enough
            reports = remote.check_hosts(
                self.remote_hosts, self.ssh, os.getcwd(), sys.executable,
                pythonpath=self._pythonpath(), probe_port=probe.getsockname()[1],
                addresses=candidates, timeout=self.check_timeout)
        addr = remote.choose_address(reports, candidates)
        if addr is None:
            raise HostCheckError({h: f"reaches none of this machine's addresses "
                                     f"{candidates} (reached: {list(r.reach) or 'none'})"
                                  for h, r in reports.items()
                                  if not set(candidates) & set(r.reach)}
                                 or {h: f"reached only {list(r.reach)}"
                                     for h, r in reports.items()})
        return addr

    def _pythonpath(self):
        return self.env.get("PYTHONPATH", os.environ.get("PYTHONPATH")) or None

    def _start_workers(self, addr, port, secret, pump):
        base = {**os.environ, **self.env}
        if self.network_interface:
            base["HORA_IFACE"] = self.network_interface
        for slot in self.slots:
            env = worker_env(slot, base, addr, port, secret, self.job_id)
            if slot.hostname in self.remote_hosts:
                worker = self._start_remote(slot, env)
            else:
                worker = _Worker(slot, proc.spawn(self.command, env))
            popen = worker.popen
            self._workers.append(worker)
            pump.add(slot.rank, popen.stdout, popen.stderr)
            pidfd = proc.open_pidfd(popen.pid)
            if pidfd is not None:
                self._selector.register(pidfd, selectors.EVENT_READ, worker)
            log.debug("started rank %d (pid %d) on %s", slot.rank, popen.pid, slot.hostname)

    def _start_remote(self, slot, env):
        """ssh to the slot's host and hand the agent its spec (secret included) on stdin."""
        shell = remote.agent_shell_command(os.getcwd(), sys.executable, self._pythonpath())
        popen = proc.spawn(remote.remote_argv(self.ssh, slot.hostname, shell),
                           {**os.environ, **self.env}, stdin=subprocess.PIPE)
        worker = _Worker(slot, popen, remote=True)
        spec = {"command": self.command, "env": _forwarded(env), "cwd": os.getcwd(),
                "grace_s": self.grace_s}
        try:
            popen.stdin.write(json.dumps(spec).encode() + b"\n")
            popen.stdin.flush()
        except OSError as e:          # ssh died at once; its exit status tells the rest
            log.error("rank %d: could not hand its spec to %s: %s", slot.rank, slot.hostname, e)
        return worker

    # -- monitoring ----------------------------------------------------------------------------
    def _monitor(self):
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while self._running():
            if self._signals:
                return self._interrupted(self._signals[0])
            if self._failure is not None:
                return self._failed()
            if deadline is not None and time.monotonic() >= deadline:
                self._timed_out()
            tick = _WATCH_S if self._watched() else _TICK_S
            self._wait(tick if deadline is None
                       else min(tick, max(0.0, deadline - time.monotonic())))
        if self._failure is not None:
            return self._failed()
        return JobResult(exitcode=0, exits=self._exits())

    def _watched(self):
        """Every running worker has a pidfd: its exit wakes the monitor."""
        watched = {key.data for key in self._selector.get_map().values()}
        return all(w in watched for w in self._running())

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
        for worker in self._workers:
            if worker.state is not WorkerState.RUNNING:
                continue
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
            worker.exit = WorkerExit(worker.slot.rank, worker.slot.hostname, worker.pid,
                                     returncode, state, time.monotonic())
            self._forget_pidfd(worker)
            if state is WorkerState.FAILED:
                if self._failure is None:     # the earliest exit is the root cause
                    self._failure = worker.exit
                log.error("%s", worker.exit.describe())

    def _running(self):
        return [w for w in self._workers if w.state is WorkerState.RUNNING]

    def _exits(self):
        return [w.exit for w in self._workers]

    # -- ways a job ends ----------------------------------------------------------------------
    def _failed(self):
        others = self._running()
        if others:
            log.error("stopping the %d other rank(s): %s", len(others),
                      ", ".join(str(w.slot.rank) for w in others))
        self._stop_all(signal.SIGTERM)
        return JobResult(exitcode=proc.exit_status(self._failure.returncode),
                         failure=self._failure, exits=self._exits())

    def _interrupted(self, signum):
        log.error("received %s; stopping all ranks", signal.Signals(signum).name)
        self._stop_all(signum)
        return JobResult(exitcode=128 + signum, failure=self._failure, signal=signum,
                         exits=self._exits())

    def _timed_out(self):
        hung = self._running()
        self._stopping = True
        # ask for every thread's traceback (the task runner registers faulthandler on SIGUSR1)
        for worker in hung:
            worker.signal(signal.SIGUSR1)
        end = time.monotonic() + _DUMP_WAIT_S
        while self._running() and time.monotonic() < end:
            self._wait(min(_TICK_S, max(0.0, end - time.monotonic())))
        self._kill_all()
        ranks = "\n".join(f"  [rank {w.slot.rank}] still running (pid {w.pid}, "
                          f"host {w.slot.hostname})" for w in hung)
        message = (f"hora job {self.job_id} timed out after {self.timeout_s:g} s; "
                   f"{len(hung)} of {len(self._workers)} rank(s) were still running (their "
                   f"tracebacks, if they could dump them, are in the output above):\n{ranks}")
        log.error("%s", message)
        raise CollectiveTimeoutError(message)

    # -- stopping ----------------------------------------------------------------------------
    def _stop_all(self, sig):
        """Send ``sig`` to every worker's process group; after ``grace_s``, SIGKILL the rest.

        The grace covers the whole group, so a worker's own children get the same chance to
        exit cleanly as the worker.
        """
        self._stopping = True
        for worker in self._workers:
            worker.signal(sig)
        end = time.monotonic() + self.grace_s
        seen_signals = len(self._signals)
        while time.monotonic() < end:
            if len(self._signals) > seen_signals and self._signals[-1] == signal.SIGINT:
                log.error("second interrupt: killing all ranks now")
                break
            if not self._running() and not proc.live_groups(self._pgids()):
                return
            self._wait(min(_TICK_S, max(0.0, end - time.monotonic())))
        self._kill_all()

    def _pgids(self):
        return [w.pid for w in self._workers]        # each worker leads its own group

    def _kill_all(self):
        """SIGKILL every worker's process group that still has processes; reap (bounded)."""
        running = self._running()
        groups = proc.live_groups(self._pgids()) | {w.pid for w in running}
        if not groups:
            return
        self._stopping = True
        for worker in running:
            log.warning("killing rank %d (pid %d)", worker.slot.rank, worker.pid)
        for pgid in groups:
            proc.signal_group(pgid, signal.SIGKILL)
        end = time.monotonic() + _REAP_WAIT_S
        while self._running() and time.monotonic() < end:
            self._wait(min(_TICK_S, max(0.0, end - time.monotonic())))
        for worker in self._running():
            log.error("rank %d (pid %d) survived SIGKILL for %.0f s; giving up on it",
                      worker.slot.rank, worker.pid, _REAP_WAIT_S)

    def _sweep_groups(self):
        """Stop processes the workers left behind in their process groups (grandchildren)."""
        groups = proc.live_groups(self._pgids())
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

    # -- signals and descriptors ---------------------------------------------------------------
    def _install_signal_handlers(self):
        """Route SIGINT/SIGTERM into the monitor loop; return a function that undoes it."""
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: SIGINT/SIGTERM are not forwarded to workers")
            return lambda: None
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
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
        except OSError:
            pass

    def _forget_pidfd(self, worker):
        for key in list(self._selector.get_map().values()):
            if key.data is worker:
                self._selector.unregister(key.fd)
                os.close(key.fd)

    def _close_pidfds(self):
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


def interface_list(value):
    """The network interfaces named by ``value``, in Horovod's forms, as a list of names.

    Args:
        value: None, ``"eth0"``, ``"eth0,eth1"`` (``--network-interfaces``), or a list or
            set of names (``--network-interface`` given several times).

    Raises:
        TypeError: ``value`` is none of these.
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple, set, frozenset)) and all(
            isinstance(v, str) for v in value):
        items = [part for v in value for part in v.split(",")]
    else:
        raise TypeError(f"network interfaces must be a name, a comma-separated string or a "
                        f"list of names, got {value!r}")
    return list(dict.fromkeys(i.strip() for i in items if i.strip()))


def _one_interface(value):
    """The interface the data plane binds to: hora's binds one per host (Horovod's may use
    several), so of several the first is used, and a warning says so."""
    names = interface_list(value)
    if len(names) > 1:
        log.warning("hora's data plane binds one network interface: using %s, not %s",
                    names[0], ", ".join(names[1:]))
    return names[0] if names else None


def _check_timeout(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not value > 0):
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")


def launch(command, np, hosts=None, hostfile=None, env=None, prefix_output=True,
           output_filename=None, timeout_s=None, start_timeout=None, grace_s=DEFAULT_GRACE_S,
           ssh=None, network_interface=None, check_timeout=remote.DEFAULT_CHECK_TIMEOUT_S):
    """Run ``command`` as ``np`` worker processes and wait for the job to end.

    Example:
        >>> status = launch(["python", "train.py"], np=4)      # doctest: +SKIP
        >>> status = launch(["python", "train.py"], np=8, hosts="a:4,b:4",
        ...                 ssh=SshSettings(port=2222))          # doctest: +SKIP

    Args:
        command: the argv every worker runs.
        np: number of processes (ranks).
        hosts: ``"host1:4,host2:2"`` (``-H``), or a list of HostSpec; default ``localhost:np``.
        hostfile: path of a hostfile (exclusive with ``hosts``).
        env: extra environment variables for every worker.
        prefix_output: tag each forwarded line with ``[<rank>]<stdout>:`` / ``<stderr>``.
        output_filename: also write each rank's output under ``DIR/rank.<r>/``.
        timeout_s: overall limit in seconds (None: no limit).
        start_timeout: seconds for every rank to reach ``hora.init()`` (``HORA_START_TIMEOUT``
            for the workers; None keeps their default).
        grace_s: seconds between SIGTERM and SIGKILL when the job is torn down.
        ssh: :class:`SshSettings` for remote hosts (port, identity file, command template).
        network_interface: interface the data plane binds to on every host (``HORA_IFACE``);
            Horovod's forms of several (``"eth0,eth1"``, a list) use the first.
        check_timeout: seconds for the start-up check of the remote hosts.

    Returns:
        The job's exit status: 0; the first failing worker's code (128+signum when it was
        killed by a signal); or 128+signum when the launcher got SIGINT/SIGTERM.

    Raises:
        ValueError: bad arguments (``np`` larger than the slots, both hosts and hostfile, ...).
        HostCheckError: a remote host is unreachable, refuses ssh, lacks python or hora, or
            runs another hora version (raised within ``check_timeout``, before any rank runs).
        CollectiveTimeoutError: ``timeout_s`` passed; the message lists the ranks still running.
    """
    job = build_job(command, np, hosts=hosts, hostfile=hostfile, env=env,
                    prefix_output=prefix_output, output_filename=output_filename,
                    timeout_s=timeout_s, start_timeout=start_timeout, grace_s=grace_s,
                    ssh=ssh, network_interface=network_interface, check_timeout=check_timeout)
    return job.run().exitcode


def build_job(command, np, hosts=None, hostfile=None, env=None, prefix_output=True,
              output_filename=None, timeout_s=None, start_timeout=None,
              grace_s=DEFAULT_GRACE_S, store=None, ssh=None, network_interface=None,
              check_timeout=remote.DEFAULT_CHECK_TIMEOUT_S):
    """Validate launch arguments and build the :class:`Job` (shared with ``run``)."""
    if isinstance(command, (str, bytes)):
        raise TypeError(f"command must be a list of arguments, got the string {command!r}")
    _check_timeout("timeout_s", timeout_s)
    _check_timeout("start_timeout", start_timeout)
    _check_timeout("check_timeout", check_timeout)
    slots = assign_slots(resolve_hosts(np, hosts, hostfile), np)
    network_interface = _one_interface(network_interface)
    log.debug("%d rank(s) on %s: %s", np, ", ".join(dict.fromkeys(s.hostname for s in slots)),
              " ".join(os.fspath(c) for c in command))
    env = dict(env or {})
    if start_timeout is not None:
        env["HORA_START_TIMEOUT"] = repr(float(start_timeout))
    return Job(list(command), slots, env=env, prefix_output=prefix_output,
               output_filename=output_filename, timeout_s=timeout_s, grace_s=grace_s,
               store=store, ssh=ssh, network_interface=network_interface,
               check_timeout=check_timeout)
