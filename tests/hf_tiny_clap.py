"""A tiny randomly initialised Hugging Face ``ClapModel`` and a synthetic batch, so the
tests run offline in seconds (the docs' recipes build the same model inline). For real work:
``ClapModel.from_pretrained("laion/clap-htsat-unfused")`` and its ``ClapProcessor``."""

import torch
from transformers import ClapConfig, ClapModel


def tiny_clap(seed: int = 0) -> ClapModel:
    """Two layers a tower, 16-dim embeddings, 64x16 spectrogram patches; no dropout."""
    config = ClapConfig(
        text_config={
            "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 37, "max_position_embeddings": 64,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        },
        audio_config={
            "spec_size": 64, "window_size": 4, "num_mel_bins": 16, "patch_size": 2,
            "patch_stride": 2, "hidden_size": 32, "patch_embeds_hidden_size": 16,
            "depths": [2, 2], "num_attention_heads": [2, 2], "num_hidden_layers": 2,
            "hidden_dropout_prob": 0.0,
        },
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    return ClapModel(config)


def tiny_batch(clips: int = 8, captions: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """``clips`` spectrograms and ``captions`` token sequences per clip (clip-major), as
    ``ClapProcessor`` would return them."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_features": torch.randn(clips, 1, 60, 16, generator=g),
        "input_ids": torch.randint(3, 99, (clips * captions, 7), generator=g),
        "attention_mask": torch.ones(clips * captions, 7, dtype=torch.long),
    }
