"""Several "hosts" on this machine: network namespaces on a private bridge, each with an sshd.

``Cluster.start()`` (root only) makes a bridge with address 10.77.<n>.1 in this namespace and,
for each host, a namespace joined to the bridge by a veth pair, with address 10.77.<n>.<k>, its
own loopback, and a real OpenSSH server listening on that address with a host key and an
authorized key generated for this cluster.  A host may be started

* ``"ok"``: sshd runs;
* ``"no-sshd"``: the namespace and its address exist, nothing listens on port 22;
* ``"no-hora"``: sshd runs in a private mount namespace where hora's source directory is
  hidden under an empty one, so ``import hora`` fails there (a host without hora).

The namespaces share this machine's file system, so the same working directory and Python
exist on every host, as on a cluster with a shared home.  The bridge is not connected to
any physical interface: nothing leaves the machine.  ``close()`` kills the sshds, deletes the
namespaces and the bridge, and removes the keys; it is safe to call after a failed start.

Without an sshd the cluster runs in its *no-sshd form*: ``--ssh-command 'ip netns exec {host}
sh -c {command}'`` with the namespace names as host names (ranks still run inside their
namespaces and talk across them), and nothing listens on port 22 anywhere.  A test that needs
an sshd there either checks what the real ssh client meets (a refused or unreachable port) or
skips, naming the reason.

The suite gets its sshd itself: before the tests that use a cluster run, ``provision()``
(called from ``tests/multiproc/conftest.py``) installs Debian's openssh-server with apt-get
when ``/usr/sbin/sshd`` is missing and this is root on an apt system, once, within
``PROVISION_TIMEOUT_S``; if it cannot, the clusters run in their no-sshd form and the session
summary says why.  ``HORA_TEST_NO_SSHD=1`` forces the no-sshd form (and installs nothing), so
that both forms can be run on one machine.
"""
import contextlib
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import hora

SSHD = "/usr/sbin/sshd"
IFACE = "hnet0"
NO_SSHD_ENV = "HORA_TEST_NO_SSHD"
# apt-get update + install of openssh-server takes seconds to a minute on a normal mirror;
# the bound keeps a dead mirror from eating the CI run's 30 minutes.
PROVISION_TIMEOUT_S = 240.0
# how long apt-get waits for another apt or dpkg on the machine to let go of its lock
_APT_LOCK_WAIT_S = 60
NETNS_LOGIN = "ip netns exec {host} sh -c {command}"     # the no-sshd form's --ssh-command
# every sshd also listens here, allowing 2 sessions a connection where port 22 allows 100:
# a host whose sshd refuses ssh's shared sessions past its MaxSessions
FEW_SESSIONS_PORT, FEW_SESSIONS = 2200, 2

_provisioned = None      # what provision() did, for the session summary


def _sh(*argv, check=True):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def unavailable_reason():
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    name = f"horaprobe{secrets.token_hex(3)}"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          timeout=20)
    if done.returncode != 0:
        return f"cannot create a network namespace here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return None


def no_sshd_reason():
    """Why clusters run in their no-sshd form here, or None when they start real sshds."""
    if _forced_no_sshd():
        return f"{NO_SSHD_ENV} is set"
    if shutil.which("ssh") is None:
        return "no ssh client ('ssh') is installed"
    if not os.access(SSHD, os.X_OK):
        why = f"{SSHD} is not installed"
        return f"{why}: {_provisioned}" if _provisioned else why
    return None


def _forced_no_sshd():
    return os.environ.get(NO_SSHD_ENV, "") not in ("", "0")


def provision(say=print, timeout_s=PROVISION_TIMEOUT_S):
    """Install what the clusters need and lack (iproute2, openssh-server), as root, with apt-get.

    Installs nothing when all is there, when not root, without apt-get, or where network
    namespaces cannot be made anyway; nor openssh-server when ``HORA_TEST_NO_SSHD`` is set.
    The clusters then run in their no-sshd form, or their tests skip, naming the reason.

    Args:
        say: takes one line for the person running the tests (what is installed, how long
            it took, or why it failed).
        timeout_s: the bound on everything apt-get does here.

    Returns:
        One line saying what happened, or None when nothing was done.
    """
    global _provisioned
    want = [] if shutil.which("ip") else ["iproute2"]
    if not _forced_no_sshd() and not os.access(SSHD, os.X_OK):
        want.append("openssh-server")       # brings the ssh client with it
    if not want or os.geteuid() != 0:
        return None                         # (without root the clusters skip, saying so)
    if want == ["openssh-server"] and unavailable_reason():
        return None                         # no namespaces here: the clusters skip anyway
    if shutil.which("apt-get") is None:
        _provisioned = f"no apt-get to install {' '.join(want)} with"
        return _provisioned
    log_path = os.path.join(tempfile.gettempdir(), "hora-tests-apt.log")
    say(f"hora tests: installing {' '.join(want)} with apt-get for the multi-host tests "
        f"(at most {timeout_s:g} s; log: {log_path}; {NO_SSHD_ENV}=1 runs them without sshd)")
    start = time.monotonic()
    deadline = start + timeout_s
    with open(log_path, "ab") as log, _system_sshd_kept_off():
        ok = _apt(["install", "--no-install-recommends", *want], log, deadline)
        if not ok:      # package lists missing or stale (a fresh image): fetch them, retry
            ok = (_apt(["update"], log, deadline)
                  and _apt(["install", "--no-install-recommends", *want], log, deadline))
    took = time.monotonic() - start
    there = {"iproute2": bool(shutil.which("ip")), "openssh-server": os.access(SSHD, os.X_OK)}
    missing = [p for p in want if not there[p]]
    if ok and not missing:
        _provisioned = f"{' '.join(want)} installed by the test suite with apt-get in {took:.1f} s"
    else:
        _provisioned = (f"apt-get did not install {' '.join(missing or want)} "
                        f"({took:.1f} s; see {log_path})")
    say(f"hora tests: {_provisioned}")
    return _provisioned


def provisioned():
    """What :func:`provision` did in this session, or None."""
    return _provisioned


def provisioned_as(line):
    """Take what :func:`provision` did in another process of the session (pytest-xdist's
    workers provision once, tests/workers.py), and return it."""
    global _provisioned
    _provisioned = line
    return line


def _apt(args, log, deadline):
    """Run ``apt-get ARGS`` non-interactively until ``deadline``; True when it succeeded."""
    if time.monotonic() >= deadline:
        return False
    argv = ["apt-get", "-q", "-y", "-o", f"DPkg::Lock::Timeout={_APT_LOCK_WAIT_S}",
            # keep the machine's own configuration files when a package upgrade brings new ones
            "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
            *args]
    log.write(f"\n$ {' '.join(argv)}\n".encode())
    log.flush()
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    try:
        return child.wait(max(0.0, deadline - time.monotonic())) == 0
    except subprocess.TimeoutExpired:
        # SIGTERM first: apt-get and dpkg stop cleanly on it (a SIGKILLed dpkg leaves the
        # package database for `dpkg --configure -a`)
        child.terminate()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)
        log.write(b"hora tests: apt-get stopped: out of time\n")
        return False


@contextlib.contextmanager
def _system_sshd_kept_off():
    """While openssh-server installs, keep its package scripts from starting the system's sshd.

    The tests start their own sshds, in their namespaces; an sshd on every interface of the
    machine is not theirs to start.  Debian's ssh init script and ssh.service both stand down
    while /etc/ssh/sshd_not_to_be_run exists.  The file goes again afterwards (if made here),
    so the machine is left as ``apt-get install openssh-server`` leaves it, less the running
    daemon.
    """
    marker = "/etc/ssh/sshd_not_to_be_run"
    made = not os.path.exists(marker)
    if made:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            f.write("hora tests: installing openssh-server\n")
    try:
        yield
    finally:
        if made:
            try:
                os.remove(marker)
            except FileNotFoundError:
                pass


class Cluster:
    """Namespaced hosts with sshd, or in the no-sshd form (see the module docstring).

    Args:
        kinds: one of "ok", "no-sshd", "no-hora" per host.
        hostnames: each host's sshd (and what it starts) has a host name of its own, the
            namespace's (a UTS namespace): Open MPI tells hosts apart by their names.

    Attributes:
        use_sshd: True when the hosts run real sshds; False in the no-sshd form.
        no_sshd_reason: why not (the no-sshd form), else None.
    """

    def __init__(self, kinds=("ok", "ok"), hostnames=False):
        self.kinds = list(kinds)
        self.hostnames = hostnames
        tag = secrets.token_hex(2)
        self.subnet = f"10.77.{int(tag, 16) % 250 + 1}"
        self.bridge = f"hbr{tag}"
        self.namespaces = [f"hora{tag}{chr(97 + i)}" for i in range(len(self.kinds))]
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(len(self.kinds))]
        self.launcher_address = f"{self.subnet}.1"
        self.unreachable = f"{self.subnet}.250"     # on the bridge's subnet, assigned to none
        self.no_sshd_reason = no_sshd_reason()
        self.use_sshd = self.no_sshd_reason is None
        self.dir = tempfile.mkdtemp(prefix="hora-cluster-")
        self.key = os.path.join(self.dir, "id_ed25519")
        self._sshd = []
        self._made_ns = []
        self._made_bridge = False

    # -- what tests pass to hora run ---------------------------------------------------------
    def host(self, i):
        """The host name of host ``i`` for ``-H``: its address (or namespace, without sshd)."""
        return self.addresses[i] if self.use_sshd else self.namespaces[i]

    def ssh_args(self, hide_hora=False):
        """The ``hora run`` flags that reach the hosts.

        Args:
            hide_hora: no-sshd form only: enter every host in a mount namespace of its own
                where hora's source directory is hidden, as the "no-hora" host's sshd does.
        """
        if self.use_sshd:
            if hide_hora:
                raise ValueError("hide_hora is for the no-sshd form; with sshd, start a "
                                 "'no-hora' host")
            return ["--ssh-port", "22", "--ssh-identity-file", self.key]
        return ["--ssh-command", self._netns_login(hide_hora)]

    def ssh_settings(self):
        from hora.runner import SshSettings
        if self.use_sshd:
            return SshSettings(port=22, identity_file=self.key)
        return SshSettings(command=NETNS_LOGIN)

    def _netns_login(self, hide_hora):
        if not hide_hora:
            return NETNS_LOGIN
        # `sh -c SCRIPT login CMD`: CMD is $1 of SCRIPT, run once hora is out of sight
        script = f'mount --bind {self.dir}/empty {_hora_dir()} && exec sh -c "$1"'
        return (f"ip netns exec {{host}} unshare --mount --propagation private sh -c "
                f"{shlex.quote(script)} login {{command}}")

    # -- life cycle ----------------------------------------------------------------------------
    def start(self):
        try:
            os.makedirs(os.path.join(self.dir, "empty"))     # what hides hora's directory
            self._network()
            if self.use_sshd:
                self._keys()
                for i, kind in enumerate(self.kinds):
                    if kind != "no-sshd":
                        self._start_sshd(i, hide_hora=kind == "no-hora")
                self._wait_for_sshd()
        except BaseException:
            self.close()
            raise
        return self

    def _network(self):
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _sh("ip", "addr", "add", f"{self.launcher_address}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            outside, inside = f"{self.bridge}v{i}", f"{self.bridge}p{i}"
            # inside, every host's interface is called IFACE (one --network-interface for all)
            _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _sh("ip", "link", "set", outside, "master", self.bridge, "up")
            _sh("ip", "link", "set", inside, "netns", ns)
            run = ("ip", "netns", "exec", ns)
            _sh(*run, "ip", "link", "set", "lo", "up")
            _sh(*run, "ip", "link", "set", inside, "name", IFACE)
            _sh(*run, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", IFACE)
            _sh(*run, "ip", "link", "set", IFACE, "up")

    def _keys(self):
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
            os.path.join(self.dir, "host_key"))
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)         # sshd's privilege-separation dir

    def _start_sshd(self, i, hide_hora):
        config = os.path.join(self.dir, f"sshd_config.{i}")
        with open(config, "w") as f:
            f.write(f"ListenAddress {self.addresses[i]}\nPort 22\nPort {FEW_SESSIONS_PORT}\n"
                    f"HostKey {self.dir}/host_key\nPidFile none\n"
                    f"AuthorizedKeysFile {self.dir}/authorized_keys\nStrictModes no\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nPrintMotd no\n"
                    "LogLevel ERROR\nMaxStartups 100\nMaxSessions 100\n"
                    f"Match LocalPort {FEW_SESSIONS_PORT}\n"
                    f"    MaxSessions {FEW_SESSIONS}\n")
        sshd = f"exec {SSHD} -D -e -f {config}"
        if hide_hora:
            sshd = f"mount --bind {self.dir}/empty {_hora_dir()} && {sshd}"
        uts = []
        if self.hostnames:      # the namespace's name, as a machine of its own would say
            sshd, uts = f"hostname {self.namespaces[i]} && {sshd}", ["--uts"]
        argv = ["ip", "netns", "exec", self.namespaces[i], "unshare", "--mount", *uts,
                "--propagation", "private", "sh", "-c", sshd]
        log = open(os.path.join(self.dir, f"sshd.{i}.log"), "wb")
        self._sshd.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=log, start_new_session=True))
        log.close()

    def _wait_for_sshd(self, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        pending = [i for i, k in enumerate(self.kinds) if k != "no-sshd"]
        while pending:
            i = pending[0]
            done = subprocess.run(["ip", "netns", "exec", self.namespaces[i], sys.executable,
                                   "-c", f"import socket; socket.create_connection(("
                                   f"'{self.addresses[i]}', 22), 1).close()"],
                                  capture_output=True, timeout=10)
            if done.returncode == 0:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                logs = open(os.path.join(self.dir, f"sshd.{i}.log"), errors="replace").read()
                raise RuntimeError(f"sshd on {self.addresses[i]} did not start: {logs}")
            time.sleep(0.1)

    def close(self):
        for p in self._sshd:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 15)
                except ProcessLookupError:
                    pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(5)
        self._sshd = []
        for ns in self._made_ns:
            # any process still in the namespace would keep it (and its veth) alive
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", ns, check=False)
        self._made_ns = []
        if self._made_bridge:
            _sh("ip", "link", "del", self.bridge, check=False)
            self._made_bridge = False
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


def _hora_dir():
    return os.path.dirname(os.path.abspath(hora.__file__))
