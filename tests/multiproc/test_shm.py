"""The shared-memory backend: it is really used, leaves nothing in /dev/shm, falls back to
TCP when shared memory is unavailable, and the launcher removes what a killed rank left.

(Its results are checked by the whole collective suite, test_collectives.py, which runs on
the default backend: shared memory on one host.)  Tests whose ranks need only their own
HORA_* variables share a job: one of 3 ranks on this host and one of 4 on two "hosts", each
running the tests' parts in turn (see "jobs of several parts" below).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import hora
from hora.backends.hierarchical import PIECE_BYTES
from tests.helpers import init_error, run_ranks, section

pytestmark = pytest.mark.timeout(60)


def _mapped_segments():
    """The hora segments this process has mapped (from /proc/self/maps), deleted or not."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f
                       if "/dev/shm/hora-" in line})


def _segment_files(pids=None):
    """hora segments in /dev/shm (made by ``pids`` only, when given: other tests, and other
    programs' files named hora-*, may be there)."""
    names = (n for n in os.listdir("/dev/shm") if n.startswith("hora-"))
    return sorted(n for n in names if pids is None or (
        n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids))


def _use_and_look(n_elems, fall_back=False):
    if fall_back:
        import hora.backends.segments as segments
        segments.SEGMENT_DIR = "/nonexistent-dir-for-hora-test"
    x = np.arange(n_elems, dtype=np.float64) * (hora.rank() + 1)
    y = hora.allreduce(x, op=hora.Sum, name="big")
    z = hora.broadcast(x, root_rank=hora.size() - 1, name="bcast")
    pids = hora.allgather_object(os.getpid())
    return y, z, _mapped_segments(), _segment_files(pids), pids


@pytest.mark.parametrize("n", [2, 3])
def test_large_collectives_go_through_an_unlinked_segment(n):
    elems = 300_000                                       # 2.4 MB: above ring.SMALL
    results = run_ranks(_use_and_look, n, timeout_s=30, args=(elems,))
    base = np.arange(elems, dtype=np.float64)
    for rank, (y, z, mapped, files, pids) in enumerate(results):
        np.testing.assert_array_equal(y, base * sum(range(1, n + 1)))
        np.testing.assert_array_equal(z, base * n)
        assert mapped and all(m.endswith("(deleted)") for m in mapped), \
            f"rank {rank}: expected a mapped, already unlinked segment, got {mapped}"
        assert not files, f"rank {rank}: segments still in /dev/shm: {files}"
    assert not _segment_files(results[0][4])


def test_tcp_backend_maps_no_segment():
    results = run_ranks(_use_and_look, 2, timeout_s=30, args=(300_000,),
                        env={"HORA_BACKEND": "tcp"})
    assert [r[2] for r in results] == [[], []]


def test_falls_back_to_tcp_when_shared_memory_is_unavailable():
    results = run_ranks(_use_and_look, 2, timeout_s=30, args=(300_000, True))
    base = np.arange(300_000, dtype=np.float64)
    for y, z, mapped, _, _ in results:
        np.testing.assert_array_equal(y, base * 3)
        np.testing.assert_array_equal(z, base * 2)
        # the board of small allreduces was made at init(), before the directory moved; the
        # data plane's segment, which the 2.4 MB allreduce needed, never came
        assert [m for m in mapped if not m.endswith("-board (deleted)")] == []


def test_unknown_backend_is_named(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import hora\nhora.init()\n")
    env = {**os.environ, "HORA_BACKEND": "carrier-pigeon"}
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable,
                           str(script)], capture_output=True, text=True, env=env, timeout=40)
    assert proc.returncode != 0
    assert "HORA_BACKEND='carrier-pigeon'" in proc.stderr and "auto, tcp, shm" in proc.stderr


def test_launcher_removes_segments_left_by_a_killed_rank(tmp_path):
    """A rank killed between creating a segment and unlinking it (simulated: the rank makes
    one with the backend's naming and dies) leaves nothing once `hora run` returns."""
    script = tmp_path / "job.py"
    # rank 1 dies once rank 0 has made its segment too (else the launcher may stop rank 0
    # before it starts)
    script.write_text(
        "import os, signal, time\n"
        "path = f'/dev/shm/hora-{os.getpid()}-1'\n"
        "open(path, 'wb').write(b'x' * 4096)\n"
        "print('made', path, flush=True)\n"
        f"flag = {str(tmp_path / 'rank0-made')!r}\n"
        "if os.environ['HORA_RANK'] == '0':\n"
        "    open(flag, 'w').close()\n"
        "else:\n"
        "    deadline = time.monotonic() + 20\n"
        "    while not os.path.exists(flag) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=40)
    made = [line.split()[-1] for line in proc.stdout.splitlines() if "made" in line]
    assert proc.returncode != 0 and len(made) == 2, proc.stdout + proc.stderr
    left = [p for p in made if os.path.exists(p)]
    assert not left, f"left behind: {left}\n{proc.stderr}"


# -- jobs of several parts ----------------------------------------------------------------------
# Starting the ranks costs more than what several tests do with them, so a job of 3 ranks on
# this host (``one_host``) and one of 4 ranks on two "hosts" (``two_hosts``, below) each run
# several tests' parts in turn, each part between its own hora.init() and shutdown() with its
# own HORA_* variables (init reads them anew, and makes a new plane); each test checks its
# own part.
def _in_turn(parts):
    """Run every ``(name, HORA_* variables, function)`` of ``parts`` in its own init; the
    variables a part sets are gone before the next."""
    import traceback
    out = {}
    set_here = set()
    for name, env, fn in parts:
        for key in set_here - set(env):
            del os.environ[key]
        os.environ.update(env)
        set_here = set(env)
        try:
            out[name] = ("ok", _in_job(fn))
        except Exception:  # noqa: BLE001 - reported by the test of that part
            out[name] = ("error", traceback.format_exc())
    for key in set_here:
        del os.environ[key]
    return out


def _parts_fixture(worker, np_, hosts=None):
    from hora.runner import run
    try:
        results = run(worker, np=np_, hosts=hosts, timeout_s=100)
    except Exception as e:  # noqa: BLE001 - reported by each test that needs it
        results = e

    def part(name):
        if isinstance(results, Exception):
            pytest.fail(f"the job of {worker.__name__} failed: {results!r}")
        return section(results, name)
    return part


_SLOT_ROWS = 5003
_READ_ROWS, _READ_SEED, _SAYS_NO_SEED = 450_003, 7, 11     # 9 MB a rank; blocks of 3 MB


def _one_host_worker():
    """3 ranks: the reduce-scatter over many slots, the peers' buffers read (HORA_SHM_CMA=1)
    and not (0), and one rank that will not read (HORA_SHM_CMA=0 on rank 1 alone)."""
    says_no = {"HORA_SHM_CMA": "0"} if int(os.environ["HORA_RANK"]) == 1 else {}
    return _in_turn([
        ("many.slots", {"HORA_SHM_SLOT_BYTES": "4096"}, lambda: _reducescatter_job(_SLOT_ROWS)),
        ("cma.1", {"HORA_SHM_CMA": "1"}, lambda: _read_job(_READ_ROWS, _READ_SEED)),
        ("cma.0", {"HORA_SHM_CMA": "0"}, lambda: _read_job(_READ_ROWS, _READ_SEED)),
        ("says.no", says_no, lambda: _read_job(_READ_ROWS, _SAYS_NO_SEED)),
    ])


@pytest.fixture(scope="module")
def one_host():
    return _parts_fixture(_one_host_worker, 3)


def _reducescatter_job(rows):
    from hora.core import state
    x = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (hora.rank() + 1) + hora.rank()
    return (type(state.engine()._plane).__name__,
            hora.reducescatter(x, op=hora.Sum, name="rs"),
            hora.reducescatter(-x, op=hora.Max, name="rs.max"))


def test_reducescatter_over_many_slots_matches_numpy(one_host):
    # slots of 4 KiB: a rank's block starts and ends inside chunks, and spans several (each
    # rank keeps its own part of a chunk out of its slot and reduces into it in place)
    rows, n = _SLOT_ROWS, 3
    results = one_host("many.slots")
    inputs = [np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (r + 1) + r
              for r in range(n)]
    assert {plane for plane, _, _ in results} == {"ShmGroup"}
    np.testing.assert_array_equal(np.concatenate([s for _, s, _ in results]), sum(inputs))
    np.testing.assert_array_equal(np.concatenate([m for _, _, m in results]),
                                  np.maximum.reduce([-x for x in inputs]))


# -- reading the peers' buffers (process_vm_readv) -------------------------------------------
def _read_job(rows, seed):
    """Large allreduces, reduce-scatters and allgathers (above 8 MiB; several 1 MiB parts of
    a reduce-scatter's reads, uneven blocks, an allgather's rows differing by rank), and
    whether the host's ranks read each other's buffers."""
    from hora.core import state
    rank, n = hora.rank(), hora.size()
    x = np.random.default_rng(seed + rank).standard_normal((rows, 5)).astype(np.float32)
    mine = np.full((rows // 2 + 1000 * rank, 3), rank, dtype=np.int64)     # rows of 24 B
    out = (hora.allreduce(x, op=hora.Sum, name="r.all"),
           hora.reducescatter(x, op=hora.Sum, name="r.sum"),
           hora.reducescatter(x, op=hora.Max, name="r.max"),
           hora.allgather(mine, name="r.gather"),
           hora.allgather(x, name="r.gather.x"))
    return (state.engine()._plane._cma,) + out


def _inputs(rows, seed, n):
    return [np.random.default_rng(seed + r).standard_normal((rows, 5)).astype(np.float32)
            for r in range(n)]


def _sum_in_rank_order(xs, n, rows):
    """The reduce-scatter's bits: each block (of ``rows`` split evenly) summed with its
    owner's input first, then the others in rank order."""
    from hora.backends.ring import even_counts, segment_bounds
    bounds = segment_bounds(even_counts(rows, n))
    out = []
    for r in range(n):
        lo, hi = bounds[r], bounds[r + 1]
        acc = xs[r][lo:hi].copy()
        for p in range(n):
            if p != r:
                acc += xs[p][lo:hi]
        out.append(acc)
    return out


@pytest.mark.parametrize("cma", ["1", "0"])
def test_large_collectives_read_the_peers_buffers_with_the_segments_bits(one_host, cma):
    rows, n, seed = _READ_ROWS, 3, _READ_SEED
    results = one_host(f"cma.{cma}")
    xs = _inputs(rows, seed, n)
    assert [r[0] for r in results] == [cma == "1"] * n
    want = _sum_in_rank_order(xs, n, rows)
    gathered = np.concatenate([np.full((rows // 2 + 1000 * r, 3), r, dtype=np.int64)
                               for r in range(n)])
    flat = [x.reshape(-1) for x in xs]
    whole = np.concatenate(_sum_in_rank_order(flat, n, flat[0].size)).reshape(rows, 5)
    for rank, (_, a, s, _, g, gx) in enumerate(results):
        # bit for bit: the same additions in the same order, through either path
        np.testing.assert_array_equal(s, want[rank], err_msg=f"rank {rank}")
        np.testing.assert_array_equal(g, gathered, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(gx, np.concatenate(xs), err_msg=f"rank {rank}")
        np.testing.assert_array_equal(a, results[0][1], err_msg=f"rank {rank}")
        if cma == "1":      # the allreduce's blocks: the whole buffer's (the segment's: chunks)
            np.testing.assert_array_equal(a, whole, err_msg=f"rank {rank}")
        else:
            np.testing.assert_allclose(a, sum(xs), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.concatenate([m for _, _, _, m, _, _ in results]),
                                  np.maximum.reduce(xs))


def test_one_rank_without_reads_turns_them_off_on_every_rank(one_host):
    # the owner's side of a read differs from the segment's: a rank that will not read
    # (HORA_SHM_CMA=0 there, or the kernel refusing it) makes every rank use the segment
    rows, n, seed = _READ_ROWS, 3, _SAYS_NO_SEED
    results = one_host("says.no")
    xs = _inputs(rows, seed, n)
    assert [r[0] for r in results] == [False] * n
    want = _sum_in_rank_order(xs, n, rows)
    for rank, (_, _, s, _, _, gx) in enumerate(results):
        np.testing.assert_array_equal(s, want[rank], err_msg=f"rank {rank}")
        np.testing.assert_array_equal(gx, np.concatenate(xs), err_msg=f"rank {rank}")


def _overwrite_at_once(m):
    """Every rank but the last overwrites its buffers as soon as each call returns, while
    the last reads slowly (each read of a peer's buffer waits 0.2 s first): the calls must
    not return before the others have read what they need."""
    import time
    from hora.backends import cma
    rank, n = hora.rank(), hora.size()
    if rank == n - 1:
        read = cma.read

        def slow(*args):
            time.sleep(0.2)
            return read(*args)
        cma.read = slow
    x = np.full(m, rank + 1.0, dtype=np.float32)
    hora.allreduce_(x, op=hora.Sum, name="o.ar")
    first = x.copy()
    if rank != n - 1:
        x[:] = -1e6
    g = hora.allgather(np.full(m // n, rank, dtype=np.float32), name="o.ag")
    got = g.copy()
    if rank != n - 1:
        g[:] = -1e6
    hora.barrier()
    return first, got


@pytest.mark.parametrize("hosts", [None, "localhost:2,127.0.0.1:2"])
def test_a_call_returns_only_after_the_others_read_its_buffer(hosts):
    from hora.runner import run
    m = (16 << 20) // 4        # 16 MiB: read from the peers (across hosts: 8 MiB pieces)
    n = 4 if hosts else 3
    env = {"HORA_HIERARCHICAL_PIECE_BYTES": str(2 << 20)} if hosts else {}
    results = run(_in_job, args=(_overwrite_at_once, m), np=n, hosts=hosts, env=env,
                  timeout_s=50)
    total = n * (n + 1) / 2
    gathered = np.repeat(np.arange(n, dtype=np.float32), m // n)
    for rank, (first, got) in enumerate(results):
        assert (first == total).all(), (rank, np.unique(first))
        if not hosts:       # (across hosts an allgather takes the TCP ring)
            np.testing.assert_array_equal(got, gathered, err_msg=f"rank {rank}")


def _owner_publishes_a_hole(m):
    """Rank 0 stays alive but publishes an address mapped nowhere for its reduce-scatter's
    buffer, as a rank that left the collective would have: rank 1's read fails (EFAULT)
    with no rank lost; each rank returns what it raised, and when."""
    import time
    from hora.backends import shm
    x = np.ones(m, dtype=np.float32)
    hora.allreduce(x, name="warm")              # (the first also probes the reads)
    if hora.rank() == 0:
        def hole(self, flat, word):
            self._words[word] = 8               # (rank 0's line starts at word 0)
            self.barrier()
            return [self._words[p * shm._LINE_WORDS + word] for p in range(self.size)]
        shm.ShmGroup._publish = hole
    start = time.monotonic()
    try:
        hora.allreduce(x, name="holed")
    except hora.HoraError as e:
        return type(e).__name__, isinstance(e, hora.HorovodInternalError), str(e), \
            getattr(e, "rank", None), time.monotonic() - start
    return None


def test_a_peer_that_left_the_collective_is_named_when_no_rank_is_lost():
    from hora.backends.shm import _LOST_S
    m = (16 << 20) // 4                         # 16 MiB: read from the peers
    results = run_ranks(_owner_publishes_a_hole, 2, timeout_s=40, args=(m,))
    kind, internal, text, rank, took = results[1]
    assert internal and "could not read rank 0's buffer" in text, results[1]
    assert f"rank 0 left the collective, and no rank was found lost within {_LOST_S:g} s" \
        in text, text
    assert _LOST_S <= took < _LOST_S + 5, took
    kind, internal, text, rank, took = results[0]   # rank 1's engine failed: it hung up
    assert internal and rank == 1, results[0]


# -- hierarchical: shared memory inside each host, TCP between hosts ----------------------------
# Two "hosts" on this machine: hora run places ranks on localhost and on 127.0.0.1, both local,
# and each rank's HORA_HOSTNAME says which; the topology (and so the algorithm) sees 2 hosts
# of 2 ranks, with real shared memory inside each and real TCP between them.  One job of 4
# ranks (``two_hosts``) runs every part in turn: the TCP part first, so that it checks a
# process that has never mapped a segment; the refused shm backend last, as its init fails.
def _hierarchical_job(sizes):
    from hora.core import state
    plane = type(state.engine()._plane).__name__
    out = []
    for m in sizes:
        x = (np.arange(m) % 11 + 3 * hora.rank()).astype(np.float32)
        out.append(hora.allreduce(x, op=hora.Sum, name=f"h.{m}"))
    avg = hora.allreduce(np.full(100_000, float(hora.rank())), name="h.avg")
    return plane, (hora.local_rank(), hora.local_size(), hora.cross_rank(), hora.cross_size()), \
        out, avg, _mapped_segments()


def _piece_job(m, calls):
    from hora.core import state
    plane = state.engine()._plane
    pieces, outs = [], []
    for i in range(calls):
        x = (np.arange(m) % 13 + i + 5 * hora.rank()).astype(np.float32)
        outs.append(hora.allreduce(x, op=hora.Sum, name=f"p.{i}"))
        pieces.append((plane.piece_bytes, not plane.measures(1 << 30)))
    return pieces, outs


_SLOT = {"HORA_SHM_SLOT_BYTES": str(1 << 20)}
_PIECE = (8 << 20) // 4 + 1             # float32 elements of the piece-size parts' calls


def _hierarchical_sizes():
    piece = PIECE_BYTES * 4 // 4        # float32 elements of a piece: PIECE_BYTES a rank
    # uneven blocks; several shm chunks; two pieces and a tail of one element, which leaves
    # the second rank of each host an empty block
    return [20_000, 2 * piece + 1, 1_000_003, 3 << 20]


def _trials():
    from hora.backends.hierarchical import PIECE_CANDIDATES, TRIAL_BYTES, TRIAL_ROUNDS
    m = TRIAL_BYTES // 4 + 3        # float32 elements: a trial (and a tail of 3)
    return m, TRIAL_ROUNDS * len(PIECE_CANDIDATES)


def _two_hosts_parts():
    """Every part of the two-hosts job, in order: (name, HORA_* variables, function)."""
    sizes, (m, trials) = _hierarchical_sizes(), _trials()
    rank = int(os.environ["HORA_RANK"])
    return [
        ("tcp", {"HORA_BACKEND": "tcp", **_SLOT}, lambda: _hierarchical_job(sizes)),
        ("auto", {"HORA_BACKEND": "auto", **_SLOT}, lambda: _hierarchical_job(sizes)),
        ("hierarchical", {"HORA_BACKEND": "hierarchical", **_SLOT},
         lambda: _hierarchical_job(sizes)),
        ("measured", {"HORA_BACKEND": "hierarchical"}, lambda: _piece_job(m, trials + 2)),
        ("piece.env", {"HORA_BACKEND": "hierarchical",
                       "HORA_HIERARCHICAL_PIECE_BYTES": str(96 << 10)},
         lambda: _piece_job(_PIECE, 2)),
        # a piece size that differs between the ranks (0 on rank 2: measure): rank 0's is used
        ("piece.rank", {"HORA_BACKEND": "hierarchical", "HORA_HIERARCHICAL_PIECE_BYTES":
                        str([64 << 10, 96 << 10, 0, 96 << 10][rank])},
         lambda: _piece_job(_PIECE, 2)),
    ]


def _two_hosts_worker():
    out = _in_turn(_two_hosts_parts())
    os.environ["HORA_BACKEND"] = "shm"
    out["shm"] = ("ok", init_error())
    return out


@pytest.fixture(scope="module")
def two_hosts():
    return _parts_fixture(_two_hosts_worker, 4, hosts="localhost:2,127.0.0.1:2")


@pytest.mark.parametrize("backend,plane", [("auto", "Hierarchical"),
                                           ("hierarchical", "Hierarchical"),
                                           ("tcp", "NoneType")])
def test_hierarchical_allreduce_on_two_hosts(two_hosts, backend, plane):
    sizes = _hierarchical_sizes()
    for rank, (got_plane, topo, outs, avg, mapped) in enumerate(two_hosts(backend)):
        assert got_plane == plane, (rank, got_plane)
        assert topo == (rank % 2, 2, rank // 2, 2), (rank, topo)
        for m, y in zip(sizes, outs):
            exp = (np.arange(m) % 11 * 4 + 3 * 6).astype(np.float32)
            np.testing.assert_array_equal(y, exp, err_msg=f"rank {rank} size {m}")
        np.testing.assert_allclose(avg, 1.5)
        assert bool(mapped) == (plane == "Hierarchical"), (rank, mapped)


def _check_sums(results, m):
    for rank, (_, outs) in enumerate(results):
        for i, y in enumerate(outs):
            exp = ((np.arange(m) % 13 + i) * 4 + 5 * 6).astype(np.float32)
            np.testing.assert_array_equal(y, exp, err_msg=f"rank {rank} call {i}")


def test_hierarchical_measures_its_piece_size_alike_on_every_rank(two_hosts):
    # the job's first 3 x 3 allreduces of at least TRIAL_BYTES try the candidates; after the
    # ninth, every rank keeps the same one (the times are summed over the ranks)
    from hora.backends.hierarchical import PIECE_CANDIDATES
    m, trials = _trials()
    results = two_hosts("measured")
    _check_sums(results, m)
    kept = {pieces[-1] for pieces, _ in results}
    assert len(kept) == 1, kept
    ((piece, done),) = kept
    assert done and piece in PIECE_CANDIDATES, kept
    for rank, (pieces, _) in enumerate(results):
        assert [d for _, d in pieces] == [False] * (trials - 1) + [True] * 3, (rank, pieces)
        assert {p for p, _ in pieces[trials - 1:]} == {piece}, (rank, pieces)


def test_hierarchical_piece_size_set_by_the_environment(two_hosts):
    results = two_hosts("piece.env")
    _check_sums(results, _PIECE)
    for rank, (pieces, _) in enumerate(results):
        assert pieces == [(96 << 10, True)] * 2, (rank, pieces)


def test_hierarchical_piece_size_that_differs_between_ranks_is_rank_0s(two_hosts):
    results = two_hosts("piece.rank")
    _check_sums(results, _PIECE)
    for rank, (pieces, _) in enumerate(results):
        assert pieces == [(64 << 10, True)] * 2, (rank, pieces)


def test_shm_backend_refused_across_hosts(two_hosts):
    for rank, message in enumerate(two_hosts("shm")):
        assert message is not None and "HORA_BACKEND=shm needs every rank on one host" in \
            message, (rank, message)


def _in_job(fn, *args):
    hora.init()
    try:
        return fn(*args)
    finally:
        hora.shutdown()
