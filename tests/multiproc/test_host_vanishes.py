"""A host that vanishes (no FIN, no RST: its link goes dark) is named by every survivor in
seconds, through the kernel's keepalive and unacknowledged-data limits on hora's sockets.

Three hosts on this machine (tests/netns.py): the launcher's namespace runs rank 0, two
network namespaces with a real sshd run ranks 1 and 2.  Once every rank has done one
collective, the test takes host 2's link down on the bridge: its packets are dropped, nothing
tells the others.  Ranks 0 and 1 sit idle for a second (in no collective with rank 2), then
call an allreduce, which must fail naming rank 2 within 10 s of the link going down, on both
within a moment of each other.
"""
import subprocess
import sys
import textwrap
import time

import pytest

from tests import netns

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import hora
    out = sys.argv[1]
    hora.init()
    r = hora.rank()
    hora.allreduce(np.ones(4), name="warm")
    open(os.path.join(out, f"ready.{r}"), "w").close()
    if r == 2:
        time.sleep(60)                  # cut off from here on; the launcher stops it
        sys.exit(0)
    while not os.path.exists(os.path.join(out, "vanished")):
        time.sleep(0.05)
    time.sleep(1.0)                     # idle: no collective with rank 2 in flight
    try:
        hora.allreduce(np.ones(4), name="after")
        print("NOT DETECTED", r, flush=True)
    except hora.HorovodInternalError as e:
        gone = float(open(os.path.join(out, "vanished")).read())
        print("DETECTED", r, type(e).__name__, getattr(e, "rank", None),
              f"{time.time() - gone:.2f}", flush=True)
        # the launcher stops every rank once one fails: the first survivor to exit would cut
        # the other off before it could say what it saw, so each waits (bounded) for the other
        open(os.path.join(out, f"detected.{r}"), "w").close()
        other = os.path.join(out, f"detected.{1 - r}")
        deadline = time.monotonic() + 15
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise SystemExit(3)
""")


@pytest.fixture
def cluster():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.Cluster(["ok", "ok"]) as c:
        yield c


@pytest.mark.timeout(90)
def test_survivors_name_a_vanished_host_within_seconds(cluster, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    hosts = f"{cluster.launcher_address}:1,{cluster.host(0)}:1,{cluster.host(1)}:1"
    argv = [sys.executable, "-m", "hora", "run", "-np", "3", "-H", hosts, *cluster.ssh_args(),
            "--timeout", "60", sys.executable, str(script), str(tmp_path)]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=tmp_path, stdin=subprocess.DEVNULL)
    link = f"{cluster.bridge}v1"                  # host 1 (rank 2) on the bridge
    try:
        deadline = time.monotonic() + 40
        while not all((tmp_path / f"ready.{r}").exists() for r in range(3)):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        subprocess.run(["ip", "link", "set", link, "down"], check=True, timeout=20)
        (tmp_path / "vanished").write_text(repr(time.time()))
        out, err = job.communicate(timeout=45)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        subprocess.run(["ip", "link", "set", link, "up"], timeout=20)
    detected = [line.split("DETECTED", 1)[1].split() for line in out.splitlines()
                if "DETECTED" in line and "NOT" not in line]
    print("detected (rank, error, named, seconds):", detected)
    assert sorted(int(d[0]) for d in detected) == [0, 1], out + err
    for rank, kind, named, seconds in detected:
        assert kind == "HoraRankFailedError" and named == "2", (rank, kind, named, out, err)
        assert float(seconds) < 10.0, f"rank {rank} took {seconds} s\n{out}\n{err}"
    # the first survivor to see the death tells the other (rank 0 relays): no survivor lags
    spread = abs(float(detected[0][3]) - float(detected[1][3]))
    assert spread < 0.75, f"the survivors named it {spread:.2f} s apart\n{out}\n{err}"
    assert job.returncode != 0
