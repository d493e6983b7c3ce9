"""Checkpoints of the trainer: save, choose the resume point, prune, load.

A checkpoint is a directory ``checkpoints/step-NNNNNNNN`` (``step-N.k`` when the step was saved
before: an epoch ending on a ``--save-every-steps`` step) holding ``state.pt`` (rank 0),
``rng-rank<r>.pt`` (every rank) and ``manifest.json`` (``manifest.py``: the SHA-256 and size of
every other file, the checkpoint's name, step and epoch, and the run's options). The files are
written into a temporary directory, the manifest last, the directory is renamed into place and
only then named by ``checkpoints/latest``. A checkpoint is used only when its manifest speaks
for its own folder alone, every file matches it, and ``state.pt`` and the RNG files load with
``weights_only=True``: ``--resume auto`` otherwise falls back to the newest checkpoint that
passes, with a warning naming what was wrong, or stops with an error naming it when none does.
Each file is read once (``manifest.read_verified``: no link followed, a FIFO never waited on),
hashed, and loaded from those same bytes; rank 0 keeps what it loaded for the resume, so a file
swapped on disk after it was verified is never loaded. Every path goes through ``run_folder``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .distributed import from_main
from .durable import TMP_PREFIX, warn
from .manifest import CheckpointError, read_verified, verify, write_manifest
from .run_folder import MAX_LATEST_BYTES, MAX_SUMMARY_BYTES, RunFolder, RunFolderError

NAME = re.compile(r"step-(\d{8})(?:\.(\d+))?")

#: Keys of ``state.pt`` a resume cannot do without.
REQUIRED_STATE = (
    "model",
    "loss",
    "optimizer",
    "scheduler",
    "scaler",
    "step",
    "epoch",
    "batch_in_epoch",
    "best",
    "history",
)
REQUIRED_RNG = ("python", "torch", "cuda", "lang_gen")
RNG_FILE = re.compile(r"rng-rank\d+\.pt")


def sort_key(name: str) -> tuple[int, int]:
    match = NAME.fullmatch(name)
    assert match is not None, name
    return int(match.group(1)), int(match.group(2) or 0)


def read_latest(checkpoints: Path) -> tuple[str | None, str | None]:
    """``(name, problem)``: what ``checkpoints/latest`` names, or why it names nothing usable
    (``problem`` is None when the file is simply absent)."""
    latest = checkpoints / "latest"
    try:
        data = RunFolder(checkpoints.parent).read_bytes(latest, MAX_LATEST_BYTES)
    except RunFolderError as err:
        return None, str(err)
    if data is None:
        return None, None
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        return None, f"{latest}: not UTF-8 text ({err.reason} at byte {err.start})"
    if not NAME.fullmatch(name):
        return None, f"{latest}: {name[:80]!r} is not a checkpoint name (step-N)"
    if not (checkpoints / name).is_dir() and not (checkpoints / name).is_symlink():
        return None, f"{latest}: names {name}, which does not exist"
    return name, None


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """Checkpoint directories (not temporary ones), newest first; symbolic links named like
    one are listed too, so that a resume names them when it skips them."""
    if not checkpoints.is_dir():
        return []
    found = [
        p
        for p in checkpoints.iterdir()
        if NAME.fullmatch(p.name) and (p.is_dir() or p.is_symlink())
    ]
    return sorted(found, key=lambda p: sort_key(p.name), reverse=True)


@dataclass
class ResumePoint:
    """The checkpoint a run resumes from. ``state`` and ``rng`` (rank 0's RNG file) are what
    was loaded from the bytes that were hashed; they are not sent to the other ranks."""

    directory: Path
    manifest: dict[str, Any]
    state: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None

    def shared(self) -> ResumePoint:
        """What the other ranks get: where, and the manifest (they load their own files)."""
        return ResumePoint(self.directory, self.manifest)


def load_bytes(data: bytes, path: Path, required: Sequence[str]) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of ``data``, ``path``'s verified bytes (a checkpoint
    holds tensors and plain types only, so a crafted file cannot run code), with errors that
    name the file."""
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message suggests weights_only=False: never relay that.
        detail = next(
            (line.strip() for line in str(err).splitlines() if "Unsupported" in line), ""
        ).split(" Please")[0]
        raise CheckpointError(
            f"--resume: {path} is not a checkpoint this trainer wrote: it holds objects "
            f"other than tensors and plain Python types, and is refused"
            + (f" ({detail})" if detail else "")
        ) from None
    except Exception as err:  # torch's unpickler fails in many ways on garbage
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"--resume: cannot read {path}: not a torch checkpoint or damaged ({first})"
        ) from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"--resume: {path} holds a {type(loaded).__name__}, not a dict")
    missing = [key for key in required if key not in loaded]
    if missing:
        raise CheckpointError(
            f"--resume: {path} lacks {', '.join(repr(k) for k in missing)} "
            "(not a complete checkpoint of this trainer)"
        )
    return loaded


def load_verified(
    directory: Path,
    name: str,
    manifest: dict[str, Any],
    required: Sequence[str],
    root: Path | None = None,
) -> dict[str, Any]:
    """``name`` of a verified checkpoint, loaded from the bytes that matched its manifest."""
    data = read_verified(directory, name, manifest, root)
    return load_bytes(data, directory / name, required)


def usable(directory: Path, root: Path | None = None, rank: int = 0) -> ResumePoint:
    """A checkpoint that passes :func:`verify`, whose files match their hashes and load with
    ``weights_only=True``, holding what a resume needs, ``state.pt`` at the manifest's step;
    else :class:`CheckpointError` naming the file. A crafted file is refused here, before the
    checkpoint is chosen, so a resume falls back. The point holds ``state.pt`` and
    ``rng-rank<rank>.pt`` as they were loaded."""
    try:
        manifest = verify(directory)
        state = load_verified(directory, "state.pt", manifest, REQUIRED_STATE, root)
        step = state["step"]
        if not isinstance(step, int) or step != manifest["step"]:
            raise CheckpointError(
                f"{directory / 'state.pt'}: at step {str(step)[:40]}, its manifest says "
                f"{manifest['step']} (a file was swapped and the manifest forged)"
            )
        rng = None
        for name in sorted(manifest["files"]):
            if RNG_FILE.fullmatch(name):
                loaded = load_verified(directory, name, manifest, REQUIRED_RNG, root)
                rng = loaded if name == f"rng-rank{rank}.pt" else rng
    except CheckpointError as err:  # the loader's messages start "--resume: "
        raise CheckpointError(str(err).removeprefix("--resume: ")) from None
    return ResumePoint(directory, manifest, state, rng)


def find_resume_point(
    checkpoints: Path, resume: str | None, refused: Mapping[str, str] | None = None
) -> ResumePoint | None:
    """The checkpoint ``--resume`` starts from, verified; ``None``: start afresh.

    ``--resume DIR``: that checkpoint or an error. ``--resume auto``: what ``latest`` names;
    when it is absent, garbled, a link, or names a checkpoint that is damaged, not loadable or
    whose manifest lists anything but plain files of its own folder, the newest usable one
    (with a warning naming what was wrong); an error when checkpoints exist but none is
    usable. ``refused``: checkpoints (by name) another rank could not verify, with why; they
    are passed over as damaged ones are. Reads only: nothing is written or deleted here.
    """
    refused = refused or {}
    if not resume:
        return None
    if resume != "auto":
        directory = Path(resume)
        if directory.is_file() and not directory.is_symlink():
            directory = directory.parent
        try:
            return usable(directory)
        except CheckpointError as err:
            raise CheckpointError(f"--resume {resume}: {err}") from err
    try:
        RunFolder(checkpoints.parent).dir(checkpoints)
    except RunFolderError as err:
        raise CheckpointError(f"--resume auto: {err}. Nothing was changed") from None
    root = checkpoints.parent
    name, problem = read_latest(checkpoints)
    problems = [problem] if problem else []
    missing = f"{checkpoints / 'latest'} is missing"
    if name in refused:
        problems.append(refused[name])
    elif name is not None:
        try:
            return usable(checkpoints / name, root)
        except CheckpointError as err:
            problems.append(str(err))
    for directory in complete_checkpoints(checkpoints):
        if directory.name == name:
            continue
        if directory.name in refused:
            problems.append(refused[directory.name])
            continue
        try:
            point = usable(directory, root)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        why = "; ".join(problems) if problems else missing
        warn(f"{why}; resuming from the newest intact checkpoint {directory}")
        return point
    if problems:
        raise CheckpointError(
            f"--resume auto: no intact checkpoint in {checkpoints}: "
            + "; ".join(problems)
            + ". Nothing was changed; restore a checkpoint, or start afresh with --overwrite"
        )
    return None


# --- options that changed since the checkpoint -------------------------------------------------

#: Never compared: where the run writes, how it reports, and resume's own switches.
UNCOMPARED = frozenset(
    {
        "config",
        "output_dir",
        "resume",
        "overwrite",
        "allow_config_change",
        "debug",
        "demo",
        "progress",
        "plots",
        "workers",
        "device",
        "check_audio",
        "eval_batch_size",
        "save_every_steps",
        "keep_checkpoints",
        "contain_audio_paths",
        "audio_root",
        "ced_checkpoint",
        "mlclap_checkpoint",
        "sonar",
        "sonar_weights",
        "e5_cache",  # where the same features are kept
        "loss_chunk_size",  # exact: the same loss and gradients, only the memory differs
    }
)
#: Changes that are only warned about, with their consequence.
LENGTH = "the learning-rate schedule is recomputed for the new length from the resumed step on"
WARN_ONLY = {
    "epochs": LENGTH,
    "max_steps": LENGTH,
    "val_manifest": "later evaluations (and so best/) use the new validation set",
    "test_manifest": "the final evaluation uses the new test set",
    "eval_max_seconds": "later evaluations crop the validation and test clips differently",
    "select_metric": "the best model is chosen by another metric from now on",
    "train_manifest": "the rest of the run trains on the data this manifest lists",
}
CONSEQUENCES = {
    "lr": "the learning rate follows the new peak from the resumed step on",
    "schedule": "the learning-rate schedule changes from the resumed step on",
    "warmup_steps": "the learning-rate schedule changes from the resumed step on",
    "min_lr_ratio": "the learning-rate schedule changes from the resumed step on",
    "step_epochs": "the learning-rate schedule changes from the resumed step on",
    "step_gamma": "the learning-rate schedule changes from the resumed step on",
    "weight_decay": "the optimizer uses the new weight decay from the resumed step on",
    "batch_size": "steps per epoch change, so the resumed epoch position no longer matches",
    "seed": "the data order and crops of the remaining epochs change",
}
DEFAULT_CONSEQUENCE = (
    "the rest of the run differs from the run that wrote the checkpoint (and may not load)"
)


def _norm(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str]]:
    """``[(option, message)]`` for each compared option whose value changed; options only
    warned about come first with ``message`` prefixed by ``warn:``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in UNCOMPARED or key not in saved or key not in current:
            continue
        old, new = _norm(saved[key]), _norm(current[key])
        if old == new:
            continue
        option = "--" + key.replace("_", "-")
        kind = "warn" if key in WARN_ONLY else "refuse"
        consequence = WARN_ONLY.get(key) or CONSEQUENCES.get(key, DEFAULT_CONSEQUENCE)
        out.append((kind, f"{option} {old!r} -> {new!r}: {consequence}"))
    return sorted(out, key=lambda item: item[0] != "warn")


def check_config(saved: dict[str, Any], current: dict[str, Any], allow: bool) -> list[str]:
    """The warnings to print for changed options; raises for changes that need
    ``--allow-config-change`` when it is not given."""
    changes = config_changes(saved, current)
    refused = [message for kind, message in changes if kind == "refuse"]
    if refused and not allow:
        raise CheckpointError(
            "--resume: options differ from the checkpoint's run: "
            + "; ".join(refused)
            + ". Resume with the checkpoint's values, or pass --allow-config-change"
        )
    return [message for _, message in changes]


# --- save, prune, load -------------------------------------------------------------------------


class CheckpointStore:
    """Writes, prunes and loads the checkpoints of one run (every rank holds one)."""

    def __init__(self, out: Path, rank: int, world: int, keep: int) -> None:
        self.folder = RunFolder(out)
        self.dir = out / "checkpoints"
        self.rank, self.world, self.is_main = rank, world, rank == 0
        self.keep = max(keep, 1)
        #: The checkpoint the run resumed from or last published (``latest``'s content).
        self.published: str | None = None
        self.published_step: int | None = None

    def new_name(self, step: int) -> str:
        """``step-N``, or ``step-N.k`` when ``step-N`` is the published checkpoint: a
        published checkpoint is never rewritten. Others of that name (never published, or
        damaged ones a resume fell back from) are replaced."""
        base = name = f"step-{step:08d}"
        k = 0
        while os.path.lexists(self.dir / name):  # a link of that name too (it is removed)
            if name != self.published:
                self.folder.remove(self.dir / name)
                break
            k += 1
            name = f"{base}.{k}"
        return name

    def save(
        self,
        name: str,
        state: Callable[[], dict[str, Any]],
        rng: dict[str, Any],
        meta: dict[str, Any],
        before_publish: Callable[[], None],
    ) -> Path:
        """Write ``name`` crash-consistently and point ``latest`` at it (every rank calls).

        The files and then the manifest go to a temporary directory (each fsynced), which is
        renamed into place and only then named by ``latest`` (replaced atomically). A kill at
        any moment leaves ``latest`` naming a complete checkpoint (or absent before the first).
        """
        tmp = self.dir / f"{TMP_PREFIX}{name}"
        if self.is_main:
            self.folder.remove(tmp)
            self.folder.dir(tmp, create=True)
        if self.world > 1:
            dist.barrier()
        directory = self.dir / name
        try:
            self.folder.torch_save(rng, tmp / f"rng-rank{self.rank}.pt")
            if self.world > 1:
                dist.barrier()
            if self.is_main:
                self.folder.torch_save(state(), tmp / "state.pt")
                write_manifest(self.folder, tmp, name, meta)
                self.folder.rename(tmp, directory)  # and fsyncs the checkpoints directory
        except Exception:
            self.folder.remove(
                tmp
            )  # a full disk: leave no half checkpoint (a kill: the next start)
            raise
        if self.is_main:
            before_publish()
            self.folder.write_text(self.dir / "latest", name)
            self.prune(name)
        self.published, self.published_step = name, int(meta["step"])
        if self.world > 1:
            dist.barrier()
        return directory

    def prune(self, latest: str) -> None:
        """Keep the ``keep`` newest checkpoints up to ``latest``; newer ones (damaged ones a
        resume fell back from) are left to be replaced when the run reaches their step, and so
        are symbolic links named like a checkpoint (never followed, never counted as kept)."""
        limit = sort_key(latest)
        older = [
            p
            for p in complete_checkpoints(self.dir)
            if sort_key(p.name) <= limit and not p.is_symlink()
        ]
        for old in older[self.keep :]:
            self.folder.remove(old)


# --- resume: which checkpoint, and loading it into the run ---------------------------------------


def resume_point(
    out: Path, args: argparse.Namespace, is_main: bool, world: int
) -> ResumePoint | None:
    """The verified checkpoint to start from, after checking the output directory and the
    options that changed: rank 0 chooses it, every other rank verifies and loads its own
    files of it, and every rank gets the same answer or the same error. A checkpoint that
    another rank could not verify is passed over on every rank together: ``--resume auto``
    falls back to the next intact one, ``--resume DIR`` stops with that rank's error (not
    one rank raising while rank 0 waits in its next collective)."""
    refused: dict[str, str] = {}
    while True:
        point = _choose_point(out, args, is_main, world, refused)
        problem = _verified_on_every_rank(point, is_main, world)
        if point is None or problem is None:
            return point
        if args.resume != "auto":
            raise CheckpointError(f"--resume {args.resume}: {problem}")
        refused[point.directory.name] = problem  # rank 0 warns as it falls back


def _verified_on_every_rank(point: ResumePoint | None, is_main: bool, world: int) -> str | None:
    """Each rank but 0 (which chose ``point``) verifies and loads ``state.pt`` and its own
    RNG file, kept in ``point`` for the resume; one all-reduce of an ok flag tells every
    rank whether all could. ``None`` when all did, else every failing rank's error."""
    if point is None or world == 1:
        return None
    problem = None
    if not is_main:
        rank = dist.get_rank()
        try:
            state = load_verified(point.directory, "state.pt", point.manifest, REQUIRED_STATE)
            name = f"rng-rank{rank}.pt"
            if name in point.manifest["files"]:
                point.rng = load_verified(point.directory, name, point.manifest, REQUIRED_RNG)
            point.state = state
        except CheckpointError as err:
            problem = f"rank {rank}: {str(err).removeprefix('--resume: ')}"
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    ok = torch.tensor([int(problem is None)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if bool(ok):
        return None
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, problem)
    return "; ".join(p for p in problems if p)


def _choose_point(
    out: Path, args: argparse.Namespace, is_main: bool, world: int, refused: dict[str, str]
) -> ResumePoint | None:
    """Rank 0's choice (verified, its files loaded; the others get where and the manifest),
    or its error on every rank."""
    from .startup import output_dir_problem

    answer: tuple[str, Any] = ("ok", None)
    point = None
    if is_main:
        try:
            problem = output_dir_problem(out, args)
            if problem:
                raise FileExistsError(problem)
            point = find_resume_point(out / "checkpoints", args.resume, refused)
            if point is not None:
                saved = point.manifest.get("args", {})
                current = json.loads(json.dumps(vars(args), default=str))
                for message in check_config(saved, current, args.allow_config_change):
                    warn(f"--resume: option changed since the checkpoint: {message}")
            answer = ("ok", point.shared() if point is not None else None)
        except (CheckpointError, FileExistsError) as err:
            answer = (type(err).__name__, str(err))
    kind, value = from_main(answer, world)
    if kind == "FileExistsError":
        raise FileExistsError(value)
    if kind != "ok":
        raise CheckpointError(value)
    return point if is_main else value


def load_modules(
    path: Path,
    state: dict[str, Any],
    model: nn.Module,
    loss_fn: nn.Module,
    bank: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
) -> None:
    """``state.pt``'s weights and optimizer state (loaded on the CPU) into the run's objects,
    or an error naming the file when they do not fit."""
    try:
        model.load_state_dict(state["model"])
        loss_fn.load_state_dict(state["loss"])
        if bank is not None and "bank" in state:
            device = next(iter(model.parameters())).device
            bank.load_state_dict(
                {
                    k: v.to(device) if isinstance(v, torch.Tensor) else v
                    for k, v in state["bank"].items()
                }
            )
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
    except (RuntimeError, KeyError, ValueError, TypeError) as err:
        first = str(err).splitlines()[0]
        raise CheckpointError(
            f"--resume: {path} does not fit this run's model, loss or optimizer ({first})"
        ) from None


def reset_schedule(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    args: argparse.Namespace,
    factor: Callable[[int], float],
) -> None:
    """The learning rate (and weight decay) of the resumed step under the current options:
    the loaded value when they did not change; no step at the old schedule's rate when
    --epochs or --lr did."""
    scheduler.base_lrs = [args.lr for _ in optimizer.param_groups]
    share = factor(scheduler.last_epoch)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * share
        group["weight_decay"] = args.weight_decay
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def rng_state(lang_gen: torch.Generator) -> dict[str, Any]:
    """Every random stream of this rank, as tensors and plain values."""
    version, words, gauss = random.getstate()
    return {
        "python": {
            "version": version,
            "state": torch.tensor(words, dtype=torch.int64),
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "lang_gen": lang_gen.get_state(),
    }


def restore_rng(point: ResumePoint, rank: int, lang_gen: torch.Generator, is_main: bool) -> None:
    """This rank's random streams from the checkpoint: rank 0's as it verified and loaded
    them, another rank's read once, hashed and loaded now (``load_verified``)."""
    name = f"rng-rank{rank}.pt"
    path = point.directory / name
    if name not in point.manifest["files"]:
        if is_main:
            print(f"[resume] {path} missing: RNG streams restart (not an exact resume)")
        return
    rng = point.rng
    if rng is None:
        rng = load_verified(point.directory, name, point.manifest, REQUIRED_RNG)
    try:
        python = rng["python"]
        if isinstance(python, dict):
            python = (python["version"], tuple(python["state"].tolist()), python["gauss"])
        random.setstate(python)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        lang_gen.set_state(rng["lang_gen"])
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as err:
        raise CheckpointError(f"--resume: {path}: not a valid RNG state ({err})") from None


def check_finite(module: nn.Module, step: int, latest: str | None) -> None:
    """Refuse to save non-finite weights (the latest checkpoint stays as it was)."""
    with torch.no_grad():
        tensors = [*module.named_parameters(), *module.named_buffers()]
        bad = [
            name
            for name, t in tensors
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]
    if bad:
        raise RuntimeError(
            f"refusing to save a checkpoint at step {step}: non-finite weights in "
            f"{bad[:5]}{'...' if len(bad) > 5 else ''}; the latest checkpoint "
            f"({latest}) is left as it was"
        )


def already_complete(
    out: Path, manifest: dict[str, Any], epochs: int, total_steps: int, is_main: bool, world: int
) -> bool:
    """The checkpoint closes the run's last epoch and the summary was written: say so."""
    step, epoch = int(manifest.get("step", -1)), int(manifest.get("epoch", -1))
    done = epoch >= epochs or (step >= total_steps and bool(manifest.get("closed")))
    if done:  # a kill after the last checkpoint: the plots and summary are still due
        summary_step = None
        if is_main:
            summary_step = read_summary(out).get("step")
        done = from_main(summary_step == step if is_main else None, world)
    if done and is_main:
        print(
            f"[resume] the run in {out} is already complete (step {step}, epoch {epoch}); "
            "nothing to do. Raise --epochs (or --max-steps) to train further."
        )
    return bool(done)


def read_summary(out: Path) -> dict[str, Any]:
    """``summary.json`` of a run folder, or ``{}`` when it is absent or unusable (a link, FIFO
    or device, too big, not JSON, too deep: named in a warning; the summary is rewritten)."""
    path = out / "summary.json"
    try:
        summary = RunFolder(out).read_json(path, MAX_SUMMARY_BYTES)
    except (OSError, ValueError) as err:
        warn(f"{err}; the run's summary is written afresh")
        return {}
    if summary is not None and not isinstance(summary, dict):
        warn(f"{path}: holds a JSON {type(summary).__name__}, not an object; written afresh")
        return {}
    return summary or {}
