"""The knowledge bank's refresh: re-encode a dataset with the current model, in eval mode and
without gradient, one batch at a time onto the bank's device.

Private: :meth:`~contrastive_losses.bank.KnowledgeBank.refresh` calls :func:`encode_pairs`
and builds the bank from what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._bank_storage import _unit_rows
from ._warnings import warn_at_caller


def eval_modules(encode_fn: Any, model: nn.Module | Sequence[nn.Module] | None) -> list[nn.Module]:
    """The modules switched to eval during a refresh: ``model`` (one or a list), else
    ``encode_fn`` itself when it is a module."""
    if model is None:
        return [encode_fn] if isinstance(encode_fn, nn.Module) else []
    many = isinstance(model, (list, tuple))
    modules: list[nn.Module] = []
    for pos, mod in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        if not isinstance(mod, nn.Module):
            where = f"model[{pos}]" if many else "model"
            raise TypeError(f"{where}: expected an nn.Module, got {type(mod).__name__}")
        modules.append(mod)
    return modules


def _with_progress(loader: Iterable[Any], progress: bool) -> Iterable[Any]:
    if not progress:
        return loader
    try:
        from tqdm.auto import tqdm
    except ImportError:
        warn_at_caller("tqdm", "tqdm is not installed: refresh() runs without a progress bar")
        return loader
    return tqdm(loader, desc="refresh knowledge bank", unit="batch")


def _checked(encoded: Any) -> tuple[Any, Any, Any]:
    if not isinstance(encoded, (tuple, list)) or len(encoded) != 3:
        got = (
            f"{len(encoded)} values"
            if isinstance(encoded, (tuple, list))
            else f"a {type(encoded).__name__}"
        )
        raise ValueError(
            "encode_fn: must return 3 values (audio_emb (b, D), text_emb (b, D),"
            f" ids (b,)), got {got}"
        )
    a, t, i = encoded
    return a, t, i


def encode_pairs(
    encode_fn: Callable[[Any], tuple[Tensor, Tensor, Tensor]],
    loader: Iterable[Any],
    modules: list[nn.Module],
    target: torch.device,
    dtype: torch.dtype,
    progress: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``encode_fn`` over every batch of ``loader`` with ``modules`` in eval mode (their
    train/eval flags restored afterwards, also on error): unit audio and text rows in
    ``dtype`` on ``target``, and the ids."""
    modes = [(sub, sub.training) for mod in modules for sub in mod.modules()]
    batches = _with_progress(loader, progress)
    audio_chunks: list[Tensor] = []
    text_chunks: list[Tensor] = []
    id_chunks: list[Tensor] = []
    try:
        for mod in modules:
            mod.eval()
        with torch.no_grad():
            for batch in batches:
                a, t, i = _checked(encode_fn(batch))
                audio_chunks.append(_unit_rows(a, "encode_fn audio").to(target, dtype))
                text_chunks.append(_unit_rows(t, "encode_fn text").to(target, dtype))
                id_chunks.append(torch.as_tensor(i).to(target))
    finally:
        for m, was_training in modes:
            m.train(was_training)
    if not audio_chunks:
        raise ValueError("loader: yielded no batch; cannot refresh the bank from nothing")
    return torch.cat(audio_chunks), torch.cat(text_chunks), torch.cat(id_chunks)
