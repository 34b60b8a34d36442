"""Remote hosts for ``hora run``: the ssh command line, the start-up check, the address to meet at.

A remote rank runs as ``<ssh> host 'cd CWD && exec PYTHON -m hora.runner.remote_agent'``.  The
agent reads its spec (command, environment, job secret included) as one JSON line on stdin, so
the secret never appears in a command line that ``ps`` shows; it then runs the command and
relays control lines from stdin as signals (see :mod:`hora.runner.remote_agent`).

Before any rank starts, :func:`check_hosts` logs into every remote host in parallel, with a
deadline, and runs a short Python check there: the working directory exists, the Python
executable exists, ``import hora`` works and its version is ours, and which of this
machine's addresses the host can reach (so the rendezvous is served at one that every host
reaches); it also reports the host's kernel (its boot id) and CPUs, for
:func:`hora.runner.proc.layout_hosts`.  A host that fails is reported by name with the
reason, in seconds.

Layer: runner.  Imports nothing from hora but :mod:`hora.errors` and :mod:`hora.version`.
"""
import concurrent.futures
import dataclasses
import json
import logging
import os
import secrets
import shlex
import stat
import subprocess
import tempfile
import time

from ..errors import HostCheckError
from ..version import __version__

__all__ = ["SshSettings", "Multiplex", "remote_argv", "agent_shell_command", "check_hosts",
           "HostReport", "choose_address", "DEFAULT_CHECK_TIMEOUT_S"]

log = logging.getLogger(__name__)

DEFAULT_CHECK_TIMEOUT_S = 15.0   # the whole start-up check, every host at once
_CONNECT_TIMEOUT_S = 5           # ssh's own TCP connect limit, inside the above
_PROBE_TIMEOUT_S = 1.0           # a remote host trying one of our addresses
_PERSIST_S = 10                  # a shared connection outlives its last session this long

_OK, _NO_HORA, _NO_CWD, _NO_PY = "HORA-CHECK-OK", "HORA-CHECK-NOHORA", "HORA-CHECK-NOCWD", \
    "HORA-CHECK-NOPY"

# Runs on the remote host: `python -c CHECK port addr...`.  Prints one line starting with
# HORA-CHECK-OK (JSON: version, python, the addresses it reached, the kernel's boot id, the
# CPUs it may use, why its ranks could not have the fixed layout) or HORA-CHECK-NOHORA.
_CHECK = """
import json, os, socket, sys
try:
    import hora
    version = hora.__version__
except Exception as e:
    print("HORA-CHECK-NOHORA", type(e).__name__ + ": " + str(e)); sys.exit(97)
port, reach = int(sys.argv[1]), []
try:
    with open("/proc/sys/kernel/random/boot_id") as f:
        kernel = f.read().strip()
except OSError:
    kernel = ""
try:
    cpus = len(os.sched_getaffinity(0))
except (AttributeError, OSError):
    cpus = os.cpu_count() or 1
try:
    from hora.runner.proc import fixed_layout_refused
    refused = fixed_layout_refused() or ""
except Exception as e:
    refused = "could not tell: " + str(e)
for addr in sys.argv[2:]:
    try:
        socket.create_connection((addr, port), %r).close()
        reach.append(addr)
    except OSError:
        pass
print("HORA-CHECK-OK", json.dumps({"version": version, "python": sys.version.split()[0],
                                   "reach": reach, "kernel": kernel, "cpus": cpus,
                                   "layout_refused": refused}))
""" % _PROBE_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class SshSettings:
    """How the launcher reaches a remote host.

    Attributes:
        port: ssh port (``-p``), or None for ssh's default.
        identity_file: private key (``-i``), or None.
        command: a template replacing ``ssh``: ``{host}`` is replaced by the host (else the
            host is appended) and ``{command}`` by the remote shell command as one argument
            (else it is appended as the last argument, as ssh takes it).  Example:
            ``"ip netns exec {host} sh -c {command}"``.
    """
    port: int = None
    identity_file: str = None
    command: str = None

    def __post_init__(self):
        if self.port is not None and (isinstance(self.port, bool) or not 0 < int(self.port)
                                      < 65536):
            raise ValueError(f"ssh port must be 1..65535, got {self.port!r}")
        if self.command is not None and not shlex.split(self.command):
            raise ValueError("--ssh-command is empty")

    def is_ssh(self):
        """True when the remote command is ssh itself (so ssh's failures can be read)."""
        return self.command is None or os.path.basename(shlex.split(self.command)[0]) == "ssh"


class Multiplex:
    """ssh sessions to a host share its connections: OpenSSH's connection sharing
    (``ControlMaster``), so a host's ranks and its start-up check make one key exchange and
    one login for every ``sessions`` of them, where each made its own (at N = 64 in hosts of
    8 on 2 CPUs, the logins were most of the job's start-up).  ``sessions`` stays under
    sshd's own limit of sessions a connection (``MaxSessions``, 10 by default).

    The shared connections run in the background; :meth:`close` ends them (each also ends
    by itself ``_PERSIST_S`` after its last session).  Only for plain ssh: an
    ``--ssh-command`` template is run as given.

    Raises:
        OSError: the sockets' folder cannot be made, or is not this user's alone.
    """

    def __init__(self, sessions, slots=None):
        self.sessions = sessions
        self.slots = dict(slots or {})      # host -> the ranks it will run
        self.dir = _sockets_dir()
        self._job = secrets.token_hex(4)
        self._hosts = {}            # host -> (its index here, sessions handed out)
        self._paths = {}            # control socket -> host

    def options(self, host, count=True):
        """ssh's options for one more session to ``host`` (``count=False``: one that ends
        before the ranks start, as the start-up check)."""
        index, opened = self._hosts.get(host, (len(self._hosts), 0))
        self._hosts[host] = (index, opened + count)
        return self._options(host, index, opened // self.sessions)

    def spare(self, host):
        """ssh's options for each connection of ``host`` but its first: opened with the
        check, at the same time, rather than by a rank that the next ones would race."""
        index = self._hosts.setdefault(host, (len(self._hosts), 0))[0]
        return [self._options(host, index, group)
                for group in range(1, -(-self.slots.get(host, 0) // self.sessions))]

    def _options(self, host, index, group):
        path = os.path.join(self.dir, f"{self._job}.{index}.{group}")
        self._paths[path] = host
        return ["-o", "ControlMaster=auto", "-o", f"ControlPath={path}",
                "-o", f"ControlPersist={_PERSIST_S}"]

    def close(self):
        """End every shared connection (their sessions have ended), which removes its
        socket."""
        for path, host in self._paths.items():
            if os.path.exists(path):
                try:
                    subprocess.run(["ssh", "-o", f"ControlPath={path}", "-O", "exit", host],
                                   stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=_CONNECT_TIMEOUT_S)
                except (OSError, subprocess.TimeoutExpired) as e:
                    log.debug("could not end the ssh connection to %s: %s", host, e)


def _sockets_dir():
    """The folder of this user's shared connections' sockets: one for every job, so that a
    launcher killed before it ends them leaves no folder behind (each connection removes
    its socket when it ends).  Short, as a socket's path must be; this user's alone."""
    path = os.path.join("/tmp" if len(tempfile.gettempdir()) > 40 else tempfile.gettempdir(),
                        f"hora-ssh-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a folder of this user's alone")
    return path


def remote_argv(ssh, host, shell_command, shared=()):
    """The local argv that runs ``shell_command`` (a shell command line) on ``host``;
    ``shared``: :meth:`Multiplex.options` (plain ssh only)."""
    options = []
    if ssh.port is not None:
        options += ["-p", str(int(ssh.port))]
    if ssh.identity_file is not None:
        options += ["-i", os.fspath(ssh.identity_file)]
    if ssh.command is None:
        # Like Horovod's launcher, trust the cluster's hosts: no prompt, no known_hosts
        # bookkeeping (pass --ssh-command 'ssh -o StrictHostKeyChecking=yes' to check keys).
        return ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                "-o", f"ConnectTimeout={_CONNECT_TIMEOUT_S}", *shared, *options, host,
                shell_command]
    template = shlex.split(ssh.command)
    if options and not ssh.is_ssh():
        raise ValueError(f"--ssh-port/--ssh-identity-file apply to ssh, not to "
                         f"--ssh-command {ssh.command!r}; put them in the template")
    argv = [template[0], *options]
    has_host = has_command = False
    for word in template[1:]:
        if "{command}" in word:
            has_command = True
            word = word.replace("{command}", shell_command)
        if "{host}" in word:
            has_host = True
            word = word.replace("{host}", host)
        argv.append(word)
    if not has_host:
        argv.append(host)
    if not has_command:
        argv.append(shell_command)
    return argv


def agent_shell_command(cwd, python, pythonpath=None, module="hora.runner.remote_agent"):
    """The remote shell command line that starts the agent (nothing secret in it)."""
    env = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    return f"cd {shlex.quote(cwd)} && {env}exec {shlex.quote(python)} -u -m {module}"


def _check_shell_command(cwd, python, pythonpath, port, addresses):
    env = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    py = shlex.quote(python)
    args = " ".join(shlex.quote(str(a)) for a in (port, *addresses))
    return (f"cd {shlex.quote(cwd)} 2>/dev/null || {{ echo {_NO_CWD}; exit 97; }}; "
            f"[ -x {py} ] || command -v {py} >/dev/null 2>&1 || {{ echo {_NO_PY}; exit 97; }}; "
            f"{env}exec {py} -c {shlex.quote(_CHECK)} {args}")


@dataclasses.dataclass(frozen=True)
class HostReport:
    """What the check learned about one host that passed it."""
    host: str
    version: str
    python: str
    reach: tuple            # this machine's addresses the host could connect to
    seconds: float          # how long the check took
    kernel: str = ""        # its kernel's boot id (hosts under one kernel share its CPUs)
    cpus: int = 0           # the CPUs a process started there may run on
    layout_refused: str = ""    # why ranks there cannot have the fixed layout ("": they can)


def _ssh_failure(stderr, ssh, host):
    """The reason an ssh login failed, from ssh's message."""
    text = " ".join(line.strip() for line in stderr.strip().splitlines()[-3:]) or "no message"
    lower = text.lower()
    port = ssh.port or 22
    if "connection refused" in lower:
        return f"ssh refused: connection refused on port {port} (is sshd running?): {text}"
    if any(s in lower for s in ("permission denied", "host key verification failed",
                                "too many authentication failures", "no supported auth")):
        return f"ssh authentication failed: {text}"
    if any(s in lower for s in ("timed out", "no route to host", "network is unreachable",
                                "could not resolve", "name or service not known",
                                "temporary failure in name resolution", "host is down")):
        return f"unreachable: {text}"
    if "connection closed" in lower or "connection reset" in lower:
        return f"ssh refused: the server closed the connection: {text}"
    return f"remote start failed: {text}"


def _check_one(host, ssh, cwd, python, pythonpath, port, addresses, timeout, shared=()):
    start = time.monotonic()
    argv = remote_argv(ssh, host, _check_shell_command(cwd, python, pythonpath, port,
                                                       addresses), shared)
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        return f"unreachable: no answer within {timeout:g} s"
    except OSError as e:
        return f"cannot run {argv[0]!r}: {e}"
    lines = done.stdout.splitlines()
    for line in lines:
        tag, _, rest = line.partition(" ")
        if tag == _OK:
            info = json.loads(rest)
            if info["version"] != __version__:
                return (f"hora version mismatch: {__version__} here, {info['version']} on "
                        f"{host} ({python})")
            return HostReport(host, info["version"], info["python"], tuple(info["reach"]),
                              time.monotonic() - start, info.get("kernel", ""),
                              info.get("cpus", 0), info.get("layout_refused", ""))
        if tag == _NO_HORA:
            return f"hora is missing for {python} on {host}: {rest} (pip install hora there)"
        if tag == _NO_CWD:
            return f"working directory {cwd} does not exist on {host}"
        if tag == _NO_PY:
            return f"python {python} is missing on {host}"
    if ssh.is_ssh() and done.returncode == 255:
        return _ssh_failure(done.stderr, ssh, host)
    tail = " ".join(done.stderr.strip().splitlines()[-3:]) or "no output"
    return f"remote start failed (exit {done.returncode}): {tail}"


def check_hosts(hosts, ssh, cwd, python, pythonpath=None, probe_port=None, addresses=(),
                timeout=DEFAULT_CHECK_TIMEOUT_S, shared=None):
    """Check every remote host in parallel; return ``{host: HostReport}``.

    Args:
        hosts: remote host names.
        ssh: :class:`SshSettings`.
        cwd, python, pythonpath: the working directory, interpreter and PYTHONPATH the ranks
            will use there.
        probe_port: a port listening on this machine; each host reports which of
            ``addresses`` it can connect to on it.
        timeout: seconds for the whole check (hosts are checked at the same time).
        shared: a :class:`Multiplex`: each check opens the host's first shared connection,
            which its ranks then use (and, beside it, its others).

    Raises:
        HostCheckError: naming every host that failed and why.
    """
    if not hosts:
        return {}
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = {pool.submit(_check_one, h, ssh, cwd, python, pythonpath, probe_port or 0,
                               addresses if probe_port else (), timeout,
                               shared.options(h, count=False) if shared else ()): h
                   for h in hosts}
        for h in hosts if shared else ():
            for options in shared.spare(h):     # (a failure here: that rank logs in alone)
                pool.submit(subprocess.run, remote_argv(ssh, h, "true", options),
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
    failures = {h: results[h] for h in hosts if not isinstance(results[h], HostReport)}
    if failures:
        raise HostCheckError(failures)
    for host in hosts:
        log.debug("host %s ok: hora %s, Python %s, checked in %.2f s", host,
                 results[host].version, results[host].python, results[host].seconds)
    return {h: results[h] for h in hosts}


def choose_address(reports, candidates):
    """The first of ``candidates`` that every host in ``reports`` reached, or None."""
    for addr in candidates:
        if all(addr in r.reach for r in reports.values()):
            return addr
    return None
