"""Process plumbing for the launcher: spawn a worker in its own process group, signal groups,
find what is still alive, describe how a process ended.

Linux first: workers get ``PR_SET_PDEATHSIG=SIGKILL`` so that a launcher killed with SIGKILL
never leaves them behind.  Elsewhere that protection is skipped (the process group still is
the unit we stop).

Ranks that take turns on the same CPUs may start with one address layout (*fixed layout*:
the ``ADDR_NO_RANDOMIZE`` personality, as ``setarch -R`` gives, so no address-space
randomization): the interpreter's code then sits at the same addresses in every rank, and a
rank that gets the CPU after another finds the branch predictor trained for its own code
rather than for another copy of it elsewhere.  A small allreduce of 4 ranks on 2 CPUs runs
in about 0.6 of the time (``benchmarks/experiments/address_layout.py``).  :func:`layout_hosts`
says which hosts' ranks start so (``HORA_RANK_ASLR``), where :func:`fixed_layout_refused`
finds no reason they cannot (a container's seccomp profile refusing the personality).

Layer: runner.  Imports nothing from hora.
"""
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import subprocess
import sys

__all__ = ["spawn", "signal_group", "live_groups", "describe_exit", "exit_status",
           "open_pidfd", "parent_death_hook", "outlive_parent", "layout_hosts",
           "fixed_layout_refused"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_ADDR_NO_RANDOMIZE = 0x0040000
_QUERY_PERSONALITY = 0xFFFFFFFF


def _load_libc(name, argtypes):
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    func.argtypes = argtypes
    func.restype = ctypes.c_int
    return func


# Resolved once in the parent: the pre-exec hook runs between fork and exec, where loading a
# library (taking locks other threads may hold) is unsafe.
_PRCTL = _load_libc("prctl", [ctypes.c_int] + [ctypes.c_ulong] * 4)
_PERSONALITY = _load_libc("personality", [ctypes.c_ulong])


def _make_preexec(parent_pid, fixed_layout=False):
    prctl, personality = _PRCTL, _PERSONALITY if fixed_layout else None

    def preexec():
        # Deliver SIGKILL to this process when the thread that forked it dies.  The launcher
        # forks from its main thread, so that is "when the launcher dies".
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if personality is not None:     # the program exec'd next gets the fixed layout
            current = personality(_QUERY_PERSONALITY)
            if current != -1:
                personality(current | _ADDR_NO_RANDOMIZE)
        # The launcher may have died before prctl took effect: then nobody will signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec if prctl is not None else None


def outlive_parent():
    """Clear a parent-death signal this process inherited from whoever forked it (a
    :func:`parent_death_hook` of a launcher that started it directly); Linux only."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, 0, 0, 0, 0)


def parent_death_hook(fixed_layout=False):
    """A ``preexec_fn`` that kills the child when this process (its forking thread) dies;
    ``fixed_layout``: the child's program starts without address-space randomization."""
    return _make_preexec(os.getpid(), fixed_layout)


@functools.lru_cache(maxsize=None)
def fixed_layout_refused():
    """Why programs this process starts cannot have the fixed layout, or None when they can.

    A container's seccomp profile may refuse the personality: Docker's default allows a few
    values (the query among them), not ``ADDR_NO_RANDOMIZE``, and the call fails with EPERM
    (the pre-exec hook then leaves the rank randomized).  The probe sets the flag on this
    process and clears it again; the flag acts only on a later ``exec``."""
    if _PERSONALITY is None:
        return "this system has no personality()"
    current = _PERSONALITY(_QUERY_PERSONALITY)
    if current != -1 and current & _ADDR_NO_RANDOMIZE:
        return None                     # (started so itself: setarch -R)
    if current == -1 or _PERSONALITY(current | _ADDR_NO_RANDOMIZE) == -1:
        return (f"personality(ADDR_NO_RANDOMIZE) is refused here "
                f"({os.strerror(ctypes.get_errno())}: a seccomp profile, such as a "
                f"container's default, allows it no such value)")
    _PERSONALITY(current)
    return None


def layout_hosts(policy, ranks, machines):
    """The hosts whose ranks start in the fixed layout (see the module's docstring).

    Args:
        policy: ``"auto"``, ``"on"`` or ``"off"`` (``HORA_RANK_ASLR``, in lower case).
        ranks: ``{host: number of ranks it runs}``.
        machines: ``{host: (kernel id, CPUs)}``; hosts under one kernel id (namespaces or
            containers of one machine) share its CPUs, and their ranks count together; an
            empty id is a machine of its own; 0 CPUs: unknown.

    Returns:
        A set of hosts: under ``"auto"`` those whose machine runs more ranks than it has
        CPUs (never one whose CPUs are unknown), every host under ``"off"``, none under
        ``"on"``.
    """
    if policy == "on":
        return set()
    if policy == "off":
        return set(ranks)

    def machine(host):
        return machines[host][0] or ("host", host)

    count, cpus = {}, {}
    for host, n in ranks.items():
        m = machine(host)
        count[m] = count.get(m, 0) + n
        cpus[m] = max(cpus.get(m, 0), machines[host][1])
    return {host for host in ranks if 0 < cpus[machine(host)] < count[machine(host)]}


def spawn(command, env, cwd=None, stdin=subprocess.DEVNULL, fixed_layout=False):
    """Start ``command`` as a worker: own session and process group, piped output.

    Must be called from the thread that lives as long as the job (the launcher's main thread
    in the CLI), because the parent-death signal fires when the forking *thread* exits.

    Args:
        stdin: ``subprocess.DEVNULL`` (a local rank) or ``subprocess.PIPE`` (ssh to a remote
            rank: the pipe carries its spec and control lines).
        fixed_layout: start ``command`` without address-space randomization.

    Returns:
        The :class:`subprocess.Popen`; its pid is also its process-group id.
    """
    return subprocess.Popen(
        command, env=env, cwd=cwd, stdin=stdin, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
        preexec_fn=_make_preexec(os.getpid(), fixed_layout))


def signal_group(pgid, sig):
    """Send ``sig`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as e:         # the pgid was reused by someone else's process
        log.warning("could not signal process group %s: %s", pgid, e)
        return False


def live_groups(pgids):
    """The subset of ``pgids`` that still has a member that is not a zombie.

    Zombies are skipped: an orphan reparented to an init that does not reap would otherwise
    look alive forever.  Reads ``/proc``; without it, falls back to ``killpg(pgid, 0)``.
    """
    wanted = set(pgids)
    if not wanted:
        return set()
    if not os.path.isdir("/proc/self"):
        return {g for g in wanted if _group_exists(g)}
    alive = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue                   # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) >= 3 and fields[0] != b"Z" and int(fields[2]) in wanted:
            alive.add(int(fields[2]))
    return alive


def _group_exists(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def open_pidfd(pid):
    """A pidfd for ``pid`` (readable once it exits), or None where the kernel lacks them."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def describe_exit(returncode):
    """``"exited with code 3"`` or ``"was killed by signal SIGKILL"`` for a Popen returncode."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"was killed by signal {name}"


def exit_status(returncode):
    """A shell-style exit status: the code, or 128+signum for a signal."""
    return returncode if returncode >= 0 else 128 - returncode
