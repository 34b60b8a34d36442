"""MkDocs hooks for the documentation site (mkdocs.yml names this file).

What a page must not copy by hand, it takes from where it lives, when the site is built:

- ``<!-- hora:settings -->``: the tables of every setting, from :data:`hora.config.DECLARED`
  (the single place the code declares them), so the Settings page cannot drift;
- ``<!-- hora:section PATH HEADING -->``: the section of the Markdown file PATH (from the
  repository root) under HEADING, up to the next heading of its level or above: the
  benchmarks' current tables stay in ``benchmarks/README.md``, next to their scripts;
- ``<!-- hora:api-hora -->``: the API reference of the top-level ``hora`` module, whose names
  load lazily (no ``__all__`` a static reader can see): its members are ``hora.core``'s.

The figures in ``benchmarks/figures/`` are added to the site as ``figures/<name>``.

Reading ``hora.config`` and ``hora.core``'s ``__all__`` needs hora and NumPy only: no
framework is imported (the API pages are read statically, by griffe).
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "benchmarks" / "figures"

_DIRECTIVE = re.compile(r"<!-- hora:(?P<what>[a-z-]+)(?P<args>[^>]*?)\s*-->")


def _cell(text):
    """``text`` safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(var):
    if var.default is None:
        return "unset"
    if var.kind is bool:
        return "1" if var.default else "0"
    if isinstance(var.default, float) and var.default == int(var.default):
        return str(int(var.default))
    return str(var.default)


def _names(var):
    names = [f"`HORA_{var.name}`", f"`HOROVOD_{var.name}`"]
    names += [f"`HOROVOD_{a}`" for a in var.aliases]
    return "<br>".join(names)


def settings_markdown():
    """The settings tables: what users set, then what a launcher writes for each worker."""
    from hora.config import DECLARED

    def table(vars_):
        rows = ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
        rows += [f"| {_names(v)} | {_cell(_default(v))} | {_cell(v.allowed())} | "
                 f"{_cell(v.doc)} |" for v in vars_]
        return "\n".join(rows)

    users = [v for v in DECLARED.values() if not v.placement]
    placed = [v for v in DECLARED.values() if v.placement]
    return (f"### What you set\n\n{table(users)}\n\n"
            "### What a launcher writes for each worker\n\n"
            "`hora run` (and Horovod's gloo launcher, under the `HOROVOD_*` names) sets these; "
            "`init()` reads them, and checks them like the others.\n\n"
            f"{table(placed)}\n")


def section_markdown(path, heading):
    """The lines of Markdown file ``path`` under ``heading`` (a whole heading line, ``#``s
    included), up to the next heading of its level or above.

    Raises:
        ValueError: the file has no such heading (a renamed section breaks the build).
    """
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    try:
        start = lines.index(heading)
    except ValueError:
        raise ValueError(f"{path} has no heading {heading!r}") from None
    out, fenced = [], False
    for line in lines[start + 1:]:
        if line.startswith("```"):
            fenced = not fenced
        m = re.match(r"(#+) ", line)
        if m and not fenced and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out).strip("\n") + "\n"


def api_hora_markdown():
    """``::: hora`` with its members named: ``hora.core``'s ``__all__`` and hora's own."""
    import hora
    import hora.core
    own = [n for n in hora._OWN if not n.startswith("__")]
    members = [*hora.core.__all__, *own]
    lines = ["::: hora", "    options:", "      members:"]
    lines += [f"        - {name}" for name in members]
    return "\n".join(lines) + "\n"


def expand(markdown):
    """``markdown`` with every ``<!-- hora:... -->`` directive replaced by what it names."""
    def one(m):
        what, args = m.group("what"), m.group("args").strip()
        if what == "settings":
            return settings_markdown()
        if what == "api-hora":
            return api_hora_markdown()
        if what == "section":
            path, heading = args.split(None, 1)
            return section_markdown(path, ast.literal_eval(heading))
        raise ValueError(f"unknown directive <!-- hora:{what} -->")
    return _DIRECTIVE.sub(one, markdown)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 - MkDocs' signature
    """Expand the ``hora:`` directives of every page."""
    return expand(markdown)


def on_files(files, config):
    """Add ``benchmarks/figures/*.png`` to the site as ``figures/<name>``."""
    from mkdocs.structure.files import File
    for png in sorted(FIGURES.glob("*.png")):
        files.append(File.generated(config, f"figures/{png.name}", abs_src_path=str(png)))
    return files
