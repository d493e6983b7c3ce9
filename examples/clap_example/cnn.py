"""A small audio tower trained from scratch on CPU: CED's log-mel front end + a 1-D CNN.

CED-Base (86 M parameters) is far too slow to train on a laptop CPU. For a demo-scale run on
real recordings (``--audio-encoder cnn``) this tower reads the same 64-band log-mel at 16 kHz
(:class:`~clap_example.ced.LogMelFrontEnd`), normalises each band with batch norm, and runs
``layers`` blocks of ``Conv1d(k=5) -> BatchNorm -> ReLU`` over time (every block after the
first halves the frame rate), then pools the clip's own frames (padding masked out) by mean
and max: ``forward(waveform (B, S), lengths (B,) | None) -> (B, embed_dim)``. The defaults
have about 0.6 M parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .ced import CEDConfig, LogMelFrontEnd


@dataclass
class CNNConfig:
    """Hyperparameters of :class:`LogMelCNN` (``--cnn-config`` overrides them)."""

    channels: int = 192
    layers: int = 4
    kernel_size: int = 5
    embed_dim: int = 256
    dropout: float = 0.1
    n_mels: int = 64

    def __post_init__(self) -> None:
        for name in ("channels", "layers", "kernel_size", "embed_dim", "n_mels"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"cnn config {name}: expected >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"cnn config dropout: expected in [0, 1), got {self.dropout}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CNNConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"cnn config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LogMelCNN(nn.Module):
    """Waveform -> pooled 1-D CNN embedding ``(B, embed_dim)`` (see the module docstring)."""

    def __init__(self, config: CNNConfig | None = None) -> None:
        super().__init__()
        self.config = config or CNNConfig()
        c = self.config
        self.front_end = LogMelFrontEnd(CEDConfig(n_mels=c.n_mels))
        self.init_bn = nn.BatchNorm1d(c.n_mels)
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        width = c.n_mels
        for i in range(c.layers):
            self.convs.append(
                nn.Conv1d(width, c.channels, c.kernel_size, stride=1 if i == 0 else 2,
                          padding=c.kernel_size // 2)
            )  # fmt: skip
            self.norms.append(nn.BatchNorm1d(c.channels))
            width = c.channels
        self.dropout = nn.Dropout(c.dropout)
        self.out = nn.Linear(2 * c.channels, c.embed_dim)

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    def _after(self, conv: nn.Module, n_frames: Tensor) -> Tensor:
        """Frames a convolution leaves from ``n_frames`` (PyTorch's output-length formula)."""
        (k,), (stride,), (pad,) = conv.kernel_size, conv.stride, conv.padding  # type: ignore[misc]
        return torch.div(n_frames + 2 * pad - k, stride, rounding_mode="floor") + 1

    def forward(self, waveform: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Padding is masked to zero before every convolution, so in eval mode a clip padded
        in a batch gets the embedding it gets alone."""
        x = self.init_bn(self.front_end(waveform, lengths))  # (B, M, T)
        n = None
        if lengths is not None:
            n = self.front_end.num_frames(lengths.to(x.device))
        for conv, norm in zip(self.convs, self.norms, strict=True):
            if n is not None:
                x = x * (torch.arange(x.shape[2], device=x.device) < n.unsqueeze(1)).unsqueeze(1)
                n = self._after(conv, n)
            x = torch.relu(norm(conv(x)))
        if n is None:
            pooled = torch.cat([x.mean(dim=2), x.amax(dim=2)], dim=1)
        else:
            mask = (torch.arange(x.shape[2], device=x.device) < n.unsqueeze(1)).unsqueeze(1)
            mean = (x * mask).sum(dim=2) / mask.sum(dim=2).clamp(min=1)
            peak = x.masked_fill(~mask, float("-inf")).amax(dim=2)
            pooled = torch.cat([mean, peak], dim=1)
        return self.out(self.dropout(pooled))
