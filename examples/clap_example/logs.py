"""The run's logs: per-step rows (JSONL + CSV) and the metric helpers that fill them."""

from __future__ import annotations

import csv
import io
import json
import math
import resource
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .durable import warn
from .log_history import StepHistory
from .run_folder import MAX_LOG_BYTES, RunFolder, RunFolderError


def to_float(value: Any) -> float | None:
    if isinstance(value, Tensor):
        if value.numel() == 0:
            return None
        return float(value.detach().float().mean())
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        return float(value)
    return None


def flatten_metrics(obj: Any, prefix: str = "") -> dict[str, float]:
    """Nested dicts/lists of numbers -> ``{"a/b/c": float}``; non-numbers are dropped."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten_metrics(value, f"{prefix}{key}/"))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(flatten_metrics(value, f"{prefix}{i}/"))
    else:
        value = to_float(obj)
        if value is not None and math.isfinite(value):
            out[prefix.rstrip("/")] = value
    return out


class StepLog:
    """Per-step JSONL + CSV, one appended line per step. On resume the rows after the
    checkpoint's step are dropped, rows up to it that are missing (a deleted or shortened file)
    are recreated from the checkpoint's step history with a warning naming the file, and both
    files are rewritten at once (temp file + replace): a kill at any moment leaves the old log
    or the new one. :attr:`history` holds the rows for the next checkpoint. A log the run folder
    refuses (a link, FIFO or device, or over :data:`run_folder.MAX_LOG_BYTES`) is named in a
    warning and replaced, its rows recreated from the checkpoint as for a missing log."""

    def __init__(
        self, directory: Path, name: str, resume_step: int | None, saved: Any = None
    ) -> None:
        self.folder = RunFolder(directory)
        self.jsonl = directory / f"{name}.jsonl"
        self.csv = directory / f"{name}.csv"
        self.columns: list[str] | None = None
        self.history = StepHistory()
        if resume_step is None:
            for path in (self.jsonl, self.csv):
                self.folder.remove(path)
            return
        kept = self._rows_up_to(resume_step)
        self._recreate(kept, resume_step, saved)
        rows = [kept[step] for step in sorted(kept)]
        self._check_csv(resume_step, len(rows))
        self.folder.write_lines(self.jsonl, [json.dumps(row) + "\n" for row in rows])
        if rows:
            self.columns = list(rows[0])
            lines = [self._csv_line(None)] + [self._csv_line(r) for r in rows]
            self.folder.write_lines(self.csv, lines)
        else:
            self.folder.remove(self.csv)
        for row in rows:
            self.history.append(row)

    def _rows_up_to(self, resume_step: int) -> dict[int, dict[str, Any]]:
        kept: dict[int, dict[str, Any]] = {}
        try:
            logged = self.folder.read_jsonl(self.jsonl, with_lines=True)
        except RunFolderError as err:
            warn(f"{err}; not read")
            logged = []
            self.folder.remove(self.jsonl)
        for line_no, row in logged:
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise ValueError(
                    f'{self.jsonl}:{line_no}: "step" must be a positive whole number, got '
                    f"{step!r}; fix or delete the line"
                )
            if step <= resume_step:
                kept[step] = row  # a repeated step (an older trainer's log): the last one wins
        return kept

    def _recreate(self, kept: dict[int, dict[str, Any]], resume_step: int, saved: Any) -> None:
        """Fill the steps up to ``resume_step`` missing from ``kept`` from the checkpoint's
        step history (``saved``), saying so: a resume never continues a shortened log
        silently."""
        missing = [step for step in range(1, resume_step + 1) if step not in kept]
        if not missing:
            return
        recorded: dict[int, dict[str, Any]] = {}
        why = "the checkpoint holds no step history (written by an older trainer)"
        if saved is not None:
            try:
                recorded = StepHistory.from_state(saved).by_step()
            except ValueError as err:
                why = f"the checkpoint's step history is not usable ({err})"
        recreated = [step for step in missing if step in recorded]
        for step in recreated:
            kept[step] = recorded[step]
        lost = len(missing) - len(recreated)
        found = "missing" if not self.jsonl.exists() else "shorter than the checkpoint's step"
        message = (
            f"{self.jsonl}: {found}: {len(missing)} of the {resume_step} rows of steps "
            f"1-{resume_step} missing; {len(recreated)} recreated from the checkpoint's step "
            "history"
        )
        if lost:
            message += f", {lost} cannot be: {why}"
        warn(message)

    def _check_csv(self, resume_step: int, rows: int) -> None:
        """Warn when the CSV held fewer rows up to ``resume_step`` than it is rewritten with."""
        try:
            had = csv_steps(self.folder, self.csv, resume_step)
        except RunFolderError as err:
            warn(f"{err}; not read")
            self.folder.remove(self.csv)
            had = None
        if had is None and rows:
            warn(f"{self.csv}: missing; rewritten from {self.jsonl.name} ({rows} rows)")
        elif had is not None and had < rows:
            warn(
                f"{self.csv}: {rows - had} of the rows of steps 1-{resume_step} missing; "
                f"rewritten from {self.jsonl.name} ({rows} rows)"
            )

    def _csv_line(self, row: dict[str, Any] | None) -> str:
        assert self.columns is not None
        buffer = io.StringIO()
        values = self.columns if row is None else [row.get(c, "") for c in self.columns]
        csv.writer(buffer).writerow(values)
        return buffer.getvalue()

    def write(self, row: dict[str, Any]) -> None:
        self.folder.append(self.jsonl, json.dumps(row) + "\n")
        if self.columns is None:
            self.columns = list(row)
            self.folder.write_lines(self.csv, [self._csv_line(None)])
        self.folder.append(self.csv, self._csv_line(row))
        self.history.append(row)

    def sync(self) -> None:
        """fsync both files (before a checkpoint that counts their rows is published)."""
        self.folder.fsync(self.jsonl)
        self.folder.fsync(self.csv)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (each epoch); CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def step_record(
    loss: Tensor, grad_norm: Tensor, terms: Any, loss_fn: torch.nn.Module, languages: list[str]
) -> dict[str, float]:
    """A step's log row: loss, gradient norm, the loss's terms (per language where a term
    has one value per language) and its scalar parameters (temperature, radius, ...)."""
    out: dict[str, float] = {"loss": float(loss), "grad_norm": float(grad_norm)}
    for key, term in (terms or {}).items():
        if isinstance(term, Tensor) and 1 < term.numel() <= 64:
            names = languages if term.numel() == len(languages) else None
            for i, v in enumerate(term.detach().float().reshape(-1).tolist()):
                out[f"terms/{key}/{names[i] if names else i}"] = v
            continue
        number = to_float(term)
        if number is not None:
            out[f"terms/{key}"] = number
    for name, param in loss_fn.named_parameters():
        if param.dim() == 0:  # temperature, static radius, SigLIP scale/bias
            out[f"param/{name}"] = float(param.detach())
    return out


def csv_steps(folder: RunFolder, path: Path, up_to: int) -> int | None:
    """How many distinct steps up to ``up_to`` the CSV log holds (None: no such file);
    unreadable lines count as missing."""
    data = folder.read_bytes(path, MAX_LOG_BYTES)
    if data is None:
        return None
    lines = data.decode("utf-8", errors="replace").splitlines()
    try:
        reader = csv.reader(lines)
        header = next(reader, [])
        column = header.index("step")
        steps = set()
        for values in reader:
            try:
                step = int(values[column])
            except (IndexError, ValueError):
                continue
            if 1 <= step <= up_to:
                steps.add(step)
    except (csv.Error, ValueError):
        return 0
    return len(steps)


def check_epoch_log(
    folder: RunFolder, path: Path, history: list[dict[str, Any]], resume_step: int
) -> None:
    """Warn when ``epoch_log.jsonl`` lacks rows of the checkpoint's history (it is then
    rewritten from the history: nothing continues silently)."""
    if not history:
        return
    try:
        present = {(r.get("epoch"), r.get("step")) for r in folder.read_jsonl(path)}
    except ValueError as err:
        warn(f"{err}; rewritten from the checkpoint's history ({len(history)} rows)")
        return
    missing = sum((h.get("epoch"), h.get("step")) not in present for h in history)
    if missing:
        found = "missing" if not path.exists() else "shorter than the checkpoint's history"
        warn(
            f"{path}: {found}: {missing} of the {len(history)} rows up to step {resume_step} "
            "missing; recreated from the checkpoint's history"
        )


def open_logs(
    out: Path,
    args: Any,
    resume_step: int | None,
    history: list[dict[str, Any]],
    step_history: Any = None,
) -> StepLog:
    """The step log (rows after ``resume_step`` dropped, missing ones recreated from
    ``step_history``, the checkpoint's), ``epoch_log.jsonl`` rewritten from the checkpoint's
    history (rows written after it, a kill before the next checkpoint, are dropped, not
    duplicated; rows missing from it are recreated, with a warning) and ``config.json``."""
    folder = RunFolder(out)
    log = StepLog(out, "train_log", resume_step, step_history)
    epoch_log = out / "epoch_log.jsonl"
    if resume_step is None:
        folder.remove(epoch_log)
    else:
        check_epoch_log(folder, epoch_log, history, resume_step)
        folder.write_lines(epoch_log, [json.dumps(h) + "\n" for h in history])
    folder.write_text(out / "config.json", json.dumps(vars(args), indent=2, default=str))
    return log
