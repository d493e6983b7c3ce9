r"""Docstrings read as written (issue 42 item 5).

A docstring that is not raw loses its escapes: ``:math:`1/\tau``` became "1/<TAB>au" in
``help(KCLLoss.forward)`` and the API reference (``\frac`` a form feed, ``\beta`` a
backspace, ``\nabla`` a newline). Three checks:

* static: every docstring whose source holds a backslash is a raw string, in ``src/``,
  ``benchmarks/``, ``examples/``, ``docs/`` and ``tests/`` (catches ``\n...`` too, which
  leaves no control character behind);
* at run time: no public docstring of the package holds a control character other than
  a newline (catches docstrings built at import time);
* every public class's ``__init__`` has its own docstring, so ``help(KCLLoss.__init__)``
  does not show ``nn.Module``'s "Initialize internal Module state".
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import pydoc
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import contrastive_losses
from contrastive_losses import ASKLoss, CACLLoss, InfoNCELoss, KCLLoss

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "benchmarks", "examples", "docs", "tests")
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # every C0 control but the newline


def _docstring_literals(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, source text)`` of every module, class and function docstring of ``path``."""
    source = path.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                text = ast.get_source_segment(source, first.value)
                if text is not None:
                    yield first.value.lineno, text


def test_docstrings_with_a_backslash_are_raw() -> None:
    bad = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_build" in path.parts or "generated" in path.parts:
                continue
            for line, text in _docstring_literals(path):
                prefix = text[: len(text) - len(text.lstrip("rRbBuUfF"))]
                if "\\" in text and "r" not in prefix.lower():
                    bad.append(f"{path.relative_to(ROOT)}:{line}")
    assert not bad, f"docstrings with a backslash that are not raw (r'''...'''): {bad}"


def test_the_static_check_finds_a_lost_escape(tmp_path: Path) -> None:
    # The check above is not vacuous: the docstring KCLLoss.forward had on main.
    module = tmp_path / "m.py"
    module.write_text('def f():\n    """logit_scale: :math:`1/\\tau`."""\n')
    (found,) = _docstring_literals(module)
    assert "\\tau" in found[1] and not found[1].startswith("r")
    assert "\t" in ast.literal_eval(found[1])  # what help() showed: a TAB, then "au"


def _public_modules() -> list[object]:
    prefix = contrastive_losses.__name__ + "."
    names = [m.name for m in pkgutil.walk_packages(contrastive_losses.__path__, prefix)]
    public = [n for n in names if not any(part.startswith("_") for part in n.split("."))]
    return [contrastive_losses] + [importlib.import_module(n) for n in sorted(public)]


def _public_objects() -> Iterator[tuple[str, object]]:
    """Every public module, the names in its ``__all__``, and their members defined in
    the package (methods, properties, ``__init__``)."""
    seen: set[int] = set()
    for module in _public_modules():
        yield module.__name__, module
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr != "__init__":
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    yield f"{module.__name__}.{name}.{attr}", member


def _public_classes() -> list[tuple[str, type]]:
    out = []
    for name, obj in _public_objects():
        if inspect.isclass(obj) and name.count(".") >= 1:
            if obj.__module__.startswith(contrastive_losses.__name__):
                out.append((name, obj))
    return out


def test_no_public_docstring_holds_a_control_character() -> None:
    bad = []
    count = 0
    for name, obj in _public_objects():
        doc = getattr(obj, "__doc__", None) if not isinstance(obj, property) else obj.__doc__
        if isinstance(doc, str):
            count += 1
            if CONTROL.search(doc):
                where = CONTROL.search(doc)
                assert where is not None
                bad.append(f"{name}: {doc[max(0, where.start() - 20) : where.end() + 5]!r}")
    assert count > 100, f"only {count} docstrings found: has the package layout changed?"
    assert not bad, "docstrings with control characters (lost escapes):\n" + "\n".join(bad)


@pytest.mark.parametrize("loss", [InfoNCELoss, KCLLoss, CACLLoss, ASKLoss])
def test_help_shows_tau(loss: type) -> None:
    text = pydoc.render_doc(loss.forward, renderer=pydoc.plaintext)
    assert "1/\\tau" in text and "\tau" not in text


def test_open_clip_drop_ins_show_tau() -> None:
    from contrastive_losses.integrations import open_clip

    for cls in (open_clip.ClipLoss, open_clip.SigLipLoss):
        for member in (cls, cls.forward, cls.__init__):
            doc = member.__doc__ or ""
            assert not CONTROL.search(doc), f"{cls.__name__}.{member.__name__}"


# Classes without an __init__ of their own (a NamedTuple, a dict subclass) have the help
# of their base's constructor, which is right for them.
WITH_INIT = [(name, cls) for name, cls in _public_classes() if "__init__" in vars(cls)]


@pytest.mark.parametrize(("name", "cls"), WITH_INIT, ids=[name for name, _ in WITH_INIT])
def test_every_public_class_documents_its_init(name: str, cls: type) -> None:
    init = vars(cls)["__init__"]
    assert init.__doc__, f"{name}.__init__ has no docstring: help() shows its base's"
    text = pydoc.render_doc(cls.__init__, renderer=pydoc.plaintext)
    assert "Initialize internal Module state" not in text
    assert not CONTROL.search(init.__doc__)


def test_the_public_modules_all_have_a_documented_init() -> None:
    names = {name.rsplit(".", 1)[1] for name, _ in WITH_INIT}
    assert {"InfoNCELoss", "KCLLoss", "CACLLoss", "SigLIPLoss", "ASKLoss"} <= names
    assert {"SupportVectorRegularizer", "RadiusPredictor", "ClipLoss", "SigLipLoss"} <= names
