"""hora's type hints reach users' type checkers: PEP 561's marker ships, the lazily loaded
API is visible to static analysis, and mypy reads the public signatures."""
import ast
from pathlib import Path

import pytest

import hora
import hora.core
from tests.helpers import run_mypy

ROOT = Path(__file__).resolve().parents[2]


def test_the_py_typed_marker_ships_with_the_package():
    tomllib = pytest.importorskip("tomllib")        # Python 3.11+
    assert (ROOT / "hora" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["hora"]


def _type_checking_names():
    """Every name the ``if TYPE_CHECKING:`` block of hora/__init__.py imports."""
    tree = ast.parse((ROOT / "hora" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return {alias.asname or alias.name for imp in node.body for alias in imp.names}
    raise AssertionError("hora/__init__.py has no TYPE_CHECKING block")


def test_type_checkers_see_every_name_that_hora_loads_lazily():
    # at run time hora's core names load on first use (PEP 562), which type checkers cannot
    # follow; the TYPE_CHECKING imports must list exactly what that lazy loading serves
    assert _type_checking_names() == set(hora.core.__all__)


_USER_SCRIPT = """
    import numpy as np
    import hora
    import hora.data

    hora.init()
    total: np.ndarray = hora.allreduce(np.ones(3), op=hora.Sum, name="x")
    reveal_type(hora.alltoall(np.ones(4)))
    reveal_type(hora.rank())
    reveal_type(hora.data.shard(["a", "b"]))
    reveal_type(hora.broadcast_object({"k": 1}))
    hora.allreduce(np.ones(3), name=3)
"""


@pytest.mark.timeout(180)
def test_mypy_reads_the_public_signatures(tmp_path, mypy_cache):
    revealed, out = run_mypy(_USER_SCRIPT, tmp_path, mypy_cache)
    assert revealed[0].startswith('"tuple[numpy.ndarray'), out
    assert revealed[1:] == ['"int"', '"hora.data.Shard[str]"', '"dict[str, int]"'], out
    assert 'Argument "name" to "allreduce" has incompatible type "int"' in out, out
    assert "Found 1 error" in out, out
