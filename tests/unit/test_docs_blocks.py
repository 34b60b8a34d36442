"""Every shell command and Python block in README.md and docs/ runs, or is checked another way.

A block is fenced with ``bash``, ``sh``, ``shell``, ``console``, ``python`` or ``py``; the line
before it says how it is checked, in a comment the rendered page does not show:

- ``<!-- test: run -->``: run here, at small sizes: a shell block with bash in a scratch
  directory that holds ``examples/``, ``docs/``, ``deploy/`` and a ``train.py`` (the one of
  docs/train.py), the environment's Python first on ``PATH``; a Python block with that Python,
  or, with ``np=N``, with ``hora run -np N``. ``small="ARGS"`` appends ARGS to each command
  that runs an example (``--epochs 1``).  A block whose scripts import TensorFlow or Keras
  runs without the optional packages those would import and the scripts do not (JAX,
  pandas, matplotlib: tests/without), as on a machine with TensorFlow and the scripts' own.
- ``<!-- test: tests/FILE.py::TEST TOKEN ... -->``: an existing test runs the same thing (the
  examples, the multi-process jobs, the suite itself: not run twice); checked here: that test
  exists in that file, and the file holds every TOKEN (the example's name, the flag).
- ``<!-- test: needs WHAT; HOW -->``: needs a cluster, a cloud account, a GPU or a long quiet
  run, and is checked by HOW: ``parse`` (every ``hora`` command's arguments parsed by hora's
  own parser, the rest of the block by ``bash -n``), ``manifest`` (every ``hora k8s`` command
  run, its output validated against the MPIJob and Katib schemas in tests/data), or
  ``syntax`` (compiled, or ``bash -n``).
- ``<!-- test: shown -->``: a file included whole (``--8<-- "PATH"``) that a block of the same
  page runs, or names the test that runs it: checked here that one does.
- ``<!-- test: sketch; syntax -->``: a fragment of a script shown beside a complete one
  (compiled).

Other blocks (output, YAML, tables, diagrams) are not commands.
"""
import ast
import collections
import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMAND_LANGS = {"bash", "sh", "shell", "console", "python", "py"}
_MARKER = re.compile(r"^<!-- test: (?P<how>.*?) -->$")
_SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
Block = collections.namedtuple("Block", "path line lang how body snippet")


def doc_files():
    """README.md and every page under docs/, by path from the repository root."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks():
    """Every command block of the documentation, its marker's text in ``how`` (None without)."""
    found = []
    for path in doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)", lines[i])
            if not m:
                i += 1
                continue
            lang, start = m.group(1), i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            i += 1
            if lang not in COMMAND_LANGS:
                continue
            before = next((x for x in reversed(lines[:start]) if x.strip()), "")
            marker = _MARKER.match(before.strip())
            text = "\n".join(body) + "\n"
            snippet = _SNIPPET.match(text.strip())
            if snippet:
                text = (ROOT / snippet.group("path")).read_text(encoding="utf-8")
            found.append(Block(str(path.relative_to(ROOT)), start + 1, lang,
                               marker.group("how") if marker else None, text,
                               snippet.group("path") if snippet else None))
    return found


BLOCKS = blocks()


def kind(block):
    """``run``, ``test`` (an existing test), ``needs``, ``shown`` or ``sketch``."""
    how = block.how or ""
    if how.startswith("tests/"):
        return "test"
    return how.split(";")[0].split()[0] if how else "unmarked"


def _id(block):
    return f"{block.path}:{block.line}"


def _select(k):
    return [pytest.param(b, id=_id(b), marks=_framework_mark(b))
            for b in BLOCKS if kind(b) == k]


def _framework_mark(block):
    """A block that runs TensorFlow, Keras, JAX or MXNet belongs to the framework tier."""
    frameworks = ("tensorflow", "keras", "jax", "mxnet")
    return [pytest.mark.framework] if any(f in block.body for f in frameworks) else []


def test_every_command_block_says_how_it_is_checked():
    counts = collections.Counter(kind(b) for b in BLOCKS)
    unmarked = [_id(b) for b in BLOCKS if kind(b) not in ("run", "test", "needs", "shown", "sketch")]
    assert not unmarked, f"command blocks without a <!-- test: ... --> line: {unmarked}"
    assert counts["run"] >= 8 and counts["test"] >= 10, counts
    print(f"doc blocks: {len(BLOCKS)}; run here {counts['run']}, by an existing test "
          f"{counts['test']}, needing a cluster/cloud/long run {counts['needs']}, "
          f"files shown that another block runs {counts['shown']}, fragments "
          f"{counts['sketch']}")


@pytest.mark.parametrize("block", _select("test"))
def test_named_test_exists_and_holds_the_command(block):
    target, *tokens = block.how.split()
    file, _, name = target.partition("::")
    source = (ROOT / file).read_text(encoding="utf-8")
    tests = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    assert name in tests, f"{_id(block)}: {file} has no test {name}"
    missing = [t for t in tokens if t not in source]
    assert not missing, f"{_id(block)}: {file} does not hold {missing}"


@pytest.mark.parametrize("block", _select("shown"))
def test_shown_file_is_run_by_a_block_of_its_page(block):
    assert block.snippet, f"{_id(block)}: 'shown' is for a file included with --8<--"
    name = pathlib.Path(block.snippet).name
    runners = [b for b in BLOCKS if b.path == block.path and kind(b) in ("run", "test")
               and (name in b.body or name in b.how)]
    assert runners, f"{_id(block)}: no block of {block.path} runs {block.snippet}"


def _commands(body):
    """A shell block's commands: continuation lines joined, comments dropped, split at
    ``&&``, ``;`` and ``|``; each as argv without leading ``VAR=value`` words."""
    text = re.sub(r"\\\n", " ", body)
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        cmd = []
        for w in words + ["&&"]:
            if w in ("&&", "|", ";", "||"):
                while cmd and re.match(r"^[A-Za-z_]\w*=", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def _hora_main(argv):
    """(exit status, stdout) of ``hora argv`` run in this process."""
    from hora.__main__ import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    return status, out.getvalue()


def _parse_hora(argv):
    """Parse ``hora argv`` with hora's own parser, without running it."""
    from hora.bench import add_command as bench_command
    from hora.core.timeline import add_command as timeline_command
    from hora.integrations import commands
    from hora.runner.cli import build_parser
    parser = build_parser((bench_command, timeline_command, *commands()))
    return parser.parse_args(argv)


def _validate_manifests(text):
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    from tests.unit.test_k8s import SCHEMA_FILE, _errors, _strict
    from tests.unit.test_k8s_katib import KATIB_SCHEMA
    schemas = {"MPIJob": SCHEMA_FILE, "Experiment": KATIB_SCHEMA}
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs, "no manifest printed"
    for doc in docs:
        schema = _strict(yaml.safe_load(schemas[doc["kind"]].read_text()))
        validator = jsonschema.Draft7Validator(schema)
        assert not _errors(validator, doc), _errors(validator, doc)


@pytest.mark.parametrize("block", _select("needs") + _select("sketch"))
def test_block_needing_a_cluster_is_checked_another_way(block):
    how = block.how.split(";", 1)[1].strip()
    if block.lang in ("python", "py"):
        assert how == "syntax", f"{_id(block)}: a Python block here is checked by syntax"
        compile(block.body, _id(block), "exec")
        return
    bash = subprocess.run(["bash", "-n"], input=block.body, capture_output=True, text=True)
    assert bash.returncode == 0, f"{_id(block)}: {bash.stderr}"
    if how == "syntax":
        return
    hora = [argv[1:] for argv in _commands(block.body.replace("$REPO", "registry/img"))
            if argv[0] == "hora"]
    assert hora, f"{_id(block)}: no hora command to check"
    for argv in hora:
        if how == "parse":
            _parse_hora(argv)
        elif how == "manifest":
            status, out = _hora_main(argv)
            assert status in (0, None), f"{_id(block)}: hora {' '.join(argv)} -> {status}"
            _validate_manifests(out)
        else:
            raise AssertionError(f"{_id(block)}: unknown check {how!r}")


@pytest.fixture
def scratch(tmp_path):
    """A directory to run blocks in: the repository's examples, docs and deploy, and
    docs/train.py as train.py."""
    for name in ("examples", "docs", "deploy"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "train.py").symlink_to(ROOT / "docs" / "train.py")
    return tmp_path


def _hidden(block, scratch):
    """What a block's processes go without (tests/without): where the scripts it runs import
    TensorFlow or Keras, the optional packages those import when they find them
    (tests.helpers.TF_EXTRAS) and that no script of the block imports itself; else nothing.
    The scripts: a Python block's own body (``block.py``), a shell block's ``*.py`` files."""
    from tests.helpers import TF_EXTRAS
    from tests.tiers import imported_modules
    names = ["block.py"] if block.lang in ("python", "py") else \
        re.findall(r"[\w./-]+\.py\b", block.body)
    tops = {m.split(".")[0] for name in names if (scratch / name).is_file()
            for m in imported_modules(str((scratch / name).resolve()))}
    if not tops & {"tensorflow", "keras"}:
        return ()
    return tuple(p for p in TF_EXTRAS if p not in tops)


def _env(hidden=()):
    """The environment blocks run in; ``hidden``: packages they cannot import (tests/without)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "SM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if hidden:
        from tests.helpers import without
        env.update(without(hidden, env))
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", _select("run"))
def test_block_runs(block, scratch):
    options = dict(word.split("=", 1) for word in shlex.split(block.how[len("run"):]))
    if block.lang in ("python", "py"):
        (scratch / "block.py").write_text(block.body)
        argv = [sys.executable, "block.py"]
        if "np" in options:
            argv = [sys.executable, "-m", "hora", "run", "-np", options["np"], *argv]
    else:
        body = block.body
        if "small" in options:
            body = re.sub(r"(examples/\S+\.py)", r"\1 " + options["small"], body)
        argv = ["bash", "-e", "-o", "pipefail", "-c", body]
    run = subprocess.run(argv, cwd=scratch, env=_env(_hidden(block, scratch)),
                         capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, f"{_id(block)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
