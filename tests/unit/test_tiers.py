"""The suite's tiers (tests/tiers.py): each test's markers follow from where it lives."""
import ast
import pathlib

import pytest

from tests import tiers

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _marks(relpath, name="test_x", fixtures=(), explicit=()):
    return tiers.markers_for(relpath, name, tuple(fixtures), set(explicit))


def test_a_unit_test_without_frameworks_is_fast():
    assert _marks("tests/unit/test_ring.py") == {"fast"}


def test_a_multiprocess_test_is_slow():
    assert _marks("tests/multiproc/test_engine.py") == {"slow"}


@pytest.mark.parametrize("relpath", ["tests/multiproc/test_tf_ops.py",
                                     "tests/multiproc/test_ray.py",
                                     "tests/multiproc/test_spark.py",
                                     "tests/multiproc/test_mxnet_ops.py",
                                     "tests/unit/test_tf_keras_elastic_state.py"])
def test_a_file_that_imports_a_framework_is_framework_and_slow(relpath):
    assert _marks(relpath) == {"framework", "slow"}


def test_a_torch_only_file_is_not_framework():
    assert "framework" not in _marks("tests/multiproc/test_torch_ops.py")


def test_a_test_with_a_cluster_is_multihost():
    assert "multihost" in _marks("tests/unit/test_hosts.py", fixtures=("cluster",))
    assert "multihost" in _marks("tests/multiproc/test_host_vanishes.py")


def test_fault_files_and_names():
    assert "fault" in _marks("tests/multiproc/test_soak.py")
    assert "fault" in _marks("tests/unit/test_fuzz_rendezvous.py")
    dead = "test_survivors_of_a_dead_rank_fail_naming_it_within_seconds[2-1-kill]"
    assert "fault" in _marks("tests/multiproc/test_board.py", dead)
    # a unit test's name does not make it a fault test: it runs in-process
    assert "fault" not in _marks("tests/unit/test_supervisor.py", "test_killed_child")


def test_listed_tests_are_fast_and_keep_their_other_marks():
    node = ("tests/multiproc/test_tf_training.py::"
            "test_tape_on_shards_equals_one_process_on_the_whole_batch[eager]")
    relpath, name = node.split("::")
    assert _marks(relpath, name) == {"framework", "fast"}


def test_an_explicit_tier_wins():
    assert _marks("tests/unit/test_ring.py", explicit=("slow",)) == set()
    assert _marks("tests/multiproc/test_engine.py", explicit=("fast",)) == set()


def test_slow_unit_files_are_slow():
    for relpath in tiers.SLOW_UNIT:
        assert (_ROOT / relpath).is_file(), relpath
        assert "slow" in _marks(relpath)


@pytest.mark.parametrize("node", sorted(tiers.FAST))
def test_every_listed_fast_test_exists(node):
    relpath, name = node.split("::")
    function, _, params = name.partition("[")
    tree = ast.parse((_ROOT / relpath).read_text(encoding="utf-8"))
    tests = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert function in tests, f"{node}: no test {function} in {relpath}"
    assert tiers.FAST[node].strip(), f"{node}: say why it stands for its binding"
    if params:
        # a parametrized test's id names one of its parameter values: its own, or those of a
        # fixture with params that it takes
        calls = [d for d in tests[function].decorator_list
                 if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)]
        takes = {a.arg for a in tests[function].args.args}
        fixtures = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                    for d in n.decorator_list if isinstance(d, ast.Call)
                    and any(k.arg == "params" for k in d.keywords)}
        assert any(d.func.attr == "parametrize" for d in calls) or takes & fixtures, node


def test_every_registered_tier_marker_is_one_markers_for_gives():
    import tomllib
    registered = {line.split(":")[0] for line in tomllib.loads(
        (_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    # ``alone`` is no tier: a test carries it itself (tests/workers.py)
    assert registered == {"fast", "slow", "framework", "multihost", "fault", "alone"}
    assert set(tiers.RUN_ORDER) == registered - {"alone"}


def test_files_run_costliest_tier_first():
    assert tiers.order({"slow", "framework"}) < tiers.order({"slow", "fault"}) \
        < tiers.order({"slow"}) < tiers.order({"fast"}) < tiers.order({"slow", "alone"})
