"""The custom autograd Functions of ``_kernels`` against autograd's own path: values,
gradients, and ``gradcheck`` in float64."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

from contrastive_losses._kernels import (
    _Distance,
    _Gram,
    _NormalizedRowsMatmul,
    _per_language_ce,
    _SymmetricDiagonalCE,
    _SymmetricMeanCE,
    _UpperClamp,
    l2_normalize,
)


def test_fused_normalize_equals_f_normalize_forward_and_backward(gen):
    x1 = randn(gen, 6, 3, 5).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    w = randn(gen, 6, 3, 5)
    y1, y2 = l2_normalize(x1), torch.nn.functional.normalize(x2, dim=-1)
    torch.testing.assert_close(y1, y2)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    assert torch.autograd.gradcheck(l2_normalize, (randn(gen, 4, 3).requires_grad_(),))


def test_symmetric_diagonal_ce_equals_autograd_path(gen):
    """The one-buffer backward of both per-language cross-entropies against autograd's
    logsumexp/diagonal path (the one used under gather), forward and backward."""
    s1 = randn(gen, 3, 5, 5).requires_grad_()
    s2 = s1.detach().clone().requires_grad_()
    w_rows, w_cols = randn(gen, 3, 5), randn(gen, 3, 5)
    rows, cols = _SymmetricDiagonalCE.apply(s1)
    plain_rows = _per_language_ce(s2, None, None, 0)
    plain_cols = _per_language_ce(s2.transpose(1, 2), None, None, 0)
    torch.testing.assert_close(rows, plain_rows)
    torch.testing.assert_close(cols, plain_cols)
    ((rows * w_rows).sum() + (cols * w_cols).sum()).backward()
    ((plain_rows * w_rows).sum() + (plain_cols * w_cols).sum()).backward()
    torch.testing.assert_close(s1.grad, s2.grad)
    leaf = randn(gen, 2, 4, 4).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: _SymmetricDiagonalCE.apply(x), (leaf,))


def _two_cross_entropies(a, t, scale):
    """autograd's path for InfoNCE's two means: two fused cross-entropies of the logits."""
    logits = scale * a @ t.T
    target = torch.arange(a.shape[0])
    return (
        torch.nn.functional.cross_entropy(logits, target),
        torch.nn.functional.cross_entropy(logits.T, target),
    )


@pytest.mark.parametrize("scale", [1.0, 3.5])
def test_symmetric_mean_ce_equals_two_cross_entropies(gen, scale):
    """The dense means' Function (the matmul inside, the float scale on the logits, one
    gradient buffer) against autograd's two cross-entropies: both values, and the
    gradients of a weighting that tells the two means apart; gradcheck in float64."""
    a = randn(gen, 7, 5).requires_grad_()
    t = randn(gen, 7, 5).requires_grad_()
    rows, cols = _SymmetricMeanCE.apply(a, t, scale)
    plain_rows, plain_cols = _two_cross_entropies(a, t, scale)
    torch.testing.assert_close(rows, plain_rows)
    torch.testing.assert_close(cols, plain_cols)
    fused = torch.autograd.grad(0.3 * rows + 1.7 * cols, (a, t))
    plain = torch.autograd.grad(0.3 * plain_rows + 1.7 * plain_cols, (a, t))
    torch.testing.assert_close(fused, plain)
    a64, t64 = a.detach().double().requires_grad_(), t.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: _SymmetricMeanCE.apply(x, y, scale), (a64, t64))


def test_symmetric_mean_ce_keeps_far_logits_exact(gen):
    """Logits hundreds apart (float32): softmax entries and the positives' probabilities
    underflow to 0, yet each log-sum-exp comes from its row's (column's) max, so the
    means and gradients stay those of the cross-entropies, finite."""
    a = torch.nn.functional.normalize(randn(gen, 6, 4), dim=-1).float().requires_grad_()
    t = torch.nn.functional.normalize(randn(gen, 6, 4), dim=-1).float().requires_grad_()
    fused = _SymmetricMeanCE.apply(a, t, 300.0)
    plain = _two_cross_entropies(a, t, 300.0)
    torch.testing.assert_close(fused, plain)
    assert all(v.isfinite() for v in fused) and max(plain) > 100  # past exp's range
    g_fused = torch.autograd.grad(fused[0] + 2 * fused[1], (a, t))
    g_plain = torch.autograd.grad(plain[0] + 2 * plain[1], (a, t))
    torch.testing.assert_close(g_fused, g_plain)


def test_symmetric_mean_ce_skips_an_input_without_grad(gen):
    """Only the input that requires grad gets one (no GEMM for the other)."""
    a, t = randn(gen, 5, 3).requires_grad_(), randn(gen, 5, 3)
    (grad_a,) = torch.autograd.grad(sum(_SymmetricMeanCE.apply(a, t, 2.0)), (a,))
    a2 = a.detach().requires_grad_()
    (plain,) = torch.autograd.grad(sum(_two_cross_entropies(a2, t, 2.0)), (a2,))
    torch.testing.assert_close(grad_a, plain)


def test_normalized_rows_matmul_equals_normalize_then_matmul(gen):
    x = randn(gen, 6, 5).requires_grad_()
    y = randn(gen, 4, 5).requires_grad_()
    inv_norm = 1.0 / torch.linalg.vector_norm(x.detach(), dim=-1)
    torch.testing.assert_close(
        _NormalizedRowsMatmul.apply(x, inv_norm, y),
        torch.nn.functional.normalize(x, dim=-1) @ y.T,
    )

    # inv_norm is a constant of the Function: pass x's own norm, as kcl does.
    def fused(x, y):
        return _NormalizedRowsMatmul.apply(x, 1.0 / torch.linalg.vector_norm(x.detach(), dim=-1), y)

    def plain(x, y):
        return torch.nn.functional.normalize(x, dim=-1) @ y.T

    w = randn(gen, 6, 4)
    g_fused = torch.autograd.grad((fused(x, y) * w).sum(), (x, y))
    g_plain = torch.autograd.grad((plain(x, y) * w).sum(), (x, y))
    torch.testing.assert_close(g_fused, g_plain)


def test_gram_and_distance_gradcheck(gen):
    y = randn(gen, 5, 3).requires_grad_()
    torch.testing.assert_close(_Gram.apply(y), y @ y.T)
    assert torch.autograd.gradcheck(_Gram.apply, (y,))
    x = randn(gen, 5, 3).requires_grad_()
    torch.testing.assert_close(_Distance.apply(x, y), torch.linalg.vector_norm(y - x, dim=-1))
    assert torch.autograd.gradcheck(_Distance.apply, (x, y))


def test_upper_clamp_passes_inward_gradients_at_the_bound():
    x = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    out = _UpperClamp.apply(x, 1.0)
    torch.testing.assert_close(out, x.detach().clamp(max=1.0))
    # Descent moves x by -grad: a positive gradient at or above the bound moves it back in.
    (grad_in,) = torch.autograd.grad(out, x, torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(grad_in, torch.tensor([1.0, 1.0, 1.0]))
    # A negative gradient would push x further out: cut at and above the bound only.
    (grad_out,) = torch.autograd.grad(_UpperClamp.apply(x, 1.0), x, -torch.ones(3))
    torch.testing.assert_close(grad_out, torch.tensor([-1.0, 0.0, 0.0]))
