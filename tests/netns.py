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

Without an sshd binary the cluster falls back to ``--ssh-command 'ip netns exec {host} sh
-c {command}'`` with the namespace names as host names: ranks still talk across namespaces.
"""
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import hora

SSHD = "/usr/sbin/sshd"
IFACE = "hnet0"


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


class Cluster:
    """Namespaced hosts with sshd (see the module docstring).

    Args:
        kinds: one of "ok", "no-sshd", "no-hora" per host.
    """

    def __init__(self, kinds=("ok", "ok")):
        self.kinds = list(kinds)
        tag = secrets.token_hex(2)
        self.subnet = f"10.77.{int(tag, 16) % 250 + 1}"
        self.bridge = f"hbr{tag}"
        self.namespaces = [f"hora{tag}{chr(97 + i)}" for i in range(len(self.kinds))]
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(len(self.kinds))]
        self.launcher_address = f"{self.subnet}.1"
        self.unreachable = f"{self.subnet}.250"     # on the bridge's subnet, assigned to none
        self.use_sshd = os.path.exists(SSHD) and shutil.which("ssh") is not None
        self.dir = tempfile.mkdtemp(prefix="hora-cluster-")
        self.key = os.path.join(self.dir, "id_ed25519")
        self._sshd = []
        self._made_ns = []
        self._made_bridge = False

    # -- what tests pass to hora run ---------------------------------------------------------
    def host(self, i):
        """The host name of host ``i`` for ``-H``: its address (or namespace, without sshd)."""
        return self.addresses[i] if self.use_sshd else self.namespaces[i]

    def ssh_args(self):
        """The ``hora run`` flags that reach the hosts."""
        if self.use_sshd:
            return ["--ssh-port", "22", "--ssh-identity-file", self.key]
        return ["--ssh-command", "ip netns exec {host} sh -c {command}"]

    def ssh_settings(self):
        from hora.runner import SshSettings
        if self.use_sshd:
            return SshSettings(port=22, identity_file=self.key)
        return SshSettings(command="ip netns exec {host} sh -c {command}")

    # -- life cycle ----------------------------------------------------------------------------
    def start(self):
        try:
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
        os.makedirs(os.path.join(self.dir, "empty"), exist_ok=True)

    def _start_sshd(self, i, hide_hora):
        config = os.path.join(self.dir, f"sshd_config.{i}")
        with open(config, "w") as f:
            f.write(f"ListenAddress {self.addresses[i]}\nPort 22\n"
                    f"HostKey {self.dir}/host_key\nPidFile none\n"
                    f"AuthorizedKeysFile {self.dir}/authorized_keys\nStrictModes no\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nPrintMotd no\n"
                    "LogLevel ERROR\nMaxStartups 100\nMaxSessions 100\n")
        sshd = f"exec {SSHD} -D -e -f {config}"
        if hide_hora:
            hora_dir = os.path.dirname(os.path.abspath(hora.__file__))
            sshd = f"mount --bind {self.dir}/empty {hora_dir} && {sshd}"
        argv = ["ip", "netns", "exec", self.namespaces[i], "unshare", "--mount",
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
