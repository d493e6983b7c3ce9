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

from .durable import (
    append_line,
    atomic_write_text,
    fsync_file,
    read_jsonl,
    warn,
    write_lines,
)


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
    checkpoint's step are dropped and both files are rewritten at once (temp file + replace):
    a kill at any moment leaves the old log or the new one."""

    def __init__(self, directory: Path, name: str, resume_step: int | None) -> None:
        self.jsonl = directory / f"{name}.jsonl"
        self.csv = directory / f"{name}.csv"
        self.columns: list[str] | None = None
        if resume_step is None:
            for path in (self.jsonl, self.csv):
                path.unlink(missing_ok=True)
            return
        kept: dict[int, dict[str, Any]] = {}
        for line_no, row in read_jsonl(self.jsonl, with_lines=True):
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise ValueError(
                    f'{self.jsonl}:{line_no}: "step" must be a positive whole number, got '
                    f"{step!r}; fix or delete the line"
                )
            if step <= resume_step:
                kept[step] = row  # a repeated step (an older trainer's log): the last one wins
        rows = [kept[step] for step in sorted(kept)]
        if len(rows) != resume_step and self.jsonl.is_file():
            warn(f"{self.jsonl}: {resume_step - len(rows)} of steps 1-{resume_step} missing")
        write_lines(self.jsonl, [json.dumps(row) + "\n" for row in rows])
        if rows:
            self.columns = list(rows[0])
            write_lines(self.csv, [self._csv_line(None)] + [self._csv_line(r) for r in rows])
        else:
            self.csv.unlink(missing_ok=True)

    def _csv_line(self, row: dict[str, Any] | None) -> str:
        assert self.columns is not None
        buffer = io.StringIO()
        values = self.columns if row is None else [row.get(c, "") for c in self.columns]
        csv.writer(buffer).writerow(values)
        return buffer.getvalue()

    def write(self, row: dict[str, Any]) -> None:
        append_line(self.jsonl, json.dumps(row) + "\n")
        if self.columns is None:
            self.columns = list(row)
            write_lines(self.csv, [self._csv_line(None)])
        append_line(self.csv, self._csv_line(row))

    def sync(self) -> None:
        """fsync both files (before a checkpoint that counts their rows is published)."""
        fsync_file(self.jsonl)
        fsync_file(self.csv)


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


def open_logs(
    out: Path, args: Any, resume_step: int | None, history: list[dict[str, Any]]
) -> StepLog:
    """The step log (rows after ``resume_step`` dropped), ``epoch_log.jsonl`` rewritten from
    the checkpoint's history (rows written after it, a kill before the next checkpoint, are
    dropped, not duplicated) and ``config.json``."""
    log = StepLog(out, "train_log", resume_step)
    epoch_log = out / "epoch_log.jsonl"
    if resume_step is None:
        epoch_log.unlink(missing_ok=True)
    else:
        write_lines(epoch_log, [json.dumps(h) + "\n" for h in history])
    atomic_write_text(out / "config.json", json.dumps(vars(args), indent=2, default=str))
    return log
