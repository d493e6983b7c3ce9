"""PNG curves of a run from its logs: loss terms, learning rate and loss parameters per step,
R@1 per language and direction per epoch."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .durable import read_jsonl


def plot_run(out_dir: str | Path) -> list[Path]:
    """Write ``plots/*.png`` under ``out_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(out_dir)
    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    written: list[Path] = []
    steps = read_jsonl(out_dir / "train_log.jsonl")
    if steps:
        x = [row["step"] for row in steps]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(x, [row["loss"] for row in steps], label="loss", lw=1.5)
        for key in sorted({k for row in steps for k in row if k.startswith("terms/")}):
            values = [row.get(key, float("nan")) for row in steps]
            if any(v == v for v in values):  # not all NaN
                ax.plot(x, values, label=key.removeprefix("terms/"), lw=0.8, alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("value")
        ax.set_title("training loss and its terms")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(plots / "loss.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        params = sorted({k for row in steps for k in row if k.startswith("param/")})
        fig, axes = plt.subplots(
            1, 1 + bool(params), figsize=(7 + 4 * bool(params), 3.5), squeeze=False
        )
        axes[0][0].plot(x, [row["lr"] for row in steps])
        axes[0][0].set_title("learning rate")
        axes[0][0].set_xlabel("step")
        if params:
            for key in params:
                axes[0][1].plot(
                    x, [row.get(key) for row in steps], label=key.removeprefix("param/")
                )
            axes[0][1].set_title("loss parameters (temperature, radius, ...)")
            axes[0][1].set_xlabel("step")
            axes[0][1].legend(fontsize=7)
        fig.tight_layout()
        written.append(plots / "lr_and_params.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    epochs = [row for row in read_jsonl(out_dir / "epoch_log.jsonl") if row.get("metrics")]
    if epochs:
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for row in epochs:
            for key, value in row["metrics"].items():
                lowered = key.lower().replace("@", "")
                if any(part in ("r1", "recall1", "r_1") for part in lowered.split("/")):
                    series[key].append((row["epoch"], value))
        if series:
            fig, ax = plt.subplots(figsize=(8, 4.5))
            for key, points in sorted(series.items()):
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key, lw=1)
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("R@1")
            ax.set_title("retrieval R@1 per language and direction")
            ax.legend(fontsize=6, ncol=2)
            fig.tight_layout()
            written.append(plots / "retrieval_r1.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
    return written
