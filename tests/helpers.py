"""Shared by the multi-process tests: run a function on N real ranks, with a deadline.

``run_ranks(fn, np)`` starts ``np`` real worker processes through hora's own launcher
(:func:`hora.runner.run`), each of which calls ``hora.init()``, runs ``fn(*args)``,
and calls ``hora.shutdown()``; the per-rank return values come back in rank order.  On timeout
the launcher dumps every worker's Python traceback, kills the job, and the test fails with a
rank-tagged message.
"""
import hora


def _in_job(fn, args, kwargs):
    hora.init()
    try:
        return fn(*args, **kwargs)
    finally:
        hora.shutdown()


def run_ranks(fn, np, timeout_s=30, args=(), kwargs=None, env=None, init=True):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the results by rank.

    Args:
        init: wrap ``fn`` in hora.init()/shutdown() (False: ``fn`` does it itself).
        env: extra environment variables for the workers.
    """
    from hora.runner import run
    kwargs = kwargs or {}
    if init:
        return run(_in_job, args=(fn, args, kwargs), np=np, env=env, timeout_s=timeout_s)
    return run(fn, args=args, kwargs=kwargs, np=np, env=env, timeout_s=timeout_s)


def job_fixture(worker, env_for=lambda n: None, timeout_s=60):
    """A module-scoped pytest fixture ``job``: ``job(n)`` runs ``worker(n)`` once on ``n``
    ranks (cached for the module) and returns every rank's result; a failed job fails the
    tests that use it, not the whole module."""
    import pytest

    @pytest.fixture(scope="module")
    def job():
        jobs = {}

        def get(n):
            if n not in jobs:
                try:
                    jobs[n] = run_ranks(worker, n, timeout_s=timeout_s, args=(n,),
                                        env=env_for(n))
                except Exception as e:  # noqa: BLE001 - reported by each test that needs it
                    jobs[n] = e
            if isinstance(jobs[n], Exception):
                pytest.fail(f"the job with {n} ranks failed: {jobs[n]!r}")
            return jobs[n]
        yield get
    return job


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
    """N worker processes started by hand; ``results()`` waits (bounded) and reads them."""

    def __init__(self, fn, np, tmp_path, args=(), env=None):
        import cloudpickle
        from hora.rendezvous import RendezvousServer, new_secret
        self.secret = new_secret()
        self.server = RendezvousServer(self.secret).start()
        self.tmp = tmp_path
        blob = tmp_path / "fn.pkl"
        blob.write_bytes(cloudpickle.dumps((fn, args)))
        self.procs = []
        path = os.pathsep.join(p for p in sys.path if p)
        for r in range(np):
            e = dict(os.environ, HORA_RANK=str(r), HORA_SIZE=str(np), HORA_LOCAL_RANK=str(r),
                     HORA_LOCAL_SIZE=str(np), HORA_RENDEZVOUS_ADDR="127.0.0.1",
                     HORA_RENDEZVOUS_PORT=str(self.server.port), HORA_SECRET=self.secret,
                     PYTHONPATH=path, **(env or {}))
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
