"""Memory and time of the tiled (``chunk_size``) losses against the dense ones, and of the
dense losses against open_clip's ``ClipLoss`` / ``SigLipLoss`` (optional peer).

    python benchmarks/bench_memory.py [--quick] [--skip-time] [--skip-memory]
    python benchmarks/bench_memory.py --plot-only     # redo the plot from the JSON

**Memory** (every case in a fresh process of its own): the *extra* peak resident set size
of one forward + backward above the inputs. The child sets its thread count, runs the
same loss once at B = 64 (one-time allocations -- oneDNN/MKL scratch, the autograd
engine, lazily loaded kernels -- land before the baseline), creates the inputs, frees
what the warm-up left to the allocator (``gc.collect``, glibc ``malloc_trim(0)``), resets
the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``: VmHWM := VmRSS) and
reads VmRSS as the baseline; after forward + backward, ``extra = VmHWM - baseline``. The
child runs with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so
every tensor above that is returned to the system when freed and RSS follows the live
tensors, as a GPU allocator's peak would: with glibc's default (dynamic) threshold,
whether freed blocks are kept depends on the order of frees, and repeats of one case
differed by up to 25 % (fixed: 0.1 %). The
extra memory therefore counts everything the step allocates: the logits (or tiles), the
normalised copies of the inputs, the input gradients (``2 B D`` floats, the floor any
loss pays) and autograd's buffers. Linux only (``/proc``); elsewhere the memory part is
skipped with a message. RSS is robust to the other processes on the machine.

**Time** (one fresh process per batch size and thread count): the candidates (dense,
tiled, open_clip where importable) are called interleaved, A B C C B A ..., after a 2 s
warm-up; ``ratio`` is the ratio of the medians of the wall times. ``cpu ratio`` is the
same for the process CPU time, less sensitive to other processes on a shared machine.

Inputs: random ``(B, D)`` float32 audio and text (``(B, K, D)`` and an all-true mask for
KCL), ``requires_grad``; temperature 0.07, SigLIP scale 10 and bias -10 (fixed). open_clip
is given ``F.normalize``-d inputs inside the timed step (its losses expect unit-norm
features; ours normalise themselves). ``open_clip`` is imported as a package, or -- when
its ``__init__`` fails (it imports torchvision, which may not import beside this torch)
-- its ``loss.py`` alone by file path; if neither works the comparison is skipped with
the reason printed.

Results: ``results/memory.json`` (tables and raw numbers) and
``results/memory_vs_batch.png``; ``--quick`` (small batches, a check that the script
runs) writes ``results/quick/``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from timing import (  # noqa: E402
    QUICK_RESULTS,
    RESULTS,
    interleaved_times,
    markdown_table,
    warm_up,
    write_results,
)

from contrastive_losses import functional as CF  # noqa: E402

TAU = 0.07
SCALE, BIAS = 10.0, -10.0
MiB = 2**20
# glibc serves allocations from this size up with mmap and unmaps them when freed. Fixed
# (which also turns off glibc's dynamic threshold), RSS follows the live tensors; with the
# default, freed blocks stay in the heap or not depending on the order of frees, and the
# same case measured +-25 % from run to run.
MMAP_THRESHOLD = 64 * 1024

# --------------------------------------------------------------------- open_clip peer


def load_open_clip_loss() -> tuple[Any | None, str]:
    """open_clip's loss module, or ``(None, why not)``."""
    try:
        import open_clip.loss as loss  # type: ignore[import-not-found]

        return loss, f"open_clip {getattr(sys.modules.get('open_clip'), '__version__', '?')}"
    except Exception as exc:  # any import failure means: skip the peer
        first = f"{type(exc).__name__}: {exc}"
    spec = importlib.util.find_spec("open_clip") if "open_clip" not in sys.modules else None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        return None, f"open_clip is not installed ({first}); pip install open_clip_torch"
    path = Path(locations[0]) / "loss.py"
    try:
        file_spec = importlib.util.spec_from_file_location("open_clip_loss", path)
        module = importlib.util.module_from_spec(file_spec)  # type: ignore[arg-type]
        file_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:
        return None, f"open_clip/loss.py does not import ({type(exc).__name__}: {exc})"
    version = "?"
    try:
        from importlib.metadata import version as dist_version

        version = dist_version("open_clip_torch")
    except Exception:
        pass
    return module, f"open_clip {version}, loss.py by file path (package import: {first})"


# --------------------------------------------------------------------- the steps


def make_inputs(loss: str, b: int, d: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(b, d, generator=g).requires_grad_()
    shape = (b, k, d) if loss == "kcl" else (b, d)
    text = torch.randn(*shape, generator=g).requires_grad_()
    return [audio, text]


def make_step(case: dict[str, Any], inputs: list[torch.Tensor], oc: Any = None):
    """A closure running one forward + backward of ``case`` on ``inputs``."""
    loss, impl, chunk = case["loss"], case["impl"], case.get("chunk")
    audio, text = inputs
    chunk_size = chunk if impl == "tiled" else None
    if impl == "open_clip":
        if loss == "infonce":
            ref, scale = oc.ClipLoss(), torch.tensor(1 / TAU)

            def fn() -> torch.Tensor:
                return ref(F.normalize(audio, dim=-1), F.normalize(text, dim=-1), scale)
        elif loss == "siglip":
            ref, s, bias = oc.SigLipLoss(), torch.tensor(SCALE), torch.tensor(BIAS)

            def fn() -> torch.Tensor:
                return ref(F.normalize(audio, dim=-1), F.normalize(text, dim=-1), s, bias)
        else:
            raise ValueError(f"no open_clip reference for {loss}")
    elif loss == "infonce":

        def fn() -> torch.Tensor:
            return CF.info_nce(audio, text, TAU, chunk_size=chunk_size)
    elif loss == "siglip":

        def fn() -> torch.Tensor:
            return CF.siglip(audio, text, SCALE, BIAS, chunk_size=chunk_size)
    elif loss == "kcl":
        mask = torch.ones(text.shape[:2], dtype=torch.bool)

        def fn() -> torch.Tensor:
            return CF.kcl(audio, text, TAU, mask=mask, chunk_size=chunk_size)
    else:
        raise ValueError(loss)

    def step() -> None:
        for x in inputs:
            x.grad = None
        fn().backward()

    return step


# --------------------------------------------------------------------- memory (child)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_child(case: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(case["threads"])
    oc = load_open_clip_loss()[0] if case["impl"] == "open_clip" else None
    tiny = dict(case, b=64)
    make_step(tiny, make_inputs(case["loss"], 64, case["d"], case["k"]), oc)()
    inputs = make_inputs(case["loss"], case["b"], case["d"], case["k"])
    step = make_step(case, inputs, oc)
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    inputs_mib = sum(x.numel() * x.element_size() for x in inputs) / MiB
    return {
        **case,
        "extra_mib": (peak - base) / 1024,
        "baseline_mib": base / 1024,
        "inputs_mib": inputs_mib,
        "seconds": seconds,
    }


def run_child(mode: str, case: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    threads = str(case["threads"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if mode == "--memory-case":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    cmd = [sys.executable, __file__, mode, json.dumps(case)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------- time (child)


def time_child(case: dict[str, Any]) -> dict[str, Any]:
    """Interleaved fwd+bwd times of ``case["impls"]`` at one batch size."""
    torch.set_num_threads(case["threads"])
    oc = load_open_clip_loss()[0] if "open_clip" in case["impls"] else None
    steps, cpu = {}, {}
    for impl in case["impls"]:
        c = dict(case, impl=impl)
        step = make_step(c, make_inputs(case["loss"], case["b"], case["d"], case["k"]), oc)
        cpu[impl] = []

        def timed(step=step, store=cpu[impl]) -> None:
            c0 = time.process_time()
            step()
            store.append(time.process_time() - c0)

        steps[impl] = timed
    warm_up(case["warmup"])
    times = interleaved_times(
        steps,
        case["rounds"],
        min_time=case["min_time"],
        max_time=case["max_time"],
        warmup=case["warmup"],
        alternate=True,
    )
    out: dict[str, Any] = {**case, "rounds_done": len(next(iter(times.values())))}
    for impl, ts in times.items():
        out[f"{impl}_s"] = statistics.median(ts)
        out[f"{impl}_cpu_s"] = statistics.median(cpu[impl][-len(ts) :])
        out[f"{impl}_all_s"] = ts
    return out


# --------------------------------------------------------------------- plan


def plan(quick: bool, have_oc: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    oc = ["open_clip"] if have_oc else []
    mem: list[dict[str, Any]] = []

    def m(loss: str, impl: str, b: int, d: int, chunk: int | None = None, k: int = 1) -> None:
        mem.append(dict(loss=loss, impl=impl, b=b, d=d, chunk=chunk, k=k, threads=1))

    tim: list[dict[str, Any]] = []

    def t(b: int, threads: int, impls: list[str], loss: str = "infonce", **kw: Any) -> None:
        cfg = dict(loss=loss, b=b, d=512, k=1, chunk=1024, threads=threads, impls=impls)
        cfg.update(rounds=7, min_time=10.0, max_time=60.0, warmup=2.0)
        if quick:
            cfg.update(rounds=3, min_time=0.0, max_time=5.0, warmup=0.2)
        cfg.update(kw)
        tim.append(cfg)

    if quick:
        for impl in ["dense", "tiled", *oc]:
            m("infonce", impl, 512, 64, 128 if impl == "tiled" else None)
            m("siglip", impl, 512, 64, 128 if impl == "tiled" else None)
        m("kcl", "dense", 256, 64, None, 4)
        m("kcl", "tiled", 256, 64, 64, 4)
        t(512, 1, ["dense", "tiled", *oc], d=64, chunk=128)
        return mem, tim

    curve = [1024, 2048, 4096, 8192, 16384]
    for b in curve:
        for impl in ["dense", "tiled", *oc]:
            m("infonce", impl, b, 512, 1024 if impl == "tiled" else None)
            m("siglip", impl, b, 512, 1024 if impl == "tiled" else None)
    m("infonce", "tiled", 32768, 512, 1024)  # dense would need ~17 GB: tiled only
    m("siglip", "tiled", 32768, 512, 1024)
    m("infonce", "tiled", 32768, 128, 1024)  # the 1 GiB target
    m("infonce", "dense", 8192, 128)  # a dense reference point at D = 128
    for chunk in (None, 1024, 256):
        m("kcl", "tiled" if chunk else "dense", 4096, 512, chunk, 8)
    m("siglip", "tiled", 4096, 512, 256)

    # The targets first (B = 1024 and 8192 at 1 and 2 threads), then the rest of the
    # 1-thread time curve, open_clip where a step is cheap. A dense step at B = 16384 takes
    # ~10 s on one idle core: 2 rounds after the untimed first call. B = 32768 is not
    # timed (tiled only: minutes per step on this machine).
    for b in (1024, 8192):
        for threads in (1, 2):
            t(b, threads, ["dense", "tiled", *(oc if b <= 4096 and threads == 1 else [])])
    for b in (2048, 4096):
        t(b, 1, ["dense", "tiled", *oc])
    t(16384, 1, ["dense", "tiled"], rounds=2, min_time=0.0)
    for b in (1024, 4096):
        t(b, 1, ["dense", "tiled", *oc], loss="siglip")
    return mem, tim


# --------------------------------------------------------------------- tables


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}x"


def _verdict(value: float | None, target: float, below: bool = True) -> str:
    if value is None:
        return "not run"
    return "met" if (value <= target if below else value >= target) else "MISSED"


def find(rows: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def summarise(mem: list[dict[str, Any]], tim: list[dict[str, Any]]) -> dict[str, str]:
    tables: dict[str, str] = {}

    def extra(**kw: Any) -> float | None:
        r = find(mem, **kw)
        return None if r is None else r["extra_mib"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    # targets
    rows: list[list[object]] = []

    def target_row(what: str, value: float | None, target: float, unit: str = "x") -> None:
        shown = "-" if value is None else (f"{value:.0f} MiB" if unit == "MiB" else _x(value))
        goal = f"<= {target:.0f} MiB" if unit == "MiB" else f"<= {target:.3g}x"
        rows.append([what, shown, goal, _verdict(value, target)])

    d16 = extra(loss="infonce", impl="dense", b=16384, d=512)
    t16 = extra(loss="infonce", impl="tiled", b=16384, d=512)
    target_row("InfoNCE B=16384 D=512 chunk 1024: tiled / dense memory", ratio(t16, d16), 1 / 8)
    target_row(
        "InfoNCE B=32768 D=128 chunk 1024: tiled extra memory",
        extra(loss="infonce", impl="tiled", b=32768, d=128),
        1024,
        "MiB",
    )
    kd = extra(loss="kcl", impl="dense", b=4096)
    for chunk in (1024, 256):
        target_row(
            f"KCL K=8 B=4096 D=512 chunk {chunk}: tiled / dense memory",
            ratio(extra(loss="kcl", impl="tiled", b=4096, chunk=chunk), kd),
            1 / 8,
        )
    sd = extra(loss="siglip", impl="dense", b=4096, d=512)
    for chunk in (1024, 256):
        target_row(
            f"SigLIP B=4096 D=512 chunk {chunk}: tiled / dense memory",
            ratio(extra(loss="siglip", impl="tiled", b=4096, d=512, chunk=chunk), sd),
            1 / 8,
        )
    for b, goal in ((8192, 1.05), (1024, 1.3)):
        for threads in (1, 2):
            r = find(tim, loss="infonce", b=b, threads=threads)
            value = None if r is None or "dense_s" not in r else r["tiled_s"] / r["dense_s"]
            what = f"InfoNCE B={b} D=512 chunk 1024, {threads} thread(s): tiled / dense time"
            target_row(what, value, goal)
    for b in sorted({r["b"] for r in mem if r["loss"] == "siglip"}):
        value = ratio(
            extra(loss="siglip", impl="dense", b=b, d=512),
            extra(loss="siglip", impl="open_clip", b=b, d=512),
        )
        if value is not None:
            target_row(f"SigLIP B={b} D=512: dense / open_clip SigLipLoss memory", value, 1.0)
    tables["targets_markdown"] = markdown_table(["target", "measured", "goal", ""], rows)

    # memory
    rows = []
    for r in mem:
        dense = extra(loss=r["loss"], impl="dense", b=r["b"], d=r["d"], k=r["k"])
        peer = extra(loss=r["loss"], impl="open_clip", b=r["b"], d=r["d"], k=r["k"])
        logits_mib = r["k"] * r["b"] ** 2 * 4 / MiB
        rows.append([
            r["loss"] + (f" K={r['k']}" if r["k"] > 1 else ""),
            r["impl"] + (f" {r['chunk']}" if r["impl"] == "tiled" else ""),
            r["b"],
            r["d"],
            f"{r['extra_mib']:.0f}",
            f"{r['extra_mib'] / logits_mib:.3g}",
            _x(ratio(r["extra_mib"], dense)) if r["impl"] != "dense" else "1x",
            _x(ratio(r["extra_mib"], peer)) if peer is not None else "-",
        ])  # fmt: skip
    tables["memory_markdown"] = markdown_table(
        ["loss", "impl (chunk)", "B", "D", "extra MiB", "/ K B² floats", "ratio to dense",
         "ratio to open_clip"],
        rows,
    )  # fmt: skip

    # time
    rows = []
    for r in tim:
        ref = "dense" if "dense" in r["impls"] else None
        for impl in r["impls"]:
            ratio_w = ratio(r[f"{impl}_s"], r.get(f"{ref}_s")) if ref else None
            ratio_c = ratio(r[f"{impl}_cpu_s"], r.get(f"{ref}_cpu_s")) if ref else None
            rows.append([
                r["loss"], impl, r["b"], r["d"], r["threads"], f"{r[f'{impl}_s']:.3g}",
                _x(ratio_w), _x(ratio_c), r["rounds_done"],
            ])  # fmt: skip
    tables["time_markdown"] = markdown_table(
        ["loss", "impl", "B", "D", "threads", "median s", "time ratio to dense",
         "cpu ratio to dense", "rounds"],
        rows,
    )  # fmt: skip
    return tables


# --------------------------------------------------------------------- plot


def plot(mem: list[dict[str, Any]], tim: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One panel above the other, 750 px wide: a docs column at 1280 px shows it at full size.
    fig, (ax_m, ax_t) = plt.subplots(2, 1, figsize=(7.5, 7.6))
    styles = {"dense": ("C0", "o"), "tiled": ("C1", "s"), "open_clip": ("C2", "^")}
    for loss, ls in (("infonce", "-"), ("siglip", "--")):
        for impl, (color, marker) in styles.items():
            pts = sorted(
                (r["b"], r["extra_mib"])
                for r in mem
                if r["loss"] == loss and r["impl"] == impl and r["d"] == 512 and r["k"] == 1
                and (impl != "tiled" or r["chunk"] == 1024)
            )  # fmt: skip
            if pts:
                label = f"{'InfoNCE' if loss == 'infonce' else 'SigLIP'} {impl}"
                label += " (chunk 1024)" if impl == "tiled" else ""
                xs, ys = zip(*pts, strict=True)
                ax_m.plot(xs, ys, ls, color=color, marker=marker, label=label, ms=4)
    ax_m.set_title("extra peak RSS of one forward + backward (D = 512)", fontsize=9)
    ax_m.set_ylabel("MiB above the inputs")
    for impl, (color, marker) in styles.items():
        pts = sorted(
            (r["b"], r[f"{impl}_s"])
            for r in tim
            if r["loss"] == "infonce" and r["threads"] == 1 and impl in r["impls"]
        )
        if pts:
            label = f"InfoNCE {impl}" + (" (chunk 1024)" if impl == "tiled" else "")
            ax_t.plot(*zip(*pts, strict=True), "-", color=color, marker=marker, label=label, ms=4)
    for r in tim:
        if r["loss"] == "infonce" and r["threads"] == 1 and "dense" in r["impls"]:
            q = r["tiled_s"] / r["dense_s"]
            ax_t.annotate(f"{q:.2f}x", (r["b"], r["tiled_s"]), textcoords="offset points",
                          xytext=(4, -12), fontsize=7, color="C1")  # fmt: skip
    ax_t.set_title("time of one forward + backward (D = 512, 1 thread, median)", fontsize=9)
    ax_t.set_ylabel("seconds (labels: tiled / dense)")
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ticks = [2**i for i in range(10, 16)]
        ax.set_xticks(ticks, [f"{b // 1024}k" for b in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--memory-case", "--time-case"):
        case = json.loads(sys.argv[2])
        child = memory_child if sys.argv[1] == "--memory-case" else time_child
        print(json.dumps(child(case)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes; results/quick/")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--plot-only", action="store_true", help="re-plot results/memory.json")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the cases already measured in results/memory.json.tmp (an interrupted run)",
    )
    args = parser.parse_args()
    out = QUICK_RESULTS if args.quick else RESULTS
    png = out / "memory_vs_batch.png"
    if args.plot_only:
        payload = json.loads((out / "memory.json").read_text())
        plot(payload["memory"], payload["time"], png)
        print(f"wrote {png}")
        return

    oc, oc_info = load_open_clip_loss()
    print(f"open_clip: {oc_info if oc is not None else 'SKIPPED: ' + oc_info}", flush=True)
    mem_plan, time_plan = plan(args.quick, oc is not None)
    can_measure = Path("/proc/self/clear_refs").exists()
    if not can_measure and not args.skip_memory:
        print("memory: SKIPPED (needs Linux /proc/self/clear_refs and VmHWM)", flush=True)
    partial = out / "memory.json.tmp"  # every finished case, for --resume
    done: dict[str, list[dict[str, Any]]] = {"memory": [], "time": []}
    if args.resume and partial.exists():
        done = json.loads(partial.read_text())

    def measured(kind: str, case: dict[str, Any]) -> dict[str, Any]:
        for r in done[kind]:
            if all(r.get(k) == v for k, v in case.items()):
                return r
        r = run_child(f"--{kind}-case", case)
        done[kind].append(r)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(done))
        return r

    mem: list[dict[str, Any]] = []
    if can_measure and not args.skip_memory:
        for case in mem_plan:
            r = measured("memory", case)
            print(
                f"memory {r['loss']:8s} {r['impl']:9s} chunk={r['chunk']} B={r['b']:6d} "
                f"D={r['d']:4d} K={r['k']}: extra {r['extra_mib']:8.1f} MiB "
                f"(inputs {r['inputs_mib']:.0f} MiB, step {r['seconds']:.1f} s)",
                flush=True,
            )
            mem.append(r)
    tim: list[dict[str, Any]] = []
    if not args.skip_time:
        for case in time_plan:
            r = measured("time", case)
            cells = ", ".join(f"{i} {r[f'{i}_s']:.3g} s" for i in r["impls"])
            print(
                f"time {r['loss']} B={r['b']} threads={r['threads']}: {cells} "
                f"({r['rounds_done']} rounds)",
                flush=True,
            )
            tim.append(r)
    tables = summarise(mem, tim)
    for key, table in tables.items():
        print(f"\n{key}:\n{table}")
    payload = {
        "open_clip": oc_info if oc is not None else f"skipped: {oc_info}",
        "machine_note": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        **tables,
        "memory": mem,
        "time": tim,
    }
    path = write_results("memory", payload, quick=args.quick)
    print(f"wrote {path}")
    partial.unlink(missing_ok=True)
    if mem or tim:
        plot(mem, tim, png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
