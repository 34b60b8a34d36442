"""The suite's tiers: which markers a collected test gets, decided from where it lives.

No test file names its tier.  :func:`markers_for` reads the test's directory, its file's name,
the modules the file imports (anywhere in it, ``pytest.importorskip`` included) and the
fixtures the test uses:

- ``framework``: the file needs TensorFlow, Keras, JAX, MXNet, Ray or Spark;
- ``multihost``: the test takes a ``cluster`` (network namespaces, an sshd in each) or the
  file drives them itself (``tests.netns``);
- ``fault``: the test kills ranks, injects faults, soaks or fuzzes;
- ``slow``: everything that starts processes (``tests/multiproc``), carries one of the three
  marks above, or is a unit test listed in :data:`SLOW_UNIT`;
- ``fast``: every other test, and the few in :data:`FAST` that stand for each binding.

``fast`` and ``slow`` split the suite in two (``-m fast`` is ``-m "not slow"``).  A test that
carries ``fast`` or ``slow`` explicitly keeps it.
"""
import ast
import functools
import pathlib
import re

# a module, or a package and everything under it, that the framework tier needs
FRAMEWORK_MODULES = (
    "tensorflow", "keras", "tf_keras", "jax", "optax", "mxnet", "ray", "pyspark",
    "hora.tensorflow", "hora.keras", "hora.jax", "hora.mxnet", "hora.ray", "hora.spark",
    "hora.integrations.spark", "hora.integrations.ray", "hora.integrations.ray_elastic",
    "hora.integrations.ray_tune", "tests.mxnet_env", "tests.elastic_keras_main",
)
MULTIHOST_MODULES = ("tests.netns",)
FAULT_MODULES = ("tests.faults", "tests.fuzzing")
# files whose every test kills a rank, injects faults, soaks or fuzzes
FAULT_FILES = {"test_failures.py", "test_fault_injection.py", "test_fuzz_control.py",
               "test_soak.py", "test_host_vanishes.py", "test_fuzz_rendezvous.py"}
# a multi-process test elsewhere whose name says it kills a rank or loses one
FAULT_NAME = re.compile(r"kill|dies|dead|vanish|survivor|crash")

# unit tests that run tools or whole programs rather than one module in-process
SLOW_UNIT = {
    "tests/unit/test_typing.py": "runs mypy over hora (4.5 s; under 1 s after the torch run)",
    "tests/unit/test_torch_typing.py": "runs mypy over the torch binding (about 40 s)",
    "tests/unit/test_readme.py": "runs the README's examples as programs",
    "tests/unit/test_docs_blocks.py": "runs the documentation's blocks as programs (about 25 s, "
                                      "14 of them TensorFlow's digits example)",
    "tests/unit/test_k8s.py": "runs hora k8s and mpirun as programs, validates manifests (32 s)",
    "tests/unit/test_k8s_elastic.py": "runs hora k8s as a program, validates manifests (36 s)",
    "tests/unit/test_k8s_katib.py": "validates Katib and MPIJob manifests against their schemas (10 s)",
}

# Tests from the slow tiers that the fast one keeps, so that it still touches every binding,
# the launcher, the board and the engine's multi-process collectives once.  Each node id runs
# one job whose sections the other tests of its parametrization only read again.
FAST = {
    "tests/multiproc/test_collectives.py::test_job_runs_and_reports_topology[3]":
        "every collective through the engine on 3 real ranks (one job, every section)",
    "tests/multiproc/test_board.py::test_board_results_equal_the_engine_bit_for_bit_and_numpy"
    "[2]":
        "the shared-memory board against the engine and numpy, bit for bit",
    "tests/multiproc/test_launcher.py::test_prefixed_output_and_env_contract":
        "hora run as a user starts it: the CLI, the workers' environment, prefixed output",
    "tests/multiproc/test_torch_ops.py::test_job_runs_every_section_without_warnings[2]":
        "hora.torch's collectives, gradients and process sets on 2 ranks",
    "tests/multiproc/test_tf_training.py::test_tape_on_shards_equals_one_process_on_the_whole_batch"
    "[eager]":
        "hora.tensorflow on 2 ranks: DistributedGradientTape's training equals one process's",
    "tests/multiproc/test_keras.py::test_fit_on_shards_equals_one_process_on_the_whole_batch"
    "[torch]":
        "hora.keras (Keras 3) training on 2 ranks, on the backend that loads fastest",
    "tests/multiproc/test_jax_ops.py::test_job_runs_every_section_without_warnings[3]":
        "hora.jax's collectives, eager and jit, on 3 ranks (its only job)",
    "tests/multiproc/test_mxnet_ops.py::test_allreduce_every_dtype_op_and_scale[3]":
        "hora.mxnet on 3 ranks where its venv exists (it skips with the reason otherwise)",
}

TIERS = ("fast", "slow")

# the order files run in, costliest first: a file runs where its costliest test's marker is;
# a file of ``alone`` tests after all (the other worker, which must stop for it, is then near
# its own end)
RUN_ORDER = ("framework", "multihost", "fault", "slow", "fast")


def order(marks):
    """Where a test with the markers ``marks`` runs: its place in RUN_ORDER, after every place
    for an ``alone`` test (a file runs at the least place of its tests)."""
    if "alone" in marks:
        return len(RUN_ORDER) + 1
    return min((RUN_ORDER.index(m) for m in marks if m in RUN_ORDER), default=len(RUN_ORDER))


def _matches(module, prefixes):
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@functools.lru_cache(maxsize=None)
def imported_modules(path):
    """Every module a Python file imports anywhere in it, with ``importorskip``'s too."""
    try:
        tree = ast.parse(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return frozenset(found)


def markers_for(relpath, name, fixturenames, explicit):
    """The tier markers of one test.

    Args:
        relpath: the test file's path from the repository root, with ``/``.
        name: the test's name, parameters included.
        fixturenames: the fixtures it uses.
        explicit: the names of the marks it already carries.

    Returns:
        The set of markers to add.
    """
    path = pathlib.PurePosixPath(relpath)
    modules = imported_modules(str(_ROOT / relpath))
    marks = set()
    if any(_matches(m, FRAMEWORK_MODULES) for m in modules):
        marks.add("framework")
    if "cluster" in fixturenames or any(_matches(m, MULTIHOST_MODULES) for m in modules):
        marks.add("multihost")
    multiproc = path.parts[:2] == ("tests", "multiproc")
    if (path.name in FAULT_FILES or any(_matches(m, FAULT_MODULES) for m in modules)
            or (multiproc and FAULT_NAME.search(name))):
        marks.add("fault")
    if "fast" in explicit or "slow" in explicit:
        return marks
    if f"{relpath}::{name}" in FAST:
        marks.add("fast")
    elif marks or multiproc or relpath in SLOW_UNIT:
        marks.add("slow")
    else:
        marks.add("fast")
    return marks


_ROOT = pathlib.Path(__file__).resolve().parent.parent
