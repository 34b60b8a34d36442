"""``hora run`` with real processes (as ``python -m hora run``): its output, the workers'
environment, the address layout of ranks, Horovod's variables and flags, and its usage.

How it stops (a failing rank, signals, a killed launcher) is in test_launcher_stops.py, the
Python API ``hora.runner.run`` in test_runner_run.py.
"""
import os
import platform
import resource
import subprocess
import sys

import numpy as np
import pytest

from tests.multiproc.hora_cli import hora_cli, hora_env, write_script

# -- hora run: output and environment --------------------------------------------------------
@pytest.mark.timeout(60)
def test_prefixed_output_and_env_contract(tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        keys = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                "HOSTNAME", "RENDEZVOUS_ADDR", "RENDEZVOUS_PORT", "JOB_ID"]
        print(" ".join(f"{k}={os.environ['HORA_' + k]}" for k in keys))
        print("secret", len(bytes.fromhex(os.environ["HORA_SECRET"])), "unbuffered",
              os.environ["PYTHONUNBUFFERED"])
        print("err", os.environ["HORA_RANK"], file=sys.stderr)
        sys.stdout.write("no newline")
        """)
    out = hora_cli("run", "-np", "3", "-H", "localhost:2,127.0.0.1:2", sys.executable, script)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    fields = {}
    for rank in range(3):
        mine = [line for line in lines if line.startswith(f"[{rank}]<stdout>:RANK=")]
        assert len(mine) == 1, out.stdout
        fields[rank] = dict(kv.split("=") for kv in mine[0].split(":", 1)[1].split())
        assert f"[{rank}]<stdout>:secret 32 unbuffered 1" in lines
        assert f"[{rank}]<stdout>:no newline" in lines
        assert f"[{rank}]<stderr>:err {rank}" in out.stderr.splitlines()
    expected = {0: ("localhost", 0, 2, 0, 2), 1: ("localhost", 1, 2, 0, 1),
                2: ("127.0.0.1", 0, 1, 1, 2)}
    for rank, (host, local_rank, local_size, cross_rank, cross_size) in expected.items():
        f = fields[rank]
        assert (f["HOSTNAME"], int(f["LOCAL_RANK"]), int(f["LOCAL_SIZE"]),
                int(f["CROSS_RANK"]), int(f["CROSS_SIZE"])) == (
            host, local_rank, local_size, cross_rank, cross_size)
        assert (f["RANK"], f["SIZE"], f["RENDEZVOUS_ADDR"]) == (str(rank), "3", "127.0.0.1")
    assert len({f["JOB_ID"] for f in fields.values()}) == 1
    assert len({f["RENDEZVOUS_PORT"] for f in fields.values()}) == 1


@pytest.mark.timeout(60)
def test_a_py_script_without_the_execute_bit_runs_with_the_launchers_python(tmp_path):
    """``hora run -np 2 train.py`` as torchrun runs it: with the launcher's Python, on every
    rank, from the job's directory (the file has no execute bit and no ``#!``)."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport hora\nhora.init()\n"
                      "print('ran', hora.rank(), hora.size(), sys.executable)\n")
    script.chmod(0o644)
    out = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", "train.py", "x"],
                         capture_output=True, text=True, timeout=40, env=hora_env(),
                         cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:ran {rank} 2 {sys.executable}" in out.stdout.splitlines(), \
            out.stdout


# a rank's personality flag ADDR_NO_RANDOMIZE, and where CPython's None object lies (in the
# interpreter's own data: the same address in every rank only when none is randomized)
_LAYOUT = """
    import os
    with open("/proc/self/personality") as f:
        fixed = int(f.read(), 16) & 0x0040000 != 0
    print("layout", os.environ["HORA_RANK"], int(fixed), hex(id(None)))
    """


def _layouts(tmp_path, np_, *flags, env=None, refused=False):
    """Each rank's (fixed layout, where None lies) under ``hora run -np np_ flags``, and the
    launcher's stderr; ``refused``: under a seccomp filter that refuses the personality as
    a container's default profile does (tests/refuse_personality.py)."""
    script = write_script(tmp_path, _LAYOUT)
    wrap = [sys.executable, os.path.join(os.path.dirname(__file__), os.pardir,
                                         "refuse_personality.py")] if refused else []
    out = subprocess.run([*wrap, sys.executable, "-m", "hora", "run", "-np", str(np_), *flags,
                          sys.executable, script], capture_output=True, text=True, timeout=40,
                         env={**hora_env(), **(env or {})}, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    got = {}
    for line in out.stdout.splitlines():
        _, _, text = line.partition(":")
        if text.startswith("layout "):
            _, rank, fixed, none_at = text.split()
            got[int(rank)] = (fixed == "1", none_at)
    assert sorted(got) == list(range(np_)), out.stdout
    return [got[r][0] for r in range(np_)], {at for _, at in got.values()}, out.stderr


def _refusal():
    from hora.runner.proc import fixed_layout_refused
    return fixed_layout_refused()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux personalities")
@pytest.mark.skipif(bool(_refusal()), reason=f"this machine refuses the fixed layout: "
                                              f"{_refusal()}")
def test_ranks_start_without_address_randomization_where_they_outnumber_the_cpus(tmp_path):
    from hora.core.topology import usable_cpus
    # off: every rank in one layout, the interpreter's objects at the same addresses
    fixed, addresses, err = _layouts(tmp_path, 2, "--rank-aslr", "off")
    assert fixed == [True, True] and len(addresses) == 1, addresses
    assert "HORA_RANK_ASLR" not in err, err
    # on (the environment's setting, and the flag's): every rank randomized
    fixed, addresses, _ = _layouts(tmp_path, 3, env={"HORA_RANK_ASLR": "off"},
                                   *("--rank-aslr", "on"))
    assert fixed == [False] * 3 and len(addresses) == 3, addresses
    fixed, _, _ = _layouts(tmp_path, 2, env={"HORA_RANK_ASLR": "ON"})
    assert fixed == [False, False]
    # auto (the default): fixed only where this machine runs more ranks than its CPUs
    cpus = usable_cpus()
    fixed, _, _ = _layouts(tmp_path, 2)
    assert fixed == [2 > cpus] * 2
    if cpus < 8:
        fixed, addresses, _ = _layouts(tmp_path, cpus + 1)
        assert fixed == [True] * (cpus + 1) and len(addresses) == 1, addresses


@pytest.mark.timeout(60)
@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="the seccomp filter of tests/refuse_personality.py is x86-64's")
def test_where_seccomp_refuses_the_fixed_layout_ranks_keep_randomized_and_off_says_why(
        tmp_path):
    # a container's default profile (Docker's) refuses personality(ADDR_NO_RANDOMIZE): the
    # job runs all the same, its ranks randomized; asked for it (off), the launcher says why
    fixed, addresses, err = _layouts(tmp_path, 2, "--rank-aslr", "off", refused=True)
    assert fixed == [False, False] and len(addresses) == 2, addresses
    assert "HORA_RANK_ASLR=off: the ranks on localhost keep randomized address layouts" in err
    assert "personality(ADDR_NO_RANDOMIZE) is refused here (Operation not permitted" in err
    # auto, crowded: randomized too, and nothing said (the fixed layout is only a speed-up)
    from hora.core.topology import usable_cpus
    n = usable_cpus() + 1
    fixed, addresses, err = _layouts(tmp_path, n, refused=True)
    assert fixed == [False] * n and len(addresses) == n, addresses
    assert "HORA_RANK_ASLR" not in err, err


def test_a_bad_rank_aslr_setting_is_refused_before_any_rank_starts(tmp_path):
    out = hora_cli("run", "-np", "2", "--rank-aslr", "sometimes", sys.executable, "-c", "")
    assert out.returncode == 2 and "--rank-aslr" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable,
                          "-c", "print('ran')"], capture_output=True, text=True, timeout=40,
                         env={**hora_env(), "HORA_RANK_ASLR": "sometimes"},
                         stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and "ran" not in out.stdout, out.stdout
    assert "HORA_RANK_ASLR='sometimes'" in out.stderr, out.stderr


_PLACEMENT = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"]


@pytest.mark.timeout(60)
def test_workers_get_horovodruns_variables_too(tmp_path):
    # two host names for this machine: a two-host layout, so cross rank and size vary
    script = write_script(tmp_path, f"""
        import os
        for prefix in ("HOROVOD_", "HORA_"):
            print(prefix, *(os.environ[prefix + k] for k in {_PLACEMENT!r}))
        """)
    out = hora_cli("run", "-np", "3", "-H", "localhost:2,127.0.0.1:1", sys.executable, script)
    assert out.returncode == 0, out.stderr
    expected = {0: "0 3 0 2 0 2 localhost", 1: "1 3 1 2 0 1 localhost",
                2: "2 3 0 1 1 2 127.0.0.1"}
    for rank, values in expected.items():
        assert f"[{rank}]<stdout>:HOROVOD_ {values}" in out.stdout.splitlines(), out.stdout
        assert f"[{rank}]<stdout>:HORA_ {values}" in out.stdout.splitlines(), out.stdout


def _horovod_worker(out_dir):
    import numpy as np

    import hora
    hora.init()
    try:
        total = hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum, name="x")
        place = [hora.rank(), hora.size(), hora.local_rank(), hora.local_size(),
                 hora.cross_rank(), hora.cross_size()]
    finally:
        hora.shutdown()
    with open(os.path.join(out_dir, f"{place[0]}.txt"), "w") as f:
        f.write(" ".join(map(str, [*place, total[0]])))


@pytest.mark.timeout(60)
def test_init_reads_horovodruns_variables_alone(tmp_path):
    """Workers started with only HOROVOD_* variables (horovodrun's names, its Gloo rendezvous
    included) find their places and reduce."""
    import cloudpickle
    from hora.rendezvous import RendezvousServer, new_secret
    secret = new_secret()
    server = RendezvousServer(secret).start()
    blob = tmp_path / "fn.pkl"
    blob.write_bytes(cloudpickle.dumps(_horovod_worker))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    boot = "import sys, cloudpickle; cloudpickle.loads(open(sys.argv[1], 'rb').read())(sys.argv[2])"
    procs = []
    try:
        for rank in range(4):                  # two "hosts" of two ranks each
            env = dict(base, HOROVOD_RANK=str(rank), HOROVOD_SIZE="4",
                       HOROVOD_LOCAL_RANK=str(rank % 2), HOROVOD_LOCAL_SIZE="2",
                       HOROVOD_CROSS_RANK=str(rank // 2), HOROVOD_CROSS_SIZE="2",
                       HOROVOD_HOSTNAME=f"node-{rank // 2}",
                       HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                       HOROVOD_GLOO_RENDEZVOUS_PORT=str(server.port), HOROVOD_SECRET=secret)
            procs.append(subprocess.Popen([sys.executable, "-c", boot, str(blob), str(tmp_path)],
                                          env=env, stdin=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        errors = [p.communicate(timeout=45)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        server.stop()
    assert [p.returncode for p in procs] == [0] * 4, errors
    for rank in range(4):
        got = (tmp_path / f"{rank}.txt").read_text().split()
        assert got == [str(v) for v in (rank, 4, rank % 2, 2, rank // 2, 2)] + ["10.0"], got


_SHOW_ENV = """
    import os
    names = ["HORA_TIMELINE", "HORA_LOG_LEVEL", "HORA_AUTOTUNE", "HORA_AUTOTUNE_LOG",
             "HORA_AUTOTUNE_WARMUP_SAMPLES", "HORA_AUTOTUNE_STEPS_PER_SAMPLE",
             "HORA_FUSION_THRESHOLD", "HORA_CYCLE_TIME", "HORA_CACHE_CAPACITY",
             "HORA_STALL_CHECK_DISABLE", "HORA_STALL_CHECK_TIME_SECONDS",
             "HORA_STALL_SHUTDOWN_TIME_SECONDS", "HORA_START_TIMEOUT", "HORA_IFACE"]
    print("env", " ".join(f"{n}={os.environ.get(n)}" for n in names))
    """

_FLAG_ENV = {"HORA_TIMELINE": "{timeline}", "HORA_LOG_LEVEL": "DEBUG", "HORA_AUTOTUNE": "1",
             "HORA_AUTOTUNE_LOG": "{tune}", "HORA_AUTOTUNE_WARMUP_SAMPLES": "2",
             "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "5", "HORA_FUSION_THRESHOLD": str(4 << 20),
             "HORA_CYCLE_TIME": "2.5", "HORA_CACHE_CAPACITY": "7",
             "HORA_STALL_CHECK_DISABLE": "1", "HORA_STALL_CHECK_TIME_SECONDS": "9.0",
             "HORA_STALL_SHUTDOWN_TIME_SECONDS": "30.0", "HORA_START_TIMEOUT": "20.0",
             "HORA_IFACE": "lo"}


def _horovodrun_flags(tmp_path):
    timeline, tune = tmp_path / "timeline.json", tmp_path / "tune.csv"
    flags = ["--timeline-filename", str(timeline), "--log-level", "debug", "--autotune",
             "--autotune-log-file", str(tune), "--autotune-warmup-samples", "2",
             "--autotune-steps-per-sample", "5", "--fusion-threshold-mb", "4",
             "--cycle-time-ms", "2.5", "--cache-capacity", "7", "--no-stall-check",
             "--stall-check-warning-time-seconds", "9",
             "--stall-check-shutdown-time-seconds", "30", "--start-timeout", "20",
             "--disable-cache", "-p", "2222", "-i", str(tmp_path / "key"),
             "--network-interfaces", "lo,eth9"]
    want = " ".join(f"{k}={v.format(timeline=timeline, tune=tune)}"
                    for k, v in _FLAG_ENV.items())
    return flags, f"env {want}", timeline


@pytest.mark.timeout(60)
def test_horovodrun_flags_reach_the_workers(tmp_path):
    flags, want, timeline = _horovodrun_flags(tmp_path)
    script = write_script(tmp_path, _SHOW_ENV)
    out = hora_cli("run", "--np", "2", "--gloo", "--verbose", *flags, sys.executable, script)
    assert out.returncode == 0, out.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:{want}" in out.stdout.splitlines(), out.stdout
    # the flag is a setting like the others: nothing is said (this script never calls
    # init(), so no timeline is written; tests/multiproc/test_timeline.py writes them)
    assert [ln for ln in out.stderr.splitlines() if "timeline" in ln] == [], out.stderr
    assert not timeline.exists()
    assert "[hora] WARNING: hora's data plane binds one network interface: using lo, not " \
           "eth9" in out.stderr
    assert "[hora] DEBUG: started rank 1" in out.stderr         # --verbose


@pytest.mark.timeout(60)
def test_horovodrun_flags_reach_workers_under_mpirun(tmp_path):
    from hora.rendezvous.netif import local_addresses
    from tests.helpers import mpirun_env, mpirun_unusable
    if mpirun_unusable():
        pytest.skip(mpirun_unusable())
    flags, want, timeline = _horovodrun_flags(tmp_path)
    # Open MPI needs an interface that exists (it crashes on an unknown one) and is not
    # loopback; one, since others here may be bridges that come and go with other tests
    nics = [name for name, addr in local_addresses() if not addr.startswith("127.")][:1]
    at = flags.index("--network-interfaces")
    flags[at + 1:at + 2] = [",".join(nics)] if nics else []
    if not nics:
        del flags[at]
    want = want.replace("HORA_IFACE=lo", f"HORA_IFACE={nics[0] if nics else None}")
    script = write_script(tmp_path, _SHOW_ENV)
    out = subprocess.run([sys.executable, "-m", "hora", "run", "--mpi", "-np", "2", *flags,
                          "--mpi-args=--oversubscribe", sys.executable, script],
                         capture_output=True, text=True, timeout=50, env=mpirun_env(),
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(want) == 2, out.stdout
    # the timeline flag is a setting like the others: nothing is said of it
    assert "timeline" not in out.stderr.replace("HORA_TIMELINE", ""), out.stderr
    if nics:                    # Open MPI's own traffic may use every interface named
        assert f"btl_tcp_if_include {','.join(nics)}" in out.stderr


@pytest.mark.timeout(60)
def test_no_output_prefix_and_output_filename(tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        print("hello from", os.environ["HORA_RANK"])
        print("oops", os.environ["HORA_RANK"], file=sys.stderr)
        """)
    logs = tmp_path / "logs"
    out = hora_cli("run", "-np", "2", "--no-output-prefix", "--output-filename", str(logs),
                sys.executable, script)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["hello from 0", "hello from 1"]
    for rank in range(2):
        assert (logs / f"rank.{rank}" / "stdout").read_text() == f"hello from {rank}\n"
        assert (logs / f"rank.{rank}" / "stderr").read_text() == f"oops {rank}\n"


# -- hora run: usage -------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_usage_errors(tmp_path):
    assert "run" in hora_cli().stdout                              # no arguments: help
    assert "usage: hora" in hora_cli("--help").stdout
    out = hora_cli("run", "-np", "2", "-H", "localhost:2", "--hostfile", str(tmp_path / "h"),
                "true")
    assert out.returncode == 2 and "not allowed with" in out.stderr, out.stderr
    out = hora_cli("run", "-np", "5", "-H", "localhost:2", "true")
    assert out.returncode == 2 and "-np 5 exceeds the 2 slots" in out.stderr, out.stderr


# -- hora run: the limit of open files ------------------------------------------------------
def _limited(soft, hard):
    """A preexec_fn: the child's limit of open files is ``soft`` of ``hard``."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
def test_a_job_larger_than_the_soft_limit_of_open_files_allows_runs(tmp_path):
    """At a soft limit of 32 open files the launcher cannot hold 8 ranks' pipes, pidfds and
    rendezvous connections: it raises its limit (the hard one allows it), and each rank's
    init() raises its own (lowered here to 20) to what connecting to every other rank
    takes."""
    script = write_script(tmp_path, """
        import resource
        import numpy as np
        import hora
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        hora.init()
        out = hora.allreduce(np.full(3, hora.rank() + 1.0), op=hora.Sum, name="x")
        print("sum", out.tolist(), "files", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        hora.shutdown()
        """)
    out = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "8", sys.executable,
                          script], capture_output=True, text=True, timeout=50, env=hora_env(),
                         stdin=subprocess.DEVNULL, preexec_fn=_limited(32, 4096))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split(":", 1)[1].split() for line in out.stdout.splitlines()
             if "<stdout>:sum" in line]
    assert len(lines) == 8, out.stdout
    expected = float(np.arange(1, 9).sum())
    for words in lines:
        assert words[1:4] == [f"[{expected},", f"{expected},", f"{expected}]"], words
        assert 3 * 8 + 20 <= int(words[5]) <= 4096, words


@pytest.mark.timeout(60)
def test_a_hard_limit_of_open_files_too_low_for_the_job_is_refused_before_any_rank_starts():
    out = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "8", sys.executable,
                          "-c", "print('ran')"], capture_output=True, text=True, timeout=40,
                         env=hora_env(), stdin=subprocess.DEVNULL, preexec_fn=_limited(32, 32))
    assert out.returncode == 2 and "ran" not in out.stdout, out.stdout + out.stderr
    assert "8 ranks need about" in out.stderr and "ulimit -n" in out.stderr, out.stderr
    assert "may open 32" in out.stderr, out.stderr
    # the Python API raises it, an OSError (EMFILE) as well as a HoraError
    code = ("import errno, resource, hora\n"
            "from hora.errors import OpenFilesLimitError\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
            "try:\n"
            "    hora.run(print, np=8)\n"
            "except OpenFilesLimitError as e:\n"
            "    print('refused', isinstance(e, OSError), e.errno == errno.EMFILE, e.limit)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=40, env=hora_env(), stdin=subprocess.DEVNULL)
    assert out.stdout.split() == ["refused", "True", "True", "32"], out.stdout + out.stderr
