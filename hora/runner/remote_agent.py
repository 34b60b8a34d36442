"""The remote end of a rank that ``hora run`` starts over ssh
(``python -m hora.runner.remote_agent``).

Protocol on stdin (from the launcher, through ssh):

1. one JSON line ``{"command": [...], "env": {...}, "cwd": "...", "grace_s": 3.0,
   "fixed_layout": false}`` (``fixed_layout``: start the rank without address-space
   randomization, see :mod:`hora.runner.proc`): the environment carries the job secret,
   which is why it travels here and not in the ssh command line (where ``ps`` on either
   machine would show it);
2. then control lines ``signal <number>``: the agent sends that signal to the rank's process
   group (ssh carries no signals without a terminal);
3. end of file: the launcher died, was killed, or dropped the connection: the agent stops the
   rank's process group (SIGTERM, then SIGKILL after ``grace_s``), so no orphan outlives its
   launcher.

End of file is the agent's only sign that the launcher is gone, so the agent must live to
see it.  Over ssh its parent is sshd; but an ``--ssh-command`` that execs into the remote
side without a server (``ip netns exec {host} sh -c {command}``, ``sudo``, ``chroot``) makes
the agent the launcher's own child, inheriting the parent-death SIGKILL that the launcher
gives every process it spawns (:func:`hora.runner.proc.spawn`).  The agent clears it first
thing: killed with the launcher, it would leave the rank's children (a data loader, a
``subprocess`` the script started) running, orphaned, in the rank's process group.

The rank inherits the agent's stdout and stderr (the ssh channel).  The agent exits with the
rank's status, or 128+signum when the rank was killed by a signal (as a shell reports it).

Layer: runner.  Imports nothing from hora but :mod:`hora.runner.proc`.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

from . import proc

__all__ = ["main"]

_SWEEP_S = 0.05


def _stop(pgid, grace_s):
    """SIGTERM the rank's group, SIGKILL what is left after ``grace_s``."""
    proc.signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while proc.live_groups([pgid]) and time.monotonic() < end:
        time.sleep(_SWEEP_S)
    proc.signal_group(pgid, signal.SIGKILL)


def _relay(stdin, child, grace_s, stopped):
    """Forward control lines as signals; stop the rank on end of file."""
    for raw in stdin:
        word, _, arg = raw.decode("ascii", "replace").strip().partition(" ")
        if word == "signal" and arg.isdigit():
            proc.signal_group(child.pid, int(arg))
    stopped.set()
    if child.poll() is None:
        _stop(child.pid, grace_s)


def main():
    """Run one rank as the launcher's spec says; return its shell-style exit status."""
    proc.outlive_parent()
    stdin = sys.stdin.buffer
    line = stdin.readline()
    if not line:
        sys.stderr.write("hora.runner.remote_agent: no job spec on stdin (started by hand?)\n")
        return 2
    spec = json.loads(line)
    grace_s = float(spec.get("grace_s", 3.0))
    try:
        child = subprocess.Popen(spec["command"], env=spec["env"], cwd=spec.get("cwd"),
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=proc.parent_death_hook(
                                     bool(spec.get("fixed_layout"))))
    except OSError as e:
        sys.stderr.write(f"hora: cannot start {spec['command'][0]!r}: {e}\n")
        return 127
    stopped = threading.Event()
    threading.Thread(target=_relay, args=(stdin, child, grace_s, stopped), daemon=True,
                     name="hora-agent-relay").start()
    returncode = child.wait()
    # the rank's own children (a data loader, a shell's job) go with it
    if proc.live_groups([child.pid]):
        _stop(child.pid, 0.0 if stopped.is_set() else grace_s)
    return proc.exit_status(returncode)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # not sys.exit: the relay thread may sit in a read of stdin, which interpreter shutdown
    # would wait on (a fatal error on a buffered stream)
    os._exit(status)
