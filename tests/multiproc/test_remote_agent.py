"""The remote agent outlives a killed launcher long enough to stop the rank's whole group.

``--ssh-command 'sh -c {command}'`` with the host ``192.0.2.1`` (TEST-NET-1, an address no
machine has; ``sh`` takes it as ``$0`` and never contacts it) runs the agent on this machine
as the launcher's own child, as ``ip netns exec``, ``sudo`` or ``chroot`` templates do.  Such
a child inherits the launcher's parent-death SIGKILL; unless the agent clears it, a launcher
killed with SIGKILL takes the agent with it, and the rank's own children are orphaned.  No
root, namespaces or sshd needed (tests/multiproc/test_multihost.py has the same check across
namespaces, with and without sshd).
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests.helpers import alive_count, alive_with, survivors

HOST = "192.0.2.1"
LOGIN = "sh -c {command}"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal and /proc are Linux's")




@pytest.mark.timeout(40)
def test_killed_launcher_leaves_no_rank_child_behind(tmp_path):
    marker = f"hora-test-{uuid.uuid4().hex}"
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        # a child of the rank (a data loader, say): it shares the rank's process group
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
        open(os.path.join({str(tmp_path)!r}, "ready"), "w").close()
        time.sleep(60)
        """))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hora", "run", "-np", "1", "-H", f"{HOST}:1",
         "--ssh-command", LOGIN, sys.executable, str(script), marker],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready").exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the rank never became ready"
            time.sleep(0.05)
        assert len(alive_count(marker, 3)) == 3        # the launcher, the rank, the rank's child
        launcher.kill()                            # no chance to clean up
        launcher.communicate()
        # the agent's grace is 3 s
        assert survivors(marker, 8) == [], "the rank's child outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        for pid in alive_with(marker):
            os.kill(pid, signal.SIGKILL)
