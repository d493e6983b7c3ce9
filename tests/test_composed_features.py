"""Issue 49's features together: hard negatives, a guide, Matryoshka prefixes, SVR,
``chunk_size``, 2 gloo ranks and ``fullgraph`` compile in one call.

Each feature has its own file (``test_hard_negatives.py``, ``test_guide_filter.py``,
``test_matryoshka.py``); here they are combined and checked against one plain-loop float64
reference written from the definitions: anchor ``i``'s a->t denominator holds its
positive, the in-batch texts the guide keeps (``G_ij <= G_ii - m``) and every present text
hard negative of every row; t->a the same with the audio side. SigLIP sums the pairs the
guide keeps (for either anchor) plus every hard negative's negative-label term.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SPAWN_DEADLINE_S, init_gloo, outlasting, rank_rows, spawn_ranks
from reference import neg_log_softmax, sim, unit

from contrastive_losses import (
    InfoNCELoss,
    MatryoshkaLoss,
    SupportVectorRegularizer,
    _compat,
)
from contrastive_losses import functional as CF

B, D, DG, H, HA = 8, 6, 4, 2, 3
TAU, SCALE, BIAS, MARGIN = 0.25, 3.0, -1.0, 0.4

pytestmark = outlasting(SPAWN_DEADLINE_S)


def _data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    guide = randn(B, DG)
    guide[3] = guide[1] + 0.05 * randn(DG)  # a near-duplicate caption: a false negative
    return {
        "audio": randn(B, D),
        "text": randn(B, D),
        "neg": randn(B, H, D),
        "neg_m": torch.rand(B, H, generator=g) < 0.7,
        "aneg": randn(B, HA, D),
        "aneg_m": torch.rand(B, HA, generator=g) < 0.7,
        "guide": guide,
    }


def _kwargs(x: dict[str, torch.Tensor], rows=slice(None)) -> dict[str, torch.Tensor]:
    return {
        "hard_negatives": x["neg"][rows],
        "hard_negatives_mask": x["neg_m"][rows],
        "audio_hard_negatives": x["aneg"][rows],
        "audio_hard_negatives_mask": x["aneg_m"][rows],
        "guide": x["guide"][rows],
        "guide_margin": MARGIN,
    }


def _kept(x: dict[str, torch.Tensor]) -> list[list[bool]]:
    """``kept[i][j]``: the in-batch pair (i, j) stays in anchor i's denominator (and, the
    guide being one tensor, in anchor j's)."""
    g = [[float((unit(x["guide"][i]) * unit(x["guide"][j])).sum()) for j in range(B)]
         for i in range(B)]  # fmt: skip
    kept = [[i == j or not g[i][j] > 1.0 - MARGIN for j in range(B)] for i in range(B)]
    assert not all(all(row) for row in kept), "the guide must exclude something"
    return kept


def _present(x: dict[str, torch.Tensor], key: str) -> list[torch.Tensor]:
    n, m = x[key], x[f"{key}_m"]
    return [n[j, k] for j in range(n.shape[0]) for k in range(n.shape[1]) if bool(m[j, k])]


def ref_info_nce(x: dict[str, torch.Tensor]) -> torch.Tensor:
    a, t, kept = x["audio"], x["text"], _kept(x)
    tn, an = _present(x, "neg"), _present(x, "aneg")
    total = torch.zeros((), dtype=a.dtype)
    for i in range(B):
        a2t = [sim(a[i], t[i], TAU)] + [
            sim(a[i], t[j], TAU) for j in range(B) if j != i and kept[i][j]
        ]
        a2t += [sim(a[i], n, TAU) for n in tn]
        t2a = [sim(t[i], a[i], TAU)] + [
            sim(t[i], a[j], TAU) for j in range(B) if j != i and kept[i][j]
        ]
        t2a += [sim(t[i], m, TAU) for m in an]
        total = total + (neg_log_softmax(a2t, 0) + neg_log_softmax(t2a, 0)) / 2
    return total / B


def _pair(u: torch.Tensor, v: torch.Tensor, z: float) -> torch.Tensor:
    logit = SCALE * (unit(u) * unit(v)).sum() + BIAS
    return -torch.log(1 / (1 + torch.exp(-z * logit)))


def ref_siglip(x: dict[str, torch.Tensor]) -> torch.Tensor:
    a, t, kept = x["audio"], x["text"], _kept(x)
    tn, an = _present(x, "neg"), _present(x, "aneg")
    total = torch.zeros((), dtype=a.dtype)
    for i in range(B):
        for j in range(B):
            if kept[i][j]:
                total = total + _pair(a[i], t[j], 1.0 if i == j else -1.0)
        total = total + sum(_pair(a[i], n, -1.0) for n in tn)
        total = total + sum(_pair(m, t[i], -1.0) for m in an)
    return total / B


LEAVES = ("audio", "text", "neg", "aneg")


def _values_and_grads(fn, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    x = {k: v.clone().requires_grad_(k in LEAVES) for k, v in x.items()}
    loss = fn(x)
    return (loss.detach(), *torch.autograd.grad(loss, [x[k] for k in LEAVES]))


def _assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, g, w in zip(("loss", *LEAVES), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("chunk", [None, 3])
def test_info_nce_with_negatives_and_a_guide_equals_the_plain_loop(chunk) -> None:
    x = _data()

    def ours(x):
        return CF.info_nce(x["audio"], x["text"], TAU, chunk_size=chunk, **_kwargs(x))

    _assert_same(_values_and_grads(ours, x), _values_and_grads(ref_info_nce, x))


@pytest.mark.parametrize("chunk", [None, 3])
def test_siglip_with_negatives_and_a_guide_equals_the_plain_loop(chunk) -> None:
    x = _data(1)

    def ours(x):
        return CF.siglip(x["audio"], x["text"], SCALE, BIAS, chunk_size=chunk, **_kwargs(x))

    _assert_same(_values_and_grads(ours, x), _values_and_grads(ref_siglip, x))


def test_matryoshka_of_svr_with_negatives_and_a_guide_equals_its_sum_over_dims() -> None:
    """MatryoshkaLoss(SVR(InfoNCE)) with both features, tiled: the sum over the prefixes of
    the same SVR on the re-normalised prefixes (the negatives cut, the guide whole)."""
    x = _data(2)
    svr = SupportVectorRegularizer(
        InfoNCELoss(TAU, chunk_size=3, guide_margin=MARGIN), radius=0.1, alpha=0.5
    ).double()
    dims = (D, 4, 2)
    kw = {k: v for k, v in _kwargs(x).items() if k != "guide_margin"}

    def wrapped(x):
        return MatryoshkaLoss(svr, dims)(x["audio"], x["text"], **kw_of(x))

    def looped(x):
        total = torch.zeros((), dtype=torch.float64)
        for d in dims:
            cut = {k: (v[..., :d] if k in ("hard_negatives", "audio_hard_negatives") else v)
                   for k, v in kw_of(x).items()}  # fmt: skip
            total = total + svr(x["audio"][:, :d], x["text"][:, :d], **cut)
        return total

    def kw_of(x):
        return {**kw, "hard_negatives": x["neg"], "audio_hard_negatives": x["aneg"]}

    _assert_same(_values_and_grads(wrapped, x), _values_and_grads(looped, x))


@pytest.mark.skipif(
    _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE, reason="torch.compile refused on this torch"
)
def test_fullgraph_compile_of_all_features_equals_eager() -> None:
    x = {k: v.float() if v.is_floating_point() else v for k, v in _data(3).items()}
    loss_fn = MatryoshkaLoss(InfoNCELoss(TAU, chunk_size=3, guide_margin=MARGIN), (D, 3))
    kw = {k: v for k, v in _kwargs(x).items() if k != "guide_margin"}
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")

    def run(fn, x):
        return _values_and_grads(lambda y: fn(y["audio"], y["text"], **{**kw, **_cut(y)}), x)

    def _cut(y):
        return {"hard_negatives": y["neg"], "audio_hard_negatives": y["aneg"]}

    for g, w in zip(run(compiled, x), run(loss_fn, x), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- two ranks


def _rank_calls(gather: bool) -> dict:
    return {
        f"{name}_{chunk}": (lambda x, r, fn=fn, chunk=chunk: fn(x, r, gather, chunk))
        for name, fn in (
            (
                "info_nce",
                lambda x, r, gather, c: CF.info_nce(
                    x["audio"][r], x["text"][r], TAU, gather=gather, chunk_size=c, **_kwargs(x, r)
                ),
            ),
            (
                "siglip",
                lambda x, r, gather, c: CF.siglip(
                    x["audio"][r],
                    x["text"][r],
                    SCALE,
                    BIAS,
                    gather=gather,
                    chunk_size=c,
                    **_kwargs(x, r),
                ),
            ),
        )
        for chunk in (None, 3)
    }


def _rank_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        rows = rank_rows(rank)  # 5 and 3 rows: uneven
        results = {}
        for name, fn in _rank_calls(gather=True).items():
            x = _data(4)
            leaves = [x[k].requires_grad_() for k in LEAVES]
            loss = fn(x, rows)
            results[name] = (loss.detach(), torch.autograd.grad(loss, leaves))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return spawn_ranks(_rank_worker, tmp_path_factory.mktemp("composed"))


@pytest.mark.parametrize("name", list(_rank_calls(gather=False)))
def test_two_gloo_ranks_with_negatives_and_a_guide_equal_one_process(rank_results, name):
    """The mean of the ranks' losses is the one-process loss; the sum of their gradients
    (what DDP's mean of W ranks' gradients times W is) the one-process gradient."""
    x = _data(4)
    leaves = [x[k].requires_grad_() for k in LEAVES]
    loss = _rank_calls(gather=False)[name](x, slice(None))
    want = torch.autograd.grad(loss, leaves)
    got_loss = sum(r[name][0] for r in rank_results) / len(rank_results)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-9, atol=1e-11)
    for i, w in enumerate(want):
        got = sum(r[name][1][i] for r in rank_results) / len(rank_results)
        torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-11, msg=LEAVES[i])
