"""Speed of the ASK pieces against their references, as ratios measured in one run.

1. ``sinkhorn`` vs POT ``sinkhorn_log`` and POT plain ``sinkhorn`` (same iterations),
   B in {24, 256, 1024}, with the plan difference to POT log.
2. ``KnowledgeBank.search`` (faiss and torch backends, with id exclusion) vs one bare
   faiss ``IndexFlatIP`` search, 50k x 1024 bank, B in {24, 256}, k = 10.
3. ``ASKLoss`` forward + backward vs a plain inline InfoNCE and vs the bare faiss search.
4. k-means (faiss) for 512 prototypes on the 50k x 1024 pairs (one run, modest niter).

Single-threaded (torch and faiss) so that ratios do not depend on a shared machine's
load. Each timing (``timing.median_time``): ~2 s warm-up (at least one call), then the
median of up to ``--runs`` calls within ``--budget`` seconds. Results:
``benchmarks/results/ask.json`` (``--quick``: small sizes, ``results/quick/ask.json``).

    PYTHONPATH=src python benchmarks/bench_ask.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from timing import markdown_table, median_time, results_path

from contrastive_losses.ask import ASKLoss
from contrastive_losses.bank import KnowledgeBank
from contrastive_losses.ot import sinkhorn


def dict_table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    return markdown_table(cols, [[r[c] for c in cols] for r in rows])


def bench_sinkhorn(args: argparse.Namespace, ot: Any) -> list[dict[str, Any]]:
    rows = []
    iters, eps = 100, 0.05
    for b in args.sinkhorn_sizes:
        g = torch.Generator().manual_seed(b)
        x = F.normalize(torch.randn(b, 64, generator=g), dim=-1)
        y = F.normalize(torch.randn(b, 64, generator=g), dim=-1)
        s32 = x @ y.T  # (B, B) cosine similarities, float32 as in training
        m32 = (-s32).numpy()
        a32 = np.full(b, 1.0 / b, dtype=np.float32)

        def pot(method: str, m: np.ndarray = m32, a: np.ndarray = a32) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return ot.sinkhorn(a, a, m, eps, method=method, numItermax=iters, stopThr=0.0)

        t_auto, n1 = median_time(
            lambda s=s32: sinkhorn(s, eps, max_iter=iters), args.warmup, args.runs, args.budget
        )
        t_log, _ = median_time(
            lambda s=s32: sinkhorn(s, eps, max_iter=iters, method="log"),
            args.warmup,
            args.runs,
            args.budget,
        )
        t_pot_log, n2 = median_time(
            lambda: pot("sinkhorn_log"), args.warmup, args.runs, args.budget
        )
        t_pot, _ = median_time(lambda: pot("sinkhorn"), args.warmup, args.runs, args.budget)
        # same-plan check in float64 (float32 POT and ours differ by rounding only)
        s64 = s32.double()
        ref = pot("sinkhorn_log", (-s64).numpy(), np.full(b, 1.0 / b))
        diff = float(np.abs(sinkhorn(s64, eps, max_iter=iters).numpy() - ref).max())
        diff32 = float(np.abs(sinkhorn(s32, eps, max_iter=iters).double().numpy() - ref).max())
        rows.append(
            {
                "B": b,
                "ours_ms": 1e3 * t_auto,
                "ours_log_ms": 1e3 * t_log,
                "pot_log_ms": 1e3 * t_pot_log,
                "pot_plain_ms": 1e3 * t_pot,
                "ours/pot_log": t_auto / t_pot_log,
                "ours_log/pot_log": t_log / t_pot_log,
                "ours/pot_plain": t_auto / t_pot,
                "max|dQ| f64": diff,
                "max|dQ| f32": diff32,
                "runs": min(n1, n2),
            }
        )
        print(f"sinkhorn B={b}: done", flush=True)
    return rows


def bench_bank(args: argparse.Namespace, faiss: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    n, d, k = args.bank_size, args.dim, 10
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(n, d, generator=g)
    text = torch.randn(n, d, generator=g)
    ids = torch.arange(n)
    banks = {}
    for backend in ("faiss", "torch"):
        banks[backend] = KnowledgeBank(d, backend=backend, num_prototypes=0).build(audio, text, ids)
    # prototypes once (faiss k-means), shared by both banks so the losses are comparable
    t0 = time.perf_counter()
    protos = KnowledgeBank(d, backend="faiss", num_prototypes=512, kmeans_iters=args.kmeans_iters)
    pa, pt = protos._make_prototypes(banks["faiss"].audio, banks["faiss"].text)
    t_kmeans = time.perf_counter() - t0
    for bank in banks.values():
        bank.prototype_audio, bank.prototype_text = pa, pt
    kmeans = {
        "N": n,
        "D": d,
        "prototypes": 512,
        "kept": int(pa.shape[0]),
        "niter": args.kmeans_iters,
        "seconds": t_kmeans,
    }
    print(f"k-means: {t_kmeans:.1f} s", flush=True)

    bare = faiss.IndexFlatIP(d)
    bare.add(F.normalize(audio, dim=-1).numpy())
    rows = []
    for b in args.batch_sizes:
        q = F.normalize(torch.randn(b, d, generator=g), dim=-1)
        q_np = q.numpy()
        batch_ids = torch.randint(0, n, (b,), generator=g)
        t_bare, _ = median_time(
            lambda q_np=q_np: bare.search(q_np, k), args.warmup, args.runs, args.budget
        )
        res: dict[str, float] = {}
        for backend, bank in banks.items():
            res[backend], _ = median_time(
                lambda bank=bank, q=q, i=batch_ids: bank.search(q, k, "audio", exclude_ids=i),
                args.warmup,
                args.runs,
                args.budget,
            )
        a = torch.randn(b, d, generator=g, requires_grad=True)
        t_ = torch.randn(b, d, generator=g, requires_grad=True)

        def infonce(a: torch.Tensor = a, t_: torch.Tensor = t_) -> None:
            logits = F.normalize(a, dim=-1) @ F.normalize(t_, dim=-1).T / 0.07
            target = torch.arange(a.shape[0])
            loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
            loss.backward()

        t_nce, _ = median_time(infonce, args.warmup, args.runs, args.budget)
        t_ask: dict[str, float] = {}
        for backend, bank in banks.items():
            loss_fn = ASKLoss(bank, k=k)
            t_ask[backend], _ = median_time(
                lambda f=loss_fn, a=a, t_=t_, i=batch_ids: f(a, t_, i).backward(),
                args.warmup,
                args.runs,
                args.budget,
            )
        rows.append(
            {
                "B": b,
                "bare_faiss_ms": 1e3 * t_bare,
                "search_faiss/bare": res["faiss"] / t_bare,
                "search_torch/bare": res["torch"] / t_bare,
                "infonce_ms": 1e3 * t_nce,
                "ask_faiss_ms": 1e3 * t_ask["faiss"],
                "ask_faiss/bare": t_ask["faiss"] / t_bare,
                "ask_faiss/infonce": t_ask["faiss"] / t_nce,
                "ask_torch/bare": t_ask["torch"] / t_bare,
                "ask_torch/infonce": t_ask["torch"] / t_nce,
            }
        )
        print(f"bank/ASK B={b}: done", flush=True)
    return rows, kmeans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--budget", type=float, default=3.0, help="seconds of timed runs per entry")
    p.add_argument("--kmeans-iters", type=int, default=5)
    p.add_argument("--out", type=Path, help="result file (default: see timing.results_path)")
    args = p.parse_args()
    args.sinkhorn_sizes = [24, 256, 1024]
    args.batch_sizes = [24, 256]
    args.bank_size, args.dim = 50_000, 1024
    if args.quick:
        args.warmup, args.runs, args.budget = 0.1, 5, 0.2
        args.sinkhorn_sizes, args.bank_size, args.dim, args.kmeans_iters = [24, 256], 4000, 64, 2

    import faiss
    import ot

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    sk = bench_sinkhorn(args, ot)
    bank_rows, kmeans = bench_bank(args, faiss)
    result = {
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "faiss": faiss.__version__,
            "pot": ot.__version__,
            "machine": platform.machine(),
            "threads": 1,
        },
        "settings": {
            "sinkhorn": {"epsilon": 0.05, "iterations": 100, "dtype": "float32"},
            "bank": {"N": args.bank_size, "D": args.dim, "k": 10, "dtype": "float32"},
            "warmup_s": args.warmup,
            "max_runs": args.runs,
            "quick": args.quick,
        },
        "sinkhorn": sk,
        "bank_and_loss": bank_rows,
        "kmeans": kmeans,
    }
    out = args.out if args.out is not None else results_path("ask", args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    print("\n## sinkhorn (100 iterations, epsilon 0.05, float32)\n")
    print(dict_table(sk))
    print(f"\n## bank search and ASKLoss fwd+bwd ({args.bank_size} x {args.dim} bank, k = 10)\n")
    print(dict_table(bank_rows))
    print(f"\n## k-means: {kmeans}")


if __name__ == "__main__":
    main()
