"""The training loop: DDP, AMP, GradCache, logging, evaluation, checkpoints and exact resume."""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import io
import json
import math
import os
import pickle
import random
import resource
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .ced import CEDAudioEncoder, CEDConfig, load_ced_checkpoint
from .config import parse_args
from .data import (
    AudioOnlyDataset,
    Clip,
    EpochBatchSampler,
    ManifestError,
    TrainDataset,
    check_audio,
    collate,
    eval_captions,
    pick,
    read_manifest,
    require_language,
    require_other_language,
)
from .durable import (
    TMP_PREFIX,
    append_line,
    atomic_torch_save,
    atomic_write_text,
    fsync_dir,
    fsync_file,
    read_jsonl,
    remove_tree,
    warn,
    write_lines,
)
from .gradcache import backward_chunks, embed_without_grad, split_chunks
from .model import ClapModel, load_mlclap_checkpoint
from .sonar import load_sonar_encoder

# ---------------------------------------------------------------------------------------------
# Loss construction
# ---------------------------------------------------------------------------------------------


def build_loss(args: argparse.Namespace) -> nn.Module:
    """Map ``--loss``/``--svr`` to ``contrastive_losses`` objects (DESIGN.md section 2).

    ``mlclap`` is the ML-CLAP baseline: InfoNCE on one randomly drawn language per clip (the
    drawing happens in :func:`select_texts`). ``ask`` builds an empty :class:`KnowledgeBank`
    that the trainer fills from the training set before the first epoch.
    """
    import contrastive_losses as cl

    if args.loss == "ask":
        if args.svr != "none":
            raise ValueError("--svr: SVR wraps infonce/siglip/mlclap/kcl/cacl, not ask")
        bank = cl.KnowledgeBank(
            args.embed_dim,
            backend=args.ask_backend,
            num_prototypes=args.ask_prototypes,
            refresh_every=args.ask_refresh_every,
        )
        return cl.ASKLoss(
            bank,
            k=args.ask_k,
            k_coarse=args.ask_k_coarse,
            injection_ratio=args.ask_injection_ratio,
            temperature=args.temperature,
        )
    base: nn.Module
    if args.loss in ("infonce", "mlclap"):
        base = cl.InfoNCELoss(
            temperature=args.temperature, learnable_temperature=args.learnable_temperature
        )
    elif args.loss == "siglip":
        base = cl.SigLIPLoss()
    elif args.loss == "kcl":
        base = cl.KCLLoss(temperature=args.temperature, negatives=args.kcl_negatives)
    elif args.loss == "cacl":
        base = cl.CACLLoss(temperature=args.temperature)
    else:
        raise ValueError(f"--loss: unknown {args.loss!r}")
    if args.svr == "none":
        return base
    kwargs: dict[str, Any] = {
        "base": base,
        "radius": args.svr,
        "direction": args.svr_direction,
        "alpha": args.svr_alpha,
        "beta": args.svr_beta,
    }
    if args.svr_radius_init is not None:
        kwargs["radius_init"] = args.svr_radius_init
    return cl.SupportVectorRegularizer(**kwargs)


def text_mode(args: argparse.Namespace) -> str:
    """Which captions a step encodes: ``all`` (KCL), ``cacl``, ``random`` or ``fixed``."""
    if args.loss == "kcl":
        return "all"
    if args.loss == "cacl":
        return "cacl"
    if args.loss == "mlclap" or args.pair_language == "random":
        return "random"
    return "fixed"


Arranged = tuple[tuple[Tensor, ...], dict[str, Tensor]]


def select_texts(
    batch: dict[str, Any],
    mode: str,
    languages: Sequence[str],
    generator: torch.Generator,
    fixed_column: int = 0,
    with_ids: bool = False,
) -> tuple[list[str], list[str], Callable[[Tensor, Tensor], Arranged]]:
    """Choose the captions to encode and return how to arrange the embeddings for the loss.

    Returns ``(texts, their languages, arrange)`` where ``arrange(audio (B, E), text (M, E))``
    gives the positional and keyword arguments of the loss's ``forward``. ``with_ids`` (ASK)
    appends the clips' dataset indices, so a sample never retrieves itself from the bank.
    """
    captions = batch["captions"]
    mask: Tensor = batch["mask"]
    b, k = mask.shape
    if mode == "all":
        rows, cols = mask.nonzero(as_tuple=True)  # row-major: the order masked_scatter fills
        texts = [captions[r][c] for r, c in zip(rows.tolist(), cols.tolist(), strict=True)]
        langs = [languages[c] for c in cols.tolist()]

        def arrange_all(audio: Tensor, text: Tensor) -> Arranged:
            # Missing captions get a constant filler: finite and non-zero, and masked out.
            full = text.new_ones(b, k, text.shape[-1])
            full = full.masked_scatter(mask.to(text.device).unsqueeze(-1), text)
            return (audio, full), {"mask": mask.to(text.device)}

        return texts, langs, arrange_all
    if mode == "cacl":
        import contrastive_losses as cl

        other = cl.sample_languages(mask, generator=generator)  # (B,) index among languages
        english = pick(captions, torch.zeros(b, dtype=torch.long))
        others = pick(captions, other)
        texts = english + others
        langs = [languages[0]] * b + [languages[i] for i in other.tolist()]

        def arrange_cacl(audio: Tensor, text: Tensor) -> Arranged:
            return (audio, text[:b], text[b:]), {}

        return texts, langs, arrange_cacl
    if mode == "random":
        import contrastive_losses as cl

        column = cl.sample_languages(mask, generator=generator, include_english=True)
    else:
        column = torch.full((b,), fixed_column, dtype=torch.long)
    texts = pick(captions, column)
    langs = [languages[i] for i in column.tolist()]
    ids: Tensor = batch["index"]

    def arrange_pair(audio: Tensor, text: Tensor) -> Arranged:
        return (audio, text), {}

    def arrange_ask(audio: Tensor, text: Tensor) -> Arranged:
        return (audio, text, ids.to(audio.device)), {}

    return texts, langs, arrange_ask if with_ids else arrange_pair


# ---------------------------------------------------------------------------------------------
# Distributed helpers
# ---------------------------------------------------------------------------------------------


def init_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_arg in ("auto", "cuda")
    if device_arg not in ("auto", "cuda"):
        device = torch.device(device_arg)
    elif use_cuda:
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # Rank 0 evaluates alone while the others wait: allow a long evaluation.
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2)
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world, device


def allreduce_gradients(
    params: Sequence[nn.Parameter], world: int, bucket_mb: float = 25.0
) -> None:
    """Average gradients across ranks in flat buckets (used with GradCache instead of DDP hooks)."""
    if world == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    limit = int(bucket_mb * 2**20)
    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= limit:
            flush()
            size = 0
    flush()


def broadcast_module(module: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (what DDP's constructor does)."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


# ---------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------


def to_float(value: Any) -> float | None:
    if isinstance(value, Tensor):
        if value.numel() == 0:
            return None
        return float(value.detach().float().mean())
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        return float(value)
    return None


def flatten_metrics(obj: Any, prefix: str = "") -> dict[str, float]:
    """Nested dicts/lists of numbers -> ``{"a/b/c": float}``; non-numbers are dropped."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten_metrics(value, f"{prefix}{key}/"))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(flatten_metrics(value, f"{prefix}{i}/"))
    else:
        value = to_float(obj)
        if value is not None and math.isfinite(value):
            out[prefix.rstrip("/")] = value
    return out


class StepLog:
    """Per-step JSONL + CSV, one appended line per step. On resume the rows after the
    checkpoint's step are dropped and both files are rewritten at once (temp file + replace):
    a kill at any moment leaves the old log or the new one."""

    def __init__(self, directory: Path, name: str, resume_step: int | None) -> None:
        self.jsonl = directory / f"{name}.jsonl"
        self.csv = directory / f"{name}.csv"
        self.columns: list[str] | None = None
        if resume_step is None:
            for path in (self.jsonl, self.csv):
                path.unlink(missing_ok=True)
            return
        kept: dict[int, dict[str, Any]] = {}
        for row in read_jsonl(self.jsonl):
            step = int(row.get("step", 0))
            if step <= resume_step:
                kept[step] = row  # a repeated step (an older trainer's log): the last one wins
        rows = [kept[step] for step in sorted(kept)]
        if len(rows) != resume_step and self.jsonl.is_file():
            warn(f"{self.jsonl}: {resume_step - len(rows)} of steps 1-{resume_step} missing")
        write_lines(self.jsonl, [json.dumps(row) + "\n" for row in rows])
        if rows:
            self.columns = list(rows[0])
            write_lines(self.csv, [self._csv_line(None)] + [self._csv_line(r) for r in rows])
        else:
            self.csv.unlink(missing_ok=True)

    def _csv_line(self, row: dict[str, Any] | None) -> str:
        assert self.columns is not None
        buffer = io.StringIO()
        values = self.columns if row is None else [row.get(c, "") for c in self.columns]
        csv.writer(buffer).writerow(values)
        return buffer.getvalue()

    def write(self, row: dict[str, Any]) -> None:
        append_line(self.jsonl, json.dumps(row) + "\n")
        if self.columns is None:
            self.columns = list(row)
            write_lines(self.csv, [self._csv_line(None)])
        append_line(self.csv, self._csv_line(row))

    def sync(self) -> None:
        """fsync both files (before a checkpoint that counts their rows is published)."""
        fsync_file(self.jsonl)
        fsync_file(self.csv)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (each epoch); CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------


class Trainer:
    """Holds the run's state; :meth:`fit` trains, evaluates and checkpoints."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str] | None = None) -> None:
        self.args = args
        self.argv = argv  # the command line, for the resume command printed on a signal
        self.rank, self.world, self.device = init_distributed(args.device)
        self.is_main = self.rank == 0
        self.out = Path(args.output_dir)
        self._prepare_output_dir()
        self.amp_dtype = self._amp_dtype()

        # Data first: manifest errors should come before minutes of model loading.
        self.languages: list[str] = list(args.languages)
        contain = args.contain_audio_paths
        self.train_clips = read_manifest(
            args.train_manifest, self.languages, args.audio_root, contain=contain
        )
        self.mode = text_mode(args)
        if self.mode == "cacl":
            require_language(self.train_clips, self.languages[0], "CACL", args.train_manifest)
            require_other_language(self.train_clips, self.languages[0], args.train_manifest)
        if self.mode == "fixed":
            require_language(
                self.train_clips,
                args.pair_language,
                f"--pair-language {args.pair_language}",
                args.train_manifest,
            )
        self.test_clips: list[Clip] = []
        if args.test_manifest:
            self.test_clips = read_manifest(
                args.test_manifest, self.languages, args.audio_root, contain=contain
            )
            eval_captions(self.test_clips, self.languages, args.test_manifest)  # validate early
        self._check_audio()
        self.train_set = TrainDataset(self.train_clips, self.languages, args.max_seconds, args.seed)
        self.sampler = EpochBatchSampler(
            len(self.train_set),
            args.batch_size,
            seed=args.seed,
            rank=self.rank,
            world_size=self.world,
        )
        self.steps_per_epoch = len(self.sampler.batches())
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"--batch-size {args.batch_size}: the training set has "
                f"{len(self.train_set)} clips, "
                f"fewer than one full batch per process ({self.world} process(es))"
            )
        self.total_steps = args.epochs * self.steps_per_epoch
        if args.max_steps is not None:
            self.total_steps = min(self.total_steps, args.max_steps)

        # Model and loss: same init on every rank, then per-rank RNG streams (dropout).
        torch.manual_seed(args.seed)
        self.model = self._build_model().to(self.device)
        self.loss_fn = build_loss(args).to(self.device)
        self.ask = args.loss == "ask"
        self.grad_cache = bool(args.grad_cache)
        self.trainable = _Trainable(self.model, self.loss_fn, self.amp_dtype, self.device)
        self.ddp: DistributedDataParallel | None = None
        if self.world > 1 and not self.grad_cache:
            self.ddp = DistributedDataParallel(
                self.trainable,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
            )
        elif self.world > 1:
            broadcast_module(self.trainable)
        self.params = [p for p in self.trainable.parameters() if p.requires_grad]
        opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
        self.optimizer = opt_cls(self.params, lr=args.lr, weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=self.amp_dtype == torch.float16
        )
        seed = args.seed * 1000 + self.rank
        random.seed(seed)
        torch.manual_seed(seed)
        self.lang_gen = torch.Generator().manual_seed(seed + 17)

        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best: float | None = None
        self.history: list[dict[str, Any]] = []
        self.bank_epoch: int | None = None
        self.epoch_losses: list[float] = []  # finite losses since the last epoch row
        self.epoch_elapsed = 0.0  # training seconds of the current epoch
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0
        self.stop_signal: int | None = None
        resume_step = self._maybe_resume()
        self.log = StepLog(self.out, "train_log", resume_step) if self.is_main else None
        if self.is_main:
            # The epoch rows are the checkpoint's history: rows written after it (a kill
            # before the next checkpoint) are dropped, not duplicated.
            epoch_log = self.out / "epoch_log.jsonl"
            if resume_step is None:
                epoch_log.unlink(missing_ok=True)
            else:
                write_lines(epoch_log, [json.dumps(h) + "\n" for h in self.history])
            config = {k: v for k, v in vars(args).items()}
            atomic_write_text(self.out / "config.json", json.dumps(config, indent=2, default=str))

    # --- output directory and input checks ------------------------------------------------

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
    )

    def _from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (so every rank raises the same error)."""
        if self.world == 1:
            return value
        shared = [value]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def _prepare_output_dir(self) -> None:
        """Refuse a non-empty --output-dir unless --resume or --overwrite; clear leftovers."""
        args = self.args
        problem = None
        if self.is_main:
            out = self.out
            if out.exists() and not out.is_dir():
                problem = f"--output-dir {out} is a file, not a directory"
            elif out.is_dir():
                entries = sorted(p.name for p in out.iterdir())
                if entries and not args.resume and not args.overwrite:
                    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                    problem = (
                        f"--output-dir {out} is not empty ({shown}): pass --resume auto to "
                        "continue the run in it, --overwrite to delete its logs and "
                        "checkpoints and start afresh, or choose another --output-dir"
                    )
                elif entries and args.overwrite:
                    for name in self.ARTEFACTS:
                        remove_tree(out / name)
            if problem is None:
                (out / "checkpoints").mkdir(parents=True, exist_ok=True)
                for folder in (out, out / "checkpoints", out / "best"):
                    if folder.is_dir():  # temp files of a killed run
                        for stale in folder.glob(f"{TMP_PREFIX}*"):
                            remove_tree(stale)
        problem = self._from_main(problem)
        if problem:
            raise FileExistsError(problem)

    def _check_audio(self) -> None:
        """Decode every clip once before training (--check-audio), each rank a share."""
        mode = self.args.check_audio
        if mode == "off":
            return
        clips = self.train_clips + self.test_clips
        started = time.time()
        problems = check_audio(
            clips[self.rank :: self.world], decode=mode == "full", workers=self.args.workers
        )
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, problems)
            problems = [p for part in gathered for p in part]
        if problems:
            raise ManifestError(
                f"{len(problems)} unusable audio file(s) (--check-audio {mode}): "
                + "; ".join(problems[:10])
                + ("; ..." if len(problems) > 10 else "")
            )
        if self.is_main:
            print(
                f"[check-audio] {len(clips)} clips {'decoded' if mode == 'full' else 'opened'} "
                f"in {time.time() - started:.1f} s"
            )

    # --- construction ---------------------------------------------------------------------

    def _amp_dtype(self) -> torch.dtype | None:
        amp = self.args.amp
        if amp == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else None
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]

    def _build_model(self) -> ClapModel:
        args = self.args
        ced_config = CEDConfig.from_dict({"size": args.ced_size, **args.ced_config})
        audio = CEDAudioEncoder(ced_config)
        if args.ced_checkpoint:
            load_ced_checkpoint(audio, args.ced_checkpoint)
        text = load_sonar_encoder(
            args.sonar,
            weights=args.sonar_weights,
            max_length=args.text_max_length,
            config_overrides=args.sonar_config,
        )
        model = ClapModel(audio, text, args.embed_dim)
        if args.mlclap_checkpoint:
            load_mlclap_checkpoint(model, args.mlclap_checkpoint)
        return model

    def _lr_factor(self, step: int) -> float:
        args = self.args
        if args.warmup_steps and step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.schedule == "constant":
            return 1.0
        if args.schedule == "step":
            return float(args.step_gamma ** ((step // self.steps_per_epoch) // args.step_epochs))
        span = max(self.total_steps - args.warmup_steps, 1)
        progress = min(max(step - args.warmup_steps, 0) / span, 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine

    # --- one step -------------------------------------------------------------------------

    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        args = self.args
        fixed = self.languages.index(args.pair_language) if self.mode == "fixed" else 0
        texts, langs, arrange = select_texts(
            batch, self.mode, self.languages, self.lang_gen, fixed, with_ids=self.ask
        )
        tokens = self.model.text.tokenize(texts, langs)
        waveform = batch["audio"].to(self.device, non_blocking=True)
        lengths = batch["lengths"].to(self.device)
        input_ids = tokens["input_ids"].to(self.device)
        attention_mask = tokens["attention_mask"].to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.scheduler.get_last_lr()[0])  # the rate this step uses
        running = self._running_stats()
        saved_stats = [t.detach().clone() for t in running]  # restored if the step is skipped
        if self.grad_cache:
            loss, terms = self._grad_cache_backward(
                waveform, lengths, input_ids, attention_mask, arrange
            )
        else:
            module = self.ddp if self.ddp is not None else self.trainable
            loss, terms = module(waveform, lengths, input_ids, attention_mask, arrange)
            self.scaler.scale(loss).backward()
        value = loss.detach().float()
        if self.world > 1:
            dist.all_reduce(value)  # NaN/Inf on any rank makes every rank skip
            value /= self.world
        # NaN guard: a non-finite loss or gradient never reaches the weights. Under fp16 the
        # GradScaler skips overflowing steps itself and lowers its scale; those count as
        # non-finite only once the scale has fallen below 1 (then it is not an overflow).
        grad_norm = torch.tensor(float("nan"))
        skipped = counted = not bool(torch.isfinite(value))
        if not skipped:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.params, args.grad_clip if args.grad_clip > 0 else float("inf")
            )
            skipped = not bool(torch.isfinite(grad_norm))
            counted = skipped and not (self.scaler.is_enabled() and self.scaler.get_scale() >= 1)
            if not skipped or self.scaler.is_enabled():
                self.scaler.step(self.optimizer)
                self.scaler.update()
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for tensor, old in zip(running, saved_stats, strict=True):
                    tensor.copy_(old)
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if counted else 0
        self.nonfinite_total += int(counted)
        with warnings.catch_warnings():
            # A skipped first step: the schedule follows the step count, skipped steps
            # included, so stepping it before any optimizer.step() is what we want.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
            self.scheduler.step()
        if self.grad_cache and self.world > 1:
            with torch.no_grad():
                for buf in self.trainable.buffers():
                    if buf.is_floating_point():
                        dist.all_reduce(buf)
                        buf /= self.world
        out: dict[str, float] = {"loss": float(value), "grad_norm": float(grad_norm)}
        for key, term in (terms or {}).items():
            if isinstance(term, Tensor) and 1 < term.numel() <= 64:
                names = self.languages if term.numel() == len(self.languages) else None
                for i, v in enumerate(term.detach().float().reshape(-1).tolist()):
                    out[f"terms/{key}/{names[i] if names else i}"] = v
                continue
            number = to_float(term)
            if number is not None:
                out[f"terms/{key}"] = number
        for name, param in self.loss_fn.named_parameters():
            if param.dim() == 0:  # temperature, static radius, SigLIP scale/bias
                out[f"param/{name}"] = float(param.detach())
        out["lr"] = lr
        out["captions"] = float(len(texts))
        out["skipped"] = int(skipped)
        out["nonfinite_steps"] = self.nonfinite_total
        return out

    def _running_stats(self) -> list[Tensor]:
        """Buffers a forward pass changes (batch-norm statistics)."""
        norms = (
            m for m in self.trainable.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
        )
        return [b for m in norms for b in m.buffers(recurse=False) if b is not None]

    def _grad_cache_backward(
        self,
        waveform: Tensor,
        lengths: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        arrange: Callable[[Tensor, Tensor], Arranged],
    ) -> tuple[Tensor, dict[str, Any]]:
        trainable = self.trainable
        chunk = self.args.grad_cache_chunk or self.args.batch_size
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}

        def encode(part: dict[str, Tensor]) -> Tensor:
            # Trim each chunk's padding to its own longest caption (less work, same result).
            width = int(part["attention_mask"].sum(1).max())
            with trainable.autocast():
                out = trainable.model.encode_text(
                    part["input_ids"][:, :width], part["attention_mask"][:, :width]
                )
            return out.float()

        cached = embed_without_grad(encode, split_chunks(batch, chunk), self.device)
        with trainable.autocast():
            audio = trainable.model.encode_audio(waveform, lengths)
        loss, terms = trainable.compute_loss(audio.float(), cached.embeddings, arrange)
        self.scaler.scale(loss).backward()
        backward_chunks(encode, cached)
        allreduce_gradients(self.params, self.world)
        return loss, terms

    # --- ASK knowledge bank ---------------------------------------------------------------

    @property
    def bank(self) -> Any:
        """The ASK loss's ``KnowledgeBank`` (held by reference, not a submodule)."""
        return getattr(self.loss_fn, "bank")  # noqa: B009 - loss_fn is typed as a plain Module

    @torch.no_grad()
    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's share of the training pairs, embedded with the current model.

        Audio: the first ``--max-seconds`` of each clip. Captions: all captions in the languages
        the loss trains on (``--pair-language``, or all of them for ``random``); every caption
        is one bank row paired with its clip's audio and carrying the clip's id. Rank ``r``
        embeds clips ``r, r + world, ...``; ``KnowledgeBank.build`` gathers the shards so every
        rank ends with the same bank.
        """
        model = self.model
        was_training = model.training
        model.eval()
        langs = self.languages if self.mode == "random" else [self.args.pair_language]
        shard = list(range(self.rank, len(self.train_clips), self.world))
        clips = [self.train_clips[i] for i in shard]
        audio = self._embed_audio(clips, self.args.max_seconds)
        texts, text_langs, owners = [], [], []
        for local, clip in enumerate(clips):
            for lang in langs:
                for caption in clip.captions.get(lang, []):
                    texts.append(caption)
                    text_langs.append(lang)
                    owners.append(local)
        text = self._embed_texts(texts, text_langs)
        owner_t = torch.tensor(owners, dtype=torch.long, device=audio.device)
        ids = torch.tensor([shard[i] for i in owners], dtype=torch.long, device=audio.device)
        model.train(was_training)
        return audio[owner_t], text, ids

    def build_bank(self, epoch: int) -> None:
        """Fill (epoch 0) or refresh (every ``--ask-refresh-every`` epochs) the ASK bank."""
        bank = self.bank
        audio, text, ids = self.embed_training_pairs()
        bank.build(audio, text, ids, gather=self.world > 1)
        self.bank_epoch = epoch
        if self.is_main:
            what = "built" if epoch == 0 else "refreshed"
            print(
                f"[ask] knowledge bank {what} from {len(bank)} training pairs "
                f"before epoch {epoch + 1}"
            )

    def bank_due(self, epoch: int) -> bool:
        if self.bank_epoch is None:
            return True
        if epoch == self.bank_epoch:
            return False
        return bool(self.bank.should_refresh(epoch))

    # --- evaluation -----------------------------------------------------------------------

    def _embed_audio(self, clips: Sequence[Clip], max_seconds: float | None) -> Tensor:
        loader = DataLoader(
            AudioOnlyDataset(clips, max_seconds),
            batch_size=self.args.eval_batch_size,
            collate_fn=collate,
            num_workers=self.args.workers,
            generator=torch.Generator().manual_seed(0),  # leave the global RNG alone
        )
        out = []
        for batch in loader:
            with self.trainable.autocast():
                emb = self.model.encode_audio(
                    batch["audio"].to(self.device), batch["lengths"].to(self.device)
                )
            out.append(emb.float())
        return self._concat(out)

    def _concat(self, chunks: list[Tensor]) -> Tensor:
        """The chunks' embeddings as one ``(N, E)`` tensor (``(0, E)`` for no chunk)."""
        if not chunks:
            return torch.zeros(0, self.model.embed_dim, device=self.device)
        return torch.cat(chunks)

    def _embed_texts(self, texts: Sequence[str], langs: Sequence[str]) -> Tensor:
        out = []
        size = self.args.eval_batch_size
        for start in range(0, len(texts), size):
            tokens = self.model.text.tokenize(
                texts[start : start + size], langs[start : start + size]
            )
            with self.trainable.autocast():
                emb = self.model.encode_text(
                    tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
                )
            out.append(emb.float())
        return self._concat(out)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """``retrieval_report`` on the test manifest (rank 0; the others wait)."""
        from contrastive_losses.metrics import retrieval_report

        was_training = self.model.training
        self.model.eval()
        audio = self._embed_audio(self.test_clips, self.args.eval_max_seconds)
        texts, langs, c = eval_captions(self.test_clips, self.languages, self.args.test_manifest)
        text = self._embed_texts(texts, langs)
        text = text.view(len(self.test_clips), len(self.languages), c, -1)
        n = len(self.test_clips)
        report = retrieval_report(
            audio,
            text,
            languages=self.languages,
            k=tuple(k for k in (1, 5, 10) if k <= n),  # small test sets: no cut-off above N
            map_k=min(10, n),
        )
        self.model.train(was_training)
        return report

    def select_value(self, metrics: dict[str, float]) -> float | None:
        key = self.args.select_metric
        if key != "mean_r1":
            return metrics.get(key)
        r1 = [v for k, v in metrics.items() if _is_r1(k)]
        return float(np.mean(r1)) if r1 else None

    # --- checkpoints ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything a resume needs, as tensors and plain types (loadable with
        ``weights_only=True``)."""
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "best": self.best,
            "history": self.history,
            "bank_epoch": self.bank_epoch,
            "epoch_losses": list(self.epoch_losses),
            "epoch_elapsed": self.epoch_elapsed,
            "nonfinite_in_row": self.nonfinite_in_row,
            "nonfinite_total": self.nonfinite_total,
            "args": vars(self.args),
        }
        if self.ask:
            state["bank"] = self.bank.state_dict()
        return state

    def rng_state(self) -> dict[str, Any]:
        version, words, gauss = random.getstate()
        return {
            "python": {
                "version": version,
                "state": torch.tensor(words, dtype=torch.int64),
                "gauss": gauss,
            },
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "lang_gen": self.lang_gen.get_state(),
        }

    def _latest_name(self) -> str | None:
        latest = self.out / "checkpoints" / "latest"
        if not latest.is_file():
            return None
        name = latest.read_text(encoding="utf-8").strip()
        if not name or name != Path(name).name or name.startswith("."):
            raise ValueError(f"{latest}: {name!r} is not a checkpoint name (step-*)")
        return name

    def _new_checkpoint_name(self) -> str:
        """``step-N``, or ``step-N.k`` when ``step-N`` is what ``latest`` names (an epoch
        ending on a --save-every-steps step): a published checkpoint is never rewritten."""
        checkpoints = self.out / "checkpoints"
        latest = self._latest_name()
        base = name = f"step-{self.step:08d}"
        k = 0
        while (checkpoints / name).exists():
            if name != latest:  # complete but never published (a kill before `latest`)
                remove_tree(checkpoints / name)
                break
            k += 1
            name = f"{base}.{k}"
        return name

    def _check_finite_weights(self) -> None:
        with torch.no_grad():
            tensors = [*self.trainable.named_parameters(), *self.trainable.named_buffers()]
            bad = [
                name
                for name, t in tensors
                if t.is_floating_point() and not bool(torch.isfinite(t).all())
            ]
        if bad:
            raise RuntimeError(
                f"refusing to save a checkpoint at step {self.step}: non-finite weights in "
                f"{bad[:5]}{'...' if len(bad) > 5 else ''}; the latest checkpoint "
                f"({self._latest_name()}) is left as it was"
            )

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-N`` crash-consistently and point ``latest`` at it.

        The files go to a temporary directory (each fsynced), which is renamed into place
        and only then named by ``latest`` (itself replaced atomically). A kill at any moment
        leaves ``latest`` naming a complete checkpoint (or absent before the first).
        """
        self._check_finite_weights()  # every rank: the weights are the same everywhere
        checkpoints = self.out / "checkpoints"
        name = self._from_main(self._new_checkpoint_name() if self.is_main else None)
        tmp = checkpoints / f"{TMP_PREFIX}{name}"
        if self.is_main:
            remove_tree(tmp)
            tmp.mkdir(parents=True)
        if self.world > 1:
            dist.barrier()
        directory = checkpoints / name
        try:
            atomic_torch_save(self.rng_state(), tmp / f"rng-rank{self.rank}.pt")
            if self.world > 1:
                dist.barrier()
            if self.is_main:
                atomic_torch_save(self.state(), tmp / "state.pt")
                os.rename(tmp, directory)
        except Exception:
            remove_tree(tmp)  # a full disk: leave no half checkpoint (a kill: the next start)
            raise
        if self.is_main:
            fsync_dir(checkpoints)
            if self.log is not None:
                self.log.sync()  # the rows up to this step are on disk before `latest`
            fsync_file(self.out / "epoch_log.jsonl")
            atomic_write_text(checkpoints / "latest", name)
            self._prune_checkpoints(name)
        if self.world > 1:
            dist.barrier()
        return directory

    def _prune_checkpoints(self, latest: str) -> None:
        keep = max(self.args.keep_checkpoints, 1)
        steps = sorted(p for p in (self.out / "checkpoints").glob("step-*") if p.is_dir())
        for old in steps[:-keep]:
            if old.name != latest:
                remove_tree(old)

    def _load(self, path: Path, map_location: Any) -> Any:
        """``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain types
        only, so a crafted file cannot run code on --resume."""
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"--resume: {path} holds objects other than tensors and plain Python types; "
                f"refusing to load it (weights_only=True): {str(err).splitlines()[0]}"
            ) from err
        except (RuntimeError, EOFError, OSError) as err:
            raise ValueError(f"--resume: cannot read {path}: {err}") from err

    def _maybe_resume(self) -> int | None:
        resume = self.args.resume
        if not resume:
            return None
        if resume == "auto":
            name = self._latest_name()
            if name is None:
                return None
            directory = self.out / "checkpoints" / name
        else:
            directory = Path(resume)
            if directory.is_file():
                directory = directory.parent
        state_file = directory / "state.pt"
        if not state_file.is_file():
            raise FileNotFoundError(f"--resume: no state.pt in {directory}")
        state = self._load(state_file, self.device)
        self.model.load_state_dict(state["model"])
        self.loss_fn.load_state_dict(state["loss"])
        if self.ask and "bank" in state:
            self.bank.load_state_dict(state["bank"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.best = state["best"]
        self.history = list(state["history"])
        self.bank_epoch = state.get("bank_epoch")
        self.epoch_losses = list(state.get("epoch_losses", []))
        self.epoch_elapsed = float(state.get("epoch_elapsed", 0.0))
        self.nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        rng_file = directory / f"rng-rank{self.rank}.pt"
        if rng_file.is_file():
            rng = self._load(rng_file, "cpu")
            python = rng["python"]
            if isinstance(python, dict):
                python = (python["version"], tuple(python["state"].tolist()), python["gauss"])
            random.setstate(python)
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            self.lang_gen.set_state(rng["lang_gen"])
        elif self.is_main:
            print(f"[resume] {rng_file} missing: RNG streams restart (not an exact resume)")
        if self.is_main:
            print(
                f"[resume] from {directory}: step {self.step}, epoch {self.epoch + 1}, "
                f"batch {self.batch_in_epoch}"
            )
        return self.step

    # --- the loop -------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to --epochs / --max-steps, evaluating and checkpointing after every epoch.

        An epoch is *closed* by its row in ``epoch_log.jsonl`` (evaluation, best model) and the
        checkpoint after it; a run resumed from a checkpoint taken after the epoch's last step
        but before it was closed closes it first.
        """
        args = self.args
        with self._signal_handlers():
            while self.epoch < args.epochs:
                epoch = self.epoch
                finished = self.step >= self.total_steps
                closed = bool(self.history) and self.history[-1]["step"] == self.step
                if finished and closed:
                    break
                if not finished and self.batch_in_epoch < self.steps_per_epoch:
                    self._train_epoch(epoch)
                self._close_epoch(epoch)
        if self.is_main and args.plots:
            from .plots import plot_run

            plot_run(self.out)
        result = {
            "step": self.step,
            "epoch": self.epoch,
            "best": self.best,
            "history": self.history,
            "world_size": self.world,
            "peak_memory_mb": peak_memory_mb(self.device),
            "ranks_in_sync": self.ranks_in_sync(),
        }
        if self.is_main:
            atomic_write_text(self.out / "summary.json", json.dumps(result, indent=2, default=str))
        return result

    def _train_epoch(self, epoch: int) -> None:
        """The epoch's remaining steps (up to --max-steps), with the step checkpoints."""
        args = self.args
        from tqdm.auto import tqdm

        if self.ask and self.batch_in_epoch == 0 and self.bank_due(epoch):
            self.build_bank(epoch)
        self.train_set.set_epoch(epoch)
        self.sampler.set_epoch(epoch, self.batch_in_epoch)
        loader = DataLoader(
            self.train_set,
            batch_sampler=self.sampler,
            collate_fn=collate,
            num_workers=args.workers,
            pin_memory=self.device.type == "cuda",
            # The loader draws its workers' base seed from this generator, not from the
            # global RNG: creating the iterator after a resume must not shift dropout.
            generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch),
        )
        bar = tqdm(
            total=self.steps_per_epoch,
            initial=self.batch_in_epoch,
            desc=f"epoch {epoch + 1}/{args.epochs}",
            disable=not (self.is_main and args.progress),
            dynamic_ncols=True,
        )
        started = time.time() - self.epoch_elapsed
        if self.device.type == "cuda" and self.batch_in_epoch == 0:
            torch.cuda.reset_peak_memory_stats(self.device)  # per-epoch peak
        self.model.train()
        for batch in loader:
            t0 = time.time()
            record = self.train_step(batch)
            self.step += 1
            self.batch_in_epoch += 1
            if not record["skipped"]:
                self.epoch_losses.append(record["loss"])
            if self.log is not None:
                row: dict[str, Any] = {
                    "step": self.step,
                    "epoch": epoch + 1,
                    "batch": self.batch_in_epoch,
                }
                row.update(record)
                row["step_time"] = time.time() - t0
                self.log.write(row)
            self.epoch_elapsed = time.time() - started
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            if self.nonfinite_in_row >= args.max_nonfinite_steps:
                raise RuntimeError(
                    f"{self.nonfinite_in_row} steps in a row had a non-finite (NaN/Inf) loss or "
                    f"gradient, the last at step {self.step}; they were skipped, the weights "
                    f"are finite and the latest checkpoint ({self._latest_name()}) holds them. "
                    "Lower --lr, check the data, try --amp none, or raise "
                    "--max-nonfinite-steps."
                )
            saved = False
            if args.save_every_steps and self.step % args.save_every_steps == 0:
                self.save_checkpoint()
                saved = True
            self._exit_if_signalled(saved)
            if self.step >= self.total_steps:
                break
        bar.close()

    def _close_epoch(self, epoch: int) -> None:
        """Evaluate, keep the best model, write the epoch row and checkpoint."""
        summary: dict[str, Any] = {
            "epoch": epoch + 1,
            "step": self.step,
            "train_loss": float(np.mean(self.epoch_losses)) if self.epoch_losses else None,
            "nonfinite_steps": self.nonfinite_total,
            "epoch_time_s": self.epoch_elapsed,
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        summary.update(self._evaluate_and_select())
        if self.batch_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        self.history.append(summary)
        self.epoch_losses = []
        self.epoch_elapsed = 0.0
        if self.is_main:
            append_line(self.out / "epoch_log.jsonl", json.dumps(summary) + "\n")
            print(
                f"[epoch {epoch + 1}] "
                + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in summary.items()
                    if k != "metrics"
                )
            )
        self.save_checkpoint()
        self._exit_if_signalled(saved=True)

    # --- signals --------------------------------------------------------------------------

    @contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """SIGINT/SIGTERM: finish the current step, save a checkpoint, print the resume
        command, exit 130/143. A second signal stops at once (the files stay consistent)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:  # second signal: no more waiting
                raise SystemExit(128 + signum)
            self.stop_signal = signum
            if self.is_main:
                name = signal.Signals(signum).name
                print(f"[{name}] saving a checkpoint after this step ...", flush=True)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _exit_if_signalled(self, saved: bool) -> None:
        flag = torch.tensor(float(self.stop_signal or 0))
        if self.world > 1:  # every rank stops at the same step, even if one got the signal
            flag = flag.to(self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        signum = int(flag.item())
        if not saved:
            self.save_checkpoint()
        if self.is_main:
            print(
                f"[{signal.Signals(signum).name}] checkpoint {self._latest_name()} saved at step "
                f"{self.step}; continue with:\n  {self.resume_command()}",
                flush=True,
            )
        raise SystemExit(128 + signum)

    def resume_command(self) -> str:
        """The command line of this run with ``--resume auto`` (and no ``--overwrite``)."""
        if self.argv is None:
            script, argv = sys.argv[0], list(sys.argv[1:])
        else:
            script = str(Path(__file__).resolve().parents[1] / "finetune_ced_sonar.py")
            argv = list(self.argv)
        kept: list[str] = []
        skip_value = False
        for i, token in enumerate(argv):
            if skip_value:
                skip_value = False
                continue
            if token in ("--resume", "--overwrite") or token.startswith(
                ("--resume=", "--overwrite=")
            ):
                nxt = argv[i + 1] if i + 1 < len(argv) else ""
                skip_value = "=" not in token and (token == "--resume" or not nxt.startswith("-"))
                skip_value = skip_value and bool(nxt)
                continue
            kept.append(token)
        kept += ["--resume", "auto"]
        if self.args.overwrite:  # set in the config file
            kept += ["--overwrite", "false"]
        launcher = [sys.executable]
        if self.world > 1:
            launcher = ["torchrun", f"--nproc_per_node={self.world}"]
        return shlex.join([*launcher, script, *kept])

    def ranks_in_sync(self) -> bool:
        """Every rank holds bit-identical parameters (a DDP sanity check; True alone)."""
        if self.world == 1:
            return True
        with torch.no_grad():
            checksum = torch.stack([p.detach().double().sum() for p in self.params])
        gathered = [torch.zeros_like(checksum) for _ in range(self.world)]
        dist.all_gather(gathered, checksum)
        return all(torch.equal(gathered[0], g) for g in gathered[1:])

    def _evaluate_and_select(self) -> dict[str, Any]:
        if not self.test_clips:
            return {}
        out: dict[str, Any] = {}
        if self.is_main:
            report = self.evaluate()
            wanted = ("per_language", "average", "mrv")
            if isinstance(report, dict) and all(key in report for key in wanted):
                metrics = flatten_metrics({key: report[key] for key in wanted})
            else:
                metrics = flatten_metrics(report)
            if hasattr(report, "to_markdown"):
                table = report.to_markdown()
                print(table)
                (self.out / "eval").mkdir(exist_ok=True)
                atomic_write_text(self.out / "eval" / f"step-{self.step:08d}.md", table + "\n")
            value = self.select_value(metrics)
            out = {"metrics": metrics, "select": value}
            if value is not None and (self.best is None or value > self.best):
                self.best = value
                best = self.out / "best"
                best.mkdir(exist_ok=True)
                # A kill between these files is repaired on resume: the checkpoint before
                # this evaluation repeats it.
                atomic_torch_save(
                    {
                        "model": self.model.state_dict(),
                        "loss": self.loss_fn.state_dict(),
                        "step": self.step,
                        "epoch": self.epoch + 1,
                        "metrics": metrics,
                        "args": vars(self.args),
                    },
                    best / "state.pt",
                )
                atomic_write_text(best / "metrics.json", json.dumps(metrics, indent=2))
                out["best"] = True
        if self.world > 1:
            shared: list[Any] = [self.best]
            dist.broadcast_object_list(shared, src=0)
            self.best = shared[0]
        return out


def _is_r1(key: str) -> bool:
    lowered = key.lower().replace("@", "")
    parts = lowered.split("/")
    return (
        any(part in ("r1", "recall1", "r_1") for part in parts)
        and "mean" not in parts
        and "average" not in parts
    )


class _Trainable(nn.Module):
    """Model + loss in one module, so DDP synchronises the loss's parameters too."""

    def __init__(
        self,
        model: ClapModel,
        loss_fn: nn.Module,
        amp_dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.amp_dtype = amp_dtype
        self.device_type = device.type

    def autocast(self) -> Any:
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def compute_loss(
        self, audio: Tensor, text: Tensor, arrange: Callable[[Tensor, Tensor], Arranged]
    ) -> tuple[Tensor, dict[str, Any]]:
        positional, keyword = arrange(audio, text)
        loss, terms = self.loss_fn(*positional, **keyword, return_terms=True)
        return loss, terms

    def forward(
        self,
        waveform: Tensor,
        lengths: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        arrange: Callable[[Tensor, Tensor], Arranged],
    ) -> tuple[Tensor, dict[str, Any]]:
        with self.autocast():
            audio, text = self.model(waveform, lengths, input_ids, attention_mask)
        assert audio is not None and text is not None  # both towers ran
        return self.compute_loss(audio.float(), text.float(), arrange)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    trainer = Trainer(args, argv)
    try:
        return trainer.fit()
    finally:
        # DDP's reducer must be freed while its process group is alive: destroyed the
        # other way round, gloo can abort at exit.
        del trainer
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
