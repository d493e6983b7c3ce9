"""CED audio encoder (Dinkel et al., "CED: Consistent ensemble distillation for audio tagging").

Written from the published architecture (the reference code was read, not copied):

* front end: 64-band log-mel spectrogram at 16 kHz -- periodic Hann window of 512 samples,
  ``n_fft = 512``, hop 160 (10 ms), centred STFT with reflect padding, power spectrum, HTK
  mel filterbank from 0 to 8 kHz without area normalisation, ``10 * log10(max(x, 1e-10))`` with
  a 120 dB floor below each clip's maximum (what ``torchaudio``'s ``MelSpectrogram`` +
  ``AmplitudeToDB(top_db=120)`` compute; the filterbank is rebuilt here in plain torch). One
  difference, deliberate: torchaudio takes the 120 dB floor below the maximum of the whole
  ``(B, n_mels, T)`` batch (it reads the batch as channels), so in the reference a clip's
  features depend on the clips batched with it; here the floor is per clip, which is what the
  reference gives for each clip run on its own (batch of one, how it is evaluated);
* ``init_bn``: a ``BatchNorm2d`` over the mel bands;
* 16 x 16 non-overlapping patches (a strided ``Conv2d``) on ``(64 mel, 1012 frames)``, i.e. a
  4 x 63 grid, with *separate* learnable time and frequency position embeddings added on the grid;
* pre-norm ViT blocks (LayerNorm eps 1e-6, fused ``qkv`` projection with bias, GELU MLP x4);
* final LayerNorm, mean over tokens.

Clips longer than ``target_length`` frames (1012, about 10.1 s) follow ``long_clip``:

* ``"reference"`` (default): what the published code does at inference (``forward_spectrogram``
  of ``RicherMans/CED`` ``models/audiotransformer.py``, the same in ML-CLAP's copy): the
  normalised log-mel (after ``init_bn``) is split into ``target_length`` chunks, the last one is
  zero-padded to ``target_length``, every chunk is encoded *without a mask* (the zero frames are
  tokens like any other), and the chunks' mean-pooled embeddings are averaged with equal weight.
  Its quirks, followed so published checkpoints give published numbers: a trailing chunk of
  any length counts (1013 frames = one full chunk + one chunk holding a single real frame, each
  weight 1/2); a clip of an exact multiple ``k * target_length`` frames (k >= 2) keeps only its
  first ``k - 1`` chunks (the reference's ``torch.stack(splits[:-1])`` when nothing needs
  padding); a clip of at most ``target_length`` frames is encoded as it is, unpadded.
  :meth:`CEDAudioEncoder.classify` averages the per-chunk *probabilities* (``sigmoid`` of the
  head on each chunk), as the reference's ``forward_head`` per chunk then ``mean``.
  (The Hugging Face port ``mispeech/ced-*`` instead concatenates the chunks' tokens and applies
  the head once to their mean -- the same embedding for one clip, a different ``classify`` --
  and for a batch of several long clips its ``reshape`` mixes chunks of different clips; we
  follow the original repository, clip by clip.)
* ``"masked"``: padding never counts -- the padded frames of the last chunk are masked in
  attention and pooling, a trailing chunk without one whole 16-frame patch is skipped, and an
  exact multiple of ``target_length`` keeps all its chunks. Cleaner for training from scratch;
  with published weights it gives other embeddings than the reference on clips longer than
  ``target_length`` (identical up to ``target_length`` frames). ``classify`` averages the
  per-chunk probabilities of the chunks kept.

Either way a batch of clips of different lengths (``lengths``) gives each clip what it gives
alone: the front end reflects each clip at its own end, the per-clip dB floor ignores padding,
and padding inside a clip's single (unpadded) chunk is masked.

Parameter names follow the Hugging Face ``mispeech/ced-{tiny,mini,small,base}`` checkpoints
(``encoder.init_bn.*``, ``encoder.patch_embed.proj.*``, ``encoder.time_pos_embed``,
``encoder.freq_pos_embed``,
``encoder.blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}.*``,
``encoder.norm.*`` and the AudioSet head ``outputlayer.{0,1}.*``), so
:func:`load_ced_checkpoint` loads their ``model.safetensors`` with ``strict`` key matching.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .sources import HubRepo, hub_file, locate

SAMPLE_RATE = 16_000

#: The four published sizes (embed_dim, depth, num_heads); every size uses 16x16 patches and mlp x4.
CED_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"embed_dim": 192, "depth": 12, "num_heads": 3},
    "mini": {"embed_dim": 256, "depth": 12, "num_heads": 4},
    "small": {"embed_dim": 384, "depth": 12, "num_heads": 6},
    "base": {"embed_dim": 768, "depth": 12, "num_heads": 12},
}

#: How clips longer than ``target_length`` frames are encoded (see the module docstring).
LONG_CLIP_RULES = ("reference", "masked")

#: Hugging Face repositories of the published checkpoints.
CED_HUB_IDS: dict[str, str] = {size: f"mispeech/ced-{size}" for size in CED_SIZES}


@dataclass
class CEDConfig:
    """Hyperparameters of :class:`CEDAudioEncoder`; the defaults are CED-Base's."""

    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    patch_size: int = 16
    patch_stride: int = 16
    target_length: int = 1012
    n_mels: int = 64
    n_fft: int = 512
    win_size: int = 512
    hop_size: int = 160
    f_min: float = 0.0
    f_max: float = 8000.0
    sample_rate: int = SAMPLE_RATE
    top_db: float | None = 120.0
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    outputdim: int = 527
    with_head: bool = False
    long_clip: str = "reference"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"ced config: embed_dim {self.embed_dim} is not divisible by num_heads "
                f"{self.num_heads}"
            )
        if self.long_clip not in LONG_CLIP_RULES:
            raise ValueError(
                f"ced config long_clip: expected one of {list(LONG_CLIP_RULES)}, "
                f"got {self.long_clip!r}"
            )

    @classmethod
    def from_size(cls, size: str, **overrides: Any) -> CEDConfig:
        """Config of a published size (``tiny``, ``mini``, ``small``, ``base``) plus overrides."""
        if size not in CED_SIZES:
            raise ValueError(f"ced size: expected one of {sorted(CED_SIZES)}, got {size!r}")
        return cls(**{**CED_SIZES[size], **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CEDConfig:
        """Build from a dict; ``size`` picks a preset, unknown keys are an error."""
        values = dict(values)
        size = values.pop("size", None)
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"ced config: unknown key(s) {unknown}; known: {sorted(known)}")
        if size is not None:
            return cls.from_size(str(size), **values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        return out


# --------------------------------------------------------------------------------------------
# Front end
# --------------------------------------------------------------------------------------------


def hz_to_mel_htk(freq: Tensor) -> Tensor:
    """HTK mel scale: ``2595 * log10(1 + f / 700)``."""
    return 2595.0 * torch.log10(1.0 + freq / 700.0)


def mel_to_hz_htk(mel: Tensor) -> Tensor:
    """Inverse of :func:`hz_to_mel_htk`."""
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(
    n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int
) -> Tensor:
    """Triangular HTK mel filters, shape ``(n_freqs, n_mels)``, peak 1, no area normalisation.

    ``n_mels + 2`` points equally spaced on the mel scale between ``f_min`` and ``f_max``; filter
    ``m`` rises linearly (in Hz) from point ``m`` to ``m + 1`` and falls to ``m + 2``.
    """
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)  # (F,)
    m_min = hz_to_mel_htk(torch.tensor(f_min, dtype=torch.float64))
    m_max = hz_to_mel_htk(torch.tensor(f_max, dtype=torch.float64))
    m_pts = torch.linspace(float(m_min), float(m_max), n_mels + 2, dtype=torch.float64)
    f_pts = mel_to_hz_htk(m_pts)  # (M + 2,)
    f_diff = f_pts[1:] - f_pts[:-1]  # (M + 1,)
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)  # (F, M + 2)
    down = -slopes[:, :-2] / f_diff[:-1]  # (F, M)
    up = slopes[:, 2:] / f_diff[1:]  # (F, M)
    return torch.clamp(torch.minimum(down, up), min=0.0).to(torch.float32)


class LogMelFrontEnd(nn.Module):
    """Waveform ``(B, S)`` at 16 kHz -> log-mel ``(B, n_mels, T)`` with ``T = 1 + S // hop``.

    Runs in float32 (float64 for float64 input) with autocast disabled (the dB conversion
    underflows in bf16/fp16). The
    window and filterbank are non-persistent buffers: they are not part of the checkpoints.
    """

    window: Tensor
    fbanks: Tensor

    def __init__(self, config: CEDConfig) -> None:
        super().__init__()
        if config.f_max > config.sample_rate / 2:
            raise ValueError(
                f"f_max: {config.f_max} Hz is above the Nyquist frequency of "
                f"{config.sample_rate} Hz audio"
            )
        self.n_fft = config.n_fft
        self.win_size = config.win_size
        self.hop_size = config.hop_size
        self.top_db = config.top_db
        self.register_buffer(
            "window", torch.hann_window(config.win_size, periodic=True), persistent=False
        )
        self.register_buffer(
            "fbanks",
            mel_filterbank(
                config.n_fft // 2 + 1, config.f_min, config.f_max, config.n_mels, config.sample_rate
            ),
            persistent=False,
        )

    def num_frames(self, num_samples: Tensor) -> Tensor:
        """Frames produced from ``num_samples`` samples (centred STFT)."""
        return torch.div(num_samples, self.hop_size, rounding_mode="floor") + 1

    def forward(self, waveform: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``lengths`` (B,) in samples: each clip is reflected at its own end (what a centred
        STFT of the clip alone does) and its dB floor ignores the frames after its end."""
        with torch.autocast(device_type=waveform.device.type, enabled=False):
            x = waveform if waveform.dtype == torch.float64 else waveform.float()
            frame_mask = None
            if lengths is None:
                spec = torch.stft(
                    x, n_fft=self.n_fft, hop_length=self.hop_size, win_length=self.win_size,
                    window=self.window, center=True, pad_mode="reflect", return_complex=True,
                )  # fmt: skip
            else:
                x = self._reflect_each(x, lengths)
                spec = torch.stft(
                    x, n_fft=self.n_fft, hop_length=self.hop_size, win_length=self.win_size,
                    window=self.window, center=False, return_complex=True,
                )  # fmt: skip
                frames = torch.arange(spec.shape[-1], device=x.device)
                n_frames = self.num_frames(lengths.to(x.device))
                frame_mask = frames.unsqueeze(0) < n_frames.unsqueeze(1)  # (B, T)
            power = spec.real.square() + spec.imag.square()  # (B, n_fft/2 + 1, T)
            mel = torch.matmul(power.transpose(1, 2), self.fbanks).transpose(1, 2)  # (B, M, T)
            log_mel = 10.0 * torch.log10(torch.clamp(mel, min=1e-10))
            if self.top_db is not None:
                real = log_mel
                if frame_mask is not None:
                    real = log_mel.masked_fill(~frame_mask.unsqueeze(1), float("-inf"))
                floor = real.amax(dim=(1, 2), keepdim=True) - self.top_db  # per clip
                log_mel = torch.maximum(log_mel, floor)
        return log_mel

    def _reflect_each(self, x: Tensor, lengths: Tensor) -> Tensor:
        return reflect_each(x, lengths, self.n_fft // 2)


def reflect_each(x: Tensor, lengths: Tensor, pad: int) -> Tensor:
    """``(B, S)`` -> ``(B, S + 2 pad)``: reflect padding of ``pad`` samples at the start and at
    each clip's own end (``torch.stft(center=True)`` on the clip alone, with ``pad = n_fft //
    2``); what lies beyond only feeds frames after the clip's end."""
    total = x.shape[-1]
    last = (lengths.to(x.device).long().clamp(1, total) - 1).unsqueeze(1)  # (B, 1)
    index = torch.arange(-pad, total + pad, device=x.device).abs().unsqueeze(0)
    index = torch.where(index > last, 2 * last - index, index)  # (B, S + 2 pad)
    return x.gather(1, index.clamp(0, total - 1))


# --------------------------------------------------------------------------------------------
# Transformer
# --------------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """``(B, 1, n_mels, T)`` -> ``(B, D, n_mels / p, T / p)`` with a strided convolution."""

    def __init__(self, config: CEDConfig) -> None:
        super().__init__()
        self.grid_size = (
            config.n_mels // config.patch_stride,
            config.target_length // config.patch_stride,
        )
        self.proj = nn.Conv2d(
            1, config.embed_dim, kernel_size=config.patch_size, stride=config.patch_stride
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class Attention(nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection and an optional key mask."""

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool, attn_drop: float, proj_drop: float
    ):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, c/H)
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, N)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop if self.training else 0.0
        )
        out = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample with probability ``p``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, config: CEDConfig, drop_path: float) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(
            dim, config.num_heads, config.qkv_bias, config.attn_drop_rate, config.drop_rate
        )
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio), config.drop_rate)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), key_mask))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class CEDModel(nn.Module):
    """The CED transformer on normalised log-mel input; returns token features ``(B, N, D)``."""

    def __init__(self, config: CEDConfig) -> None:
        super().__init__()
        self.config = config
        self.init_bn = nn.BatchNorm2d(config.n_mels, momentum=0.01)
        self.patch_embed = PatchEmbed(config)
        f_grid, t_grid = self.patch_embed.grid_size
        self.time_pos_embed = nn.Parameter(torch.randn(1, config.embed_dim, 1, t_grid) * 0.02)
        self.freq_pos_embed = nn.Parameter(torch.randn(1, config.embed_dim, f_grid, 1) * 0.02)
        self.pos_drop = nn.Dropout(config.drop_rate)
        rates = torch.linspace(0, config.drop_path_rate, config.depth).tolist()
        self.blocks = nn.ModuleList(Block(config, rate) for rate in rates)
        self.norm = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.apply(_init_weights)

    def normalize(self, log_mel: Tensor) -> Tensor:
        """``init_bn`` over the mel bands: ``(B, M, T)`` -> ``(B, 1, M, T)``."""
        return self.init_bn(log_mel.unsqueeze(2)).transpose(1, 2)

    def forward_features(
        self, x: Tensor, frame_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``x`` ``(B, 1, M, T <= target_length)`` -> tokens ``(B, F*Tp, D)`` and token mask.

        ``frame_mask`` ``(B, T)`` marks real (True) vs padded frames; a patch is real if all its
        frames are (its last one is), so a padded clip keeps exactly the patches the unpadded
        clip has: the strided convolution drops a trailing partial patch.
        """
        x = self.patch_embed(x)  # (B, D, F, Tp)
        _, _, f, t = x.shape
        x = x + self.time_pos_embed[:, :, :, :t] + self.freq_pos_embed[:, :, :f, :]
        x = x.flatten(2).transpose(1, 2)  # (B, F*Tp, D), frequency-major
        token_mask = None
        if frame_mask is not None:
            stride = self.config.patch_stride
            last = self.config.patch_size - 1
            patch_mask = frame_mask[:, last : last + t * stride : stride]  # (B, Tp)
            token_mask = patch_mask.unsqueeze(1).expand(-1, f, -1).reshape(x.shape[0], f * t)
        x = self.pos_drop(x)
        for block in self.blocks:
            x = block(x, token_mask)
        return self.norm(x), token_mask


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class CEDAudioEncoder(nn.Module):
    """Waveform -> mean-pooled CED embedding ``(B, embed_dim)``.

    ``forward(waveform (B, S), lengths (B,) | None)``: ``lengths`` in samples for batches padded
    to a common length. ``outputlayer`` (the AudioSet tagging head) exists only with
    ``config.with_head``; the retrieval model does not use it.
    """

    def __init__(self, config: CEDConfig | None = None) -> None:
        super().__init__()
        self.config = config or CEDConfig()
        self.front_end = LogMelFrontEnd(self.config)
        self.encoder = CEDModel(self.config)
        self.outputlayer: nn.Module | None = None
        if self.config.with_head:
            self.outputlayer = nn.Sequential(
                nn.LayerNorm(self.config.embed_dim),
                nn.Linear(self.config.embed_dim, self.config.outputdim),
            )

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    def forward(self, waveform: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``(B, S)`` (and ``lengths`` ``(B,)`` in samples for a padded batch) -> ``(B, D)``:
        the equal-weight mean of the clip's chunk embeddings (see ``long_clip``)."""
        pooled, weights = self.chunk_embeddings(waveform, lengths)
        return _weighted_mean(pooled, weights)

    def classify(self, waveform: Tensor, lengths: Tensor | None = None) -> Tensor:
        """AudioSet tag probabilities ``(B, outputdim)``: the mean over the clip's chunks of
        ``sigmoid(head(chunk embedding))``, as the reference (needs ``with_head=True``)."""
        if self.outputlayer is None:
            raise RuntimeError("classify: this encoder was built without the AudioSet head")
        pooled, weights = self.chunk_embeddings(waveform, lengths)
        return _weighted_mean(torch.sigmoid(self.outputlayer(pooled)), weights)

    def chunk_counts(self, n_frames: Tensor) -> Tensor:
        """Chunks each clip of ``n_frames`` frames is encoded as, under ``long_clip``."""
        target, patch = self.config.target_length, self.config.patch_size
        if self.config.long_clip == "masked":  # chunks holding at least one whole patch
            return 1 + torch.div((n_frames - patch).clamp(min=0), target, rounding_mode="floor")
        chunks = torch.div(n_frames + target - 1, target, rounding_mode="floor")
        exact = (n_frames > target) & (n_frames % target == 0)  # reference: last one dropped
        return chunks - exact.long()

    def chunk_embeddings(
        self, waveform: Tensor, lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Mean-pooled embedding of every chunk ``(C, B, D)`` and its weight ``(C, B)`` (1 for
        the clip's chunks, 0 past its end)."""
        if waveform.dim() != 2:
            raise ValueError(f"waveform: expected shape (B, S), got {tuple(waveform.shape)}")
        cfg = self.config
        log_mel = self.front_end(waveform, lengths)  # (B, M, T)
        x = self.encoder.normalize(log_mel)  # (B, 1, M, T)
        total = x.shape[-1]
        if lengths is None:
            n_frames = torch.full((x.shape[0],), total, device=x.device, dtype=torch.long)
        else:
            n_frames = self.front_end.num_frames(lengths.to(x.device)).clamp(max=total)
        shortest = int(n_frames.min())
        if shortest < cfg.patch_size:
            raise ValueError(
                f"waveform: a clip gives {shortest} frames, fewer than one patch "
                f"({cfg.patch_size} frames = "
                f"{cfg.patch_size * cfg.hop_size / cfg.sample_rate:.2f} s)"
            )
        frame_mask = torch.arange(total, device=x.device).unsqueeze(0) < n_frames.unsqueeze(1)
        x = x * frame_mask[:, None, None, :]  # after init_bn: padding is zero, as the reference's
        counts = self.chunk_counts(n_frames)  # (B,)
        # Clips longer than one chunk are encoded unmasked under the reference rule.
        unmasked = (n_frames > cfg.target_length) & (cfg.long_clip == "reference")
        width = min(total, cfg.target_length)
        pooled: list[Tensor] = []
        weights: list[Tensor] = []
        for index in range(int(counts.max())):
            start = index * cfg.target_length
            chunk = x[..., start : start + width]
            chunk_mask = frame_mask[:, start : start + width]
            short = width - chunk.shape[-1]
            if short:  # the last chunk, zero-padded to target_length
                chunk, chunk_mask = F.pad(chunk, (0, short)), F.pad(chunk_mask, (0, short))
            used = counts > index  # (B,)
            # Unmasked clips and clips past their end (weight 0) attend to every token.
            chunk_mask = chunk_mask | (unmasked | ~used).unsqueeze(1)
            tokens, token_mask = self.encoder.forward_features(
                chunk, None if bool(chunk_mask.all()) else chunk_mask
            )
            if token_mask is None:
                pooled.append(tokens.mean(dim=1))
            else:
                w = token_mask.to(tokens.dtype).unsqueeze(-1)  # (B, N, 1)
                pooled.append((tokens * w).sum(1) / w.sum(1).clamp(min=1.0))
            weights.append(used.to(tokens.dtype))
        return torch.stack(pooled), torch.stack(weights)


def _weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """``(C, B, K)`` averaged over ``C`` with weights ``(C, B)``."""
    w = weights.unsqueeze(-1)
    return (values * w).sum(0) / w.sum(0).clamp(min=1.0)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def _resolve_checkpoint_file(name_or_path: str | os.PathLike[str]) -> Path:
    """A ``.safetensors`` / ``.bin`` / ``.pt`` file, a directory holding one, or a hub
    repository asked for as ``hf:owner/name`` (see :mod:`clap_example.sources`)."""
    where = locate(name_or_path, "ced checkpoint")
    if isinstance(where, HubRepo):
        return hub_file(where, "model.safetensors", "ced checkpoint")
    if where.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (where / name).is_file():
                return where / name
        raise FileNotFoundError(
            f"ced checkpoint: no model.safetensors or pytorch_model.bin in directory {where}"
        )
    return where


def read_state_dict(file: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a safetensors or torch checkpoint into a flat ``name -> tensor`` dict."""
    file = Path(file)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(file)))
    obj = torch.load(str(file), map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ValueError(f"checkpoint {file}: expected a state dict, got {type(obj).__name__}")
    return obj


def convert_original_ced_keys(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map the original (zenodo) CED key layout onto the Hugging Face one.

    Original checkpoints hold ``init_bn.1.*`` (a BatchNorm inside a Sequential), top-level
    ``patch_embed``/``blocks``/... and the torchaudio front-end buffers ``front_end.*``; the HF
    ones prefix the transformer with ``encoder.``. Already-converted keys pass through.
    """
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("front_end."):
            continue  # filterbank/window buffers: rebuilt by LogMelFrontEnd
        if key.startswith(("encoder.", "outputlayer.")):
            out[key] = value
            continue
        key = key.replace("init_bn.1.", "init_bn.")
        out[f"encoder.{key}"] = value
    return out


def adapt_position_embeddings(state_dict: dict[str, Tensor], model: CEDAudioEncoder) -> None:
    """Crop (or bilinearly resize) position embeddings to the model's grid, in place."""
    for key, axis in (("encoder.time_pos_embed", -1), ("encoder.freq_pos_embed", -2)):
        if key not in state_dict:
            continue
        target = getattr(model.encoder, key.split(".")[1])
        src = state_dict[key]
        if src.shape == target.shape:
            continue
        if src.shape[axis] >= target.shape[axis]:
            index = [slice(None)] * src.dim()
            index[axis] = slice(0, target.shape[axis])
            state_dict[key] = src[tuple(index)].contiguous()
        else:
            state_dict[key] = F.interpolate(
                src.float(), size=tuple(target.shape[-2:]), mode="bilinear", align_corners=False
            ).to(src.dtype)


def load_ced_checkpoint(
    model: CEDAudioEncoder, name_or_path: str | os.PathLike[str], strict: bool = True
) -> list[str]:
    """Load published CED weights into ``model``; returns the checkpoint keys that were ignored.

    ``name_or_path``: a ``model.safetensors`` file, a directory with one, an original ``.pt``
    checkpoint, or a hub repository: ``hf:mispeech/ced-base`` (the published ids also without
    ``hf:``; needs network or the hub cache). A missing local path is an error at once. The
    AudioSet head (``outputlayer.*``) is loaded only into a model built with ``with_head=True``
    and ignored otherwise. With ``strict`` every encoder parameter and buffer must be present
    with its shape.
    """
    state = convert_original_ced_keys(read_state_dict(_resolve_checkpoint_file(name_or_path)))
    adapt_position_embeddings(state, model)
    ignored = []
    if model.outputlayer is None:
        ignored = sorted(k for k in state if k.startswith("outputlayer."))
        for key in ignored:
            del state[key]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    if strict and (missing or unexpected or wrong):
        raise ValueError(
            f"ced checkpoint {name_or_path} does not match the model: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}, "
            f"shape mismatches {wrong[:8]}"
        )
    model.load_state_dict(
        {k: v for k, v in state.items() if k in expected and k not in wrong}, strict=False
    )
    return ignored + unexpected


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def frames_for_seconds(seconds: float, hop_size: int = 160, sample_rate: int = SAMPLE_RATE) -> int:
    """Spectrogram frames of a clip of ``seconds`` (centred STFT)."""
    return math.floor(seconds * sample_rate / hop_size) + 1
