"""docs/screenshot_check.py's page checks: error boxes, words broken in table cells and
figures too small to read (the browser part runs where Chromium is installed)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers import load_file_module

ROOT = Path(__file__).resolve().parents[1]


check = load_file_module("screenshot_check", ROOT / "docs" / "screenshot_check.py")


def _figure(path: Path, fontsize: float, dpi: int = 100) -> None:
    """A 750-px-wide figure whose smallest text is ``fontsize`` points, saved as the
    studies save theirs (with its smallest text recorded)."""
    pytest.importorskip("matplotlib", reason="the studies plot with matplotlib (dev extra)")
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    import common
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(750 / dpi, 3), dpi=dpi)
    ax.plot([0, 1], [0, 1])
    ax.set_title("title", fontsize=12)
    ax.tick_params(labelsize=fontsize)
    common.save_figure(fig, path)


def test_figures_record_their_smallest_text_and_the_check_scales_it(tmp_path: Path) -> None:
    _figure(tmp_path / "small.png", fontsize=7)  # 7 pt at 100 dpi: 9.7 px
    record = float(check.png_text(tmp_path / "small.png")[check.FONT_KEY])
    assert record == pytest.approx(7 * 100 / 72, abs=0.05)
    page = tmp_path / "page.html"
    full = {"src": "small.png", "natural": 750, "shown": 736}
    assert check.figure_problems(page, [full]) == []
    squeezed = {"src": "small.png", "natural": 750, "shown": 450}  # 5.8 px on screen
    (problem,) = check.figure_problems(page, [squeezed])
    assert "small.png: smallest text 5.8 px on screen" in problem


def test_images_without_a_record_may_not_be_shrunk_much(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib writes the test PNG")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10, 2), dpi=100)
    fig.savefig(tmp_path / "plain.png")
    plt.close(fig)
    page = tmp_path / "page.html"
    assert check.figure_problems(page, [{"src": "plain.png", "natural": 1000, "shown": 900}]) == []
    (problem,) = check.figure_problems(page, [{"src": "plain.png", "natural": 1000, "shown": 600}])
    assert "shown at 60% of its width" in problem
    (problem,) = check.figure_problems(page, [{"src": "gone.png", "natural": 0, "shown": 0}])
    assert "did not load" in problem


def test_every_page_is_checked_but_not_sphinx_folders(tmp_path: Path) -> None:
    for name in ("index.html", "methods/kcl.html", "_static/x.html", "a.cl-layout.html"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("<html></html>")
    assert check.all_pages(tmp_path) == ["index", "methods/kcl"]


PAGE = """<!doctype html><html><head><style>
table { width: 60px; } td { overflow-wrap: anywhere; }
.contents::before { content: "ERROR: Adding a table of contents is unnecessary"; }
</style></head><body><article role="main">
<nav class="contents local" id="on-this-page"><p>On this page</p></nav>
<div class="admonition error"><p>broken</p></div>
<table><tr><td>random_swap20 ok</td></tr></table>
</article></body></html>"""


@pytest.mark.skipif(
    not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")),
    reason="Chromium is not installed (apt-get install chromium): it renders the page",
)
def test_the_browser_probe_finds_error_boxes_and_broken_words(tmp_path: Path) -> None:
    (tmp_path / "bad.html").write_text(PAGE)
    problems = check.page_problems(tmp_path, "bad")
    boxes = [p for p in problems if "error box" in p]
    assert any("nav.contents" in p for p in boxes), problems
    assert any("admonition error" in p for p in boxes), problems
    assert "bad.html: word broken in a table cell: 'random_swap20'" in problems
    assert not any("'ok'" in p for p in problems)


def test_lost_escapes_are_found_in_a_page() -> None:
    # What the API page of KCLLoss.forward held on main: "1/\tau" in a non-raw docstring.
    lost = '<span class="math notranslate nohighlight">\\(1/\tau\\)</span>'
    (problem,) = check.escape_problems(f"<p>logit_scale: {lost}</p>")
    assert problem == "lost escape: TAB in maths '1/<TAB>au' (a \\t... command)"
    (problem,) = check.escape_problems("<p>\\(\x0crac{1}{2}\\)</p>")  # \frac
    assert "control character" in problem and "<FF>rac" in problem
    fine = '<span class="math">\\(1/\\tau\\)</span><pre>\tindented code</pre>'
    assert check.escape_problems(fine) == []
