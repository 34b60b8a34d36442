"""What the multi-host tests need from the machine, set up by the suite itself.

The tests that take a ``cluster`` fixture (tests/netns.py: network namespaces, one sshd in
each) need root, iproute2 and an OpenSSH server.  Once collection has picked the tests to run,
and only if one of them uses a cluster, :func:`tests.netns.provision` installs what is missing
(as root, with apt-get, bounded in time), before any test's own timeout starts counting.
Without an sshd the clusters run in their no-sshd form; the session summary says which form
ran, and why.  ``HORA_TEST_NO_SSHD=1`` forces the no-sshd form.  Under pytest-xdist every
worker collects the whole suite: the first to get there installs, the others reuse what it did
(tests/workers.py), and tests/conftest.py prints the summary a worker left (the controller
never loads this file: it collects nothing).
"""
from tests import netns, workers

_ran_clusters = False


def _uses_cluster(item):
    return "cluster" in getattr(item, "fixturenames", ())


def pytest_collection_finish(session):
    global _ran_clusters
    if session.config.option.collectonly or not any(map(_uses_cluster, session.items)):
        return
    _ran_clusters = True
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else print
    netns.provisioned_as(workers.once("provision", lambda: netns.provision(say=say)))


def pytest_sessionfinish(session):
    if _ran_clusters:
        workers.note("multihost", _form())


def _form():
    unavailable, no_sshd = netns.unavailable_reason(), netns.no_sshd_reason()
    if unavailable:
        form = f"skipped: {unavailable}"
    elif no_sshd:
        form = f"ran without sshd (--ssh-command {netns.NETNS_LOGIN!r}): {no_sshd}"
    else:
        form = "ran with a real sshd per host"
        if netns.provisioned():
            form += f" ({netns.provisioned()})"
    return form
