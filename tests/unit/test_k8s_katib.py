"""hora k8s katib: a Katib Experiment (kubeflow.org/v1beta1) whose trials are hora MPIJobs.

The Experiment is checked against Katib's own field schema (tests/data, from
kubeflow/katib's swagger.json: its CRD takes any object), closed as test_k8s.py closes the
MPIJob's so a misspelt field fails, plus the rules Katib's admission webhook applies that no
schema says (pkg/webhook/v1beta1/experiment/validator/validator.go): the enumerations, the
trial parameters used by the template and no others, a metrics format with two groups.  The
trial template must be the MPIJob ``hora k8s mpijob`` prints, valid against the MPIJob schema.
"""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from hora.integrations import k8s  # noqa: E402
from hora.integrations.katib import (  # noqa: E402
    KATIB_ALGORITHMS, KATIB_METRICS_FORMAT, katib_experiment, parse_param, trial_command)
from tests.unit.test_k8s import SCHEMA_FILE, _errors, _strict  # noqa: E402

pytestmark = pytest.mark.timeout(60)

KATIB_SCHEMA = Path(__file__).resolve().parent.parent / "data" / \
    "katib_experiment_v1beta1_schema.yaml"
# Katib's Go constants (pkg/apis/controller/common/v1beta1/common_types.go,
# experiments/v1beta1/experiment_types.go) and webhook checks at the schema's commit
OBJECTIVE_TYPES = {"maximize", "minimize"}
PARAMETER_TYPES = {"double", "int", "discrete", "categorical"}
COLLECTOR_KINDS = {"StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "None",
                   "Push"}
PLACEHOLDER = re.compile(r"\$\{trialParameters\..+?\}")     # consts.TrialTemplateParam...

ARGV = ["k8s", "katib", "--image", "registry.example/hora:1", "-np", "4",
        "--slots-per-worker", "2", "--name", "mnist-tune", "--objective-metric", "accuracy",
        "--objective-type", "maximize", "--goal", "0.99", "--additional-metric", "loss",
        "--param", "lr:double:0.001:0.1", "--param", "batch:int:16:128:16",
        "--param", "opt:categorical:sgd,adam", "--algorithm", "bayesianoptimization",
        "--max-trials", "20", "--parallel-trials", "4", "--max-failed-trials", "2",
        "--", "python", "train.py", "--epochs", "3"]


@pytest.fixture(scope="module")
def katib():
    schema = _strict(yaml.safe_load(KATIB_SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def mpijob():
    schema = _strict(yaml.safe_load(SCHEMA_FILE.read_text()))
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "hora", *argv], capture_output=True,
                          text=True, timeout=30)


def _webhook_errors(experiment):
    """What Katib's validating webhook would reject, of the rules hora's output touches."""
    spec, errors = experiment["spec"], []
    name = experiment["metadata"]["name"]
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 40:
        errors.append(f"name {name}")
    if spec["objective"]["type"] not in OBJECTIVE_TYPES:
        errors.append("objective type")
    if spec["metricsCollectorSpec"]["collector"]["kind"] not in COLLECTOR_KINDS:
        errors.append("collector kind")
    for fmt in spec["metricsCollectorSpec"].get("source", {}).get("filter", {}).get(
            "metricsFormat", []):
        if not re.match(r".*\(.*\).*\(.*\).*", fmt):
            errors.append(f"metricsFormat {fmt}: two top subexpressions are required")
    fs = spec["metricsCollectorSpec"].get("source", {}).get("fileSystemPath")
    if spec["metricsCollectorSpec"]["collector"]["kind"] == "File" and (
            not fs or fs["kind"] != "File" or not fs["path"].startswith("/")
            or fs.get("format") not in ("TEXT", "JSON")):
        errors.append("File collector needs an absolute file path and a format")
    for p in spec["parameters"]:
        if p["parameterType"] not in PARAMETER_TYPES:
            errors.append(f"parameter type {p['parameterType']}")
    template = spec["trialTemplate"]
    for field in ("primaryContainerName", "successCondition", "failureCondition"):
        if not template.get(field):
            errors.append(f"trialTemplate.{field} is required")
    refs = {t["reference"] for t in template["trialParameters"]}
    if refs - {p["name"] for p in spec["parameters"]}:
        errors.append("a trial parameter refers to no parameter")
    text = yaml.safe_dump(template["trialSpec"])
    used = set(PLACEHOLDER.findall(text))
    declared = {"${trialParameters.%s}" % t["name"] for t in template["trialParameters"]}
    if used != declared:
        errors.append(f"placeholders {sorted(used)} != trial parameters {sorted(declared)}")
    return errors


def test_cli_experiment_validates_against_katib_and_mpijob_schemas(katib, mpijob):
    run = _cli(*ARGV)
    assert run.returncode == 0, run.stderr
    experiment = yaml.safe_load(run.stdout)
    assert _errors(katib, experiment) == []
    assert _webhook_errors(experiment) == []
    assert experiment["apiVersion"] == "kubeflow.org/v1beta1"
    assert experiment["kind"] == "Experiment"
    assert experiment["metadata"] == {"name": "mnist-tune"}
    spec = experiment["spec"]
    assert spec["objective"] == {"type": "maximize", "objectiveMetricName": "accuracy",
                                 "goal": 0.99, "additionalMetricNames": ["loss"]}
    assert spec["algorithm"] == {"algorithmName": "bayesianoptimization"}
    assert (spec["maxTrialCount"], spec["parallelTrialCount"],
            spec["maxFailedTrialCount"]) == (20, 4, 2)
    assert spec["parameters"] == [
        {"name": "lr", "parameterType": "double",
         "feasibleSpace": {"min": "0.001", "max": "0.1"}},
        {"name": "batch", "parameterType": "int",
         "feasibleSpace": {"min": "16", "max": "128", "step": "16"}},
        {"name": "opt", "parameterType": "categorical",
         "feasibleSpace": {"list": ["sgd", "adam"]}}]
    assert spec["metricsCollectorSpec"] == {
        "collector": {"kind": "StdOut"},
        "source": {"filter": {"metricsFormat": [KATIB_METRICS_FORMAT]}}}
    # the trial is the MPIJob `hora k8s mpijob` makes, placeholders appended to the command
    template = spec["trialTemplate"]
    trial = template["trialSpec"]
    assert _errors(mpijob, trial) == []
    expected = k8s.mpijob_manifest(
        ["python", "train.py", "--epochs", "3", "--lr", "${trialParameters.lr}",
         "--batch", "${trialParameters.batch}", "--opt", "${trialParameters.opt}"],
        "registry.example/hora:1", 4, 2, name="mnist-tune")
    del expected["metadata"]          # Katib names each trial's job
    assert trial == expected
    assert template["primaryContainerName"] == "mpi-launcher"
    launcher = trial["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    assert [c["name"] for c in launcher] == ["mpi-launcher"]
    # the label the MPI operator (v2beta1) puts on the launcher pod
    assert template["primaryPodLabels"] == {"training.kubeflow.org/job-role": "launcher"}


def test_metrics_format_reads_what_rank_0_prints():
    pattern = re.compile(KATIB_METRICS_FORMAT)
    line = "[1,0]<stdout>: epoch 3 accuracy=0.913 loss = 1.5e-2"
    found = {m.group(1): float(m.group(2)) for m in pattern.finditer(line)}
    assert found["accuracy"] == 0.913 and found["loss"] == 0.015


def test_placeholders_already_in_the_command_are_kept(katib, mpijob):
    params = [parse_param("lr:double:0.01:0.5"), parse_param("layers:discrete:2,4,8")]
    command = trial_command(["python", "t.py", "--learning-rate=${trialParameters.lr}"],
                                params)
    assert command == ["python", "t.py", "--learning-rate=${trialParameters.lr}",
                       "--layers", "${trialParameters.layers}"]
    experiment = katib_experiment(
        k8s.mpijob_manifest(command, "img", 2), "loss", "minimize", params,
        algorithm="tpe", metrics_collector="File", name="t", namespace="kubeflow-user")
    assert _errors(katib, experiment) == [] and _webhook_errors(experiment) == []
    assert _errors(mpijob, experiment["spec"]["trialTemplate"]["trialSpec"]) == []
    assert "goal" not in experiment["spec"]["objective"]
    assert experiment["metadata"] == {"name": "t", "namespace": "kubeflow-user"}
    assert experiment["spec"]["metricsCollectorSpec"]["source"]["fileSystemPath"] == {
        "path": "/var/log/katib/metrics.log", "kind": "File", "format": "TEXT"}


@pytest.mark.parametrize("algorithm", KATIB_ALGORITHMS)
def test_every_algorithm_validates(katib, algorithm):
    params = [parse_param("lr:double:0.001:0.1:0.001")]
    job = k8s.mpijob_manifest(trial_command(["python", "t.py"], params), "img", 2)
    experiment = katib_experiment(job, "acc", "maximize", params, algorithm=algorithm)
    assert _errors(katib, experiment) == [] and _webhook_errors(experiment) == []


def test_the_strict_schema_and_the_webhook_checks_do_reject_mistakes(katib):
    params = [parse_param("lr:double:0.001:0.1")]
    job = k8s.mpijob_manifest(trial_command(["python", "t.py"], params), "img", 2)
    good = katib_experiment(job, "acc", "maximize", params)
    bad = copy.deepcopy(good)
    bad["spec"]["maxTrialCounts"] = 3                       # misspelt field
    assert _errors(katib, bad)
    bad = copy.deepcopy(good)
    bad["spec"]["parallelTrialCount"] = "3"                 # not an integer
    assert _errors(katib, bad)
    bad = copy.deepcopy(good)
    bad["spec"]["trialTemplate"]["trialParameters"].append({"name": "x", "reference": "x"})
    assert _webhook_errors(bad)
    bad = copy.deepcopy(good)
    bad["spec"]["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"] = ["(\\w+)=.*"]
    assert _webhook_errors(bad)


@pytest.mark.parametrize("text,fragment", [
    ("lr:float:1:2", "the type must be one of"),
    ("lr:double:0.1", "expected lr:double:MIN:MAX"),
    ("lr:double:0.5:0.1", "MIN < MAX"),
    ("n:int:1.5:4", "not all finite integers"),
    ("n:int:1:4:0", "STEP > 0"),
    ("opt:categorical:", "distinct values"),
    ("opt:categorical:a,a", "distinct values"),
    ("k:discrete:1,x", "not all finite numbers"),
    # Katib parses no inf or nan, and two spellings of one number are one value to it
    ("lr:double:0:inf", "['0', 'inf'] are not all finite numbers"),
    ("lr:double:nan:1", "not all finite numbers"),
    ("lr:double:0:1:inf", "not all finite numbers"),
    ("k:discrete:1,inf", "not all finite numbers"),
    ("k:discrete:1,2,1.0", "expected distinct numbers a,b,... (1 and 1.0 are the same number)"),
    ("k:discrete:0.5,5e-1", "(0.5 and 5e-1 are the same number)"),
    ("9lives:int:1:2", "the name must be a letter"),
])
def test_bad_params_are_named(text, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)) as info:
        parse_param(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("argv,fragment", [
    (["--name", "Tune"], "'Tune' is not a Katib experiment name"),
    (["--name", "a" * 41], "at most 40"),
    (["--param", "lr:double:1:1"], "MIN < MAX"),
    (["--param", "lr:double:1:2", "--param", "lr:int:1:2"], "parameter names repeat"),
    (["--max-trials", "0"], "max_trials must be a positive integer, got 0"),
    (["--max-failed-trials", "-1"], "max_failed_trials must be an integer >= 0, got -1"),
    (["--metrics-format", "(\\w+)"], "needs two groups"),
    (["--metrics-format", "(("], "missing"),
    (["--metrics-collector", "File", "--metrics-file", "rel.log"], "absolute path"),
    (["--algorithm", "magic"], "invalid choice: 'magic'"),
    (["--algorithm", "grid"], "grid search needs a STEP for parameters ['lr']"),
    (["--param", "lr:double:0:inf"], "are not all finite numbers"),
    (["--param", "x:discrete:1,1.0"], "(1 and 1.0 are the same number)"),
    (["--goal", "inf"], "goal must be a finite number, got inf"),
])
def test_bad_input_is_a_usage_error_quoting_the_value(argv, fragment):
    base = ["k8s", "katib", "--image", "i", "-np", "2", "--objective-metric", "acc",
            "--objective-type", "maximize"]
    if not any(a == "--param" for a in argv):
        base += ["--param", "lr:double:0.1:0.2"]
    run = _cli(*base, *argv, "--", "python", "t.py")
    assert run.returncode == 2
    assert fragment in run.stderr


def test_api_refuses_a_job_that_ignores_a_parameter():
    params = [parse_param("lr:double:0.001:0.1")]
    with pytest.raises(ValueError, match=r"never uses parameters \['lr'\]"):
        katib_experiment(k8s.mpijob_manifest(["python", "t.py"], "img", 2), "acc",
                         "maximize", params)
    with pytest.raises(ValueError, match="objective type must be maximize or minimize"):
        katib_experiment({}, "acc", "max", params)


def test_yaml_is_the_same_without_pyyaml():
    hide = ("import sys; sys.modules['yaml'] = None\n"
            "from hora.__main__ import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    without = subprocess.run([sys.executable, "-c", hide, *ARGV], capture_output=True,
                             text=True, timeout=30)
    assert without.returncode == 0, without.stderr
    assert without.stdout == _cli(*ARGV).stdout
    assert without.stdout.startswith("apiVersion: kubeflow.org/v1beta1\nkind: Experiment\n")
