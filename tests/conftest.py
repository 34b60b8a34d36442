"""The whole suite: hora's and the tests' own modules compiled once, before any test.

Most tests start real ranks, each a fresh interpreter that imports hora (and often the tests'
helpers) again.  Where ``PYTHONDONTWRITEBYTECODE`` is set (as on this project's machines) no
interpreter writes a ``.pyc``, so each of them compiled hora's sources anew: a
fifth of a second a rank for ``hora.init()``'s imports alone, more for the framework bindings,
over thousands of ranks.  The packages pip installed have theirs already; an editable install
of hora does not.  Written here once (``compileall``, next to the sources, in the
``__pycache__`` folders that git ignores), they are read by every later import, and a source
changed afterwards is compiled again as usual (a ``.pyc`` names its source's time and size).
"""
import compileall
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_configure(config):
    if not sys.dont_write_bytecode:
        return                  # every interpreter writes its own as it imports
    for package in ("hora", "tests"):
        # a tree that cannot be written to keeps compiling as before: nothing to report
        compileall.compile_dir(str(_ROOT / package), quiet=2)
