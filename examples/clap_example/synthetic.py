"""Offline stand-ins for tests, smoke runs and benchmarks: synthetic captioned audio, a tiny NLLB
tokenizer trained with sentencepiece, and a randomly initialised SONAR-shaped encoder directory.

Nothing here is downloaded. The tokenizer and the encoder directory have the same layout as the
real ported SONAR checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``), so the
trainer loads them with its real loading code.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

#: Sound classes of the synthetic data and their captions in three languages.
SOUNDS: dict[str, dict[str, str]] = {
    "high_tone": {
        "eng_Latn": "a {adj} high beeping tone",
        "fra_Latn": "un bip aigu {adj_fr}",
        "deu_Latn": "ein {adj_de} hoher piepton",
    },
    "low_tone": {
        "eng_Latn": "a {adj} low humming tone",
        "fra_Latn": "un bourdonnement grave {adj_fr}",
        "deu_Latn": "ein {adj_de} tiefes brummen",
    },
    "noise": {
        "eng_Latn": "{adj} white noise hissing",
        "fra_Latn": "un bruit blanc {adj_fr} qui siffle",
        "deu_Latn": "ein {adj_de} weisses rauschen",
    },
    "chirp": {
        "eng_Latn": "a {adj} rising chirp",
        "fra_Latn": "un gazouillis montant {adj_fr}",
        "deu_Latn": "ein {adj_de} steigendes zwitschern",
    },
    "pulses": {
        "eng_Latn": "{adj} rhythmic clicking pulses",
        "fra_Latn": "des impulsions rythmiques {adj_fr}",
        "deu_Latn": "{adj_de} rhythmische klickende impulse",
    },
}
ADJECTIVES = [("loud", "fort", "lauter"), ("soft", "doux", "leiser"), ("short", "bref", "kurzer")]
LANGUAGES3 = ("eng_Latn", "fra_Latn", "deu_Latn")


def synth_sound(
    kind: str, seconds: float, sample_rate: int, rng: np.random.Generator
) -> np.ndarray:
    """A few seconds of one sound class with random pitch/level, float32 in [-1, 1]."""
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    level = rng.uniform(0.2, 0.6)
    if kind == "high_tone":
        wave = np.sin(2 * np.pi * rng.uniform(2500, 3500) * t)
    elif kind == "low_tone":
        wave = np.sin(2 * np.pi * rng.uniform(150, 300) * t)
    elif kind == "noise":
        wave = rng.standard_normal(n) * 0.5
    elif kind == "chirp":
        f0, f1 = rng.uniform(300, 600), rng.uniform(3000, 5000)
        wave = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds)))
    elif kind == "pulses":
        wave = np.zeros(n)
        period = int(sample_rate * rng.uniform(0.08, 0.15))
        for start in range(0, n, period):
            wave[start : start + int(0.004 * sample_rate)] = 1.0
    else:
        raise ValueError(f"unknown sound kind {kind!r}")
    wave = wave + 0.01 * rng.standard_normal(n)
    return (level * wave / max(np.abs(wave).max(), 1e-6)).astype(np.float32)


def caption(kind: str, lang: str, adjective: int) -> str:
    adj, adj_fr, adj_de = ADJECTIVES[adjective]
    return SOUNDS[kind][lang].format(adj=adj, adj_fr=adj_fr, adj_de=adj_de)


def make_dataset(
    directory: str | os.PathLike[str],
    n_train: int = 16,
    n_test: int = 8,
    seconds: Sequence[float] = (2.0, 3.0),
    languages: Sequence[str] = LANGUAGES3,
    seed: int = 0,
    drop_language_every: int = 4,
    test_captions: int = 2,
    n_val: int = 0,
) -> dict[str, Path]:
    """Write wav clips and ``train.csv`` / ``test.jsonl`` (and, with ``n_val``, ``val.jsonl``)
    manifests under ``directory``.

    Training clips use mixed sample rates (16, 22.05, 44.1 kHz) and some are stereo, so loading
    resamples and downmixes. Every ``drop_language_every``-th training clip lacks its last
    language (exercises the KCL mask); English and the second language are always present.
    Test and validation clips have ``test_captions`` captions in every language (validation
    clips are drawn after the test clips, so ``n_val`` leaves the other splits as they were).
    """
    import soundfile as sf

    directory = Path(directory)
    audio_dir = directory / "audio"
    audio_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    kinds = list(SOUNDS)
    rates = (16_000, 22_050, 44_100)
    rows: dict[str, list[dict[str, str]]] = {"train": [], "test": [], "val": []}
    for split, count in (("train", n_train), ("test", n_test), ("val", n_val)):
        for i in range(count):
            kind = kinds[i % len(kinds)]
            sr = rates[i % len(rates)] if split == "train" else 16_000
            length = float(seconds[i % len(seconds)])
            wave = synth_sound(kind, length, sr, rng)
            if split == "train" and i % 3 == 1:
                wave = np.stack([wave, wave * 0.9], axis=1)  # stereo
            audio_id = f"{split}_{i:03d}_{kind}"
            path = audio_dir / f"{audio_id}.wav"
            sf.write(str(path), wave, sr)
            n_caps = 1 if split == "train" else test_captions
            for j, lang in enumerate(languages):
                if (
                    split == "train"
                    and drop_language_every
                    and j == len(languages) - 1
                    and j >= 2
                    and i % drop_language_every == drop_language_every - 1
                ):
                    continue
                for c in range(n_caps):
                    adjective = (
                        int(rng.integers(len(ADJECTIVES))) if c == 0 else (c + i) % len(ADJECTIVES)
                    )
                    rows[split].append(
                        {
                            "audio_path": f"audio/{audio_id}.wav",
                            "audio_id": audio_id,
                            "caption": caption(kind, lang, adjective),
                            "language": lang,
                        }
                    )
    return write_manifests(directory, rows, audio_dir)


def write_manifests(
    directory: Path, rows: dict[str, list[dict[str, str]]], audio_dir: Path
) -> dict[str, Path]:
    """``train.csv``, ``test.jsonl`` and (when it has rows) ``val.jsonl`` from the rows of
    each split."""
    train = directory / "train.csv"
    with train.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["audio_path", "audio_id", "caption", "language"])
        writer.writeheader()
        writer.writerows(rows["train"])
    out = {"train": train, "audio": audio_dir}
    for split in ("test", "val"):
        if split == "val" and not rows.get("val"):
            continue
        out[split] = directory / f"{split}.jsonl"
        with out[split].open("w", encoding="utf-8") as f:
            for row in rows[split]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def corpus(languages: Sequence[str] = LANGUAGES3) -> list[str]:
    """Every caption the synthetic data can produce (the tokenizer's training text)."""
    lines = []
    for kind in SOUNDS:
        for lang in languages:
            for a in range(len(ADJECTIVES)):
                lines.append(caption(kind, lang, a))
    return lines


def train_nllb_tokenizer(
    directory: str | os.PathLike[str], lines: Sequence[str], vocab_size: int = 160
) -> Any:
    """Train a tiny sentencepiece BPE model on ``lines`` and wrap it as an ``NllbTokenizer``.

    The NLLB layout is kept: ``<s> <pad> </s> <unk>`` at ids 0-3, the sentencepiece pieces after
    them, then the 202 NLLB language codes and ``<mask>``. Saved as ``tokenizer.json`` in
    ``directory`` (what the real checkpoints ship), so ``AutoTokenizer`` loads it.
    """
    import sentencepiece as spm
    from transformers import NllbTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(lines) * 20),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab: dict[str, int] = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            continue
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    merges = [
        (piece[:cut], piece[cut:])
        for piece in vocab
        if not piece.startswith("<")
        for cut in range(1, len(piece))
        if piece[:cut] in vocab and piece[cut:] in vocab
    ]
    tokenizer = NllbTokenizer(vocab=vocab, merges=cast(Any, merges))  # (left, right) pairs
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def make_sonar_dir(
    directory: str | os.PathLike[str],
    lines: Sequence[str] | None = None,
    d_model: int = 32,
    layers: int = 2,
    heads: int = 2,
    ffn: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
) -> Path:
    """A SONAR-shaped encoder directory with random weights and a tiny tokenizer."""
    import torch
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100Encoder

    from .sonar import sonar_config

    directory = Path(directory)
    tokenizer = train_nllb_tokenizer(directory, lines or corpus())
    config = sonar_config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        encoder_layers=layers,
        encoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        max_position_embeddings=256,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
    )
    torch.manual_seed(seed)
    encoder = M2M100Encoder(config)
    encoder.save_pretrained(str(directory))
    return directory


def tiny_ced_config(**overrides: Any) -> dict[str, Any]:
    """CED overrides for CPU tests: the architecture of the real models, 2 small blocks."""
    values: dict[str, Any] = {"embed_dim": 32, "depth": 2, "num_heads": 2}
    values.update(overrides)
    return values


def tiny_run_config(data: dict[str, Path], sonar: str | os.PathLike[str]) -> dict[str, Any]:
    """Trainer options of a tiny CPU run on :func:`make_dataset`'s data and the encoder of
    :func:`make_sonar_dir` (one epoch, no progress bars or plots; the validation set when the
    data has one); add ``output_dir``."""
    return {
        "train_manifest": str(data["train"]),
        "val_manifest": str(data["val"]) if "val" in data else None,
        "test_manifest": str(data["test"]),
        "sonar": str(sonar),
        "languages": list(LANGUAGES3),
        "ced_config": tiny_ced_config(),
        "embed_dim": 32,
        "batch_size": 4,
        "eval_batch_size": 8,
        "epochs": 1,
        "lr": 1e-3,
        "max_seconds": 2.0,
        "progress": False,
        "plots": False,
        "seed": 0,
    }


# --- the learnable demo set (``finetune_ced_sonar.py --demo``) ------------------------------

#: What the demo's captions say, per sound: every word names something that can be heard.
DEMO_SOUNDS: dict[str, dict[str, str]] = {
    "high_tone": {
        "eng_Latn": "a {level} high beeping tone",
        "fra_Latn": "un bip aigu {level}",
        "deu_Latn": "ein {level} hoher piepton",
    },
    "low_tone": {
        "eng_Latn": "a {level} low humming tone",
        "fra_Latn": "un bourdonnement grave {level}",
        "deu_Latn": "ein {level} tiefes brummen",
    },
    "noise": {
        "eng_Latn": "{level} white noise hissing",
        "fra_Latn": "un bruit blanc {level} qui siffle",
        "deu_Latn": "ein {level} weisses rauschen",
    },
    "chirp": {
        "eng_Latn": "a {level} rising chirp",
        "fra_Latn": "un gazouillis montant {level}",
        "deu_Latn": "ein {level} steigendes zwitschern",
    },
    "pulses": {
        "eng_Latn": "{level} rhythmic clicking pulses",
        "fra_Latn": "des impulsions rythmiques {level}",
        "deu_Latn": "{level} rhythmische klickende impulse",
    },
}
#: Loud and quiet in the three languages, and the peak level of each.
DEMO_LEVELS: dict[str, dict[str, str]] = {
    "loud": {"eng_Latn": "loud", "fra_Latn": "fort", "deu_Latn": "lauter"},
    "quiet": {"eng_Latn": "quiet", "fra_Latn": "faible", "deu_Latn": "leiser"},
}
DEMO_PEAK = {"loud": (0.6, 0.9), "quiet": (0.02, 0.04)}


def demo_caption(kind: str, level: str, lang: str) -> str:
    return DEMO_SOUNDS[kind][lang].format(level=DEMO_LEVELS[level][lang])


def demo_corpus(languages: Sequence[str] = LANGUAGES3) -> list[str]:
    """Every caption of the demo set (its tokenizer's training text)."""
    return [
        demo_caption(kind, level, lang)
        for kind in DEMO_SOUNDS
        for level in DEMO_LEVELS
        for lang in languages
    ]


def make_demo_dataset(
    directory: str | os.PathLike[str],
    per_class_train: int = 16,
    seconds: float = 1.0,
    seed: int = 0,
) -> dict[str, Path]:
    """A small set a tiny model learns in a minute on CPU: 5 sounds x 2 levels = 10 classes.

    Each training clip has one caption in each of English, French and German that names what
    is heard (the sound and whether it is loud or quiet). The test set has one clip per class
    with its caption in every language, so text-to-audio R@1 is 1.0 for a model that hears
    both the sound and the level, 0.5 for one that hears the sound only, and 0.1 by chance;
    the validation set is built the same way from other draws. Writes 16 kHz mono wav files
    and ``train.csv`` / ``val.jsonl`` / ``test.jsonl`` under ``directory``.
    """
    import soundfile as sf

    directory = Path(directory)
    audio_dir = directory / "audio"
    audio_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sr = 16_000
    classes = [(kind, level) for kind in DEMO_SOUNDS for level in DEMO_LEVELS]
    splits = {"train": per_class_train, "test": 1, "val": 1}  # val last: the others unchanged
    rows: dict[str, list[dict[str, str]]] = {"train": [], "test": [], "val": []}
    for split, per_class in splits.items():
        for i in range(per_class):
            for kind, level in classes:
                wave = synth_sound(kind, seconds, sr, rng)
                low, high = DEMO_PEAK[level]
                wave = wave / max(float(np.abs(wave).max()), 1e-6) * rng.uniform(low, high)
                audio_id = f"{split}_{kind}_{level}_{i:03d}"
                sf.write(str(audio_dir / f"{audio_id}.wav"), wave.astype(np.float32), sr)
                for lang in LANGUAGES3:
                    rows[split].append(
                        {
                            "audio_path": f"audio/{audio_id}.wav",
                            "audio_id": audio_id,
                            "caption": demo_caption(kind, level, lang),
                            "language": lang,
                        }
                    )
    return write_manifests(directory, rows, audio_dir)
