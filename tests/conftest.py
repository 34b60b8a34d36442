"""The whole suite: hora's and the tests' own modules compiled once, before any test.

Most tests start real ranks, each a fresh interpreter that imports hora (and often the tests'
helpers) again.  Where ``PYTHONDONTWRITEBYTECODE`` is set (as on this project's machines) no
interpreter writes a ``.pyc``, so each of them compiled hora's sources anew: a
fifth of a second a rank for ``hora.init()``'s imports alone, more for the framework bindings,
over thousands of ranks.  The packages pip installed have theirs already; an editable install
of hora does not.  Written here once (``compileall``, next to the sources, in the
``__pycache__`` folders that git ignores), they are read by every later import, and a source
changed afterwards is compiled again as usual (a ``.pyc`` names its source's time and size).

Every collected test also gets its tier's markers (``fast`` or ``slow``, and ``framework``,
``multihost``, ``fault`` where they apply) from where it lives: tests/tiers.py decides.  The
files then run in the tiers' order, the costliest first (tests/tiers.py, ``RUN_ORDER``): with
pytest-xdist's workers each taking the next file, the last minutes are spent on the short unit
tests rather than on one worker's long framework file while the others wait.  A test marked
``alone`` runs while no other test does (tests/workers.py).
"""
import compileall
import os
import pathlib
import sys

import pytest

from tests import tiers, workers

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_configure(config):
    if not os.environ.get(workers.WORKER_ENV):
        workers.start_session()
    if not sys.dont_write_bytecode:
        return                  # every interpreter writes its own as it imports
    for package in ("hora", "tests"):
        # a tree that cannot be written to keeps compiling as before: nothing to report
        compileall.compile_dir(str(_ROOT / package), quiet=2)


def pytest_collection_modifyitems(config, items):
    """Every test gets its tier's markers (tests/tiers.py) from where it lives."""
    for item in items:
        relpath = pathlib.Path(os.path.relpath(item.path, _ROOT)).as_posix()
        explicit = {mark.name for mark in item.iter_markers()}
        for name in sorted(tiers.markers_for(relpath, item.name,
                                             tuple(getattr(item, "fixturenames", ())), explicit)):
            item.add_marker(name)
    rank = {}
    for item in items:      # a file keeps its tests together, in their order: its module
        here = tiers.order({mark.name for mark in item.iter_markers()})     # jobs run once
        rank[item.path] = min(rank.get(item.path, here), here)
    items.sort(key=lambda item: rank[item.path])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with workers.alone(exclusive=item.get_closest_marker("alone") is not None):
        yield


def pytest_terminal_summary(terminalreporter):
    """The line the multi-host tests left (tests/multiproc/conftest.py): how their hosts ran."""
    form = workers.notes("multihost")
    if form:
        terminalreporter.write_line(f"multi-host tests {form}")


@pytest.fixture(scope="session")
def mypy_cache(tmp_path_factory):
    """One mypy cache for the session's mypy runs (tests.helpers.run_mypy)."""
    return tmp_path_factory.mktemp("mypy-cache")
