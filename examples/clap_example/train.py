"""The training loop: DDP, AMP, GradCache, logging, evaluation, checkpoints and exact resume."""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import math
import os
import random
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
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
    TrainDataset,
    collate,
    eval_captions,
    pick,
    read_manifest,
    require_language,
    require_other_language,
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
    """Append-only per-step JSONL + CSV; on resume rows after the checkpoint's step are dropped."""

    def __init__(self, directory: Path, name: str, resume_step: int | None) -> None:
        self.jsonl = directory / f"{name}.jsonl"
        self.csv = directory / f"{name}.csv"
        self.columns: list[str] | None = None
        if resume_step is None:
            for path in (self.jsonl, self.csv):
                path.unlink(missing_ok=True)
            return
        kept = [r for r in self.read(self.jsonl) if r.get("step", 0) <= resume_step]
        self.jsonl.unlink(missing_ok=True)
        self.csv.unlink(missing_ok=True)
        for row in kept:
            self.write(row)

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            return []
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def write(self, row: dict[str, Any]) -> None:
        with self.jsonl.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.columns is None:
            self.columns = list(row)
            with self.csv.open("w", encoding="utf-8", newline="") as f:
                csv.writer(f).writerow(self.columns)
        with self.csv.open("a", encoding="utf-8", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.columns])


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

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world, self.device = init_distributed(args.device)
        self.is_main = self.rank == 0
        self.out = Path(args.output_dir)
        if self.is_main:
            (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.amp_dtype = self._amp_dtype()

        # Data first: manifest errors should come before minutes of model loading.
        self.languages: list[str] = list(args.languages)
        self.train_clips = read_manifest(args.train_manifest, self.languages, args.audio_root)
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
            self.test_clips = read_manifest(args.test_manifest, self.languages, args.audio_root)
            eval_captions(self.test_clips, self.languages, args.test_manifest)  # validate early
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
        resume_step = self._maybe_resume()
        self.log = StepLog(self.out, "train_log", resume_step) if self.is_main else None
        if self.is_main:
            config = {k: v for k, v in vars(args).items()}
            (self.out / "config.json").write_text(json.dumps(config, indent=2, default=str))

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
        if self.grad_cache:
            loss, terms = self._grad_cache_backward(
                waveform, lengths, input_ids, attention_mask, arrange
            )
        else:
            module = self.ddp if self.ddp is not None else self.trainable
            loss, terms = module(waveform, lengths, input_ids, attention_mask, arrange)
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, args.grad_clip if args.grad_clip > 0 else float("inf")
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        if self.grad_cache and self.world > 1:
            with torch.no_grad():
                for buf in self.trainable.buffers():
                    if buf.is_floating_point():
                        dist.all_reduce(buf)
                        buf /= self.world
        value = loss.detach().float()
        if self.world > 1:
            dist.all_reduce(value)
            value /= self.world
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
        return out

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
            "args": vars(self.args),
        }
        if self.ask:
            state["bank"] = self.bank.state_dict()
        return state

    def rng_state(self) -> dict[str, Any]:
        return {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "lang_gen": self.lang_gen.get_state(),
        }

    def save_checkpoint(self, tag: str | None = None) -> Path:
        name = tag or f"step-{self.step:08d}"
        directory = self.out / "checkpoints" / name
        if self.is_main:
            directory.mkdir(parents=True, exist_ok=True)
        if self.world > 1:
            dist.barrier()
        torch.save(self.rng_state(), directory / f"rng-rank{self.rank}.pt")
        if self.is_main:
            tmp = directory / "state.pt.tmp"
            torch.save(self.state(), tmp)
            os.replace(tmp, directory / "state.pt")
            (self.out / "checkpoints" / "latest").write_text(name)
            self._prune_checkpoints()
        if self.world > 1:
            dist.barrier()
        return directory

    def _prune_checkpoints(self) -> None:
        keep = max(self.args.keep_checkpoints, 1)
        steps = sorted(p for p in (self.out / "checkpoints").glob("step-*") if p.is_dir())
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _maybe_resume(self) -> int | None:
        resume = self.args.resume
        if not resume:
            return None
        if resume == "auto":
            latest = self.out / "checkpoints" / "latest"
            if not latest.is_file():
                return None
            directory = self.out / "checkpoints" / latest.read_text().strip()
        else:
            directory = Path(resume)
            if directory.is_file():
                directory = directory.parent
        state_file = directory / "state.pt"
        if not state_file.is_file():
            raise FileNotFoundError(f"--resume: no state.pt in {directory}")
        state = torch.load(state_file, map_location=self.device, weights_only=False)
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
        rng_file = directory / f"rng-rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, map_location="cpu", weights_only=False)
            random.setstate(rng["python"])
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
        args = self.args
        from tqdm.auto import tqdm

        stop = self.step >= self.total_steps
        while self.epoch < args.epochs and not stop:
            epoch = self.epoch
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
            started = time.time()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # per-epoch peak
            losses: list[float] = []
            self.model.train()
            for batch in loader:
                t0 = time.time()
                record = self.train_step(batch)
                self.step += 1
                self.batch_in_epoch += 1
                losses.append(record["loss"])
                if self.log is not None:
                    row: dict[str, Any] = {
                        "step": self.step,
                        "epoch": epoch + 1,
                        "batch": self.batch_in_epoch,
                    }
                    row.update(record)
                    row["step_time"] = time.time() - t0
                    self.log.write(row)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                if args.save_every_steps and self.step % args.save_every_steps == 0:
                    self.save_checkpoint()
                if self.step >= self.total_steps:
                    stop = True
                    break
            bar.close()
            epoch_done = self.batch_in_epoch >= self.steps_per_epoch
            summary: dict[str, Any] = {
                "epoch": epoch + 1,
                "step": self.step,
                "train_loss": float(np.mean(losses)) if losses else None,
                "epoch_time_s": time.time() - started,
                "peak_memory_mb": peak_memory_mb(self.device),
            }
            if epoch_done or stop:
                summary.update(self._evaluate_and_select())
            if epoch_done:
                self.epoch += 1
                self.batch_in_epoch = 0
            self.history.append(summary)
            if self.is_main:
                with (self.out / "epoch_log.jsonl").open("a", encoding="utf-8") as f:
                    f.write(json.dumps(summary) + "\n")
                print(
                    f"[epoch {epoch + 1}] "
                    + ", ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in summary.items()
                        if k != "metrics"
                    )
                )
            self.save_checkpoint()
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
            (self.out / "summary.json").write_text(json.dumps(result, indent=2, default=str))
        return result

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
                (self.out / "eval" / f"step-{self.step:08d}.md").write_text(table + "\n")
            value = self.select_value(metrics)
            out = {"metrics": metrics, "select": value}
            if value is not None and (self.best is None or value > self.best):
                self.best = value
                best = self.out / "best"
                best.mkdir(exist_ok=True)
                torch.save(
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
                (best / "metrics.json").write_text(json.dumps(metrics, indent=2))
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
    trainer = Trainer(args)
    try:
        return trainer.fit()
    finally:
        # DDP's reducer must be freed while its process group is alive: destroyed the
        # other way round, gloo can abort at exit.
        del trainer
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
