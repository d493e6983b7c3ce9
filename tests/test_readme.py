"""Every Python block in README.md runs, in order, in one namespace."""

from __future__ import annotations

import re
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
    ci = (README.parent / ".ci" / "run").read_text()
    set_up = README.read_text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", set_up, flags=re.S)
    commands = [line for block in bash for line in block.splitlines() if line.strip()]
    assert len(commands) >= 2, commands  # a venv, the install, the tests
    ci_lines = [line.strip() for line in ci.splitlines()]
    for command in commands:
        assert command in ci_lines, f"{command!r} is in README but not in .ci/run"
    order = [ci_lines.index(command) for command in commands]
    assert order == sorted(order), "README and .ci/run give the set-up commands in another order"


def test_which_loss_section_cites_studies_that_exist():
    """README's and the docs index's "Which loss should I use?" cite the studies their
    numbers come from, by links that resolve."""
    section = README.read_text().split("## Which loss should I use?", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(([^)#]+)", section)
    for study in ("real_multilingual", "multilingual", "svr", "svr_regimes", "ask"):
        assert f"benchmarks/results/studies/{study}.md" in links, study
    missing = [link for link in links if not (README.parent / link).is_file()]
    assert not missing, missing
    index = (README.parent / "docs" / "index.rst").read_text()
    cited = index.split("Which loss should I use?", 1)[1].split("Next steps", 1)[0]
    for ref in ("real_data", "results-studies-multilingual", "results-studies-svr", "methods/svr"):
        assert ref in cited, ref
