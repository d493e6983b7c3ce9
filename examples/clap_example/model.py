"""Dual encoder: CED audio tower + SONAR text tower, each with an ML-CLAP projection head.

ML-CLAP (Yan et al., Interspeech 2024) projects the 768-d CED-Base embedding with
``Linear(768, 1024) -> ReLU -> Linear(1024, 1024)`` and the 1024-d SONAR embedding with
``Linear(1024, 1024) -> ReLU -> Linear(1024, 1024)``. The model returns raw (unnormalised)
projections: the library's losses L2-normalise their inputs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from .ced import CEDAudioEncoder, convert_original_ced_keys, read_state_dict
from .sonar import SonarTextEncoder, fairseq2_to_m2m100_keys


def projection_head(in_dim: int, embed_dim: int) -> nn.Sequential:
    """``Linear(in, E) -> ReLU -> Linear(E, E)`` (keys ``0.*`` and ``2.*`` as in ML-CLAP)."""
    return nn.Sequential(nn.Linear(in_dim, embed_dim), nn.ReLU(), nn.Linear(embed_dim, embed_dim))


class ClapModel(nn.Module):
    """``encode_audio(waveform, lengths) -> (B, E)``, ``encode_text(ids, mask) -> (N, E)``."""

    def __init__(self, audio: CEDAudioEncoder, text: SonarTextEncoder, embed_dim: int = 1024):
        super().__init__()
        self.audio = audio
        self.text = text
        self.audio_proj = projection_head(audio.embed_dim, embed_dim)
        self.text_proj = projection_head(text.embed_dim, embed_dim)
        self.embed_dim = embed_dim

    def encode_audio(self, waveform: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.audio_proj(self.audio(waveform, lengths))

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.text_proj(self.text(input_ids, attention_mask))

    def forward(
        self,
        waveform: Tensor | None = None,
        lengths: Tensor | None = None,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Either tower or both (one call, so DDP sees a single forward)."""
        audio = None if waveform is None else self.encode_audio(waveform, lengths)
        text = None
        if input_ids is not None:
            if attention_mask is None:
                raise ValueError("attention_mask: required with input_ids")
            text = self.encode_text(input_ids, attention_mask)
        return audio, text


def mlclap_key_map(state_dict: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Map an ML-CLAP ``pretrain.pt`` state dict onto :class:`ClapModel` names.

    ML-CLAP's keys: ``audio_encoder.model.*`` (the original CED layout: ``init_bn.1.*``,
    ``patch_embed.*``, ``blocks.*``, ``front_end.*`` buffers...), ``text_encoder.model.*`` (the
    fairseq2 SONAR encoder), ``audio_proj.{0,2}.*``, ``text_proj.{0,2}.*`` and ``temperature``.
    Returns the mapped dict and the extras (``temperature``) that have no place in the model.
    """
    audio = {
        k[len("audio_encoder.model.") :]: v
        for k, v in state_dict.items()
        if k.startswith("audio_encoder.model.")
    }
    mapped: dict[str, Tensor] = {}
    for key, value in convert_original_ced_keys(audio).items():
        if key.startswith("outputlayer."):
            continue
        mapped[f"audio.{key}"] = value
    for key, value in fairseq2_to_m2m100_keys(state_dict, prefix="text_encoder.model.").items():
        mapped[f"text.encoder.{key}"] = value
    for key, value in state_dict.items():
        if key.startswith(("audio_proj.", "text_proj.")):
            mapped[key] = value
    extras = {k: v for k, v in state_dict.items() if k == "temperature"}
    return mapped, extras


def load_mlclap_checkpoint(
    model: ClapModel, path: str | os.PathLike[str], strict: bool = True
) -> dict[str, Any]:
    """Load ML-CLAP weights (``pretrain.pt``) into ``model``; returns extras (the temperature).

    With ``strict``, every parameter of the model must be found with the right shape (buffers
    such as BatchNorm statistics included); keys of the checkpoint without a place in the model
    are reported in the returned ``"ignored"`` list.
    """
    mapped, extras = mlclap_key_map(read_state_dict(path))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(mapped))
    wrong = sorted(k for k in set(mapped) & set(expected) if mapped[k].shape != expected[k].shape)
    if strict and (missing or wrong):
        raise ValueError(
            f"ML-CLAP checkpoint {path} does not fit the model: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, shape mismatches "
            f"{[(k, tuple(mapped[k].shape), tuple(expected[k].shape)) for k in wrong[:8]]}"
        )
    with torch.no_grad():
        model.load_state_dict(
            {k: v for k, v in mapped.items() if k in expected and k not in wrong}, strict=False
        )
    extras["ignored"] = sorted(set(mapped) - set(expected))
    return extras
