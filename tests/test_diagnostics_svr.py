"""force_decomposition and trajectory_drift (SupCLAP §2.1, App. D, Fig. 1) against
autograd and plain loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from contrastive_losses import diagnostics
from contrastive_losses import functional as CF

F64 = torch.float64


def unit(gen, *shape):
    return F.normalize(torch.randn(*shape, generator=gen, dtype=F64), dim=-1)


def _radius_rows(radius, b):
    if radius is None:
        return torch.zeros(b, dtype=F64)
    return torch.as_tensor(radius, dtype=F64).expand(b)


@pytest.mark.parametrize("radius", [None, 0.3, "per_row"])
def test_forces_are_the_negative_gradient(gen, radius):
    """pull + push = -d l_i / d t_i for the InfoNCE row (radius None) and the SVR row."""
    t, a = unit(gen, 6, 5).requires_grad_(), unit(gen, 6, 5)
    r = torch.rand(6, generator=gen, dtype=F64) if radius == "per_row" else radius
    CF.support_vector_term(
        t, a, 0.0 if r is None else r, 0.2, normalize=False, reduction="sum"
    ).backward()
    forces = diagnostics.force_decomposition(t.detach(), a, 0.2, r, normalize=False)
    torch.testing.assert_close(forces.pull + forces.push, -t.grad)
    assert (forces.radius is None) == (radius is None)


@given(st.integers(2, 6), st.integers(2, 6), st.integers(0, 2**31 - 1), st.floats(0.0, 1.2))
def test_decomposition_matches_loops(b, d, seed, radius):
    """Every candidate's force split along u_i = (a_i - t_i)/||a_i - t_i||: the parallel
    part as is, the perpendicular norm times |1 - R/||a_i - t_i|||; the net push is the
    sum over negatives."""
    g = torch.Generator().manual_seed(seed)
    t, a = unit(g, b, d), unit(g, b, d)
    tau = 0.3
    forces = diagnostics.force_decomposition(t, a, tau, radius)
    for i in range(b):
        u = a[i] - t[i]
        dist = float(u.norm())
        u_hat = u / dist
        scores = torch.stack([(t[i] + radius * u_hat) @ a[j] / tau for j in range(b)])
        prob = torch.softmax(scores, dim=0)
        push = torch.zeros(d, dtype=F64)
        for j in range(b):
            if j == i:
                continue
            f = -prob[j] * a[j] / tau  # descent direction: away from the negative
            par = f @ u_hat
            perp = f - par * u_hat
            scaled = par * u_hat + (1 - radius / dist) * perp
            push = push + scaled
            torch.testing.assert_close(forces.negative_parallel[i, j], par)
            torch.testing.assert_close(
                forces.negative_perpendicular[i, j], abs(1 - radius / dist) * perp.norm()
            )
        torch.testing.assert_close(forces.push[i], push)
        torch.testing.assert_close(forces.push_parallel[i], push @ u_hat)
        torch.testing.assert_close(
            forces.push_perpendicular[i], (push - (push @ u_hat) * u_hat).norm()
        )
        torch.testing.assert_close(forces.direction[i], u_hat)
        torch.testing.assert_close(forces.distance[i], torch.tensor(dist, dtype=F64))
        pull = (1 - prob[i]) * a[i] / tau
        pull_par = (pull @ u_hat) * u_hat
        torch.testing.assert_close(
            forces.pull[i], pull_par + (1 - radius / dist) * (pull - pull_par)
        )
        assert forces.negative_parallel[i, i] == 0 and forces.negative_perpendicular[i, i] == 0


def test_radius_equal_to_distance_removes_every_perpendicular_push(gen):
    """R_i = ||a_i - t_i||: J_i projects on u_i, the push keeps only its parallel part."""
    t, a = unit(gen, 5, 4), unit(gen, 5, 4)
    dist = (a - t).norm(dim=-1)
    forces = diagnostics.force_decomposition(t, a, 0.1, dist)
    torch.testing.assert_close(forces.push_perpendicular, torch.zeros(5, dtype=F64))
    torch.testing.assert_close(forces.negative_perpendicular, torch.zeros(5, 5, dtype=F64))
    plain = diagnostics.force_decomposition(t, a, 0.1)
    assert bool((plain.push_perpendicular > 0).all())


def test_masked_rows_and_candidates_exert_no_force(gen):
    t, a = unit(gen, 5, 4), unit(gen, 5, 4)
    mask = torch.tensor([True, True, False, True, True])
    forces = diagnostics.force_decomposition(t, a, 0.2, 0.1, mask=mask)
    keep = torch.tensor([0, 1, 3, 4])
    sub = diagnostics.force_decomposition(t[keep], a[keep], 0.2, 0.1)
    torch.testing.assert_close(forces.push[keep], sub.push)
    torch.testing.assert_close(forces.pull[keep], sub.pull)
    torch.testing.assert_close(forces.negative_parallel[keep][:, keep], sub.negative_parallel)
    assert forces.push[2].abs().max() == 0 and forces.negative_parallel[:, 2].abs().max() == 0


def test_coincident_positive_is_finite(gen):
    t = unit(gen, 4, 3)
    a = t.clone()
    a[1:] = unit(gen, 3, 3)
    forces = diagnostics.force_decomposition(t, a, 0.1, 0.5)
    assert all(torch.isfinite(f).all() for f in forces if isinstance(f, torch.Tensor))
    plain = diagnostics.force_decomposition(t, a, 0.1)
    torch.testing.assert_close(forces.push[0], plain.push[0])  # no direction: no SVR


# ------------------------------------------------------------------ trajectory drift


def test_trajectory_drift_values():
    pull = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 4.0]])
    update = torch.tensor([[5.0, 0.0], [0.0, -0.2], [1.0, -1.0], [0.0, 0.0]])
    out = diagnostics.trajectory_drift(update, pull)
    torch.testing.assert_close(out, torch.tensor([1.0, -1.0, 0.0, 0.0]))


@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_trajectory_drift_is_cosine(b, d, seed):
    g = torch.Generator().manual_seed(seed)
    u, p = torch.randn(b, d, generator=g, dtype=F64), torch.randn(b, d, generator=g, dtype=F64)
    out = diagnostics.trajectory_drift(u, p)
    torch.testing.assert_close(out, F.cosine_similarity(u, p, dim=-1))
    torch.testing.assert_close(diagnostics.trajectory_drift(3.0 * u, 0.5 * p), out)


def test_gradient_step_on_the_embedding_moves_along_pull_plus_push(gen):
    """Used from a loop: a plain gradient step on t moves it along pull + push (cosine 1)
    and its drift from the pull is the angle the push adds."""
    t, a = unit(gen, 6, 5).requires_grad_(), unit(gen, 6, 5)
    forces = diagnostics.force_decomposition(t.detach(), a, 0.2, 0.2, normalize=False)
    CF.support_vector_term(t, a, 0.2, 0.2, normalize=False, reduction="sum").backward()
    update = -0.01 * t.grad
    total = forces.pull + forces.push
    torch.testing.assert_close(
        diagnostics.trajectory_drift(update, total), torch.ones(6, dtype=F64)
    )
    drift = diagnostics.trajectory_drift(update, forces.pull)
    torch.testing.assert_close(drift, F.cosine_similarity(total, forces.pull, dim=-1))
    assert bool((drift < 1).all())


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda u, p: diagnostics.trajectory_drift(u, p[:2]), ValueError, "pull: shape"),
        (lambda u, p: diagnostics.trajectory_drift(u.long(), p), TypeError, "update"),
        (lambda u, p: diagnostics.trajectory_drift(u, p.float()), TypeError, "pull: dtype"),
        (lambda u, p: diagnostics.trajectory_drift(u * float("nan"), p), ValueError, "update"),
        (lambda u, p: diagnostics.trajectory_drift(u, "p"), TypeError, "pull"),
        (lambda u, p: diagnostics.force_decomposition(u, p[:2], 0.1), ValueError, "candidates"),
        (lambda u, p: diagnostics.force_decomposition(u, p, -0.1), ValueError, "temperature"),
        (
            lambda u, p: diagnostics.force_decomposition(u, p, 0.1, torch.ones(2)),
            ValueError,
            "radius",
        ),
        (
            lambda u, p: diagnostics.force_decomposition(u, p, 0.1, mask=torch.ones(3)),
            TypeError,
            "mask",
        ),
    ],
)
def test_bad_inputs_name_the_argument(gen, call, error, match):
    u, p = unit(gen, 3, 4), unit(gen, 3, 4)
    with pytest.raises(error, match=match):
        call(u, p)
