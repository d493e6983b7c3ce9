r"""open_clip's own trainer, ``open_clip_train.main``, on this library's drop-ins.

Changing the import does nothing there: ``open_clip_train.main`` builds its loss through
``open_clip.factory.create_loss``, and builds its optimizer from the model before the loss
exists. :func:`install` wires both, with every extra of the drop-ins; run it before
``main``::

    import sys
    from contrastive_losses.integrations.open_clip_train import install
    from open_clip_train.main import main

    install(svr={"radius": "dynamic"})
    main(sys.argv[1:])

or, the same from the shell (``--cl-*`` flags are ours, the rest open_clip's)::

    python -m contrastive_losses.integrations.open_clip_train \
        --cl-svr '{"radius": "dynamic"}' --model RN50 --train-data ...

What it changes, all undone by :meth:`Installation.uninstall`:

* ``ClipLoss`` and ``SigLipLoss`` in ``open_clip.factory`` (the names ``create_loss`` looks
  up) build :class:`~contrastive_losses.integrations.open_clip.ClipLoss` and
  :class:`~contrastive_losses.integrations.open_clip.SigLipLoss` with open_clip's arguments
  and ``chunk_size``, ``svr``, ``validate_args``; ``DistillClipLoss`` and ``CoCaLoss``
  raise, having no drop-in here.
* ``create_model_and_transforms`` (in ``open_clip.factory``, ``open_clip`` and an imported
  ``open_clip_train.main``) registers the SVR radius's parameters (the predictor's, or a
  static radius) on the first model it builds, as the submodule ``contrastive_losses_svr``:
  open_clip's optimizer, built from ``model.named_parameters()``, then trains them (its
  weight decay on the predictor's weight matrices, none on biases and a static radius),
  its checkpoints save them and ``--resume`` restores them. The loss uses those same
  parameters. The predictor's initial weights are drawn there from the seed in force
  (``torch.initial_seed()``, which open_clip's ``--seed`` sets just before it builds the
  model), as ``SupportVectorRegularizer(..., **svr)`` draws them right after
  ``torch.manual_seed(seed)``, and the global RNG is left as it was: the same ``--seed``
  gives the same predictor, whatever ran before.
* With ``ids``, a callable ``ids(images, texts) -> (B,) integer tensor``, a forward hook
  on that model adds ``"ids"`` to its output dict, which the train loop hands to the
  loss: pairs that share an id are all positives. They matter where one sample comes
  in two different views (one image with two of its captions); an exact duplicate
  (the same image and caption twice) needs none: with identical rows the
  supervised-contrastive loss and its parameter gradients are those without ``ids``.
* With ``svr``, ``output_dict=True`` returns ``contrastive_loss`` (the base loss),
  ``svr_loss`` (:math:`\alpha\,\mathcal{L}_{svr}`) and, with the constraint on,
  ``svr_constraint_loss`` (:math:`\beta\,\mathcal{L}_{con}`): open_clip's train loop sums
  the entries (the total and its gradient are the regularised loss) and logs each one.
  The dict also holds ``radius_mean`` and ``radius_over_distance`` (the batch's mean
  radius and share of anchors whose radius exceeds their positive's distance), which
  open_clip logs too (its loop logs ``.items()``) but does not add to the loss: they are
  left out of the dict's ``.values()``, which is what it sums.

:func:`install` and :meth:`Installation.uninstall` hold one lock: of installs racing in
several threads exactly one succeeds and the others raise ``ValueError``, and an
uninstall puts every name back before another install can start.

Nothing is imported from open_clip until :func:`install` runs.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from ..infonce import InfoNCELoss
from ..svr import RadiusPredictor, SupportVectorRegularizer
from . import open_clip as drop_ins

if TYPE_CHECKING:
    from _collections_abc import dict_values

__all__ = ["Installation", "install", "main"]

#: The name of the submodule that carries the SVR radius's parameters on the model.
SUBMODULE = "contrastive_losses_svr"
_EXTRA = "open_clip_torch[training] (open_clip and its open_clip_train package)"
_active: list[Installation] = []
#: Held by install(), uninstall() and _attach(): a check of _active and the patches it
#: guards happen as one step.
_lock = threading.Lock()


class Installation:
    """What :func:`install` changed; :meth:`uninstall` (or leaving a ``with`` block) puts
    open_clip back.

    Attributes:
        radius: the Module holding the SVR radius's trainable parameters (registered on
            the first model built as ``contrastive_losses_svr``), or ``None`` (no ``svr``,
            or a fixed radius).
        models: the models built since :func:`install` that carry ``radius`` and the
            ``ids`` hook (the first one only).
        losses: the losses ``create_loss`` built since :func:`install`.
    """

    def __init__(self, chunk_size: int | None, svr: Mapping[str, Any] | None,
                 ids: Callable[[Tensor, Tensor], Tensor] | None,
                 validate_args: bool | None) -> None:  # fmt: skip
        """Made by :func:`install` from its own arguments (see there); not built by hand."""
        self.options: dict[str, Any] = {
            "chunk_size": chunk_size,
            "svr": None if svr is None else dict(svr),
            "validate_args": validate_args,
        }
        self.ids = ids
        self.radius = _radius_holder(svr)
        self.models: list[nn.Module] = []
        self.losses: list[nn.Module] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._hooks: list[Any] = []

    def _patch(self, module: Any, name: str, value: Any) -> None:
        self._undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def uninstall(self) -> None:
        """Put back every name :func:`install` replaced and remove the ``ids`` hook (the
        ``contrastive_losses_svr`` submodule stays on models already built)."""
        with _lock:
            for module, name, original in reversed(self._undo):
                setattr(module, name, original)
            for hook in self._hooks:
                hook.remove()
            self._undo.clear()
            self._hooks.clear()
            if self in _active:
                _active.remove(self)

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _attach(self, model: nn.Module, seed: int) -> None:
        """Give the first model built the radius's parameters, the predictor's drawn from
        ``seed``, and the ``ids`` hook."""
        with _lock:
            if self.models or not isinstance(model, nn.Module):
                return
            self.models.append(model)
        if self.radius is not None:
            if hasattr(self.radius, "predictor"):
                _reseed(cast(RadiusPredictor, self.radius.predictor), seed)
            device = next(model.parameters(), torch.empty(0)).device
            model.add_module(SUBMODULE, self.radius.to(device))
        if self.ids is not None:
            self._hooks.append(model.register_forward_hook(self._add_ids, with_kwargs=True))

    def _add_ids(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> Any:  # fmt: skip
        images = args[0] if args else kwargs.get("image")
        texts = args[1] if len(args) > 1 else kwargs.get("text")
        if self.ids is None or not isinstance(output, dict) or images is None or texts is None:
            return output  # the train loop's calls pass both
        output["ids"] = self.ids(images, texts)
        return output

    def _loss(
        self, cls: type[drop_ins.ClipLoss] | type[drop_ins.SigLipLoss]
    ) -> Callable[..., nn.Module]:
        def build(*args: Any, **kwargs: Any) -> nn.Module:
            loss = cls(*args, **{**kwargs, **self.options})
            if self.options["svr"] is not None:
                _use_svr(loss, self.radius)
            self.losses.append(loss)
            return loss

        return build


def install(
    *,
    chunk_size: int | None = None,
    svr: Mapping[str, Any] | None = None,
    ids: Callable[[Tensor, Tensor], Tensor] | None = None,
    validate_args: bool | None = None,
) -> Installation:
    """Make ``open_clip_train.main`` train with this library's ``ClipLoss`` / ``SigLipLoss``.

    Call it before ``open_clip_train.main.main`` (before or after importing it); the
    module docstring lists what it changes.

    Args:
        chunk_size: the drop-ins' ``chunk_size`` (``None``: dense).
        svr: the drop-ins' ``svr``, keyword arguments of
            :class:`~contrastive_losses.SupportVectorRegularizer` (e.g.
            ``{"radius": "dynamic"}``), checked here.
        ids: ``None`` or a callable ``ids(images, texts)`` returning the batch's ``(B,)``
            integer sample ids (pairs that share one are all positives).
        validate_args: the drop-ins' ``validate_args``.

    Returns:
        An :class:`Installation`; ``.uninstall()`` puts open_clip back.

    Raises:
        ImportError: open_clip is not installed (the message names the package).
        ValueError: an installation is active.
        TypeError: ``ids`` is not callable, or ``svr`` not a dict.

    Example:
        >>> from contrastive_losses.integrations.open_clip_train import install
        >>> install(svr={"radius": "dynamic"}, chunk_size=256)  # doctest: +SKIP
    """
    if ids is not None and not callable(ids):
        raise TypeError(f"ids: expected None or a callable (images, texts) -> ids, got {ids!r}")
    if svr is not None and not isinstance(svr, Mapping):
        raise TypeError(
            f"svr: expected None or a dict of keyword arguments, got {type(svr).__name__}"
        )
    try:
        factory = importlib.import_module("open_clip.factory")
        package = importlib.import_module("open_clip")
    except ImportError as error:
        raise ImportError(f"install needs open_clip: pip install '{_EXTRA}'") from error
    with _lock:
        if _active:
            raise ValueError("install: already installed; call .uninstall() on the first one")
        done = Installation(chunk_size, svr, ids, validate_args)
        _patch_open_clip(done, factory, package)
        _active.append(done)
    return done


def _patch_open_clip(done: Installation, factory: Any, package: Any) -> None:
    """Replace the loss classes and ``create_model_and_transforms`` (in ``open_clip``'s
    factory, package and an imported ``open_clip_train.main``); undone by ``done``."""
    done._patch(factory, "ClipLoss", done._loss(_TrainerClipLoss))
    done._patch(factory, "SigLipLoss", done._loss(_TrainerSigLipLoss))
    for name in ("DistillClipLoss", "CoCaLoss"):
        if hasattr(factory, name):
            done._patch(factory, name, _unsupported(name))
    original = factory.create_model_and_transforms

    def create_model_and_transforms(*args: Any, **kwargs: Any) -> Any:
        seed = torch.initial_seed()  # open_clip's main seeds just before this call
        built = original(*args, **kwargs)
        done._attach(built[0], seed)
        return built

    trainer = sys.modules.get("open_clip_train.main")
    for module in (factory, package, trainer):
        if getattr(module, "create_model_and_transforms", None) is original:
            done._patch(module, "create_model_and_transforms", create_model_and_transforms)


def _radius_holder(svr: Mapping[str, Any] | None) -> nn.Module | None:
    """The SVR radius's trainable part, checked by building the regulariser once, or
    ``None`` for no ``svr`` or a fixed radius."""
    if svr is None:
        return None
    template = SupportVectorRegularizer(InfoNCELoss(normalize=False), **svr)
    holder = nn.Module()
    if template.predictor is not None:
        holder.predictor = template.predictor
    elif template.radius_mode == "static":
        holder.radius = template.radius
    else:
        return None
    return holder


def _reseed(predictor: RadiusPredictor, seed: int) -> None:
    """Redraw the untrained ``predictor``'s weights as its constructor draws them right
    after ``torch.manual_seed(seed)``, leaving the global RNG as it was."""
    last = cast(nn.Linear, predictor.mlp[-1])  # zero weight, bias radius_init: no draw
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = RadiusPredictor(predictor.num_features, predictor.hidden,
                                float(last.bias.detach()),
                                validate_args=predictor.validate_args)  # fmt: skip
    predictor.load_state_dict(fresh.state_dict())


def _use_svr(loss: nn.Module, holder: nn.Module | None) -> None:
    """Make ``loss``'s regulariser use ``holder``'s predictor or static radius (the
    parameters on the model), and keep its SVR terms for the ``output_dict``
    (:class:`_SvrTerms`)."""
    regulariser = cast(SupportVectorRegularizer, loss.loss)
    if holder is not None and hasattr(holder, "predictor"):
        regulariser.predictor = cast(RadiusPredictor, holder.predictor)
    elif holder is not None:
        regulariser.radius = holder.radius
    loss.loss = _SvrTerms(regulariser)


#: The regulariser's radius statistics that open_clip's log shows (not summed).
_RADIUS_STATISTICS = ("radius_mean", "radius_over_distance")


class _SvrTerms(nn.Module):
    """Calls the regulariser with ``return_terms`` and keeps its weighted SVR and
    constraint terms and its radius statistics (detached) for the drop-in's
    ``output_dict``."""

    def __init__(self, regulariser: SupportVectorRegularizer) -> None:
        super().__init__()
        self.regulariser = regulariser
        self.terms: dict[str, Tensor] = {}
        self.statistics: dict[str, Tensor] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        loss, terms = self.regulariser(*args, return_terms=True, **kwargs)
        self.terms = {"svr_loss": self.regulariser.alpha * terms["svr"]}
        if self.regulariser.constraint:
            self.terms["svr_constraint_loss"] = self.regulariser.beta * terms["constraint"]
        self.statistics = {name: terms[name] for name in _RADIUS_STATISTICS}
        return loss


class _LoggedOnly(dict[str, Tensor]):
    """The ``output_dict``: open_clip's train loop sums ``.values()`` into its loss and
    logs ``.items()``; the radius statistics are items but not values, so they are
    logged and never added to the loss."""

    def __init__(self, summed: dict[str, Tensor], logged_only: dict[str, Tensor]) -> None:
        super().__init__({**summed, **logged_only})
        self.logged_only = frozenset(logged_only)

    def values(self) -> dict_values[str, Tensor]:
        return {k: v for k, v in self.items() if k not in self.logged_only}.values()


def _output(loss: nn.Module, total: Tensor, output_dict: bool) -> Tensor | dict[str, Tensor]:
    """open_clip's output; with SVR the dict splits ``total`` into ``contrastive_loss``
    (carrying the whole gradient) and the detached SVR terms, which sum back to it, and
    adds the radius statistics, logged but not summed (:class:`_LoggedOnly`)."""
    if not output_dict:
        return total
    if not isinstance(loss.loss, _SvrTerms):
        return {"contrastive_loss": total}
    extra = {key: value.to(total.dtype) for key, value in loss.loss.terms.items()}
    summed = {"contrastive_loss": total - sum(extra.values()), **extra}
    logged = {key: value.to(total.dtype) for key, value in loss.loss.statistics.items()}
    return _LoggedOnly(summed, logged)


def _follow(loss: nn.Module, features: Tensor) -> None:
    """Move the loss to the features' device (open_clip never moves its loss)."""
    tensor = next(itertools.chain(loss.buffers(), loss.parameters()), None)
    if tensor is not None and tensor.device != features.device:
        loss.to(features.device)


class _TrainerClipLoss(drop_ins.ClipLoss):
    """The ``ClipLoss`` drop-in with the SVR terms in its ``output_dict``."""

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                logit_bias: Tensor | None = None, output_dict: bool = False, *,
                ids: Tensor | None = None) -> Tensor | dict[str, Tensor]:  # fmt: skip
        _follow(self, image_features)
        total = super().forward(image_features, text_features, logit_scale, logit_bias, ids=ids)
        return _output(self, total, output_dict)  # type: ignore[arg-type]


class _TrainerSigLipLoss(drop_ins.SigLipLoss):
    """The ``SigLipLoss`` drop-in with the SVR terms in its ``output_dict``."""

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                logit_bias: Tensor | None, output_dict: bool = False, *,
                ids: Tensor | None = None) -> Tensor | dict[str, Tensor]:  # fmt: skip
        _follow(self, image_features)
        total = super().forward(image_features, text_features, logit_scale, logit_bias, ids=ids)
        return _output(self, total, output_dict)  # type: ignore[arg-type]


def _unsupported(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"{name}: open_clip's {name} (--distill, CoCa models) has no drop-in in "
            "contrastive_losses; run without install() for it"
        )

    return refuse


#: How ``--cl-svr`` is written on a shell's command line.
_SVR_EXAMPLE = """--cl-svr '{"radius": "dynamic"}'"""


def _json_object(value: str) -> dict[str, Any]:
    """``--cl-svr``'s value: a JSON object, or an error that shows how to write one."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not JSON ({err.msg}); keys and strings need double quotes, e.g. "
            + _SVR_EXAMPLE
        ) from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError(
            f"{value!r} is JSON but not an object, e.g. " + _SVR_EXAMPLE
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m contrastive_losses.integrations.open_clip_train [--cl-chunk-size N]
    [--cl-svr JSON] [--cl-no-checks] <open_clip_train.main's flags>``:
    :func:`install`, then open_clip's ``main`` on the remaining flags."""
    parser = argparse.ArgumentParser(
        prog="python -m contrastive_losses.integrations.open_clip_train",
        description="open_clip's trainer (open_clip_train.main) on contrastive_losses' "
        "drop-ins: the --cl-* options below are ours; every other flag goes to open_clip's "
        "trainer unchanged.",
        epilog="open_clip's own flags (--model, --train-data, --batch-size, ...): "
        "python -m open_clip_train.main --help",
    )
    parser.add_argument(
        "--cl-chunk-size", type=int, default=None, help="chunk_size of the loss (exact tiling)"
    )
    parser.add_argument(
        "--cl-svr",
        type=_json_object,
        default=None,
        help="SupportVectorRegularizer options as a JSON object, e.g. " + _SVR_EXAMPLE,
    )
    parser.add_argument("--cl-no-checks", action="store_true", help="validate_args=False")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    install(chunk_size=ours.cl_chunk_size, svr=ours.cl_svr, ids=None,
            validate_args=False if ours.cl_no_checks else None)  # fmt: skip
    trainer = importlib.import_module("open_clip_train.main")
    trainer.main(rest)


if __name__ == "__main__":  # pragma: no cover - open_clip's trainer, run by hand
    main()
