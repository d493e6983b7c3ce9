"""Evaluation of the trainer: embedding clips and captions, ``retrieval_report`` on the
validation set (every epoch) or the test set (once, ``final_test``), the selection metric and
the best model; also the training-set embeddings ASK's bank is built from."""

from __future__ import annotations

import argparse
import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from .data import AudioOnlyDataset, Clip, collate, eval_captions
from .durable import warn
from .logs import flatten_metrics
from .model import ClapModel
from .objective import Trainable
from .run_folder import RunFolder


def is_r1(key: str) -> bool:
    """A flattened metric key that is an R@1 (not a mean or average of them)."""
    lowered = key.lower().replace("@", "")
    parts = lowered.split("/")
    return (
        any(part in ("r1", "recall1", "r_1") for part in parts)
        and "mean" not in parts
        and "average" not in parts
    )


class Evaluator:
    """Embeds with the trainer's model; evaluates (rank 0) and keeps ``best/``.

    ``val_clips`` are what every epoch's evaluation (and so ``best/``) sees; the test set is
    handed to :meth:`evaluate` only at the end."""

    def __init__(
        self,
        args: argparse.Namespace,
        trainable: Trainable,
        device: torch.device,
        languages: Sequence[str],
        val_clips: Sequence[Clip],
        out: Path,
    ) -> None:
        self.args = args
        self.trainable = trainable
        self.model: ClapModel = trainable.model
        self.device = device
        self.languages = list(languages)
        self.val_clips = list(val_clips)
        self.out = out
        self.folder = RunFolder(out)
        self.last_table: Path | None = None  # the latest retrieval table written

    def embed_audio(self, clips: Sequence[Clip], max_seconds: float | None) -> Tensor:
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

    def embed_texts(self, texts: Sequence[str], langs: Sequence[str]) -> Tensor:
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
    def evaluate(
        self, clips: Sequence[Clip] | None = None, manifest: str | None = None
    ) -> dict[str, Any]:
        """``retrieval_report`` on ``clips`` from ``manifest`` (default: the validation set;
        rank 0, the others wait)."""
        from contrastive_losses.metrics import retrieval_report

        if clips is None:
            clips, manifest = self.val_clips, self.args.val_manifest
        was_training = self.model.training
        self.model.eval()
        audio = self.embed_audio(clips, self.args.eval_max_seconds)
        texts, langs, c = eval_captions(clips, self.languages, str(manifest))
        text = self.embed_texts(texts, langs)
        text = text.view(len(clips), len(self.languages), c, -1)
        n = len(clips)
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
        r1 = [v for k, v in metrics.items() if is_r1(k)]
        return float(np.mean(r1)) if r1 else None

    def report_metrics(self, report: Any, step: int, prefix: str = "") -> dict[str, float]:
        """Flattened metrics of ``report``; its table kept in ``eval/`` (``last_table``:
        ``step-N.md`` for a validation, ``test-step-N.md`` with ``prefix="test-"``)."""
        wanted = ("per_language", "average", "mrv")
        if isinstance(report, dict) and all(key in report for key in wanted):
            metrics = flatten_metrics({key: report[key] for key in wanted})
        else:
            metrics = flatten_metrics(report)
        self.last_table = None
        if hasattr(report, "to_markdown"):
            table = report.to_markdown()
            self.last_table = self.out / "eval" / f"{prefix}step-{step:08d}.md"
            self.folder.write_text(self.last_table, table + "\n")
        return metrics

    def select(
        self,
        report: Any,
        best: float | None,
        step: int,
        epoch: int,
        loss_fn: torch.nn.Module,
        world: int,
    ) -> tuple[dict[str, Any], float | None]:
        """From rank 0's ``report`` (None on the other ranks), keep ``best/`` when the
        selection metric improves on ``best``; returns the epoch row's evaluation fields and
        the best value, the same on every rank."""
        out: dict[str, Any] = {}
        if report is not None:
            metrics = self.report_metrics(report, step)
            value = self.select_value(metrics)
            out = {"metrics": metrics, "select": value}
            if value is not None and (best is None or value > best):
                best = value
                self.save_best(loss_fn, step, epoch, metrics)
                out["best"] = True
        if world > 1:
            shared: list[Any] = [best]
            torch.distributed.broadcast_object_list(shared, src=0)
            best = shared[0]
        return out, best

    def save_best(
        self, loss_fn: torch.nn.Module, step: int, epoch: int, metrics: dict[str, float]
    ) -> None:
        best = self.out / "best"
        # A kill between these files is repaired on resume: the checkpoint before this
        # evaluation repeats it.
        self.folder.torch_save(
            {
                "model": self.model.state_dict(),
                "loss": loss_fn.state_dict(),
                "step": step,
                "epoch": epoch,
                "metrics": metrics,
                "args": vars(self.args),
            },
            best / "state.pt",
        )
        self.folder.write_text(best / "metrics.json", json.dumps(metrics, indent=2))

    @torch.no_grad()
    def embed_training_pairs(
        self, train_clips: Sequence[Clip], langs: Sequence[str], rank: int, world: int
    ) -> tuple[Tensor, Tensor, Tensor]:
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
        shard = list(range(rank, len(train_clips), world))
        clips = [train_clips[i] for i in shard]
        audio = self.embed_audio(clips, self.args.max_seconds)
        texts, text_langs, owners = [], [], []
        for local, clip in enumerate(clips):
            for lang in langs:
                for caption in clip.captions.get(lang, []):
                    texts.append(caption)
                    text_langs.append(lang)
                    owners.append(local)
        text = self.embed_texts(texts, text_langs)
        owner_t = torch.tensor(owners, dtype=torch.long, device=audio.device)
        ids = torch.tensor([shard[i] for i in owners], dtype=torch.long, device=audio.device)
        model.train(was_training)
        return audio[owner_t], text, ids


def build_bank_if_due(
    bank: Any,
    bank_epoch: int | None,
    epoch: int,
    evaluator: Evaluator,
    train_clips: Sequence[Clip],
    langs: Sequence[str],
    rank: int,
    world: int,
) -> int | None:
    """Build ASK's bank before the first epoch, refresh it when ``should_refresh(epoch)``;
    returns the epoch the bank is from."""
    due = bank_epoch is None or (epoch != bank_epoch and bool(bank.should_refresh(epoch)))
    if not due:
        return bank_epoch
    audio, text, ids = evaluator.embed_training_pairs(train_clips, langs, rank, world)
    with warnings.catch_warnings(record=True) as caught:  # said in the trainer's words below
        warnings.simplefilter("always")
        bank.build(audio, text, ids, gather=world > 1)
    if rank == 0:
        for seen in caught:
            warn(f"[ask] {as_trainer_option(str(seen.message))}")
    if rank == 0:
        what = "built" if epoch == 0 else "refreshed"
        print(
            f"[ask] knowledge bank {what} from {len(bank)} training pairs before epoch {epoch + 1}"
        )
    return epoch


#: The KnowledgeBank arguments its build warns about, and the trainer options that set them.
_ASK_OPTIONS = {"num_prototypes": "--ask-prototypes"}


def as_trainer_option(message: str) -> str:
    """A library warning about ASK in the trainer's words: ``num_prototypes=512`` becomes
    ``--ask-prototypes 512`` (the option that changes it)."""
    for name, option in _ASK_OPTIONS.items():
        message = re.sub(rf"\b{name}=", f"{option} ", message)
        message = re.sub(rf"\b{name}\b", option, message)
    return message
