"""Local Sphinx extension of the contrastive_losses docs.

* **API pages.** At ``builder-inited`` it writes one page per module of ``API_MODULES``
  (conf.py) into ``api/generated/`` plus the toctree that ``api/index.rst`` includes. A
  module in ``PENDING_MODULES`` that does not exist yet is left out; any other module that
  is absent or fails to import stops the build, and so does a public module under
  ``src/contrastive_losses/`` that ``API_MODULES`` forgot. Every name in a module's
  ``__all__`` is documented exactly once: at the top level when ``contrastive_losses``
  exports it (that is what users import), else on the page of the module that defines it
  (``info_nce`` on ``infonce``'s page, beside ``InfoNCELoss``'s method), else (defined in
  a private module) on the first page that lists it. A face that re-exports names
  (``functional``, ``losses``) lists them with links.
* **Aliases.** A cross-reference to ``contrastive_losses.<module>.<Name>`` resolves to
  where the object is documented: ``contrastive_losses.<Name>``, or the page of the
  module that defines it (``contrastive_losses.functional.kcl`` ->
  ``contrastive_losses.kcl.kcl``).
* **``.. benchmark-results:: NAME``** renders ``benchmarks/results/NAME.json`` (its
  markdown tables), ``NAME.md`` and ``NAME*.png`` (captioned, with alt text, from the
  JSON's ``figures``: ``{file name: {"caption": ..., "alt": ...}}``, else by file name);
  ``*`` renders every result that no earlier directive on the page claimed. Absent
  results give a short note, not an error.
* **Example README.** The line ``<!-- examples/README.md -->`` in a Markdown page is
  replaced by the text of ``examples/README.md`` (headings one level down, image paths
  fixed, links to repository files made plain) when that file exists, else by a note.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import types
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

PACKAGE = "contrastive_losses"
GENERATED = Path("api") / "generated"


# ----------------------------------------------------------------------------- API pages


def _title(text: str, char: str) -> list[str]:
    return [text, char * len(text), ""]


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        raise ExtensionError(f"{module.__name__} has no __all__: say which names are public")
    return list(names)


def _check_listed(api_modules: list[str]) -> None:
    package = importlib.import_module(PACKAGE)
    found = {
        f"{PACKAGE}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_")
    }
    unlisted = sorted(found - set(api_modules))
    if unlisted:
        raise ExtensionError(
            f"public module(s) {unlisted} are not in API_MODULES in docs/conf.py: add them "
            "(or rename them with a leading underscore if they are private)"
        )


def _available(api_modules: list[str], pending: set[str]) -> list[types.ModuleType]:
    unknown = sorted(pending - set(api_modules))
    if unknown:
        raise ExtensionError(f"PENDING_MODULES lists {unknown}, which API_MODULES does not")
    out = []
    for name in api_modules:
        if importlib.util.find_spec(name) is None:
            if name in pending:
                logger.info(f"[cl_docs] {name} is pending and absent: not documented yet")
                continue
            raise ExtensionError(f"{name} (API_MODULES in docs/conf.py) does not exist")
        if name in pending:
            logger.info(
                f"[cl_docs] {name} exists: documented. Remove it from PENDING_MODULES "
                "in docs/conf.py"
            )
        out.append(importlib.import_module(name))  # import errors stop the build
    return out


def _top_level_objects() -> dict[int, str]:
    """``id(obj) -> name`` of every non-module object the package exports."""
    package = importlib.import_module(PACKAGE)
    return {
        id(getattr(package, name)): name
        for name in _public_names(package)
        if not isinstance(getattr(package, name), types.ModuleType)
    }


def _member_directive(obj: Any, qualified: str) -> list[str]:
    if inspect.isclass(obj):
        return [f".. autoclass:: {qualified}", "   :members:", "   :undoc-members:", ""]
    if callable(obj):
        return [f".. autofunction:: {qualified}", ""]
    return [f".. autodata:: {qualified}", ""]


def _homes(modules: list[types.ModuleType], top: dict[int, str]) -> dict[int, str]:
    """``id(obj) -> module`` whose page documents it, for every listed non-top-level name:
    the module that defines it when that one has a page, else the first page listing it."""
    with_page = {m.__name__ for m in modules}
    homes: dict[int, str] = {}
    for module in modules:
        if module.__name__ == PACKAGE:
            continue
        for name in _public_names(module):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) or id(obj) in top:
                continue
            defined_in = getattr(obj, "__module__", None)
            if defined_in in with_page:
                homes[id(obj)] = defined_in
            else:
                homes.setdefault(id(obj), module.__name__)
    return homes


def _page(module: types.ModuleType, top: dict[int, str], homes: dict[int, str]) -> str:
    """Module docstring, a summary table of every public name, then each own member."""
    name = module.__name__
    public = _public_names(module)
    members = {n: getattr(module, n) for n in public}
    elsewhere: list[str] = []
    if name == PACKAGE:
        own = [n for n, obj in members.items() if not isinstance(obj, types.ModuleType)]
        summary = list(public)
        exported: list[str] = []
    else:
        own = [n for n, obj in members.items() if homes.get(id(obj)) == name]
        elsewhere = [
            f"{homes[id(obj)]}.{n}"
            for n, obj in members.items()
            if id(obj) not in top and homes.get(id(obj), name) != name
        ]
        exported = [top[id(obj)] for n, obj in members.items() if id(obj) in top]
        summary = own + [f"~{target}" for target in elsewhere]
        summary += [f"~{PACKAGE}.{n}" for n in exported]
    # Short titles keep the sidebar readable; the module's full name heads the page body.
    lines = _title(name if name == PACKAGE else name.rsplit(".", 1)[1], "=")
    if name != PACKAGE:
        lines += [f"``{name}``", ""]
    lines += [f".. automodule:: {name}", ""]
    if summary:
        lines += [".. rubric:: Contents", "", ".. autosummary::", "   :nosignatures:", ""]
        lines += [f"   {entry}" for entry in summary] + [""]
    if elsewhere:
        refs = ", ".join(f":obj:`~{target}`" for target in elsewhere)
        lines += [f"Documented with the module that defines them: {refs}.", ""]
    if exported:
        refs = ", ".join(f":obj:`~{PACKAGE}.{n}`" for n in exported)
        lines += [f"Documented at the top level, where you import them from: {refs}.", ""]
    for member in own:
        lines += _member_directive(members[member], f"{name}.{member}")
    return "\n".join(lines)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def generate_api_pages(app: Sphinx) -> None:
    api_modules = list(app.config.cl_api_modules)
    pending = set(app.config.cl_pending_modules)
    _check_listed(api_modules)
    modules = _available(api_modules, pending)
    top = _top_level_objects()
    out = Path(app.srcdir) / GENERATED
    out.mkdir(parents=True, exist_ok=True)
    homes = _homes(modules, top)
    wanted = {f"{m.__name__}.rst": _page(m, top, homes) for m in modules}
    for stale in out.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()
    for filename, text in wanted.items():
        _write_if_changed(out / filename, text)
    toc = [".. toctree::", "   :maxdepth: 1", ""]
    toc += [f"   generated/{m.__name__}" for m in modules]
    _write_if_changed(out / "toctree.inc", "\n".join(toc) + "\n")


def _defining_target(target: str) -> str | None:
    """``contrastive_losses.<module>.<Name>`` -> ``<defining module>.<Name>`` of the object."""
    module_name, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    defined_in = getattr(obj, "__module__", None)
    if not isinstance(defined_in, str) or defined_in == module_name:
        return None
    return f"{defined_in}.{attr}"


def resolve_alias(app: Sphinx, env: Any, node: nodes.Element, contnode: nodes.Element) -> Any:
    """Resolve ``contrastive_losses.<module>.<Name>`` (or a bare ``Name`` inside a module)
    to where the object is documented: ``contrastive_losses.<Name>``, or the page of the
    module that defines it."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    parts = target.split(".")
    if parts[0] == PACKAGE and len(parts) > 2:
        candidates = [".".join([PACKAGE, *parts[2:]]), _defining_target(target)]
    elif parts[0] != PACKAGE:
        candidates = [".".join([PACKAGE, *parts])]
    else:
        return None
    domain = env.get_domain("py")
    for candidate in candidates:
        if candidate and domain.find_obj(env, None, None, candidate, None, 0):
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], candidate, node, contnode
            )
    return None


def skip_namedtuple_fields(app: Sphinx, what: str, name: str, obj: Any, skip: bool, opts: Any):
    """NamedTuple fields say "Alias for field number 0"; the class docstring says more."""
    if type(obj).__name__ == "_tuplegetter":
        return True
    return None


# ----------------------------------------------------------------------------- benchmarks


def _markdown_table_to_rst(markdown: str, caption: str) -> list[str]:
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in markdown.strip().splitlines()
        if line.strip().startswith("|")
    ]
    rows = [r for r in rows if not all(set(c) <= set("-: ") and c for c in r)]  # separator
    if not rows:
        return []
    width = max(len(r) for r in rows)
    # A header like "search_faiss/bare" may wrap after its slash (a zero-width space),
    # else a table of many such columns cannot fit the column.
    rows[0] = [cell.replace("/", "/\u200b") for cell in rows[0]]
    out = [f".. list-table:: {caption}", "   :header-rows: 1", ""]
    for row in rows:
        row = row + [""] * (width - len(row))
        out.append(f"   * - {row[0] or ' '}")
        out += [f"     - {cell or ' '}" for cell in row[1:]]
    return [*out, ""]


def _machine(payload: dict[str, Any]) -> str:
    machine = payload.get("machine")
    if not isinstance(machine, dict):
        return ""
    return "Measured on: " + ", ".join(f"{k} ``{v}``" for k, v in machine.items()) + "."


class BenchmarkResults(SphinxDirective):
    """``.. benchmark-results:: NAME`` (or ``*`` for all results not shown yet on the page;
    ``:exclude: A B`` leaves those out of ``*``, e.g. a summary that repeats every table)."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {"exclude": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        # "studies/*" renders the results of a sub-folder (the controlled studies).
        sub, _, name = self.arguments[0].rpartition("/")
        results = Path(self.config.cl_results_dir) / sub
        docdir = Path(self.env.doc2path(self.env.docname)).parent
        claimed: set[str] = self.env.temp_data.setdefault("cl_bench_claimed", set())
        stems = sorted(
            {p.stem for p in results.glob("*.json")} | {p.stem for p in results.glob("*.md")}
        )
        if name == "*":
            excluded = set(self.options.get("exclude", "").split())
            names = [s for s in stems if f"{sub}/{s}" not in claimed and s not in excluded]
            with_titles = True
        else:
            names = [name]
            with_titles = False
        claimed.update(f"{sub}/{s}" for s in names)
        lines: list[str] = []
        for stem in names:
            lines += self._render(results, docdir, stem, stems, with_titles)
        if not lines and name == "*":
            return []
        container = nodes.container()
        nested_parse_with_titles(self.state, StringList(lines, source=str(results)), container)
        return container.children

    def _render(
        self, results: Path, docdir: Path, stem: str, stems: list[str], with_titles: bool
    ) -> list[str]:
        rel = Path(os.path.relpath(results, docdir)).as_posix()
        # A titled result gets a label to cite it by: ``:ref:`results-studies-svr```.
        label = "-".join(["results", *results.relative_to(self.config.cl_results_dir).parts, stem])
        lines = [f".. _{label}:", "", *_title(stem, "-")] if with_titles else []
        json_path, md_path = results / f"{stem}.json", results / f"{stem}.md"
        longer = [s for s in stems if s != stem and s.startswith(stem)]
        pngs = sorted(
            p for p in results.glob(f"{stem}*.png") if not any(p.stem.startswith(s) for s in longer)
        )
        if not (json_path.exists() or md_path.exists() or pngs):
            return [
                *lines,
                ".. note::",
                "",
                f"   Not run in this checkout: ``benchmarks/results/{stem}.json`` is absent.",
                "",
            ]
        payload: dict[str, Any] = {}
        if json_path.exists():
            self.env.note_dependency(str(json_path))
            payload = json.loads(json_path.read_text(encoding="utf-8"))
            tables = {
                key: value
                for key, value in payload.items()
                if isinstance(value, str) and value.lstrip().startswith("|")
            }
            for key, table in tables.items():
                caption = f"{stem}.json" if len(tables) == 1 else f"{stem}.json: ``{key}``"
                lines += _markdown_table_to_rst(table, caption)
            if machine := _machine(payload):
                lines += [machine, ""]
            lines += [f"Raw numbers: :download:`{stem}.json <{rel}/{stem}.json>`.", ""]
        if md_path.exists():
            self.env.note_dependency(str(md_path))
            lines += [f".. include:: {rel}/{stem}.md", "   :parser: myst_parser.sphinx_", ""]
        figures = payload.get("figures", {})
        order = list(figures)  # the study's own order first (its main figure), then by name
        pngs.sort(key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name))
        for png in pngs:
            lines += _figure(f"{rel}/{png.name}", figures.get(png.name) or {})
        return lines


def _figure(path: str, meta: dict[str, str]) -> list[str]:
    """A results PNG with the caption and alt text its JSON's ``figures`` gives (else its
    file name): a study says what each figure shows where it draws it."""
    name = path.rsplit("/", 1)[-1]
    caption = meta.get("caption", name)
    alt = meta.get("alt", caption)
    return [f".. figure:: {path}", "   :width: 100%", f"   :alt: {alt}", "", f"   {caption}", ""]


# ----------------------------------------------------------------------------- example README

README_MARKER = "<!-- examples/README.md -->"
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _inline_readme(readme: Path, docdir: Path, repository: str) -> str:
    """The README's Markdown, headings one level down and relative paths rewritten.

    Images point at the file from the docs page. Links to repository files (scripts,
    other READMEs) are not docs pages: they go to ``cl_repository_url`` when set, else
    become plain text. Fenced code is left alone.
    """
    base = readme.parent

    def link(match: re.Match[str]) -> str:
        bang, text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#", target):
            return match.group(0)
        if bang:
            path = Path(os.path.relpath((base / target).resolve(), docdir)).as_posix()
            return f"![{text}]({path})"
        if repository:
            path = Path(os.path.relpath((base / target).resolve(), readme.parents[1]))
            return f"[{text}]({repository.rstrip('/')}/{path.as_posix()})"
        return text

    out, fenced = [], False
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            line = "#" + line if re.match(r"^#{1,5} ", line) else _LINK.sub(link, line)
        out.append(line)
    return "\n".join(out)


def include_example_readme(app: Sphinx, docname: str, source: list[str]) -> None:
    if README_MARKER not in source[0]:
        return
    readme = Path(app.config.cl_examples_readme)
    docdir = Path(app.env.doc2path(docname)).parent
    if readme.exists():
        app.env.note_dependency(str(readme))
        block = _inline_readme(readme, docdir, app.config.cl_repository_url)
    else:
        block = (
            "```{note}\n`examples/README.md` is not in this checkout; the example's own "
            "README appears here once it is.\n```"
        )
    source[0] = source[0].replace(README_MARKER, block)


# ----------------------------------------------------------------------------- setup


def setup(app: Sphinx) -> dict[str, Any]:
    root = Path(app.confdir).parent
    app.add_config_value("cl_api_modules", [], "env")
    app.add_config_value("cl_pending_modules", set(), "env")
    app.add_config_value("cl_results_dir", str(root / "benchmarks" / "results"), "env")
    app.add_config_value("cl_examples_readme", str(root / "examples" / "README.md"), "env")
    # e.g. "https://github.com/OWNER/REPO/blob/main": where README links to repo files go.
    app.add_config_value("cl_repository_url", "", "env")
    app.connect("builder-inited", generate_api_pages)
    app.connect("missing-reference", resolve_alias)
    app.connect("autodoc-skip-member", skip_namedtuple_fields)
    app.connect("source-read", include_example_readme)
    app.add_directive("benchmark-results", BenchmarkResults)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


__all__ = ["setup"]
