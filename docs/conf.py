"""Sphinx configuration of the contrastive_losses documentation.

Build (warnings are errors, as in CI)::

    PYTHONPATH=src python -m sphinx -W -b html docs docs/_build/html
    PYTHONPATH=src python -m sphinx -W -b doctest docs docs/_build/doctest

``tests/test_docs.py`` runs both. The package is imported from ``src/`` (no install needed).
Maths: a local MathJax (the ``docs`` extra's, or Debian's ``libjs-mathjax``) is copied into
the build when installed, else the CDN is used; see ``_ext/cl_mathjax.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(DOCS / "_ext"))

import contrastive_losses  # noqa: E402

# -- API reference -------------------------------------------------------------------
# Every public module, in the order the API reference lists them. ``cl_docs`` writes one
# page per module into api/generated/ at the start of each build (autosummary-style) and
# fails the build when a public module under src/contrastive_losses/ is missing here.
API_MODULES = [
    "contrastive_losses",
    "contrastive_losses.functional",
    "contrastive_losses.losses",
    "contrastive_losses.infonce",
    "contrastive_losses.siglip",
    "contrastive_losses.kcl",
    "contrastive_losses.cacl",
    "contrastive_losses.svr",
    "contrastive_losses.ask",
    "contrastive_losses.bank",
    "contrastive_losses.ot",
    "contrastive_losses.grad_cache",
    "contrastive_losses.matryoshka",
    "contrastive_losses.metrics",
    "contrastive_losses.diagnostics",
    "contrastive_losses.distributed",
    "contrastive_losses.integrations",
    "contrastive_losses.integrations.open_clip",
    "contrastive_losses.integrations.open_clip_train",
]
# Modules still on their feature branches. A pending module that does not import is left
# out of the API reference and its doctest snippets are skipped (`:skipif: pending(...)`);
# once it imports it is documented and tested like any other. Any other module that fails
# to import fails the build. MERGE: delete a module's line once its branch is in main.
PENDING_MODULES: set[str] = set()
cl_api_modules = API_MODULES
cl_pending_modules = PENDING_MODULES

# -- Project ---------------------------------------------------------------------------
project = "contrastive_losses"
author = "contrastive_losses developers"
copyright = "contrastive_losses developers"
release = contrastive_losses.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
    "sphinx_copybutton",
    "myst_parser",
    "cl_docs",
    "cl_mathjax",  # a local MathJax when one is installed (offline maths), else the CDN
]

# Intersphinx (links to the torch and Python docs) downloads objects.inv at build time.
# CI and the development machines have no network, and a failed download is a warning,
# i.e. an error under -W. So it is opt-in: set CL_DOCS_INTERSPHINX=1 where the network is
# there (e.g. when publishing). Offline, ``torch.Tensor`` in signatures is plain text.
if os.environ.get("CL_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
    }

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "snippets", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
nitpicky = False
pygments_style = "friendly"
pygments_dark_style = "monokai"

# -- autodoc / napoleon ----------------------------------------------------------------
# Members are listed per page by cl_docs (from each module's __all__), not by default.
autodoc_default_options = {"member-order": "bysource", "exclude-members": "extra_repr"}
autodoc_inherit_docstrings = False  # no "Define the computation performed at every call"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
autoclass_content = "class"
python_use_unqualified_type_names = True
autosummary_generate = False  # cl_docs writes the API pages; autosummary only draws tables

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("Shape", "notes_style")]

# -- MyST (Markdown pages: changelog, example README, benchmark tables) ----------------
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# -- doctest ---------------------------------------------------------------------------
# Snippets of pending modules carry `:skipif: pending("contrastive_losses.svr")`, or
# `pending("module:name")` when the snippet needs one name that another branch may add
# later: skipped while the module (or name) is pending and absent, run otherwise.
doctest_global_setup = f"""
import importlib as _il
import importlib.util as _ilu
import torch
torch.manual_seed(0)
_PENDING = {sorted(PENDING_MODULES)!r}

def pending(target):
    module, _, name = target.partition(":")
    if module not in _PENDING:
        return False
    if _ilu.find_spec(module) is None:
        return True
    return bool(name) and not hasattr(_il.import_module(module), name)
"""
doctest_test_doctest_blocks = "default"

# -- HTML ------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"contrastive_losses {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "navigation_with_keys": True,
}
html_show_sourcelink = False
# The copy button copies what a reader would type: the commands without their prompts
# ("$ ", ">>> ", "... ", and "> ", the shell's prompt inside a multi-line "for" loop), the
# lines that continue a command ending in a backslash, and a here-document up to its
# delimiter; output lines are left out. tests/test_docs.py runs the built copybutton.js
# on every console block.
copybutton_prompt_text = r">>> |\.\.\. |\$ |> "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True
copybutton_line_continuation_character = "\\"
copybutton_here_doc_delimiter = "EOF"
