"""InfoNCE, SigLIP, KCL and CACL against the paper-equation references, gradcheck,
properties, Module == functional, and every bad input."""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from helpers import F64, randn, random_mask
from hypothesis import given
from hypothesis import strategies as st

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    sample_languages,
)
from contrastive_losses import functional as CF

# ------------------------------------------------------------------ references


@pytest.mark.parametrize("temperature", [0.07, 0.5, 2.0])
def test_info_nce_matches_reference(gen, temperature):
    a, t = randn(gen, 6, 5), randn(gen, 6, 5)
    torch.testing.assert_close(CF.info_nce(a, t, temperature), ref.info_nce(a, t, temperature))


def test_info_nce_ids_matches_reference(gen):
    a, t = randn(gen, 7, 4), randn(gen, 7, 4)
    ids = [0, 1, 0, 2, 3, 1, 4]
    out = CF.info_nce(a, t, 0.2, ids=torch.tensor(ids))
    torch.testing.assert_close(out, ref.info_nce_ids(a, t, ids, 0.2))


def test_info_nce_unique_ids_equal_plain(gen):
    """The multi-positive path with distinct ids is the fast cross-entropy path, fwd + bwd."""
    a1, t1 = randn(gen, 9, 6).requires_grad_(), randn(gen, 9, 6).requires_grad_()
    a2, t2 = a1.detach().clone().requires_grad_(), t1.detach().clone().requires_grad_()
    fast = CF.info_nce(a1, t1, 0.1)
    slow = CF.info_nce(a2, t2, 0.1, ids=torch.arange(9) * 3)
    torch.testing.assert_close(fast, slow)
    fast.backward()
    slow.backward()
    torch.testing.assert_close(a1.grad, a2.grad)
    torch.testing.assert_close(t1.grad, t2.grad)


def test_info_nce_identical_embeddings_is_log_batch(gen):
    """All similarities equal -> every softmax is uniform -> loss = log B."""
    x = randn(gen, 1, 8).expand(5, 8)
    torch.testing.assert_close(CF.info_nce(x, x, 0.07), torch.tensor(math.log(5), dtype=F64))


def test_siglip_matches_reference(gen):
    a, t = randn(gen, 5, 4), randn(gen, 5, 4)
    torch.testing.assert_close(CF.siglip(a, t, 7.0, -3.0), ref.siglip(a, t, 7.0, -3.0))


@pytest.mark.parametrize("masked", [False, True])
def test_kcl_matches_reference(gen, masked):
    a, t = randn(gen, 6, 5), randn(gen, 6, 3, 5)
    mask = random_mask(gen, 6, 3) if masked else None
    out = CF.kcl(a, t, 0.3, mask=mask)
    expected = ref.kcl(a, t, 0.3, None if mask is None else mask.tolist())
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("masked", [False, True])
def test_kcl_all_languages_matches_reference(gen, masked):
    a, t = randn(gen, 5, 4), randn(gen, 5, 3, 4)
    mask = random_mask(gen, 5, 3) if masked else None
    out = CF.kcl(a, t, 0.3, mask=mask, negatives="all_languages")
    expected = ref.kcl_all_languages(a, t, 0.3, None if mask is None else mask.tolist())
    torch.testing.assert_close(out, expected)


def test_cacl_matches_reference(gen):
    a, e, o = randn(gen, 6, 4), randn(gen, 6, 4), randn(gen, 6, 4)
    torch.testing.assert_close(CF.cacl(a, e, o, 0.2), ref.cacl(a, e, o, 0.2))


# ------------------------------------------------------------------ gradcheck (float64)


def _leaf(gen, *shape):
    return randn(gen, *shape).requires_grad_()


def test_gradcheck_info_nce(gen):
    a, t = _leaf(gen, 4, 3), _leaf(gen, 4, 3)
    assert torch.autograd.gradcheck(lambda x, y: CF.info_nce(x, y, 0.5), (a, t))
    ids = torch.tensor([0, 1, 0, 2])
    assert torch.autograd.gradcheck(lambda x, y: CF.info_nce(x, y, 0.5, ids=ids), (a, t))


def test_gradcheck_info_nce_temperature(gen):
    a, t = _leaf(gen, 4, 3), _leaf(gen, 4, 3)
    tau = torch.tensor(0.3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y, s: CF.info_nce(x, y, s), (a, t, tau))


def test_gradcheck_siglip(gen):
    a, t = _leaf(gen, 4, 3), _leaf(gen, 4, 3)
    scale = torch.tensor(5.0, dtype=F64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(CF.siglip, (a, t, scale, bias))


@pytest.mark.parametrize("negatives", ["per_language", "all_languages"])
def test_gradcheck_kcl(gen, negatives):
    a, t = _leaf(gen, 4, 3), _leaf(gen, 4, 3, 3)
    mask = random_mask(gen, 4, 3)
    for m in (None, mask):
        fn = lambda x, y, m=m: CF.kcl(x, y, 0.5, mask=m, negatives=negatives)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (a, t))


def test_gradcheck_cacl(gen):
    a, e, o = _leaf(gen, 4, 3), _leaf(gen, 4, 3), _leaf(gen, 4, 3)
    assert torch.autograd.gradcheck(lambda x, y, z: CF.cacl(x, y, z, 0.5), (a, e, o))


# ------------------------------------------------------------------ properties

dims = st.tuples(st.integers(2, 7), st.integers(1, 5), st.integers(2, 6))  # B, K, D


@given(dims, st.integers(0, 2**31 - 1), st.floats(0.05, 2.0))
def test_kcl_with_one_language_is_info_nce(bkd, seed, temperature):
    b, _, d = bkd
    g = torch.Generator().manual_seed(seed)
    a, t = randn(g, b, d), randn(g, b, d)
    for negatives in ("per_language", "all_languages"):
        out = CF.kcl(a, t[:, None], temperature, negatives=negatives)
        torch.testing.assert_close(out, CF.info_nce(a, t, temperature))


@given(dims, st.integers(0, 2**31 - 1))
def test_cacl_is_mean_of_three_info_nce(bkd, seed):
    b, _, d = bkd
    g = torch.Generator().manual_seed(seed)
    a, e, o = randn(g, b, d), randn(g, b, d), randn(g, b, d)
    expected = (CF.info_nce(a, e) + CF.info_nce(a, o) + CF.info_nce(e, o)) / 3
    torch.testing.assert_close(CF.cacl(a, e, o), expected)


@given(dims, st.integers(0, 2**31 - 1), st.sampled_from(["info_nce", "siglip", "kcl", "kcl_all"]))
def test_invariant_to_permuting_the_batch(bkd, seed, which):
    b, k, d = bkd
    g = torch.Generator().manual_seed(seed)
    a, t = randn(g, b, d), randn(g, b, k, d)
    mask = random_mask(g, b, k)
    perm = torch.randperm(b, generator=g)
    fns = {
        "info_nce": lambda a, t, m: CF.info_nce(a, t[:, 0]),
        "siglip": lambda a, t, m: CF.siglip(a, t[:, 0]),
        "kcl": lambda a, t, m: CF.kcl(a, t, mask=m),
        "kcl_all": lambda a, t, m: CF.kcl(a, t, mask=m, negatives="all_languages"),
    }
    fn = fns[which]
    torch.testing.assert_close(fn(a, t, mask), fn(a[perm], t[perm], mask[perm]))


@given(dims, st.integers(0, 2**31 - 1), st.floats(0.05, 1.0))
def test_masked_kcl_is_count_weighted_info_nce_on_present_pairs(bkd, seed, temperature):
    """Per language, masked KCL is InfoNCE on the sub-batch of present pairs; the total
    weights each language by its number of present pairs."""
    b, k, d = bkd
    g = torch.Generator().manual_seed(seed)
    a, t = randn(g, b, d), randn(g, b, k, d)
    mask = random_mask(g, b, k, p=0.6)
    total, count = torch.zeros((), dtype=F64), 0
    for lang in range(k):
        rows = mask[:, lang].nonzero().flatten()
        n = len(rows)
        if n == 0:
            continue
        if n == 1:  # a single pair: softmax over one item, loss exactly 0
            count += 1
            continue
        total = total + n * CF.info_nce(a[rows], t[rows, lang], temperature)
        count += n
    torch.testing.assert_close(CF.kcl(a, t, temperature, mask=mask), total / count)


@given(dims, st.integers(0, 2**31 - 1))
def test_all_true_mask_equals_no_mask(bkd, seed):
    b, k, d = bkd
    g = torch.Generator().manual_seed(seed)
    a, t = randn(g, b, d), randn(g, b, k, d)
    ones = torch.ones(b, k, dtype=torch.bool)
    for negatives in ("per_language", "all_languages"):
        torch.testing.assert_close(
            CF.kcl(a, t, mask=ones, negatives=negatives), CF.kcl(a, t, negatives=negatives)
        )


def test_kcl_is_mean_over_languages_of_info_nce(gen):
    a, t = randn(gen, 6, 4), randn(gen, 6, 3, 4)
    per_lang = torch.stack([CF.info_nce(a, t[:, k], 0.1) for k in range(3)])
    torch.testing.assert_close(CF.kcl(a, t, 0.1), per_lang.mean())
    _, terms = CF.kcl(a, t, 0.1, return_terms=True)
    torch.testing.assert_close(terms["loss_per_language"], per_lang)


def test_masked_kcl_backward_is_finite_and_ignores_absent_captions(gen):
    """An absent caption gets exactly zero gradient and nothing is NaN."""
    a, t = randn(gen, 5, 4).requires_grad_(), randn(gen, 5, 3, 4).requires_grad_()
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[2, 1] = mask[4, 2] = False
    for negatives in ("per_language", "all_languages"):
        a.grad = t.grad = None
        CF.kcl(a, t, mask=mask, negatives=negatives).backward()
        assert torch.isfinite(a.grad).all() and torch.isfinite(t.grad).all()
        assert t.grad[2, 1].abs().max() == 0 and t.grad[4, 2].abs().max() == 0
        assert t.grad[2, 0].abs().max() > 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_are_consistent(gen, reduction):
    a, t = randn(gen, 5, 4), randn(gen, 5, 3, 4)
    mask = random_mask(gen, 5, 3)
    cases = [
        (lambda r: CF.info_nce(a, t[:, 0], reduction=r), (5,)),
        (lambda r: CF.siglip(a, t[:, 0], reduction=r), (5,)),
        (lambda r: CF.kcl(a, t, mask=mask, reduction=r), (5, 3)),
        (lambda r: CF.cacl(a, t[:, 0], t[:, 1], reduction=r), (5,)),
    ]
    for fn, shape in cases:
        per_sample = fn("none")
        assert per_sample.shape == shape
        out = fn(reduction)
        if reduction == "sum":
            torch.testing.assert_close(out, per_sample.sum())
        elif reduction == "mean":
            n = int(mask.sum()) if len(shape) == 2 else shape[0]
            torch.testing.assert_close(out, per_sample.sum() / n)


# ------------------------------------------------------------------ Modules == functional


def test_modules_match_functional(gen):
    a, t = randn(gen, 6, 4), randn(gen, 6, 3, 4)
    mask = random_mask(gen, 6, 3)
    torch.testing.assert_close(InfoNCELoss(0.2).double()(a, t[:, 0]), CF.info_nce(a, t[:, 0], 0.2))
    torch.testing.assert_close(
        SigLIPLoss(5.0, -1.0).double()(a, t[:, 0]), CF.siglip(a, t[:, 0], 5.0, -1.0)
    )
    torch.testing.assert_close(
        KCLLoss(0.2, negatives="all_languages").double()(a, t, mask),
        CF.kcl(a, t, 0.2, mask=mask, negatives="all_languages"),
    )
    idx = sample_languages(mask, generator=torch.Generator().manual_seed(1))
    rows = torch.arange(6)
    expected = CF.cacl(a, t[:, 0], t[rows, idx], 0.2)
    torch.testing.assert_close(CACLLoss(0.2).double()(a, t, idx, mask=mask), expected)
    again = CACLLoss(0.2).double()(a, t, mask=mask, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(again, expected)
    torch.testing.assert_close(CACLLoss(0.2).double()(a, t[:, 0], t[rows, idx]), expected)


def test_learnable_temperature_trains_and_is_clamped():
    loss_fn = InfoNCELoss(0.07, learnable_temperature=True)
    assert [n for n, _ in loss_fn.named_parameters()] == ["log_logit_scale"]
    a, t = torch.randn(8, 4), torch.randn(8, 4)
    loss_fn(a, t).backward()
    assert loss_fn.log_logit_scale.grad is not None and loss_fn.log_logit_scale.grad != 0
    with torch.no_grad():
        loss_fn.log_logit_scale.fill_(math.log(1000.0))
    torch.testing.assert_close(loss_fn.temperature, torch.tensor(0.01))
    fixed = InfoNCELoss(0.07)
    assert list(fixed.parameters()) == [] and "log_logit_scale" in fixed.state_dict()


def test_siglip_parameters_initialised_as_paper():
    loss_fn = SigLIPLoss()
    torch.testing.assert_close(loss_fn.log_scale.detach(), torch.tensor(math.log(10.0)))
    torch.testing.assert_close(loss_fn.bias.detach(), torch.tensor(-10.0))
    loss_fn(torch.randn(6, 4), torch.randn(6, 4)).backward()
    assert loss_fn.log_scale.grad != 0 and loss_fn.bias.grad != 0


def test_return_terms_are_detached_and_complete(gen):
    a, t = randn(gen, 5, 4).requires_grad_(), randn(gen, 5, 3, 4)
    loss, terms = KCLLoss().double()(a, t, return_terms=True)
    assert loss.requires_grad
    assert set(terms) == {"loss_a2t", "loss_t2a", "loss_per_language", "temperature"}
    assert all(not v.requires_grad for v in terms.values())
    torch.testing.assert_close((terms["loss_a2t"] + terms["loss_t2a"]) / 2, loss.detach())
    _, terms = CACLLoss().double()(a, t, generator=gen, return_terms=True)
    assert {"loss_audio_english", "loss_audio_other", "loss_english_other"} <= set(terms)


def test_contrastive_pairs_cover_what_each_loss_contrasts(gen):
    a, t = randn(gen, 5, 4), randn(gen, 5, 3, 4)
    mask = random_mask(gen, 5, 3)
    pairs = KCLLoss().contrastive_pairs(a, t, mask)
    assert len(pairs) == 3 and torch.equal(pairs[1].text, t[:, 1])
    assert torch.equal(pairs[2].mask, mask[:, 2])
    idx = torch.full((5,), 2)
    cacl_pairs = CACLLoss().contrastive_pairs(a, t, idx)
    assert [p.audio is a for p in cacl_pairs[:2]] == [True, True]
    assert torch.equal(cacl_pairs[2].audio, t[:, 0]) and torch.equal(cacl_pairs[2].text, t[:, 2])
    assert len(InfoNCELoss().contrastive_pairs(a, t[:, 0])) == 1


# ------------------------------------------------------------------ sample_languages


def test_sample_languages_draws_present_non_english_uniformly():
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool).repeat(2000, 1)
    idx = sample_languages(mask, generator=torch.Generator().manual_seed(0))
    assert bool(mask[torch.arange(len(idx)), idx].all()) and bool((idx != 0).all())
    first = idx[0::2]
    share = (first == 1).double().mean().item()  # two choices {1, 3}: ~0.5
    assert abs(share - 0.5) < 0.05
    assert bool((idx[1::2] == 2).all())
    with_en = sample_languages(mask, include_english=True, generator=torch.Generator())
    assert (with_en == 0).any()


def test_sample_languages_is_reproducible():
    one = sample_languages(8, batch_size=64, generator=torch.Generator().manual_seed(3))
    two = sample_languages(8, batch_size=64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(one, two) and one.min() >= 1 and one.max() <= 7


# ------------------------------------------------------------------ bad inputs


def _good(gen):
    return randn(gen, 4, 3), randn(gen, 4, 3), randn(gen, 4, 2, 3)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda a, t, tk: CF.info_nce(a[0], t), ValueError, r"audio: expected shape \(B, D\)"),
        (lambda a, t, tk: CF.info_nce(a, t[:3]), ValueError, "text: batch size B 3"),
        (lambda a, t, tk: CF.info_nce(a, t[:, :2]), ValueError, "text: embedding dim D 2"),
        (lambda a, t, tk: CF.info_nce(a.long(), t), TypeError, "audio: expected a floating"),
        (lambda a, t, tk: CF.info_nce(a, t.float()), TypeError, "text: dtype torch.float32"),
        (lambda a, t, tk: CF.info_nce(a[:1], t[:1]), ValueError, "audio: batch size 1"),
        (lambda a, t, tk: CF.info_nce(a, t, 0.0), ValueError, "temperature: must be"),
        (lambda a, t, tk: CF.info_nce(a, t, -1.0), ValueError, "temperature: must be"),
        (lambda a, t, tk: CF.info_nce(a, t, reduction="avg"), ValueError, "reduction"),
        (lambda a, t, tk: CF.info_nce(a, t, ids=torch.arange(3)), ValueError, "ids: expected"),
        (lambda a, t, tk: CF.info_nce(a, t, ids=torch.ones(4)), TypeError, "ids: expected an int"),
        (lambda a, t, tk: CF.info_nce(a, "x"), TypeError, "text: expected a torch.Tensor"),
        (lambda a, t, tk: CF.kcl(a, t), ValueError, r"text: expected shape \(B, K, D\)"),
        (lambda a, t, tk: CF.kcl(a, tk[:3]), ValueError, "text: batch size B 3"),
        (lambda a, t, tk: CF.kcl(a, tk, negatives="x"), ValueError, "negatives"),
        (
            lambda a, t, tk: CF.kcl(a, tk, mask=torch.ones(4, 3, dtype=torch.bool)),
            ValueError,
            r"mask: expected shape \(4, 2\)",
        ),
        (lambda a, t, tk: CF.kcl(a, tk, mask=torch.ones(4, 2)), TypeError, "mask: expected a bool"),
        (
            lambda a, t, tk: CF.kcl(
                a, tk, mask=torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1]]).bool()
            ),
            ValueError,
            r"mask: sample\(s\) \[1\] have no present caption",
        ),
        (lambda a, t, tk: CF.cacl(a, t, t[:2]), ValueError, "other: batch size B 2"),
        (lambda a, t, tk: CACLLoss()(a, tk, torch.zeros(4).long()), ValueError, "English"),
        (lambda a, t, tk: CACLLoss()(a, tk, torch.full((4,), 5)), ValueError, "other: language"),
        (lambda a, t, tk: CACLLoss()(a, t), ValueError, "other:"),
        (lambda a, t, tk: SigLIPLoss(scale_init=0.0), ValueError, "scale_init"),
        (lambda a, t, tk: KCLLoss(negatives="some"), ValueError, "negatives"),
        (lambda a, t, tk: InfoNCELoss(temperature=-0.1), ValueError, "temperature"),
        (lambda a, t, tk: CF.info_nce(a, t, gather=True), ValueError, "gather: True needs"),
        (lambda a, t, tk: sample_languages(4), ValueError, "batch_size"),
        (
            lambda a, t, tk: sample_languages(torch.tensor([[1, 0], [1, 1]]).bool()),
            ValueError,
            r"sample\(s\) \[0\] have no non-English caption",
        ),
    ],
)
def test_bad_inputs_name_the_argument(gen, call, error, match):
    a, t, tk = _good(gen)
    with pytest.raises(error, match=match):
        call(a, t, tk)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["audio", "text"])
def test_non_finite_inputs_are_rejected(gen, bad, which):
    a, _t, tk = _good(gen)
    x = a if which == "audio" else tk
    x.view(-1)[4] = bad
    with pytest.raises(ValueError, match=f"{which}: contains 1 NaN/Inf"):
        CF.kcl(a, tk)


def test_zero_vector_is_rejected(gen):
    a, t, _ = _good(gen)
    t[2] = 0
    with pytest.raises(ValueError, match=r"text: embedding at index \(2,\) is all zeros"):
        CF.info_nce(a, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a mismatch")
def test_device_mismatch_is_rejected(gen):
    a, t, _ = _good(gen)
    with pytest.raises(ValueError, match="text: on device cuda"):
        CF.info_nce(a, t.cuda())


def test_device_mismatch_is_rejected_on_meta(gen):
    """CPU-only machines: the meta device stands in for a second device."""
    from contrastive_losses._checks import check_same_device_dtype

    a, t, _ = _good(gen)
    with pytest.raises(ValueError, match="text: on device meta but audio is on cpu"):
        check_same_device_dtype([(a, "audio"), (t.to("meta"), "text")])


# ------------------------------------------------------------------ fast paths


def test_half_precision_norm_overflow_is_handled():
    """float16 rows whose squared norm overflows still normalise (float32 norms)."""
    a = torch.full((3, 8), 300.0, dtype=torch.float16)
    a[1, 0] = -300.0
    t = torch.randn(3, 8, dtype=torch.float16)
    assert torch.isfinite(CF.info_nce(a, t)).all()


@pytest.mark.parametrize("masked", [False, True])
def test_kcl_fused_normalisation_equals_plain_path(gen, masked):
    """The fast path (scores scaled by 1/||t||) against normalise-then-matmul, fwd + bwd."""
    a1, t1 = randn(gen, 6, 5).requires_grad_(), randn(gen, 6, 3, 5).requires_grad_()
    a2, t2 = a1.detach().clone().requires_grad_(), t1.detach().clone().requires_grad_()
    mask = random_mask(gen, 6, 3) if masked else None
    fast = CF.kcl(a1, t1, 0.1, mask=mask)
    plain = CF.kcl(
        torch.nn.functional.normalize(a2, dim=-1),
        torch.nn.functional.normalize(t2, dim=-1),
        0.1,
        mask=mask,
        normalize=False,
    )
    torch.testing.assert_close(fast, plain)
    fast.backward()
    plain.backward()
    torch.testing.assert_close(a1.grad, a2.grad)
    torch.testing.assert_close(t1.grad, t2.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["audio", "text"])
@pytest.mark.parametrize("loss", ["info_nce", "siglip"])
def test_normalize_false_non_finite_inputs_are_named(gen, loss, which, bad, dtype):
    """normalize=False: the logits' bound (one norm per tensor) also refuses NaN/Inf, by
    name and count as check_finite does (it replaced a separate finiteness pass)."""
    a = F.normalize(torch.randn(6, 8, generator=gen), dim=-1).to(dtype)
    t = F.normalize(torch.randn(6, 8, generator=gen), dim=-1).to(dtype)
    (a if which == "audio" else t)[2, 3] = bad
    fn = CF.info_nce if loss == "info_nce" else CF.siglip
    for chunk_size in (None, 2):
        with pytest.raises(ValueError, match=f"^{which}: contains 1 NaN/Inf"):
            fn(a, t, normalize=False, chunk_size=chunk_size)
    (a if which == "audio" else t)[2, 3] = 0.5  # finite again: no error
    assert torch.isfinite(fn(a, t, normalize=False))


def test_normalize_false_mean_fast_path_equals_the_per_sample_path(gen):
    """info_nce's one-process dense mean (two fused cross-entropy means) equals the mean of
    its per-sample losses, value, terms and gradients (float64)."""
    a = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    for kwargs in ({"temperature": 0.3}, {"logit_scale": s}):
        fast, terms = CF.info_nce(a, t, return_terms=True, **kwargs)
        rows = CF.info_nce(a, t, reduction="none", **kwargs)
        _, plain_terms = CF.info_nce(a, t, reduction="none", return_terms=True, **kwargs)
        torch.testing.assert_close(fast, rows.mean(), rtol=1e-13, atol=0)
        torch.testing.assert_close(terms, plain_terms, rtol=1e-13, atol=0)
        leaves = (a, t, s) if "logit_scale" in kwargs else (a, t)
        g_fast = torch.autograd.grad(fast, leaves)
        g_rows = torch.autograd.grad(rows.mean(), leaves)
        torch.testing.assert_close(g_fast, g_rows, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("offset", [0, 2])
def test_siglip_sign_flip_as_product_equals_the_in_place_flip(gen, monkeypatch, offset):
    """Up to _SIGN_PRODUCT_MAX pairs SigLIP's dense path flips the positives by a +-1
    product, above it in place: the same values and gradients, bit for bit (this rank's
    rows against every rank's columns from ``offset``, as under gather)."""
    import contrastive_losses.siglip as S

    a = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    weights = torch.linspace(0.5, 1.5, 21, dtype=torch.float64).reshape(3, 7)

    def value_and_grads():
        pairs = S._dense_pair_losses(a, t, s, b, offset, None, None)
        return pairs.detach(), torch.autograd.grad((pairs * weights).sum(), (a, t, s, b))

    product = value_and_grads()
    monkeypatch.setattr(S, "_SIGN_PRODUCT_MAX", 0)
    in_place = value_and_grads()
    torch.testing.assert_close(product, in_place, rtol=0, atol=0)
    flipped = torch.zeros(3, 7, dtype=torch.bool)
    flipped.diagonal(offset).fill_(True)
    logits = (a * s).detach() @ t.detach().T + b.detach()
    want = F.softplus(torch.where(flipped, -logits, logits))
    torch.testing.assert_close(product[0], want, rtol=1e-14, atol=0)
