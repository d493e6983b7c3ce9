"""Every knob of the pretrained-encoder study's arms (``real_pretrained.py``,
``real_tuned.py``), by name, from the command line to the constructor that reads it.

``--set NAME=VALUE`` with a lower-case ``NAME`` below (``--set svr.alpha=0.1``,
``--set lr=3e-4``, ``--set text=adapter``); upper-case names stay the studies' own module
settings. :func:`apply` writes a setting into ``real_multilingual``'s globals and its
``LOSS_OPTIONS`` (read where the towers, the optimiser and each loss are built), so it must
run after ``real_pretrained.configure()`` sets the study's (``configure()`` itself ends
by applying ``real_pretrained.KNOBS``, the ``--set`` knobs, so calling it again keeps them);
:func:`effective` is the whole setting an arm trains with, defaults resolved, as each run
records it.

Shared (every arm): ``lr`` (Adam, the audio head and the loss's own parameters),
``dropout``, ``hidden`` (the head's width), ``epochs``, ``text`` (``frozen``: e5's features
as they are; ``adapter``: ``real_towers.TextBlock`` on them, ``x + MLP(x)`` with
``real_multilingual.TEXT_HIDDEN`` hidden units, 2 x 384 x 384 + 384 + 384 weights, starting
at the identity), ``text_lr`` (the adapter's rate as a share of ``lr``), ``temperature``,
``learn_temperature`` (InfoNCE, KCL, CACL: the logit scale learns, starting at
``1 / temperature``; ASKLoss has none). SVR arms: ``svr.alpha``, ``svr.beta``,
``svr.radius_init``, ``svr.radius`` (``static``, ``dynamic`` or a fixed float; default the
arm's own kind), ``svr.direction``. ASK: ``ask.k``, ``ask.injection_ratio``,
``ask.ot_weight``, ``ask.lambda_fine``, ``ask.lambda_coarse``, ``ask.prototypes`` and
``ask.refresh`` (the ``KnowledgeBank``'s ``num_prototypes`` and ``refresh_every``). KCL and
CACL have no weights of their own (``KCLLoss``, ``CACLLoss``: temperature only).
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

import real_multilingual as rm

from contrastive_losses import ASKLoss, SupportVectorRegularizer

TEXT_LR = rm.TEXT_LR  # the study's, before any knob moved it

SHARED = ("lr", "dropout", "hidden", "epochs", "text", "text_lr", "temperature")
SVR = ("svr.alpha", "svr.beta", "svr.radius_init", "svr.radius", "svr.direction")
ASK = ("ask.k", "ask.injection_ratio", "ask.ot_weight", "ask.lambda_fine", "ask.lambda_coarse",
       "ask.prototypes", "ask.refresh")  # fmt: skip
TEXT_KINDS = ("frozen", "adapter")
#: Knob -> its type (``str`` knobs: see :func:`check`).
TYPES: dict[str, type] = {
    **dict.fromkeys(("lr", "dropout", "text_lr", "temperature"), float),
    **dict.fromkeys(("hidden", "epochs"), int),
    "text": str,
    "learn_temperature": bool,
    "svr.alpha": float, "svr.beta": float, "svr.radius_init": float, "svr.radius": str,
    "svr.direction": str,
    "ask.k": int, "ask.injection_ratio": float, "ask.ot_weight": float,
    "ask.lambda_fine": float, "ask.lambda_coarse": float, "ask.prototypes": int,
    "ask.refresh": int,
}  # fmt: skip
#: Where a loss knob goes: ``(LOSS_OPTIONS key, constructor argument)``.
TARGET = {"learn_temperature": ("base", "learnable_temperature")}
TARGET |= {f"svr.{n}": ("svr", n) for n in ("alpha", "beta", "radius_init", "radius", "direction")}
TARGET |= {f"ask.{n}": ("ask", n) for n in ("k", "injection_ratio", "ot_weight")}
TARGET |= {f"ask.{n}": ("ask", n) for n in ("lambda_fine", "lambda_coarse")}
TARGET |= {"ask.prototypes": ("bank", "num_prototypes"), "ask.refresh": ("bank", "refresh_every")}


def names(arm: str) -> tuple[str, ...]:
    """The knobs ``arm`` reads."""
    if arm == "ask":
        return (*SHARED, *ASK)
    own = SVR if arm.startswith("svr_") else ()
    return (*SHARED, "learn_temperature", *own)


def _library(cls: type, name: str) -> Any:
    return inspect.signature(cls.__init__).parameters[name].default


def defaults(arm: str, study: dict[str, Any]) -> dict[str, Any]:
    """``arm``'s knobs as the study runs them: ``study``'s ``lr``, ``dropout``, ``hidden``,
    ``epochs``; e5 frozen; ``real_multilingual``'s temperature, text rate, ASK prototypes
    and refresh; the library's defaults for the rest (SVR's and ASK's constructors)."""
    out = {k: study[k] for k in ("lr", "dropout", "hidden", "epochs")}
    out |= {"text": "frozen", "text_lr": TEXT_LR, "temperature": rm.TEMPERATURE,
            "learn_temperature": False}  # fmt: skip
    out |= {k: _library(SupportVectorRegularizer, TARGET[k][1]) for k in SVR}
    out["svr.radius"] = arm.removeprefix("svr_") if arm.startswith("svr_") else "dynamic"
    out |= {k: _library(ASKLoss, TARGET[k][1]) for k in ASK[:5]}
    out |= {"ask.prototypes": rm.PROTOTYPES, "ask.refresh": rm.ASK_REFRESH}
    return {k: out[k] for k in names(arm)}


def effective(arm: str, given: dict[str, Any], study: dict[str, Any]) -> dict[str, Any]:
    """The whole setting ``arm`` trains with: :func:`defaults` with ``given`` over them
    (knobs ``arm`` does not read left out)."""
    mine = defaults(arm, study)
    return mine | {k: v for k, v in given.items() if k in mine}


def check(name: str, value: Any) -> Any:
    """``value`` as knob ``name``'s type; ValueError naming the knob otherwise."""
    if name not in TYPES:
        raise ValueError(f"--set {name}: not a knob; choose from {sorted(TYPES)}")
    kind = TYPES[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if name == "svr.radius" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)  # a fixed radius
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"--set {name}={value!r}: expected {kind.__name__}")
    if name == "text" and value not in TEXT_KINDS:
        raise ValueError(f"--set text={value!r}: expected one of {TEXT_KINDS}")
    return value


def parse(assignments: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``NAME=VALUE`` items -> ``(upper-case module settings, left as given; knobs,
    checked)``; a knob's value is a Python literal or, for a word, the word itself."""
    module, knobs = [], {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if sep and key.isupper():
            module.append(item)
            continue
        if not sep:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        knobs[key] = check(key, parsed)
    return module, knobs


def apply(setting: dict[str, Any]) -> None:
    """Write ``setting`` (knobs) into ``real_multilingual``: ``LR``, ``DROPOUT``, ``HIDDEN``
    where given (else as ``real_pretrained.configure()``, which calls this last, set them),
    ``TEXT_LR``, ``TEXT_TRAINABLE`` and ``LOSS_OPTIONS`` (absent knobs: the study's)."""
    for key, name in (("lr", "LR"), ("dropout", "DROPOUT"), ("hidden", "HIDDEN")):
        if key in setting:
            setattr(rm, name, setting[key])
    rm.TEXT_LR = setting.get("text_lr", TEXT_LR)
    rm.TEXT_TRAINABLE = setting.get("text", "frozen") == "adapter"
    options: dict[str, dict[str, Any]] = {}
    if "temperature" in setting:
        options["base"] = {"temperature": setting["temperature"]}
        options["ask"] = {"temperature": setting["temperature"]}
    for key, (where, argument) in TARGET.items():
        if key in setting:
            options.setdefault(where, {})[argument] = setting[key]
    rm.LOSS_OPTIONS = options
