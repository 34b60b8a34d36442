"""Start a job of worker processes, watch them, and tear the job down as one unit.

:func:`launch` is the Python API behind ``hora run``; :class:`Job` runs one
:class:`~hora.runner.launch_config.LaunchConfig`.  A job:

1. with remote hosts, checks every one of them first, in parallel (:mod:`hora.runner.remote`),
   and fails in seconds naming the host and the reason;
2. serves a :class:`~hora.rendezvous.RendezvousServer` with a fresh secret: on 127.0.0.1 for
   a one-host job, else on every interface, advertised at the address of this machine that
   every host reached during the check (logged);
3. starts one process per rank, each in its own process group (with a parent-death signal,
   so a killed launcher leaves nothing behind) and the ``HORA_*`` environment contract
   (:mod:`hora.runner.contract`); a remote rank is an ssh process whose remote agent gets
   its environment on stdin and stops the rank when that stdin closes
   (:mod:`hora.runner.remote_agent`);
4. hands the ranks to the :class:`~hora.runner.supervisor.Supervisor`: the first worker to
   fail (by time of exit) fails the job, and every other worker's process group gets
   SIGTERM, then SIGKILL after a grace period; SIGINT/SIGTERM/SIGHUP sent to the launcher
   are forwarded the same way; an overall timeout first asks workers for a traceback dump
   (SIGUSR1), then kills;
5. stops the rendezvous server and the output thread, and removes the shared-memory
   segments of ranks killed during their set-up, on every exit path.

Layer: runner.  May import hora.errors, hora.config, hora.rendezvous; never hora.core or
hora.backends.
"""
import collections
import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import uuid

from ..config import env_value, remove_segments_of
from ..rendezvous.host import kernel_id, open_files, usable_cpus
from ..errors import CollectiveTimeoutError, HostCheckError, OpenFilesLimitError
from ..rendezvous import RendezvousServer, new_secret
from ..rendezvous.netif import routable_addresses
from . import proc, remote
from .contract import forwarded, job_env, worker_env
from .hosts import assign_slots, is_local_host, resolve_hosts
from .launch_config import LaunchConfig, interface_list, one_interface
from .monitor import Monitor
from .output import OutputPump
from .remote import SshSettings
from .supervisor import (DEFAULT_GRACE_S, Ending, Supervisor, WorkerExit,  # noqa: F401
                         WorkerState)

__all__ = ["launch", "Job", "JobResult", "LaunchConfig", "WorkerExit", "WorkerState",
           "worker_env", "interface_list", "DEFAULT_GRACE_S", "SshSettings"]

log = logging.getLogger(__name__)

# the launcher's open files: a rank's two output pipes, its pidfd and its connection to the
# rendezvous while it starts (a remote rank's ssh also has a pipe for its stdin); and what
# the launcher holds for itself
_FILES_A_RANK = 4
_FILES_A_REMOTE_RANK = 5
_FILES_BASE = 64

TORCH_STORE_PORT = 29500    # torchrun's default MASTER_PORT: rank 0 on another host serves it


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


@contextlib.contextmanager
def serving(server, config):
    """While the block runs, the job's rendezvous ``server`` holds ``config.store`` and, with
    ``config.monitor``, the status table draws from it (:mod:`hora.runner.monitor`)."""
    monitor = Monitor(server) if config.monitor else None
    try:
        for key, value in config.store.items():
            server.put(key, value)
        if monitor is not None:
            monitor.start()
        yield
    finally:
        if monitor is not None:
            monitor.stop()


def reserve_open_files(local, remote):
    """Raise this process's limit of open files to what a launcher of ``local`` ranks on
    this machine and ``remote`` ranks elsewhere needs (its ranks inherit it); raise
    :class:`~hora.errors.OpenFilesLimitError` when the hard limit is lower."""
    needed = _FILES_BASE + _FILES_A_RANK * local + _FILES_A_REMOTE_RANK * remote
    limit = open_files(needed)
    if limit < needed:
        raise OpenFilesLimitError(needed, limit, local + remote)


def _agent_relay(popen):
    """Signals for a remote rank travel to its agent as ``signal <n>`` lines on ssh's stdin
    (ssh carries no signals without a terminal); False once ssh is gone."""
    def relay(sig):
        if popen.stdin is None:
            return False
        try:
            popen.stdin.write(f"signal {int(sig)}\n".encode())
            popen.stdin.flush()
            return True
        except (OSError, ValueError):
            return False             # ssh already gone: its process group gets the signal
    return relay


class Job:
    """One run of ``config.command`` on every slot.  Use once: ``Job(config).run()``.

    Raises:
        ValueError: the hosts cannot hold ``config.np`` ranks, or do not parse.
        SettingError: rank 0 runs on this machine and could not write the timeline file
            (``HORA_TIMELINE``).
        TypeError: ``config.network_interface`` is of no form Horovod accepts.
    """

    def __init__(self, config):
        self.config = config
        self.slots = assign_slots(resolve_hosts(config.np, config.hosts, config.hostfile),
                                  config.np)
        self.network_interface = one_interface(config.network_interface)
        hosts = list(dict.fromkeys(s.hostname for s in self.slots))
        self.remote_hosts = [h for h in hosts if not is_local_host(h)]
        if self.slots[0].hostname not in self.remote_hosts:
            config.check_timeline()         # rank 0 writes it here: fail before it starts
        self.ssh = config.ssh or SshSettings()
        self.job_id = uuid.uuid4().hex[:12]
        self._supervisor = None
        self._shared = None     # remote.Multiplex: the ssh connections a host's ranks share
        self._machines = {}     # remote host -> (kernel id, CPUs), from its start-up check
        self._refusals = {}     # remote host -> why it refuses the fixed layout ("" if it does not)
        log.debug("%d rank(s) on %s: %s", config.np, ", ".join(hosts),
                  " ".join(config.command))

    # -- the whole life of a job ---------------------------------------------------------------
    def run(self):
        """Start every worker, supervise them, tear down; return a :class:`JobResult`.

        Raises:
            CollectiveTimeoutError: ``timeout_s`` passed before the job ended (after the
                workers were asked for tracebacks and killed).
            HostCheckError: a remote host failed its start-up check.
            OpenFilesLimitError: this process may not open the files ``np`` ranks need.
            OSError: a worker's command cannot be started.
        """
        if self._supervisor is not None:
            raise RuntimeError("a Job runs once; make a new one")
        config = self.config
        remote = sum(s.hostname in self.remote_hosts for s in self.slots)
        reserve_open_files(len(self.slots) - remote, remote)
        secret = new_secret()
        addr = self._meeting_address()       # checks the remote hosts first
        pump = OutputPump(len(self.slots), config.prefix_output, config.output_filename)
        self._supervisor = supervisor = Supervisor(config.grace_s, output=pump)
        server = RendezvousServer(secret, host="0.0.0.0" if self.remote_hosts else addr,
                                  port=0).start()
        try:
            with serving(server, config), supervisor:
                if self.remote_hosts:
                    log.info("rendezvous at %s:%d (reachable from every host); data plane: %s",
                             addr, server.port, f"interface {self.network_interface}"
                             if self.network_interface else "each host binds the address it "
                             "reaches the rendezvous from (--network-interface to choose)")
                self._start_workers(addr, server.port, secret)
                outcome = supervisor.wait(config.timeout_s)
                if outcome.ending is Ending.TIMED_OUT:
                    self._timed_out(outcome.hung)
                return JobResult(exitcode=outcome.exitcode, failure=outcome.failure,
                                 signal=outcome.signal, exits=outcome.exits,
                                 store=server.items())
        finally:
            try:
                # shared-memory segments a rank killed during their set-up left behind
                for path in remove_segments_of(supervisor.pids):
                    log.warning("removed %s, left behind by a worker", path)
            finally:
                server.stop()
                self._end_sharing()

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
        self._shared = self._sharing()
        try:
            return self._check_hosts(candidates)
        except BaseException:
            self._end_sharing()
            raise

    def _check_hosts(self, candidates):
        """Check the remote hosts; return the first of ``candidates`` that all reached."""
        # the probe never accepts: that a host connects is enough
        with socket.create_server(("0.0.0.0", 0)) as probe:
            reports = remote.check_hosts(
                self.remote_hosts, self.ssh, os.getcwd(), sys.executable,
                pythonpath=self._pythonpath(), probe_port=probe.getsockname()[1],
                addresses=candidates, timeout=self.config.check_timeout, shared=self._shared)
        self._machines = {h: (r.kernel, r.cpus) for h, r in reports.items()}
        self._refusals = {h: r.layout_refused for h, r in reports.items()}
        addr = remote.choose_address(reports, candidates)
        if addr is None:
            raise HostCheckError({h: f"reaches none of this machine's addresses "
                                     f"{candidates} (reached: {list(r.reach) or 'none'})"
                                  for h, r in reports.items()
                                  if not set(candidates) & set(r.reach)}
                                 or {h: f"reached only {list(r.reach)}"
                                     for h, r in reports.items()})
        return addr

    def _sharing(self):
        """The ssh connections the remote hosts' sessions share (HORA_SSH_SESSIONS), or
        None: one connection a rank (0, or an ``--ssh-command`` template)."""
        sessions = env_value("SSH_SESSIONS", {**os.environ, **self.config.env})
        if not sessions or self.ssh.command is not None:
            return None
        try:
            return remote.Multiplex(sessions, self._host_slots())
        except OSError as e:
            log.warning("each rank logs in over ssh alone: %s", e)
            return None

    def _host_slots(self):
        """``{host: the ranks it runs}``."""
        return collections.Counter(s.hostname for s in self.slots)

    def _end_sharing(self):
        if self._shared is not None:
            self._shared.close()

    def _pythonpath(self):
        return self.config.env.get("PYTHONPATH", os.environ.get("PYTHONPATH")) or None

    def _start_workers(self, addr, port, secret):
        config = self.config
        base = job_env(os.environ, config.env, self.network_interface, config.start_timeout)
        if config.monitor:
            base["HORA_MONITOR"] = "1"
        fixed = self._fixed_layout()
        store = self._torch_store(addr)
        for slot in self.slots:
            env = worker_env(slot, base, addr, port, secret, self.job_id, store)
            if slot.hostname in self.remote_hosts:
                worker = self._start_remote(slot, env, base, slot.hostname in fixed)
            else:
                worker = self._supervisor.spawn(slot.rank, slot.hostname, config.command, env,
                                                fixed_layout=slot.hostname in fixed)
            log.debug("started rank %d (pid %d) on %s", slot.rank, worker.pid, slot.hostname)

    def _torch_store(self, addr):
        """Where rank 0 will serve torch.distributed's store (``MASTER_ADDR``,
        ``MASTER_PORT``): a port free on this machine when rank 0 runs here, else torchrun's
        default port on rank 0's host."""
        host = self.slots[0].hostname
        if host in self.remote_hosts:
            return host, TORCH_STORE_PORT
        with socket.socket() as s:
            s.bind(("", 0))
            return addr, s.getsockname()[1]

    def _fixed_layout(self):
        """The hosts whose ranks start without address-space randomization
        (``HORA_RANK_ASLR``: :func:`hora.runner.proc.layout_hosts`)."""
        policy = self._layout_policy()
        ranks = {}
        for slot in self.slots:
            ranks[slot.hostname] = ranks.get(slot.hostname, 0) + 1
        here = self._this_machine()         # (a remote host's CPUs: its check's)
        machines = {h: self._machines.get(h, ("", 0)) if h in self.remote_hosts else here
                    for h in ranks}
        fixed = proc.layout_hosts(policy, ranks, machines)
        refused = {h: why for h in fixed
                   if (why := self._refusals.get(h) if h in self.remote_hosts
                       else proc.fixed_layout_refused())}
        fixed -= set(refused)
        self._tell_refused(policy, refused)
        if fixed:
            log.debug("ranks without address-space randomization (HORA_RANK_ASLR=%s) on %s",
                      policy, ", ".join(sorted(fixed)))
        return fixed

    @staticmethod
    def _tell_refused(policy, refused):
        """Say that the hosts of ``refused`` (``{host: why}``) keep randomized ranks although
        ``HORA_RANK_ASLR`` = ``policy`` would fix their layout: a warning when the user asked
        for it (``off``), a debug line under ``auto`` (there the fixed layout is only a
        speed-up)."""
        say = log.warning if policy == "off" else log.debug
        for why in sorted(set(refused.values())):
            hosts = ", ".join(sorted(h for h, w in refused.items() if w == why))
            say("HORA_RANK_ASLR=%s: the ranks on %s keep randomized address layouts: %s",
                policy, hosts, why)

    @staticmethod
    def _this_machine():
        """``(kernel id, CPUs)`` of this machine, as :func:`hora.runner.proc.layout_hosts`
        takes a host's."""
        return kernel_id(), usable_cpus()

    def _layout_policy(self):
        """``HORA_RANK_ASLR`` for the ranks (the job's environment over this process's)."""
        return env_value("RANK_ASLR", {**os.environ, **self.config.env}).lower()

    def _start_remote(self, slot, env, base, fixed_layout=False):
        """ssh to the slot's host and hand the agent its spec (secret included) on stdin."""
        shell = remote.agent_shell_command(os.getcwd(), sys.executable, self._pythonpath())
        shared = self._shared.options(slot.hostname) if self._shared else ()
        worker = self._supervisor.spawn(slot.rank, slot.hostname,
                                        remote.remote_argv(self.ssh, slot.hostname, shell,
                                                           shared),
                                        base, stdin=subprocess.PIPE,
                                        make_relay=_agent_relay)
        spec = {"command": self.config.command, "env": forwarded(env), "cwd": os.getcwd(),
                "grace_s": self.config.grace_s, "fixed_layout": fixed_layout}
        try:
            worker.popen.stdin.write(json.dumps(spec).encode() + b"\n")
            worker.popen.stdin.flush()
        except OSError as e:          # ssh died at once; its exit status tells the rest
            log.error("rank %d: could not hand its spec to %s: %s", slot.rank, slot.hostname, e)
        return worker

    def _timed_out(self, hung):
        """Ask the hung ranks for their tracebacks, kill the job, raise naming them."""
        supervisor = self._supervisor
        supervisor.dump_tracebacks()
        supervisor.kill()
        ranks = "\n".join(f"  [rank {w.rank}] still running (pid {w.pid}, "
                          f"host {w.host})" for w in hung)
        message = (f"hora job {self.job_id} timed out after {self.config.timeout_s:g} s; "
                   f"{len(hung)} of {len(supervisor.workers)} rank(s) were still running "
                   f"(their tracebacks, if they could dump them, are in the output "
                   f"above):\n{ranks}")
        log.error("%s", message)
        raise CollectiveTimeoutError(message)


def launch(command, np, **options):
    """Run ``command`` as ``np`` worker processes and wait for the job to end.

    Example:
        >>> status = launch(["python", "train.py"], np=4)      # doctest: +SKIP
        >>> status = launch(["python", "train.py"], np=8, hosts="a:4,b:4",
        ...                 ssh=SshSettings(port=2222))          # doctest: +SKIP

    Args:
        command: the argv every worker runs.
        np: number of processes (ranks).
        **options: the other fields of :class:`LaunchConfig`: ``hosts``, ``hostfile``,
            ``env``, ``prefix_output``, ``output_filename``, ``timeout_s``,
            ``start_timeout``, ``grace_s``, ``store``, ``ssh``, ``network_interface``,
            ``check_timeout``.

    Returns:
        The job's exit status: 0; the first failing worker's code (128+signum when it was
        killed by a signal); or 128+signum when the launcher got SIGINT/SIGTERM/SIGHUP.

    Raises:
        ValueError: bad arguments (``np`` larger than the slots, both hosts and hostfile, ...).
        HostCheckError: a remote host is unreachable, refuses ssh, lacks python or hora, or
            runs another hora version (raised within ``check_timeout``, before any rank runs).
        CollectiveTimeoutError: ``timeout_s`` passed; the message lists the ranks still running.
    """
    return Job(LaunchConfig(command, np, **options)).run().exitcode
