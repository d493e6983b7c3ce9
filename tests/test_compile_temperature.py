"""A Python-float temperature that changes between calls reuses the compiled graph
(issue 29 item 6).

An annealed temperature (or SigLIP scale and bias) is a new float every step. dynamo
bakes the first value into the first graph; at the second it makes the float symbolic
(automatic dynamic) and that graph serves every later value, as long as nothing in the
loss turns the float back into a constant: ``torch.as_tensor(scale)`` did (SigLIP's
terms and its tiled path), one graph per value. Each functional form, dense and tiled,
runs ``len(VALUES)`` temperatures through ``torch.compile(fullgraph=True)`` with a backend
that counts graphs: at most 2, and every value equals the eager one, with its gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from helpers import CountingBackend

from contrastive_losses import functional as CF

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch._prims_common.check` is deprecated:FutureWarning"
)

B, K, D = 8, 3, 4
VALUES = (0.07, 0.06, 0.05, 0.04, 0.03)

CASES: dict[str, Callable[..., torch.Tensor]] = {
    "info_nce": lambda a, t, tau, c: CF.info_nce(a, t[:, 0], tau, chunk_size=c),
    "kcl": lambda a, t, tau, c: CF.kcl(a, t, temperature=tau, chunk_size=c),
    "cacl": lambda a, t, tau, c: CF.cacl(a, t[:, 0], t[:, 1], temperature=tau, chunk_size=c),
    "siglip": lambda a, t, tau, c: CF.siglip(a, t[:, 0], 1 / tau, -1 / tau, chunk_size=c),
    "support_vector_term": lambda a, t, tau, c: CF.support_vector_term(
        a, t[:, 0], 0.1, tau, chunk_size=c
    ),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Both paths of InfoNCE and SigLIP (SigLIP's tiled path made a tensor of its own); one
# each of the others, for CI time (a compile per value costs seconds).
RUNS = [
    ("info_nce", None),
    ("info_nce", 3),
    ("siglip", None),
    ("siglip", 3),
    ("kcl", 3),
    ("cacl", None),
    ("support_vector_term", 3),
]


@pytest.mark.parametrize(
    ("name", "chunk_size"), RUNS, ids=[f"{n}-{'dense' if c is None else 'tiled'}" for n, c in RUNS]
)
def test_a_changing_float_temperature_compiles_at_most_twice(name, chunk_size):
    loss = CASES[name]
    g = torch.Generator().manual_seed(0)
    audio, text = torch.randn(B, D, generator=g), torch.randn(B, K, D, generator=g)
    counter = CountingBackend()
    compiled = torch.compile(loss, fullgraph=True, backend=counter)
    for tau in VALUES:
        a = audio.clone().requires_grad_()
        out = compiled(a, text, tau, chunk_size)
        (grad,) = torch.autograd.grad(out, a)
        a_ref = audio.clone().requires_grad_()
        ref = loss(a_ref, text, tau, chunk_size)
        (ref_grad,) = torch.autograd.grad(ref, a_ref)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert counter.calls <= 2, f"{counter.calls} graphs for {len(VALUES)} temperatures"
