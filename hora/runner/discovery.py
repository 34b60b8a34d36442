"""The host discovery script of an elastic job (``--host-discovery-script``): running it,
bounding each run, and reading the hosts it prints.

Each run of the script is a process group of its own (its own session), with the launcher's
parent-death signal: a run that outlives ``timeout_s`` is killed with its children, and
so is whatever a finished run left behind in its group (a background child still holding
the output) and a run still going when the launcher closes the poller.  The output goes to
temporary files, not pipes, so a child that keeps a pipe open cannot hold the launcher up.
The bound is ``HORA_DISCOVERY_TIMEOUT`` seconds when that is set, else 10 s (Horovod has no
bound and so no name for it).

Runs are started and collected without blocking (:meth:`Discovery.start`,
:meth:`Discovery.collect`), so the launcher's loop keeps watching its workers while a slow
script runs; :meth:`Discovery.poll` is the blocking form for the first answer.

Layer: runner.  Imports hora.errors and hora.runner.{hosts,proc}.
"""
import logging
import os
import signal
import subprocess
import tempfile
import time

from ..config import DECLARED, env_value
from ..errors import HoraError
from . import proc
from .hosts import HostSpec

__all__ = ["Discovery", "parse_discovery_output", "discovery_timeout", "DISCOVERY_PERIOD_S",
           "DISCOVERY_TIMEOUT_S"]

log = logging.getLogger(__name__)

# From one answer to the next run, as Horovod's DISCOVER_HOSTS_FREQUENCY_SECS.
DISCOVERY_PERIOD_S = 1.0
# the longest one run may take (Horovod waits without bound); HORA_DISCOVERY_TIMEOUT sets it
DISCOVERY_TIMEOUT_S = DECLARED["DISCOVERY_TIMEOUT"].default
_WAIT_STEP_S = 0.02             # how often the blocking poll looks at a run in flight
_STDERR_TAIL = 300              # characters of a failed run's stderr quoted in its error


def parse_discovery_output(text, default_slots):
    """The hosts a discovery script printed: ``host`` or ``host:slots`` lines (blank lines
    and ``#`` comments skipped), as HostSpecs in the order printed.

    Raises:
        ValueError: a line that is not ``host[:slots]``, or a host listed twice.
    """
    specs = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        host = host.strip()
        if not host or " " in host:
            raise ValueError(f"line {number}: {raw!r} is not host[:slots]")
        try:
            count = int(slots) if slots.strip() else default_slots
        except ValueError:
            raise ValueError(f"line {number}: {raw!r}: slots must be a number") from None
        if count < 1:
            raise ValueError(f"line {number}: {raw!r}: slots must be at least 1")
        if any(s.hostname == host for s in specs):
            raise ValueError(f"line {number}: host {host!r} is listed twice")
        specs.append(HostSpec(host, count))
    return specs


def discovery_timeout(env=None):
    """The longest one run of the script may take: ``HORA_DISCOVERY_TIMEOUT`` seconds in
    ``env`` (default ``os.environ``) when set, else :data:`DISCOVERY_TIMEOUT_S`.

    Raises:
        SettingError: the variable is not a number of seconds above 0 (a ``ValueError``).
    """
    return env_value("DISCOVERY_TIMEOUT", env)


class _Run:
    """One run of the script: a shell in a session of its own, output in temporary files."""

    def __init__(self, script, deadline):
        self.deadline = deadline
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        try:
            self.popen = subprocess.Popen(
                script, shell=True, stdin=subprocess.DEVNULL, stdout=self._out,
                stderr=self._err, start_new_session=True, close_fds=True,
                preexec_fn=proc.parent_death_hook())
        except BaseException:
            self._close_files()
            raise

    def exited(self):
        """Whether the shell has exited.  It is not reaped here: until :meth:`end` reaps
        it, its pid (the group's id) cannot be reused, so killing the group is safe."""
        try:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True                 # already reaped
        return info is not None

    def end(self):
        """Kill what is left of the group, reap the shell; return ``(returncode, stdout,
        stderr)`` (returncode None: it had not exited and was killed)."""
        finished = self.exited()
        proc.signal_group(self.popen.pid, signal.SIGKILL)
        returncode = self.popen.wait()
        try:
            out, err = self._read(self._out), self._read(self._err)
        finally:
            self._close_files()
        return (returncode if finished else None), out, err

    @staticmethod
    def _read(f):
        f.seek(0)
        return f.read().decode("utf-8", "replace")

    def _close_files(self):
        self._out.close()
        self._err.close()


class Discovery:
    """Runs the discovery script: the first failure is fatal, later ones are logged and the
    hosts found before are kept (Horovod's rule).  A run that takes longer than
    ``timeout_s`` is a failure; it is killed, its children too.

    Args:
        script: a shell command that prints the hosts, ``host[:slots]`` a line.
        default_slots: the slots of a host whose line gives none.
        timeout_s: the longest one run may take (None: :func:`discovery_timeout`).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: ``HORA_DISCOVERY_TIMEOUT`` is not a number of seconds above 0.
    """

    def __init__(self, script, default_slots, timeout_s=None, clock=time.monotonic):
        self.script = script
        self.default_slots = default_slots
        self.timeout_s = discovery_timeout() if timeout_s is None else timeout_s
        self._clock = clock
        self.hosts = None           # the last good answer
        self._run = None            # the run in flight

    @property
    def running(self):
        """Whether a run is in flight."""
        return self._run is not None

    def poll(self):
        """Run the script to its end or its timeout; return the hosts (the last good ones
        when this run failed).

        Raises:
            HoraError: the first run failed.
        """
        self.start()
        try:
            while True:
                hosts = self.collect()
                if hosts is not None:
                    return hosts
                time.sleep(min(_WAIT_STEP_S, max(0.0, self._run.deadline - self._clock())))
        finally:
            self.close()                # interrupted: the run goes with the caller

    def start(self):
        """Start a run in the background, unless one is in flight.

        Raises:
            HoraError: the first run could not start.
        """
        if self._run is None:
            try:
                self._run = _Run(self.script, self._clock() + self.timeout_s)
            except OSError as e:
                self._failed(e)

    def collect(self):
        """The answer of the run in flight once it has one: the hosts it printed, or the
        last good ones when it failed or ran past its timeout.  None: no run in flight, or
        it is still running.

        Raises:
            HoraError: the first run failed.
        """
        run = self._run
        if run is None:
            return None
        timed_out = self._clock() >= run.deadline
        if not run.exited() and not timed_out:
            return None
        self._run = None
        returncode, out, err = run.end()
        try:
            if returncode is None:
                raise HoraError(f"did not finish within {self.timeout_s:g} s; killed")
            if returncode != 0:
                raise HoraError(f"{proc.describe_exit(returncode)}: "
                                f"{err.strip()[-_STDERR_TAIL:]}")
            hosts = parse_discovery_output(out, self.default_slots)
        except (HoraError, ValueError) as e:
            return self._failed(e)
        log.debug("discovered hosts: %s", ", ".join(f"{h.hostname}:{h.slots}" for h in hosts))
        self.hosts = hosts
        return hosts

    def close(self):
        """Kill the run in flight, if any, and its children."""
        run, self._run = self._run, None
        if run is not None:
            run.end()

    def _failed(self, error):
        message = f"--host-discovery-script {self.script!r}: {error}"
        if self.hosts is None:
            raise HoraError(message) from error
        log.warning("%s; keeping the hosts found before", message)
        return self.hosts
