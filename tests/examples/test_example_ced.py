"""CED audio encoder: front end, padding/chunking, and checkpoint key compatibility with the
published Hugging Face CED checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from clap_example.ced import (
    CED_SIZES,
    CEDAudioEncoder,
    CEDConfig,
    LogMelFrontEnd,
    load_ced_checkpoint,
    mel_filterbank,
)
from safetensors.torch import save_file

TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2}


def hf_ced_keys(depth: int, with_head: bool = True) -> list[str]:
    """Parameter and buffer names of a ``mispeech/ced-*`` ``model.safetensors``, written out
    from the published checkpoints' naming (not from our module)."""
    keys = [
        "encoder.init_bn.weight",
        "encoder.init_bn.bias",
        "encoder.init_bn.running_mean",
        "encoder.init_bn.running_var",
        "encoder.init_bn.num_batches_tracked",
        "encoder.patch_embed.proj.weight",
        "encoder.patch_embed.proj.bias",
        "encoder.time_pos_embed",
        "encoder.freq_pos_embed",
        "encoder.norm.weight",
        "encoder.norm.bias",
    ]
    for i in range(depth):
        for name in (
            "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
            "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
            "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
        ):  # fmt: skip
            keys.append(f"encoder.blocks.{i}.{name}")
    if with_head:
        keys += [
            "outputlayer.0.weight",
            "outputlayer.0.bias",
            "outputlayer.1.weight",
            "outputlayer.1.bias",
        ]
    return keys


def fake_hf_checkpoint(
    path: Path, dim: int, depth: int, classes: int = 7
) -> dict[str, torch.Tensor]:
    """A ``model.safetensors`` with the HF key names and shapes of a (tiny) CED."""
    g = torch.Generator().manual_seed(1)
    shapes = {
        "encoder.init_bn.weight": (64,),
        "encoder.init_bn.bias": (64,),
        "encoder.init_bn.running_mean": (64,),
        "encoder.init_bn.running_var": (64,),
        "encoder.patch_embed.proj.weight": (dim, 1, 16, 16),
        "encoder.patch_embed.proj.bias": (dim,),
        "encoder.time_pos_embed": (1, dim, 1, 63),
        "encoder.freq_pos_embed": (1, dim, 4, 1),
        "encoder.norm.weight": (dim,),
        "encoder.norm.bias": (dim,),
        "outputlayer.0.weight": (dim,),
        "outputlayer.0.bias": (dim,),
        "outputlayer.1.weight": (classes, dim),
        "outputlayer.1.bias": (classes,),
    }
    for i in range(depth):
        p = f"encoder.blocks.{i}."
        shapes.update({
            p + "norm1.weight": (dim,), p + "norm1.bias": (dim,),
            p + "attn.qkv.weight": (3 * dim, dim), p + "attn.qkv.bias": (3 * dim,),
            p + "attn.proj.weight": (dim, dim), p + "attn.proj.bias": (dim,),
            p + "norm2.weight": (dim,), p + "norm2.bias": (dim,),
            p + "mlp.fc1.weight": (4 * dim, dim), p + "mlp.fc1.bias": (4 * dim,),
            p + "mlp.fc2.weight": (dim, 4 * dim), p + "mlp.fc2.bias": (dim,),
        })  # fmt: skip
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    state["encoder.init_bn.running_var"] = state["encoder.init_bn.running_var"].abs() + 0.5
    state["encoder.init_bn.num_batches_tracked"] = torch.tensor(1234)
    assert sorted(state) == sorted(hf_ced_keys(depth))
    save_file(state, str(path))
    return state


# --- front end ----------------------------------------------------------------------------------


def reference_htk_filterbank(
    n_freqs: int, f_min: float, f_max: float, n_mels: int, sr: int
) -> np.ndarray:
    """Plain loops over the HTK triangular filter definition."""

    def mel(f: float) -> float:
        return 2595.0 * math.log10(1.0 + f / 700.0)

    def hz(m: float) -> float:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    edges = [
        hz(mel(f_min) + (mel(f_max) - mel(f_min)) * i / (n_mels + 1)) for i in range(n_mels + 2)
    ]
    out = np.zeros((n_freqs, n_mels))
    for k in range(n_freqs):
        f = k * (sr / 2) / (n_freqs - 1)
        for m in range(n_mels):
            lo, centre, hi = edges[m], edges[m + 1], edges[m + 2]
            if lo <= f <= centre:
                out[k, m] = (f - lo) / (centre - lo)
            elif centre < f <= hi:
                out[k, m] = (hi - f) / (hi - centre)
    return out


def test_mel_filterbank_matches_htk_definition() -> None:
    ours = mel_filterbank(257, 0.0, 8000.0, 64, 16000).double().numpy()
    ref = reference_htk_filterbank(257, 0.0, 8000.0, 64, 16000)
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_front_end_shape_peak_band_and_floor() -> None:
    config = CEDConfig(**TINY)
    front = LogMelFrontEnd(config)
    sr, seconds, freq = 16000, 1.0, 1000.0
    t = torch.arange(int(sr * seconds)) / sr
    wave = torch.sin(2 * math.pi * freq * t).unsqueeze(0)
    log_mel = front(wave)
    assert log_mel.shape == (1, 64, 1 + int(sr * seconds) // 160)
    band = int(log_mel[0, :, 50].argmax())
    fb = mel_filterbank(257, 0.0, 8000.0, 64, 16000)
    assert band == int(
        fb[round(freq / (sr / 2) * 256)].argmax()
    )  # the band whose filter peaks at 1 kHz
    assert float(log_mel.max() - log_mel.min()) <= 120.0 + 1e-4  # top_db floor
    silent = front(torch.zeros(1, 1600))
    assert torch.isfinite(silent).all()


# --- encoder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", sorted(CED_SIZES))
def test_state_dict_keys_are_the_hf_names_for_every_size(size: str) -> None:
    config = CEDConfig.from_size(size, depth=2, with_head=True)  # depth 2 keeps it small
    model = CEDAudioEncoder(config)
    assert sorted(model.state_dict()) == sorted(hf_ced_keys(depth=2))
    assert model.encoder.time_pos_embed.shape == (1, CED_SIZES[size]["embed_dim"], 1, 63)
    assert model.encoder.freq_pos_embed.shape == (1, CED_SIZES[size]["embed_dim"], 4, 1)


def test_without_head_keys_are_the_hf_encoder_names() -> None:
    model = CEDAudioEncoder(CEDConfig(**TINY))
    assert sorted(model.state_dict()) == sorted(hf_ced_keys(depth=2, with_head=False))


def test_loads_fake_hf_checkpoint_strictly(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    state = fake_hf_checkpoint(file, dim=32, depth=2)
    model = CEDAudioEncoder(CEDConfig(**TINY, with_head=True, outputdim=7))
    ignored = load_ced_checkpoint(model, tmp_path)  # the directory form
    assert ignored == []
    loaded = model.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
    probs = model.eval().classify(torch.randn(2, 16000))
    assert probs.shape == (2, 7) and bool(((probs > 0) & (probs < 1)).all())

    # The retrieval model has no AudioSet head: the head's keys are ignored, the rest strict.
    bare = CEDAudioEncoder(CEDConfig(**TINY))
    ignored = load_ced_checkpoint(bare, file)
    assert ignored == sorted(k for k in state if k.startswith("outputlayer."))
    torch.testing.assert_close(
        bare.encoder.blocks[1].mlp.fc2.weight, state["encoder.blocks.1.mlp.fc2.weight"]
    )


def test_checkpoint_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    fake_hf_checkpoint(file, dim=32, depth=2)
    deeper = CEDAudioEncoder(CEDConfig(embed_dim=32, depth=3, num_heads=2))
    with pytest.raises(ValueError, match=r"missing \['encoder.blocks.2"):
        load_ced_checkpoint(deeper, file)
    wider = CEDAudioEncoder(CEDConfig(embed_dim=64, depth=2, num_heads=2))
    with pytest.raises(ValueError, match="shape mismatches"):
        load_ced_checkpoint(wider, file)


def test_original_zenodo_layout_is_converted(tmp_path: Path) -> None:
    """Original CED checkpoints: ``init_bn.1.*``, no ``encoder.`` prefix, front-end buffers."""
    hf = fake_hf_checkpoint(tmp_path / "hf.safetensors", dim=32, depth=2)
    original = {}
    for key, value in hf.items():
        if key.startswith("encoder."):
            key = key.removeprefix("encoder.").replace("init_bn.", "init_bn.1.")
        original[key] = value
    original["front_end.0.mel_scale.fb"] = torch.zeros(257, 64)
    original["front_end.0.spectrogram.window"] = torch.zeros(512)
    torch.save(original, tmp_path / "audiotransformer_tiny.pt")
    model = CEDAudioEncoder(CEDConfig(**TINY))
    load_ced_checkpoint(model, tmp_path / "audiotransformer_tiny.pt")
    torch.testing.assert_close(model.encoder.init_bn.running_var, hf["encoder.init_bn.running_var"])


def test_position_embeddings_are_cropped_to_a_shorter_target(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    state = fake_hf_checkpoint(file, dim=32, depth=2)
    model = CEDAudioEncoder(CEDConfig(**TINY, target_length=512))  # 32 time patches
    load_ced_checkpoint(model, file)
    torch.testing.assert_close(
        model.encoder.time_pos_embed, state["encoder.time_pos_embed"][..., :32]
    )


def test_padding_does_not_change_the_embedding() -> None:
    torch.manual_seed(0)
    model = CEDAudioEncoder(CEDConfig(**TINY)).eval()
    short = torch.randn(1, 16000 * 3)
    alone = model(short)
    batch = torch.cat([short, torch.zeros(1, 16000 * 2)], dim=1)
    padded = model(batch, torch.tensor([short.shape[1]]))
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_masked_rule_is_the_mean_of_its_masked_chunks() -> None:
    torch.manual_seed(0)
    config = CEDConfig(**TINY, target_length=160, long_clip="masked")  # 1.6 s chunks
    model = CEDAudioEncoder(config).eval()
    wave = torch.randn(2, 16000 * 4)  # 401 frames: chunks of 160, 160, 81 (+ padding)
    out = model(wave)
    assert out.shape == (2, 32)
    # Reference: the same chunks encoded one by one (last one zero-padded and masked).
    x = model.encoder.normalize(model.front_end(wave))
    pooled = []
    for start in range(0, x.shape[-1], 160):
        chunk = x[..., start : start + 160]
        n = chunk.shape[-1]
        mask = torch.zeros(2, 160, dtype=torch.bool)
        mask[:, :n] = True
        chunk = torch.nn.functional.pad(chunk, (0, 160 - n))
        tokens, token_mask = model.encoder.forward_features(chunk, mask if n < 160 else None)
        if token_mask is None:
            pooled.append(tokens.mean(1))
        else:
            w = token_mask.float().unsqueeze(-1)
            pooled.append((tokens * w).sum(1) / w.sum(1))
    torch.testing.assert_close(out, torch.stack(pooled).mean(0), atol=1e-5, rtol=1e-5)


def test_too_short_input_is_a_clear_error() -> None:
    model = CEDAudioEncoder(CEDConfig(**TINY))
    with pytest.raises(ValueError, match="fewer than one patch"):
        model(torch.randn(1, 1000))


# --- long clips: the reference's chunk rule ----------------------------------------------------


def plain_ced_tokens(enc: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The CED transformer written out: ``(N, 1, M, T)`` normalised log-mel -> tokens, no mask
    (strided conv patches, time + frequency position embeddings, pre-norm blocks with the
    reference's explicit ``softmax(q k^T / sqrt(d)) v`` attention, final LayerNorm)."""
    h = F.conv2d(x, enc.patch_embed.proj.weight, enc.patch_embed.proj.bias, stride=16)
    h = h + enc.time_pos_embed[..., : h.shape[-1]] + enc.freq_pos_embed
    h = h.flatten(2).transpose(1, 2)  # (N, F*T, D), frequency-major
    n, length, dim = h.shape
    for blk in enc.blocks:
        heads = blk.attn.num_heads
        y = F.layer_norm(h, (dim,), blk.norm1.weight, blk.norm1.bias, 1e-6)
        qkv = F.linear(y, blk.attn.qkv.weight, blk.attn.qkv.bias)
        q, k, v = qkv.reshape(n, length, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5).softmax(-1)
        y = (attn @ v).transpose(1, 2).reshape(n, length, dim)
        h = h + F.linear(y, blk.attn.proj.weight, blk.attn.proj.bias)
        y = F.layer_norm(h, (dim,), blk.norm2.weight, blk.norm2.bias, 1e-6)
        y = F.linear(F.gelu(F.linear(y, blk.mlp.fc1.weight, blk.mlp.fc1.bias)), blk.mlp.fc2.weight)
        h = h + y + blk.mlp.fc2.bias
    return F.layer_norm(h, (dim,), enc.norm.weight, enc.norm.bias, 1e-6)


def reference_chunks(model: CEDAudioEncoder, wave: torch.Tensor, target: int) -> torch.Tensor:
    """The CED repository's ``forward_spectrogram`` on ONE clip ``(S,)``, written from its
    behaviour: ``init_bn``; at most ``target`` frames -> encoded as they are; longer -> split
    into ``target`` chunks, a short last chunk zero-padded, a full last chunk dropped (the
    reference's ``torch.stack(splits[:-1])``); no mask; returns the chunks' mean-pooled
    embeddings ``(C, D)`` (the clip's embedding is their plain mean)."""
    log_mel = model.front_end(wave.unsqueeze(0))  # (1, M, T): the clip alone
    bn = model.encoder.init_bn
    x = (log_mel - bn.running_mean[:, None]) / torch.sqrt(bn.running_var[:, None] + bn.eps)
    x = (x * bn.weight[:, None] + bn.bias[:, None]).unsqueeze(1)  # (1, 1, M, T)
    if x.shape[-1] <= target:
        return plain_ced_tokens(model.encoder, x).mean(1)
    splits = list(x.split(target, -1))
    if splits[-1].shape[-1] < target:
        pad = torch.zeros(*x.shape[:-1], target, dtype=x.dtype)
        pad[..., : splits[-1].shape[-1]] = splits[-1]
        splits[-1] = pad
    else:
        splits = splits[:-1]
    return plain_ced_tokens(model.encoder, torch.cat(splits, 0)).mean(1)


def random_ced(config: CEDConfig) -> CEDAudioEncoder:
    """float64, eval mode, init_bn with non-trivial statistics (so zero-padding after it is not
    zero-padding before it)."""
    torch.manual_seed(0)
    model = CEDAudioEncoder(config).double().eval()
    with torch.no_grad():
        bn = model.encoder.init_bn
        bn.running_mean.copy_(torch.randn(64, dtype=torch.float64) * 5 - 40)
        bn.running_var.copy_(torch.rand(64, dtype=torch.float64) * 50 + 10)
        bn.weight.copy_(torch.rand(64, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(64, dtype=torch.float64))
    return model


def wave_of_frames(frames: int, seed: int) -> torch.Tensor:
    """A clip whose centred STFT has exactly ``frames`` frames (hop 160)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((frames - 1) * 160, generator=g, dtype=torch.float64)


# tiny: CED-Tiny's width (192) and heads (3) with 3 of its 12 blocks; base: CED-Base's width
# (768) and heads (12) with 1 of its 12 blocks (the chunk rule does not depend on depth; 12
# float64 blocks take minutes on 2 cores).
# The mixed batch: a clip under one chunk (masked in the batch), an exact multiple, short tails.
LONG_CLIP_SHAPES = {
    "tiny": ({**CED_SIZES["tiny"], "depth": 3}, [1500, 700, 2024, 1013, 2501]),
    "base": ({**CED_SIZES["base"], "depth": 1}, [1500, 700, 2024]),
}
LONG_FRAMES = (1012, 1013, 1500, 2024, 2501)


@pytest.mark.parametrize("shape", sorted(LONG_CLIP_SHAPES))
def test_long_clips_equal_the_reference_rule(shape: str) -> None:
    sizes, frames = LONG_CLIP_SHAPES[shape]
    model = random_ced(CEDConfig(**sizes, with_head=True, outputdim=5))
    assert model.config.long_clip == "reference"  # the default
    with torch.no_grad():
        for i, n in enumerate(LONG_FRAMES):
            wave = wave_of_frames(n, seed=i)
            chunks = reference_chunks(model, wave, 1012)
            expected_chunks = {1012: 1, 1013: 2, 1500: 2, 2024: 1, 2501: 3}[n]
            assert chunks.shape[0] == expected_chunks
            got = model(wave.unsqueeze(0))[0]
            torch.testing.assert_close(got, chunks.mean(0), atol=1e-6, rtol=1e-6)
            probs = torch.sigmoid(model.outputlayer(chunks)).mean(0)  # per-chunk probabilities
            torch.testing.assert_close(
                model.classify(wave.unsqueeze(0))[0], probs, atol=1e-6, rtol=1e-6
            )
        # A batch of mixed lengths, padded with zeros: each clip as it is alone.
        waves = [wave_of_frames(n, seed=10 + i) for i, n in enumerate(frames)]
        lengths = torch.tensor([w.shape[0] for w in waves])
        batch = torch.zeros(len(waves), int(lengths.max()), dtype=torch.float64)
        for row, w in zip(batch, waves, strict=True):
            row[: w.shape[0]] = w
        expected = torch.stack([reference_chunks(model, w, 1012).mean(0) for w in waves])
        torch.testing.assert_close(model(batch, lengths), expected, atol=1e-6, rtol=1e-6)


def test_masked_rule_differs_only_past_one_chunk() -> None:
    config = CEDConfig(**TINY)
    reference = random_ced(config)
    masked = random_ced(CEDConfig(**TINY, long_clip="masked"))
    masked.load_state_dict(reference.state_dict())
    with torch.no_grad():
        short = wave_of_frames(1012, seed=0).unsqueeze(0)
        torch.testing.assert_close(masked(short), reference(short))
        long = wave_of_frames(1013, seed=0).unsqueeze(0)  # 1 real frame in the 2nd chunk
        first = wave_of_frames(1012, seed=0)  # masked: the 1-frame chunk is skipped
        torch.testing.assert_close(masked(long), masked(first.unsqueeze(0)), atol=1e-6, rtol=0)
        assert not torch.allclose(reference(long), masked(long), atol=1e-3)


def test_unknown_long_clip_rule_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="long_clip"):
        CEDConfig(long_clip="mean")
