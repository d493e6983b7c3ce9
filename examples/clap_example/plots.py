"""PNG plots of a run, from its logs.

``plots/summary.png`` is the one to open first, readable in ten seconds: the training loss (raw
and smoothed) with its terms; the loss's parameters, one axis per unit (:func:`params_panel`); the
validation set's R@1 per epoch (mean over languages, both directions) against chance; and the
last epoch's R@1 per language as bars (the test set is evaluated once, after the plots:
``summary.json``). Beside it, in more detail: ``loss.png`` (every term, per language
too), ``retrieval_r1.png`` (R@1 per language, one panel per direction) and
``lr_and_params.png`` (learning rate and each scalar parameter on its own axis).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import MaxNLocator

from .durable import warn
from .run_folder import RunFolder

#: Step-log keys drawn as loss parameters (own axes), not as loss terms.
_PARAM_WORDS = ("temperature", "radius", "scale", "bias", "reliability")
_DIRECTIONS = {"t2a": "text \u2192 audio", "a2t": "audio \u2192 text"}


def smooth(values: Sequence[float], window: int | None = None) -> np.ndarray:
    """Trailing moving average (``window`` default: a 15th of the series, at least 3 points),
    NaNs skipped."""
    x = np.asarray(values, dtype=float)
    window = window or max(3, len(x) // 15)
    out = np.full_like(x, np.nan)
    for i in range(len(x)):
        part = x[max(0, i - window + 1) : i + 1]
        part = part[np.isfinite(part)]
        if part.size:
            out[i] = part.mean()
    return out


def _is_param(key: str) -> bool:
    return key.startswith("param/") or any(w in key.lower() for w in _PARAM_WORDS)


def _series(steps: list[dict[str, Any]], key: str) -> list[float]:
    return [float(row.get(key, float("nan"))) for row in steps]


def _present(steps: list[dict[str, Any]], prefix: str) -> list[str]:
    keys = sorted({k for row in steps for k in row if k.startswith(prefix)})
    return [k for k in keys if any(np.isfinite(_series(steps, k)))]


def r1_by_language(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{direction: {language: R@1}}`` from flattened ``per_language/<lang>/<dir>/R@1``."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "per_language" and parts[3] == "R@1":
            out.setdefault(parts[2], {})[parts[1]] = float(value)
    return out


def _loss_axis(ax: Any, steps: list[dict[str, Any]], per_language: bool) -> None:
    x = [row["step"] for row in steps]
    loss = _series(steps, "loss")
    ax.plot(x, loss, color="tab:blue", lw=0.8, alpha=0.35, label="loss (per step)")
    ax.plot(x, smooth(loss), color="tab:blue", lw=2.2, label="loss (smoothed)")
    terms = [k for k in _present(steps, "terms/") if not _is_param(k)]
    if not per_language:
        terms = [k for k in terms if k.count("/") == 1]
    colors = iter(["tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive"])
    for key in terms:
        ax.plot(
            x, smooth(_series(steps, key)), lw=1.0, ls="--", color=next(colors, None),
            label=key.removeprefix("terms/") + " (smoothed)",
        )  # fmt: skip
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)


#: The parameter panel's axes, one per unit: (its y label, whether a key belongs on it).
#: Radius statistics share one axis (a distance in the normalised embedding space); the share
#: of anchors whose radius passes ``||a - t||`` and the radius slope each get their own.
_PARAM_UNITS: tuple[tuple[str, Any], ...] = (
    ("temperature", lambda k: "temperature" in k or "scale" in k),
    ("radius", lambda k: "radius" in k and "over_distance" not in k and "slope" not in k
     and not k.endswith("radius_std")),
    ("share R > \u2016a \u2212 t\u2016", lambda k: "radius_over_distance" in k),
    ("radius slope", lambda k: "radius_slope" in k),
)  # fmt: skip
#: At most this many parameter axes in summary.png (every parameter: lr_and_params.png).
_MAX_PARAM_AXES = 4


def param_groups(steps: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The logged loss parameters grouped by unit, one ``(label, keys)`` per axis of the
    summary's parameter panel; a key of no known unit gets an axis of its own."""
    keys = [k for k in _present(steps, "terms/") + _present(steps, "param/") if _is_param(k)]
    groups: list[tuple[str, list[str]]] = []
    for label, belongs in _PARAM_UNITS:
        chosen = [k for k in keys if belongs(k)]
        if chosen:
            groups.append((label, chosen))
    placed = {k for _, chosen in groups for k in chosen}
    known = ("radius_std",)
    groups += [(k.split("/", 1)[1], [k]) for k in keys if k not in placed and not k.endswith(known)]
    return groups[:_MAX_PARAM_AXES]


def params_panel(fig: Any, spec: Any, steps: list[dict[str, Any]]) -> list[Any]:
    """The summary's "Loss parameters" panel in ``spec``: one axis per unit
    (:func:`param_groups`) stacked over a shared step axis, each series labelled in a legend
    to the right of its axis, outside the lines. Returns the axes (none: nothing logged)."""
    groups = param_groups(steps)
    if not groups:
        return []
    x = [row["step"] for row in steps]
    inner = spec.subgridspec(len(groups), 1, hspace=0.15)
    axes: list[Any] = []
    for i, (label, keys) in enumerate(groups):
        ax = fig.add_subplot(inner[i], sharex=axes[0] if axes else None)
        styles = iter(["-", "--", ":", "-."])
        for key in keys:
            values = _series(steps, key)
            fixed = " (fixed)" if np.nanmax(values) == np.nanmin(values) else ""
            ax.plot(x, values, lw=1.5, ls=next(styles, "-"), label=key.split("/", 1)[1] + fixed)
        ax.set_ylabel(label, fontsize=9)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        ax.grid(alpha=0.3)
        if i < len(groups) - 1:
            ax.tick_params(labelbottom=False)
        axes.append(ax)
    axes[-1].set_xlabel("training step")
    return axes


def _r1_epochs(ax: Any, epochs: list[dict[str, Any]], chance: float | None) -> None:
    x = [row["epoch"] for row in epochs]
    both: list[list[float]] = [[] for _ in epochs]
    for direction, label in _DIRECTIONS.items():
        ys = []
        for i, row in enumerate(epochs):
            values = list(r1_by_language(row["metrics"]).get(direction, {}).values())
            ys.append(float(np.mean(values)) if values else float("nan"))
            both[i] += values
        if any(np.isfinite(ys)):
            ax.plot(x, ys, marker="o", ms=3, lw=1.2, label=label)
    ax.plot(
        x, [float(np.mean(v)) if v else np.nan for v in both], color="black", lw=2.4,
        label="mean of both",
    )  # fmt: skip
    _chance_line(ax, chance)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("R@1 (mean over languages)")
    ax.legend(fontsize=9, loc="best")
    ax.grid(alpha=0.3)


def _chance_line(ax: Any, chance: float | None) -> None:
    if chance is not None:
        ax.axhline(chance, color="gray", ls=":", lw=1.5, label=f"chance ({chance:.2f})")


def _final_bars(ax: Any, row: dict[str, Any], chance: float | None) -> None:
    table = r1_by_language(row["metrics"])
    languages = sorted({lang for values in table.values() for lang in values})
    width = 0.8 / max(len(table), 1)
    xs = np.arange(len(languages))
    for i, (direction, values) in enumerate(sorted(table.items(), reverse=True)):
        heights = [values.get(lang, np.nan) for lang in languages]
        bars = ax.bar(xs + (i - (len(table) - 1) / 2) * width, heights, width,
                      label=_DIRECTIONS.get(direction, direction))  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    _chance_line(ax, chance)
    ax.set_xticks(xs, [lang.split("_")[0] for lang in languages])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("R@1")
    ax.legend(fontsize=9, loc="upper right", ncol=3)


def summary_figure(plt: Any, out_dir: Path, steps: list, epochs: list, chance: float | None) -> Any:
    fig = plt.figure(figsize=(14, 8.5))
    grid = fig.add_gridspec(2, 2)
    loss_ax = fig.add_subplot(grid[0, 0])
    r1_ax, bar_ax = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    if steps:
        _loss_axis(loss_ax, steps, per_language=False)
        loss_ax.legend(fontsize=9, loc="upper right")
        first, last = smooth(_series(steps, "loss"))[[0, -1]]
        loss_ax.set_title(f"Training loss: {first:.2f} \u2192 {last:.2f} (smoothed)")
        param_axes = params_panel(fig, grid[0, 1], steps)
        if param_axes:
            param_axes[0].set_title("Loss parameters, one axis per unit")
        else:
            empty = fig.add_subplot(grid[0, 1])
            empty.text(0.5, 0.5, "no temperature or radius logged", ha="center")
            empty.set_axis_off()
    if epochs:
        _r1_epochs(r1_ax, epochs, chance)
        r1_ax.set_title("VALIDATION SET: R@1 per epoch (higher is better)")
        _final_bars(bar_ax, epochs[-1], chance)
        bar_ax.set_title(f"VALIDATION SET: R@1 per language after epoch {epochs[-1]['epoch']}")
    else:
        for ax in (r1_ax, bar_ax):
            ax.text(0.5, 0.5, "no validation set (--val-manifest)", ha="center")
            ax.set_axis_off()
    headline = [f"Run {out_dir}"]
    if epochs:
        both = [v for t in r1_by_language(epochs[-1]["metrics"]).values() for v in t.values()]
        if both:
            headline.append(f"last validation R@1 {np.mean(both):.2f}")
            if chance is not None:
                headline[-1] += f" (chance {chance:.2f})"
    fig.suptitle("   |   ".join(headline), fontsize=13, fontweight="bold")
    fig.tight_layout()
    return fig


def plot_run(out_dir: str | Path, chance: float | None = None) -> list[Path]:
    """Write ``plots/summary.png`` and the detailed plots under ``out_dir``; ``chance`` is the
    R@1 of a random ranking (1 / validation clips), drawn as a line. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    folder = RunFolder(out_dir)
    plots = out_dir / "plots"
    folder.dir(plots, create=True)
    steps, epochs = _rows(folder, "train_log.jsonl"), _rows(folder, "epoch_log.jsonl")
    epochs = [row for row in epochs if row.get("metrics")]
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        written.append(plots / name)
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=100)
        plt.close(fig)
        folder.write_bytes(written[-1], image.getvalue())

    if steps or epochs:
        save(summary_figure(plt, out_dir, steps, epochs, chance), "summary.png")
    if steps:
        fig, ax = plt.subplots(figsize=(10, 5))
        _loss_axis(ax, steps, per_language=True)
        ax.set_title("Training loss and its terms (terms smoothed)")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        save(fig, "loss.png")
        save(_lr_and_params(plt, steps), "lr_and_params.png")
    if epochs:
        save(_retrieval(plt, epochs, chance), "retrieval_r1.png")
    return written


def _rows(folder: RunFolder, name: str) -> list[dict[str, Any]]:
    """A log's rows for the plots; a log the run folder refuses is named and not plotted."""
    try:
        return folder.read_jsonl(folder.root / name)
    except ValueError as err:
        warn(f"{err}; not plotted")
        return []


def _lr_and_params(plt: Any, steps: list[dict[str, Any]]) -> Any:
    x = [row["step"] for row in steps]
    keys = [k for k in _present(steps, "terms/") + _present(steps, "param/") if _is_param(k)]
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(4.5 * (1 + len(keys)), 3.6), squeeze=False)
    axes[0][0].plot(x, _series(steps, "lr"), color="tab:green")
    axes[0][0].set_title("learning rate")
    for ax, key in zip(axes[0][1:], keys, strict=True):
        ax.plot(x, _series(steps, key))
        ax.set_title(key.split("/", 1)[1])
    for ax in axes[0]:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _retrieval(plt: Any, epochs: list[dict[str, Any]], chance: float | None) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    x = [row["epoch"] for row in epochs]
    for ax, (direction, label) in zip(axes, _DIRECTIONS.items(), strict=True):
        tables = [r1_by_language(row["metrics"]).get(direction, {}) for row in epochs]
        for lang in sorted({lang for t in tables for lang in t}):
            ax.plot(x, [t.get(lang, np.nan) for t in tables], marker="o", ms=3, lw=1, label=lang)
        means = [float(np.mean(list(t.values()))) if t else np.nan for t in tables]
        ax.plot(x, means, color="black", lw=2.4, label="mean")
        _chance_line(ax, chance)
        ax.set_title(f"VALIDATION SET R@1, {label}")
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="upper left")
    axes[0].set_ylabel("R@1")
    fig.tight_layout()
    return fig
