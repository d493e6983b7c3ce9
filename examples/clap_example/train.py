"""The training loop: DDP, AMP, GradCache, logging, evaluation, checkpoints and exact resume.

What happens around the loop lives beside it: ``startup`` (checks before any folder is
created), ``sources`` (local paths, or the hub when asked), ``checkpoint`` (manifest, save,
verify, resume, prune), ``evaluation``, ``objective`` (the loss and the captions a step
encodes), ``update`` (the guarded optimizer step), ``logs``, ``board`` (TensorBoard),
``console`` (progress, epoch lines, the closing block), ``plots``, ``signals`` and
``distributed``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from contrastive_losses.distributed import check_call_counts

from .checkpoint import already_complete, read_summary, resume_point
from .config import parse_args
from .console import closing_lines, epoch_line
from .distributed import (
    allreduce_gradients,
    average_buffers,
    broadcast_module,
    init_distributed,
    ranks_in_sync,
)
from .evaluation import Evaluator, build_bank_if_due
from .final_test import final_test, selection_record, start_note
from .logs import flatten_metrics, open_logs, peak_memory_mb, step_record
from .objective import (
    Trainable,
    build_loss,
    grad_cache_backward,
    running_stats,
    select_texts,
    text_mode,
)
from .run_folder import RunFolder
from .signals import StopSignals, resume_command
from .startup import (
    amp_dtype,
    build_model,
    build_optimizer,
    check_clips,
    check_sources,
    epoch_loader,
    lr_factor,
    prepare_output_dir,
    read_data,
)
from .trainer_checkpoints import TrainerCheckpoints
from .update import guarded_update

# Re-exported: the names tests and users import from here.
_Trainable = Trainable
__all__ = [
    "Trainer",
    "build_loss",
    "cli",
    "flatten_metrics",
    "main",
    "select_texts",
    "text_mode",
]


class Trainer:
    """Holds the run's state; :meth:`fit` trains, evaluates and checkpoints.

    Start-up order: every check that can fail (options, manifests, batch size, the checkpoint
    to resume and its options, the audio, the models) runs before the output directory is
    created or changed, so a failed start leaves nothing that blocks the corrected rerun.
    """

    def __init__(self, args: argparse.Namespace, argv: Sequence[str] | None = None) -> None:
        self.args = args
        self.argv = argv  # the command line, for the resume command printed on a signal
        self.rank, self.world, self.device = init_distributed(args.device)
        self.is_main = self.rank == 0
        self.out = Path(args.output_dir)
        self.folder = RunFolder(self.out)  # every file of the run goes through it
        self.amp_dtype = amp_dtype(args.amp, self.device)

        # Data first: manifest errors should come before minutes of model loading.
        data = read_data(args, self.rank, self.world)
        self.languages, self.mode = data.languages, data.mode
        self.train_clips, self.val_clips = data.train_clips, data.val_clips
        self.train_set, self.sampler = data.train_set, data.sampler
        self.steps_per_epoch, self.total_steps = data.steps_per_epoch, data.total_steps
        self.checkpoints = TrainerCheckpoints(self)
        point = resume_point(self.out, args, self.is_main, self.world)
        self.already_complete = point is not None and already_complete(
            self.out, point.manifest, args.epochs, self.total_steps, self.is_main, self.world
        )
        if self.already_complete:
            return
        check_clips(args, data, self.rank, self.world)

        # Model and loss: same init on every rank, then per-rank RNG streams (dropout).
        torch.manual_seed(args.seed)
        self.model = build_model(args).to(self.device)
        self.loss_fn = build_loss(args).to(self.device)
        self.ask = args.loss == "ask"
        self.grad_cache = bool(args.grad_cache)
        self.trainable = Trainable(self.model, self.loss_fn, self.amp_dtype, self.device)
        self.ddp: DistributedDataParallel | None = None
        if self.world > 1 and not self.grad_cache:
            self.ddp = DistributedDataParallel(
                self.trainable,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
            )
        elif self.world > 1:
            broadcast_module(self.trainable)
        self.params = [p for p in self.trainable.parameters() if p.requires_grad]
        self.optimizer, self.scheduler, self.scaler = build_optimizer(
            args, self.params, self._lr_factor, self.device, self.amp_dtype
        )
        seed = args.seed * 1000 + self.rank
        random.seed(seed)
        torch.manual_seed(seed)
        self.lang_gen = torch.Generator().manual_seed(seed + 17)
        self.evaluator = Evaluator(
            args, self.trainable, self.device, self.languages, self.val_clips, self.out
        )

        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best: float | None = None
        self.history: list[dict[str, Any]] = []
        self.saved_step_log: Any = None  # the checkpoint's step rows (logs.StepHistory)
        self.bank_epoch: int | None = None
        self.epoch_losses: list[float] = []  # finite losses since the last epoch row
        self.epoch_elapsed = 0.0  # training seconds of the current epoch
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0
        self.stop = StopSignals(self.is_main, self.checkpoints.restart_point)

        # Every check passed: only now is the output directory created or changed.
        if self.is_main:
            prepare_output_dir(self.out, bool(args.overwrite))
        if self.world > 1:
            dist.barrier()
        resume_step = self.checkpoints.restore(point) if point is not None else None
        self.log = (
            open_logs(self.out, args, resume_step, self.history, self.saved_step_log)
            if self.is_main
            else None
        )
        self.board = None
        if self.is_main and args.tensorboard:
            from .board import ScalarBoard

            self.board = ScalarBoard(self.folder, resume_step)

    @property
    def stop_signal(self) -> int | None:
        return self.stop.signum

    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.args, self.steps_per_epoch, self.total_steps, step)

    # --- one step -------------------------------------------------------------------------

    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        args = self.args
        fixed = self.languages.index(args.pair_language) if self.mode == "fixed" else 0
        texts, langs, arrange = select_texts(
            batch, self.mode, self.languages, self.lang_gen, fixed, with_ids=self.ask
        )
        tokens = self.model.text.tokenize(texts, langs)
        waveform = batch["audio"].to(self.device, non_blocking=True)
        lengths = batch["lengths"].to(self.device)
        input_ids = tokens["input_ids"].to(self.device)
        attention_mask = tokens["attention_mask"].to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.scheduler.get_last_lr()[0])  # the rate this step uses
        running = running_stats(self.trainable)
        saved_stats = [t.detach().clone() for t in running]  # restored if the step is skipped
        if self.grad_cache:
            chunk = args.grad_cache_chunk or args.batch_size
            loss, terms = grad_cache_backward(
                self.trainable, self.scaler, (waveform, lengths, input_ids, attention_mask),
                arrange, chunk
            )  # fmt: skip
            allreduce_gradients(self.params, self.world)
        else:
            module = self.ddp if self.ddp is not None else self.trainable
            loss, terms = module(waveform, lengths, input_ids, attention_mask, arrange)
            self.scaler.scale(loss).backward()
        value = loss.detach().float()
        if self.world > 1:
            dist.all_reduce(value)  # NaN/Inf on any rank makes every rank skip
            value /= self.world
        done = guarded_update(
            value, self.params, self.optimizer, self.scaler, self.scheduler, args.grad_clip,
            running, saved_stats,
        )  # fmt: skip
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if done.counted else 0
        self.nonfinite_total += int(done.counted)
        if self.grad_cache:  # no DDP: the ranks' running statistics are averaged here
            average_buffers(self.trainable, self.world)
        out = step_record(value, done.grad_norm, terms, self.loss_fn, self.languages)
        out.update(lr=lr, captions=float(len(texts)), skipped=int(done.skipped))
        out["nonfinite_steps"] = self.nonfinite_total
        return out

    # --- ASK knowledge bank ---------------------------------------------------------------

    @property
    def bank(self) -> Any:
        """The ASK loss's ``KnowledgeBank`` (held by reference, not a submodule)."""
        return getattr(self.loss_fn, "bank")  # noqa: B009 - loss_fn is typed as a plain Module

    def build_bank_if_due(self, epoch: int) -> None:
        """Fill (epoch 0) or refresh (every ``--ask-refresh-every`` epochs) the ASK bank."""
        langs = self.languages if self.mode == "random" else [self.args.pair_language]
        self.bank_epoch = build_bank_if_due(
            self.bank, self.bank_epoch, epoch, self.evaluator, self.train_clips, langs,
            self.rank, self.world,
        )  # fmt: skip

    # --- the loop -------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to --epochs / --max-steps, evaluating on --val-manifest and checkpointing
        after every epoch, then evaluate --test-manifest once on the chosen model.

        An epoch is *closed* by its row in ``epoch_log.jsonl`` (evaluation, best model) and the
        checkpoint after it; a run resumed from a checkpoint taken after the epoch's last step
        but before it was closed closes it first. ``summary.json``, written last, marks the run
        complete: a run killed in the test evaluation repeats only that on ``--resume``.
        """
        args = self.args
        if self.already_complete:
            return read_summary(self.out)
        if self.is_main:
            print(start_note(args), flush=True)
        with self.stop.installed():
            while self.epoch < args.epochs:
                epoch = self.epoch
                finished = self.step >= self.total_steps
                closed = bool(self.history) and self.history[-1]["step"] == self.step
                if finished and closed:
                    break
                if not finished and self.batch_in_epoch < self.steps_per_epoch:
                    self._train_epoch(epoch)
                self._close_epoch(epoch)
        if self.board is not None:
            self.board.close()
        if self.is_main and args.plots:
            from .plots import plot_run

            plot_run(self.out, chance=1 / len(self.val_clips) if self.val_clips else None)
        in_sync = self.ranks_in_sync()  # before rank 0 loads best/ for the test set
        selection = selection_record(args, self.history)
        result = {
            "step": self.step,
            "epoch": self.epoch,
            "best": self.best,
            "selection": selection,
            "test": final_test(self, selection),
            "history": self.history,
            "world_size": self.world,
            "peak_memory_mb": peak_memory_mb(self.device),
            "ranks_in_sync": in_sync,
        }
        if self.is_main:
            self.folder.write_text(
                self.out / "summary.json", json.dumps(result, indent=2, default=str)
            )
        return result

    def _train_epoch(self, epoch: int) -> None:
        """The epoch's remaining steps (up to --max-steps), with the step checkpoints."""
        args = self.args
        if self.ask and self.batch_in_epoch == 0:
            self.build_bank_if_due(epoch)
        loader, bar = epoch_loader(
            args, self.train_set, self.sampler, self.steps_per_epoch, epoch, self.batch_in_epoch,
            self.device, self.is_main,
        )  # fmt: skip
        started = time.time() - self.epoch_elapsed
        if self.device.type == "cuda" and self.batch_in_epoch == 0:
            torch.cuda.reset_peak_memory_stats(self.device)  # per-epoch peak
        self.model.train()
        for batch in loader:
            t0 = time.time()
            record = self.train_step(batch)
            self.step += 1
            self.batch_in_epoch += 1
            if not record["skipped"]:
                self.epoch_losses.append(record["loss"])
            if self.log is not None:
                row: dict[str, Any] = {
                    "step": self.step,
                    "epoch": epoch + 1,
                    "batch": self.batch_in_epoch,
                }
                row.update(record)
                row["step_time"] = time.time() - t0
                self.log.write(row)
                if self.board is not None:
                    self.board.step(row)
            self.epoch_elapsed = time.time() - started
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            if self.nonfinite_in_row >= args.max_nonfinite_steps:
                raise RuntimeError(
                    f"{self.nonfinite_in_row} steps in a row had a non-finite (NaN/Inf) loss or "
                    f"gradient, the last at step {self.step}; they were skipped, the weights "
                    f"are finite and the latest checkpoint ({self._latest_name()}) holds them. "
                    "Lower --lr, check the data, try --amp none, or raise "
                    "--max-nonfinite-steps."
                )
            saved = False
            if args.save_every_steps and self.step % args.save_every_steps == 0:
                self.save_checkpoint()
                saved = True
            self._exit_if_signalled(saved)
            if self.step >= self.total_steps:
                break
        bar.close()

    def _close_epoch(self, epoch: int) -> None:
        """Evaluate, keep the best model, write the epoch row and checkpoint."""
        summary: dict[str, Any] = {
            "epoch": epoch + 1,
            "step": self.step,
            "train_loss": float(np.mean(self.epoch_losses)) if self.epoch_losses else None,
            "nonfinite_steps": self.nonfinite_total,
            "epoch_time_s": self.epoch_elapsed,
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        summary.update(self._evaluate_and_select())
        # An extra loss call on one rank (an evaluation batch) pairs every later call with
        # a peer's other batch, unseen by each call's own exchange: the totals must agree.
        check_call_counts(self.loss_fn, f"end of the evaluation at step {self.step}")
        if self.batch_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        self.history.append(summary)
        self.epoch_losses = []
        self.epoch_elapsed = 0.0
        if self.is_main:
            self.folder.append(self.out / "epoch_log.jsonl", json.dumps(summary) + "\n")
            if self.board is not None:
                self.board.epoch(summary)
            table = self.evaluator.last_table if summary.get("metrics") else None
            print(epoch_line(summary, self.args.epochs, table), flush=True)
        self.save_checkpoint()
        self._exit_if_signalled(saved=True)

    # --- signals --------------------------------------------------------------------------

    def _exit_if_signalled(self, saved: bool) -> None:
        signum = self.stop.agreed(self.world, self.device)
        if not signum:
            return
        if not saved:
            self.save_checkpoint()
        if self.is_main:
            import signal

            print(
                f"[{signal.Signals(signum).name}] checkpoint {self._latest_name()} saved at step "
                f"{self.step}; continue with:\n  {self.resume_command()}",
                flush=True,
            )
        raise SystemExit(128 + signum)

    def resume_command(self) -> str:
        return resume_command(self.argv, self.args, self.world)

    def ranks_in_sync(self) -> bool:
        return ranks_in_sync(self.params, self.world)

    # --- evaluation -----------------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """``retrieval_report`` on the validation manifest (rank 0; the others wait)."""
        return self.evaluator.evaluate()

    def _evaluate_and_select(self) -> dict[str, Any]:
        if not self.val_clips:
            return {}
        report = self.evaluate() if self.is_main else None
        out, self.best = self.evaluator.select(
            report, self.best, self.step, self.epoch + 1, self.loss_fn, self.world
        )
        return out

    # --- checkpoints (trainer_checkpoints) -------------------------------------------------

    def state(self) -> dict[str, Any]:
        return self.checkpoints.state()

    def _latest_name(self) -> str | None:
        return self.checkpoints.published

    def save_checkpoint(self) -> Path:
        """``checkpoints/step-N`` with its manifest, then ``latest`` (see ``checkpoint.py``)."""
        return self.checkpoints.save()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the options, train, return the run's summary (errors propagate: see :func:`cli`)."""
    args = parse_args(argv)
    if args.demo:
        from .demo import prepare_demo

        prepare_demo(args)  # checks every option before it writes anything
    else:
        check_sources(args)
    started = time.time()
    trainer = Trainer(args, argv)
    try:
        result = trainer.fit()
        if trainer.is_main and not trainer.already_complete:
            seconds = time.time() - started
            title = "demo" if args.demo else "run"
            lines = closing_lines(
                trainer.out, seconds, len(trainer.val_clips), title, result.get("test")
            )
            print("\n".join(lines), flush=True)
        return result
    finally:
        # DDP's reducer must be freed while its process group is alive: destroyed the
        # other way round, gloo can abort at exit.
        del trainer
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


#: Errors of the options, the inputs or the files: exit code 2 (argparse's), one line.
USER_ERRORS = (ValueError, LookupError, OSError, ImportError)


def cli(argv: Sequence[str] | None = None) -> int:
    """The command line: errors are one line on stderr (exit 2 for bad options, inputs or
    files, 1 otherwise) without a traceback; ``--debug`` shows it."""
    raw = list(sys.argv[1:] if argv is None else argv)
    debug = any(a == "--debug" or (a.startswith("--debug=") and a != "--debug=false") for a in raw)
    try:
        main(argv)
    except Exception as err:
        if debug:
            traceback.print_exc()
        message = " ".join(str(err).split()) or type(err).__name__
        hint = "" if isinstance(err, USER_ERRORS) or debug else " (--debug shows the traceback)"
        print(f"finetune_ced_sonar.py: error: {message}{hint}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, USER_ERRORS) else 1
    return 0
