"""Numerics and checks at the edges (issue 11, items 11-15): zero rows where the mask
marks captions absent, a learnable temperature at its bound, half precision KCL, row
norms whose squares overflow or underflow, and the minor argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F64, randn, random_mask
from torch import nn

from contrastive_losses import (
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
)
from contrastive_losses import functional as CF
from contrastive_losses.bank import KnowledgeBank
from contrastive_losses.diagnostics import force_decomposition, trajectory_drift

# ------------------------------------------------------------------ 11: masked zero rows


def _padded(gen, b=6, k=3, d=5):
    """Audio, text with absent captions set to zero (the usual padding) and its mask."""
    a, t = randn(gen, b, d), randn(gen, b, k, d)
    mask = random_mask(gen, b, k, p=0.5)
    mask[:, 1] = True  # CACL draws among the non-English captions
    assert not bool(mask.all())  # some padding, or the test proves nothing
    return a, t.masked_fill(~mask[..., None], 0.0), t, mask


@pytest.mark.parametrize("negatives", ["per_language", "all_languages"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_kcl_accepts_zero_rows_where_masked(gen, negatives, reduction):
    a, padded, random_rows, mask = _padded(gen)
    grads = []
    for text in (padded, random_rows):  # what absent rows hold must not matter
        ai, ti = a.clone().requires_grad_(), text.clone().requires_grad_()
        loss = CF.kcl(ai, ti, 0.2, mask=mask, negatives=negatives, reduction=reduction)
        loss.sum().backward()
        grads.append((loss.detach(), ai.grad, ti.grad * mask[..., None]))
        assert torch.isfinite(ti.grad).all()
    for x, y in zip(*grads, strict=True):
        torch.testing.assert_close(x, y)


def test_kcl_module_and_cacl_accept_zero_padding(gen):
    a, padded, random_rows, mask = _padded(gen)
    torch.testing.assert_close(KCLLoss(0.2)(a, padded, mask), KCLLoss(0.2)(a, random_rows, mask))
    loss = CACLLoss(0.2)(a, padded, mask=mask, generator=torch.Generator().manual_seed(1))
    ref = CACLLoss(0.2)(a, random_rows, mask=mask, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loss, ref)


def test_kcl_still_rejects_zero_present_rows_and_nan_padding(gen):
    a, padded, _, mask = _padded(gen)
    b, k = torch.nonzero(mask)[1].tolist()
    bad = padded.clone()
    bad[b, k] = 0
    with pytest.raises(ValueError, match=rf"text: embedding at index \({b}, {k}\) is all zeros"):
        CF.kcl(a, bad, 0.2, mask=mask)
    b, k = torch.nonzero(~mask)[0].tolist()
    nan = padded.clone()
    nan[b, k, 0] = float("nan")  # absent, but NaN reaches present rows' gradients (0 * NaN)
    with pytest.raises(
        ValueError, match=rf"text: NaN/Inf in the masked-out \(absent\) row at index \({b}, {k}\)"
    ):
        CF.kcl(a, nan, 0.2, mask=mask)


# ------------------------------------------------------------------ 12: temperature bound


@pytest.mark.parametrize("cls", [InfoNCELoss, KCLLoss, CACLLoss])
def test_learnable_temperature_moves_off_its_bound(gen, cls):
    loss_fn = cls(0.01, learnable_temperature=True)
    a, t = randn(gen, 8, 4).float(), randn(gen, 8, 3, 4).float()
    args = (a, t[:, 0]) if cls is InfoNCELoss else (a, t)
    kwargs = {"generator": torch.Generator().manual_seed(0)} if cls is CACLLoss else {}
    opt = torch.optim.SGD(loss_fn.parameters(), lr=1e-3)
    for _ in range(3):  # unaligned pairs: the loss falls as the temperature rises
        opt.zero_grad()
        loss_fn(*args, **kwargs).backward()
        assert float(loss_fn.log_logit_scale.grad) > 0
        opt.step()
    assert float(loss_fn.temperature.detach()) > 0.0101


def test_learnable_temperature_never_passes_its_bound(gen):
    loss_fn = InfoNCELoss(0.01, learnable_temperature=True)
    # Every pair at cosine 1, every other at 0.99: a colder softmax still lowers the
    # loss, so the gradient points past the bound and is cut there.
    a = torch.eye(8) * 0.1 + 1.0
    opt = torch.optim.SGD(loss_fn.parameters(), lr=1.0)
    start = float(loss_fn.log_logit_scale.detach())
    for _ in range(3):
        opt.zero_grad()
        loss_fn(a, a).backward()
        assert float(loss_fn.log_logit_scale.grad) == 0
        opt.step()
    assert float(loss_fn.log_logit_scale.detach()) == start
    torch.testing.assert_close(loss_fn.temperature, torch.tensor(0.01))


def test_fixed_temperature_below_the_clamp_raises():
    with pytest.raises(ValueError, match=r"temperature: 0.005 is below 1/max_logit_scale"):
        InfoNCELoss(0.005)
    InfoNCELoss(0.005, max_logit_scale=200.0)  # allowed once the bound moves
    with pytest.raises(ValueError, match="max_logit_scale: 100000 exceeds"):
        KCLLoss(0.5, max_logit_scale=1e5)


# ------------------------------------------------------------------ 13: half precision KCL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("negatives", ["per_language", "all_languages"])
@pytest.mark.parametrize("text_scale", [1e-3, 1.0, 3e3])
def test_kcl_half_precision_gradients_are_finite_and_close(gen, dtype, negatives, text_scale):
    a, t = randn(gen, 6, 16).float(), randn(gen, 6, 3, 16).float() * text_scale
    mask = random_mask(gen, 6, 3)
    out = []
    for dt in (torch.float32, dtype):
        ai = a.to(dt).clone().requires_grad_()
        ti = t.to(dt).clone().requires_grad_()
        loss = CF.kcl(ai, ti, 0.1, mask=mask, negatives=negatives)
        loss.backward()
        assert loss.dtype == dt and ai.grad.dtype == dt and ti.grad.dtype == dt
        out.append((loss.float(), ai.grad.float(), ti.grad.float() * text_scale))
    tol = 2e-2 if dtype == torch.float16 else 8e-2  # bfloat16 keeps 8 bits of mantissa
    for ref, half in zip(*out, strict=True):
        assert torch.isfinite(half).all()
        scale = ref.abs().max()
        torch.testing.assert_close(half / scale, ref / scale, rtol=0, atol=tol)


# ------------------------------------------------------------------ 14: norms at the edges


def _entry_points():
    """name -> (fn(audio, text (B, K, D)) -> loss, which inputs get rescaled)."""
    return {
        "info_nce": lambda a, t: CF.info_nce(a, t[:, 0], 0.2),
        "siglip": lambda a, t: CF.siglip(a, t[:, 0], 3.0, -1.0),
        "kcl": lambda a, t: CF.kcl(a, t, 0.2),
        "kcl_all": lambda a, t: CF.kcl(a, t, 0.2, negatives="all_languages"),
        "cacl": lambda a, t: CF.cacl(a, t[:, 0], t[:, 1], 0.2),
        "InfoNCELoss": lambda a, t: InfoNCELoss(0.2)(a, t[:, 0]),
        "SigLIPLoss": lambda a, t: SigLIPLoss()(a, t[:, 0]),
        "KCLLoss": lambda a, t: KCLLoss(0.2)(a, t),
        "CACLLoss": lambda a, t: CACLLoss(0.2)(a, t, torch.full((a.shape[0],), 2)),
        "l2_normalize": lambda a, t: (CF.l2_normalize(a) * CF.l2_normalize(t[:, 0])).sum(),
        "force_decomposition": lambda a, t: force_decomposition(t[:, 0], a, 0.2).pull.sum(),
    }


@pytest.mark.parametrize("name", list(_entry_points()))
@pytest.mark.parametrize("scale", [1e20, 1e-25, 3e35, 1e-37])
@pytest.mark.parametrize("which", ["audio", "text"])
def test_normalising_is_scale_invariant_at_float32_extremes(gen, name, scale, which):
    """Entries above 1e19 or below 1e-22 overflow/underflow a float32 sum of squares."""
    fn = _entry_points()[name]
    a, t = randn(gen, 5, 8).float(), randn(gen, 5, 3, 8).float()
    expected = fn(a, t)
    a_s = (a * scale if which == "audio" else a).requires_grad_()
    t_s = (t * scale if which == "text" else t).requires_grad_()
    got = fn(a_s, t_s)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if got.requires_grad:
        got.backward()
        for g in (a_s.grad, t_s.grad):
            assert g is None or torch.isfinite(g).all()


@pytest.mark.parametrize("name", list(_entry_points()))
@pytest.mark.parametrize("which", ["audio", "text"])
def test_unnormalisable_norms_raise_naming_the_argument(gen, name, which):
    fn = _entry_points()[name]
    a, t = randn(gen, 5, 8).float(), randn(gen, 5, 3, 8).float()
    a_s = a * 1e-44 if which == "audio" else a  # subnormal: 1/norm overflows float32
    t_s = t * 1e-44 if which == "text" else t
    arg = {
        "audio": {"force_decomposition": "candidates", "l2_normalize": "x"},
        "text": {"force_decomposition": "anchor", "l2_normalize": "x", "cacl": "english"},
    }[which].get(name, which)
    if which == "text" and name in ("CACLLoss",):
        arg = r"text\[:, 0\]"  # the (B, K, D) form names text and the English column
    with pytest.raises(ValueError, match=rf"{arg}: embedding at index .* has L2 norm .*outside"):
        fn(a_s, t_s)


def test_float16_norms_at_the_edges(gen):
    a, t = randn(gen, 5, 8).float(), randn(gen, 5, 3, 8).float()
    expected = CF.info_nce(a, t[:, 0], 0.2)
    for scale in (1e-3, 2e3):  # squares under- or overflow float16, the norms do not
        got = CF.info_nce((a * scale).half(), t[:, 0].half(), 0.2)
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match=r"audio: embedding at index .* outside"):
        CF.info_nce((a * 1e-7).half(), t[:, 0].half(), 0.2)


def test_bank_normalises_extreme_norms(gen):
    x = randn(gen, 6, 4).float()
    kb = KnowledgeBank(dim=4, backend="torch", num_prototypes=0)
    expected = kb.build(x, x, torch.arange(6)).audio.clone()
    for scale in (1e20, 1e-25, 1e-15):  # F.normalize's eps=1e-12 would leave 1e-15 as is
        torch.testing.assert_close(kb.build(x * scale, x, torch.arange(6)).audio, expected)
    with pytest.raises(ValueError, match="audio_emb: embedding at index"):
        kb.build(x * 1e-44, x, torch.arange(6))


# ------------------------------------------------------------------ 15: minor checks


def test_kcl_with_no_language_raises(gen):
    a, t = randn(gen, 4, 5), randn(gen, 4, 0, 5)
    with pytest.raises(ValueError, match="text: K = 0 languages"):
        CF.kcl(a, t)
    with pytest.raises(ValueError, match="text: K = 0 languages"):
        KCLLoss()(a, t)


@pytest.mark.parametrize("temperature", [1e-40, 1e-5, torch.tensor(1e-40)])
def test_tiny_temperature_raises(gen, temperature):
    a, t = randn(gen, 4, 5), randn(gen, 4, 2, 5)
    for fn in (
        lambda: CF.info_nce(a, t[:, 0], temperature),
        lambda: CF.kcl(a, t, temperature),
        lambda: CF.cacl(a, t[:, 0], t[:, 1], temperature),
    ):
        with pytest.raises(ValueError, match=r"temperature: .* below the smallest supported"):
            fn()
    CF.info_nce(a, t[:, 0], 1e-4)  # the bound itself is fine and finite
    assert torch.isfinite(CF.info_nce(a.float(), t[:, 0].float(), 1e-4))


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), torch.tensor(float("nan"))])
def test_siglip_rejects_non_finite_bias(gen, bias):
    a, t = randn(gen, 4, 5), randn(gen, 4, 5)
    with pytest.raises(ValueError, match="bias: must be finite"):
        CF.siglip(a, t, 10.0, bias)
    with pytest.raises(TypeError, match="bias: expected a float"):
        CF.siglip(a, t, 10.0, "0")


def test_cacl_english_index_is_checked(gen):
    a, t = randn(gen, 4, 5), randn(gen, 4, 3, 5)
    with pytest.raises(ValueError, match="english_index: must be >= 0, got -1"):
        CACLLoss(english_index=-1)
    with pytest.raises(TypeError, match="english_index: expected an int"):
        CACLLoss(english_index=1.0)
    with pytest.raises(ValueError, match="english_index: 3 is outside the K = 3 languages"):
        CACLLoss(english_index=3)(a, t)
    assert torch.isfinite(CACLLoss(english_index=2)(a, t, torch.tensor([0, 1, 0, 1])))


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan")])
def test_trajectory_drift_rejects_non_positive_eps(eps):
    with pytest.raises(ValueError, match="eps: must be a finite number > 0"):
        trajectory_drift(torch.ones(2, 3), torch.ones(2, 3), eps=eps)


def _bank(gen, n=6, d=4):
    kb = KnowledgeBank(dim=d, backend="torch", num_prototypes=2)
    return kb.build(randn(gen, n, d).float(), randn(gen, n, d).float(), torch.arange(n))


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("ids", torch.arange(4), r"state\['audio'\]: expected shape \(4, 4\)"),
        ("audio", torch.zeros(6, 3), r"state\['audio'\]: expected shape \(6, 4\)"),
        ("text", torch.zeros(5, 4), r"state\['text'\]: expected shape \(6, 4\)"),
        ("ids", torch.zeros(6, 1, dtype=torch.long), r"state\['ids'\]: expected an integer"),
        ("ids", torch.zeros(6), r"state\['ids'\]: expected an integer"),
        ("prototype_text", torch.zeros(3, 4), r"state\['prototype_text'\]: expected shape"),
        ("audio", torch.full((6, 4), float("nan")), r"state\['audio'\]: contains 24 NaN"),
    ],
)
def test_bank_load_state_dict_checks_shapes(gen, key, value, match):
    kb = _bank(gen)
    state = dict(kb.state_dict(), **{key: value})
    fresh = KnowledgeBank(dim=4, backend="torch")
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    assert fresh.is_empty  # nothing half-loaded
    assert len(fresh.load_state_dict(kb.state_dict())) == 6


@pytest.mark.parametrize("search", ["search", "search_prototypes"])
def test_bank_search_rejects_non_finite_queries(gen, search):
    kb = _bank(gen)
    q = torch.zeros(2, 4)
    q[1, 2] = float("nan")
    with pytest.raises(ValueError, match="queries: contains 1 NaN/Inf"):
        getattr(kb, search)(q, 1)


def test_bank_refresh_accepts_a_list_of_modules(gen):
    enc_a, enc_t = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), nn.Linear(4, 4)
    enc_t.eval()  # mixed modes come back as they were
    seen = []

    def encode(batch):
        seen.append((enc_a.training, enc_t.training))
        return enc_a(batch), enc_t(batch), torch.arange(batch.shape[0])

    x = randn(gen, 6, 4).float()
    kb = KnowledgeBank(dim=4, backend="torch", num_prototypes=0)
    for model in ([enc_a, enc_t], (enc_a, enc_t)):
        kb.refresh(encode, [x], model=model, progress=False)
        assert seen[-1] == (False, False)
        assert enc_a.training and enc_a[1].training and not enc_t.training
    with pytest.raises(TypeError, match=r"model\[1\]: expected an nn.Module, got str"):
        kb.refresh(encode, [x], model=[enc_a, "enc_t"], progress=False)


def test_l2_normalize_validates_without_norms():
    with pytest.raises(ValueError, match="x: embedding at index \\(1,\\) is all zeros"):
        CF.l2_normalize(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(
        CF.l2_normalize(torch.tensor([[3e30, 4e30]], dtype=F64)),
        torch.tensor([[0.6, 0.8]], dtype=F64),
    )
    assert math.isfinite(float(CF.l2_normalize(torch.tensor([[1e-30, 0.0]])).sum()))


# ------------------------------------------------------------------ found by the sweep


def test_trajectory_drift_is_scale_invariant_at_the_extremes(gen):
    u, p = randn(gen, 4, 6).float(), randn(gen, 4, 6).float()
    expected = trajectory_drift(u, p)
    for su, sp in ((1e30, 1e30), (1e20, 1e-20), (3e38 / 6, 1.0), (1e-20, 1e15)):
        torch.testing.assert_close(trajectory_drift(u * su, p * sp), expected)
    # Below the floor eps on |u||p| the cosine is scaled down, as documented.
    assert trajectory_drift(u * 1e-30, p * 1e-25).abs().max() < 1e-20
    zero = trajectory_drift(torch.zeros(2, 6), torch.ones(2, 6))
    assert torch.equal(zero, torch.zeros(2))


def test_sinkhorn_rejects_an_epsilon_that_overflows_the_scores(gen):
    s = randn(gen, 4, 4).float()
    with pytest.raises(ValueError, match=r"epsilon: 1e-40 is too small .* overflows"):
        CF.sinkhorn(s, 1e-40)


def test_siglip_scale_and_bias_bounds(gen):
    a, t = randn(gen, 4, 5), randn(gen, 4, 5)
    with pytest.raises(ValueError, match="scale: 1e\\+40 exceeds 10000"):
        CF.siglip(a, t, 1e40, 0.0)
    with pytest.raises(ValueError, match=r"bias: \|1e\+40\| exceeds 10000"):
        CF.siglip(a, t, 10.0, 1e40)
    with pytest.raises(ValueError, match="scale_init: 1e-300 is outside"):
        SigLIPLoss(scale_init=1e-300)
    with pytest.raises(ValueError, match="bias_init: must be finite"):
        SigLIPLoss(bias_init=float("nan"))


def test_meta_tensors_raise_naming_the_argument(gen):
    a = randn(gen, 4, 5)
    with pytest.raises(ValueError, match="audio: on device meta"):
        CF.info_nce(a.to("meta"), a.to("meta"))  # both meta: no device mismatch to report
    with pytest.raises(ValueError, match="queries: on device meta, which holds no values"):
        _bank(gen).search(torch.zeros(2, 4, device="meta"), 1)


def test_bank_search_rejects_queries_whose_scores_overflow(gen):
    q = torch.full((1, 4), 3e38)
    with pytest.raises(ValueError, match="queries: a row norm exceeds float32's max"):
        _bank(gen).search(q, 1)


def _cacl_text_form(audio, text, mask=None, other=None, normalize=True):
    loss = CACLLoss(0.1, normalize=normalize)
    return loss(audio, text, other, mask=mask, generator=torch.Generator().manual_seed(0))


_T = torch.randn(6, 3, 8, generator=torch.Generator().manual_seed(1))


def _set(x, idx, value):
    x = x.clone()
    x[idx] = value
    return x


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        (None, TypeError, r"^text: expected a torch.Tensor"),
        (_T.tolist(), TypeError, r"^text: expected a torch.Tensor"),
        (_T.reshape(-1), ValueError, r"^text: expected shape \(B, K, D\)"),
        (_T[:, None], ValueError, r"^text: expected shape \(B, K, D\)"),
        (_T[:1], ValueError, r"^text: batch size B 1 does not match audio's 6"),
        (_T[:5], ValueError, r"^text: batch size B 5 does not match audio's 6"),
        (_T[:, :, :0], ValueError, r"^text: embedding dimension D is 0"),
        (_T[:, :, :7], ValueError, r"^text: embedding dim D 7 does not match audio's 8"),
        (_T[:, :0], ValueError, r"^text: K = 0 languages"),
        (_T[:, :2], ValueError, r"^text, mask: .*\(6, 2, 8\).*\(6, 3\)"),
        (_T.long(), TypeError, r"^text: expected a floating-point tensor"),
        (_T.double(), TypeError, r"^text: dtype torch.float64 differs from audio's torch.float32"),
        (_T.half(), TypeError, r"^text: dtype torch.float16 differs from audio's torch.float32"),
        (_T.to("meta"), ValueError, r"^text: on device meta but audio is on cpu"),
        (_set(_T, (0, 0, 0), float("nan")), ValueError, r"^text\[:, 0\]: contains 1 NaN/Inf"),
        (
            _set(_T, (0, 0), 0.0),
            ValueError,
            r"^text\[:, 0\]: embedding at index \(0,\) is all zeros",
        ),
        (
            torch.zeros_like(_T),
            ValueError,
            r"^text\[:, 0\]: embedding at index \(0,\) is all zeros",
        ),
        (_T * 1e-44, ValueError, r"^text\[:, 0\]: embedding at index \(0,\) has L2 norm"),
        (
            _set(_T, (0, 1), 0.0),
            ValueError,
            r"^text\[i, other\[i\]\]: embedding at index \(0,\) is all zeros",
        ),
    ],
    ids=[
        "none",
        "list",
        "1-d",
        "extra dim",
        "batch 1",
        "batch mismatch",
        "D 0",
        "D mismatch",
        "K 0",
        "K mismatch mask",
        "int64",
        "float64",
        "float16",
        "meta",
        "nan",
        "zero row",
        "all zeros",
        "subnormal",
        "zero other row",
    ],
)
def test_cacl_text_form_errors_name_text(text, error, match):
    """CACLLoss(audio, text (B, K, D), mask=...): an error about ``text`` names ``text``
    (it named ``english``, ``english_or_text`` or ``mask``)."""
    audio = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(6, 3, dtype=torch.bool)
    other = torch.ones(6, dtype=torch.long)  # column 1: the "other" language of every row
    with pytest.raises(error, match=match):
        _cacl_text_form(audio, text, mask, other)


def test_cacl_text_form_ignores_unused_captions_and_zero_rows_without_normalize():
    """Only the English and the drawn captions are checked: NaN in a caption that is not
    used is no error (as before), and zero rows are fine when nothing is normalised."""
    audio = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    other = torch.ones(6, dtype=torch.long)
    text = _set(_T, (0, 2, 0), float("nan"))
    assert torch.isfinite(_cacl_text_form(audio, text, other=other))
    assert torch.isfinite(
        _cacl_text_form(audio, _set(_T, (0, 1), 0.0), other=other, normalize=False)
    )
