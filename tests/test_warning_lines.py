"""The library's other warnings point at the user's line, once per line (issue 34).

The scale and training-check warnings are tested where they are documented
(``test_scale_warnings.py``, ``test_param_watch.py``, ``test_svr.py``); these are the
rest: a warning raised several calls deep (a Module's ``forward``, ``KnowledgeBank.build``
through its k-means) must still name the line of this file that called the library.
"""

from __future__ import annotations

import builtins
import sys
import warnings

import pytest
import torch

from contrastive_losses import ASKLoss, KnowledgeBank
from contrastive_losses.bank import _faiss_available
from contrastive_losses.integrations.open_clip import ClipLoss


def _record(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return [w for w in record if issubclass(w.category, UserWarning)]


def _at_line(record, text: str, line: int) -> None:
    """Exactly one warning with ``text``, at ``line`` of this file."""
    hits = [w for w in record if text in str(w.message)]
    assert len(hits) == 1, [str(w.message) for w in record]
    assert (hits[0].filename, hits[0].lineno) == (__file__, line)


def _bank(n: int = 30, protos: int = 4, backend: str = "torch") -> KnowledgeBank:
    g = torch.Generator().manual_seed(0)
    a, t = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
    return KnowledgeBank(8, backend=backend, num_prototypes=protos).build(a, t, torch.arange(n))


def test_k_coarse_above_the_prototypes_warns_once_at_the_forward_call():
    loss_fn = ASKLoss(_bank(protos=4), k=3)  # k_coarse 10 > 4 prototypes
    a, t, ids = torch.randn(4, 8), torch.randn(4, 8), torch.arange(100, 104)

    def calls():
        for _ in range(3):
            loss_fn(a, t, ids)  # the line named, once

    _at_line(_record(calls), "k_coarse: 10 exceeds", calls.__code__.co_firstlineno + 2)


def test_too_many_prototypes_warns_at_the_build_call():
    g = torch.Generator().manual_seed(0)
    a, t = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    bank = KnowledgeBank(4, backend="torch", num_prototypes=50)
    call = lambda: bank.build(a, t, torch.arange(5))  # noqa: E731
    _at_line(_record(call), "num_prototypes=50 exceeds", call.__code__.co_firstlineno)


@pytest.mark.skipif(not _faiss_available(), reason="faiss not installed: its k-means warns")
def test_faiss_k_means_with_few_points_warns_at_the_build_call():
    call = lambda: _bank(n=30, protos=8, backend="faiss")  # noqa: E731
    record = _record(call)
    hits = [w for w in record if "faiss advises" in str(w.message)]
    assert len(hits) == 1 and hits[0].filename == __file__  # inside _bank, the build line
    assert hits[0].lineno == _bank.__code__.co_firstlineno + 3


def test_missing_tqdm_warns_at_the_refresh_call(monkeypatch):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    monkeypatch.delitem(sys.modules, "tqdm.auto", raising=False)
    bank = _bank()
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(30, 8, generator=g), torch.randn(30, 8, generator=g), torch.arange(30))]
    call = lambda: bank.refresh(lambda batch: batch, loader, progress=True)  # noqa: E731
    _at_line(_record(call), "tqdm is not installed", call.__code__.co_firstlineno)


def test_clip_loss_without_gather_with_grad_warns_at_the_constructor_call():
    call = lambda: ClipLoss(local_loss=True, world_size=2)  # noqa: E731
    _at_line(_record(call), "gather_with_grad=False", call.__code__.co_firstlineno)
