"""What a training step optimises: the loss object of ``--loss``/``--svr``, the captions a step
encodes and how their embeddings are arranged for the loss, and model + loss as one module."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from .data import pick
from .model import ClapModel


def build_loss(args: argparse.Namespace) -> nn.Module:
    """Map ``--loss``/``--svr`` to ``contrastive_losses`` objects (DESIGN.md section 2).

    ``mlclap`` is the ML-CLAP baseline: InfoNCE on one randomly drawn language per clip (the
    drawing happens in :func:`select_texts`). ``infonce_all`` is InfoNCE over all present
    ``(clip, caption)`` pairs of the batch (``B x K`` rows, a clip's audio repeated per
    caption), KCL's compute-matched control (the studies' ``pairs_all``): its audio->text term
    is ``KCLLoss(negatives="all_languages")``'s and its text->audio term KCL's plus
    ``log K`` (the K copies of a clip's audio tie), so it is computed as that loss. ``ask``
    builds an empty :class:`KnowledgeBank` that the trainer fills from the training set
    before the first epoch.
    """
    import contrastive_losses as cl

    if args.loss == "ask":
        if args.svr != "none":
            raise ValueError("--svr: SVR wraps infonce/siglip/mlclap/kcl/cacl, not ask")
        bank = cl.KnowledgeBank(
            args.embed_dim,
            backend=args.ask_backend,
            num_prototypes=args.ask_prototypes,
            refresh_every=args.ask_refresh_every,
        )
        return cl.ASKLoss(
            bank,
            k=args.ask_k,
            k_coarse=args.ask_k_coarse,
            injection_ratio=args.ask_injection_ratio,
            temperature=args.temperature,
        )
    base: nn.Module
    chunk = args.loss_chunk_size
    if args.loss in ("infonce", "mlclap"):
        base = cl.InfoNCELoss(
            temperature=args.temperature,
            learnable_temperature=args.learnable_temperature,
            chunk_size=chunk,
        )
    elif args.loss == "siglip":
        base = cl.SigLIPLoss(chunk_size=chunk)
    elif args.loss in ("kcl", "infonce_all"):
        negatives = "all_languages" if args.loss == "infonce_all" else args.kcl_negatives
        base = cl.KCLLoss(temperature=args.temperature, negatives=negatives, chunk_size=chunk)
    elif args.loss == "cacl":
        base = cl.CACLLoss(temperature=args.temperature, chunk_size=chunk)
    else:
        raise ValueError(f"--loss: unknown {args.loss!r}")
    if args.svr == "none":
        return base
    kwargs: dict[str, Any] = {
        "base": base,
        "radius": args.svr,
        "direction": args.svr_direction,
        "alpha": args.svr_alpha,
    }
    if args.svr_beta is not None:
        kwargs["beta"] = args.svr_beta
    if args.svr_radius_init is not None:
        kwargs["radius_init"] = args.svr_radius_init
    return cl.SupportVectorRegularizer(**kwargs)


def text_mode(args: argparse.Namespace) -> str:
    """Which captions a step encodes: ``all`` (KCL, all-pairs InfoNCE), ``cacl``, ``random``
    or ``fixed``."""
    if args.loss in ("kcl", "infonce_all"):
        return "all"
    if args.loss == "cacl":
        return "cacl"
    if args.loss == "mlclap" or args.pair_language == "random":
        return "random"
    return "fixed"


Arranged = tuple[tuple[Tensor, ...], dict[str, Tensor]]


def select_texts(
    batch: dict[str, Any],
    mode: str,
    languages: Sequence[str],
    generator: torch.Generator,
    fixed_column: int = 0,
    with_ids: bool = False,
) -> tuple[list[str], list[str], Callable[[Tensor, Tensor], Arranged]]:
    """Choose the captions to encode and return how to arrange the embeddings for the loss.

    Returns ``(texts, their languages, arrange)`` where ``arrange(audio (B, E), text (M, E))``
    gives the positional and keyword arguments of the loss's ``forward``. ``with_ids`` (ASK)
    appends the clips' dataset indices, so a sample never retrieves itself from the bank.
    """
    captions = batch["captions"]
    mask: Tensor = batch["mask"]
    b, k = mask.shape
    if mode == "all":
        rows, cols = mask.nonzero(as_tuple=True)  # row-major: the order masked_scatter fills
        texts = [captions[r][c] for r, c in zip(rows.tolist(), cols.tolist(), strict=True)]
        langs = [languages[c] for c in cols.tolist()]

        def arrange_all(audio: Tensor, text: Tensor) -> Arranged:
            # Missing captions get a constant filler: finite and non-zero, and masked out.
            full = text.new_ones(b, k, text.shape[-1])
            full = full.masked_scatter(mask.to(text.device).unsqueeze(-1), text)
            return (audio, full), {"mask": mask.to(text.device)}

        return texts, langs, arrange_all
    if mode == "cacl":
        import contrastive_losses as cl

        other = cl.sample_languages(mask, generator=generator)  # (B,) index among languages
        english = pick(captions, torch.zeros(b, dtype=torch.long))
        others = pick(captions, other)
        texts = english + others
        langs = [languages[0]] * b + [languages[i] for i in other.tolist()]

        def arrange_cacl(audio: Tensor, text: Tensor) -> Arranged:
            return (audio, text[:b], text[b:]), {}

        return texts, langs, arrange_cacl
    if mode == "random":
        import contrastive_losses as cl

        column = cl.sample_languages(mask, generator=generator, include_english=True)
    else:
        column = torch.full((b,), fixed_column, dtype=torch.long)
    texts = pick(captions, column)
    langs = [languages[i] for i in column.tolist()]
    ids: Tensor = batch["index"]

    def arrange_pair(audio: Tensor, text: Tensor) -> Arranged:
        return (audio, text), {}

    def arrange_ask(audio: Tensor, text: Tensor) -> Arranged:
        return (audio, text, ids.to(audio.device)), {}

    return texts, langs, arrange_ask if with_ids else arrange_pair


class Trainable(nn.Module):
    """Model + loss in one module, so DDP synchronises the loss's parameters too."""

    def __init__(
        self,
        model: ClapModel,
        loss_fn: nn.Module,
        amp_dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.amp_dtype = amp_dtype
        self.device_type = device.type

    def autocast(self) -> Any:
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def compute_loss(
        self, audio: Tensor, text: Tensor, arrange: Callable[[Tensor, Tensor], Arranged]
    ) -> tuple[Tensor, dict[str, Any]]:
        positional, keyword = arrange(audio, text)
        loss, terms = self.loss_fn(*positional, **keyword, return_terms=True)
        return loss, terms

    def forward(
        self,
        waveform: Tensor,
        lengths: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        arrange: Callable[[Tensor, Tensor], Arranged],
    ) -> tuple[Tensor, dict[str, Any]]:
        with self.autocast():
            audio, text = self.model(waveform, lengths, input_ids, attention_mask)
        assert audio is not None and text is not None  # both towers ran
        return self.compute_loss(audio.float(), text.float(), arrange)


def running_stats(module: nn.Module) -> list[Tensor]:
    """Buffers a forward pass changes (batch-norm statistics)."""
    norms = (m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase))
    return [b for m in norms for b in m.buffers(recurse=False) if b is not None]


class _Tower(nn.Module):
    """One tower of the model under the run's autocast, returning float32 embeddings: a
    Module, so that :class:`~contrastive_losses.GradCache` finds its batch-norm layers."""

    def __init__(self, trainable: Trainable, audio: bool) -> None:
        super().__init__()
        self.trainable = trainable
        self.audio = audio

    def forward(self, first: Tensor, second: Tensor) -> Tensor:
        model = self.trainable.model
        with self.trainable.autocast():
            if self.audio:  # (waveform, lengths)
                out = model.encode_audio(first, second)
            else:  # (input_ids, attention_mask), trimmed to this chunk's longest caption
                width = int(second.sum(1).max())
                out = model.encode_text(first[:, :width], second[:, :width])
        return out.float()


def grad_cache_backward(
    trainable: Trainable,
    scaler: torch.amp.GradScaler,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor],
    arrange: Callable[[Tensor, Tensor], Arranged],
    chunk: int,
) -> tuple[Tensor, dict[str, Any]]:
    """Loss and gradients with both towers GradCached (:class:`~contrastive_losses.GradCache`):
    clips and captions embedded without a graph in chunks of ``chunk`` rows, the loss once,
    its gradient pushed back through each chunk again. Batch-norm layers (the CED's mel-band
    norm) see each chunk's statistics, as each rank's under DDP."""
    from contrastive_losses import GradCache

    waveform, lengths, input_ids, attention_mask = inputs
    cache = GradCache(
        lambda audio, text: trainable.compute_loss(audio, text, arrange),
        chunk,
        scaler=scaler,
        batch_norm="per_chunk",
    )
    loss, terms = cache(
        _Tower(trainable, audio=True), (waveform, lengths),
        _Tower(trainable, audio=False), (input_ids, attention_mask),
    )  # fmt: skip
    return loss, terms
