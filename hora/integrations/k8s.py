"""Kubernetes: a Kubeflow MPI Operator ``MPIJob`` (kubeflow.org/v2beta1) for a hora script.

    hora k8s mpijob --image IMG -np 8 --slots-per-worker 4 -- python train.py | kubectl apply -f -

The operator runs one launcher pod and ``ceil(np / slots_per_worker)`` worker pods, mounts a
hostfile listing the workers with ``slots=slotsPerWorker`` at ``/etc/mpi/hostfile`` (and
points Open MPI at it), and shares an SSH key between them.  The launcher runs ``mpirun``,
which starts the ranks on the workers over SSH; there ``hora.init()`` finds its rank in
Open MPI's environment, as under any mpirun.  So the manifest only has to say: which image,
how many workers with how many slots, and the ``mpirun`` command line (Horovod's flags).

Elastic (``--elastic``, Horovod's elastic training on the operator): the launcher runs
``hora run -np N --min-np A --max-np B --host-discovery-script /etc/mpi/discover_hosts.sh``
instead of ``mpirun``, and ``hora run`` starts and restarts the ranks itself over SSH on the
hosts the script prints.  The operator (kubeflow.org/v2beta1) writes that script into the
launcher's ``/etc/mpi`` and rewrites it as worker pods come and go: one ``echo`` per
*running* worker pod, its host name without slots, so ``--slots`` gives every host
``slotsPerWorker`` slots.  The job asks for ``ceil(max_np / slots_per_worker)`` workers;
the ones that run decide the size.  :func:`discover_hosts_script` is a stand-in for an
operator that writes no such script: it reads the operator's hostfile.

Both pod templates carry ``sidecar.istio.io/inject: "false"`` (Kubeflow's Istio would break
the launcher's SSH and keep finished pods up), and the replica specs the operator's restart
policies (launcher ``OnFailure``, workers ``Never``).

Katib (``hora k8s katib``): :mod:`hora.integrations.katib`, an ``Experiment`` whose trial
template is that MPIJob; it builds on this module, which does not import it.

The manifest is printed as block YAML (what people paste and edit), written here, so that
the command's output is the same whether or not PyYAML is installed.

Layer: integrations.  Imports nothing from hora.
"""
import math
import os
import re
import shlex
import signal
import sys

__all__ = ["API_VERSION", "DISCOVER_HOSTS", "HOSTFILE", "POD_ANNOTATIONS", "mpirun_command",
           "mpijob_manifest",
           "hora_run_command", "elastic_mpijob_manifest", "discover_hosts_script", "render",
           "to_yaml", "add_command"]

API_VERSION = "kubeflow.org/v2beta1"
# what the operator mounts in the launcher (from the job's ConfigMap, at /etc/mpi)
DISCOVER_HOSTS = "/etc/mpi/discover_hosts.sh"
HOSTFILE = "/etc/mpi/hostfile"
# On Kubeflow clusters (Istio in every user namespace) an injected Envoy sidecar takes the
# pod's traffic: it breaks the launcher's SSH to the workers and keeps a finished pod running.
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}

# A DNS-1123 label: the operator derives pod and service names from the job name.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX = 63
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _positive(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def mpirun_command(command, np, env=None, mpirun_args=()):
    """The launcher's ``mpirun`` argv for ``command`` on ``np`` ranks, with Horovod's flags.

    ``--bind-to none`` leaves thread placement to the framework (hora's engine thread and
    the user's compute threads), ``--map-by slot`` fills each worker's slots in turn (so
    consecutive ranks share a host, as ``hora run`` places them), ``--mca pml ob1 --mca btl
    ^openib`` keeps Open MPI's own traffic off InfiniBand verbs, and ``-x`` exports the
    variables ranks need.  ``--allow-run-as-root`` because the operator's default SSH setup
    is root's.

    Args:
        command: the program and its arguments (``["python", "train.py"]``).
        np: number of ranks.
        env: extra ``{NAME: value}`` every rank gets (``-x NAME=value``); for example
            ``NCCL_DEBUG=INFO``, which Horovod's recipe sets and hora's data plane ignores.
        mpirun_args: more ``mpirun`` arguments, placed before the command.
    """
    if not command:
        raise ValueError("no command given (e.g. -- python train.py)")
    _positive(np, "np")
    # Horovod's recipe spells these -bind-to/-map-by; Open MPI 5 takes only the two-dash
    # forms, which Open MPI 4 accepts as well
    argv = ["mpirun", "-np", str(np), "--allow-run-as-root", "--bind-to", "none",
            "--map-by", "slot", "-x", "LD_LIBRARY_PATH", "-x", "PATH",
            "-x", "PYTHONUNBUFFERED=1", "--mca", "pml", "ob1", "--mca", "btl", "^openib"]
    for name, value in (env or {}).items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"environment variable name {name!r} is not valid")
        argv += ["-x", f"{name}={value}"]
    return argv + [str(a) for a in mpirun_args] + [str(c) for c in command]


def mpijob_manifest(command, image, np, slots_per_worker=1, name="hora-job", namespace=None,
                    env=None, mpirun_args=(), ssh_auth_mount_path="/root/.ssh",
                    worker_resources=None, image_pull_policy=None):
    """An MPIJob manifest (a dict) that runs ``command`` on ``np`` ranks.

    Args:
        command: the training program and its arguments.
        image: the container image of launcher and workers (hora, Open MPI and sshd in it).
        np: number of ranks.
        slots_per_worker: ranks per worker pod; ``ceil(np / slots_per_worker)`` workers.
        name: the MPIJob's name (a DNS-1123 label).
        namespace: its namespace, or None for kubectl's current one.
        env: extra variables for every rank (see :func:`mpirun_command`).
        mpirun_args: more ``mpirun`` arguments.
        ssh_auth_mount_path: where the operator mounts the SSH key (the image's user's
            ``~/.ssh``).
        worker_resources: a Kubernetes ``resources`` dict for each worker container, e.g.
            ``{"limits": {"nvidia.com/gpu": 4}}``.
        image_pull_policy: ``Always``, ``IfNotPresent``, ``Never`` or None.

    Raises:
        ValueError: naming the bad argument and quoting its value.
    """
    _check_job(image, name)
    _positive(np, "np")
    _positive(slots_per_worker, "slots_per_worker")
    argv = mpirun_command(command, np, env, mpirun_args)
    return _manifest(argv, {}, math.ceil(np / slots_per_worker), slots_per_worker, image,
                     name, namespace, ssh_auth_mount_path, worker_resources, image_pull_policy)


def _check_job(image, name):
    if not isinstance(image, str) or not image.strip():
        raise ValueError(f"image must be a container image name, got {image!r}")
    if not isinstance(name, str) or len(name) > _NAME_MAX or not _NAME.match(name):
        raise ValueError(f"name {name!r} is not a DNS-1123 label (lower-case letters, digits "
                         f"and '-', starting and ending alphanumeric, at most {_NAME_MAX})")


def _manifest(launcher_argv, run_policy, workers, slots_per_worker, image, name, namespace,
              ssh_auth_mount_path, worker_resources, image_pull_policy, launcher_env=None):
    """The MPIJob whose launcher runs ``launcher_argv`` and whose ``workers`` pods run sshd."""
    def container(role, **fields):
        c = {"name": f"mpi-{role}", "image": image, **fields}
        if image_pull_policy is not None:
            c["imagePullPolicy"] = image_pull_policy
        return c

    launcher = container("launcher", command=launcher_argv[:1], args=launcher_argv[1:])
    if launcher_env:
        launcher["env"] = [{"name": k, "value": v} for k, v in launcher_env.items()]
    worker = container("worker", command=["/usr/sbin/sshd"], args=["-De"])
    if worker_resources:
        worker["resources"] = worker_resources
    metadata = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace

    def replica(replicas, restart_policy, c):
        # the restart policy belongs to the replica spec: the operator overrides (and warns
        # about) one set in the pod template
        return {"replicas": replicas, "restartPolicy": restart_policy,
                "template": {"metadata": {"annotations": dict(POD_ANNOTATIONS)},
                             "spec": {"containers": [c]}}}
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": metadata,
        "spec": {
            "slotsPerWorker": slots_per_worker,
            "runPolicy": {"cleanPodPolicy": "Running", **run_policy},
            "sshAuthMountPath": ssh_auth_mount_path,
            "mpiImplementation": "OpenMPI",
            "mpiReplicaSpecs": {
                # the operator's defaults, written out: a launcher that fails before mpirun
                # runs (workers' sshd not up yet) is restarted; a worker is never restarted
                # under a running mpirun, which cannot take it back
                "Launcher": replica(1, "OnFailure", launcher),
                "Worker": replica(workers, "Never", worker),
            },
        },
    }


def _elastic_sizes(np, min_np, max_np):
    """``(min_np, max_np)`` with their defaults (``np``), checked: ``min <= np <= max``."""
    _positive(np, "np")
    min_np = np if min_np is None else _positive(min_np, "min_np")
    max_np = np if max_np is None else _positive(max_np, "max_np")
    if min_np > np:
        raise ValueError(f"min_np {min_np} is more than np {np} (need min_np <= np <= max_np)")
    if np > max_np:
        raise ValueError(f"np {np} is more than max_np {max_np} (need min_np <= np <= max_np)")
    return min_np, max_np


def hora_run_command(command, np, min_np=None, max_np=None, slots=1,
                     discovery_script=DISCOVER_HOSTS, run_args=()):
    """The elastic launcher's argv: ``hora run`` on the hosts ``discovery_script`` prints.

    Args:
        command: the program and its arguments.
        np: ranks to start with; ``min_np`` and ``max_np`` (default ``np`` each) bound
            the job as hosts come and go (``min_np <= np <= max_np``).
        slots: ranks per host that the script lists without ``:slots`` (the operator's
            lists none).
        discovery_script: the executable that prints the available hosts.
        run_args: more ``hora run`` arguments (``--elastic-timeout``, ``--reset-limit``,
            ...), placed before the command.
    """
    if not command:
        raise ValueError("no command given (e.g. -- python train.py)")
    min_np, max_np = _elastic_sizes(np, min_np, max_np)
    _positive(slots, "slots")
    if not isinstance(discovery_script, str) or not discovery_script.strip():
        raise ValueError(f"discovery_script must be a path, got {discovery_script!r}")
    argv = ["hora", "run", "-np", str(np), "--min-np", str(min_np), "--max-np", str(max_np),
            "--host-discovery-script", discovery_script, "--slots", str(slots)]
    return argv + [str(a) for a in run_args] + [str(c) for c in command]


def elastic_mpijob_manifest(command, image, np, min_np=None, max_np=None, slots_per_worker=1,
                            name="hora-job", namespace=None, env=None, run_args=(),
                            discovery_script=DISCOVER_HOSTS, ssh_auth_mount_path="/root/.ssh",
                            worker_resources=None, image_pull_policy=None):
    """An MPIJob manifest (a dict) for elastic training: ``np`` ranks to start with, between
    ``min_np`` and ``max_np`` as worker pods come and go.

    The launcher runs :func:`hora_run_command`; the job asks for ``ceil(max_np /
    slots_per_worker)`` worker pods (sshd, as in :func:`mpijob_manifest`) and, for gang
    schedulers, a minimum of the launcher and ``ceil(min_np / slots_per_worker)`` workers
    (``runPolicy.schedulingPolicy.minAvailable``).  ``env`` becomes the launcher's
    environment, which ``hora run`` hands to every rank.  The other arguments are those of
    :func:`mpijob_manifest`.

    Raises:
        ValueError: naming the bad argument and quoting its value.
    """
    _check_job(image, name)
    min_np, max_np = _elastic_sizes(np, min_np, max_np)
    _positive(slots_per_worker, "slots_per_worker")
    launcher_env = {"PYTHONUNBUFFERED": "1"}
    for var, value in (env or {}).items():
        if not _ENV_NAME.match(var):
            raise ValueError(f"environment variable name {var!r} is not valid")
        launcher_env[var] = str(value)
    argv = hora_run_command(command, np, min_np, max_np, slots_per_worker, discovery_script,
                            run_args)
    policy = {"schedulingPolicy": {"minAvailable": 1 + math.ceil(min_np / slots_per_worker)}}
    return _manifest(argv, policy, math.ceil(max_np / slots_per_worker), slots_per_worker,
                     image, name, namespace, ssh_auth_mount_path, worker_resources,
                     image_pull_policy, launcher_env)


# -- Katib: a hyperparameter search whose trials are hora MPIJobs ----------------------------
_DISCOVER_TEMPLATE = """\
#!/bin/sh
# Elastic hora's host discovery for a Kubeflow MPIJob (written by `hora k8s discover-hosts`).
# Prints one available worker pod a line as host:slots.  The MPI Operator's hostfile lists
# every worker replica ("host slots=N" for Open MPI, "host:N" for Intel MPI and MPICH); of
# those, the pods that run are the ones whose name resolves: the job's headless Service
# publishes only ready pods.  Without getent every listed host is printed.
hostfile=%(hostfile)s
slots=%(slots)d
if [ ! -r "$hostfile" ]; then
    echo "discover_hosts: cannot read $hostfile" >&2
    exit 1
fi
check=
if command -v getent >/dev/null 2>&1; then check=1; fi
while read -r host rest || [ -n "$host" ]; do
    case $host in ''|'#'*) continue ;; esac
    n=$slots
    case $host in *:*) n=${host##*:}; host=${host%%:*} ;; esac
    for word in $rest; do
        case $word in slots=*) n=${word#slots=} ;; esac
    done
    if [ -z "$check" ] || getent hosts "$host" >/dev/null 2>&1; then
        echo "$host:$n"
    fi
done < "$hostfile"
"""


def discover_hosts_script(hostfile=HOSTFILE, slots_per_worker=1):
    """A POSIX ``sh`` host-discovery script that prints the job's running worker pods as
    ``host:slots`` lines, read from the MPI Operator's ``hostfile`` (see the script's
    comment); ``slots_per_worker`` for the lines that give no slots.
    """
    if not isinstance(hostfile, str) or not hostfile.strip():
        raise ValueError(f"hostfile must be a path, got {hostfile!r}")
    _positive(slots_per_worker, "slots_per_worker")
    return _DISCOVER_TEMPLATE % {"hostfile": shlex.quote(hostfile), "slots": slots_per_worker}


def render(manifest):
    """The manifest as block YAML (see :func:`to_yaml`)."""
    return to_yaml(manifest)


# -- a YAML emitter for what manifests are made of -------------------------------------------
# A string is written plain only when every YAML reader takes it back as that same string:
# it starts with a letter, "_" or "/" (or dashes and a letter, as mpirun's flags do), holds
# only letters, digits and "_./=+-", and is not one of the words YAML 1.1 readers (PyYAML,
# and Kubernetes' go-yaml) turn into booleans or null.  Anything else is double-quoted.
_PLAIN = re.compile(r"(?:[A-Za-z_/]|-+[A-Za-z])[A-Za-z0-9_./=+-]*")      # whole text: fullmatch
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "~"}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\0": "\\0"}


def _printable(ch):
    """Whether YAML lets ``ch`` stand for itself inside a double-quoted scalar (line breaks,
    U+0085 and U+2028/9 included, are escaped: a reader would fold them)."""
    o = ord(ch)
    return (0x20 <= o <= 0x7E or 0xA0 <= o <= 0xD7FF and o not in (0x2028, 0x2029)
            or (0xE000 <= o <= 0xFFFD and o != 0xFEFF) or 0x10000 <= o <= 0x10FFFF)


def _quoted(text):
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif _printable(ch):
            out.append(ch)
        elif ord(ch) <= 0xFF:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _scalar(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return ".nan"
        if value in (float("inf"), float("-inf")):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return _quoted(value)
    if isinstance(value, dict):
        return "{}"                     # only empty ones get here
    if isinstance(value, (list, tuple)):
        return "[]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as YAML")


def _nested(value):
    return isinstance(value, (dict, list, tuple)) and len(value) > 0


def _lines(value, indent):
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"YAML mapping keys here must be strings, got {key!r}")
            if _nested(item):
                lines.append(f"{pad}{_scalar(key)}:")
                lines += _lines(item, indent + 2)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_scalar(item)}")
        return lines
    if isinstance(value, (list, tuple)) and value:
        lines = []
        for item in value:
            if _nested(item):
                inner = _lines(item, indent + 2)
                # "- " takes the place of the item's indentation on its first line
                lines.append(f"{pad}- {inner[0][indent + 2:]}")
                lines += inner[1:]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
        return lines
    return [pad + _scalar(value)]


def to_yaml(value):
    """``value`` (dicts with string keys, lists, strings, numbers, booleans, None) as block
    YAML that any YAML 1.1 or 1.2 reader loads back equal to ``value``.

    Raises:
        TypeError: ``value`` holds anything else.
    """
    return "\n".join(_lines(value, 0)) + "\n"


def _env_pairs(items):
    env = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    return env


def _job_arguments(p, name="hora-job"):
    """The MPIJob's arguments, shared by ``hora k8s mpijob`` and ``hora k8s katib``."""
    p.add_argument("--image", required=True, help="container image of launcher and workers")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
                   help="number of ranks (with --elastic: ranks to start with)")
    p.add_argument("--slots-per-worker", type=int, default=1, metavar="S",
                   help="ranks per worker pod (default 1)")
    p.add_argument("--name", default=name,
                   help="the MPIJob's name (katib: the Experiment's; default %(default)s)")
    p.add_argument("--namespace", help="the MPIJob's namespace")
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="a variable every rank gets (repeatable)")
    p.add_argument("--mpirun-args", default="", metavar="ARGS",
                   help="more mpirun arguments, one shell-quoted string")
    p.add_argument("--ssh-auth-mount-path", default="/root/.ssh", metavar="PATH",
                   help="where the operator mounts the SSH key (default /root/.ssh)")
    p.add_argument("--gpus-per-worker", type=int, default=0, metavar="G",
                   help="nvidia.com/gpu limit of each worker (default none)")


def add_command(subparsers, more_kinds=()):
    """Register ``hora k8s mpijob`` and ``hora k8s discover-hosts`` on the ``hora`` command
    line, and the kinds of ``more_kinds``: callables ``add(kinds)`` that each add one
    (``hora k8s katib``: :func:`hora.integrations.katib.add_katib`, which builds on this
    module and so is handed in, not imported)."""
    k8s = subparsers.add_parser("k8s", help="Kubernetes manifests for hora jobs")
    kinds = k8s.add_subparsers(dest="k8s_kind", metavar="KIND", required=True)
    p = kinds.add_parser(
        "mpijob", help="print a Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1)",
        description="Print an MPIJob manifest that runs COMMAND on N ranks under mpirun "
                    "as YAML; apply it with kubectl apply -f -.  With --elastic the "
                    "launcher runs hora run's elastic mode instead (see --elastic).")
    _job_arguments(p)
    e = p.add_argument_group(
        "elastic training",
        "--elastic: the launcher runs 'hora run -np N --min-np A --max-np B "
        f"--host-discovery-script {DISCOVER_HOSTS} --slots S COMMAND', which starts the "
        "ranks over SSH on the running worker pods and resizes the job as pods come and go "
        "(Horovod's elastic mode; the training script uses hvd.elastic.run).  The job asks "
        "for ceil(max-np / S) worker pods.  The MPI Operator (kubeflow.org/v2beta1) writes "
        f"{DISCOVER_HOSTS} in the launcher, listing its running worker pods without slots, "
        "hence --slots S; for an operator that does not, see 'hora k8s discover-hosts'.")
    e.add_argument("--elastic", action="store_true",
                   help="an elastic job run by 'hora run' instead of mpirun")
    e.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="A",
                   help="fewest ranks the job goes on with (default N)")
    e.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="B",
                   help="most ranks the job grows to (default N)")
    e.add_argument("--host-discovery-script", dest="discovery_script", default=None,
                   metavar="PATH", help=f"the launcher's discovery script (default "
                                        f"{DISCOVER_HOSTS}, the operator's)")
    e.add_argument("--hora-run-args", default="", metavar="ARGS",
                   help="more 'hora run' arguments (e.g. '--elastic-timeout 600 "
                        "--reset-limit 3'), one shell-quoted string")
    p.add_argument("command", nargs="...", help="-- the program and its arguments")
    p.set_defaults(handler=lambda args: _mpijob(args, p))
    for add in more_kinds:
        add(kinds)
    d = kinds.add_parser(
        "discover-hosts", help="print a host-discovery script for an elastic MPIJob",
        description="Print a POSIX sh script that lists an MPIJob's running worker pods as "
                    "host:slots lines, for 'hora run --host-discovery-script' in the "
                    "launcher, where the MPI Operator does not write "
                    f"{DISCOVER_HOSTS} itself.  The script reads the hostfile the operator "
                    f"mounts in the launcher ({HOSTFILE}: every worker replica, as 'host "
                    "slots=N' or 'host:N') and keeps the hosts whose name resolves (getent "
                    "hosts): the job's headless Service publishes only ready pods.  It needs "
                    "no kubectl and no access to the Kubernetes API.  Put it in the image or "
                    "mount it from a ConfigMap (mode 0555), and pass its path to 'hora k8s "
                    "mpijob --elastic --host-discovery-script PATH'.")
    d.add_argument("--hostfile", default=HOSTFILE, metavar="PATH",
                   help=f"the operator's hostfile (default {HOSTFILE})")
    d.add_argument("--slots-per-worker", type=int, default=1, metavar="S",
                   help="slots of a host the hostfile gives none (default 1)")
    d.set_defaults(handler=lambda args: _discover_hosts(args, d))


def _gpu_limits(gpus):
    return {"limits": {"nvidia.com/gpu": _positive(gpus, "--gpus-per-worker")}} if gpus else None


def _mpijob(args, parser):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    elastic_only = [flag for flag, value in (
        ("--min-np", args.min_np), ("--max-np", args.max_np),
        ("--host-discovery-script", args.discovery_script),
        ("--hora-run-args", args.hora_run_args)) if value not in (None, "")]
    if not args.elastic and elastic_only:
        parser.error(f"{', '.join(elastic_only)}: only with --elastic")
    if args.elastic and args.mpirun_args:
        parser.error("--mpirun-args: an elastic job runs 'hora run', not mpirun "
                     "(use --hora-run-args)")
    try:
        resources = _gpu_limits(args.gpus_per_worker)
        if args.elastic:
            manifest = elastic_mpijob_manifest(
                command, args.image, args.np, args.min_np, args.max_np, args.slots_per_worker,
                name=args.name, namespace=args.namespace, env=_env_pairs(args.env),
                run_args=shlex.split(args.hora_run_args),
                discovery_script=args.discovery_script or DISCOVER_HOSTS,
                ssh_auth_mount_path=args.ssh_auth_mount_path, worker_resources=resources)
        else:
            manifest = mpijob_manifest(
                command, args.image, args.np, args.slots_per_worker, name=args.name,
                namespace=args.namespace, env=_env_pairs(args.env),
                mpirun_args=shlex.split(args.mpirun_args),
                ssh_auth_mount_path=args.ssh_auth_mount_path, worker_resources=resources)
    except ValueError as e:
        parser.error(str(e))
    return _emit(render(manifest))


def _discover_hosts(args, parser):
    try:
        script = discover_hosts_script(args.hostfile, args.slots_per_worker)
    except ValueError as e:
        parser.error(str(e))
    return _emit(script)


def _emit(text):
    """Write ``text`` to stdout; the exit status.  A reader that stops early (``| head``)
    ends the command quietly, with the status of a Unix tool killed by SIGPIPE."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # what is still buffered would fail again when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return 0

