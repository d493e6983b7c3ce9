"""``chunk_size``: the tiled (memory-bounded) path equals the dense path and the paper's
loops, forward and backward, for every loss; bad chunk sizes are refused by name."""

from __future__ import annotations

import copy

import pytest
import reference as ref
import reference_svr as ref_svr
import torch
from helpers import F64, randn, random_mask
from hypothesis import given, settings
from hypothesis import strategies as st

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses import functional as CF
from contrastive_losses._kernels import _TiledCrossEntropy, _TiledSigmoid

B, K, D = 7, 3, 5
CHUNKS = (1, 2, 7, 20)  # 1, does not divide B, = B, > B


def _data(seed: int, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    audio = randn(g, B, D).to(dtype).requires_grad_()
    text = randn(g, B, K, D).to(dtype).requires_grad_()
    return audio, text, random_mask(g, B, K, p=0.6), torch.tensor([0, 1, 2, 0, 3, 1, 4])


def _calls():
    """name -> fn(audio, text, mask, ids, temperature, chunk_size, reduction)."""
    return {
        "info_nce": lambda a, t, m, i, tau, c, r: CF.info_nce(
            a, t[:, 0], tau, reduction=r, chunk_size=c, return_terms=True
        ),
        "info_nce_ids": lambda a, t, m, i, tau, c, r: CF.info_nce(
            a, t[:, 0], tau, ids=i, reduction=r, chunk_size=c, return_terms=True
        ),
        "siglip": lambda a, t, m, i, tau, c, r: CF.siglip(
            a, t[:, 0], 1 / tau, -2 / tau, reduction=r, chunk_size=c, return_terms=True
        ),
        "siglip_ids": lambda a, t, m, i, tau, c, r: CF.siglip(
            a, t[:, 0], 1 / tau, -2 / tau, ids=i, reduction=r, chunk_size=c, return_terms=True
        ),
        "kcl": lambda a, t, m, i, tau, c, r: CF.kcl(
            a, t, tau, reduction=r, chunk_size=c, return_terms=True
        ),
        "kcl_mask": lambda a, t, m, i, tau, c, r: CF.kcl(
            a, t, tau, mask=m, reduction=r, chunk_size=c, return_terms=True
        ),
        "kcl_all": lambda a, t, m, i, tau, c, r: CF.kcl(
            a, t, tau, negatives="all_languages", reduction=r, chunk_size=c, return_terms=True
        ),
        "kcl_all_mask": lambda a, t, m, i, tau, c, r: CF.kcl(
            a,
            t,
            tau,
            mask=m,
            negatives="all_languages",
            reduction=r,
            chunk_size=c,
            return_terms=True,
        ),
        "cacl": lambda a, t, m, i, tau, c, r: CF.cacl(
            a, t[:, 0], t[:, 1], tau, reduction=r, chunk_size=c, return_terms=True
        ),
        "svr_term": lambda a, t, m, i, tau, c, r: (
            CF.support_vector_term(t[:, 1], a, 0.3, tau, reduction=r, chunk_size=c),
            {},
        ),
        "svr_term_mask": lambda a, t, m, i, tau, c, r: (
            CF.support_vector_term(
                t[:, 1],
                a,
                torch.linspace(0, 0.5, B, dtype=a.dtype),
                tau,
                mask=m[:, 1],
                reduction=r,
                chunk_size=c,
            ),
            {},
        ),
    }


def _assert_same(dense, tiled):
    """``(loss, terms, grads)`` of the tiled path equal the dense ones (float64)."""
    (l1, t1, g1), (l2, t2, g2) = dense, tiled
    torch.testing.assert_close(l2, l1, rtol=1e-10, atol=1e-12)
    assert t1.keys() == t2.keys()
    for key in t1:
        torch.testing.assert_close(t2[key], t1[key], rtol=1e-10, atol=1e-12)
    for x, y in zip(g1, g2, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-12)


def _run(name, chunk, reduction, seed=0, dtype=F64):
    a, t, m, i = _data(seed, dtype)
    tau = torch.tensor(0.2, dtype=dtype, requires_grad=True)
    loss, terms = _calls()[name](a, t, m, i, tau, chunk, reduction)
    weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=dtype).reshape(loss.shape)
    grads = torch.autograd.grad((loss * weights).sum(), (a, t, tau), allow_unused=True)
    return loss.detach(), terms, grads


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", list(_calls()))
def test_tiled_equals_dense_float64(name, chunk, reduction):
    _assert_same(_run(name, None, reduction), _run(name, chunk, reduction))


@pytest.mark.parametrize("name", ["info_nce", "siglip_ids", "kcl_mask", "kcl_all", "cacl"])
def test_tiled_equals_dense_float32(name):
    loss, _, grads = _run(name, None, "mean", dtype=torch.float32)
    t_loss, _, t_grads = _run(name, 3, "mean", dtype=torch.float32)
    torch.testing.assert_close(t_loss, loss, rtol=1e-5, atol=1e-6)
    for g, tg in zip(grads, t_grads, strict=True):
        torch.testing.assert_close(tg, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["info_nce", "siglip", "kcl_mask", "kcl_all", "svr_term"])
def test_half_inputs_are_computed_in_float32(name, dtype):
    """Tiles run in float32 and the result comes back in the input dtype: the tiled loss
    of half inputs equals the float32 loss of the same (rounded) inputs."""
    a, t, m, i = _data(0, dtype)
    loss, _ = _calls()[name](a, t, m, i, 0.2, 3, "mean")
    assert loss.dtype == dtype
    grads = torch.autograd.grad(loss, (a, t), allow_unused=True)
    a32, t32 = (x.detach().float().requires_grad_() for x in (a, t))
    ref_loss, _ = _calls()[name](a32, t32, m, i, 0.2, 3, "mean")
    torch.testing.assert_close(loss.float(), ref_loss.detach(), rtol=1e-2, atol=1e-2)
    for g in grads:
        assert g is None or (g.dtype == dtype and bool(torch.isfinite(g).all()))


def test_tiled_matches_the_papers_loops():
    """The tiled path against tests/reference.py (plain loops from the equations)."""
    a, t, m, i = (x.detach() for x in _data(1))
    tau, ml = 0.2, m.tolist()
    cases = [
        (CF.info_nce(a, t[:, 0], tau, chunk_size=3), ref.info_nce(a, t[:, 0], tau)),
        (
            CF.info_nce(a, t[:, 0], tau, ids=i, chunk_size=2),
            ref.info_nce_ids(a, t[:, 0], i.tolist(), tau),
        ),
        (CF.siglip(a, t[:, 0], 5.0, -2.0, chunk_size=3), ref.siglip(a, t[:, 0], 5.0, -2.0)),
        (CF.kcl(a, t, tau, mask=m, chunk_size=2), ref.kcl(a, t, tau, ml)),
        (
            CF.kcl(a, t, tau, mask=m, negatives="all_languages", chunk_size=4),
            ref.kcl_all_languages(a, t, tau, ml),
        ),
        (CF.cacl(a, t[:, 0], t[:, 1], tau, chunk_size=3), ref.cacl(a, t[:, 0], t[:, 1], tau)),
        (
            CF.support_vector_term(t[:, 1], a, 0.3, tau, chunk_size=2),
            ref_svr.support_vector_term(t[:, 1], a, [0.3] * B, tau),
        ),
    ]
    for ours, theirs in cases:
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def _module_pairs():
    yield "info_nce", lambda c: InfoNCELoss(learnable_temperature=True, chunk_size=c)
    yield "siglip", lambda c: SigLIPLoss(chunk_size=c)
    yield "kcl", lambda c: KCLLoss(learnable_temperature=True, chunk_size=c)
    yield (
        "kcl_all",
        lambda c: KCLLoss(negatives="all_languages", learnable_temperature=True, chunk_size=c),
    )
    yield "cacl", lambda c: CACLLoss(learnable_temperature=True, chunk_size=c)


def _module_call(name, loss_fn, a, t, m, **kw):
    if name in ("info_nce", "siglip"):
        return loss_fn(a, t[:, 0], **kw)
    if name == "cacl":
        return loss_fn(a, t, generator=torch.Generator().manual_seed(0), **kw)
    return loss_fn(a, t, m, **kw)


@pytest.mark.parametrize("name,make", list(_module_pairs()))
def test_modules_tiled_equal_dense_with_learnable_parameters(name, make):
    """Learnable temperature / SigLIP scale and bias get the same gradient, accumulated
    over tiles."""
    a, t, m, _ = _data(2)
    dense, tiled = make(None).double(), make(3).double()
    tiled.load_state_dict(dense.state_dict())
    out = []
    for loss_fn in (dense, tiled):
        loss, terms = _module_call(name, loss_fn, a, t, m, return_terms=True)
        params = [a, t, *loss_fn.parameters()]
        assert len(params) > 2
        out.append((loss, terms, torch.autograd.grad(loss, params)))
    _assert_same(*out)


@pytest.mark.parametrize("direction", ["uni", "bi"])
@pytest.mark.parametrize("radius", ["dynamic", "static", 0.2])
@pytest.mark.parametrize("name,make", list(_module_pairs()))
def test_svr_tiles_with_its_base_chunk_size(name, make, radius, direction):
    """SupportVectorRegularizer follows its base's chunk_size: the running top-k for the
    predictor's input, the tiled SVR rows and the tiled radius slope equal the dense ones
    (values, every term, every gradient: embeddings, temperature, radius parameters)."""
    a, t, m, _ = _data(3)
    torch.manual_seed(0)
    dense = SupportVectorRegularizer(
        make(None), radius=radius, direction=direction, num_features=4
    ).double()
    tiled = copy.deepcopy(dense)
    tiled.base.chunk_size = 2
    out = []
    for loss_fn in (dense, tiled):
        loss, terms = _module_call(name, loss_fn, a, t, m, return_terms=True)
        params = [a, t, *loss_fn.parameters()]
        out.append((loss, terms, torch.autograd.grad(loss, params, allow_unused=True)))
    _assert_same(*out)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(2, 9),
    k=st.integers(1, 3),
    d=st.integers(1, 4),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    n_ids=st.integers(1, 9),
    negatives=st.sampled_from(["per_language", "all_languages"]),
)
def test_tiled_property_any_shape_ids_and_mask(b, k, d, chunk, seed, n_ids, negatives):
    """Any shape, chunk size, duplicate ids (InfoNCE, SigLIP) and mask (KCL): the tiled
    loss and gradients equal the dense ones."""
    g = torch.Generator().manual_seed(seed)
    audio = randn(g, b, d).requires_grad_()
    text = randn(g, b, k, d).requires_grad_()
    ids = torch.randint(0, n_ids, (b,), generator=g)
    mask = random_mask(g, b, k, p=0.5)
    calls = [
        lambda c: CF.info_nce(audio, text[:, 0], 0.3, ids=ids, chunk_size=c),
        lambda c: CF.siglip(audio, text[:, 0], 4.0, -1.0, ids=ids, chunk_size=c),
        lambda c: CF.kcl(audio, text, 0.3, mask=mask, negatives=negatives, chunk_size=c),
    ]
    for call in calls:
        dense = call(None)
        g_dense = torch.autograd.grad(dense, (audio, text), allow_unused=True)
        tiled = call(chunk)
        g_tiled = torch.autograd.grad(tiled, (audio, text), allow_unused=True)
        torch.testing.assert_close(tiled, dense, rtol=1e-10, atol=1e-12)
        for x, y in zip(g_dense, g_tiled, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_tiled_cross_entropy_gradcheck(symmetric, ids, masked):
    g = torch.Generator().manual_seed(4)
    q, b = 2, 5
    x = randn(g, b, 3).requires_grad_()
    y = randn(g, q, b, 3).requires_grad_()
    row_ids = col_ids = torch.tensor([0, 1, 0, 2, 1]) if ids else None
    valid = (torch.rand(q, b, generator=g) > 0.3) if masked else None
    columns = (0, b) if symmetric else None

    def fn(x, y):
        return _TiledCrossEntropy.apply(x, y, 0, row_ids, col_ids, valid, valid, 2, columns, False)

    assert torch.autograd.gradcheck(fn, (x, y))


@pytest.mark.parametrize("ids", [False, True])
def test_tiled_sigmoid_gradcheck(ids):
    g = torch.Generator().manual_seed(5)
    x, y = randn(g, 5, 3).requires_grad_(), randn(g, 5, 3).requires_grad_()
    scale = torch.tensor(3.0, dtype=F64, requires_grad=True)
    bias = torch.tensor(-1.0, dtype=F64, requires_grad=True)
    row_ids = col_ids = torch.tensor([0, 1, 0, 2, 1]) if ids else None
    assert torch.autograd.gradcheck(
        lambda x, y, s, b: _TiledSigmoid.apply(x, y, s, b, 0, row_ids, col_ids, 2),
        (x, y, scale, bias),
    )


@pytest.fixture
def tiled_calls(monkeypatch):
    """Records every call of the tiled Functions (and runs it)."""
    calls: list[str] = []
    for cls in (_TiledCrossEntropy, _TiledSigmoid):

        def apply(*args, _apply=cls.apply, _name=cls.__name__):
            calls.append(_name)
            return _apply(*args)

        monkeypatch.setattr(cls, "apply", staticmethod(apply))
    return calls


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["info_nce", "info_nce_ids", "siglip", "siglip_ids", "cacl"])
def test_one_tile_runs_the_dense_path(name, reduction, tiled_calls):
    """chunk_size >= B: one tile covers the batch, and the call runs the dense path (the
    tile loop cost 2-3x it at B = 32, issue 28): the dense values and gradients, bit for
    bit, and no tiled Function is called; one column fewer (B - 1) does call it."""
    dense = _run(name, None, reduction)
    for chunk in (B, B + 13):
        torch.testing.assert_close(_run(name, chunk, reduction), dense, rtol=0, atol=0)
    assert tiled_calls == []
    _assert_same(dense, _run(name, B - 1, reduction))
    assert tiled_calls


@pytest.mark.parametrize("siglip", [False, True])
def test_open_clip_drop_ins_with_one_tile_run_the_dense_path(siglip, tiled_calls):
    """The open_clip drop-ins' ``chunk_size`` at or above the batch: their dense call."""
    from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

    cls = SigLipLoss if siglip else ClipLoss
    a, t, _, _ = _data(1)
    scale = torch.tensor(8.0, dtype=F64, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=F64, requires_grad=True)

    def value_and_grads(loss_fn):
        loss = loss_fn(a, t[:, 0], scale, bias)
        return loss.detach(), torch.autograd.grad(loss, (a, t, scale), allow_unused=True)

    dense = value_and_grads(cls())
    torch.testing.assert_close(value_and_grads(cls(chunk_size=B)), dense, rtol=0, atol=0)
    assert tiled_calls == []
    value_and_grads(cls(chunk_size=B - 1))
    assert tiled_calls


def test_no_tile_is_kept_for_backward():
    """What autograd keeps between forward and backward is O(B*D + B), not a tile: the
    tiled loss saves the inputs and row/column statistics only (open_clip's chunked
    SigLIP keeps every chunk's logits, PR #1214)."""
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    b, d = 64, 4
    g = torch.Generator().manual_seed(6)
    a, t = randn(g, b, d).requires_grad_(), randn(g, b, d).requires_grad_()
    for call in (
        lambda: CF.info_nce(a, t, 0.1, chunk_size=8),
        lambda: CF.siglip(a, t, chunk_size=8),
        lambda: CF.kcl(a, t[:, None].expand(-1, 2, -1), 0.1, chunk_size=8),
    ):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            call()
        assert saved and max(s.numel() for s in saved) <= 2 * b * d, saved


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "64"])
def test_bad_chunk_size_is_refused_by_name(bad):
    a, t, _, _ = _data(0)
    calls = [
        lambda: CF.info_nce(a, t[:, 0], chunk_size=bad),
        lambda: CF.siglip(a, t[:, 0], chunk_size=bad),
        lambda: CF.kcl(a, t, chunk_size=bad),
        lambda: CF.cacl(a, t[:, 0], t[:, 1], chunk_size=bad),
        lambda: CF.support_vector_term(t[:, 0], a, 0.1, chunk_size=bad),
        lambda: InfoNCELoss(chunk_size=bad),
        lambda: SigLIPLoss(chunk_size=bad),
        lambda: KCLLoss(chunk_size=bad),
        lambda: CACLLoss(chunk_size=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="chunk_size"):
            call()
