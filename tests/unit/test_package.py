"""The package as pip sees it: the license, and extras that install a framework without
swapping out the one a user has (lower bounds only; exact versions in ``test``), and that
bring what their examples import."""
import ast
import pathlib
import sys

import pytest

tomllib = pytest.importorskip("tomllib")            # Python 3.11+
requirements = pytest.importorskip("packaging.requirements")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
FRAMEWORK_EXTRAS = ("torch", "tensorflow", "tensorflow-cpu", "keras", "keras2", "jax", "ray",
                    "spark")
# an import name -> its distribution where the two differ
DISTRIBUTIONS = {"sklearn": "scikit-learn"}


def _requirements(extra):
    return {r.name: r for r in map(requirements.Requirement, EXTRAS[extra])}


def test_apache_2_license_file_and_fields():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    classifiers = PROJECT["classifiers"]
    assert not [c for c in classifiers if c.startswith("License ::")]   # PEP 639: the field
    for prefix in ("Development Status ::", "Operating System ::", "Topic ::",
                   "Programming Language :: Python :: 3.11"):
        assert any(c.startswith(prefix) for c in classifiers), prefix


@pytest.mark.parametrize("extra", FRAMEWORK_EXTRAS)
def test_framework_extras_take_lower_bounds_only(extra):
    for name, req in _requirements(extra).items():
        operators = {spec.operator for spec in req.specifier}
        assert operators == {">="}, f"[{extra}] {req}: a lower bound only (exact pins in test)"


def test_each_tensorflow_build_has_an_extra_that_keeps_it():
    """tensorflow and tensorflow-cpu are two distributions of one package: an extra that
    named the other would install a second TensorFlow over the user's."""
    assert set(_requirements("tensorflow")) == {"tensorflow", "tensorboard"}
    assert set(_requirements("tensorflow-cpu")) == {"tensorflow-cpu", "tensorboard"}
    for extra in EXTRAS:
        names = set(_requirements(extra))
        assert not {"tensorflow", "tensorflow-cpu"} <= names, extra


def test_the_suite_pins_what_it_runs_and_builds_the_docs():
    test = _requirements("test")
    for name in ("torch", "tensorflow", "tf-keras", "jax"):
        assert [s.operator for s in test[name].specifier] == ["=="], test[name]
    assert set(_requirements("docs")) == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    for name, req in _requirements("docs").items():
        assert str(test[name]) == str(req)


def _third_party_imports(path):
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "hora"}


@pytest.mark.parametrize("example, extra", [("mxnet_digits.py", "mxnet"),
                                            ("pytorch_digits.py", "examples")])
def test_an_examples_extra_brings_what_it_imports(example, extra):
    """The README's recipes: ``.[examples]`` then pytorch_digits.py; ``.[mxnet]`` (in a venv
    of its own) then mxnet_digits.py.  numpy comes with hora itself."""
    brought = set(_requirements(extra)) | {"numpy"}
    needed = {DISTRIBUTIONS.get(n, n) for n in _third_party_imports(ROOT / "examples" / example)}
    assert needed <= brought, f"[{extra}] lacks {sorted(needed - brought)} for {example}"
