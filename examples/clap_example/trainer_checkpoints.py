"""The trainer's side of checkpoints: what a checkpoint of the run holds (``state.pt``, this
rank's RNG streams, the manifest's metadata) and how a verified one is put back into the run.
The files' format, verification, saving and pruning are ``checkpoint.py``'s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import (
    REQUIRED_STATE,
    CheckpointStore,
    ResumePoint,
    check_finite,
    load_modules,
    load_verified,
    reset_schedule,
    restore_rng,
    rng_state,
)
from .distributed import from_main

if TYPE_CHECKING:
    from .train import Trainer


class TrainerCheckpoints:
    """Saves the trainer's state and restores it from a :class:`ResumePoint` (every rank
    holds one; the trainer's counters stay the trainer's attributes)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        args = trainer.args
        self.store = CheckpointStore(
            trainer.out, trainer.rank, trainer.world, args.keep_checkpoints
        )

    @property
    def published(self) -> str | None:
        """The checkpoint the run resumed from or last published (``latest``'s content)."""
        return self.store.published

    def restart_point(self) -> str:
        if self.store.published is None:
            return "step 0 (no checkpoint saved yet)"
        return f"{self.store.published} (step {self.store.published_step})"

    def state(self) -> dict[str, Any]:
        """Everything a resume needs, as tensors and plain types (loadable with
        ``weights_only=True``)."""
        t = self.trainer
        state: dict[str, Any] = {
            "model": t.model.state_dict(),
            "loss": t.loss_fn.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "scaler": t.scaler.state_dict(),
            "step": t.step,
            "epoch": t.epoch,
            "batch_in_epoch": t.batch_in_epoch,
            "best": t.best,
            "history": t.history,
            "step_log": t.log.history.state_dict() if t.log is not None else None,
            "bank_epoch": t.bank_epoch,
            "epoch_losses": list(t.epoch_losses),
            "epoch_elapsed": t.epoch_elapsed,
            "nonfinite_in_row": t.nonfinite_in_row,
            "nonfinite_total": t.nonfinite_total,
            "args": vars(t.args),
        }
        if t.ask:
            state["bank"] = t.bank.state_dict()
        return state

    def save(self) -> Path:
        """``checkpoints/step-N`` with its manifest, then ``latest`` (see ``checkpoint.py``)."""
        t = self.trainer
        # every rank: the weights are the same everywhere
        check_finite(t.trainable, t.step, self.store.published)
        name = from_main(self.store.new_name(t.step) if t.is_main else None, t.world)
        meta = {
            "step": t.step,
            "epoch": t.epoch,
            "batch_in_epoch": t.batch_in_epoch,
            "closed": bool(t.history) and t.history[-1]["step"] == t.step,
            "world_size": t.world,
            "args": vars(t.args),
        }

        def before_publish() -> None:
            if t.log is not None:
                t.log.sync()  # the rows up to this step are on disk before `latest`
            t.folder.fsync(t.out / "epoch_log.jsonl")

        return self.store.save(name, t.state, rng_state(t.lang_gen), meta, before_publish)

    def restore(self, point: ResumePoint) -> int:
        """Load the checkpoint (rank 0: what it verified and loaded; another rank: its files
        read once, hashed and loaded); the learning rate is recomputed for its step under the
        current options (the same value when they did not change)."""
        t = self.trainer
        directory = point.directory
        state = point.state
        if state is None:
            state = load_verified(directory, "state.pt", point.manifest, REQUIRED_STATE)
        bank = t.bank if t.ask else None
        load_modules(
            directory / "state.pt", state, t.model, t.loss_fn, bank, t.optimizer, t.scheduler,
            t.scaler,
        )  # fmt: skip
        reset_schedule(t.optimizer, t.scheduler, t.args, t._lr_factor)
        t.step = int(state["step"])
        t.epoch = int(state["epoch"])
        t.batch_in_epoch = int(state["batch_in_epoch"])
        t.best = state["best"]
        t.history = list(state["history"])
        t.saved_step_log = state.get("step_log")
        t.bank_epoch = state.get("bank_epoch")
        t.epoch_losses = list(state.get("epoch_losses", []))
        t.epoch_elapsed = float(state.get("epoch_elapsed", 0.0))
        t.nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
        t.nonfinite_total = int(state.get("nonfinite_total", 0))
        restore_rng(point, t.rank, t.lang_gen, t.is_main)
        point.state = point.rng = None  # loaded into the run: free the copy
        self.store.published = directory.name
        self.store.published_step = t.step
        if t.is_main:
            print(
                f"[resume] from {directory}: step {t.step}, epoch {t.epoch + 1}, "
                f"batch {t.batch_in_epoch}",
                file=sys.stderr,
                flush=True,
            )
        return t.step
