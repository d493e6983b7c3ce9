"""Hard negatives (issue 49, item 1) for InfoNCE, SigLIP and KCL: every present hard
negative of every row is an extra column of every anchor (MultipleNegativesRankingLoss),
never an anchor itself. Each loss equals a plain-loop float64 reference written from that
definition, dense and tiled, values and gradients; gradcheck; properties; 2 gloo ranks;
SVR; GradCache; ``torch.compile(fullgraph=True)``; bad inputs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import init_gloo, randn, rank_rows, spawn_ranks
from hypothesis import given
from hypothesis import strategies as st
from reference import neg_log_softmax, sim, unit
from torch import Tensor, nn

from contrastive_losses import (
    GradCache,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
    _compat,
)
from contrastive_losses import functional as CF

TAU, SCALE, BIAS = 0.2, 3.0, -1.0
B, H, HA, D, K = 5, 3, 2, 4, 3


def _present(mask: Tensor | None, n: int, h: int) -> list[tuple[int, int]]:
    """The ``(row, slot)`` of every present negative."""
    return [(j, k) for j in range(n) for k in range(h) if mask is None or bool(mask[j, k])]


# ------------------------------------------------------------------ plain-loop references


def ref_info_nce(a, t, neg, neg_m, aneg, aneg_m, ids=None):
    """Per row i: a->t softmax over the N texts and every present text negative, the mean
    over its positives (equal ids) of -log softmax; t->a over the N audios and every
    present audio negative; the mean over rows of (a2t + t2a) / 2."""
    n = a.shape[0]
    ids = list(range(n)) if ids is None else ids
    tn = [] if neg is None else [neg[j, k] for j, k in _present(neg_m, n, neg.shape[1])]
    an = [] if aneg is None else [aneg[j, k] for j, k in _present(aneg_m, n, aneg.shape[1])]
    total = torch.zeros((), dtype=a.dtype)
    for i in range(n):
        pos = [j for j in range(n) if ids[j] == ids[i]]
        a2t = [sim(a[i], t[j], TAU) for j in range(n)] + [sim(a[i], x, TAU) for x in tn]
        t2a = [sim(t[i], a[j], TAU) for j in range(n)] + [sim(t[i], x, TAU) for x in an]
        la = sum(neg_log_softmax(a2t, p) for p in pos) / len(pos)
        lt = sum(neg_log_softmax(t2a, p) for p in pos) / len(pos)
        total = total + (la + lt) / 2
    return total / n


def _softplus_term(u, v, z):
    """-log sigmoid(z (scale <u, v> + bias)), written out."""
    logit = SCALE * (unit(u) * unit(v)).sum() + BIAS
    return -torch.log(1 / (1 + torch.exp(-z * logit)))


def ref_siglip(a, t, neg, neg_m, aneg, aneg_m):
    """The in-batch pairs plus a negative-label pair for every (audio anchor, present
    text negative) and every (present audio negative, text anchor); over N."""
    n = a.shape[0]
    total = torch.zeros((), dtype=a.dtype)
    for i in range(n):
        for j in range(n):
            total = total + _softplus_term(a[i], t[j], 1.0 if i == j else -1.0)
        if neg is not None:
            for j, k in _present(neg_m, n, neg.shape[1]):
                total = total + _softplus_term(a[i], neg[j, k], -1.0)
        if aneg is not None:
            for j, k in _present(aneg_m, n, aneg.shape[1]):
                total = total + _softplus_term(aneg[j, k], t[i], -1.0)
    return total / n


def ref_kcl(a, t, mask, neg, neg_m, aneg, aneg_m):
    """ATRI Eq. 9-11 per language over the present captions, each a->t softmax with every
    present text negative, each t->a softmax with every present audio negative."""
    n, k_langs = t.shape[0], t.shape[1]
    tn = [] if neg is None else [neg[j, h] for j, h in _present(neg_m, n, neg.shape[1])]
    an = [] if aneg is None else [aneg[j, h] for j, h in _present(aneg_m, n, aneg.shape[1])]
    total, count = torch.zeros((), dtype=a.dtype), 0
    for k in range(k_langs):
        members = [j for j in range(n) if mask is None or bool(mask[j, k])]
        for i in members:
            a2t = [sim(a[i], t[j, k], TAU) for j in members] + [sim(a[i], x, TAU) for x in tn]
            t2a = [sim(t[i, k], a[j], TAU) for j in members] + [sim(t[i, k], x, TAU) for x in an]
            pos = members.index(i)
            total = total + neg_log_softmax(a2t, pos) + neg_log_softmax(t2a, pos)
            count += 1
    return total / (2 * count)


def ref_kcl_all(a, t, mask, neg, neg_m, aneg, aneg_m):
    """``negatives="all_languages"``: one a->t softmax per clip over all present
    captions and every present text negative (its own present captions positive); each
    caption's t->a over all audios and every present audio negative."""
    n, k_langs = t.shape[0], t.shape[1]
    caps = [(j, k) for j in range(n) for k in range(k_langs) if mask is None or bool(mask[j, k])]
    tn = [] if neg is None else [neg[j, h] for j, h in _present(neg_m, n, neg.shape[1])]
    an = [] if aneg is None else [aneg[j, h] for j, h in _present(aneg_m, n, aneg.shape[1])]
    total = torch.zeros((), dtype=a.dtype)
    for i in range(n):
        scores = [sim(a[i], t[j, k], TAU) for j, k in caps] + [sim(a[i], x, TAU) for x in tn]
        own = [c for c, (j, _) in enumerate(caps) if j == i]
        a2t = sum(neg_log_softmax(scores, p) for p in own) / len(own)
        for _, k in (caps[c] for c in own):
            t2a = [sim(t[i, k], a[j], TAU) for j in range(n)] + [sim(t[i, k], x, TAU) for x in an]
            total = total + (a2t + neg_log_softmax(t2a, i)) / 2
    return total / len(caps)


# ------------------------------------------------------------------ data and comparison


def _data(seed: int = 0, b: int = B, h: int = H, ha: int = HA, k: int = 0) -> dict:
    """float64 leaves: audio, text ((b, k, D) when k), both sides' negatives and masks
    (row 0 of each mask has no present negative at all)."""
    g = torch.Generator().manual_seed(seed)
    text_shape = (b, k, D) if k else (b, D)
    neg_m = torch.rand(b, h, generator=g) < 0.6
    aneg_m = torch.rand(b, ha, generator=g) < 0.6
    neg_m[0], aneg_m[0] = False, False
    caption_m = torch.rand(b, max(k, 1), generator=g) < 0.7
    caption_m[:, 0] = True
    return {
        "audio": randn(g, b, D).requires_grad_(),
        "text": randn(g, *text_shape).requires_grad_(),
        "neg": randn(g, b, h, D).requires_grad_(),
        "neg_m": neg_m,
        "aneg": randn(g, b, ha, D).requires_grad_(),
        "aneg_m": aneg_m,
        "mask": caption_m,
    }


def _grads(loss: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad(loss, xs)


def _assert_same(got: Tensor, want: Tensor, x: dict) -> None:
    """Values and the gradients of audio, text and both sides' negatives."""
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    leaves = (x["audio"], x["text"], x["neg"], x["aneg"])
    for gg, gw in zip(_grads(got, *leaves), _grads(want, *leaves), strict=True):
        torch.testing.assert_close(gg, gw, rtol=1e-8, atol=1e-11)


CHUNKS = [None, 2, 3]  # dense; tiles that divide neither the batch nor the negatives' columns


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_ids", [False, True])
def test_info_nce_matches_plain_loop(chunk, masked, with_ids):
    x = _data()
    nm, am = (x["neg_m"], x["aneg_m"]) if masked else (None, None)
    ids = [0, 1, 0, 2, 1] if with_ids else None
    got = CF.info_nce(
        x["audio"],
        x["text"],
        TAU,
        ids=None if ids is None else torch.tensor(ids),
        hard_negatives=x["neg"],
        hard_negatives_mask=nm,
        audio_hard_negatives=x["aneg"],
        audio_hard_negatives_mask=am,
        chunk_size=chunk,
    )
    want = ref_info_nce(x["audio"], x["text"], x["neg"], nm, x["aneg"], am, ids)
    _assert_same(got, want, x)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("masked", [False, True])
def test_siglip_matches_plain_loop(chunk, masked):
    x = _data(1)
    nm, am = (x["neg_m"], x["aneg_m"]) if masked else (None, None)
    got = CF.siglip(
        x["audio"],
        x["text"],
        SCALE,
        BIAS,
        hard_negatives=x["neg"],
        hard_negatives_mask=nm,
        audio_hard_negatives=x["aneg"],
        audio_hard_negatives_mask=am,
        chunk_size=chunk,
    )
    want = ref_siglip(x["audio"], x["text"], x["neg"], nm, x["aneg"], am)
    _assert_same(got, want, x)


@pytest.mark.parametrize("chunk", [None, 2])
def test_siglip_scale_and_bias_gradients_with_negatives(chunk):
    """The tiled reduction's bias gradient (its own backward) and the scale's."""
    x = _data(2)
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    kw = {
        "hard_negatives": x["neg"],
        "hard_negatives_mask": x["neg_m"],
        "audio_hard_negatives": x["aneg"],
    }
    got = CF.siglip(x["audio"], x["text"], scale, bias, chunk_size=chunk, **kw)
    want = ref_siglip(x["audio"], x["text"], x["neg"], x["neg_m"], x["aneg"], None)
    # the reference's scale and bias are constants: compare d/dscale by finite difference
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    gs, gb = torch.autograd.grad(got, (scale, bias))
    eps = 1e-6
    for p, g in ((scale, gs), (bias, gb)):
        with torch.no_grad():
            p += eps
            up = CF.siglip(x["audio"], x["text"], scale, bias, chunk_size=chunk, **kw)
            p -= 2 * eps
            down = CF.siglip(x["audio"], x["text"], scale, bias, chunk_size=chunk, **kw)
            p += eps
        torch.testing.assert_close(g, (up - down) / (2 * eps), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode", ["per_language", "all_languages"])
@pytest.mark.parametrize("masked", [False, True])
def test_kcl_matches_plain_loop(chunk, mode, masked):
    x = _data(3, k=K)
    cm = x["mask"] if masked else None
    nm, am = (x["neg_m"], x["aneg_m"]) if masked else (None, None)
    got = CF.kcl(
        x["audio"],
        x["text"],
        TAU,
        mask=cm,
        negatives=mode,
        hard_negatives=x["neg"],
        hard_negatives_mask=nm,
        audio_hard_negatives=x["aneg"],
        audio_hard_negatives_mask=am,
        chunk_size=chunk,
    )
    ref = ref_kcl if mode == "per_language" else ref_kcl_all
    want = ref(x["audio"], x["text"], cm, x["neg"], nm, x["aneg"], am)
    _assert_same(got, want, x)


def test_kcl_absent_captions_stay_zero_with_negatives():
    """reduction="none": (B, K), 0 at absent captions, as without negatives."""
    x = _data(4, k=K)
    out = CF.kcl(
        x["audio"],
        x["text"],
        TAU,
        mask=x["mask"],
        hard_negatives=x["neg"],
        audio_hard_negatives=x["aneg"],
        reduction="none",
    )
    assert bool((out[~x["mask"]] == 0).all())
    assert bool((out[x["mask"]] > 0).all())


# ------------------------------------------------------------------ gradcheck


def test_gradcheck_tiled_and_dense():
    """float64 gradcheck of the tiled reduction (chunk 2 over 7 columns) and the dense one,
    masks included, through info_nce (with ids), siglip (learnable bias) and kcl."""
    g = torch.Generator().manual_seed(5)
    a, t, tk = randn(g, 3, 3), randn(g, 3, 3), randn(g, 3, 2, 3)
    n, an = randn(g, 3, 2, 3), randn(g, 3, 1, 3)
    nm = torch.tensor([[True, False], [True, True], [False, False]])
    bias = torch.tensor(-0.5, dtype=torch.float64)
    ids = torch.tensor([0, 1, 0])
    for chunk in (None, 2):

        def f(a, t, tk, n, an, bias, chunk=chunk):
            nce = CF.info_nce(
                a, t, TAU, ids=ids, hard_negatives=n, hard_negatives_mask=nm,
                audio_hard_negatives=an, chunk_size=chunk,
            )  # fmt: skip
            sig = CF.siglip(
                a, t, SCALE, bias, hard_negatives=n, hard_negatives_mask=nm, chunk_size=chunk
            )
            kcl = CF.kcl(a, tk, TAU, hard_negatives=n, audio_hard_negatives=an, chunk_size=chunk)
            return nce + sig + kcl

        inputs = tuple(x.clone().requires_grad_() for x in (a, t, tk, n, an, bias))
        assert torch.autograd.gradcheck(f, inputs)


# ------------------------------------------------------------------ properties


@given(seed=st.integers(0, 10_000), b=st.integers(2, 5), h=st.integers(1, 3))
def test_adding_a_negative_never_lowers_info_nce(seed, b, h):
    x = _data(seed, b=b, h=h)
    mask = x["neg_m"].clone()
    mask[0] = False
    more = mask.clone()
    more[0, 0] = True
    kw = {"hard_negatives": x["neg"].detach()}
    fewer_loss = CF.info_nce(
        x["audio"].detach(), x["text"].detach(), hard_negatives_mask=mask, **kw
    )
    more_loss = CF.info_nce(x["audio"].detach(), x["text"].detach(), hard_negatives_mask=more, **kw)
    assert float(more_loss) > float(fewer_loss)


@given(seed=st.integers(0, 10_000), chunk=st.sampled_from([None, 2]))
def test_fully_masked_negatives_equal_none(seed, chunk):
    """Values and gradients: absent negatives take no part, and make no NaN."""
    x = _data(seed)
    a, t = x["audio"], x["text"]
    off = torch.zeros(B, H, dtype=torch.bool)
    for fn in (CF.info_nce, CF.siglip):
        got = fn(a, t, hard_negatives=x["neg"], hard_negatives_mask=off, chunk_size=chunk)
        want = fn(a, t, chunk_size=chunk)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        ga, gt, gn = torch.autograd.grad(got, (a, t, x["neg"]))
        wa, wt = torch.autograd.grad(want, (a, t))
        torch.testing.assert_close((ga, gt), (wa, wt), rtol=1e-10, atol=1e-12)
        assert bool((gn == 0).all())


@given(seed=st.integers(0, 10_000), chunk=st.sampled_from([None, 2]))
def test_permuting_the_negatives_leaves_the_loss(seed, chunk):
    """Any permutation of all B*H negatives (across rows too): the same column set."""
    x = _data(seed)
    flat, m = x["neg"].detach().reshape(B * H, D), x["neg_m"].reshape(-1)
    perm = torch.randperm(B * H, generator=torch.Generator().manual_seed(seed))
    shuffled = {
        "hard_negatives": flat[perm].view(B, H, D),
        "hard_negatives_mask": m[perm].view(B, H),
    }
    kept = {"hard_negatives": x["neg"].detach(), "hard_negatives_mask": x["neg_m"]}
    a, t = x["audio"].detach(), x["text"].detach()
    for fn in (CF.info_nce, CF.siglip):
        got = fn(a, t, chunk_size=chunk, **shuffled)
        torch.testing.assert_close(got, fn(a, t, chunk_size=chunk, **kept), rtol=1e-12, atol=0)


def test_no_negative_columns_equal_none():
    """H = 0 (a batch where mining found nothing): the plain loss, dense and tiled."""
    x = _data(13)
    a, t = x["audio"].detach(), x["text"].detach()
    empty = torch.zeros(B, 0, D, dtype=torch.float64)
    for chunk in (None, 2):
        for fn in (CF.info_nce, CF.siglip):
            got = fn(a, t, hard_negatives=empty, audio_hard_negatives=empty, chunk_size=chunk)
            torch.testing.assert_close(got, fn(a, t, chunk_size=chunk), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    """Half inputs and negatives: the float32 loss of the same (rounded) values, returned
    in their dtype, with gradients in their dtype."""
    x = _data(14)
    half = [x[k].detach().to(dtype).requires_grad_() for k in ("audio", "text", "neg", "aneg")]
    wide = [h.detach().float().requires_grad_() for h in half]
    kw = {"hard_negatives_mask": x["neg_m"], "chunk_size": 2}
    got = CF.info_nce(half[0], half[1], hard_negatives=half[2], audio_hard_negatives=half[3], **kw)
    want = CF.info_nce(wide[0], wide[1], hard_negatives=wide[2], audio_hard_negatives=wide[3], **kw)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0, atol=0)
    for gh, gw in zip(torch.autograd.grad(got, half), torch.autograd.grad(want, wide), strict=True):
        assert gh.dtype == dtype
        torch.testing.assert_close(gh, gw.to(dtype))


# ------------------------------------------------------------------ 2 gloo ranks


def _rank_losses(gather: bool) -> dict:
    """name -> fn(data, rows): each loss with both sides' negatives (masked), dense and
    tiled."""

    def kw(x, rows, key="hard_negatives"):
        return {
            key: x["neg"][rows],
            f"{key}_mask": x["neg_m"][rows],
            "audio_hard_negatives": x["aneg"][rows],
            "audio_hard_negatives_mask": x["aneg_m"][rows],
        }

    out = {}
    for c in (None, 3):
        out[f"info_nce_{c}"] = lambda x, r, c=c: CF.info_nce(
            x["audio"][r], x["text"][r], TAU, gather=gather, chunk_size=c, **kw(x, r)
        )
        out[f"info_nce_ids_{c}"] = lambda x, r, c=c: CF.info_nce(
            x["audio"][r],
            x["text"][r],
            TAU,
            ids=torch.tensor([0, 1, 2, 3, 0, 4, 2, 5])[r],
            gather=gather,
            chunk_size=c,
            **kw(x, r),
        )
        out[f"siglip_{c}"] = lambda x, r, c=c: CF.siglip(
            x["audio"][r], x["text"][r], SCALE, BIAS, gather=gather, chunk_size=c, **kw(x, r)
        )
        out[f"kcl_all_{c}"] = lambda x, r, c=c: CF.kcl(
            x["audio"][r],
            x["text3"][r],
            TAU,
            mask=x["mask3"][r],
            negatives="all_languages",
            gather=gather,
            chunk_size=c,
            **kw(x, r, "hard_negatives"),
        )
        out[f"kcl_{c}"] = lambda x, r, c=c: CF.kcl(
            x["audio"][r],
            x["text3"][r],
            TAU,
            mask=x["mask3"][r],
            gather=gather,
            chunk_size=c,
            **kw(x, r, "hard_negatives"),
        )
    return out


def _rank_data() -> dict:
    x = _data(7, b=8)
    y = _data(8, b=8, k=K)
    x["text3"], x["mask3"] = y["text"], y["mask"]
    return {k: v.detach() for k, v in x.items()}


def _rank_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        rows = rank_rows(rank)  # 5 and 3 rows: uneven
        results = {}
        for name, fn in _rank_losses(gather=True).items():
            x = _rank_data()
            leaves = [x[k].requires_grad_() for k in ("audio", "text", "text3", "neg", "aneg")]
            loss = fn(x, rows)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            results[name] = (loss.detach(), grads)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return spawn_ranks(_rank_worker, tmp_path_factory.mktemp("hardneg"))


@pytest.mark.parametrize("name", list(_rank_losses(gather=False)))
def test_two_gloo_ranks_equal_one_process(rank_results, name):
    """The mean of the ranks' losses is the one-process loss on the concatenated batch;
    the ranks' gradients (each rank's rows, /world) are its gradients."""
    x = _rank_data()
    leaves = [x[k].requires_grad_() for k in ("audio", "text", "text3", "neg", "aneg")]
    loss = _rank_losses(gather=False)[name](x, slice(None))
    want = torch.autograd.grad(loss, leaves, allow_unused=True)
    mean = sum(r[name][0] for r in rank_results) / 2
    torch.testing.assert_close(mean, loss.detach(), rtol=1e-9, atol=0)
    for i, w in enumerate(want):
        got = [r[name][1][i] for r in rank_results]
        if w is None:
            assert all(g is None for g in got)
            continue
        # gathered gradients reach their owner: rank r's leaf holds its rows' gradient
        total = sum(g for g in got) / 2
        parts = [total[rank_rows(r)] for r in range(2)]
        torch.testing.assert_close(torch.cat(parts), w, rtol=1e-8, atol=1e-11)


# rank r's call of each case: negatives on one rank only, another H, a mask on one rank only
MISMATCHES = {
    "given": lambda r, a, t, n: CF.info_nce(a, t, hard_negatives=n if r == 0 else None),
    "shape": lambda r, a, t, n: CF.siglip(a, t, hard_negatives=n[:, : 1 + r]),
    "mask": lambda r, a, t, n: CF.info_nce(
        a,
        t,
        hard_negatives=n,
        hard_negatives_mask=torch.ones(n.shape[:2], dtype=torch.bool) if r else None,
    ),
    "audio": lambda r, a, t, n: CF.kcl(
        a, t[:, None], hard_negatives=n, audio_hard_negatives=n if r else None
    ),
}


def _mismatch_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        x = _rank_data()
        rows = rank_rows(rank)
        results = {}
        for name, fn in MISMATCHES.items():
            try:
                fn(rank, x["audio"][rows], x["text"][rows], x["neg"][rows])
                results[name] = "no error"
            except ValueError as e:
                results[name] = str(e)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_that_disagree_on_negatives_are_refused_not_hung(tmp_path):
    """Every rank raises a ValueError naming the hard negatives (a gather of negatives
    on one rank only would pair collectives wrongly: a hang or a gloo abort)."""
    results = spawn_ranks(_mismatch_worker, tmp_path)
    expected = {
        "given": r"^hard negatives given \(text, audio\): differs across ranks",
        "shape": r"^hard_negatives: shape after the batch dim \(1, 4\) on rank 0 but \(2, 4\)",
        "mask": r"^hard negatives' masks given \(text, audio\): differs across ranks",
        "audio": r"^hard negatives given \(text, audio\): differs across ranks",
    }
    for name, pattern in expected.items():
        for r in results:
            assert re.search(pattern, r[name]), (name, r[name])


# ------------------------------------------------------------------ wrappers


def test_svr_wrapping_info_nce_adds_its_term_to_the_base_with_negatives():
    """SVR forwards the keywords to the base; its term is on the in-batch pairs only."""
    x = _data(9)
    a, t = x["audio"].detach(), x["text"].detach()
    kw = {"hard_negatives": x["neg"].detach(), "hard_negatives_mask": x["neg_m"]}
    base = InfoNCELoss(TAU)
    torch.manual_seed(0)
    svr = SupportVectorRegularizer(base, radius="static", num_features=B).double()
    plain_term = svr(a, t) - base(a, t)
    with_neg = svr(a, t, **kw)
    torch.testing.assert_close(with_neg, base(a, t, **kw) + plain_term, rtol=1e-12, atol=1e-12)
    assert float(base(a, t, **kw)) != pytest.approx(float(base(a, t)))


class _Tower(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(6, D).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


def test_grad_cache_with_negatives_encoded_by_the_text_tower():
    """The negatives' captions ride with the positives through the text encoder; the
    cached step leaves the plain step's gradients."""
    g = torch.Generator().manual_seed(10)
    audio_in, text_in = randn(g, B, 6), randn(g, B + B * H, 6)

    def loss_fn(a, t, **kw):
        return CF.info_nce(a, t[:B], hard_negatives=t[B:].view(B, H, -1), **kw)

    towers = [(_Tower(1), _Tower(2)), (_Tower(1), _Tower(2))]
    plain = loss_fn(towers[0][0](audio_in), towers[0][1](text_in), chunk_size=3)
    plain.backward()
    cached = GradCache(loss_fn, chunk_size=2)(
        towers[1][0], audio_in, towers[1][1], text_in, chunk_size=3
    )
    torch.testing.assert_close(cached, plain.detach(), rtol=1e-12, atol=0)
    for p, q in zip(
        [*towers[0][0].parameters(), *towers[0][1].parameters()],
        [*towers[1][0].parameters(), *towers[1][1].parameters()],
        strict=True,
    ):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(
    _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE, reason="torch.compile refused on this torch"
)
@pytest.mark.parametrize("chunk", [None, 2])
def test_compiled_fullgraph_equals_eager(chunk):
    """The three Modules with both sides' negatives (masked) in one fullgraph graph."""
    torch._dynamo.reset()
    x, y = _data(11), _data(12, k=K)
    losses = (
        InfoNCELoss(TAU, chunk_size=chunk),
        SigLIPLoss(learnable=False, chunk_size=chunk),
        KCLLoss(TAU, chunk_size=chunk),
    )
    masks = {"audio_hard_negatives_mask": x["aneg_m"]}

    def step(a, t, t3, n, an):
        nce, sig, kcl = losses
        return (
            nce(
                a,
                t,
                hard_negatives=n,
                hard_negatives_mask=x["neg_m"],
                audio_hard_negatives=an,
                **masks,
            )
            + sig(
                a,
                t,
                hard_negatives=n,
                hard_negatives_mask=x["neg_m"],
                audio_hard_negatives=an,
                **masks,
            )
            + kcl(a, t3, y["mask"], hard_negatives=n, audio_hard_negatives=an, **masks)
        )

    leaves = [x["audio"], x["text"], y["text"], x["neg"], x["aneg"]]
    f32 = [v.detach().float().requires_grad_() for v in leaves]
    eager = step(*f32)
    ge = torch.autograd.grad(eager, f32)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*f32)
    gc = torch.autograd.grad(compiled, f32)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"hard_negatives": torch.randn(B, H)},
            ValueError,
            r"hard_negatives: expected shape \(B, H, D\)",
        ),
        ({"hard_negatives": torch.randn(B + 1, H, D)}, ValueError, "hard_negatives.*batch size B"),
        (
            {"hard_negatives": torch.randn(B, H, D + 1)},
            ValueError,
            "hard_negatives.*embedding dim D",
        ),
        (
            {"hard_negatives": torch.randn(B, H, D).double()},
            (TypeError, ValueError),
            "hard_negatives",
        ),
        ({"hard_negatives": torch.ones(B, H, D, dtype=torch.long)}, TypeError, "negatives"),
        ({"hard_negatives": [[0.0]]}, TypeError, "negatives"),
        (
            {"hard_negatives_mask": torch.ones(B, H, dtype=torch.bool)},
            ValueError,
            "given without hard_negatives",
        ),
        (
            {"audio_hard_negatives": torch.full((B, H, D), float("nan"))},
            ValueError,
            "audio_hard_negatives",
        ),
        (
            {"audio_hard_negatives": torch.zeros(B, H, D)},
            ValueError,
            "audio_hard_negatives.*all zeros",
        ),
    ],
)
def test_bad_negatives_are_refused_by_name(change, error, match):
    a, t = torch.randn(B, D), torch.randn(B, D)
    for fn in (CF.info_nce, CF.siglip):
        with pytest.raises(error, match=match):
            fn(a, t, **change)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (
            torch.ones(B, H + 1, dtype=torch.bool),
            ValueError,
            r"hard_negatives_mask: expected shape",
        ),
        (torch.ones(B, H), TypeError, "hard_negatives_mask: expected a bool tensor"),
        ("yes", TypeError, "hard_negatives_mask"),
    ],
)
def test_bad_masks_are_refused_by_name(mask, error, match):
    a, t, n = torch.randn(B, D), torch.randn(B, D), torch.randn(B, H, D)
    with pytest.raises(error, match=match):
        CF.info_nce(a, t, hard_negatives=n, hard_negatives_mask=mask)
    with pytest.raises(error, match=match):
        CF.kcl(a, t[:, None], hard_negatives=n, hard_negatives_mask=mask)


def test_absent_negatives_may_be_zero_rows_and_overflow_is_refused():
    a, t = torch.randn(B, D), torch.randn(B, D)
    n = torch.randn(B, H, D)
    n[1, 2] = 0
    m = torch.ones(B, H, dtype=torch.bool)
    m[1, 2] = False
    assert torch.isfinite(CF.info_nce(a, t, hard_negatives=n, hard_negatives_mask=m))
    with pytest.raises(ValueError, match=r"hard_negatives.*normalize=False"):
        CF.info_nce(a, t, hard_negatives=n * 1e37, normalize=False)
