"""Every Python block in README.md runs, in order, in one namespace."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


CONTINUES = "# continues the Quickstart"


def test_readme_python_blocks_run_alone_or_say_they_continue():
    """A reader may paste any block into a fresh interpreter: it runs there, or its first
    line says which block it continues."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    alone = [block for block in blocks if not block.startswith(CONTINUES)]
    assert blocks[0] in alone, "the first block (the Quickstart) must run alone"
    for block in alone:
        exec(compile(block, str(README), "exec"), {})


def test_readme_set_up_commands_are_the_ci_commands():
    """README's "Development" section holds the maintainers' commands (the torch pin
    included), which CI runs as written; the users' install names no pinned torch."""
    ci = (README.parent / ".ci" / "run").read_text()
    set_up = README.read_text().split("## Development", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", set_up, flags=re.S)
    commands = [line for block in bash for line in block.splitlines() if line.strip()]
    assert len(commands) >= 2, commands  # a venv, the install, the tests
    ci_lines = [line.strip() for line in ci.splitlines()]
    for command in commands:
        assert command in ci_lines, f"{command!r} is in README but not in .ci/run"
    order = [ci_lines.index(command) for command in commands]
    assert order == sorted(order), "README and .ci/run give the set-up commands in another order"


def test_the_users_install_pins_no_torch():
    text = README.read_text()
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "torch==" not in install
    index = (README.parent / "docs" / "index.rst").read_text()
    assert "torch==" not in index  # the docs' install is the users' one
    assert text.count('pip install "torch==2.13.*" -e ".[dev]"') == 1  # Development only


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_which_loss_section_cites_studies_that_exist():
    """README's "Which loss should I use?" cites the studies its numbers come from and the
    docs page with the rest, by links that resolve; the docs index points to that page."""
    section = _section(README.read_text(), "Which loss should I use?")
    links = re.findall(r"\]\(([^)#]+)", section)
    for study in ("real_pretrained", "real_multilingual", "real_text_layer", "multilingual",
                  "svr", "svr_regimes", "ask"):  # fmt: skip
        assert f"benchmarks/results/studies/{study}.md" in links, study
    assert "docs/which_loss.rst" in links
    missing = [link for link in links if not (README.parent / link).is_file()]
    assert not missing, missing
    index = (README.parent / "docs" / "index.rst").read_text()
    cited = index.split("Which loss should I use?", 1)[1].split("Next steps", 1)[0]
    assert ":doc:`which_loss`" in cited


def test_which_loss_section_is_at_most_300_words():
    section = _section(README.read_text(), "Which loss should I use?")
    words = [w for w in section.split() if re.search(r"[A-Za-z0-9]", w)]
    assert len(words) <= 300, len(words)


# --- the numbers: every interval README and the docs page quote, from the results files ---

STUDIES = README.parent / "benchmarks" / "results" / "studies"
WHICH_LOSS = README.parent / "docs" / "which_loss.rst"
#: The newest study of each kind and the seed-paired comparisons the pages may quote:
#: (study, arm, reference arm), the runs keyed by "method" (real_multilingual) or "arm".
COMPARISONS = [
    *(("real_pretrained", arm, "random") for arm in (
        "kcl", "cacl", "pairs_all", "svr_static", "svr_dynamic", "ask", "length_only",
        "random_top")),
    ("real_pretrained", "kcl", "pairs_all"),
    ("real_pretrained", "kcl_top", "random_top"),
    *(("real_multilingual", arm, "random") for arm in (
        "kcl", "cacl", "pairs_all", "random_xK", "svr_static", "svr_dynamic", "ask")),
    ("real_multilingual", "kcl", "pairs_all"),
    ("real_multilingual", "kcl", "random_xK"),
    ("real_multilingual", "ask_swap20", "random_swap20"),
    *(("real_multilingual", f"{arm}_text", "random_text") for arm in ("kcl", "cacl", "pairs_all")),
    ("real_multilingual", "kcl_text", "pairs_all_text"),
    *(("real_text_layer", arm, "random") for arm in ("kcl", "cacl", "pairs_all")),
    ("real_text_layer", "kcl", "pairs_all"),
]  # fmt: skip
#: The table of "Which loss should I use?", row by row, in README and on the docs page.
TABLE = [
    ("real_pretrained", "kcl", "random"),
    ("real_pretrained", "pairs_all", "random"),
    ("real_pretrained", "cacl", "random"),
    ("real_pretrained", "svr_static", "random"),
    ("real_pretrained", "svr_dynamic", "random"),
    ("real_pretrained", "ask", "random"),
]
INTERVAL = re.compile(r"[+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] \(\d+/\d+ seeds ahead\)")


def _interval(study: str, arm: str, reference: str) -> str:
    """``paired_difference(...).text()`` of T2A R@1 in points, recomputed from the study's
    per-seed runs (seeds where both arms ran)."""
    sys.path.insert(0, str(README.parent / "examples"))
    from clap_example.compare import paired_difference

    runs = json.loads((STUDIES / f"{study}.json").read_text())["runs"]
    r1 = {(run.get("method", run.get("arm")), run["seed"]): run["t2a_R@1"] for run in runs}
    seeds = sorted(seed for (name, seed) in r1 if name == arm and (reference, seed) in r1)
    return paired_difference([100 * (r1[arm, s] - r1[reference, s]) for s in seeds]).text()


def test_every_interval_quoted_is_recomputed_from_the_newest_studies():
    """README (its "Which loss", SVR and ASK sections alike) and the docs page quote only
    intervals that the newest studies' per-seed runs give, and the table's rows are the
    losses they name, in the same order on both pages."""
    expected = {_interval(*c) for c in COMPARISONS}
    readme, page = README.read_text(), WHICH_LOSS.read_text()
    for name, text in (("README.md", readme), ("docs/which_loss.rst", page)):
        quoted = INTERVAL.findall(" ".join(text.split()))  # an interval wrapped over lines too
        assert quoted, name
        wrong = [q for q in quoted if q not in expected]
        assert not wrong, (name, wrong, sorted(expected))
    rows = [_interval(*c) for c in TABLE]
    table = _section(readme, "Which loss should I use?").split("| loss |", 1)[1]
    assert INTERVAL.findall(table.split("\n\n", 1)[0]) == rows
    for line in table.split("\n\n", 1)[0].splitlines():
        if INTERVAL.search(line):  # each row names the study its numbers come from
            study = {c[0] for c in TABLE if _interval(*c) in line}
            assert line.rstrip(" |").endswith(f"studies/{study.pop()}.md)"), line
    page_table = page.split(".. list-table::", 1)[1].split("\n\n", 2)[1]
    assert INTERVAL.findall(page_table) == rows
    for text in (_section(readme, "Support vector regularisation"), _section(readme, "ASK:")):
        assert INTERVAL.findall(text), "the SVR and ASK sections quote the newest study"


def _commands(text: str) -> list[list[str]]:
    """The trainer commands of the page's bash blocks, continuation lines joined."""
    blocks = re.findall(r"\.\. code-block:: bash\n\n(.*?)(?:\n\S|\Z)", text, flags=re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        losses = re.search(r"for loss in ([^;]+);", joined)
        for line in joined.splitlines():
            if "examples/finetune_ced_sonar.py" in line:
                for loss in losses.group(1).split():
                    argv = line.split("finetune_ced_sonar.py", 1)[1].split()
                    commands.append([a.replace("$seed", "0").replace("$loss", loss) for a in argv])
    return commands


def test_the_paired_comparison_runs_as_written(monkeypatch):
    """The docs page's comparison loops parse as the trainer's options (the Tux Paint one
    after its install and build steps, the one on your own manifests) and compare with the
    loss the docs say to start with."""
    sys.path.insert(0, str(README.parent / "examples"))
    from clap_example.config import DEFAULT_LOSS, parse_args

    monkeypatch.chdir(README.parent)  # the commands run in the clone
    page = WHICH_LOSS.read_text()
    commands = _commands(page)
    assert len(commands) == 6, commands  # 2 loops x 3 losses
    for argv in commands:
        args = parse_args(argv)
        assert args.seed == 0 and args.output_dir == f"runs/{args.loss}-0"
    assert {parse_args(argv).loss for argv in commands} == {DEFAULT_LOSS, "kcl", "infonce_all"}
    tux = page.split("**On Tux Paint**", 1)[1].split("**On your own manifests**", 1)[0]
    assert 'pip install -e ".[real]"' in tux and "data_builders/tuxpaint.py" in tux
    builder = next(line for line in tux.splitlines() if "data_builders/tuxpaint.py" in line)
    examples_readme = (README.parent / "examples" / "README.md").read_text()
    assert builder.strip() in examples_readme  # the build step examples/README documents
    assert page.count(f"compare_runs.py runs/* --baseline {DEFAULT_LOSS}") == 2
    assert "hours" in page.split("**What it costs.**", 1)[1]
