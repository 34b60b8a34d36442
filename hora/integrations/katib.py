"""Katib: ``hora k8s katib`` prints an ``Experiment`` (kubeflow.org/v1beta1) whose trial
template is the MPIJob of :func:`hora.integrations.k8s.mpijob_manifest`, its command holding
``${trialParameters.<name>}`` for each searched parameter; the StdOut metrics collector reads
``name=value`` lines from the launcher, where mpirun brings every rank's output.

Layer: integrations.  Imports nothing from hora but :mod:`hora.integrations.k8s`.
"""
import math
import re
import shlex

from .k8s import (_emit, _env_pairs, _gpu_limits, _job_arguments, _positive, mpijob_manifest,
                  render)

__all__ = ["KATIB_API_VERSION", "KATIB_ALGORITHMS", "KATIB_METRICS_FORMAT", "parse_param",
           "trial_command", "katib_experiment", "add_katib"]


KATIB_API_VERSION = "kubeflow.org/v1beta1"
# the algorithms of Katib's default configuration (katib-config.yaml, runtime.suggestions)
KATIB_ALGORITHMS = ("random", "grid", "bayesianoptimization", "tpe", "multivariate-tpe",
                    "cmaes", "sobol", "hyperband")
# Katib's own default filter: "name=value" anywhere in a line, e.g. "epoch 3 accuracy=0.91";
# the first group is the metric's name, the second its value
KATIB_METRICS_FORMAT = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"
KATIB_METRICS_FILE = "/var/log/katib/metrics.log"
_PARAM_TYPES = ("double", "int", "categorical", "discrete")
_PARAM_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_EXPERIMENT_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")       # Katib's webhook: <= 40


def parse_param(text):
    """A Katib ``ParameterSpec`` from ``name:type:range``.

    ``lr:double:0.001:0.1``, ``batch:int:16:128`` (optionally ``:step``, e.g.
    ``batch:int:16:128:16``), ``opt:categorical:sgd,adam``, ``layers:discrete:2,4,8``.

    Raises:
        ValueError: quoting ``text`` and saying what is wrong.
    """
    name, _, rest = str(text).partition(":")
    kind, _, space = rest.partition(":")
    if not _PARAM_NAME.match(name):
        raise ValueError(f"--param {text!r}: the name must be a letter, then letters, digits, "
                         f"'_' or '-'")
    if kind not in _PARAM_TYPES:
        raise ValueError(f"--param {text!r}: the type must be one of {', '.join(_PARAM_TYPES)}")
    if kind in ("categorical", "discrete"):
        values = [v for v in space.split(",") if v != ""]
        if not values or len(set(values)) != len(values):
            raise ValueError(f"--param {text!r}: expected distinct values a,b,...")
        if kind == "discrete":
            seen = {}
            for value, number in zip(values, _numbers(text, values, float)):
                if number in seen:                      # 1 and 1.0: one value to Katib
                    raise ValueError(f"--param {text!r}: expected distinct numbers a,b,... "
                                     f"({seen[number]} and {value} are the same number)")
                seen[number] = value
        return {"name": name, "parameterType": kind, "feasibleSpace": {"list": values}}
    bounds = space.split(":")
    if len(bounds) not in (2, 3):
        raise ValueError(f"--param {text!r}: expected {name}:{kind}:MIN:MAX[:STEP]")
    low, high, *step = _numbers(text, bounds, int if kind == "int" else float)
    if not low < high or (step and step[0] <= 0):
        raise ValueError(f"--param {text!r}: need MIN < MAX (and STEP > 0)")
    feasible = dict(zip(("min", "max", "step"), bounds))
    return {"name": name, "parameterType": kind, "feasibleSpace": feasible}


def _check_experiment_name(name):
    if not isinstance(name, str) or len(name) > 40 or not _EXPERIMENT_NAME.match(name):
        raise ValueError(f"name {name!r} is not a Katib experiment name (lower-case letters, "
                         f"digits and '-', starting with a letter, at most 40)")


def _numbers(text, values, kind):
    """``values`` as ``kind``: finite numbers (Katib parses no inf or nan)."""
    try:
        numbers = [kind(v) for v in values]
    except ValueError:
        numbers = None
    if numbers is None or not all(math.isfinite(n) for n in numbers):
        raise ValueError(f"--param {text!r}: {values} are not all finite "
                         f"{'integers' if kind is int else 'numbers'}")
    return numbers


def trial_command(command, parameters):
    """``command`` with each parameter's ``${trialParameters.<name>}`` in it: where the
    command names none, ``--<name> ${trialParameters.<name>}`` is appended."""
    command = [str(c) for c in command]
    for p in parameters:
        placeholder = "${trialParameters.%s}" % p["name"]
        if not any(placeholder in c for c in command):
            command += [f"--{p['name']}", placeholder]
    return command


def katib_experiment(trial_job, objective_metric, objective_type, parameters, goal=None,
                     additional_metrics=(), algorithm="random", max_trials=12,
                     parallel_trials=3, max_failed_trials=3, metrics_collector="StdOut",
                     metrics_format=KATIB_METRICS_FORMAT, metrics_file=KATIB_METRICS_FILE,
                     name="hora-tune", namespace=None):
    """A Katib ``Experiment`` (kubeflow.org/v1beta1) whose trials run ``trial_job``.

    Args:
        trial_job: the MPIJob of one trial (:func:`mpijob_manifest`), its command holding
            the ``${trialParameters.<name>}`` placeholders (:func:`trial_command`).
        objective_metric: the metric Katib optimises, printed ``name=value`` by rank 0.
        objective_type: ``"maximize"`` or ``"minimize"``.
        parameters: Katib ``ParameterSpec`` dicts (:func:`parse_param`); each becomes a
            trial parameter of the same name.
        goal: stop once a trial reaches it, or None.
        additional_metrics: more metric names to record.
        algorithm: the suggestion algorithm (one of :data:`KATIB_ALGORITHMS`).
        max_trials, parallel_trials, max_failed_trials: Katib's trial counts.
        metrics_collector: ``"StdOut"`` (the launcher's output: mpirun brings every rank's
            there) or ``"File"`` (``metrics_file``, read in the launcher pod).
        metrics_format: the regular expression with two groups, name and value, that picks
            metrics out of text.
        name, namespace: the Experiment's.

    Raises:
        ValueError: naming the bad argument and quoting its value.
    """
    _check_experiment_name(name)
    objective = _objective(objective_metric, objective_type, goal, additional_metrics)
    names = _search_names(algorithm, parameters)
    _check_trial_counts(max_trials, parallel_trials, max_failed_trials)
    if re.compile(metrics_format).groups < 2:
        raise ValueError(f"metrics format {metrics_format!r} needs two groups: name, value")
    text = repr(trial_job)
    missing = [n for n in names if "${trialParameters.%s}" % n not in text]
    if missing:
        raise ValueError(f"the trial job never uses parameters {missing} (see trial_command)")
    source = _metrics_source(metrics_collector, metrics_format, metrics_file)
    metadata = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": KATIB_API_VERSION,
        "kind": "Experiment",
        "metadata": metadata,
        "spec": {
            "objective": objective,
            "algorithm": {"algorithmName": algorithm},
            "parallelTrialCount": parallel_trials,
            "maxTrialCount": max_trials,
            "maxFailedTrialCount": max_failed_trials,
            "metricsCollectorSpec": {"collector": {"kind": metrics_collector},
                                     "source": source},
            "parameters": [dict(p) for p in parameters],
            "trialTemplate": _trial_template(trial_job, names),
        },
    }


def _search_names(algorithm, parameters):
    """The searched parameters' names, once the search is one Katib can run: a known
    algorithm, at least one parameter, no name twice, and for grid a step on every range."""
    if algorithm not in KATIB_ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(KATIB_ALGORITHMS)}")
    if not parameters:
        raise ValueError("no parameters to search (e.g. --param lr:double:0.001:0.1)")
    names = [p["name"] for p in parameters]
    if len(set(names)) != len(names):
        raise ValueError(f"parameter names repeat: {names}")
    if algorithm == "grid":
        # Katib's grid suggestion refuses a numeric range it cannot enumerate
        stepless = [p["name"] for p in parameters
                    if "min" in p["feasibleSpace"] and "step" not in p["feasibleSpace"]]
        if stepless:
            raise ValueError(f"grid search needs a STEP for parameters {stepless} "
                             f"(e.g. NAME:double:0.01:0.1:0.01)")
    return names


def _check_trial_counts(max_trials, parallel_trials, max_failed_trials):
    """Katib's trial counts: the trials and the parallel ones at least 1, the failures it
    tolerates at least 0."""
    _positive(max_trials, "max_trials")
    _positive(parallel_trials, "parallel_trials")
    if isinstance(max_failed_trials, bool) or not isinstance(max_failed_trials, int) \
            or max_failed_trials < 0:
        raise ValueError(f"max_failed_trials must be an integer >= 0, got {max_failed_trials!r}")


def _metrics_source(collector, metrics_format, metrics_file):
    """The metrics collector's ``source``: the filter, and for the File collector its file,
    an absolute path in the launcher pod (where the collector reads it)."""
    source = {"filter": {"metricsFormat": [metrics_format]}}
    if collector == "File":
        if not str(metrics_file).startswith("/"):
            raise ValueError(f"metrics file must be an absolute path, got {metrics_file!r}")
        source["fileSystemPath"] = {"path": metrics_file, "kind": "File", "format": "TEXT"}
    elif collector != "StdOut":
        raise ValueError(f"metrics collector must be StdOut or File, got {collector!r}")
    return source


def _trial_template(trial_job, names):
    """The trial template: ``trial_job`` (without its metadata: Katib names each trial's
    job), the searched parameters, and how Katib finds the MPIJob's output and its end."""
    return {
        # the launcher runs mpirun, whose output holds every rank's: the collector
        # watches it (the operator labels its pod with the job role)
        "primaryContainerName": "mpi-launcher",
        "primaryPodLabels": {"training.kubeflow.org/job-role": "launcher"},
        "successCondition": 'status.conditions.#(type=="Succeeded")#|#(status=="True")#',
        "failureCondition": 'status.conditions.#(type=="Failed")#|#(status=="True")#',
        "trialParameters": [{"name": n, "reference": n,
                             "description": f"hyperparameter {n}"} for n in names],
        "trialSpec": {k: v for k, v in trial_job.items() if k != "metadata"},
    }


def _objective(metric, kind, goal, additional_metrics):
    """The Experiment's ``objective``; a ValueError for a bad argument."""
    if kind not in ("maximize", "minimize"):
        raise ValueError(f"objective type must be maximize or minimize, got {kind!r}")
    if not metric or not isinstance(metric, str):
        raise ValueError(f"objective metric must be a name, got {metric!r}")
    objective = {"type": kind, "objectiveMetricName": metric}
    if goal is not None:
        if isinstance(goal, bool) or not isinstance(goal, (int, float)) \
                or not math.isfinite(goal):
            raise ValueError(f"goal must be a finite number, got {goal!r}")
        objective["goal"] = float(goal)
    if additional_metrics:
        objective["additionalMetricNames"] = [str(m) for m in additional_metrics]
    return objective




def add_katib(kinds):
    k = kinds.add_parser(
        "katib", help="print a Katib Experiment (kubeflow.org/v1beta1) whose trials are "
                      "MPIJobs",
        description="Print a Katib Experiment that searches hyperparameters with trials that "
                    "are the MPIJob 'hora k8s mpijob' prints.  Each --param becomes a trial "
                    "parameter: where COMMAND does not hold ${trialParameters.NAME} itself, "
                    "'--NAME ${trialParameters.NAME}' is appended to it.  Rank 0 prints the "
                    "metrics as name=value (e.g. 'accuracy=0.91'); the StdOut collector reads "
                    "them from the launcher, where mpirun brings every rank's output.  Katib "
                    "must list MPIJob.v2beta1.kubeflow.org in its trialResources "
                    "(katib-config).")
    _job_arguments(k, name="hora-tune")
    k.add_argument("--objective-metric", required=True, metavar="NAME",
                   help="the metric to optimise (printed NAME=VALUE by rank 0)")
    k.add_argument("--objective-type", required=True, choices=("maximize", "minimize"))
    k.add_argument("--goal", type=float, help="stop when a trial reaches this value")
    k.add_argument("--additional-metric", action="append", default=[], metavar="NAME",
                   help="another metric to record (repeatable)")
    k.add_argument("--param", action="append", required=True, metavar="NAME:TYPE:RANGE",
                   help="a hyperparameter: lr:double:0.001:0.1, batch:int:16:128[:STEP], "
                        "opt:categorical:sgd,adam, layers:discrete:2,4,8 (repeatable)")
    k.add_argument("--algorithm", default="random", choices=KATIB_ALGORITHMS,
                   help="the search algorithm (default random)")
    k.add_argument("--max-trials", type=int, default=12, help="maxTrialCount (default 12)")
    k.add_argument("--parallel-trials", type=int, default=3,
                   help="parallelTrialCount (default 3)")
    k.add_argument("--max-failed-trials", type=int, default=3,
                   help="maxFailedTrialCount (default 3)")
    k.add_argument("--metrics-collector", default="StdOut", choices=("StdOut", "File"),
                   help="StdOut: the launcher's output (default); File: --metrics-file in "
                        "the launcher pod")
    k.add_argument("--metrics-file", default=KATIB_METRICS_FILE, metavar="PATH",
                   help=f"with --metrics-collector File (default {KATIB_METRICS_FILE})")
    k.add_argument("--metrics-format", default=KATIB_METRICS_FORMAT, metavar="REGEX",
                   help="regular expression with two groups, name and value (default "
                        "Katib's: name=value)")
    k.add_argument("command", nargs="...", help="-- the program and its arguments")
    k.set_defaults(handler=lambda args: _katib(args, k))


def _katib(args, parser):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        _check_experiment_name(args.name)       # also the trials' MPIJob name
        params = [parse_param(p) for p in args.param]
        trial = mpijob_manifest(
            trial_command(command, params), args.image, args.np, args.slots_per_worker,
            name=args.name, env=_env_pairs(args.env),
            mpirun_args=shlex.split(args.mpirun_args),
            ssh_auth_mount_path=args.ssh_auth_mount_path,
            worker_resources=_gpu_limits(args.gpus_per_worker))
        manifest = katib_experiment(
            trial, args.objective_metric, args.objective_type, params, goal=args.goal,
            additional_metrics=args.additional_metric, algorithm=args.algorithm,
            max_trials=args.max_trials, parallel_trials=args.parallel_trials,
            max_failed_trials=args.max_failed_trials,
            metrics_collector=args.metrics_collector, metrics_format=args.metrics_format,
            metrics_file=args.metrics_file, name=args.name, namespace=args.namespace)
    except (ValueError, re.error) as e:
        parser.error(str(e))
    return _emit(render(manifest))
