"""SONAR text encoder (transformers M2M100 encoder + NLLB tokenizer), the fairseq2 and ML-CLAP
key maps, and the CLAP model's heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clap_example.ced import CEDAudioEncoder, CEDConfig
from clap_example.model import ClapModel, load_mlclap_checkpoint
from clap_example.sonar import (
    canonical_language,
    fairseq2_to_m2m100_keys,
    load_sonar_encoder,
    masked_mean,
    strip_encoder_prefix,
)
from safetensors.torch import save_file


def test_tokenizer_prefixes_the_language_code_and_ends_with_eos(sonar_dir: Path) -> None:
    enc = load_sonar_encoder(sonar_dir)
    tok = enc.tokenizer
    batch = enc.tokenize(
        ["a loud rising chirp", "un bip aigu doux", "ein leiser tiefes brummen"],
        ["eng_Latn", "fra_Latn", "deu_Latn"],
    )
    for row, mask, lang in zip(
        batch["input_ids"],
        batch["attention_mask"],
        ["eng_Latn", "fra_Latn", "deu_Latn"],
        strict=True,
    ):
        n = int(mask.sum())
        assert int(row[0]) == tok.convert_tokens_to_ids(lang)
        assert int(row[n - 1]) == tok.eos_token_id
        assert bool((row[n:] == tok.pad_token_id).all())
    # Mixed-language batching gives each text exactly what a one-language call gives.
    tok.src_lang = "fra_Latn"
    alone = tok(["un bip aigu doux"])["input_ids"][0]
    n = int(batch["attention_mask"][1].sum())
    assert batch["input_ids"][1, :n].tolist() == list(alone)
    for code in ("jpn_Jpan", "zho_Hans", "cat_Latn", "nld_Latn", "spa_Latn"):
        assert tok.convert_tokens_to_ids(code) != tok.unk_token_id


def test_unknown_language_is_rejected(sonar_dir: Path) -> None:
    enc = load_sonar_encoder(sonar_dir)
    with pytest.raises(ValueError, match="xx_Latn"):
        enc.tokenize(["hello"], ["xx_Latn"])
    assert canonical_language("fr") == "fra_Latn" and canonical_language("zho_Hans") == "zho_Hans"


def test_mean_pooling_ignores_padding(sonar_dir: Path) -> None:
    enc = load_sonar_encoder(sonar_dir).eval()
    with torch.no_grad():
        alone = enc.encode(["un bip aigu"], ["fra_Latn"])
        batched = enc.encode(
            ["un bip aigu", "a loud rising chirp with rhythmic pulses"], ["fra_Latn", "eng_Latn"]
        )
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(masked_mean(hidden, mask)[0], hidden[0, :2].mean(0))


def test_loads_weights_saved_under_any_transformers_prefix(sonar_dir: Path, tmp_path: Path) -> None:
    enc = load_sonar_encoder(sonar_dir)
    state = enc.encoder.state_dict()
    for prefix in ("", "encoder.", "model.encoder."):
        prefixed = strip_encoder_prefix({prefix + k: v for k, v in state.items()}, set(state))
        assert sorted(prefixed) == sorted(state)
    with pytest.raises(ValueError, match="no M2M100 encoder weights"):
        strip_encoder_prefix({"foo.bar": torch.zeros(1)}, set(state))
    random_init = load_sonar_encoder(sonar_dir, weights=False)
    assert not torch.equal(
        random_init.encoder.layers[0].fc1.weight, enc.encoder.layers[0].fc1.weight
    )


def to_fairseq2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """M2M100Encoder names -> fairseq2 SONAR names (the inverse map, written independently)."""
    out = {}
    for key, value in state.items():
        if key == "embed_tokens.weight":
            fs2 = value.clone()
            # NLLB order <s> <pad> </s> <unk> -> fairseq2 order <pad> <unk> <s> </s>
            fs2[[0, 1, 2, 3]] = value[[1, 3, 0, 2]]
            out["encoder_frontend.embed.weight"] = fs2
            continue
        if key.startswith("layer_norm."):
            out[key] = value
            continue
        key = (
            key.replace(".self_attn.out_proj.", ".self_attn.output_proj.")
            .replace(".fc1.", ".ffn.inner_proj.")
            .replace(".fc2.", ".ffn.output_proj.")
            .replace(".final_layer_norm.", ".ffn_layer_norm.")
        )
        out["encoder." + key] = value
    out["encoder_frontend.pos_encoder.freqs"] = torch.zeros(3)
    return out


def test_fairseq2_key_map_round_trips(sonar_dir: Path) -> None:
    enc = load_sonar_encoder(sonar_dir)
    state = enc.encoder.state_dict()
    mapped = fairseq2_to_m2m100_keys(to_fairseq2(state))
    assert sorted(mapped) == sorted(state)
    for key in state:
        torch.testing.assert_close(mapped[key], state[key], rtol=0, atol=0)


def test_mlclap_checkpoint_loads_into_the_model(sonar_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = ClapModel(
        CEDAudioEncoder(CEDConfig(embed_dim=32, depth=2, num_heads=2)),
        load_sonar_encoder(sonar_dir),
        16,
    )
    ckpt: dict[str, torch.Tensor] = {}
    for (
        key,
        value,
    ) in source.audio.state_dict().items():  # original CED layout under audio_encoder.model.
        key = key.removeprefix("encoder.").replace("init_bn.", "init_bn.1.")
        ckpt["audio_encoder.model." + key] = value
    ckpt["audio_encoder.model.front_end.0.mel_scale.fb"] = torch.zeros(257, 64)
    ckpt["audio_encoder.model.outputlayer.1.weight"] = torch.zeros(527, 32)
    for key, value in to_fairseq2(source.text.encoder.state_dict()).items():
        ckpt["text_encoder.model." + key] = value
    for key, value in source.state_dict().items():
        if key.startswith(("audio_proj.", "text_proj.")):
            ckpt[key] = value
    ckpt["temperature"] = torch.tensor(0.05)
    path = tmp_path / "pretrain.pt"
    torch.save(ckpt, path)

    torch.manual_seed(1)
    target = ClapModel(
        CEDAudioEncoder(CEDConfig(embed_dim=32, depth=2, num_heads=2)),
        load_sonar_encoder(sonar_dir, weights=False),
        16,
    )
    extras = load_mlclap_checkpoint(target, path)
    assert float(extras["temperature"]) == pytest.approx(0.05)
    for key, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0)


def test_projection_heads_are_the_mlclap_shapes(sonar_dir: Path) -> None:
    model = ClapModel(
        CEDAudioEncoder(CEDConfig(embed_dim=32, depth=1, num_heads=2)),
        load_sonar_encoder(sonar_dir),
        24,
    )
    assert [type(m).__name__ for m in model.audio_proj] == ["Linear", "ReLU", "Linear"]
    assert model.audio_proj[0].in_features == 32 and model.audio_proj[2].out_features == 24
    assert model.text_proj[0].in_features == 32 and model.text_proj[2].out_features == 24
    # Real sizes: CED-Base 768 -> 1024 -> 1024 and SONAR 1024 -> 1024 -> 1024.
    from clap_example.model import projection_head

    assert projection_head(768, 1024)[0].weight.shape == (1024, 768)
    assert projection_head(1024, 1024)[2].weight.shape == (1024, 1024)


def test_saved_safetensors_weights_are_read(sonar_dir: Path, tmp_path: Path) -> None:
    """A directory with a full M2M100 model's weights (``model.encoder.*``, ``model.shared``)."""
    import shutil

    enc = load_sonar_encoder(sonar_dir)
    full = tmp_path / "full"
    shutil.copytree(sonar_dir, full)
    (full / "model.safetensors").unlink()
    state = {
        "model.encoder." + k: v.contiguous()
        for k, v in enc.encoder.state_dict().items()
        if k != "embed_tokens.weight"
    }
    state["model.shared.weight"] = enc.encoder.embed_tokens.weight.detach().clone()
    save_file(state, str(full / "model.safetensors"))
    again = load_sonar_encoder(full)
    torch.testing.assert_close(again.encoder.embed_tokens.weight, enc.encoder.embed_tokens.weight)
