"""A reduced kill-during-save loop: a few real SIGKILLs of the trainer, resumed with
``--resume auto``; the result must equal an uninterrupted run bit for bit (``kill_loop.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kill_loop import LOOP_SETTINGS, run_loop


@pytest.mark.slow
def test_sigkills_during_saves_resume_to_identical_results(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    values = {**base_config, **LOOP_SETTINGS, "epochs": 1}
    lines: list[str] = []
    # Kills at opens, fsyncs, renames and deletes: the moments between and around files.
    stats = run_loop(
        3, tmp_path, seed=1, timer_share=0.0, meta_share=1.0, log=lines.append, config_values=values
    )
    assert stats["failures"] == [], "\n".join(lines)
    assert stats["kills"] >= 3 and stats["io_kills"] == stats["kills"]
    assert stats["episodes"] >= 1
