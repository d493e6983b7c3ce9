"""The docs' results pages stay readable (issue 42): every study in benchmarks/results/studies
is shown on a page of its own (or on the Real data page), the benchmarks page no longer
renders them all, nor the run_all summary that repeats its tables."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _directives(page: Path) -> list[str]:
    return re.findall(r"^\.\. benchmark-results:: (\S+)", page.read_text(), flags=re.M)


def test_every_study_is_on_one_page_of_its_own() -> None:
    studies = {p.stem for p in (ROOT / "benchmarks" / "results" / "studies").glob("*.json")}
    shown: dict[str, list[str]] = {}
    for page in DOCS.rglob("*.rst"):
        for target in _directives(page):
            if target.startswith("studies/"):
                shown.setdefault(target.removeprefix("studies/"), []).append(str(page))
    assert "*" not in shown, shown["*"]  # no page renders every study at once
    assert set(shown) == studies, (sorted(shown), sorted(studies))
    twice = {stem: pages for stem, pages in shown.items() if len(pages) > 1}
    assert not twice, twice
    for stem, (page,) in shown.items():  # the label other pages cite it by
        assert f".. _results-studies-{stem}:" in Path(page).read_text(), stem


def test_the_benchmarks_page_leaves_out_the_summary_that_repeats_it() -> None:
    text = (DOCS / "benchmarks.rst").read_text()
    assert ".. benchmark-results:: *\n   :exclude: summary\n" in text
