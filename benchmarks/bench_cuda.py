"""The losses on a CUDA GPU: the tiled path, the compiled step and open_clip, side by side.

    python benchmarks/bench_cuda.py            # on a machine with a CUDA GPU
    python benchmarks/bench_cuda.py --quick    # tiny sizes; on CPU when there is no GPU

What the CPU benchmarks cannot show: on a GPU the B x B logits are cheap to compute but
their memory is what limits the batch. For each batch size, one forward + backward of
symmetric InfoNCE (and KCL with K languages, and SigLIP) is timed and its peak memory read:

* **time**: CUDA events around the step, the candidates interleaved after a warm-up, the
  median of ``--repeats`` rounds; reported as a ratio to the reference of the row (our
  dense loss, or open_clip's own loss where it is given).
* **memory**: ``torch.cuda.max_memory_allocated`` during the step minus the memory held
  before it (inputs included in neither), in MiB; a candidate that runs out of memory is
  recorded as ``"oom"``.

Candidates: ``dense`` (ours, ``chunk_size=None``), ``tiled`` (ours, ``chunk_size=1024``),
``open_clip`` (its ``ClipLoss`` / ``SigLipLoss``, loaded by file path when ``open_clip``'s
``loss.py`` can be found, else skipped with the reason), ``loop`` (KCL only: K InfoNCE
calls, one per language, the plain reading of ATRI Eq. 9-11), and ``compiled`` (our dense
loss under ``torch.compile``, the default inductor backend, ``validate_args=False``).
Inputs are random float32 ``(B, D)`` features (``(B, K, D)`` for KCL) with
``requires_grad``; open_clip gets ``F.normalize``-d inputs inside the timed step.

Results: ``results/cuda.json`` (``results/quick/cuda.json`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from timing import markdown_table, write_results

from contrastive_losses import functional as CF


def _open_clip_loss() -> tuple[Any, str]:
    """open_clip's ``loss`` module by file path (no torchvision needed), or the reason."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None, "open_clip is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    loader_spec = importlib.util.spec_from_file_location("open_clip_loss_for_bench", path)
    if loader_spec is None or loader_spec.loader is None:
        return None, f"cannot load {path}"
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return module, ""


def _step(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        loss_fn().backward()

    return run


def _measure(
    fns: dict[str, Callable[[], None]], repeats: int, device: torch.device
) -> dict[str, Any]:
    """Median milliseconds and peak extra MiB of each candidate, interleaved."""
    cuda = device.type == "cuda"
    out: dict[str, Any] = {}
    alive = dict(fns)
    for name, fn in list(alive.items()):  # warm-up, and the memory of one step
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                fn()
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - before
                out[name] = {"peak_mib": peak / 2**20}
            else:
                out[name] = {"peak_mib": None}
        except torch.OutOfMemoryError:
            out[name] = {"ms": "oom", "peak_mib": "oom"}
            del alive[name]
            torch.cuda.empty_cache()
    times: dict[str, list[float]] = {name: [] for name in alive}
    for _ in range(repeats):
        for name, fn in alive.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                import time

                t0 = time.perf_counter()
                fn()
                times[name].append(1e3 * (time.perf_counter() - t0))
    for name, ts in times.items():
        out[name]["ms"] = statistics.median(ts)
    return out


def _candidates(
    loss: str, B: int, D: int, K: int, device: torch.device, oc: Any
) -> tuple[dict[str, Callable[[], None]], str]:
    """The timed steps of one row and the name of its reference."""
    g = torch.Generator(device="cpu").manual_seed(B)
    audio = torch.randn(B, D, generator=g).to(device).requires_grad_()
    if loss == "kcl":
        text = torch.randn(B, K, D, generator=g).to(device).requires_grad_()
    else:
        text = torch.randn(B, D, generator=g).to(device).requires_grad_()
    opts = {"validate_args": False}
    fns: dict[str, Callable[[], None]] = {}
    if loss == "infonce":
        fns["dense"] = _step(lambda: CF.info_nce(audio, text, 0.07, **opts))
        fns["tiled"] = _step(lambda: CF.info_nce(audio, text, 0.07, chunk_size=1024, **opts))
        compiled = torch.compile(CF.info_nce)
        fns["compiled"] = _step(lambda: compiled(audio, text, 0.07, **opts))
        if oc is not None:
            ref = oc.ClipLoss()
            scale = torch.tensor(1 / 0.07, device=device)
            fns["open_clip"] = _step(
                lambda: ref(F.normalize(audio, dim=-1), F.normalize(text, dim=-1), scale)
            )
    elif loss == "siglip":
        fns["dense"] = _step(lambda: CF.siglip(audio, text, 10.0, -10.0, **opts))
        fns["tiled"] = _step(lambda: CF.siglip(audio, text, 10.0, -10.0, chunk_size=1024, **opts))
        if oc is not None:
            ref = oc.SigLipLoss()
            scale = torch.tensor(10.0, device=device)
            bias = torch.tensor(-10.0, device=device)
            fns["open_clip"] = _step(
                lambda: ref(F.normalize(audio, dim=-1), F.normalize(text, dim=-1), scale, bias)
            )
    else:  # kcl
        fns["dense"] = _step(lambda: CF.kcl(audio, text, 0.07, **opts))
        fns["tiled"] = _step(lambda: CF.kcl(audio, text, 0.07, chunk_size=1024, **opts))
        fns["loop"] = _step(
            lambda: sum(CF.info_nce(audio, text[:, k], 0.07, **opts) for k in range(K)) / K
        )
    reference = "open_clip" if "open_clip" in fns else ("loop" if loss == "kcl" else "dense")
    return fns, reference


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per (loss, B): each candidate's time ratio to the row's reference
    and its peak extra memory in MiB."""
    header = ["loss", "B", "reference", "candidate", "time ratio", "peak MiB"]
    body = []
    for row in rows:
        for name, r in row["results"].items():
            peak = r["peak_mib"]
            body.append([
                row["loss"], row["B"], row["reference"], name,
                r.get("ratio", r["ms"]), peak if peak is not None else "-",
            ])  # fmt: skip
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a check that it runs")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("bench_cuda: no CUDA device here (run --quick for a CPU check that it runs)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [64, 256] if args.quick else [1024, 4096, 16384, 32768]
    D, K = (32, 3) if args.quick else (512, 8)
    repeats = 3 if args.quick else args.repeats
    oc, why = _open_clip_loss()
    if oc is None:
        print(f"open_clip: skipped ({why})")
    rows = []
    for loss in ("infonce", "siglip", "kcl"):
        for B in sizes:
            if loss == "kcl" and B > sizes[-2]:
                continue  # K x the logits: the largest size is the InfoNCE row's
            fns, reference = _candidates(loss, B, D, K, device, oc)
            res = _measure(fns, repeats, device)
            ref_ms = res[reference]["ms"]
            for _name, r in res.items():
                if isinstance(r["ms"], float) and isinstance(ref_ms, float):
                    r["ratio"] = r["ms"] / ref_ms
            rows.append({"loss": loss, "B": B, "D": D, "reference": reference, "results": res})
            cells = ", ".join(
                f"{n} {r['ms'] if r['ms'] == 'oom' else format(r['ms'], '.2f')} ms"
                + (f" ({r['ratio']:.2f}x)" if "ratio" in r else "")
                + (f" {r['peak_mib']:.0f} MiB" if isinstance(r["peak_mib"], float) else "")
                for n, r in res.items()
            )
            print(f"{loss:8s} B={B:6d}: {cells}", flush=True)
            del fns
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "open_clip": why or "loaded",
        "D": D,
        "K": K,
        "repeats": repeats,
    }
    markdown = table(rows)
    print(markdown)
    write_results(
        "cuda", {"meta": meta, "rows": rows, "table_markdown": markdown}, quick=args.quick
    )


if __name__ == "__main__":
    main()
