"""The example trainer across 2 gloo ranks (issue 33): a checkpoint that a non-zero rank
cannot verify (its own view of the files, e.g. a node-local disk) is passed over by every
rank together, instead of that rank raising alone while rank 0 waits in its next
collective (killed by the launcher, or 2 hours); and one rank's extra loss call in an
evaluation raises on both ranks at the end of the evaluation
(:func:`~contrastive_losses.distributed.check_call_counts`) instead of pairing every later
step with the peer's previous batch. Each run has a deadline: a hang fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, spawn_ranks
from test_example_checkpoints import CFG, MIDDLE, NEWEST, ckpt, flip_byte
from test_example_reliability import run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REPO = EXAMPLES.parent


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory: pytest.TempPathFactory, base_config: dict[str, Any]):
    """A run paused after 3 steps (3 checkpoints), and its config."""
    out = tmp_path_factory.mktemp("ranks") / "run"
    cfg = {**base_config, **CFG}
    run(out, cfg, max_steps=3)
    return out, cfg


def _resume_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """``resume_point`` on each rank; rank 1 reads its files from its own copy of the run
    (``copy``), whose newest ``state.pt`` is damaged."""
    from clap_example import checkpoint
    from clap_example.config import parse_args

    init_gloo(rank, world, init_method, timeout_s=60)
    job = json.loads((Path(out_dir) / "job.json").read_text())
    out, copy = Path(job["out"]), Path(job["copy"])
    if rank == 1:
        real = checkpoint.read_verified

        def own_view(directory: Path, name: str, manifest: dict, root: Path | None = None):
            mine = copy / directory.relative_to(out)
            return real(mine, name, manifest, None if root is None else copy)

        checkpoint.read_verified = own_view
    results: dict[str, Any] = {}
    try:
        for case, resume in (("auto", "auto"), ("explicit", str(ckpt(out, NEWEST)))):
            args = parse_args(["--config", job["config"], "--resume", resume])
            try:
                point = checkpoint.resume_point(out, args, rank == 0, world)
                results[case] = ("point", point.directory.name, point.state is not None)
            except ValueError as err:
                results[case] = ("error", type(err).__name__, str(err))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_one_rank_cannot_verify_is_passed_over_by_every_rank(
    three_checkpoints, tmp_path: Path
) -> None:
    out, cfg = three_checkpoints
    copy = tmp_path / "rank1-view"
    shutil.copytree(out, copy, symlinks=True)
    flip_byte(ckpt(copy, NEWEST) / "state.pt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**cfg, "output_dir": str(out)}))
    job = {"out": str(out), "copy": str(copy), "config": str(config)}
    (tmp_path / "job.json").write_text(json.dumps(job))
    results = spawn_ranks(_resume_worker, tmp_path, deadline_s=240)
    # --resume auto: both ranks fall back together, each with its files loaded.
    assert [r["auto"] for r in results] == [("point", MIDDLE, True)] * 2, results
    # --resume DIR: the same error on both ranks, naming the rank and its file.
    outcomes = [r["explicit"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes
    kind, name, message = outcomes[0]
    assert (kind, name) == ("error", "CheckpointError"), outcomes[0]
    assert message.startswith(f"--resume {ckpt(out, NEWEST)}: rank 1: "), message
    assert str(ckpt(copy, NEWEST) / "state.pt") in message, message


EXTRA_BATCH = """
import sys
sys.path.insert(0, {examples!r})
import torch
from clap_example import train

evaluate = train.Trainer._evaluate_and_select


def with_an_extra_batch(self):
    if self.rank == 0:  # one more evaluation batch on rank 0 than on rank 1
        with torch.no_grad():
            emb = torch.randn(2, self.model.embed_dim)
            self.loss_fn(emb, emb.flip(0))
    return evaluate(self)


train.Trainer._evaluate_and_select = with_an_extra_batch
sys.exit(train.cli())
"""


def test_an_extra_evaluation_batch_on_one_rank_raises_on_both(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    values = {
        **base_config,
        "loss": "infonce",
        "max_steps": 2,
        "batch_size": 3,
        "test_manifest": None,
        "val_manifest": None,
        "output_dir": str(tmp_path / "ddp"),
    }
    config = tmp_path / "ddp.json"
    config.write_text(json.dumps(values))
    script = tmp_path / "extra_batch.py"
    script.write_text(EXTRA_BATCH.format(examples=str(EXAMPLES)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(script), "--config", str(config)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-4000:]
    expected = (
        "finetune_ced_sonar.py: error: calls of InfoNCELoss (end of the evaluation at step "
        "2): rank 1 compared the calls of the loss while rank 0 made another gathered loss call"
    )
    errors = [line for line in proc.stderr.splitlines() if expected in line]
    assert len(errors) == 2, proc.stderr[-4000:]  # one line from each rank, the same
    assert errors[0].split(expected)[1] == errors[1].split(expected)[1], errors
    assert "SIGABRT" not in proc.stderr and "Signal 6" not in proc.stderr, proc.stderr[-4000:]
