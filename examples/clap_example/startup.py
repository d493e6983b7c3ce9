"""Start-up of a training run: everything that is checked before any folder is created (options,
manifests, batch size, audio, models), then the output directory itself."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .board import summary_writer_class
from .ced import CEDConfig
from .console import progress_bar
from .data import (
    Clip,
    EpochBatchSampler,
    ManifestError,
    TrainDataset,
    check_audio,
    collate,
    eval_captions,
    read_manifest,
    require_language,
    require_other_language,
)
from .durable import TMP_PREFIX
from .model import ClapModel, load_mlclap_checkpoint
from .objective import text_mode
from .run_folder import RunFolder, RunFolderError
from .sonar import load_sonar_encoder
from .sources import HubRepo, locate
from .towers import build_audio_tower, build_e5_tower, check_whisper_source, uses_sonar

#: What a run writes in --output-dir (what --overwrite deletes).
ARTEFACTS = (
    "checkpoints",
    "best",
    "eval",
    "plots",
    "train_log.jsonl",
    "train_log.csv",
    "epoch_log.jsonl",
    "summary.json",
    "config.json",
    "tensorboard",
)
#: The directories among them (each a real directory of the run folder, never a link).
RUN_DIRS = ("checkpoints", "best", "eval", "plots", "tensorboard")


@dataclass
class RunData:
    """The run's clips, batches and step counts (the test set is read at the end)."""

    languages: list[str]
    mode: str
    train_clips: list[Clip]
    val_clips: list[Clip]
    train_set: TrainDataset
    sampler: EpochBatchSampler
    steps_per_epoch: int
    total_steps: int


def read_data(args: argparse.Namespace, rank: int, world: int) -> RunData:
    """Manifests, caption languages and batch sizes checked; nothing is written."""
    languages: list[str] = list(args.languages)
    contain = args.contain_audio_paths
    train_clips = read_manifest(args.train_manifest, languages, args.audio_root, contain=contain)
    mode = text_mode(args)
    if mode == "cacl":
        require_language(
            train_clips, languages[0], "CACL", args.train_manifest,
            fix="leave those clips out, or train them with --loss mlclap or kcl",
        )  # fmt: skip
        require_other_language(train_clips, languages[0], args.train_manifest)
    if mode == "fixed":
        require_language(
            train_clips,
            args.pair_language,
            f"--pair-language {args.pair_language}",
            args.train_manifest,
            fix="--pair-language random draws among each clip's captions",
        )
    val_clips: list[Clip] = []
    if args.val_manifest:
        val_clips = read_eval_manifest(args, args.val_manifest, languages)
    if args.test_manifest and not Path(args.test_manifest).is_file():
        # Only checked by stat: the test set is opened and read after the model is chosen.
        what = "not a regular file" if Path(args.test_manifest).exists() else "no such file"
        raise ManifestError(
            f"--test-manifest {args.test_manifest}: {what} (the test set is read once, at "
            "the end of training)"
        )
    train_set = TrainDataset(train_clips, languages, args.max_seconds, args.seed)
    sampler = EpochBatchSampler(
        len(train_set), args.batch_size, seed=args.seed, rank=rank, world_size=world
    )
    steps_per_epoch = len(sampler.batches())
    if steps_per_epoch == 0:
        raise ValueError(
            f"--batch-size {args.batch_size}: the training set has {len(train_set)} clips, "
            f"fewer than one full batch per process ({world} process(es))"
        )
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    return RunData(
        languages, mode, train_clips, val_clips, train_set, sampler, steps_per_epoch, total_steps
    )


def read_eval_manifest(args: argparse.Namespace, path: str, languages: list[str]) -> list[Clip]:
    """The clips of a validation or test manifest, every clip captioned in every language."""
    clips = read_manifest(path, languages, args.audio_root, contain=args.contain_audio_paths)
    eval_captions(clips, languages, path)  # validated now, not at the first evaluation
    return clips


def check_sources(args: argparse.Namespace, generated: tuple[str, ...] = ()) -> None:
    """The weights' sources, the CED options and --tensorboard, checked in a blink before
    anything is read or written: ``--ced-checkpoint``, ``--sonar`` and ``--mlclap-checkpoint``
    exist locally or are hub repositories asked for (``hf:owner/name``, see ``sources``),
    and so does ``--audio-encoder whisper-base``'s model;
    ``generated`` lists the paths the demo is about to write."""
    if args.tensorboard:
        summary_writer_class()
    for option, value in (
        ("--ced-checkpoint", args.ced_checkpoint),
        ("--sonar", args.sonar),
        ("--mlclap-checkpoint", args.mlclap_checkpoint),
    ):
        if value is None or str(value) in generated:
            continue
        if isinstance(locate(value, option), HubRepo) and option == "--mlclap-checkpoint":
            raise ValueError(f"{option} {value}: expected a local pretrain.pt file")
    try:
        CEDConfig.from_dict({"size": args.ced_size, **args.ced_config})
    except (TypeError, ValueError) as err:
        raise ValueError(f"--ced-config {json.dumps(args.ced_config)}: {err}") from err
    check_whisper_source(args)


def output_dir_problem(out: Path, args: argparse.Namespace, label: str | None = None) -> str | None:
    """Why ``out`` cannot be used as it is (a file; not empty without --resume/--overwrite;
    one of its folders a link, FIFO or device: ``run_folder``'s rule, unless --overwrite
    deletes it); ``label`` names it as the user typed it (default ``--output-dir OUT``)."""
    label = label or f"--output-dir {out}"
    if out.exists() and not out.is_dir():
        return f"{label} is a file, not a directory"
    if out.is_dir() and not args.overwrite:
        try:
            for name in RUN_DIRS:
                RunFolder(out).dir(out / name)
        except RunFolderError as err:
            return f"{label}: {err}"
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        if entries and not args.resume and not args.overwrite:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            return (
                f"{label} is not empty ({shown}): pass --resume auto to "
                "continue the run in it, --overwrite to delete its logs and "
                "checkpoints and start afresh, or choose another --output-dir"
            )
    return None


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Create the folders (after every check passed); --overwrite clears the earlier run's
    files, and a killed run's temporary files go."""
    folder = RunFolder(out)
    if overwrite and out.is_dir():
        for name in ARTEFACTS:
            folder.remove(out / name)  # a link is removed, never followed
    out.mkdir(parents=True, exist_ok=True)
    folder.dir(out / "checkpoints", create=True)
    for directory in (out, out / "checkpoints", out / "best"):
        if folder.dir(directory) is not None:  # temp files of a killed run
            for stale in directory.glob(f"{TMP_PREFIX}*"):
                folder.remove(stale)


def check_clips(
    args: argparse.Namespace, data: RunData | list[Clip], rank: int, world: int
) -> None:
    """Decode every clip once (--check-audio), each rank a share: the training and validation
    clips before training (``data``), the test clips (a list, rank 0) before their evaluation."""
    mode = args.check_audio
    if mode == "off":
        return
    clips = data if isinstance(data, list) else data.train_clips + data.val_clips
    started = time.time()
    problems = check_audio(clips[rank::world], decode=mode == "full", workers=args.workers)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = [p for part in gathered for p in part]
    if problems:
        raise ManifestError(
            f"{len(problems)} unusable audio file(s) (--check-audio {mode}): "
            + "; ".join(problems[:10])
            + ("; ..." if len(problems) > 10 else "")
        )
    if rank == 0:
        print(
            f"[check-audio] {len(clips)} clips {'decoded' if mode == 'full' else 'opened'} "
            f"in {time.time() - started:.1f} s"
        )


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def build_model(args: argparse.Namespace) -> ClapModel:
    audio = build_audio_tower(args)
    if uses_sonar(args):
        text = load_sonar_encoder(
            args.sonar,
            weights=args.sonar_weights,
            max_length=args.text_max_length,
            config_overrides=args.sonar_config,
        )
    else:
        text = build_e5_tower(args)
    model = ClapModel(audio, text, args.embed_dim)  # type: ignore[arg-type]
    if args.mlclap_checkpoint:
        load_mlclap_checkpoint(model, args.mlclap_checkpoint)
    return model


def lr_factor(args: argparse.Namespace, steps_per_epoch: int, total_steps: int, step: int) -> float:
    """The learning rate of ``step`` as a share of --lr."""
    if args.warmup_steps and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.schedule == "constant":
        return 1.0
    if args.schedule == "step":
        return float(args.step_gamma ** ((step // steps_per_epoch) // args.step_epochs))
    span = max(total_steps - args.warmup_steps, 1)
    progress = min(max(step - args.warmup_steps, 0) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine


def build_optimizer(
    args: argparse.Namespace,
    params: list[torch.nn.Parameter],
    factor: Any,
    device: torch.device,
    amp: torch.dtype | None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, torch.amp.GradScaler]:
    """--optimizer with the schedule ``factor(step)`` and the fp16 grad scaler."""
    opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    optimizer = opt_cls(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    return optimizer, scheduler, scaler


def epoch_loader(
    args: argparse.Namespace,
    train_set: TrainDataset,
    sampler: EpochBatchSampler,
    steps_per_epoch: int,
    epoch: int,
    batch_in_epoch: int,
    device: torch.device,
    is_main: bool,
) -> tuple[DataLoader, Any]:
    """The loader of ``epoch``'s remaining batches and its progress bar."""
    train_set.set_epoch(epoch)
    sampler.set_epoch(epoch, batch_in_epoch)
    loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        # The loader draws its workers' base seed from this generator, not from the
        # global RNG: creating the iterator after a resume must not shift dropout.
        generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch),
    )
    bar = progress_bar(
        steps_per_epoch, batch_in_epoch, f"epoch {epoch + 1}/{args.epochs}",
        enabled=is_main and bool(args.progress),
    )  # fmt: skip
    return loader, bar
