"""What chose the run's model, and the run's one evaluation on the test set.

With ``--val-manifest`` every epoch is evaluated on the validation set and the best by
``--select-metric`` is kept in ``best/``; after the last epoch ``best/``'s weights are loaded
and ``--test-manifest`` is read, its audio checked (``--check-audio``) and evaluated once.
Without ``--val-manifest`` nothing is selected: no evaluation runs during training, no
``best/`` is written, and the test set is evaluated on the last epoch's weights (a test set
evaluated every epoch becomes a selection as soon as anyone picks the best-looking epoch).

The test manifest is not opened before the training ends, so nothing during training can
depend on it. A failure here (a bad test manifest or audio file) leaves the checkpoints and
``best/`` as they were and writes no ``summary.json``: fix the file and ``--resume auto``
repeats only this evaluation.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch

from .console import mean_r1
from .distributed import from_main
from .startup import check_clips, read_eval_manifest

if TYPE_CHECKING:
    from .train import Trainer


def selection_record(args: Any, history: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``selection``: the manifest that chose ``best/``, the metric, and
    the epoch it chose (``manifest`` None: nothing was selected)."""
    if not args.val_manifest:
        return {
            "manifest": None,
            "rule": "no --val-manifest: nothing selected; the run's model is the last epoch's",
        }
    chosen = [row for row in history if row.get("best")]
    last = chosen[-1] if chosen else {}
    return {
        "manifest": args.val_manifest,
        "metric": args.select_metric,
        "value": last.get("select"),
        "epoch": last.get("epoch"),
        "step": last.get("step"),
    }


def start_note(args: Any) -> str:
    """The line printed at the start: what chooses the model, and when the test set is read."""
    if args.val_manifest:
        chosen, first = "best/", f"best/ is chosen on --val-manifest {args.val_manifest}"
    else:
        chosen = "the last epoch's weights"
        first = "no --val-manifest: no evaluation during training and no best/"
    second = (
        f"--test-manifest is read and evaluated once, at the end, on {chosen}"
        if args.test_manifest
        else "no --test-manifest"
    )
    return f"[select] {first}; {second}"


def load_best(t: Trainer, selection: dict[str, Any]) -> None:
    """``best/state.pt``'s weights into the model (rank 0), checked to be the epoch the run's
    history chose (a ``best/`` of another run is an error naming it)."""
    path = t.out / "best" / "state.pt"
    info = t.folder.lstat(path)
    data = t.folder.read_bytes(path, info.st_size if info is not None else 0)
    if data is None:
        raise FileNotFoundError(f"{path}: missing; the run's history chose step "
                                f"{selection['step']} on {selection['manifest']}")  # fmt: skip
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch's unpickler fails in many ways on a damaged file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{path}: not a best model this trainer wrote ({first})") from None
    if (
        not isinstance(state, dict)
        or "model" not in state
        or state.get("step") != selection["step"]
    ):
        found = state.get("step") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{path}: holds step {found}, but the run's history chose step "
            f"{selection['step']} on {selection['manifest']}; not evaluated on the test set"
        )
    t.model.load_state_dict(state["model"])


def evaluate_test(t: Trainer, selection: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: read and check the test set, load the chosen weights, evaluate once."""
    args = t.args
    clips = read_eval_manifest(args, args.test_manifest, t.languages)
    check_clips(args, clips, 0, 1)
    if selection.get("step") is not None:
        load_best(t, selection)
        model, epoch, step = "best/", selection["epoch"], selection["step"]
    else:
        epoch = t.history[-1]["epoch"] if t.history else t.epoch
        model, step = "last epoch", t.step
    report = t.evaluator.evaluate(clips, args.test_manifest)
    metrics = t.evaluator.report_metrics(report, step, prefix="test-")
    table = t.evaluator.last_table
    return {
        "manifest": args.test_manifest,
        "clips": len(clips),
        "model": model,
        "epoch": epoch,
        "step": step,
        "metrics": metrics,
        "table": str(table) if table is not None else None,
    }


def final_test(t: Trainer, selection: dict[str, Any]) -> dict[str, Any] | None:
    """The test set's evaluation on the chosen model (rank 0 evaluates, every rank gets the
    result, or raises when rank 0 failed); None without ``--test-manifest``."""
    if not t.args.test_manifest:
        return None
    result: dict[str, Any] | None = None
    failure: str | None = None
    if t.is_main:
        try:
            result = evaluate_test(t, selection)
        except Exception as err:
            from_main((None, f"{type(err).__name__}: {err}"), t.world)
            raise
        r1 = " ".join(f"{k} {v:.3f}" for k, v in mean_r1(result["metrics"]).items())
        print(
            f"[test] {result['clips']} clips of {result['manifest']} on {result['model']} "
            f"(epoch {result['epoch']}, step {result['step']}): R@1 {r1}",
            flush=True,
        )
    result, failure = from_main((result, failure), t.world)
    if failure is not None:
        raise RuntimeError(f"rank 0's test evaluation failed: {failure}")
    return result
