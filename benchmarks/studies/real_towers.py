"""Towers of the real-data study (``real_multilingual.py``): audio over time-resolved log-mel
frames, its length-only control, and a trainable block on top of the frozen e5 text side.

- :class:`ConvAudioTower`: ``(B, M, T)`` log-mel frames (zero after each clip's length) ->
  ``(B, dim)``. Two 1-D convolutions over time (kernel 5, the second with stride 2), an
  optional bidirectional GRU, masked mean and max pooling over the valid steps, the log
  length appended, then linear. Time is not stretched: a word is the same width in a short
  and a long utterance, which the flattened fixed-size patch of the first study lacked.
- :func:`length_only`: the same input with every valid frame replaced by ones: the tower
  sees the duration and nothing else (the control for "the model learns the length").
- :func:`spec_augment`: SpecAugment-style band and step masks (training only).
- :class:`TextBlock`: ``x + MLP(x)`` over e5's sentence embedding, the MLP's output layer
  initialised to zero (it starts as frozen e5 and can move).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def valid_mask(lengths: Tensor, steps: int) -> Tensor:
    """``(B, steps)`` bool: step ``t < lengths[b]``."""
    return torch.arange(steps, device=lengths.device)[None] < lengths[:, None]


def normalise_frames(audio: Tensor, lengths: Tensor) -> Tensor:
    """Per-utterance, per-band mean and variance normalisation over the valid frames of
    ``(B, M, T)``; frames past ``lengths`` are zero. float32."""
    a = audio.float()
    mask = valid_mask(lengths, a.shape[-1])[:, None].float()
    n = lengths.clamp(min=1)[:, None, None].float()
    mean = (a * mask).sum(-1, keepdim=True) / n
    var = ((a - mean).square() * mask).sum(-1, keepdim=True) / n
    return (a - mean) / (var.sqrt() + 1e-3) * mask


def pool_frames(audio: Tensor, lengths: Tensor, time: int, mels: int) -> tuple[Tensor, Tensor]:
    """Average ``time`` frames and groups of bands down to ``mels``: ``((B, mels, T//time),
    lengths // time)`` (at least 1)."""
    a = audio.float()
    if a.shape[1] != mels:
        if a.shape[1] % mels:
            raise ValueError(f"mels: {a.shape[1]} bands cannot be pooled to {mels}")
        a = a.reshape(a.shape[0], mels, -1, a.shape[2]).mean(2)
    if time > 1:
        a = nn.functional.avg_pool1d(a, time)
    return a, (lengths // time).clamp(1, a.shape[-1])


def length_only(audio: Tensor, lengths: Tensor) -> Tensor:
    """Ones on every valid frame, zero after: only the duration is left."""
    return valid_mask(lengths, audio.shape[-1])[:, None].expand_as(audio).float()


def spec_augment(
    audio: Tensor, lengths: Tensor, generator: torch.Generator, bands: int, steps: int
) -> Tensor:
    """Two band masks of up to ``bands`` bands and two step masks of up to ``steps`` steps
    per clip (zeroed, which is the mean after :func:`normalise_frames`)."""
    b, m, t = audio.shape
    keep = torch.ones(b, m, t)
    for size, axis in ((bands, 1), (steps, 2)):
        if size <= 0:
            continue
        for _ in range(2):
            width = torch.randint(0, size + 1, (b,), generator=generator)
            span = (lengths.cpu() if axis == 2 else torch.full((b,), m)) - width
            start = (torch.rand(b, generator=generator) * span.clamp(min=0).float()).long()
            pos = torch.arange(m if axis == 1 else t)[None]
            cut = (pos >= start[:, None]) & (pos < (start + width)[:, None])
            keep = keep * (~cut[:, :, None] if axis == 1 else ~cut[:, None, :]).float()
    return audio * keep.to(audio.device)


class ConvAudioTower(nn.Module):
    """``(B, mels, T)`` frames, ``(B,)`` valid steps, ``(B,)`` log seconds -> ``(B, dim)``
    (see the module doc); ``gru`` adds a bidirectional GRU of ``width`` after the convs."""

    def __init__(self, mels: int, dim: int, width: int, gru: bool, dropout: float) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv1d(mels, width, 5, padding=2),
            nn.GELU(),
            nn.Conv1d(width, width, 5, stride=2, padding=2),
            nn.GELU(),
        )
        self.gru = nn.GRU(width, width // 2, batch_first=True, bidirectional=True) if gru else None
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width + 1, dim)

    def forward(self, x: Tensor, lengths: Tensor, seconds: Tensor) -> Tensor:
        h = self.convs(x)  # (B, W, ceil(T / 2))
        steps = ((lengths + 1) // 2).clamp(1, h.shape[-1])
        if self.gru is not None:
            h = self.gru(h.transpose(1, 2))[0].transpose(1, 2)
        mask = valid_mask(steps, h.shape[-1])[:, None]
        mean = (h * mask).sum(-1) / steps[:, None].float()
        peak = h.masked_fill(~mask, float("-inf")).amax(-1)
        return self.head(torch.cat([self.drop(mean), self.drop(peak), seconds[:, None]], 1))


class TextBlock(nn.Module):
    """``x + W2 GELU(W1 x)`` on ``(..., dim)`` e5 features, ``W2`` zero at the start."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, hidden)
        self.outer = nn.Linear(hidden, dim)
        nn.init.zeros_(self.outer.weight)
        nn.init.zeros_(self.outer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.outer(nn.functional.gelu(self.inner(x)))


class FeatureHead(nn.Module):
    """A head on a frozen pretrained encoder (``real_pretrained.py``): ``(B, F, 1)`` fixed
    clip features (the encoder's pooled states, standardised) and ``(B,)`` log length ->
    ``(B, dim)``: dropout on the input, the log length appended, one GELU layer of
    ``hidden``, dropout, linear."""

    def __init__(self, features: int, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.body = nn.Sequential(
            nn.Linear(features + 1, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )

    def forward(self, x: Tensor, lengths: Tensor, seconds: Tensor) -> Tensor:
        return self.body(torch.cat([self.drop(x[:, :, 0]), seconds[:, None]], dim=1))


class TopBlockTower(nn.Module):
    """A pretrained encoder's top block made trainable under a :class:`FeatureHead`
    (``real_pretrained.py``'s second stage): ``(B, T, d)`` states entering the block (zero
    after each clip's ``lengths`` frames) -> the block, the final norm, mean and max over
    the valid frames, the first stage's standardisation (``mean``, ``std``: fixed), the
    head. With the block and norm as loaded, it equals the head on the cached features."""

    def __init__(
        self, block: nn.Module, norm: nn.Module, mean: Tensor, std: Tensor, head: FeatureHead
    ) -> None:
        super().__init__()
        self.block, self.norm, self.head = block, norm, head
        self.register_buffer("mean", mean.float())
        self.register_buffer("std", std.float())

    def forward(self, x: Tensor, lengths: Tensor, seconds: Tensor) -> Tensor:
        steps = int(lengths.max())
        x = x[:, :steps].float()
        keep = valid_mask(lengths, steps)
        h = self.norm(self.block(x, keep))
        mask = keep[..., None]
        mean = (h * mask).sum(1) / lengths[:, None].clamp(min=1)
        peak = h.masked_fill(~mask, float("-inf")).amax(1)
        pooled = (torch.cat([mean, peak], dim=1) - self.mean) / self.std
        return self.head(pooled[:, :, None], lengths, seconds)
