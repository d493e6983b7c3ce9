"""``help(Class.__init__)`` shows the class's own arguments.

A public class documents its constructor's arguments in its docstring (``Args:``, as
Sphinx's autodoc and napoleon read them). Its ``__init__`` had no docstring, so
``help(KCLLoss.__init__)`` showed ``nn.Module.__init__``'s "Initialize internal Module
state". :func:`init_doc` gives ``__init__`` the class's summary line and ``Args``
section, read from the class docstring, so the text lives in one place.
"""

from __future__ import annotations

import inspect
import re
from typing import TypeVar

T = TypeVar("T", bound=type)

# A Google-style section header on a line of its own ("Shape:", "Example:").
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")


def init_doc(cls: T) -> T:
    """Class decorator: ``cls.__init__.__doc__`` becomes "Build a ``cls``." plus the
    ``Args`` section of ``cls.__doc__`` (and a pointer to the class for the rest)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    args: list[str] = []
    inside = False
    for line in lines:
        header = _SECTION.match(line)
        if header:
            inside = header.group(1) == "Args"
        if inside:
            args.append(line)
    summary = lines[0] if lines else ""
    text = f"Build a :class:`{cls.__name__}`: {summary}\n\n"
    if args:
        text += "\n".join(args).rstrip() + "\n\n"
    text += f"Shapes, maths and an example: ``help({cls.__name__})``."
    cls.__init__.__doc__ = text  # type: ignore[misc]  # the class itself, not an instance
    return cls
