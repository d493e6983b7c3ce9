"""Command line and config file (JSON, or YAML when PyYAML is installed) of the trainer.

Every option can be given in the config file under its long name (dashes or underscores) and on
the command line; the command line wins. Unknown config keys are an error.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import descriptors, safe_json
from .sonar import PAPER_LANGUAGES, canonical_language
from .towers import (
    add_real_data_args,
    apply_tower_defaults,
    tower_default_text,
    uses_sonar,
    validate_towers,
)

LOSSES = ("infonce", "siglip", "mlclap", "kcl", "infonce_all", "cacl", "ask")
#: Where the docs say to start (docs "Which loss should I use?"): ML-CLAP's random-language
#: InfoNCE; no other loss beat it beyond seed noise on real recordings.
DEFAULT_LOSS = "mlclap"
SVR_MODES = ("none", "static", "dynamic")
CHECK_AUDIO = ("full", "header", "off")
REQUIRED = ("train_manifest", "sonar", "output_dir")
#: What a missing required option is, and the other way to do without it.
REQUIRED_HINTS = {
    "train_manifest": "--train-manifest FILE (CSV/JSONL: audio_path,audio_id,caption,language)",
    "sonar": "--sonar DIR (the SONAR text encoder; or --text-encoder e5, the CPU text tower "
    "that needs no SONAR)",
    "output_dir": "--output-dir DIR (where the run writes)",
}


def _languages(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    langs = [canonical_language(str(v)) for v in items if str(v).strip()]
    if not langs:
        raise argparse.ArgumentTypeError("languages: empty list")
    if len(set(langs)) != len(langs):
        raise argparse.ArgumentTypeError(f"languages: duplicates in {langs}")
    return langs


def _json_dict(value: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        out = safe_json.loads(value, "the value")
    except ValueError as err:
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {shown!r}: {err}") from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return out


def _bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def _add_flag(group: Any, name: str, default: bool, help: str) -> None:
    """A boolean option: ``--x`` alone means true; ``--x false`` (or the config file) sets it."""
    group.add_argument(name, type=_bool, nargs="?", const=True, default=default, help=help)


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Errors are one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="finetune_ced_sonar.py",
        description="Fine-tune CED (audio) + SONAR (text) with a contrastive_losses loss.",
        formatter_class=_DefaultsOnce,
    )
    p.add_argument("--config", help="JSON (or YAML) file with any of the options below")
    _add_flag(
        p,
        "--demo",
        False,
        "generate a small learnable synthetic set and tiny towers under --output-dir and train "
        "on them (about 120 CPU-seconds); other options override the demo's",
    )

    _add_data_args(p)
    _add_tower_and_loss_args(p)
    _add_optimisation_args(p)
    _add_output_args(p)
    return p


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The "data" group: manifests, languages, crops, the audio check."""
    g = p.add_argument_group("data")
    g.add_argument("--train-manifest", help="CSV/JSONL: audio_path,audio_id,caption,language")
    g.add_argument(
        "--val-manifest",
        help="validation set: evaluated with retrieval_report after every epoch; chooses best/ "
        "(--select-metric). Without it nothing is evaluated during training and no best/ is kept",
    )
    g.add_argument(
        "--test-manifest",
        help="evaluated once, at the end, on the chosen model (best/ with --val-manifest, else "
        "the last epoch's weights); not read before the training ends",
    )
    g.add_argument("--audio-root", help="base of relative audio paths (default: manifest's dir)")
    g.add_argument(
        "--languages",
        type=_languages,
        default=list(PAPER_LANGUAGES),
        help="comma-separated NLLB codes, English first; K = their number",
    )
    g.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help=f"random training crop length (default: {tower_default_text('max_seconds')})",
    )
    g.add_argument(
        "--eval-max-seconds",
        type=float,
        default=None,
        help="crop validation and test clips (default: whole clips, chunked by the encoder)",
    )
    g.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    g.add_argument(
        "--check-audio",
        default="full",
        choices=CHECK_AUDIO,
        help="decode every training and validation clip before training (test clips: before "
        "the final evaluation) and stop on unreadable, truncated or non-finite audio, naming "
        "the manifest line (header: open the files only; off: skip)",
    )
    _add_flag(
        g,
        "--contain-audio-paths",
        False,
        "every audio path must resolve (symlinks followed) inside --audio-root "
        "(or the manifest's directory)",
    )


def _add_tower_and_loss_args(p: argparse.ArgumentParser) -> None:
    """The "models" group (the towers and their weights), then the "loss" group
    (:func:`_add_loss_args`)."""
    g = p.add_argument_group("models")
    g.add_argument(
        "--ced-size", default="base", choices=("tiny", "mini", "small", "base"), help="CED width"
    )
    g.add_argument(
        "--ced-config",
        type=_json_dict,
        default={},
        help="CEDConfig overrides as JSON, e.g. '{\"depth\": 2}'",
    )
    g.add_argument(
        "--ced-checkpoint",
        help="HF CED weights: model.safetensors or its directory (a local path), or a hub "
        "repository written hf:mispeech/ced-base",
    )
    g.add_argument(
        "--sonar",
        help="directory with the SONAR encoder's config.json, weights and NLLB tokenizer, or a "
        "hub repository written hf:cointegrated/SONAR_200_text_encoder",
    )
    _add_flag(g, "--sonar-weights", True, "false: random init from the directory's config (tests)")
    g.add_argument(
        "--sonar-config", type=_json_dict, default={}, help="M2M100Config overrides as JSON"
    )
    g.add_argument("--text-max-length", type=int, default=128, help="caption tokens kept")
    g.add_argument(
        "--embed-dim",
        type=int,
        default=None,
        help=f"projection output size (default: {tower_default_text('embed_dim')})",
    )
    g.add_argument(
        "--mlclap-checkpoint", help="ML-CLAP pretrain.pt: initialises both towers and heads"
    )

    add_real_data_args(p)
    _add_loss_args(p)


def _add_loss_args(p: argparse.ArgumentParser) -> None:
    """The "loss" group: --loss, SVR, temperature, tiling, KCL, ASK and GradCache options."""
    g = p.add_argument_group("loss")
    g.add_argument(
        "--loss",
        default=DEFAULT_LOSS,
        choices=LOSSES,
        help="mlclap: InfoNCE on one random language per clip (the ML-CLAP baseline, where the "
        "docs' 'Which loss should I use?' says to start); kcl: ATRI's 1-to-K loss over all K "
        "captions; infonce_all: InfoNCE over all K captions as extra pairs (KCL's "
        "compute-matched control, the studies' pairs_all); infonce/siglip/ask: the "
        "--pair-language caption; cacl: English + one other (see examples/README.md)",
    )
    g.add_argument("--svr", default="none", choices=SVR_MODES, help="support vector regularisation")
    g.add_argument(
        "--svr-direction", default="bi", choices=("uni", "bi"), help="SVR: text->audio or both"
    )
    g.add_argument("--svr-alpha", type=float, default=1.0, help="SVR term weight")
    g.add_argument(
        "--svr-beta",
        type=float,
        default=None,
        help="SVR radius penalty weight (default: the library's, 1.0; SupCLAP's 0.01 lets the "
        "dynamic radius run above ||a - t||: docs/methods/svr.rst, 'Why beta = 1')",
    )
    g.add_argument(
        "--svr-radius-init", type=float, default=None, help="initial radius (None: the loss's)"
    )
    g.add_argument("--temperature", type=float, default=0.07, help="softmax temperature")
    g.add_argument(
        "--loss-chunk-size",
        type=int,
        default=None,
        help="tile the loss's B x B logits in column blocks of this size (exact, memory "
        "O(B x chunk); see docs 'Large batches'); not for ask",
    )
    _add_flag(g, "--learnable-temperature", False, "infonce/mlclap: learn the temperature")
    g.add_argument(
        "--kcl-negatives",
        default="per_language",
        choices=("per_language", "all_languages"),
        help="KCL: negatives from the same language or from all",
    )
    g.add_argument(
        "--pair-language",
        default="eng_Latn",
        help="infonce/siglip/ask: caption language per clip, an NLLB code or 'random' "
        "(mlclap is always 'random')",
    )
    g.add_argument("--ask-k", type=int, default=10, help="ASK: neighbours retrieved")
    g.add_argument("--ask-prototypes", type=int, default=512, help="ASK: bank prototypes")
    g.add_argument(
        "--ask-k-coarse", type=int, default=10, help="ASK: prototypes retrieved per sample"
    )
    g.add_argument(
        "--ask-refresh-every", type=int, default=15, help="epochs between bank refreshes"
    )
    g.add_argument(
        "--ask-injection-ratio", type=float, default=0.2, help="ASK: knowledge injection ratio"
    )
    g.add_argument(
        "--ask-backend",
        default="auto",
        choices=("auto", "faiss", "torch"),
        help="ASK: kNN search backend",
    )
    _add_flag(
        g,
        "--grad-cache",
        False,
        "GradCache both towers (contrastive_losses.GradCache: the encoders' activations of "
        "one chunk, not of the batch; KCL's K*B captions in the memory of B)",
    )
    g.add_argument(
        "--grad-cache-chunk",
        type=int,
        default=None,
        help="clips and captions per chunk (default: batch size); batch-norm layers see "
        "each chunk's statistics",
    )


def _add_optimisation_args(p: argparse.ArgumentParser) -> None:
    """The "optimisation" group: length, batch, optimizer, schedule, precision, seed."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    g.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps in total"
    )
    g.add_argument("--batch-size", type=int, default=24, help="per process")
    g.add_argument("--eval-batch-size", type=int, default=32, help="clips/captions per forward")
    g.add_argument("--optimizer", default="adam", choices=("adam", "adamw"), help="optimizer")
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate (default: {tower_default_text('lr')})",
    )
    g.add_argument("--weight-decay", type=float, default=0.0, help="optimizer weight decay")
    g.add_argument(
        "--schedule",
        default="cosine",
        choices=("cosine", "step", "constant"),
        help="learning-rate schedule",
    )
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    g.add_argument(
        "--min-lr-ratio", type=float, default=0.0, help="cosine floor, as a share of --lr"
    )
    g.add_argument("--step-epochs", type=int, default=3, help="step schedule: decay every N epochs")
    g.add_argument("--step-gamma", type=float, default=0.1, help="step schedule: decay factor")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    g.add_argument(
        "--amp",
        default="auto",
        choices=("auto", "bf16", "fp16", "none"),
        help="auto: bf16 on CUDA, none on CPU",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of every random stream")
    g.add_argument(
        "--max-nonfinite-steps",
        type=int,
        default=5,
        help="a step whose loss or gradient is NaN/Inf is skipped (no update); this many in a "
        "row stop the run with an error",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """The "output" group: where the run writes, resume, checkpoints, reporting."""
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", help="logs, checkpoints and plots go here")
    g.add_argument(
        "--resume", help="checkpoint directory, or 'auto' for the latest in --output-dir"
    )
    _add_flag(
        g,
        "--overwrite",
        False,
        "start afresh in a non-empty --output-dir, deleting the earlier run's logs and "
        "checkpoints (without it, or --resume, a non-empty directory is an error)",
    )
    g.add_argument("--save-every-steps", type=int, default=0, help="also checkpoint every N steps")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="step checkpoints kept")
    g.add_argument(
        "--select-metric",
        default="mean_r1",
        help="what chooses best/ on --val-manifest: 'mean_r1' (mean R@1 over languages and "
        "directions) or a flattened retrieval_report key",
    )
    _add_flag(
        g,
        "--allow-config-change",
        False,
        "resume although options that change the training differ from the checkpoint's "
        "(each is named, with its consequence)",
    )
    _add_flag(g, "--debug", False, "errors show their traceback")
    _add_flag(g, "--progress", True, "tqdm progress bars")
    _add_flag(g, "--plots", True, "PNG curves at the end: plots/summary.png and detailed plots")
    _add_flag(
        g,
        "--tensorboard",
        False,
        "also write the logged scalars as TensorBoard events in --output-dir/tensorboard "
        "(needs the tensorboard package, in the examples extra)",
    )


#: Largest --config file read (bytes): a config holds a few dozen options.
MAX_CONFIG_BYTES = 1 << 24


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:  # one descriptor, checked by fstat: a FIFO named here is an error, not a hang
        fd = descriptors.open_regular(path, "--config")
    except FileNotFoundError:
        raise FileNotFoundError(f"--config: {path} does not exist") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"--config {path}: {size} bytes, more than a config file holds")
        try:
            raw = f.read(size + 1)  # one byte past fstat's size: a file still growing shows
        except OSError as err:
            raise OSError(
                err.errno, f"--config {path}: cannot be read ({err.strerror or err})"
            ) from None
    if len(raw) != size:  # YAML and JSON alike: never parsed cut short or half written
        raise ValueError(
            f"--config {path}: changed while it was read ({size} bytes at open, "
            f"{'more' if len(raw) > size else len(raw)} read); write it whole, then start the run"
        )
    text = raw.decode("utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as err:
            raise ImportError(
                f"--config {path}: YAML needs PyYAML (pip install pyyaml), or use JSON"
            ) from err
        try:
            data = yaml.safe_load(text)
        except RecursionError:
            raise ValueError(f"--config {path}: nested too deeply to read") from None
        if safe_json.depth(data) > safe_json.MAX_DEPTH:
            raise ValueError(f"--config {path}: nested more than {safe_json.MAX_DEPTH} deep")
    else:
        data = safe_json.loads(text, f"--config {path}")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option -> value")
    return data


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.demo:
        from .demo import demo_defaults

        if first.output_dir is None:
            parser.error("--demo needs --output-dir (the demo's data, models and run go there)")
        parser.set_defaults(**demo_defaults(first.output_dir))
    if first.config:
        values = load_config_file(first.config)
        dests = {a.dest: a for a in parser._actions}
        defaults: dict[str, Any] = {}
        for key, value in values.items():
            dest = key.replace("-", "_")
            if dest not in dests or dest in ("help", "config"):
                raise ValueError(f"--config {first.config}: unknown option {key!r}")
            action = dests[dest]
            if (
                action.type is not None
                and value is not None
                and not isinstance(value, (bool, dict))
            ):
                value = action.type(value)  # type: ignore[operator]
            elif action.type is _bool and isinstance(value, bool):
                pass
            if action.choices is not None and value not in action.choices:
                raise ValueError(
                    f"--config {first.config}: {key} = {value!r}, expected one of "
                    f"{list(action.choices)}"
                )
            defaults[dest] = value
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    needed = [name for name in REQUIRED if name != "sonar" or uses_sonar(args)]
    missing = [REQUIRED_HINTS[name] for name in needed if getattr(args, name) is None]
    if missing:
        parser.error(f"missing required option(s): {'; '.join(missing)} (command line or --config)")
    apply_tower_defaults(args)
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    """Cross-option checks, with messages that say what to change."""
    validate_towers(args)
    if args.loss == "ask" and args.svr != "none":
        raise ValueError("--svr: SVR wraps infonce/siglip/mlclap/kcl/cacl, not ask")
    if args.loss == "cacl" and args.languages[0] != "eng_Latn":
        raise ValueError(
            f"--languages: CACL anchors on English, list eng_Latn first (got {args.languages})"
        )
    if args.loss == "cacl" and len(args.languages) < 2:
        raise ValueError("--languages: CACL needs English and at least one other language")
    if args.pair_language != "random":
        args.pair_language = canonical_language(args.pair_language)
        if args.pair_language not in args.languages:
            raise ValueError(
                f"--pair-language: {args.pair_language} is not in --languages {args.languages}"
            )
    validate_manifests(args)
    if args.batch_size < 2:
        raise ValueError(
            f"--batch-size: a contrastive batch needs >= 2 clips, got {args.batch_size}"
        )
    for name in ("epochs", "eval_batch_size", "text_max_length", "embed_dim"):
        if getattr(args, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}"
            )
    if args.max_nonfinite_steps < 1:
        raise ValueError(f"--max-nonfinite-steps: expected >= 1, got {args.max_nonfinite_steps}")
    if args.resume and args.overwrite:
        raise ValueError("--overwrite and --resume exclude each other: keep one")
    if args.loss_chunk_size is not None and args.loss_chunk_size < 1:
        raise ValueError(f"--loss-chunk-size: expected >= 1, got {args.loss_chunk_size}")
    if args.loss_chunk_size is not None and args.loss == "ask":
        raise ValueError("--loss-chunk-size: tiles infonce/siglip/mlclap/kcl/cacl, not ask")
    if args.grad_cache_chunk is not None and args.grad_cache_chunk < 1:
        raise ValueError(f"--grad-cache-chunk: expected >= 1, got {args.grad_cache_chunk}")


def validate_manifests(args: argparse.Namespace) -> None:
    """--val-manifest and --test-manifest are two files with different contents: choosing best/
    on the set that reports the final numbers is what the split avoids. Compared by path, then,
    for two regular files of the same size, byte by byte (the test set is read for nothing
    else before the training ends)."""
    val, test = args.val_manifest, args.test_manifest
    if not (val and test):
        return
    if os.path.realpath(val) == os.path.realpath(test):
        same = "are the same file"
    elif _same_bytes(val, test):
        same = "hold the same bytes"
    else:
        return
    raise ValueError(
        f"--val-manifest {val} and --test-manifest {test} {same}: best/ would "
        "be chosen on the test set; give a validation split (the Tux Paint builder writes "
        "galleries/val_*.jsonl) or split one off the training manifest"
    )


def _same_bytes(first: str, second: str) -> bool:
    """Whether two regular files of the same size hold the same bytes; anything else (a
    missing or special file) is ``False`` and left to the manifest checks that name it."""
    try:
        a, b = os.stat(first), os.stat(second)
        if not (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode)) or a.st_size != b.st_size:
            return False
        with (
            os.fdopen(descriptors.open_regular(first, "--val-manifest"), "rb") as x,
            os.fdopen(descriptors.open_regular(second, "--test-manifest"), "rb") as y,
        ):
            while True:
                chunk = x.read(1 << 20)
                if chunk != y.read(1 << 20):
                    return False
                if not chunk:
                    return True
    except (OSError, ValueError):
        return False
