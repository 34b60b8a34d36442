"""The documentation site builds with ``mkdocs build --strict`` (no broken link, no missing
reference, no warning), its settings page is hora/config.py's, and every public function of
the modules in its API reference has a docstring."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the modules the API reference documents (docs/api/), read statically: none is imported
API_MODULES = ("hora", "hora.torch", "hora.tensorflow", "hora.keras", "hora.jax", "hora.mxnet",
               "hora.elastic", "hora.ray", "hora.spark", "hora.data")
# HORA_* names the documentation may use that are not settings of hora/config.py: the image's
# (deploy/), the suite's, and the SageMaker start-up script's
NOT_SETTINGS = {"HORA_EXTRAS", "HORA_TRAIN_COMMAND", "HORA_TEST_NO_SSHD",
                "HORA_SAGEMAKER_SSH_WAIT_S", "HORA_SAGEMAKER_MPI_START_S"}


def _mkdocs():
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
        import material  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the docs tools are not installed ({e.name}): pip install -e \".[docs]\"")


@pytest.mark.timeout(120)
def test_mkdocs_build_strict(tmp_path):
    _mkdocs()
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                          str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    settings = (tmp_path / "site" / "settings" / "index.html").read_text(encoding="utf-8")
    from hora.config import DECLARED
    missing = [name for name in DECLARED if f"HORA_{name}<" not in settings]
    assert not missing, f"settings missing from the generated page: {missing}"
    api = (tmp_path / "site" / "api" / "torch" / "index.html").read_text(encoding="utf-8")
    assert 'id="hora.torch.DistributedOptimizer"' in api


def test_every_hora_variable_the_docs_name_is_a_setting():
    from hora.config import DECLARED
    declared = {f"HORA_{name}" for name in DECLARED}
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    named = {m for p in texts for m in re.findall(r"HORA_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    unknown = sorted(named - declared - NOT_SETTINGS)
    assert not unknown, f"the docs name HORA_* variables hora/config.py does not declare: {unknown}"


def test_public_functions_of_the_api_reference_have_docstrings():
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)])
    loader.load("hora")             # the package, every submodule with it (loading each is slow)
    loader.resolve_aliases(implicit=False, external=False)
    bare = []
    for name in API_MODULES:
        module = loader.modules_collection[name]
        if name == "hora":
            import hora.core
            members = [module[m] for m in hora.core.__all__ if m in module.members]
        else:
            members = [m for n, m in module.members.items() if m.is_public]
        for member in members:
            try:
                target = member.final_target if member.is_alias else member
            except Exception:  # noqa: BLE001 - an alias griffe cannot follow: not ours to check
                continue
            if target.is_function and not target.docstring:
                bare.append(f"{name}.{member.name}")
            if target.is_class:
                bare += [f"{name}.{member.name}.{n}" for n, m in target.members.items()
                         if not n.startswith("_") and m.is_function and not m.docstring
                         and not m.is_alias]
    assert not bare, f"public functions without a docstring: {bare}"
