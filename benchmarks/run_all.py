"""Run every benchmark, then write one summary of their ratio tables with bar plots.

    PYTHONPATH=src python benchmarks/run_all.py            # full runs (tens of minutes)
    PYTHONPATH=src python benchmarks/run_all.py --quick    # check that everything runs
    PYTHONPATH=src python benchmarks/run_all.py --summary-only   # re-plot existing results
    PYTHONPATH=src python benchmarks/run_all.py --studies  # also the controlled studies

Every ``benchmarks/bench_*.py`` runs in its own process, one after the other (never in
parallel: they time things). ``--quick`` is passed through to the scripts that have a
``--quick`` mode; those write ``results/quick/<name>.json`` and this script writes
``results/quick/summary.md`` and ``results/quick/*_ratios.png``, so a quick check never
overwrites the committed full numbers in ``results/``. Every benchmark must have a
``--quick`` mode: a quick run marks a script without one as FAILED (in the summary and the
exit status) instead of skipping it, so "the quick run passed" means every benchmark ran.
A script that prints its
tables instead of writing ``<name>.json`` gets one written here, holding the markdown
tables of its standard output. Each script's output is kept in ``<name>.log``.

``--studies`` also runs ``benchmarks/studies/*.py`` (InfoNCE/KCL/CACL consistency, SVR,
ASK), which write to ``results/studies/`` (``results/quick/studies/`` with ``--quick``).

The summary: for each benchmark, its ratio columns (ours / reference, measured in the
same run; < 1 means ours is cheaper) as a markdown table and as a horizontal bar plot on
a log axis with the reference at 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from timing import QUICK_RESULTS, RESULTS, markdown_table  # noqa: E402


@dataclass
class RatioTable:
    """Rows of a benchmark table: label cells, then ratio cells (floats or None)."""

    title: str
    labels: list[str]
    ratios: list[str]
    extras: list[str] = field(default_factory=list)  # shown after the ratios, not plotted
    rows: list[tuple[list[str], list[float | None], list[str]]] = field(default_factory=list)


@dataclass
class RowsSpec:
    """A list of row dicts in the script's JSON (``payload[key]``)."""

    key: str
    title: str
    labels: list[str]
    ratios: list[str]
    extras: list[str] = field(default_factory=list)


@dataclass
class MarkdownSpec:
    """A markdown table stored as a string in the script's JSON (``payload[key]``)."""

    key: str
    title: str
    labels: list[str]
    ratios: list[str]
    extras: list[str] = field(default_factory=list)


# What to summarise of each known benchmark; unknown ones fall back to every markdown
# table found in their JSON or standard output, with ratio columns found by
# is_ratio_column (cells like "1.23x", or a header with the word "ratio").
SPECS: dict[str, list[RowsSpec | MarkdownSpec]] = {
    "losses": [
        MarkdownSpec(
            "table_markdown",
            "loss fwd+bwd vs references (time, activation memory)",
            ["ratio", "B"],
            ["time ratio", "activation-memory ratio"],
            ["target", ""],
        )
    ],
    "memory": [
        MarkdownSpec(
            "targets_markdown",
            "tiled (chunk_size) vs dense, dense SigLIP vs open_clip: the targets",
            ["target"],
            ["measured"],
            ["goal", ""],
        ),
        MarkdownSpec(
            "time_markdown",
            "forward + backward time, ratio to the dense path",
            ["loss", "impl", "B", "threads"],
            ["time ratio to dense", "cpu ratio to dense"],
        ),
    ],
    "open_clip": [
        MarkdownSpec(
            key="table_markdown",
            title="open_clip drop-ins' loss call vs open_clip's own (fwd+bwd, one thread)",
            labels=["loss", "B", "ours"],
            ratios=["cpu ratio to open_clip", "wall ratio", "cpu ratio to dense"],
            extras=["target", ""],
        )
    ],
    "dense_step": [
        MarkdownSpec(
            key="table_markdown",
            title="InfoNCE's dense step over one matmul (B = D = 1024) and ClipLoss over "
            "open_clip's (B = 32), fwd+bwd, one thread",
            labels=["ratio", "candidate", "B"],
            ratios=["cpu ratio (median of the runs)", "wall ratio"],
            extras=["range over the runs", "target", ""],
        )
    ],
    "svr": [
        RowsSpec(
            "rows",
            "SupportVectorRegularizer(base) / base, fwd+bwd",
            ["loss", "batch", "variant"],
            ["time_ratio", "time_ratio_fast", "memory_ratio"],
        )
    ],
    "ask": [
        RowsSpec(
            "sinkhorn",
            "sinkhorn vs POT (100 iterations, float32)",
            ["B"],
            ["ours/pot_log", "ours_log/pot_log", "ours/pot_plain"],
        ),
        RowsSpec(
            "bank_and_loss",
            "bank search and ASKLoss fwd+bwd vs bare faiss and InfoNCE",
            ["B"],
            [
                "search_faiss/bare",
                "search_torch/bare",
                "ask_faiss/bare",
                "ask_torch/bare",
                "ask_faiss/infonce",
                "ask_torch/infonce",
            ],
        ),
    ],
}


# ----------------------------------------------------------------------- running


def scripts(folder: Path, prefix: str) -> dict[str, Path]:
    return {
        p.stem.removeprefix(prefix): p
        for p in sorted(folder.glob(f"{prefix}*.py"))
        if p.stem not in ("common", "__init__")
    }


def has_quick(script: Path) -> bool:
    return '"--quick"' in script.read_text(encoding="utf-8")


def run_script(script: Path, args: list[str], log: Path) -> tuple[int, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(script), *args]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(cmd)}\n\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    print(f"  {status} in {seconds:.0f} s; output in {log.relative_to(ROOT)}", flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], flush=True)
    return proc.returncode, seconds, proc.stdout


# ----------------------------------------------------------------------- tables


def markdown_tables(text: str) -> list[str]:
    """Every markdown table (consecutive lines starting with ``|``) in ``text``."""
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.strip().startswith("|"):
            current.append(line.strip())
        elif current:
            if len(current) >= 3:
                tables.append("\n".join(current))
            current = []
    return tables


def parse_markdown(table: str) -> tuple[list[str], list[list[str]]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()]
    header, body = rows[0], rows[1:]
    body = [r for r in body if not all(set(c) <= set("-: ") for c in r)]  # separator
    # a repeated name ("| peak | ratio | extra | ratio |") takes its left neighbour's
    header = [
        f"{header[i - 1]} {h}" if i > 0 and header.count(h) > 1 else h for i, h in enumerate(header)
    ]
    return header, body


def as_float(cell: object) -> float | None:
    if isinstance(cell, bool) or cell is None:
        return None
    if isinstance(cell, (int, float)):
        return float(cell)
    text = str(cell).strip().removesuffix("x").removesuffix("×").strip()
    try:
        return float(text)
    except ValueError:
        return None


RATIO_CELL = re.compile(r"^-?\d+(\.\d*)?(e[-+]?\d+)?\s*[x×]$")


def is_ratio_column(name: str, cells: list[str]) -> bool:
    """A column of ratios: cells written like ``1.23x``, or a header with the word
    "ratio" over numbers."""
    filled = [c.strip() for c in cells if c.strip() not in ("", "-", "–")]
    if not filled:
        return False
    if all(RATIO_CELL.match(c) for c in filled):
        return True
    return bool(re.search(r"\bratio\b", name.lower())) and all(
        as_float(c) is not None for c in filled
    )


def from_markdown(
    table: str,
    title: str,
    labels: list[str] | None,
    ratios: list[str] | None,
    extras: list[str] | None = None,
) -> RatioTable | None:
    header, body = parse_markdown(table)
    if ratios is None:
        ratios = [
            h
            for i, h in enumerate(header)
            if is_ratio_column(h, [r[i] for r in body if i < len(r)])
        ]
    if labels is None:
        labels = [header[0]] if header and header[0] not in ratios else []
    if not ratios:
        return None
    out = RatioTable(
        title, [h for h in labels if h in header], ratios, [h for h in extras or [] if h in header]
    )
    for row in body:
        cells = dict(zip(header, row, strict=False))
        out.rows.append(
            (
                [cells.get(h, "") for h in out.labels],
                [as_float(cells.get(h)) for h in ratios],
                [cells.get(h, "") for h in out.extras],
            )
        )
    return out


def extract(name: str, payload: dict[str, Any], stdout: str = "") -> list[RatioTable]:
    """The ratio tables of one benchmark's JSON (or, failing that, of its stdout)."""
    found: list[RatioTable] = []
    for spec in SPECS.get(name, []):
        value = payload.get(spec.key)
        if isinstance(spec, MarkdownSpec) and isinstance(value, str):
            table = from_markdown(value, spec.title, spec.labels, spec.ratios, spec.extras)
            if table is not None:
                found.append(table)
        elif isinstance(spec, RowsSpec) and isinstance(value, list) and value:
            table = RatioTable(spec.title, spec.labels, spec.ratios, spec.extras)
            for row in value:
                table.rows.append(
                    (
                        [str(row.get(h, "")) for h in spec.labels],
                        [as_float(row.get(h)) for h in spec.ratios],
                        [str(row.get(h, "")) for h in spec.extras],
                    )
                )
            found.append(table)
    if found:
        return found
    tables = [t for v in payload.values() if isinstance(v, str) for t in markdown_tables(v)]
    for i, table_md in enumerate(tables or markdown_tables(stdout)):
        table = from_markdown(table_md, f"table {i + 1}", None, None)
        if table is not None and table.rows:
            found.append(table)
    return found


def fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{value:.3g}"


def render(table: RatioTable) -> str:
    rows = [[*labels, *(fmt(v) for v in values), *extras] for labels, values, extras in table.rows]
    header = [*table.labels, *table.ratios, *(h or "verdict" for h in table.extras)]
    return markdown_table(header, rows)


def row_label(names: list[str], cells: list[str]) -> str:
    return " ".join(
        f"B={c}" if n in ("B", "batch") else c for n, c in zip(names, cells, strict=True) if c
    )


def plot(name: str, tables: list[RatioTable], path: Path) -> bool:
    drawable = [t for t in tables if any(v and v > 0 for _, vs, _ in t.rows for v in vs)]
    if not drawable:
        return False
    heights = [max(1.6, 0.32 * len(t.rows) * max(1, len(t.ratios)) ** 0.5 + 1.0) for t in drawable]
    fig, axes = plt.subplots(
        len(drawable), 1, figsize=(9.5, sum(heights)), dpi=80, squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )  # fmt: skip
    for ax, table in zip(axes[:, 0], drawable, strict=True):
        n_ratio = len(table.ratios)
        width = 0.8 / n_ratio
        ylabels = [row_label(table.labels, labels) for labels, _, _ in table.rows]
        for j, ratio in enumerate(table.ratios):
            ys = [i + (j - (n_ratio - 1) / 2) * width for i in range(len(table.rows))]
            xs = [vs[j] if vs[j] is not None and vs[j] > 0 else math.nan for _, vs, _ in table.rows]
            ax.barh(ys, xs, height=width, label=ratio)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        values = [v for _, vs, _ in table.rows for v in vs if v is not None and v > 0]
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_major_formatter(plain)
        if max([*values, 1.0]) / min([*values, 1.0]) < 30:  # under ~1.5 decades: label minors
            ax.xaxis.set_minor_formatter(plain)
            ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_yticks(range(len(table.rows)), ylabels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {table.title}", fontsize=9)
        ax.grid(axis="x", alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.set_xlabel("ratio to reference (log scale; < 1: ours cheaper)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; results/quick/")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these benchmarks only")
    parser.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="do not run these")
    parser.add_argument(
        "--summary-only", action="store_true", help="run nothing; summarise existing results"
    )
    parser.add_argument("--studies", action="store_true", help="also run benchmarks/studies/")
    args = parser.parse_args()
    out_dir = QUICK_RESULTS if args.quick else RESULTS
    benches = scripts(HERE, "bench_")
    unknown = sorted(set(args.only or []) - set(benches))
    if unknown:
        parser.error(f"--only: no benchmarks/bench_{unknown[0]}.py; have {sorted(benches)}")
    status: dict[str, str] = {}
    stdouts: dict[str, str] = {}
    for name, script in benches.items():
        if args.summary_only:
            status[name] = "not run now (existing results)"
            continue
        if (args.only and name not in args.only) or name in args.skip:
            status[name] = "not run now (--only/--skip)"
            continue
        if args.quick and not has_quick(script):
            status[name] = "FAILED: the script has no --quick mode (every benchmark needs one)"
            print(f"{script.name}: {status[name]}", flush=True)
            continue
        json_path = out_dir / f"{name}.json"
        before = json_path.stat().st_mtime if json_path.exists() else None
        rc, seconds, stdout = run_script(
            script, ["--quick"] if args.quick else [], out_dir / f"{name}.log"
        )
        stdouts[name] = stdout
        status[name] = f"ran in {seconds:.0f} s" if rc == 0 else f"FAILED (exit {rc})"
        wrote = json_path.exists() and json_path.stat().st_mtime != before
        if rc == 0 and not wrote:  # the script prints its tables: keep them as its JSON
            tables = markdown_tables(stdout)
            payload = {"script": script.name, "args": ["--quick"] if args.quick else []}
            payload |= {f"table_{i + 1}": t for i, t in enumerate(tables)}
            json_path.write_text(json.dumps(payload, indent=2) + "\n")
    if args.studies and not args.summary_only:
        for name, script in scripts(HERE / "studies", "").items():
            rc, seconds, _ = run_script(
                script, ["--quick"] if args.quick else [], out_dir / "studies" / f"{name}.log"
            )
            status[f"studies/{name}"] = f"ran in {seconds:.0f} s" if rc == 0 else f"FAILED ({rc})"
    for name in scripts(HERE / "studies", ""):
        if f"studies/{name}" not in status and (out_dir / "studies" / f"{name}.md").exists():
            status[f"studies/{name}"] = "not run now (existing results)"

    lines = [
        "# Benchmark summary",
        "",
        f"Written by `benchmarks/run_all.py{' --quick' if args.quick else ''}`"
        f"{' (--summary-only)' if args.summary_only else ''} on "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs. Every number is a ratio "
        "(ours / reference, measured in the same run; < 1 means ours is cheaper). "
        + ("**Quick run: small sizes and few repeats, a check that the scripts work, not a "
           "measurement.**" if args.quick else ""),
        "",
    ]  # fmt: skip
    for name in sorted(status, key=lambda n: (n.startswith("studies/"), n)):
        lines += [f"## {name}", ""]
        json_path = out_dir / f"{name}.json"
        lines += [f"Status: {status[name]}.", ""]
        if name.startswith("studies/"):
            lines += [f"Tables, interpretation and plots: `{name}.md` (next to this file).", ""]
            continue
        if not json_path.exists():
            lines += [f"No `{json_path.relative_to(HERE)}`.", ""]
            continue
        payload = json.loads(json_path.read_text(encoding="utf-8"))
        tables = extract(name, payload, stdouts.get(name, ""))
        meta = payload.get("machine") or payload.get("environment")
        if meta:
            lines += [f"Measured on: `{json.dumps(meta)}`.", ""]
        if not tables:
            lines += ["No ratio table found in its results.", ""]
        for table in tables:
            lines += [f"**{table.title}**", "", render(table), ""]
        png = out_dir / f"{name}_ratios.png"
        if plot(name, tables, png):
            lines += [f"Plot: `{png.name}` (next to this file).", ""]
    summary = out_dir / "summary.md"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text("\n".join(lines))
    print(f"wrote {summary.relative_to(ROOT)}")
    if any("FAILED" in s for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
