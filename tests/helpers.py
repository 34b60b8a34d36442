"""Shared by the multi-process tests: run a function on N real ranks, with a deadline.

``run_ranks(fn, np)`` starts ``np`` real worker processes through hora's own launcher
(:func:`hora.runner.run`), each of which calls ``hora.init()``, runs ``fn(*args)``,
and calls ``hora.shutdown()``; the per-rank return values come back in rank order.  On timeout
the launcher dumps every worker's Python traceback, kills the job, and the test fails with a
rank-tagged message.
"""
import numpy as np

import hora


def _in_job(fn, args, kwargs):
    hora.init()
    try:
        return fn(*args, **kwargs)
    finally:
        hora.shutdown()


def run_sections(sections):
    """Run every ``{name: fn}`` of one worker; return ``{name: ("ok", value)}`` or ``("error",
    traceback)``: a failing section is reported by its own test, and the others still run."""
    import traceback
    out = {}
    for name, run in sections.items():
        try:
            out[name] = ("ok", run())
        except Exception:  # noqa: BLE001 - reported by the test of that section
            out[name] = ("error", traceback.format_exc())
    return out


# the optional packages TensorFlow and Keras import when they find them installed (see
# tests/without/sitecustomize.py): a TensorFlow rank that needs none of them goes without
TF_EXTRAS = ("jax", "jaxlib", "sklearn", "pandas", "matplotlib")


def without(packages, env=None):
    """``env`` (extra variables for a job, or None) with ``packages`` made unimportable in
    its processes: tests/without/ leads their PYTHONPATH, and its sitecustomize.py hides
    the packages named in ``HORA_TEST_WITHOUT``."""
    env = dict(env or {})
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "without")
    rest = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, rest) if p)
    env["HORA_TEST_WITHOUT"] = ",".join(packages)
    return env


def keras_extras(backend):
    """:data:`TF_EXTRAS` but the package of Keras' ``backend`` itself (JAX's)."""
    return tuple(p for p in TF_EXTRAS if not p.startswith(backend))


def run_ranks(fn, np, timeout_s=30, args=(), kwargs=None, env=None, init=True, python=None):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the results by rank.

    Args:
        init: wrap ``fn`` in hora.init()/shutdown() (False: ``fn`` does it itself).
        env: extra environment variables for the workers.
        python: the interpreter the workers run (default this one's; see
            tests/mxnet_env.py for one with other packages).
    """
    from hora.runner import run
    kwargs = kwargs or {}
    if init:
        return run(_in_job, args=(fn, args, kwargs), np=np, env=env, timeout_s=timeout_s,
                   executable=python)
    return run(fn, args=args, kwargs=kwargs, np=np, env=env, timeout_s=timeout_s,
               executable=python)


def job_fixture(worker, env_for=lambda n: None, timeout_s=60, sizes=None, runner=None):
    """A module-scoped pytest fixture ``job``: ``job(n)`` runs ``worker(n)`` once on ``n``
    ranks (cached for the module) and returns every rank's result; a failed job fails the
    tests that use it, not the whole module.

    Args:
        sizes: the N this module runs (others are skipped); None: every N asked for.
        runner: how to start the ranks, ``runner(fn, np, timeout_s=, args=, env=)``;
            default :func:`run_ranks` (hora's launcher), or :func:`run_mpirun`.
    """
    import pytest
    runner = runner or run_ranks

    @pytest.fixture(scope="module")
    def job():
        jobs = {}

        def get(n):
            if sizes is not None and n not in sizes:
                pytest.skip(f"this backend's suite runs N in {sorted(sizes)} (CI time)")
            return cached(jobs, n, lambda: runner(worker, n, timeout_s=timeout_s, args=(n,),
                                                  env=env_for(n)), f"the job with {n} ranks")
        yield get
    return job


def cached(jobs, key, run, what):
    """``jobs[key]``, made by ``run()`` the first time; where ``run()`` raised, every test
    that asks fails saying ``what`` failed and why (one failed job fails the tests that read
    it, not the module).  For a module's fixture that runs each of its jobs once."""
    import pytest
    if key not in jobs:
        try:
            jobs[key] = run()
        except Exception as e:  # noqa: BLE001 - reported by each test that needs it
            jobs[key] = e
    if isinstance(jobs[key], Exception):
        pytest.fail(f"{what} failed: {jobs[key]!r}")
    return jobs[key]


def init_error():
    """In a rank: what ``hora.init()`` raised (its message), or None after a clean init and
    shutdown."""
    import hora
    try:
        hora.init()
    except hora.HoraError as e:
        return str(e)
    hora.shutdown()
    return None


def section(results, name):
    """Per-rank results of one section (``("ok", value)`` / ``("error", traceback)`` per
    rank), or a test failure quoting the first rank that raised."""
    import pytest
    for rank, res in enumerate(results):
        if res[name][0] == "error":
            pytest.fail(f"section {name!r} raised on rank {rank}:\n{res[name][1]}")
    return [res[name][1] for res in results]


# -- a bare harness for failure tests --------------------------------------------------------
# hora's launcher stops every rank as soon as one fails, which is right for users but hides
# what the survivors saw.  Failure tests start ranks themselves: a rendezvous server, N
# processes with the HORA_* contract, and one result file per rank.
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

_BOOT = """
import sys, traceback, cloudpickle
fn, args = cloudpickle.loads(open(sys.argv[1], 'rb').read())
try:
    out = ('ok', fn(*args))
except BaseException as e:
    out = ('error', type(e).__name__, str(e), getattr(e, 'rank', None), traceback.format_exc())
with open(sys.argv[2], 'wb') as f:
    f.write(cloudpickle.dumps(out))
"""


class RawJob:
    """N worker processes started by hand; ``results()`` waits (bounded) and reads them.

    ``hosts``: ``[(host name, ranks)]``, the ranks in that order on "hosts" of this machine
    (each rank's HORA_HOSTNAME, local and cross ranks as ``hora run -H`` gives them);
    default one host of ``np`` ranks."""

    def __init__(self, fn, np, tmp_path, args=(), env=None, hosts=None):
        import cloudpickle
        from hora.rendezvous import RendezvousServer, new_secret
        self.secret = new_secret()
        self.server = RendezvousServer(self.secret).start()
        self.tmp = tmp_path
        blob = tmp_path / "fn.pkl"
        blob.write_bytes(cloudpickle.dumps((fn, args)))
        self.procs = []
        path = os.pathsep.join(p for p in sys.path if p)
        places = [{"HORA_LOCAL_RANK": str(r), "HORA_LOCAL_SIZE": str(np)} for r in range(np)]
        if hosts is not None:
            places = [{"HORA_LOCAL_RANK": str(local), "HORA_LOCAL_SIZE": str(count),
                       "HORA_CROSS_RANK": str(cross), "HORA_CROSS_SIZE": str(len(hosts)),
                       "HORA_HOSTNAME": host}
                      for cross, (host, count) in enumerate(hosts) for local in range(count)]
            assert len(places) == np, (np, hosts)
        for r in range(np):
            e = dict(os.environ, HORA_RANK=str(r), HORA_SIZE=str(np),
                     HORA_RENDEZVOUS_ADDR="127.0.0.1", HORA_RENDEZVOUS_PORT=str(self.server.port),
                     HORA_SECRET=self.secret, PYTHONPATH=path, **places[r], **(env or {}))
            with open(tmp_path / f"stderr{r}", "wb") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", _BOOT, str(blob), str(tmp_path / f"out{r}.pkl")],
                    env=e, stdin=subprocess.DEVNULL, stderr=err))

    def results(self, timeout_s=30):
        """Per-rank ('ok', value) / ('error', type, message, rank, tb) / None if no result."""
        import cloudpickle
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"ranks {[i for i, q in enumerate(self.procs) if q.poll() is None]} "
                        f"still running after {timeout_s} s") from None
        finally:
            self.close()
        out = []
        for r in range(len(self.procs)):
            f = self.tmp / f"out{r}.pkl"
            out.append(cloudpickle.loads(f.read_bytes()) if f.exists() else None)
        return out

    def stderr(self, rank):
        """What rank ``rank`` wrote to stderr."""
        return (self.tmp / f"stderr{rank}").read_text(errors="replace")

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        self.server.stop()


def said(tmp, rank):
    """In a rank of a :class:`RawJob` in ``tmp``: what rank ``rank`` has written to stderr so
    far ("" before it wrote anything)."""
    try:
        with open(os.path.join(str(tmp), f"stderr{rank}"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def until(done, within_s=20.0, poll_s=0.05):
    """Wait until ``done()`` or ``within_s`` seconds have passed; return ``done()``'s last
    answer.  A rank that must stay late until the others have shown something (a stall
    warning on rank 0's stderr) waits for it, not for a time long enough on a busy machine."""
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        time.sleep(poll_s)
    return done()


# -- the same workers under Open MPI's mpirun ------------------------------------------------
# No hora launcher: mpirun starts the ranks, hora.init() meets through mpi4py (its placement
# source is "mpirun"), and each rank leaves its result in a cloudpickle file.
_MPI_BOOT = """
import os, sys, traceback, cloudpickle, hora
fn, args = cloudpickle.loads(open(sys.argv[1], 'rb').read())
rank = int(os.environ['OMPI_COMM_WORLD_RANK'])
try:
    hora.init()
    try:
        out = ('ok', fn(*args))
    finally:
        hora.shutdown()
except BaseException:
    out = ('error', traceback.format_exc())
with open(os.path.join(sys.argv[2], f'out{rank}.pkl'), 'wb') as f:
    f.write(cloudpickle.dumps(out))
"""

_NOT_INHERITED = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "PRTE_", "SLURM_")


def die_in(delay):
    """In the victim of :func:`until_one_dies`: SIGKILL this process ``delay`` seconds from
    now, from a thread, at no particular point of what the main thread does (the time of
    death goes into ``$DEATH_FILE`` first)."""
    import signal
    import threading

    def die_soon():
        time.sleep(delay)
        with open(os.environ["DEATH_FILE"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die_soon, daemon=True).start()


def until_one_dies(fn, np, tmp_path, victim, args=(), timeout_s=30, env=None):
    """Run ``fn(*args)`` on ``np`` ranks (a :class:`RawJob`) whose rank ``victim`` writes the
    time it dies into the file ``$DEATH_FILE`` and dies.  Checks that the victim returned
    nothing and every other rank returned normally; returns ``(job, the time of death,
    {rank: what it returned})`` for the survivors."""
    death = tmp_path / "death"
    job = RawJob(fn, np, tmp_path, args=args, env={"DEATH_FILE": str(death), **(env or {})})
    results = job.results(timeout_s=timeout_s)
    killed_at = float(death.read_text())
    assert results[victim] is None
    survived = {}
    for r, res in enumerate(results):
        if r != victim:
            assert res[0] == "ok", res
            survived[r] = res[1]
    return job, killed_at, survived


def mpirun_env(env=None):
    """This process's environment for an mpirun job: no launcher variables of ours or of an
    enclosing job, root allowed (CI runs as root), ``env`` on top."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = os.pathsep.join(p for p in sys.path if p)
    return dict(base, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=path, **(env or {}))


_MPIRUN_REASON = []


def mpirun_unusable():
    """Why ``mpirun`` cannot start a local job here (None when it can): not installed, or
    installed but unable to launch even one local process (an Open MPI that insists on an
    ssh agent the machine lacks, say).  Tried once per test session."""
    import shutil
    if not _MPIRUN_REASON:
        if shutil.which("mpirun") is None:
            reason = "Open MPI's mpirun is not installed (pip install 'hora[mpi]')"
        else:
            try:
                run = subprocess.run(["mpirun", "--oversubscribe", "-np", "1", sys.executable,
                                      "-c", "pass"], env=mpirun_env(), capture_output=True,
                                     text=True, timeout=60, stdin=subprocess.DEVNULL)
                reason = None if run.returncode == 0 else (
                    f"mpirun cannot start a local process here (exit {run.returncode}): "
                    f"{' '.join((run.stdout + run.stderr).split())[:300]}")
            except subprocess.TimeoutExpired:
                reason = "mpirun -np 1 did not finish within 60 s"
        _MPIRUN_REASON.append(reason)
    return _MPIRUN_REASON[0]


def run_mpirun(fn, np, timeout_s=30, args=(), env=None):
    """Like :func:`run_ranks`, with ``mpirun -np np`` starting the ranks: each calls
    hora.init(), ``fn(*args)`` and hora.shutdown(); returns the results by rank.  A rank that
    raised (or wrote nothing) fails with its traceback and mpirun's output."""
    import signal
    import tempfile
    import cloudpickle
    with tempfile.TemporaryDirectory(prefix="hora-mpirun-") as tmp:
        blob = os.path.join(tmp, "fn.pkl")
        with open(blob, "wb") as f:
            f.write(cloudpickle.dumps((fn, args)))
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np),
               sys.executable, "-c", _MPI_BOOT, blob, tmp]
        proc = subprocess.Popen(cmd, env=mpirun_env(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)         # mpirun and the ranks it started
            output, _ = proc.communicate()
            raise AssertionError(f"mpirun -np {np} still running after {timeout_s} s:\n"
                                 f"{output.decode(errors='replace')[-4000:]}") from None
        tail = output.decode(errors="replace")[-4000:]
        results = []
        for r in range(np):
            path = os.path.join(tmp, f"out{r}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} of mpirun -np {np} left no result (exit status "
                                     f"{proc.returncode}):\n{tail}")
            with open(path, "rb") as f:
                status, value = cloudpickle.loads(f.read())
            if status == "error":
                raise AssertionError(f"rank {r} of mpirun -np {np} raised:\n{value}")
            results.append(value)
        return results


# -- type hints, as a user's mypy sees them --------------------------------------------------
def run_mypy(source, tmp_path, cache_dir, timeout_s=170):
    """mypy's verdict on the user script ``source``: ``(revealed types, output)``, the
    revealed types without mypy's ``builtins.`` (versions differ in spelling it out).
    Skips the test where mypy is not installed.

    ``cache_dir`` (the session's ``mypy_cache`` fixture) is shared by every run of the
    session: what one run learnt of the standard library, NumPy and hora is read by the
    next instead of checked again (hora's run: 4.5 s alone, 0.6 s after the torch run),
    and mypy checks again whatever changed since, the user script included."""
    import importlib.util
    import textwrap
    import pytest
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]' brings it)")
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(source))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # an editable install is an import hook mypy does not follow: point it at the source
    run = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                          "--cache-dir", str(cache_dir), str(script)],
                         capture_output=True, text=True, timeout=timeout_s,
                         env=dict(os.environ, MYPYPATH=root), cwd=tmp_path)
    revealed = [line.split("Revealed type is ")[1].replace("builtins.", "")
                for line in run.stdout.splitlines() if "Revealed type is" in line]
    return revealed, run.stdout


# -- jobs started as other launchers would (torchrun, srun) --------------------------------
_LAUNCHER_PREFIXES = ("HORA_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK")


def launcher_free_env(tmp_path, **extra):
    """This process's environment without any launcher's variables, and with a home
    directory of the test's own: outside ``hora run``, ``init()`` may make a per-user secret
    in ``~/.hora`` (hora.rendezvous.keys), which must not land in the real one."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return dict(env, HOME=str(home), PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                **extra)


def free_port_pair():
    """A free port whose successor is free too (torchrun's store takes MASTER_PORT, hora's
    rank 0 the next one)."""
    import socket
    import pytest
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    pytest.skip("no two consecutive free ports")


def pid_alive(pid):
    """Whether process ``pid`` is alive and not a zombie (Linux: read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def alive_with(marker):
    """Pids of live (not zombie) processes, other than this one, whose command line holds
    ``marker`` (Linux: read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if marker.encode() in argv and stat[stat.rfind(b")") + 2:][:1] != b"Z":
            pids.append(int(entry))
    return pids


def alive_count(marker, count, within_s=10.0):
    """``alive_with(marker)`` once it lists ``count`` processes, or as it is after
    ``within_s`` seconds.  A process is listed only once its command line is set, which
    Linux does late in ``execve``: after the ``vfork`` or the close-on-exec pipe that tells
    its parent (``subprocess.Popen``) that the exec went through; so a child that its
    parent has seen started may still be missing for a moment on a busy machine."""
    deadline = time.monotonic() + within_s
    while len(pids := alive_with(marker)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def survivors(marker, within_s):
    """Wait up to ``within_s`` seconds for every process with ``marker`` in its command line
    to end; return the pids still alive then (``[]``: none)."""
    deadline = time.monotonic() + within_s
    while alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive_with(marker)


def on_threads(transports, fn, timeout_s):
    """Run ``fn(transport)`` for each of ``transports`` (one rank each) on a thread of its
    own; return the results in rank order, then close the transports.  Fails the test
    naming the ranks that raised or did not finish within ``timeout_s``."""
    import threading
    size = len(transports)
    results, errors = [None] * size, {}

    def body(r):
        try:
            results[r] = fn(transports[r])
        except BaseException as e:  # reported by the test thread below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank-{r}")
               for r in range(size)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout_s)
        hung = [r for r, th in enumerate(threads) if th.is_alive()]
    finally:
        for t in transports:
            t.close()
    assert not hung, f"ranks {hung} did not finish within {timeout_s} s"
    if errors:
        r = min(errors)
        raise AssertionError(f"rank {r} raised {errors[r]!r}") from errors[r]
    return results


def run_digits_example(example, tmp_path, epochs, env, args=()):
    """Run ``examples/<example>`` on 2 ranks with ``hora run`` (``--epochs``, checkpoints in
    ``tmp_path/ckpt``, extra ``args``), in ``tmp_path``, under ``env``; check that it exited 0
    and that rank 0 alone printed its final test accuracy; return (that accuracy, stdout)."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", example)
    cmd = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable,
           os.path.abspath(script), "--epochs", str(epochs), "--checkpoint-dir",
           str(tmp_path / "ckpt"), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    final = [line for line in out.stdout.splitlines() if "final test accuracy" in line]
    assert len(final) == 1 and final[0].startswith("[0]"), out.stdout[-2000:]
    return float(final[0].split("accuracy ")[1].split()[0]), out.stdout


def caught(call):
    """``(class name, is ValueError, is RuntimeError, message)`` of what ``call()`` raised,
    or None: how the bindings' argument-error tests compare with Horovod's exception types."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what was raised is the result
        return type(e).__name__, isinstance(e, ValueError), isinstance(e, RuntimeError), str(e)
    return None


def call_case(hvd, case, x, n, splits=None):
    """One differentiable collective of a binding's gradient tests (TensorFlow's, JAX's):
    ``case`` is ``(kind, op name or None)``, ``x`` the input, ``n`` the job's size, ``splits``
    an alltoall's."""
    kind, op = case
    op = getattr(hvd, op) if op else None
    if kind == "allreduce":
        return hvd.allreduce(x, op=op)
    if kind == "grouped_allreduce":
        return hvd.grouped_allreduce([x, 2.0 * x], op=op)[1]
    if kind == "allgather":
        return hvd.allgather(x)
    if kind == "grouped_allgather":
        return hvd.grouped_allgather([2.0 * x, x])[0]
    if kind == "broadcast":
        return hvd.broadcast(x, root_rank=n - 1)
    if kind == "alltoall":
        return hvd.alltoall(x, splits=splits)[0]
    if kind == "reducescatter":
        return hvd.reducescatter(x, op=op)
    if kind == "grouped_reducescatter":
        return hvd.grouped_reducescatter([x, x], op=op)[0]
    raise ValueError(f"no such case: {kind}")


def reduce_expected(xs, op, pre=1.0, post=1.0):
    """NumPy's reduction of the gathered inputs ``xs`` (in rank order) by ``op``'s name with
    Horovod's scaling (each input times ``pre``, the result times ``post``, an Average divided
    by the count), in float64, then in the inputs' dtype: the bindings' tests' oracle."""
    n, dt = len(xs), xs[0].dtype
    if dt == np.bool_:
        return np.logical_or.reduce(xs) if op in ("Sum", "Max") else np.logical_and.reduce(xs)
    fn = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum,
          "Product": np.multiply}[op]
    red = fn.reduce([x.astype(np.float64) * pre for x in xs]) * post
    red = red / n if op == "Average" else red
    if dt.kind in "iu":
        red = np.trunc(red)             # small values: no sum wraps around
    return red.astype(dt)


def block_bounds(rows, n):
    """Where each of ``n`` ranks' blocks of ``rows`` rows begins (and the end): the first
    ``rows % n`` blocks one row longer, as Horovod's reducescatter splits them."""
    q, extra = divmod(rows, n)
    return np.cumsum([0] + [q + 1 if k < extra else q for k in range(n)]).tolist()
