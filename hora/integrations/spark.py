"""``hora.spark.run(fn, ...)``: a hora job whose ranks are the tasks of a Spark barrier stage.

The driver (this process, which holds the active ``SparkContext``) serves the job's
rendezvous store on the address Spark's executors already reach it at
(``spark.driver.host``), with a fresh secret, and puts ``(fn, args, kwargs)`` in it exactly
as :func:`hora.run` does (key :data:`~hora.runner.run_func.FN_KEY`).  It then runs one
Spark job of ``num_proc`` partitions in barrier execution mode, so that Spark starts every
task at once or none of them.  Each task:

1. takes its rank from its partition id and its host from the barrier context's task
   addresses (``BarrierTaskContext.getTaskInfos()``): the ranks whose executors share a
   host get local ranks on it in rank order, as under ``hora run``;
2. checks in at the driver's store (``spark/started/<rank>``);
3. starts ``python -m hora.runner.task`` -- the worker side of :func:`hora.run` -- in a
   fresh process with the ``HORA_*`` contract (:func:`hora.runner.contract.worker_env`) in
   its environment; that process fetches the function, calls it (the function calls
   ``hora.init()`` itself) and stores its value or traceback under ``run/result/<rank>``;
4. waits for it, ending it (SIGTERM, then SIGKILL) when the driver asks (``spark/abort``:
   another rank failed, or the job timed out) or when the driver's store goes away;
5. reports how it ended (``spark/exit/<rank>``) and returns that small record to Spark.

Why a subprocess and not the Python worker itself: a rank's hora state (its engine thread,
its sockets, its shared-memory segments) must end with the rank, and pyspark reuses its
Python workers for later tasks; a process of its own also lets a task be stopped with a
signal, and what a killed rank leaves in ``/dev/shm`` is removed by its task.  The process
gets a parent-death signal, so a task that Spark kills takes its rank along.

A task never fails the Spark job for a failed rank: barrier stages are retried as a whole,
which would run the user's function again.  The driver instead watches the store, tells the
other tasks to stop at the first failure, and raises
:class:`~hora.errors.WorkerFailedError` for the earliest one (the order in which their exits
reached the driver), as :func:`hora.run` does.

Every wait is bounded: executors to offer ``num_proc`` slots and every task to check in
(``start_timeout``), the job as a whole (``timeout_s``, optional), and the teardown.

Layer: integrations.  Uses the runner's Python API (its worker, its environment contract)
and the rendezvous store; pyspark is imported only inside the functions that need it.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import cloudpickle

from ..config import remove_segments_of
from ..errors import (CollectiveTimeoutError, HoraError, RendezvousError, RendezvousTimeoutError,
                      WorkerFailedError)
from ..rendezvous import RendezvousClient, RendezvousServer, new_secret
from ..runner import SlotInfo, proc
from ..runner.contract import job_env, worker_env
from ..runner.run_func import FN_KEY, RESULT_PREFIX

__all__ = ["run", "task_slots", "DEFAULT_START_TIMEOUT_S"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Spark may have to start or scale executors before a barrier stage can run at all
# (Horovod's Spark runner waits as long by default).
DEFAULT_START_TIMEOUT_S = 600.0
_GRACE_S = 3.0          # SIGTERM -> SIGKILL for a rank's process (as hora.run's default)
_POLL_S = 0.1           # how often the driver looks at the store
_ABORT_POLL_S = 0.5     # how long a task waits for the driver's word between looks at its rank
_CANCEL_AFTER_S = 15.0  # after asking tasks to stop: how long before Spark is told to kill them
_JOIN_S = 30.0          # after cancelling the Spark job: how long to wait for Spark to let go

_STARTED = "spark/started/"
_EXIT = "spark/exit/"
_ABORT = "spark/abort"
# the last line of a Python traceback: "ValueError: ...", "hora.errors.HoraError: ..."
_PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b: ")


# -- placement (pure) -----------------------------------------------------------------------

def task_slots(hosts: Sequence[str]) -> list[SlotInfo]:
    """Each rank's :class:`~hora.runner.SlotInfo`, given the host of each rank's task.

    Ranks on one host take local ranks in rank order; hosts are ordered by their lowest rank
    (Spark places partitions where it likes, so a host's ranks need not be consecutive).

    Example:
        >>> [(s.local_rank, s.local_size, s.cross_rank, s.cross_size)
        ...  for s in task_slots(["a", "b", "a"])]
        [(0, 2, 0, 2), (0, 1, 1, 2), (1, 2, 0, 1)]
    """
    order = list(dict.fromkeys(hosts))
    ranks_on = {host: [r for r, h in enumerate(hosts) if h == host] for host in order}
    slots = []
    for rank, host in enumerate(hosts):
        local_rank = ranks_on[host].index(rank)
        peers = [h for h in order if len(ranks_on[h]) > local_rank]
        slots.append(SlotInfo(hostname=host, rank=rank, local_rank=local_rank,
                              local_size=len(ranks_on[host]), cross_rank=peers.index(host),
                              cross_size=len(peers), size=len(hosts)))
    return slots


def _host_of(address):
    """``"10.0.0.5:40123"`` or ``"[fe80::1]:40123"`` -> the host part."""
    host, sep, _port = address.rpartition(":")
    if not sep:
        return address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# -- the task side (runs in a pyspark Python worker) ----------------------------------------

def _make_mapper(spec):
    """The barrier stage's function; ``spec`` is plain data (no hora object crosses to Spark)."""
    def mapper(_partition):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        hosts = [_host_of(info.address) for info in ctx.getTaskInfos()]
        yield _run_rank(spec, task_slots(hosts)[rank])
    return mapper


def _run_rank(spec, slot):
    """Run one rank's process under the driver's eye; return how it ended."""
    client = RendezvousClient(spec["addr"], spec["port"], spec["secret"],
                              timeout=spec["start_timeout"])
    try:
        client.put(f"{_STARTED}{slot.rank}", slot.hostname)
        base = job_env(os.environ, _rank_env(spec), spec["nics"], spec["init_timeout"])
        env = worker_env(slot, base, spec["addr"], spec["port"], spec["secret"], spec["job_id"])
        command = [spec["executable"] or sys.executable, "-m", "hora.runner.task"]
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                 start_new_session=True, close_fds=True,
                                 preexec_fn=proc.parent_death_hook())
        try:
            returncode, why = _watch(child, client)
        finally:
            _stop(child)
            remove_segments_of([child.pid])
        record = (slot.rank, returncode, slot.hostname, child.pid, why)
        try:
            client.put(f"{_EXIT}{slot.rank}", record)
        except RendezvousError:
            pass            # the driver is gone; Spark's result is all it could read anyway
        return record
    finally:
        client.close()


def _rank_env(spec):
    """The user's variables, with a PYTHONPATH that finds what the driver's ``fn`` imports:
    theirs, then this Python worker's ``sys.path`` (files Spark shipped), then the
    driver's ``sys.path`` entries that exist here."""
    env = dict(spec["env"])
    entries = env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else []
    for entry in [*sys.path, *spec["driver_path"]]:
        path = os.path.abspath(entry or os.getcwd())
        if os.path.exists(path):
            entries.append(path)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(e for e in entries if e))
    return env


def _watch(child, client):
    """Wait for ``child`` to exit, or for the driver to ask it to stop; (returncode, why)."""
    while True:
        returncode = child.poll()
        if returncode is not None:
            return returncode, None
        try:
            reason = client.get(_ABORT, _ABORT_POLL_S)
        except RendezvousTimeoutError:
            continue
        except RendezvousError as e:        # the driver died or dropped us
            return None, f"lost the driver: {e}"
        return None, f"stopped by the driver: {reason}"


def _stop(child):
    """SIGTERM the rank's process group, SIGKILL it after a grace period; reap the rank."""
    if child.poll() is None:
        proc.signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    proc.signal_group(child.pid, signal.SIGKILL)    # whatever the rank left running
    try:
        child.wait(_GRACE_S)
    except subprocess.TimeoutExpired:
        log.warning("rank process %d did not die after SIGKILL", child.pid)


# -- the driver side ------------------------------------------------------------------------

def run(fn: Callable[..., T], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None,
        use_mpi: bool | None = None, use_gloo: bool | None = None,
        extra_mpi_args: str | None = None, env: Mapping[str, str] | None = None,
        stdout: Any = None, stderr: Any = None, verbose: int = 1,
        nics: str | Sequence[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None, *, timeout_s: float | None = None,
        init_timeout: float | None = None) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks; return the results by rank.

    Each rank runs in a fresh Python process started by its Spark task (one task per rank, in
    a barrier stage), with the ``HORA_*`` contract set, so ``fn`` calls ``hora.init()`` and
    uses hora as under ``hora run``.  Call it on the driver, with a SparkContext active.

    Example:
        >>> def train():
        ...     import hora.torch as hvd
        ...     hvd.init()
        ...     return hvd.allreduce(torch.tensor([hvd.rank()])).item()
        >>> spark = SparkSession.builder.getOrCreate()           # doctest: +SKIP
        >>> hora.spark.run(train, num_proc=2)                     # doctest: +SKIP
        [0.5, 0.5]

    Args:
        fn: the function (anything cloudpickle can pickle); runs on every rank.
        args, kwargs: its arguments, the same on every rank.
        num_proc: number of ranks (default: the context's ``defaultParallelism``).  Barrier
            mode needs as many free task slots at once.
        start_timeout: seconds for the cluster to offer ``num_proc`` task slots and for every
            task to check in at the driver (default 600: executors may start on demand).
        use_mpi, use_gloo, extra_mpi_args: Horovod's controller choice: hora's own data
            planes always run, and ``use_mpi=True`` is refused.
        env: extra environment variables for the ranks.
        stdout, stderr, prefix_output_with_timestamp: accepted for Horovod's callers and
            ignored: the ranks' output goes to the executors' logs, as any Spark task's does.
        verbose: 0 is quiet; 1 (the default) logs the job's size and progress at INFO; 2 at
            DEBUG too.
        nics: the interface the data plane binds to on every executor host (``HORA_IFACE``):
            a name or a list, of which the first is used.
        executable: the ranks' Python (default: that of each task's Python worker).
        timeout_s: limit on the whole job in seconds (None: no limit).
        init_timeout: seconds for every rank to reach ``hora.init()`` (``HORA_START_TIMEOUT``;
            None: hora's default).

    Returns:
        ``[fn's value on rank 0, on rank 1, ...]``.

    Raises:
        WorkerFailedError: a rank raised or died; the earliest failure to reach the driver,
            with its ``rank``, ``host``, ``exitcode`` and ``detail`` (the rank's traceback).
        RendezvousTimeoutError: the cluster did not offer ``num_proc`` slots, or the tasks
            did not all start, within ``start_timeout``.
        CollectiveTimeoutError: ``timeout_s`` passed (the ranks were stopped).
        HoraError: the Spark job failed for a reason of Spark's own (its message included),
            or no SparkContext is active.
        ValueError: ``num_proc`` is not a positive integer, or exceeds a local master's
            fixed number of slots; ``use_mpi`` and ``use_gloo`` both true.
        NotImplementedError: ``use_mpi=True``.
    """
    _check_controller(use_mpi, use_gloo)
    del extra_mpi_args, stdout, stderr, prefix_output_with_timestamp   # documented as ignored
    sc = _active_context()
    num_proc = _num_proc(sc, num_proc)
    start_timeout = DEFAULT_START_TIMEOUT_S if start_timeout is None else float(start_timeout)
    level = logging.INFO if verbose == 1 else logging.DEBUG if verbose and verbose > 1 else None
    task = {"env": dict(env or {}), "nics": _first_nic(nics), "executable": executable,
            "start_timeout": start_timeout, "init_timeout": init_timeout,
            "driver_path": [os.path.abspath(p or os.getcwd()) for p in sys.path]}
    bind, addr = _driver_addresses(sc)
    job = _SparkJob(sc, num_proc, start_timeout, timeout_s, level)
    return _serve(job, bind, addr, (fn, tuple(args), dict(kwargs or {})), task)


def _check_controller(use_mpi, use_gloo):
    """Refuse Horovod's MPI controller, alone or with Gloo: every rank runs hora's own data
    planes."""
    if use_mpi and use_gloo:
        raise ValueError("spark.run(use_mpi=True, use_gloo=True): choose one")
    if use_mpi:
        raise NotImplementedError("spark.run(use_mpi=True) is not supported: every rank runs "
                                  "hora's own data planes (leave use_mpi out)")


def _num_proc(sc, num_proc):
    """The job's size: ``num_proc``, or as many ranks as the context runs tasks by default."""
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"spark.run(num_proc={num_proc!r}): must be a positive integer")
    return num_proc


def _serve(job, bind, addr, call, task):
    """Run the barrier stage while the job's store, under a fresh secret, holds ``call``
    (pickled, as :func:`hora.run` stores it); each task gets ``task`` and the store's
    address.  The store stops with the job, however that ends."""
    secret = new_secret()
    server = RendezvousServer(secret, host=bind, port=0).start()
    try:
        server.put(FN_KEY, cloudpickle.dumps(call))
        spec = {"addr": addr, "port": server.port, "secret": secret, "job_id": job.job_id,
                **task}
        job.wait_for_slots()
        return job.run(server, _make_mapper(spec))
    finally:
        server.stop()


def _active_context():
    try:
        from pyspark import SparkContext
    except ImportError as e:
        raise HoraError("hora.spark.run needs pyspark (pip install pyspark)") from e
    sc = SparkContext._active_spark_context
    if sc is None:
        raise HoraError("hora.spark.run: no active SparkContext; start a SparkSession (or "
                        "SparkContext) on this driver first")
    return sc


def _driver_addresses(sc):
    """(address to bind, address executors use): where Spark's own driver endpoint is."""
    conf = sc.getConf()
    host = conf.get("spark.driver.host") or socket.gethostname()
    bind = conf.get("spark.driver.bindAddress") or host
    try:
        bind = socket.gethostbyname(bind)
    except OSError:
        bind = "0.0.0.0"
    return bind, host


def _first_nic(nics):
    if not nics:
        return None
    if isinstance(nics, str):
        return nics.split(",")[0].strip() or None
    return next(iter(nics))


def _slots(sc):
    """Task slots the cluster offers now (executor cores / task cpus), or None if unknown.

    Uses Spark's own count (the one its barrier check uses), which pyspark does not expose."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(
            jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception as e:   # noqa: BLE001 - a private API of Spark's: absent is "unknown"
        log.debug("cannot count Spark's task slots: %s", e)
        return None


class _SparkJob:
    """One barrier job of a :func:`run` call: starts it, watches the store, tears it down."""

    def __init__(self, sc, num_proc, start_timeout, timeout_s, level):
        self.sc, self.num_proc = sc, num_proc
        self.start_timeout, self.timeout_s, self.level = start_timeout, timeout_s, level
        self.job_id = f"spark-{uuid.uuid4().hex[:12]}"
        self.group = f"hora.spark.run.{self.job_id}"
        self.started_at = time.monotonic()
        self._outcome = {}

    def _say(self, message, *args):
        if self.level is not None:
            log.log(self.level, "%s: " + message, self.job_id, *args)

    def wait_for_slots(self):
        """Wait (up to ``start_timeout``) until the cluster has ``num_proc`` slots at once.

        Spark checks this too, but retries for minutes before it fails (its
        ``spark.scheduler.barrier.maxConcurrentTasksCheck.*`` settings)."""
        deadline = self.started_at + self.start_timeout
        master = self.sc.master
        fixed = master == "local" or (master.startswith("local[") and master.endswith("]"))
        while True:
            slots = _slots(self.sc)
            if slots is None or slots >= self.num_proc:
                self._say("%d rank(s) as Spark barrier tasks (%s task slots)", self.num_proc,
                          "unknown" if slots is None else slots)
                return
            advice = (f"Spark's barrier mode starts all {self.num_proc} tasks at once, so it "
                      f"needs {self.num_proc} free task slots (executor cores / "
                      f"spark.task.cpus): lower num_proc or add executors")
            if fixed:
                raise ValueError(f"spark.run(num_proc={self.num_proc}): master {master!r} has "
                                 f"{slots} task slot(s). {advice}")
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"spark.run(num_proc={self.num_proc}): the cluster offered {slots} task "
                    f"slot(s) within start_timeout={self.start_timeout:g} s. {advice}, or "
                    f"raise start_timeout if executors are allocated on demand")
            time.sleep(0.2)

    def run(self, server, mapper):
        """Run the barrier stage; return the ranks' values, or raise for the first failure."""
        thread = threading.Thread(target=self._spark_job, args=(mapper,), daemon=True,
                                  name=f"hora-{self.group}")
        thread.start()
        try:
            failure, timed_out, missing = self._watch(server, thread)
        finally:
            if thread.is_alive():
                self._tear_down(server, thread, "the driver stopped the job")
        results = server.items(RESULT_PREFIX)
        outcomes = {int(k[len(RESULT_PREFIX):]): cloudpickle.loads(v) for k, v in results.items()}
        if failure is not None:
            raise _failure_error(failure, outcomes.get(failure[0]))
        if missing:
            ranks = ", ".join(map(str, missing))
            raise RendezvousTimeoutError(
                f"hora job {self.job_id}: Spark task(s) of rank(s) {ranks} did not start "
                f"within start_timeout={self.start_timeout:g} s (Spark's reason, if any: "
                f"{_spark_reason(self._outcome.get('error'))}); check that the cluster has "
                f"{self.num_proc} free task slots, or raise start_timeout")
        if timed_out:
            exits = server.items(_EXIT)
            running = [r for r in range(self.num_proc) if f"{_EXIT}{r}" not in exits
                       or exits[f"{_EXIT}{r}"][4] is not None]
            raise CollectiveTimeoutError(
                f"hora job {self.job_id} timed out after {self.timeout_s:g} s; rank(s) "
                f"{', '.join(map(str, running))} were still running (their output is in the "
                f"executors' logs)")
        error = self._outcome.get("error")
        if error is not None:
            exits = server.items(_EXIT)
            silent = [r for r in range(self.num_proc) if f"{_EXIT}{r}" not in exits]
            raise HoraError(f"hora job {self.job_id}: the Spark job failed (rank(s) without "
                            f"an exit report: {', '.join(map(str, silent)) or 'none'}): "
                            f"{_spark_reason(error)}") from error
        for rank in range(self.num_proc):       # a rank that ended without a word, or oddly
            if rank not in outcomes or outcomes[rank][0] != "ok":
                record = server.items(_EXIT).get(
                    f"{_EXIT}{rank}", (rank, None, None, None, "reported no exit"))
                raise _failure_error(record, outcomes.get(rank))
        return [outcomes[rank][1] for rank in range(self.num_proc)]

    def _spark_job(self, mapper):
        """The Spark job, in a thread of its own (pyspark pins the job group to it)."""
        try:
            self.sc.setJobGroup(self.group, "hora.spark.run", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
            self._outcome["records"] = rdd.barrier().mapPartitions(mapper).collect()
        except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
            self._outcome["error"] = e

    def _watch(self, server, thread):
        """Poll the store until the job ends; (first failed exit, timed out, ranks not started).

        The first failed exit is the earliest to reach the driver; at once the other tasks are
        asked to stop (they would fail, or wait for the failed rank, anyway)."""
        start_deadline = self.started_at + self.start_timeout
        end_deadline = (None if self.timeout_s is None
                        else time.monotonic() + float(self.timeout_s))
        seen, all_started = set(), False
        while thread.is_alive():
            thread.join(_POLL_S)
            now = time.monotonic()
            failure = self._first_failure(server, seen)
            if failure is not None:
                self._tear_down(server, thread, f"rank {failure[0]} failed")
                return failure, False, []
            if not all_started:
                started = server.items(_STARTED)
                all_started = len(started) == self.num_proc
                if all_started:
                    self._say("all %d Spark task(s) started", self.num_proc)
                elif now >= start_deadline:
                    missing = [r for r in range(self.num_proc) if f"{_STARTED}{r}" not in started]
                    self._tear_down(server, thread, "start_timeout passed")
                    return None, False, missing
            if end_deadline is not None and now >= end_deadline:
                self._tear_down(server, thread, f"timeout_s={self.timeout_s:g} passed")
                return None, True, []
        # the job ended between two looks: what arrived since the last one
        return self._first_failure(server, seen), False, []

    def _first_failure(self, server, seen):
        """The first failed exit among those not ``seen`` yet (in rank order within one
        look); on finding one, asks the other tasks to stop."""
        exits = server.items(_EXIT)
        for key in sorted(set(exits) - seen, key=lambda k: int(k[len(_EXIT):])):
            seen.add(key)
            record = exits[key]
            if _failed(record):
                self._say("rank %d failed (%s); stopping the other ranks", record[0],
                          _how(record))
                server.put(_ABORT, f"rank {record[0]} failed")
                return record
        return None

    def _tear_down(self, server, thread, reason):
        """Ask the tasks to stop their ranks; then have Spark cancel the job; bounded."""
        server.put(_ABORT, reason)
        thread.join(_CANCEL_AFTER_S)
        if thread.is_alive():
            self._say("cancelling Spark job group %s (%s)", self.group, reason)
            self.sc.cancelJobGroup(self.group)
            thread.join(_JOIN_S)
        if thread.is_alive():
            log.warning("%s: Spark job group %s still running %g s after it was cancelled",
                        self.job_id, self.group, _JOIN_S)


def _failed(record):
    _rank, returncode, _host, _pid, why = record
    return why is None and returncode != 0


def _how(record):
    return proc.describe_exit(record[1]) if record[1] is not None else record[4]


def _spark_reason(error):
    """A Spark error in a line or two (Py4J's are pages long): Spark's first line that names
    an exception, and the last line of a Python traceback in it (a task's own error)."""
    if error is None:
        return "none"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Exception" in line or "Error" in line]
    reason = (named or lines or [type(error).__name__])[0][:1000]
    python = [line for line in named if _PYTHON_ERROR.match(line)]
    if python and python[-1] not in reason:
        reason += f" (the task's Python error: {python[-1][:500]})"
    return reason


def _failure_error(record, outcome):
    """The WorkerFailedError for one rank's exit record and (maybe) its stored outcome."""
    rank, returncode, host, pid, why = record
    if outcome is not None and outcome[0] == "error":
        detail = outcome[1]
        message = f"rank {rank} (pid {pid}, host {host}) raised:\n{detail}"
    else:
        how = _how(record)
        if outcome is not None:
            detail = f"returned a result, then {how}"
        elif returncode == 0:
            detail = f"{how} without reporting a result (os._exit?)"
        else:
            detail = f"{how} without reporting a result"
        message = f"rank {rank} (pid {pid}, host {host}) {detail}"
    return WorkerFailedError(message, rank=rank, exitcode=returncode, host=host, detail=detail)
