"""What a run prints: one progress bar and one line per epoch, and a closing block that says
what happened (loss from -> to, validation and test R@1 against chance, where the plots and
logs are). Full tables go to files (``eval/step-*.md``, ``eval/test-step-*.md``), not to the
console."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from .durable import warn
from .evaluation import is_r1
from .run_folder import RunFolder


class PlainBar:
    """The progress bar without tqdm: one line rewritten in place on a terminal (nothing when
    the output is not a terminal), cleared when the epoch ends."""

    def __init__(self, total: int, initial: int, desc: str, disable: bool) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.disable = disable or not sys.stderr.isatty()
        self.postfix = ""
        self.last = 0.0

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.disable and (time.time() - self.last > 0.2 or self.n >= self.total):
            self.last = time.time()
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} steps {self.postfix}")
            sys.stderr.flush()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.disable:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def progress_bar(total: int, initial: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar when tqdm is installed (cleared at the end of the epoch), else a
    :class:`PlainBar`."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return PlainBar(total, initial, desc, disable=not enabled)
    return tqdm(
        total=total, initial=initial, desc=desc, disable=not enabled, leave=False,
        dynamic_ncols=True,
    )  # fmt: skip


def mean_r1(metrics: dict[str, float]) -> dict[str, float]:
    """Mean R@1 over languages per direction: ``{"t2a": ..., "a2t": ...}`` (those present)."""
    out: dict[str, float] = {}
    for direction in ("t2a", "a2t"):
        values = [
            v
            for k, v in metrics.items()
            if k.startswith("per_language/") and is_r1(k) and f"/{direction}/" in k
        ]
        if values:
            out[direction] = sum(values) / len(values)
    return out


def epoch_line(summary: dict[str, Any], epochs: int, table: Path | None) -> str:
    """``epoch 3/30  step 15  loss 2.345  val R@1 t2a 0.40 a2t 0.35 (best)  1.2 s``."""
    parts = [f"epoch {summary['epoch']}/{epochs}", f"step {summary['step']}"]
    if summary.get("train_loss") is not None:
        parts.append(f"loss {summary['train_loss']:.4f}")
    r1 = mean_r1(summary.get("metrics") or {})
    if r1:
        shown = " ".join(f"{k} {v:.2f}" for k, v in r1.items())
        parts.append(f"val R@1 {shown}" + (" (best)" if summary.get("best") else ""))
    if summary.get("nonfinite_steps"):
        parts.append(f"{summary['nonfinite_steps']} non-finite steps skipped")
    parts.append(f"{summary.get('epoch_time_s', 0.0):.1f} s")
    if table is not None:
        parts.append(f"table {table.parent.name}/{table.name}")
    return "  ".join(parts)


def closing_lines(
    run: Path,
    seconds: float,
    n_val: int,
    title: str = "run",
    test: dict[str, Any] | None = None,
) -> list[str]:
    """The run's closing block (at most 10 lines), read from its logs: validation R@1 from
    the first to the last epoch, and ``test``, the final test evaluation (``final_test``)."""
    folder = RunFolder(run)
    epoch_log = run / "epoch_log.jsonl"
    try:
        rows = folder.read_jsonl(epoch_log)
    except ValueError as err:
        warn(f"{err}; not summarised")
        rows = []
    losses = [r["train_loss"] for r in rows if r.get("train_loss") is not None]
    steps = rows[-1]["step"] if rows else 0
    lines = [f"{title} finished in {seconds:.0f} s ({len(rows)} epochs, {steps} steps)"]
    if losses:
        fall = 100 * (1 - losses[-1] / losses[0]) if losses[0] else 0.0
        lines.append(
            f"  training loss  {losses[0]:.3f} -> {losses[-1]:.3f} ({fall:.0f}% lower, "
            "mean per epoch)"
        )
    first = mean_r1(rows[0].get("metrics") or {}) if rows else {}
    last = mean_r1(rows[-1].get("metrics") or {}) if rows else {}
    names = {"t2a": "text->audio", "a2t": "audio->text"}
    if last and n_val:
        for key, value in last.items():
            lines.append(
                f"  val set R@1    {names[key]} {first.get(key, float('nan')):.2f} -> "
                f"{value:.2f} (mean over languages; chance {1 / n_val:.2f})"
            )
    if test:
        shown = ", ".join(f"{names[k]} {v:.2f}" for k, v in mean_r1(test["metrics"]).items())
        lines.append(
            f"  test set R@1   {shown} on {test['model']} (epoch {test['epoch']}; chance "
            f"{1 / test['clips']:.2f})"
        )
    plots = run / "plots"
    if folder.is_file(plots / "summary.png"):
        lines.append(f"  summary plot   {plots / 'summary.png'}")
        others = sorted(p.name for p in plots.glob("*.png") if p.name != "summary.png")
        if others:
            lines.append(f"  other plots    {plots}/ ({', '.join(others)})")
    lines.append(f"  logs           {run / 'train_log.csv'}, {epoch_log}")
    if (run / "eval").is_dir():
        lines.append(f"  tables         {run / 'eval'}/ (step-*.md per epoch, test-step-*.md)")
    if (run / "best").is_dir():
        lines.append(f"  best model     {run / 'best'}/")
    return lines
