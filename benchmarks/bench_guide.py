"""The cost of guided false-negative filtering (``guide=``): InfoNCE, SigLIP and KCL
(K = 4) forward + backward with a guide ``(B, Dg)`` against the same call without one,
dense and tiled (``chunk_size``), in the same run, interleaved; ratio = medians.

Two guides: ``duplicates``, one tensor (a caption encoder's) where a tenth of the rows
are noisy copies of another row (a few percent of the negatives excluded, the usual
case), and ``pair``, a random ``(guide_audio, guide_text)`` pair with margin 0 (about half
excluded: a worst case). The guide adds one ``(b, Dg) @ (Dg, N)`` product per
direction (the tiled kernels recompute it per tile, in forward and in backward) and the
masks' passes over the logits; on CPU ``exp`` of an excluded (filled) entry takes a slow
underflow path, so the cost grows with the share excluded (``guide_masked``, recorded).

    PYTHONPATH=src python benchmarks/bench_guide.py [--runs 3] [--quick]

One thread (the machine's cores are shared). Results: ``results/guide.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import interleaved_times, markdown_table, warm_up, write_results

from contrastive_losses import functional as CF

TAU, K, DG = 0.07, 4, 384  # Dg: an e5-small-sized guide


def _guide(kind: str, b: int, g: torch.Generator):
    """The guide and its margin (see the module docstring)."""
    if kind == "pair":
        return (torch.randn(b, DG, generator=g), torch.randn(b, DG, generator=g)), 0.0
    guide = torch.randn(b, DG, generator=g)
    rows = torch.randperm(b, generator=g)
    copies, sources = rows[: b // 10], rows[b // 10 : 2 * (b // 10)]
    guide[copies] = guide[sources] + 0.1 * torch.randn(len(copies), DG, generator=g)
    return guide, 0.05


def _step(loss: str, b: int, d: int, chunk: int | None, guide_kind: str | None):
    g = torch.Generator().manual_seed(0)
    audio = torch.randn(b, d, generator=g).requires_grad_()
    text_shape = (b, K, d) if loss == "kcl" else (b, d)
    text = torch.randn(*text_shape, generator=g).requires_grad_()
    guide, margin = _guide(guide_kind or "pair", b, g)
    kwargs = {"chunk_size": chunk, "guide_margin": margin}
    if guide_kind is not None:
        kwargs["guide"] = guide

    def run(return_terms: bool = False):
        audio.grad = text.grad = None
        if loss == "info_nce":
            out = CF.info_nce(audio, text, TAU, return_terms=return_terms, **kwargs)
        elif loss == "siglip":
            out = CF.siglip(audio, text, return_terms=return_terms, **kwargs)
        else:
            out = CF.kcl(audio, text, TAU, return_terms=return_terms, **kwargs)
        if return_terms:
            return out[1]["guide_masked"].item()
        out.backward()
        return None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="independent runs (medians of each)")
    parser.add_argument("--quick", action="store_true", help="a check that it runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    b, d, chunk = (64, 32, 16) if args.quick else (512, 512, 128)
    repeats = 3 if args.quick else 15
    warm_up(0.2 if args.quick else 2.0)
    rows, cases = [], []
    for loss, kind in [
        (x, y) for y in ("duplicates", "pair") for x in ("info_nce", "siglip", "kcl")
    ]:
        for impl, c in (("dense", None), ("tiled", chunk)):
            ratios = []
            guided = _step(loss, b, d, c, kind)
            masked = guided(return_terms=True)
            for _ in range(args.runs):
                fns = {"plain": _step(loss, b, d, c, None), "guided": guided}
                times = interleaved_times(fns, repeats, alternate=True)
                med = {k: statistics.median(v) for k, v in times.items()}
                ratios.append(med["guided"] / med["plain"])
            case = {
                "loss": loss,
                "guide": kind,
                "guide_masked": masked,
                "impl": impl,
                "B": b,
                "D": d,
                "Dg": DG,
                "chunk_size": c,
                "K": K if loss == "kcl" else None,
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "runs": args.runs,
            }
            cases.append(case)
            rows.append(
                [
                    loss,
                    kind,
                    f"{masked:.4f}",
                    impl,
                    f"{case['ratio_median']:.2f}",
                    f"{min(ratios):.2f}-{max(ratios):.2f}",
                ]
            )
    header = ["loss", "guide", "guide_masked", "path", "time ratio (guided / plain)", "range"]
    print(markdown_table(header, rows))
    path = write_results("guide", {"threads": 1, "cases": cases}, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
