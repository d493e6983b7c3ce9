"""Whisper's log-mel front end in torch: 80 Slaney mel bands of a 25 ms / 10 ms STFT at 16 kHz.

What OpenAI's ``whisper.audio.log_mel_spectrogram`` and faster-whisper's numpy
``FeatureExtractor`` compute, per clip:

1. a centred STFT (``n_fft = 400``, hop 160, periodic Hann window, reflect padding), the last
   frame dropped: a clip of ``S`` samples gives ``T = S // 160`` frames (100 a second);
2. the power spectrum through ``n_mels`` triangular filters on the Slaney mel scale (linear to
   1 kHz, logarithmic above; each filter's area normalised, librosa's ``norm="slaney"``), 0 to
   8 kHz;
3. ``log10`` (floored at ``1e-10``), then floored again at the clip's own maximum minus 8
   (80 dB of range), then ``(x + 4) / 4``.

Whisper's encoder was trained on 30-s windows: a shorter clip followed by silence up to 30 s
(whose log-mel sits at the floor). :meth:`WhisperLogMel.forward` gives the clip at its own
length (``window="own"``) or padded with zero samples to 30 s, as OpenAI's ``transcribe``
does (``window="padded"``: always 3000 frames).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .ced import reflect_each

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
#: Samples in Whisper's 30-s window, and its log-mel frames.
WINDOW_SAMPLES = 30 * SAMPLE_RATE
WINDOW_FRAMES = WINDOW_SAMPLES // HOP


def hz_to_mel_slaney(freq: Tensor) -> Tensor:
    """Slaney's mel scale: ``3 f / 200`` below 1 kHz, ``15 + 27 ln(f / 1000) / ln 6.4`` above."""
    linear = 3.0 * freq / 200.0
    log = 15.0 + torch.log(torch.clamp(freq, min=1e-10) / 1000.0) * (27.0 / math.log(6.4))
    return torch.where(freq >= 1000.0, log, linear)


def mel_to_hz_slaney(mel: Tensor) -> Tensor:
    """Inverse of :func:`hz_to_mel_slaney`."""
    linear = 200.0 * mel / 3.0
    log = 1000.0 * torch.exp((mel - 15.0) * (math.log(6.4) / 27.0))
    return torch.where(mel >= 15.0, log, linear)


def slaney_filters(
    n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE, f_max: float | None = None
) -> Tensor:
    """Triangular filters ``(n_mels, n_fft // 2 + 1)``: ``n_mels + 2`` points equally spaced on
    the Slaney mel scale from 0 Hz to ``f_max`` (default Nyquist); filter ``m`` rises from
    point ``m`` to ``m + 1`` and falls to ``m + 2`` (linearly in Hz), times ``2 / (f_{m+2} -
    f_m)`` so each has unit area."""
    f_max = sample_rate / 2 if f_max is None else f_max
    bins = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    top = hz_to_mel_slaney(torch.tensor(float(f_max), dtype=torch.float64))
    points = mel_to_hz_slaney(torch.linspace(0.0, float(top), n_mels + 2, dtype=torch.float64))
    width = points[1:] - points[:-1]  # (M + 1,)
    ramps = points.unsqueeze(1) - bins.unsqueeze(0)  # (M + 2, F)
    rise = -ramps[:-2] / width[:-1].unsqueeze(1)
    fall = ramps[2:] / width[1:].unsqueeze(1)
    filters = torch.clamp(torch.minimum(rise, fall), min=0.0)
    return (filters * (2.0 / (points[2:] - points[:-2])).unsqueeze(1)).to(torch.float32)


class WhisperLogMel(nn.Module):
    """Waveform ``(B, S)`` at 16 kHz -> ``(features (B, n_mels, T), frames (B,))``.

    ``lengths`` (B,) in samples (default: all ``S``): each clip is reflected at its own end
    and its floor is its own maximum minus 8, so a clip padded in a batch gets the frames it
    gets alone; ``frames = lengths // 160``. With ``window="padded"`` every clip is followed by
    zero samples up to 30 s (longer clips are cut there) and ``T = 3000``; ``frames`` still
    counts the clip's own frames. Runs in float32 with autocast off. The window and the
    filters are non-persistent buffers (not in checkpoints).
    """

    window: Tensor
    filters: Tensor

    def __init__(self, n_mels: int = 80) -> None:
        super().__init__()
        if n_mels < 1:
            raise ValueError(f"n_mels: expected >= 1, got {n_mels}")
        self.n_mels = n_mels
        self.register_buffer("window", torch.hann_window(N_FFT, periodic=True), persistent=False)
        self.register_buffer("filters", slaney_filters(n_mels), persistent=False)

    def forward(
        self, waveform: Tensor, lengths: Tensor | None = None, window: str = "own"
    ) -> tuple[Tensor, Tensor]:
        if waveform.ndim != 2:
            raise ValueError(f"waveform: expected (B, S), got shape {tuple(waveform.shape)}")
        if window not in ("own", "padded"):
            raise ValueError(f"window: expected 'own' or 'padded', got {window!r}")
        batch, total = waveform.shape
        if lengths is None:
            lengths = torch.full((batch,), total, dtype=torch.long)
        lengths = lengths.to(waveform.device).long().clamp(0, total)
        with torch.autocast(device_type=waveform.device.type, enabled=False):
            x = waveform.float()
            if window == "padded":
                x = x[:, :WINDOW_SAMPLES] * (
                    torch.arange(min(total, WINDOW_SAMPLES), device=x.device) < lengths[:, None]
                )
                x = nn.functional.pad(x, (0, WINDOW_SAMPLES - x.shape[1]))
                lengths = lengths.clamp(max=WINDOW_SAMPLES)
                padded = torch.full_like(lengths, WINDOW_SAMPLES)
            else:
                padded = lengths
            if x.shape[1] <= N_FFT // 2:  # reflect padding needs more samples than its width
                x = nn.functional.pad(x, (0, N_FFT // 2 + 1 - x.shape[1]))
            spec = torch.stft(
                reflect_each(x, padded.clamp(min=N_FFT // 2 + 1), N_FFT // 2),
                n_fft=N_FFT, hop_length=HOP, window=self.window, center=False,
                return_complex=True,
            )[..., :-1]  # fmt: skip
            power = spec.real.square() + spec.imag.square()  # (B, F, T)
            log_mel = torch.log10(torch.clamp(self.filters @ power, min=1e-10))  # (B, M, T)
            valid = torch.arange(log_mel.shape[-1], device=x.device) < (padded // HOP)[:, None]
            peak = log_mel.masked_fill(~valid[:, None, :], float("-inf")).amax(dim=(1, 2))
            log_mel = torch.maximum(log_mel, (peak - 8.0)[:, None, None])
            return (log_mel + 4.0) / 4.0, lengths // HOP
