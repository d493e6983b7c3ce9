"""No overflow inside the bound (issue 48 item 4): float16/bfloat16 losses are computed in
float32 and cast to the input dtype once, at the end.

The sums over pairs ran in the input dtype: ``functional.siglip``, ``functional.kcl`` and
open_clip's ``SigLipLoss`` returned ``inf`` for inputs the logit bound accepts, where the
float64 loss fits float16. Here: a property over every loss, both half dtypes, dense and
tiled, against the float64 loss of the same (half) inputs, and the three cases of the
issue rebuilt.

The tolerance of the property, derived: the half inputs are exact in float32 and every
loss computes from them in float32 (normalising included), so the half loss is the
float64 loss ``ref`` rounded once to the half dtype, ``eps/2 * |ref|`` (round to nearest;
``eps`` the dtype's ``finfo.eps``), plus the float32 arithmetic: each logit a dot product
of ``D`` terms, each loss a log-sum-exp or sum over ``N`` columns and ``K`` languages,
each within ``(D + N*K)`` float32 roundings ``eps32`` of the logit bound ``L`` (the
largest ``|logit|`` the bound check allows: scale * largest row norms + ``|bias|``), at
most ``N`` such errors per row for SigLIP's sums (``n_terms`` below). A factor 8 covers
the constants of these bounds (the log-sum-exp's and the normalisation's few roundings).
The regulariser adds its float32 terms to its base's loss, which the base returns
rounded to the half dtype: two roundings there (the base's loss is at most the total).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from open_clip_reference import load_open_clip_loss

from contrastive_losses import InfoNCELoss, SupportVectorRegularizer
from contrastive_losses import functional as CF
from contrastive_losses.ask import ask
from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

HALF = (torch.float16, torch.bfloat16)
K = 2  # languages of KCL's captions
EPS32 = torch.finfo(torch.float32).eps


def _svr_module(a, t, tk, scale, bias, normalize, chunk):
    base = InfoNCELoss(1 / scale, max_logit_scale=1e4, normalize=normalize, chunk_size=chunk)
    return SupportVectorRegularizer(base, radius=0.1)(a, t)


def _ask(a, t, tk, scale, bias, normalize, chunk):
    # knowledge rows of norm at most 1 (a KnowledgeBank stores unit rows): the pairs' own
    fine = torch.stack([a, t], 1)[:, None]
    return ask(a, t, fine, fine.flip(2), temperature=1 / scale, normalize=normalize)


def _open_clip_args(a, t, scale, bias):
    """The model's exp'd scale (and bias) as 0-d tensors in the features' dtype."""
    return a.new_full((), scale), a.new_full((), bias)


# name -> (loss(a, t, tk, scale, bias, normalize, chunk), terms summed per row, normalises)
LOSSES = {
    "info_nce": (lambda a, t, tk, s, b, n, c: CF.info_nce(a, t, 1 / s, normalize=n, chunk_size=c)),
    "siglip": (lambda a, t, tk, s, b, n, c: CF.siglip(a, t, s, b, normalize=n, chunk_size=c)),
    "kcl": (lambda a, t, tk, s, b, n, c: CF.kcl(a, tk, 1 / s, normalize=n, chunk_size=c)),
    "kcl all_languages": (
        lambda a, t, tk, s, b, n, c: CF.kcl(
            a, tk, 1 / s, negatives="all_languages", normalize=n, chunk_size=c
        )
    ),
    "cacl": (
        lambda a, t, tk, s, b, n, c: CF.cacl(
            a, tk[:, 0], tk[:, 1], 1 / s, normalize=n, chunk_size=c
        )
    ),
    "support_vector_term": (
        lambda a, t, tk, s, b, n, c: CF.support_vector_term(
            t, a, 0.1, 1 / s, normalize=n, chunk_size=c
        )
    ),
    "SVR(InfoNCELoss)": _svr_module,
    "ask": _ask,
    "open_clip ClipLoss": (
        lambda a, t, tk, s, b, n, c: ClipLoss(chunk_size=c)(a, t, _open_clip_args(a, t, s, b)[0])
    ),
    "open_clip SigLipLoss": (
        lambda a, t, tk, s, b, n, c: SigLipLoss(chunk_size=c)(a, t, *_open_clip_args(a, t, s, b))
    ),
}
FEATURES_AS_GIVEN = {"open_clip ClipLoss", "open_clip SigLipLoss"}  # normalize=False only
NORMALISED_ONLY = {"ask"}  # its knowledge rows are unit rows; its logits have no bound check


def _inputs(seed, b, d, rho, norm, dtype):
    """Audio ``(b, d)`` of row norms in ``[norm/2, norm]``, text ``rho``-aligned with it
    (``rho < 0``: positives pointing away, the largest losses), captions ``(b, K, d)``,
    all rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    u = F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)
    other = F.normalize(torch.randn(b, K, d, generator=g, dtype=torch.float64), dim=-1)
    lengths = norm * (0.5 + 0.5 * torch.rand(b, 1, generator=g, dtype=torch.float64))
    a = u * lengths
    tk = (rho * u[:, None] + math.sqrt(1 - rho**2) * other) * lengths[:, None]
    return a.to(dtype), tk[:, 0].to(dtype), tk.to(dtype)


def _logit_limit(dtype: torch.dtype, b: int) -> float:
    """The largest logit drawn: the bound check's, a quarter of the dtype's max, for
    float16; for bfloat16, whose range is float32's, also low enough that a float32 sum
    of the at most ``(b K)^2`` terms, each at most twice a logit, stays finite. Nearer
    bfloat16's bound (logits above 1e35) float32 sums overflow where float64's would not:
    outside this property, and outside any training."""
    f32 = torch.finfo(torch.float32).max / (2 * (b * K) ** 2)
    return min(torch.finfo(dtype).max / 4, f32)


def _call(name, a, t, tk, scale, bias, normalize, chunk):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scale habits (a scale below 2 is allowed here)
        return LOSSES[name](a, t, tk, scale, bias, normalize, chunk)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(LOSSES))
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(2, 9),
    d=st.integers(2, 8),
    rho=st.floats(-1.0, 0.9),
    log_scale=st.floats(0.3, 4.0),  # the logit scale 1/temperature, 2 to 1e4
    log_reach=st.floats(-6.0, 0.05),  # normalize=False: the peak logit over the bound
    bias=st.sampled_from([0.0, -10.0]),
    normalize=st.booleans(),
    chunk=st.sampled_from([None, 3]),
)
def test_half_loss_is_the_float64_loss_rounded_where_that_fits(
    name, dtype, seed, b, d, rho, log_scale, log_reach, bias, normalize, chunk
):
    """Wherever the bound check accepts the half inputs and the float64 loss of the same
    inputs is finite in the half dtype, the half loss is finite and within the tolerance
    derived in the module docstring. For the open_clip drop-ins that also makes them
    open_clip's loss to open_clip's own precision where open_clip is finite (the triangle
    inequality), asserted directly."""
    normalize = (normalize or name in NORMALISED_ONLY) and name not in FEATURES_AS_GIVEN
    scale = float(torch.tensor(10.0**log_scale, dtype=dtype))  # exact as a model's scale
    reach = 10.0**log_reach * _logit_limit(dtype, b)
    norm = 1.0 if normalize else math.sqrt(reach / scale)
    a, t, tk = _inputs(seed, b, d, rho, norm, dtype)
    try:
        half = _call(name, a, t, tk, scale, bias, normalize, chunk)
    except ValueError as error:  # the bound check refused: outside the property
        assert "overflows" in str(error), error
        reject()
    ref = float(_call(name, a.double(), t.double(), tk.double(), scale, bias, normalize, chunk))
    fi = torch.finfo(dtype)
    if not abs(ref) < fi.max:
        reject()
    assert half.dtype == dtype
    assert torch.isfinite(half), (float(half), ref)
    peak = 1.0 if normalize else max(float(x.double().norm(dim=-1).max()) for x in (a, tk))
    logit_bound = scale * (peak + 0.1) * peak + abs(bias)  # + 0.1: the SVR's radius
    n = b * K
    n_terms = n if "siglip" in name.lower() else 1
    roundings = 2 if name == "SVR(InfoNCELoss)" else 1  # the base's loss comes rounded
    tol = roundings * fi.eps / 2 * abs(ref) + 8 * n_terms * (d + n) * EPS32 * logit_bound
    assert abs(float(half) - ref) <= tol, (float(half), ref, tol)
    if name in FEATURES_AS_GIVEN:
        oc = load_open_clip_loss()
        theirs_fn = oc.ClipLoss() if name == "open_clip ClipLoss" else oc.SigLipLoss()
        s, bb = _open_clip_args(a, t, scale, bias)
        theirs = theirs_fn(a, t, s) if name == "open_clip ClipLoss" else theirs_fn(a, t, s, bb)
        if torch.isfinite(theirs):
            assert abs(float(half) - float(theirs)) <= abs(float(theirs) - ref) + tol


def _collapsed(b: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``b`` equal rows (collapsed embeddings)."""
    return torch.ones(b, d, dtype=dtype)


@pytest.mark.parametrize("chunk", [None, 32])
def test_float16_siglip_of_collapsed_rows_is_finite(chunk):
    """Every pair scores ``scale + bias = 90``: each row sums ``softplus(-90)`` (its
    positive) and ``B - 1`` times ``softplus(90)``, so the loss is ``(B - 1) * 90`` and a
    little (11430 at ``B = 128``, fits float16), where the sum over the ``B^2`` pairs
    (1.46e6) does not: it was ``inf``."""
    b = 128
    x = _collapsed(b, 16, torch.float16)
    loss = CF.siglip(x, x, 100.0, -10.0, chunk_size=chunk)
    expected = math.log1p(math.exp(-90.0)) + (b - 1) * (90.0 + math.log1p(math.exp(-90.0)))
    assert loss.dtype == torch.float16
    assert torch.isfinite(loss)
    assert abs(float(loss) - expected) <= torch.finfo(torch.float16).eps / 2 * expected


@pytest.mark.parametrize("negatives", ["per_language", "all_languages"])
def test_float16_kcl_of_opposed_pairs_is_finite(negatives):
    """Audio ``e1, -e1`` with each caption the opposite of its clip's, at the smallest
    temperature ``1e-4`` (logits ``+-1e4``, inside the bound, 16376 in float16): every
    direction's positive scores ``-1e4`` against a negative at ``+1e4``, so each term is
    ``2e4 + log1p(exp(-2e4)) = 2e4`` and the loss, their mean, 2e4; their sum over the
    ``2 * B * K = 8`` terms (1.6e5) overflows float16 and was ``inf``."""
    audio = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float16)
    text = (-audio)[:, None].expand(-1, 2, -1).contiguous()  # K = 2 languages
    loss = CF.kcl(audio, text, 1e-4, negatives=negatives, normalize=False)
    ref = CF.kcl(audio.double(), text.double(), 1e-4, negatives=negatives, normalize=False)
    # all_languages: each audio's two captions are both positives and its two negatives
    # both at +1e4, so its a->t term is 2e4 + log 2 (the t->a term stays 2e4)
    expected = 2e4 if negatives == "per_language" else 2e4 + math.log(2) / 2
    assert torch.isfinite(loss)
    assert abs(float(ref) - expected) <= 1e-9 * expected
    assert abs(float(loss) - float(ref)) <= torch.finfo(torch.float16).eps / 2 * abs(float(ref))


def test_open_clip_siglip_drop_in_at_1024_collapsed_features_is_finite_where_open_clip_is_not():
    """The drop-in with L2-normalised float16 features, ``B = 1024``, nearly collapsed
    (every row the same direction plus noise of 0.75 its length: mean cosine about
    0.64), ``logit_scale`` 100, bias -10: the float64 loss is about 55250 (fits float16);
    open_clip's own ``SigLipLoss`` sums its pairs in float16 and returns ``inf``; ours is
    the float64 loss rounded to float16."""
    b, d = 1024, 512
    g = torch.Generator().manual_seed(0)
    u = F.normalize(torch.randn(1, d, generator=g), dim=-1)
    x, y = (
        F.normalize(u + 0.75 * torch.randn(b, d, generator=g) / d**0.5, dim=-1).half()
        for _ in range(2)
    )
    scale, bias = torch.tensor(100.0).half(), torch.tensor(-10.0).half()
    oc = load_open_clip_loss()
    exact = float(oc.SigLipLoss()(x.double(), y.double(), scale.double(), bias.double()))
    assert 4e4 < exact < torch.finfo(torch.float16).max
    assert not torch.isfinite(oc.SigLipLoss()(x, y, scale, bias))  # open_clip overflows
    for chunk in (None, 256):
        ours = SigLipLoss(chunk_size=chunk)(x, y, scale, bias)
        assert ours.dtype == torch.float16 and torch.isfinite(ours)
        assert abs(float(ours) - exact) <= torch.finfo(torch.float16).eps / 2 * exact, chunk
