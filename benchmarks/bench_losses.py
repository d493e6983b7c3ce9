"""Forward+backward time and activation memory of InfoNCE, KCL and CACL, as ratios to
references measured in the same run.

References:
* InfoNCE vs ``clip_ref``: what open_clip's ClipLoss does (normalise, two matmuls
  ``a @ t.T`` and ``t @ a.T``, two cross-entropies), vs ``clip_ref_1mm`` (the same with
  the transpose of one logits matrix), and vs one bare ``(B, D) @ (D, B)`` matmul.
* KCL vs a Python loop of K ``info_nce`` calls (the per-language loss written the
  obvious way), and vs a loop of K ``clip_ref`` calls.
* CACL vs three ``info_nce`` calls.

Run: ``python benchmarks/bench_losses.py [--quick]``; writes results/losses.json
(``--quick``: results/quick/losses.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from timing import (
    interleaved_medians,
    markdown_table,
    saved_tensor_bytes,
    warm_up,
    write_results,
)

from contrastive_losses import functional as CF

TAU = 0.07


def clip_ref(a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a, t = F.normalize(a, dim=-1), F.normalize(t, dim=-1)
    target = torch.arange(a.shape[0])
    logits_a = a @ t.T / TAU
    logits_t = t @ a.T / TAU
    return (F.cross_entropy(logits_a, target) + F.cross_entropy(logits_t, target)) / 2


def clip_ref_1mm(a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a, t = F.normalize(a, dim=-1), F.normalize(t, dim=-1)
    target = torch.arange(a.shape[0])
    logits = a @ t.T / TAU
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def fwd_bwd(loss_fn, *inputs: torch.Tensor):
    leaves = [x.detach().requires_grad_() for x in inputs]

    def run() -> torch.Tensor:
        loss = loss_fn(*leaves)
        loss.backward()
        return loss

    return run, lambda: loss_fn(*leaves)


def bench(
    batch: int, k_langs: int, dim: int, repeats: int, min_time: float = 1.0
) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(batch, dim, generator=g)
    t = torch.randn(batch, dim, generator=g)
    tk = torch.randn(batch, k_langs, dim, generator=g)
    o = torch.randn(batch, dim, generator=g)
    cases = {
        "info_nce": (lambda x, y: CF.info_nce(x, y, TAU), (a, t)),
        "clip_ref": (clip_ref, (a, t)),
        "clip_ref_1mm": (clip_ref_1mm, (a, t)),
        "kcl": (lambda x, y: CF.kcl(x, y, TAU), (a, tk)),
        "kcl_loop_info_nce": (
            lambda x, y: sum(CF.info_nce(x, y[:, k], TAU) for k in range(k_langs)) / k_langs,
            (a, tk),
        ),
        "kcl_loop_clip_ref": (
            lambda x, y: sum(clip_ref(x, y[:, k]) for k in range(k_langs)) / k_langs,
            (a, tk),
        ),
        "cacl": (lambda x, y, z: CF.cacl(x, y, z, TAU), (a, t, o)),
        "cacl_3x_info_nce": (
            lambda x, y, z: (CF.info_nce(x, y) + CF.info_nce(x, z) + CF.info_nce(y, z)) / 3,
            (a, t, o),
        ),
    }
    runs = {}
    memory = {}
    for name, (fn, inputs) in cases.items():
        run, forward = fwd_bwd(fn, *inputs)
        runs[name] = run
        memory[name] = saved_tensor_bytes(forward)
    bt = b2 = torch.randn(batch, dim)
    runs["one_matmul"] = lambda: bt @ b2.T
    times = interleaved_medians(runs, repeats=repeats, min_time=min_time)
    return [
        {"B": batch, "case": name, "seconds": times[name], "saved_bytes": memory.get(name)}
        for name in runs
    ]


RATIOS = [
    ("info_nce", "clip_ref", None),
    ("info_nce", "clip_ref_1mm", None),
    ("info_nce", "one_matmul", None),
    ("kcl", "kcl_loop_info_nce", {24: 0.4, 256: 0.6, 1024: 0.9}),
    ("kcl", "kcl_loop_clip_ref", None),
    ("cacl", "cacl_3x_info_nce", None),
]
TARGETS = {("info_nce", "clip_ref"): {1024: 0.7}, ("info_nce", "one_matmul"): {1024: 4.0}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="B in {24, 256}, 5 repeats: a check, not a measurement"
    )
    parser.add_argument("--out", type=Path, help="result file (default: see timing.results_path)")
    args = parser.parse_args()
    batches = [24, 256] if args.quick else [24, 256, 1024]
    warm_up(0.5 if args.quick else 2.0)
    rows: list[dict[str, object]] = []
    for batch in batches:
        if args.quick:  # a check that the script runs, not a measurement
            rows += bench(batch, k_langs=8, dim=1024, repeats=5, min_time=0.0)
        else:
            repeats = {24: 200, 256: 40, 1024: 9}[batch]
            rows += bench(batch, k_langs=8, dim=1024, repeats=repeats)
    lookup = {(r["B"], r["case"]): r for r in rows}
    table = []
    for ours, ref, kcl_targets in RATIOS:
        targets = kcl_targets or TARGETS.get((ours, ref), {})
        for batch in batches:
            t_ratio = lookup[(batch, ours)]["seconds"] / lookup[(batch, ref)]["seconds"]
            m_ours, m_ref = (
                lookup[(batch, ours)]["saved_bytes"],
                lookup[(batch, ref)]["saved_bytes"],
            )
            m_ratio = m_ours / m_ref if m_ours and m_ref else float("nan")
            target = targets.get(batch)
            verdict = "" if target is None else ("met" if t_ratio <= target else "MISSED")
            table.append(
                [
                    f"{ours} / {ref}",
                    batch,
                    t_ratio,
                    m_ratio,
                    "" if target is None else target,
                    verdict,
                ]
            )
    md = markdown_table(
        ["ratio", "B", "time ratio", "activation-memory ratio", "target", ""], table
    )
    print(md)
    payload = {"quick": args.quick, "rows": rows, "table_markdown": md}
    path = write_results("losses", payload, quick=args.quick, path=args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
