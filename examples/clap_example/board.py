"""``--tensorboard``: the scalars of ``train_log`` (per step) and ``epoch_log`` (per epoch) as
TensorBoard events under ``--output-dir/tensorboard``, written with
``torch.utils.tensorboard`` (the ``tensorboard`` package, in the ``examples`` extra)."""

from __future__ import annotations

import os
import stat
from typing import Any

from .run_folder import RunFolder, kind, refusal

#: The message of a missing tensorboard package.
MISSING = (
    "--tensorboard needs the tensorboard package: pip install 'contrastive-losses[examples]' "
    "(or pip install tensorboard), or leave --tensorboard out"
)

#: Step-row keys that are positions, not scalars to plot.
_POSITION_KEYS = ("step", "epoch", "batch")


def summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or an ImportError naming the extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(MISSING) from err
    return SummaryWriter


class ScalarBoard:
    """Writes the same numbers as the JSONL logs: ``train/<key>`` per step (loss, terms,
    temperature and radius, learning rate, gradient norm) and ``test/<metric>`` and
    ``epoch/train_loss`` per epoch, at the step they belong to. A resumed run drops the events
    after its checkpoint's step (``purge_step``), as the logs do."""

    def __init__(self, folder: RunFolder, resume_step: int | None) -> None:
        writer = summary_writer_class()
        directory = folder.root / "tensorboard"
        #: The directory's descriptor, held while the writer runs: the writer opens its files
        #: by path, so it is given ``/proc/self/fd/N`` (Linux), the directory that was checked,
        #: even should ``tensorboard/`` be swapped for a link later.
        self.fd = folder.open_dir(directory, create=True)
        for entry in sorted(os.scandir(self.fd), key=lambda e: e.name):
            mode = entry.stat(follow_symlinks=False).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # the writer would follow it
                os.close(self.fd)
                raise refusal(directory / entry.name, kind(mode))
        held = f"/proc/self/fd/{self.fd}"
        logdir = held if os.path.isdir(held) else str(directory)
        self.writer = writer(logdir, purge_step=resume_step)

    def step(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key not in _POSITION_KEYS and isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}", float(value), step)

    def epoch(self, summary: dict[str, Any]) -> None:
        step = int(summary["step"])
        if summary.get("train_loss") is not None:
            self.writer.add_scalar("epoch/train_loss", float(summary["train_loss"]), step)
        for key, value in (summary.get("metrics") or {}).items():
            self.writer.add_scalar(f"test/{key}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        os.close(self.fd)
