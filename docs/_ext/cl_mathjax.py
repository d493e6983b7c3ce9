"""Maths that typeset offline: a local MathJax copied into the build, else the CDN.

Sphinx loads MathJax from a CDN, so a build read without network shows raw TeX. When a
local copy is installed, this extension copies it into ``<html>/_static/mathjax/`` and
points ``mathjax_path`` there (a relative path: the site works offline and once
published). The first copy found wins:

1. ``CL_DOCS_MATHJAX=DIR``: a folder holding ``tex-mml-chtml.js`` (MathJax 3 or 4) or
   ``MathJax.js`` (MathJax 2); ``CL_DOCS_MATHJAX=cdn`` keeps the CDN;
2. ``django-static-mathjax`` from the ``docs`` extra (MathJax 3.2 files only; it needs no
   Django and imports as ``mathjax``);
3. Debian's ``libjs-mathjax`` (MathJax 2.7, ``/usr/share/javascript/mathjax``);

else the CDN, and the build log says so. ``-D mathjax_path=...`` on the command line
overrides all of this.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ExtensionError
from sphinx.ext.mathjax import MATHJAX_URL
from sphinx.util import logging

logger = logging.getLogger(__name__)

DEBIAN = Path("/usr/share/javascript/mathjax")
TARGET = "mathjax"  # under _static/
# What to copy of each layout: the script the page loads, then what it loads on demand
# (fonts, TeX extensions, the menu and its accessibility parts). Not the other bundles.
LAYOUTS: dict[int, list[str]] = {
    3: ["tex-mml-chtml.js", "input", "output", "a11y", "ui", "adaptors", "sre"],
    2: [
        "MathJax.js",
        "config/TeX-AMS-MML_HTMLorMML.js",
        "extensions",
        "jax/input/TeX",
        "jax/input/MathML",
        "jax/output/HTML-CSS",
        "jax/output/CommonHTML",
        "jax/output/PreviewHTML",
        "jax/element",
        "fonts/HTML-CSS/TeX",
        "localization/en",
    ],
}


def _major(folder: Path) -> int | None:
    for major, files in LAYOUTS.items():
        if (folder / files[0]).is_file():
            return major
    return None


def find_local_mathjax() -> tuple[Path, int] | None:
    """The local MathJax folder and its major version (2, or 3 for 3/4), or None: the CDN."""
    choice = os.environ.get("CL_DOCS_MATHJAX", "")
    if choice == "cdn":
        return None
    if choice:
        major = _major(Path(choice))
        if major is None:
            raise ExtensionError(f"CL_DOCS_MATHJAX={choice!r}: no tex-mml-chtml.js or MathJax.js")
        return Path(choice), major
    candidates = []
    spec = importlib.util.find_spec("mathjax")  # django-static-mathjax; does not import it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p, "static", "mathjax", "es5") for p in spec.submodule_search_locations]
    candidates.append(DEBIAN)
    for folder in candidates:
        if (major := _major(folder)) is not None:
            return folder, major
    return None


def choose_mathjax(app: Sphinx, config: Config) -> None:
    if config.mathjax_path != MATHJAX_URL:  # chosen by the user (conf.py or -D)
        return
    found = find_local_mathjax()
    if found is None:
        logger.info("MathJax: from the CDN (offline, maths shows as TeX; see cl_mathjax.py)")
        return
    folder, major = found
    config.cl_mathjax_source = str(folder)
    config.mathjax_path = f"{TARGET}/{LAYOUTS[major][0]}"
    if major == 2:  # MathJax 2 takes its configuration file from the page, not a query
        config.mathjax2_config = {"config": ["TeX-AMS-MML_HTMLorMML.js"]}
    logger.info("MathJax %s: local copy %s, copied into _static/%s", major, folder, TARGET)


def copy_mathjax(app: Sphinx, exc: Exception | None) -> None:
    source = app.config.cl_mathjax_source
    if exc is not None or not source or app.builder.format != "html":
        return
    folder, dest = Path(source), Path(app.outdir, "_static", TARGET)
    major = _major(folder)
    assert major is not None  # choose_mathjax checked it
    for rel in LAYOUTS[major]:
        src = folder / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, dirs_exist_ok=True)  # symlinks followed
        elif src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.mathjax")
    app.add_config_value("cl_mathjax_source", "", "html")  # set by choose_mathjax
    app.connect("config-inited", choose_mathjax, priority=900)  # after conf.py's values
    app.connect("build-finished", copy_mathjax)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
