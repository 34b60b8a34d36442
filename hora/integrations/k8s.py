"""Kubernetes: a Kubeflow MPI Operator ``MPIJob`` (kubeflow.org/v2beta1) for a hora script.

    hora k8s mpijob --image IMG -np 8 --slots-per-worker 4 -- python train.py | kubectl apply -f -

The operator runs one launcher pod and ``ceil(np / slots_per_worker)`` worker pods, mounts a
hostfile listing the workers with ``slots=slotsPerWorker`` at ``/etc/mpi/hostfile`` (and
points Open MPI at it), and shares an SSH key between them.  The launcher runs ``mpirun``,
which starts the ranks on the workers over SSH; there ``hora.init()`` finds its rank in
Open MPI's environment, as under any mpirun.  So the manifest only has to say: which image,
how many workers with how many slots, and the ``mpirun`` command line (Horovod's flags).

The manifest is printed as block YAML (what people paste and edit), written here, so that
the command's output is the same whether or not PyYAML is installed.

Layer: integrations.  Imports nothing from hora.
"""
import math
import re
import shlex

__all__ = ["API_VERSION", "mpirun_command", "mpijob_manifest", "render", "to_yaml",
           "add_command"]

API_VERSION = "kubeflow.org/v2beta1"

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
    if not isinstance(image, str) or not image.strip():
        raise ValueError(f"image must be a container image name, got {image!r}")
    if not isinstance(name, str) or len(name) > _NAME_MAX or not _NAME.match(name):
        raise ValueError(f"name {name!r} is not a DNS-1123 label (lower-case letters, digits "
                         f"and '-', starting and ending alphanumeric, at most {_NAME_MAX})")
    _positive(np, "np")
    _positive(slots_per_worker, "slots_per_worker")
    workers = math.ceil(np / slots_per_worker)

    def container(role, **fields):
        c = {"name": f"mpi-{role}", "image": image, **fields}
        if image_pull_policy is not None:
            c["imagePullPolicy"] = image_pull_policy
        return c

    launcher = container("launcher", command=["mpirun"],
                         args=mpirun_command(command, np, env, mpirun_args)[1:])
    worker = container("worker", command=["/usr/sbin/sshd"], args=["-De"])
    if worker_resources:
        worker["resources"] = worker_resources
    metadata = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": metadata,
        "spec": {
            "slotsPerWorker": slots_per_worker,
            "runPolicy": {"cleanPodPolicy": "Running"},
            "sshAuthMountPath": ssh_auth_mount_path,
            "mpiImplementation": "OpenMPI",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [launcher]}}},
                "Worker": {"replicas": workers, "template": {"spec": {"containers": [worker]}}},
            },
        },
    }


def render(manifest):
    """The manifest as block YAML (see :func:`to_yaml`)."""
    return to_yaml(manifest)


# -- a YAML emitter for what manifests are made of -------------------------------------------
# A string is written plain only when every YAML reader takes it back as that same string:
# it starts with a letter, "_" or "/" (or dashes and a letter, as mpirun's flags do), holds
# only letters, digits and "_./=+-", and is not one of the words YAML 1.1 readers (PyYAML,
# and Kubernetes' go-yaml) turn into booleans or null.  Anything else is double-quoted.
_PLAIN = re.compile(r"^(?:[A-Za-z_/]|-+[A-Za-z])[A-Za-z0-9_./=+-]*$")
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
        if _PLAIN.match(value) and value.lower() not in _RESERVED:
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


def add_command(subparsers):
    """Register ``hora k8s mpijob`` on the ``hora`` command line."""
    k8s = subparsers.add_parser("k8s", help="Kubernetes manifests for hora jobs")
    kinds = k8s.add_subparsers(dest="k8s_kind", metavar="KIND", required=True)
    p = kinds.add_parser(
        "mpijob", help="print a Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1)",
        description="Print an MPIJob manifest that runs COMMAND on N ranks under mpirun "
                    "as YAML; apply it with kubectl apply -f -.")
    p.add_argument("--image", required=True, help="container image of launcher and workers")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
                   help="number of ranks")
    p.add_argument("--slots-per-worker", type=int, default=1, metavar="S",
                   help="ranks per worker pod (default 1)")
    p.add_argument("--name", default="hora-job", help="the MPIJob's name (default hora-job)")
    p.add_argument("--namespace", help="the MPIJob's namespace")
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="a variable every rank gets (repeatable)")
    p.add_argument("--mpirun-args", default="", metavar="ARGS",
                   help="more mpirun arguments, one shell-quoted string")
    p.add_argument("--ssh-auth-mount-path", default="/root/.ssh", metavar="PATH",
                   help="where the operator mounts the SSH key (default /root/.ssh)")
    p.add_argument("--gpus-per-worker", type=int, default=0, metavar="G",
                   help="nvidia.com/gpu limit of each worker (default none)")
    p.add_argument("command", nargs="...", help="-- the program and its arguments")
    p.set_defaults(handler=lambda args: _mpijob(args, p))


def _mpijob(args, parser):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        resources = ({"limits": {"nvidia.com/gpu": _positive(args.gpus_per_worker,
                                                             "--gpus-per-worker")}}
                     if args.gpus_per_worker else None)
        manifest = mpijob_manifest(
            command, args.image, args.np, args.slots_per_worker, name=args.name,
            namespace=args.namespace, env=_env_pairs(args.env),
            mpirun_args=shlex.split(args.mpirun_args),
            ssh_auth_mount_path=args.ssh_auth_mount_path, worker_resources=resources)
    except ValueError as e:
        parser.error(str(e))
    print(render(manifest), end="")
    return 0
