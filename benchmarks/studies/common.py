"""Shared pieces of the controlled studies: synthetic data, tiny encoders, the training
loop, evaluation through :mod:`contrastive_losses.metrics`, seed statistics, plots and
result files.

The synthetic world: latent "meanings" ``z`` drawn around cluster centres (items of one
cluster are each other's hard negatives); every modality (audio, text in language k) is
a fixed random nonlinear view of ``z`` plus noise. A view is a two-layer random network
``tanh(z W1) W2``; a language's view is the English one rotated towards an independent
random network by an angle (0: English itself, pi/2: unrelated surface form).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import Tensor, nn

from contrastive_losses import metrics

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))
from timing import machine, markdown_table  # noqa: E402

RESULTS = BENCHMARKS / "results" / "studies"
QUICK_RESULTS = BENCHMARKS / "results" / "quick" / "studies"


# ----------------------------------------------------------------------- command line


def parse_args(
    doc: str,
    *,
    epochs: int,
    seeds: int,
    quick_epochs: int = 3,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """``--epochs``, ``--seeds``, ``--quick`` (2 seeds, ``quick_epochs`` epochs, results
    into ``results/quick/studies/``: a check that the script runs), ``--out-dir``,
    ``--render`` (no training: rewrite the markdown and plots from the saved JSON);
    ``extra(parser)`` adds a study's own arguments."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(parser)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--seeds", type=int, default=seeds, help="seeds 0 .. n-1")
    parser.add_argument("--quick", action="store_true", help="2 seeds, a few epochs")
    parser.add_argument("--out-dir", type=Path, help="default: benchmarks/results/studies")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--render", action="store_true", help="no training: re-render md and PNGs from the JSON"
    )
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.seeds = min(args.epochs, quick_epochs), min(args.seeds, 2)
    if args.out_dir is None:
        args.out_dir = QUICK_RESULTS if args.quick else RESULTS
    torch.set_num_threads(args.threads)
    return args


# ----------------------------------------------------------------------- synthetic data


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def zipf_weights(n: int, exponent: float) -> Tensor:
    """``p_c`` proportional to ``(c + 1) ** -exponent`` (0: uniform; ~1: long tail)."""
    w = torch.arange(1, n + 1, dtype=torch.float64) ** -exponent
    return (w / w.sum()).float()


@dataclass
class Latents:
    centres: Tensor  # (C, L)
    weights: Tensor  # (C,) cluster frequencies

    @classmethod
    def make(cls, g: torch.Generator, clusters: int, latent: int, zipf: float = 0.0) -> Latents:
        return cls(torch.randn(clusters, latent, generator=g), zipf_weights(clusters, zipf))

    def sample(
        self, g: torch.Generator, n: int, spread: float, *, balanced: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``n`` latents and their cluster labels: by the cluster frequencies, or
        ``balanced`` (the same count per cluster, for a test set that weighs the tail)."""
        c = len(self.centres)
        if balanced:
            labels = torch.arange(n) % c
        else:
            labels = torch.multinomial(self.weights, n, replacement=True, generator=g)
        z = self.centres[labels] + spread * torch.randn(n, self.centres.shape[1], generator=g)
        return z, labels


class RandomView:
    """A fixed random nonlinear map ``x = tanh(z W1) W2`` (scaled to unit-ish variance)."""

    def __init__(self, w1: Tensor, w2: Tensor) -> None:
        self.w1, self.w2 = w1, w2

    @classmethod
    def make(cls, g: torch.Generator, d_in: int, d_out: int, hidden: int = 64) -> RandomView:
        w1 = torch.randn(d_in, hidden, generator=g) * (2.0 / d_in) ** 0.5
        w2 = torch.randn(hidden, d_out, generator=g) / hidden**0.5
        return cls(w1, w2)

    def rotated(self, g: torch.Generator, angle: float) -> RandomView:
        """The view ``cos(angle) * self + sin(angle) * other`` for an independent random
        ``other`` (weight by weight): 0 is this view, pi/2 an unrelated one."""
        other = RandomView.make(g, self.w1.shape[0], self.w2.shape[1], self.w1.shape[1])
        c, s = math.cos(angle), math.sin(angle)
        return RandomView(c * self.w1 + s * other.w1, c * self.w2 + s * other.w2)

    def __call__(self, z: Tensor, g: torch.Generator, noise: float) -> Tensor:
        x = torch.tanh(z @ self.w1) @ self.w2
        return x + noise * torch.randn(x.shape, generator=g)


def paired_clusters(
    seed: int,
    n_train: int,
    n_test: int,
    *,
    clusters: int = 32,
    latent: int = 16,
    spread: float = 0.6,
    noise: float = 0.3,
    zipf: float = 0.0,
    balanced_test: bool = False,
    mismatch: float = 0.0,
    dims: tuple[int, int] = (64, 48),
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Audio-text pairs: one latent per pair, an audio view and a text view of it.

    ``mismatch``: share of *training* pairs whose caption is swapped with another such
    pair's (wrong captions, as in web-crawled audio-caption data); the test set is clean.

    Returns ``(train, test)`` dicts with ``audio (N, 64)``, ``text (N, 48)``, ``label
    (N,)`` (the cluster of the audio).
    """
    g = generator(1000 + seed)
    lat = Latents.make(g, clusters, latent, zipf)
    view_a = RandomView.make(g, latent, dims[0])
    view_t = RandomView.make(g, latent, dims[1])
    out = []
    for n, balanced in ((n_train, False), (n_test, balanced_test)):
        z, label = lat.sample(g, n, spread, balanced=balanced)
        out.append({"audio": view_a(z, g, noise), "text": view_t(z, g, noise), "label": label})
    if mismatch > 0:
        swap = torch.randperm(n_train, generator=g)[: int(mismatch * n_train)]
        text = out[0]["text"]
        text[swap] = text[swap[torch.randperm(len(swap), generator=g)]]
    return out[0], out[1]


def multilingual(
    seed: int,
    n_train: int,
    n_test: int,
    languages: dict[str, float],
    *,
    clusters: int = 64,
    latent: int = 16,
    spread: float = 0.7,
    noise: float = 0.3,
    dims: tuple[int, int] = (64, 48),
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Clips with one caption per language: ``audio (N, 64)``, ``text (N, K, 48)``.

    ``languages`` maps each name to the angle of its view from English's (the first,
    angle 0): the meaning ``z`` is shared, the surface form differs.
    """
    g = generator(2000 + seed)
    lat = Latents.make(g, clusters, latent)
    view_a = RandomView.make(g, latent, dims[0])
    english = RandomView.make(g, latent, dims[1])
    views = [english.rotated(g, angle) for angle in languages.values()]
    out = []
    for n in (n_train, n_test):
        z, label = lat.sample(g, n, spread)
        text = torch.stack([view(z, g, noise) for view in views], dim=1)  # (N, K, Dt)
        out.append({"audio": view_a(z, g, noise), "text": text, "label": label})
    return out[0], out[1]


# ----------------------------------------------------------------------- models, training


def mlp(d_in: int, d_out: int = 32, hidden: int = 128, layers: int = 1) -> nn.Module:
    """``layers`` hidden ReLU layers of width ``hidden``, then a linear projection."""
    mods: list[nn.Module] = []
    d = d_in
    for _ in range(layers):
        mods += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    mods.append(nn.Linear(d, d_out))
    return nn.Sequential(*mods)


@torch.no_grad()
def embed(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` in eval mode, without gradient (train mode restored)."""
    was = module.training
    module.eval()
    try:
        return module(x)
    finally:
        module.train(was)


StepResult = Tensor | tuple[Tensor, Callable[[], None]]


def train(
    params: Sequence[nn.Parameter] | Sequence[dict[str, Any]],
    n: int,
    *,
    epochs: int,
    batch: int,
    seed: int,
    step: Callable[[Tensor, int], StepResult],
    start_epoch: Callable[[int], None] | None = None,
    end_epoch: Callable[[int], None] | None = None,
    lr: float = 1e-3,
    batches: Callable[[torch.Generator], Sequence[Tensor]] | None = None,
    schedule: Callable[[float], float] | None = None,
) -> None:
    """Adam over ``params`` (or Adam's parameter-group dicts); each epoch visits the ``n``
    training items in a seeded random order, in batches of ``batch`` (a last batch of one
    item is dropped). ``batches``, if given, makes each epoch's batches instead (called
    with the seeded generator). ``schedule``, if given, multiplies every group's learning
    rate at each step by ``schedule(fraction of training done)``.

    ``step(idx, epoch)`` returns the loss of the batch ``idx``, or ``(loss, after)`` with
    ``after()`` called right after the optimiser step (for before/after measurements).
    """
    opt = torch.optim.Adam(list(params), lr=lr)
    initial = [group["lr"] for group in opt.param_groups]
    order = generator(seed)
    steps_per_epoch = max(1, n // batch)
    done = 0
    for epoch in range(epochs):
        if start_epoch is not None:
            start_epoch(epoch)
        epoch_batches = (
            batches(order) if batches else torch.randperm(n, generator=order).split(batch)
        )
        for idx in epoch_batches:
            if len(idx) < 2:
                continue
            if schedule is not None:
                factor = schedule(min(done / (epochs * steps_per_epoch), 1.0))
                for group, start in zip(opt.param_groups, initial, strict=True):
                    group["lr"] = start * factor
            done += 1
            out = step(idx, epoch)
            loss, after = out if isinstance(out, tuple) else (out, None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after is not None:
                after()
        if end_epoch is not None:
            end_epoch(epoch)


def r_at_1(audio: Tensor, text: Tensor) -> dict[str, float]:
    """Held-out T2A and A2T R@1 (one caption per clip), via ``metrics``."""
    out = metrics.audio_text_retrieval(audio, text, k=(1,), map_k=1)
    return {"t2a": out["t2a"]["R@1"], "a2t": out["a2t"]["R@1"]}


# ----------------------------------------------------------------------- statistics


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``n - 1``; 0 for one value); NaN if any is."""
    vals = [float(v) for v in values]
    if any(math.isnan(v) for v in vals):
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def pm(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
    """``"mean ± std"`` of ``values * scale``."""
    if any(v is None or math.isnan(v) for v in values):
        return "–"
    m, s = mean_std([v * scale for v in values])
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def paired(a: Sequence[float], b: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
    """Seed-paired difference ``a - b``: ``"mean ± std (a > b in n/N seeds)"``."""
    diffs = [scale * (x - y) for x, y in zip(a, b, strict=True)]
    wins = sum(d > 0 for d in diffs)
    m, s = mean_std(diffs)
    return f"{m:+.{digits}f} ± {s:.{digits}f} (> 0 in {wins}/{len(diffs)} seeds)"


def holds(*series: Sequence[float]) -> str:
    """``"holds in n/N seeds"`` for ``series[0] <= series[1] <= ...`` seed by seed."""
    flags = [all(x <= y for x, y in itertools.pairwise(vals)) for vals in zip(*series, strict=True)]
    return f"holds in {sum(flags)}/{len(flags)} seeds"


def curves(runs: Sequence[dict[str, list[float]]], key: str) -> dict[str, list[float]]:
    """Per-epoch mean and sample std over seeds of ``run[key]`` (a list per epoch)."""
    stacked = list(zip(*(r[key] for r in runs), strict=True))  # epochs x seeds
    stats = [mean_std(vs) for vs in stacked]
    return {"mean": [m for m, _ in stats], "std": [s for _, s in stats]}


def band(ax: Any, mean: Sequence[float], std: Sequence[float], **kwargs: Any) -> None:
    """A mean line with a ±1 std band, x = epoch 1 .. n."""
    x = list(range(1, len(mean) + 1))
    line = ax.plot(x, mean, **kwargs)[0]
    lo = [m - s for m, s in zip(mean, std, strict=True)]
    hi = [m + s for m, s in zip(mean, std, strict=True)]
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, lw=0)


def bars(
    ax: Any,
    groups: Sequence[str],
    series: dict[str, list[Sequence[float]]],
    colours: dict[str, str] | None = None,
) -> None:
    """Grouped bars, mean ± std over seeds: ``series[name][group] = values over seeds``."""
    width = 0.8 / len(series)
    for j, (name, per_group) in enumerate(series.items()):
        stats = [mean_std(v) for v in per_group]
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(
            xs,
            [m for m, _ in stats],
            width,
            yerr=[s for _, s in stats],
            label=name,
            capsize=2,
            color=(colours or {}).get(name),
        )
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.grid(axis="y", alpha=0.3)


# ----------------------------------------------------------------------- output


def table(header: list[str], rows: list[list[object]]) -> str:
    return markdown_table(header, rows)


# PNG text key holding the height, in the PNG's pixels, of the figure's smallest text:
# docs/screenshot_check.py scales it by the width the page shows the image at and fails
# a figure whose smallest text would be unreadably small there.
MIN_FONT_KEY = "cl-min-font-px"


def min_font_px(fig: Any) -> float:
    """Size in pixels (at the figure's dpi) of the smallest visible non-empty text."""
    from matplotlib.text import Text

    sizes = [
        t.get_fontsize()
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and t.figure is not None
    ]
    return min(sizes, default=math.nan) * fig.dpi / 72


# A docs column at 1280 px is ~736 px wide: a figure 7.5 in wide at 100 dpi (750 px) is
# shown at ~98 % of its size, so its 8-pt text stays ~11 px on screen.
FIG_WIDTH, FIG_DPI = 7.5, 100


def panel_grid(n: int, cols: int = 2, height: float = 3.0) -> tuple[Any, list[Any]]:
    """A figure of ``n`` panels, ``cols`` a row, FIG_WIDTH wide; its axes in reading order."""
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(FIG_WIDTH, height * rows), dpi=FIG_DPI, squeeze=False
    )
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.remove()
    return fig, flat[:n]


def save_figure(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, metadata={MIN_FONT_KEY: f"{min_font_px(fig):.1f}"})
    plt.close(fig)
    return path


def load(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The saved ``<name>.json`` of a previous run (for ``--render``); sets ``args.epochs``
    and ``args.seeds`` to the saved run's."""
    payload = json.loads((args.out_dir / f"{name}.json").read_text(encoding="utf-8"))
    args.epochs, args.seeds = payload["setup"]["epochs"], payload["setup"]["seeds"]
    return payload


def run_or_load(
    args: argparse.Namespace, name: str, run: Callable[[argparse.Namespace], Any]
) -> tuple[Any, float, dict[str, Any]]:
    """``(runs, seconds, saved)``: train with ``run(args)``, or with ``--render`` reload the
    runs and timing of ``<name>.json`` (``saved``; empty when training)."""
    saved = load(args, name) if args.render else {}
    start = time.perf_counter()
    runs = saved["runs"] if args.render else run(args)
    seconds = saved["seconds"] if args.render else time.perf_counter() - start
    return runs, seconds, saved


def save_study(
    args: argparse.Namespace,
    name: str,
    markdown: str,
    setup: dict[str, Any],
    saved: dict[str, Any],
    results: dict[str, Any],
) -> None:
    """Write a study's ``.md`` and ``.json``; a ``--render`` keeps the saved machine and
    set-up, so re-rendering never relabels an old run."""
    machine_of_run = {"machine": saved["machine"]} if args.render else {}
    payload = {**machine_of_run, "setup": saved.get("setup", setup), **results}
    write(args.out_dir, name, markdown, payload)


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (the tables show at most 4), recursively."""
    if isinstance(x, float):
        return x if math.isnan(x) or math.isinf(x) else float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def write(out_dir: Path, name: str, markdown: str, payload: dict[str, Any]) -> None:
    """``<name>.md`` and ``<name>.json`` (with the machine and the markdown) in ``out_dir``.

    The JSON holds every seed's raw results under ``"runs"`` (what ``--render`` reads)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(markdown.rstrip() + "\n")
    full = {"machine": payload.get("machine", machine()), **payload, "markdown": markdown}
    text = json.dumps(_rounded(full), separators=(",", ":"))
    (out_dir / f"{name}.json").write_text(text + "\n")
    print(f"wrote {out_dir / name}.md, .json", flush=True)
