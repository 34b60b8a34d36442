"""hora k8s mpijob: the manifest is a valid kubeflow.org/v2beta1 MPIJob.

The schema is the MPIJob CRD's own OpenAPI v3 schema (tests/data, vendored from
kubeflow/mpi-operator).  Kubernetes prunes fields a structural schema does not list instead of
rejecting them, so the test closes every object that lists its properties: a misspelt field
fails here as it would under ``kubectl apply --validate=strict``.
"""
import copy
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from hora.integrations import k8s  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "data" / "mpijob_v2beta1_schema.yaml"


def _strict(schema):
    """The schema with ``additionalProperties: false`` wherever properties are listed."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
    close(schema)
    return schema


@pytest.fixture(scope="module")
def validator():
    schema = _strict(yaml.safe_load(SCHEMA_FILE.read_text()))
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())


def _errors(validator, manifest):
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)]


def _cli(*argv):
    run = subprocess.run([sys.executable, "-m", "hora", *argv], capture_output=True, text=True,
                         timeout=30)
    return run


@pytest.mark.parametrize("np,slots", [(8, 4), (1, 1), (5, 2), (3, 8)])
def test_cli_manifest_validates_against_the_crd_schema(validator, np, slots):
    run = _cli("k8s", "mpijob", "--image", "registry.example/hora:1", "-np", str(np),
               "--slots-per-worker", str(slots), "--name", "mnist", "--", "python", "train.py",
               "--epochs", "3")
    assert run.returncode == 0, run.stderr
    manifest = yaml.safe_load(run.stdout)
    assert _errors(validator, manifest) == []
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"
    spec = manifest["spec"]
    assert spec["slotsPerWorker"] == slots and spec["mpiImplementation"] == "OpenMPI"
    assert set(spec["mpiReplicaSpecs"]) == {"Launcher", "Worker"}
    assert spec["mpiReplicaSpecs"]["Launcher"]["replicas"] == 1
    assert spec["mpiReplicaSpecs"]["Worker"]["replicas"] == math.ceil(np / slots)
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    argv = launcher["command"] + launcher["args"]
    assert argv[:3] == ["mpirun", "-np", str(np)]
    assert argv[-4:] == ["python", "train.py", "--epochs", "3"]
    joined = " ".join(argv)
    for flags in ("--bind-to none", "--map-by slot", "-x LD_LIBRARY_PATH", "-x PATH",
                  "--mca pml ob1", "--mca btl ^openib"):
        assert flags in joined
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["image"] == launcher["image"] == "registry.example/hora:1"
    _assert_kubeflow_ready(spec)


def _assert_kubeflow_ready(spec):
    """What a Kubeflow cluster needs: no Istio sidecar in either pod (it breaks the
    launcher's SSH and keeps finished pods running), and the operator's restart policies set
    on the replica specs (a policy in the pod template is overridden, with a warning)."""
    replicas = spec["mpiReplicaSpecs"]
    assert replicas["Launcher"]["restartPolicy"] == "OnFailure"
    assert replicas["Worker"]["restartPolicy"] == "Never"
    for role in ("Launcher", "Worker"):
        template = replicas[role]["template"]
        assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
        assert "restartPolicy" not in template["spec"]


def test_options_reach_the_manifest(validator):
    manifest = k8s.mpijob_manifest(
        ["python", "t.py"], "img", 4, 2, name="job-2", namespace="ml",
        env={"NCCL_DEBUG": "INFO"}, mpirun_args=["--tag-output"],
        ssh_auth_mount_path="/home/mpiuser/.ssh",
        worker_resources={"limits": {"nvidia.com/gpu": 2}}, image_pull_policy="IfNotPresent")
    assert _errors(validator, manifest) == []
    assert manifest["metadata"] == {"name": "job-2", "namespace": "ml"}
    args = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("NCCL_DEBUG=INFO") - 1] == "-x"
    assert args.index("--tag-output") < args.index("t.py")
    assert manifest["spec"]["sshAuthMountPath"] == "/home/mpiuser/.ssh"


def test_the_strict_schema_does_reject_mistakes(validator):
    good = k8s.mpijob_manifest(["python", "t.py"], "img", 2)
    bad = copy.deepcopy(good)
    bad["spec"]["slotsPerWorkers"] = 2                       # misspelt field
    assert _errors(validator, bad)
    bad = copy.deepcopy(good)
    bad["spec"]["mpiImplementation"] = "LAM"                 # not in the enum
    assert _errors(validator, bad)
    bad = copy.deepcopy(good)
    bad["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"] = {
        "sidecar.istio.io/inject": False}                    # annotations are strings
    assert _errors(validator, bad)


def test_the_yaml_quotes_the_istio_annotation():
    text = k8s.render(k8s.mpijob_manifest(["python", "t.py"], "img", 2))
    # unquoted, `false` would be a boolean, which Kubernetes refuses in annotations
    assert text.count('sidecar.istio.io/inject: "false"') == 2


def test_json_without_yaml_is_the_same_manifest():
    manifest = k8s.mpijob_manifest(["python", "t.py"], "img", 3, 2)
    assert yaml.safe_load(k8s.render(manifest)) == manifest
    assert json.loads(json.dumps(manifest)) == manifest


@pytest.mark.parametrize("argv,fragment", [
    (["--image", "i", "-np", "0", "--", "python"], "np must be a positive integer, got 0"),
    (["--image", "i", "-np", "2", "--slots-per-worker", "-1", "--", "python"],
     "slots_per_worker must be a positive integer, got -1"),
    (["--image", "i", "-np", "2", "--name", "Bad_Name", "--", "python"], "'Bad_Name'"),
    (["--image", "i", "-np", "2"], "no command given"),
    (["--image", "i", "-np", "2", "--env", "NOEQUALS", "--", "python"], "NAME=VALUE"),
])
def test_bad_input_is_a_usage_error_quoting_the_value(argv, fragment):
    run = _cli("k8s", "mpijob", *argv)
    assert run.returncode == 2
    assert fragment in run.stderr


def test_launcher_command_runs_locally_under_mpirun(tmp_path):
    from tests.helpers import mpirun_unusable
    if mpirun_unusable():
        pytest.skip(f"{mpirun_unusable()}: the launcher command cannot be run here")
    mpirun = shutil.which("mpirun")
    script = tmp_path / "w.py"
    script.write_text(
        "import os, numpy as np, hora\n"
        "hora.init()\n"
        "total = hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum, name='x')\n"
        "open(os.path.join(os.environ['OUT'], str(hora.rank())), 'w')"
        ".write(f'{hora.size()} {total[0]}')\n"
        "hora.shutdown()\n")
    manifest = k8s.mpijob_manifest([sys.executable, str(script)], "img", 2, 2)
    launcher = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"][
        "containers"][0]
    argv = [mpirun] + launcher["args"]
    # locally there is no operator hostfile: let mpirun place both ranks here
    argv[1:1] = ["--oversubscribe"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "OMPI_"))}
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=50,
                         env=dict(env, OUT=str(out)))
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.read_text() for p in out.iterdir()) == ["2 3.0", "2 3.0"]


# -- the YAML hora writes itself ---------------------------------------------------------------
_ARGV = ["k8s", "mpijob", "--image", "registry.example/hora:1", "-np", "8",
         "--slots-per-worker", "4", "--env", "NCCL_DEBUG=INFO", "--gpus-per-worker", "2",
         "--", "python", "train.py", "--lr", "0.1", "--tag", "yes", "a b: c", "#x"]

_HIDE_YAML = ("import sys; sys.modules['yaml'] = None\n"
              "from hora.__main__ import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


def test_cli_prints_block_yaml_with_or_without_pyyaml():
    with_pyyaml = _cli(*_ARGV)
    without = subprocess.run([sys.executable, "-c", _HIDE_YAML, *_ARGV], capture_output=True,
                             text=True, timeout=30)
    assert with_pyyaml.returncode == 0 and without.returncode == 0, without.stderr
    assert without.stdout == with_pyyaml.stdout
    # block YAML, what people edit: not JSON (which a YAML reader would also take)
    assert without.stdout.startswith("apiVersion: kubeflow.org/v2beta1\nkind: MPIJob\n")
    expected = k8s.mpijob_manifest(
        ["python", "train.py", "--lr", "0.1", "--tag", "yes", "a b: c", "#x"],
        "registry.example/hora:1", 8, 4, env={"NCCL_DEBUG": "INFO"},
        worker_resources={"limits": {"nvidia.com/gpu": 2}})
    assert yaml.safe_load(without.stdout) == expected


# strings a YAML reader would take for something else, or that need escapes
_TRICKY = ["", "yes", "No", "ON", "y", "null", "~", "true", "1", "0x1F", "1e3", "1_000", "1:30",
           "-1", ".inf", "-.inf", ".NaN", "2001-12-14", "=", "<<", "- x", "-x", "--flag", "a: b",
           "a #b", "#c", "@x", "`x", "!tag", "&a", "*a", "|", ">", "'q'", '"q"', "[1]", "{a: 1}",
           "%x", "?", "a\nb", "tab\there", " lead", "trail ", "ü", "\u2028", "\x85", "\x7f",
           "\x00", "\ufeff", "\U0001F600", "\\", "C:\\path", "^openib", "a,b", "NAME=VALUE"]


@pytest.mark.parametrize("text", _TRICKY)
def test_tricky_strings_come_back_as_strings(text):
    value = {"k": text, text or "empty": [text, {"inner": text}], "list": [[text, 1], []]}
    assert yaml.safe_load(k8s.to_yaml(value)) == value


def test_scalars_and_empty_collections():
    value = {"i": 3, "neg": -2, "f": 1.5, "t": True, "f2": False, "none": None, "d": {},
             "l": [], "nested": [{"a": [1, {"b": None}]}, [[]]]}
    assert yaml.safe_load(k8s.to_yaml(value)) == value
    with pytest.raises(TypeError, match="cannot write set"):
        k8s.to_yaml({"s": {1, 2}})
    with pytest.raises(TypeError, match="keys here must be strings"):
        k8s.to_yaml({1: "a"})


def test_any_text_round_trips():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    # surrogates cannot be written as UTF-8; every other code point can
    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
    leaves = st.none() | st.booleans() | st.integers() | text
    trees = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3)
                         | st.dictionaries(text, kids, max_size=3), max_leaves=12)

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(st.dictionaries(text, trees, max_size=4))
    # a plain-looking text with a trailing newline (a `$` in the plain-scalar pattern once
    # let it through unquoted), as a key and as a value
    @hypothesis.example({"A\n": None})
    @hypothesis.example({"": {"key": "value\n"}})
    def round_trip(value):
        assert yaml.safe_load(k8s.to_yaml(value)) == value

    round_trip()


@pytest.mark.parametrize("argv", [
    ["mpijob", "--image", "i", "-np", "2", "--", "python", "t.py"],
    ["discover-hosts"],
    ["katib", "--image", "i", "-np", "2", "--objective-metric", "acc", "--objective-type",
     "maximize", "--param", "lr:double:0.1:0.2", "--", "python", "t.py"],
])
def test_a_reader_that_stops_early_ends_the_command_quietly(argv):
    """`hora k8s ... | head`: the pipe closes before the manifest is written; the command
    ends as a Unix tool killed by SIGPIPE would (status 141), with nothing on stderr."""
    import signal
    read, write = os.pipe()
    os.close(read)                  # no reader: every write fails with EPIPE
    try:
        run = subprocess.run([sys.executable, "-m", "hora", "k8s", *argv], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (128 + signal.SIGPIPE, "")
