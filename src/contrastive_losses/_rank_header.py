"""The fixed-length header the ranks exchange to agree (see
:func:`contrastive_losses.distributed.validate_together`): its layout, :class:`Validation`
(what a loss's checks fill in), the encoding of settings and gathered tensors as int64s,
the one ``all_gather`` of it, and the wording of what the ranks disagree on (the same
message on every rank, built from the gathered headers).

Private: :mod:`contrastive_losses._rank_agreement` builds and reads the header;
:mod:`contrastive_losses.distributed` is the public face.
"""

from __future__ import annotations

import ast
import math
import struct
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from . import _compat
from ._gather import _gather_objects

# The names of the call-count entries of a fingerprint (_rank_agreement adds them;
# _settings_message words each).
_CALL_KEY = "call of "  # the fingerprint entry's name: "call of InfoNCELoss"
_COUNT_KEY = "calls of "  # check_call_counts' entry: "calls of InfoNCELoss (evaluation)"
_ORDER_KEY = "order of the calls of "  # its second entry: the kinds in order

# Modes in a header's first long: the checks off (zeros, nothing read back), on eager, on
# compiled (the header built in the graph, read by the op rank_header).
_OFF, _EAGER, _COMPILED = 0, 1, 2

# What validate_together exchanges about each tensor the ranks will gather: its dtype,
# whether autograd records it and the sizes after the batch dim, in a fixed-length slot
# so that every rank sends the same number of longs whether or not its checks passed (or
# registered anything).
_MAX_AGREE = 8  # tensors per block (ASK: audio, text and four knowledge tensors)
_MAX_TRAILING = 4  # dims after the batch dim; (B, K, 2, D) knowledge has 3
_SLOT = 3 + _MAX_TRAILING  # [dtype code, grad, ndim, *dims, zero padding]
_MAX_SETTINGS = 24  # settings per call in the fingerprint
_SETTING = 3  # [crc32 of the name, type tag, value code]
# [checks on, failed, batch, *settings, *tensor slots]
_HEADER = 3 + _SETTING * _MAX_SETTINGS + _SLOT * _MAX_AGREE
_FLOAT_TAG = 3
# A torch.dtype setting (the scale's): compared after the gathered tensors, as a Module
# cast with its inputs differs in both and the inputs' dtype is the one to name.
_DTYPE_TAG = 5
_DTYPES = {
    zlib.crc32(str(d).encode()): d
    for d in (getattr(torch, n) for n in dir(torch))
    if isinstance(d, torch.dtype)
}


def _dtype_code(dtype: torch.dtype) -> int:
    """A code that is the same in every process (not ``hash``, which is salted)."""
    return zlib.crc32(str(dtype).encode())


@dataclass
class Validation:
    """What :func:`validate_together` hands to the checks: ``min_batch`` is the local
    minimum (0 under gather, the global one otherwise); set ``batch`` to the local batch
    size once the inputs are validated, and name the validated tensors that will be
    gathered with :meth:`agree` (in the same order on every rank)."""

    min_batch: int
    batch: int = 0
    tensors: list[tuple[str, Tensor]] = field(default_factory=list)
    fingerprint: list[tuple[str, object]] = field(default_factory=list)
    active: bool = False  # the ranks check together: settings are recorded
    # Under torch.compile: a 0-d zero computed from the exchange's result (None eager)
    exchanged: Tensor | None = None

    def ordered(self, *tensors: Tensor | None) -> tuple[typing.Any, ...]:
        """``tensors`` (``None`` passed through) with the same values, made to depend on
        the ranks' exchange under ``torch.compile``: call it on what will be gathered,
        after the block. The exchange's result is a zero that no compiler can know,
        so ``x - zero`` (``x | False`` for bool) is ``x`` exactly (``-0.0`` and NaN
        included) and its gather cannot run before the exchange: inductor ordered a
        gather first, which a peer's exchange met (a gloo abort instead of the error).
        Eager the exchange has finished when the block ends: ``tensors`` as given."""
        zero = self.exchanged
        if zero is None:
            return tensors
        return tuple(_after(x, zero) for x in tensors)

    def settings(self, **values: object) -> None:
        """Settings (``name=value``) that must be the same on every rank: floats and 0-d
        tensors (compared to a relative ``1e-6``), ints, bools, strings and ``None``.
        Under gather with the checks on, ranks that differ raise one ``ValueError``
        naming the setting and every rank's value (a temperature of 0.05 on one rank and
        0.07 on another would give each rank another loss; a ``chunk_size`` of ``None``
        on one and 2 on another would pair different collectives, a gloo abort). Nothing
        is recorded (no value read) unless the ranks check together."""
        if not self.active:
            return
        for key, value in values.items():
            if isinstance(value, Tensor) and value.numel() != 1:
                value = tuple(value.shape)
            elif isinstance(value, Tensor):  # a 0-d temperature, scale, radius: read, or
                # traced: its value goes into the header in the graph
                value = value.detach() if _compat.is_compiling() else float(value.detach())
            self.fingerprint.append((key, value))
        if len(self.fingerprint) > _MAX_SETTINGS:
            raise RuntimeError(f"validate_together: at most {_MAX_SETTINGS} settings")

    def agree(self, **tensors: Tensor) -> None:
        """Tensors (``name=tensor``) whose dtype and trailing shape (every dim after the
        batch dim) must be the same on every rank: under gather, ranks that differ raise
        one ``ValueError`` naming the argument and both values instead of crashing in the
        collective."""
        self.tensors.extend(tensors.items())
        if len(self.tensors) > _MAX_AGREE:
            raise RuntimeError(f"validate_together: at most {_MAX_AGREE} tensors can agree")

    def _encoded_settings(self) -> list[int]:
        if len(self.fingerprint) > _MAX_SETTINGS:  # a fixed length: the ranks' headers pair
            raise RuntimeError(f"validate_together: at most {_MAX_SETTINGS} settings")
        out = [0] * (_SETTING * _MAX_SETTINGS)
        for i, (key, value) in enumerate(self.fingerprint):
            out[i * _SETTING : (i + 1) * _SETTING] = [_crc(key), *_setting_code(value)]
        return out

    def _encoded(self) -> list[int]:
        out = [0] * (_SLOT * _MAX_AGREE)
        for i, (_, x) in enumerate(self.tensors):
            dims = list(x.shape[1:])
            if len(dims) > _MAX_TRAILING:
                raise RuntimeError(f"validate_together: over {_MAX_TRAILING} trailing dims")
            # A gather with a graph on one rank only would leave that rank's backward
            # (a reduce-scatter) without a peer: a hang, not an error.
            grad = int(x.requires_grad and torch.is_grad_enabled())
            slot = [_dtype_code(x.dtype), grad, len(dims), *dims]
            out[i * _SLOT : i * _SLOT + len(slot)] = slot
        return out


def _after(x: Tensor | None, zero: Tensor) -> Tensor | None:
    """``x`` exactly, computed after ``zero`` (a 0-d int64 zero; see
    :meth:`Validation.ordered`)."""
    if x is None:
        return None
    if x.dtype == torch.bool:  # bool has no subtraction
        return x | zero.to(torch.bool)
    return x - zero.to(x.device)  # a 0-d int64 keeps x's dtype


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _setting_code(value: object) -> tuple[int, int]:
    """``(type tag, value)`` of a setting as two int64s, the same in every process."""
    if value is None:
        return 0, 0
    if isinstance(value, bool):
        return 1, int(value)
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return 2, value
    if isinstance(value, float):
        return _FLOAT_TAG, struct.unpack("<q", struct.pack("<d", value))[0]
    if isinstance(value, torch.dtype):
        return _DTYPE_TAG, _dtype_code(value)
    return 4, _crc(repr(value))


def _float_of(code: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", code))[0])


def _settings_agree(rows: list[list[int]], dtypes: bool = True) -> bool:
    """Every rank sent the same settings; floats equal to a relative ``1e-6``; dtype
    settings only with ``dtypes``."""
    first = rows[0]
    for row in rows[1:]:
        for i in range(0, _SETTING * _MAX_SETTINGS, _SETTING):
            mine, theirs = first[i : i + _SETTING], row[i : i + _SETTING]
            if mine == theirs or (not dtypes and mine[1] == theirs[1] == _DTYPE_TAG):
                continue
            same_float = mine[:2] == theirs[:2] and mine[1] == _FLOAT_TAG
            if not (
                same_float and math.isclose(_float_of(mine[2]), _float_of(theirs[2]), rel_tol=1e-6)
            ):
                return False
    return True


def _settings_message(fingerprints: list[list[tuple[str, str, str]]]) -> str:
    """The first setting on which the ranks differ, with every rank's value (the same
    text on every rank: it is built from the gathered fingerprints)."""
    names = [[entry[0] for entry in f] for f in fingerprints]
    counting = [r for r, n in enumerate(names) if n and n[0].startswith(_COUNT_KEY)]
    if counting and len(counting) < len(names):  # a peer's extra call met the count check
        extra = [r for r in range(len(names)) if r not in counting]
        return (
            f"{names[counting[0]][0]}: rank {', '.join(map(str, counting))} compared the "
            f"calls of the loss while rank {', '.join(map(str, extra))} made another gathered "
            "loss call; every rank must call a gathered loss the same number of times (an "
            "extra batch on one rank pairs every later call with a peer's other batch; "
            "every rank raises it)"
        )
    if any(n != names[0] for n in names[1:]):
        listed = "; ".join(f"rank {r}: {', '.join(n) or 'none'}" for r, n in enumerate(names))
        return (
            f"settings: the ranks call different losses or forms ({listed}); every rank must "
            "call the same loss with the same settings to gather (every rank raises it)"
        )
    for i, key in enumerate(names[0]):
        full = [f[i][2] for f in fingerprints]
        if any(not _same_repr(v, full[0]) for v in full[1:]):
            short = [f[i][1] for f in fingerprints]
            values = short if len(set(short)) > 1 else full  # 6 digits unless they tie
            each = ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))
            if key.startswith(_COUNT_KEY):
                return (
                    f"{key}: the ranks made different numbers of gathered calls ({each}); "
                    "every rank must call a gathered loss the same number of times (an "
                    "extra batch on one rank pairs every later call with a peer's other "
                    "batch; every rank raises it)"
                )
            if key.startswith(_ORDER_KEY):
                orders = [ast.literal_eval(f[i][2]) for f in fingerprints]
                return (
                    f"{key}: the ranks made as many gathered calls but of other kinds in "
                    f"another order ({_first_difference(orders)}; training: grad mode on, "
                    "evaluation: off); an extra call on each rank, at different points, "
                    "pairs every call between them with a peer's other batch (every rank "
                    "raises it)"
                )
            if key.startswith(_CALL_KEY):
                return (
                    f"{key}: differs across ranks ({each}); every rank must call each "
                    "gathered loss Module the same number of times, in the same order (a "
                    "rank's extra call met another call's exchange; every rank raises it)"
                )
            return (
                f"{key}: differs across ranks ({each}); every rank must use the same {key} "
                "to gather, or the ranks compute different losses (every rank raises it)"
            )
    return "settings: the ranks' settings differ (every rank raises it)"


def _printed(value: object) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _same_repr(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    except ValueError:
        return a == b


def _slot_values(row: list[int], i: int) -> tuple[str, str, str]:
    """The dtype, the trailing shape and the grad bit a rank sent in slot ``i``, as
    printed."""
    code, grad, ndim, *dims = row[i * _SLOT : (i + 1) * _SLOT]
    dtype = _DTYPES.get(code)
    printed = str(dtype) if dtype is not None else f"<dtype code {code}>"
    return printed, str(tuple(dims[:ndim])), str(bool(grad))


_GRAD = "requires_grad (with grad mode on)"


def _disagreement(names: list[str], rows: list[list[int]]) -> str | None:
    """The first registered tensor on which the ranks differ, as a message; ``None`` when
    all agree. Ranks compare slot by slot, so the message is the same on every rank."""
    for i, name in enumerate(names):
        for r, row in enumerate(rows[1:], start=1):
            if row[i * _SLOT : (i + 1) * _SLOT] == rows[0][i * _SLOT : (i + 1) * _SLOT]:
                continue
            first, theirs = _slot_values(rows[0], i), _slot_values(row, i)
            kind = next(k for k in range(3) if first[k] != theirs[k])
            if kind == 2:
                return (
                    f"{name}: {_GRAD} {first[2]} on rank 0 but {theirs[2]} on rank {r}; "
                    "every rank must build the autograd graph of what it gathers, or none "
                    "(torch.no_grad() or an input that requires grad on some ranks only "
                    "leaves the backward's collective without a peer, a hang; every rank "
                    "raises it)"
                )
            what = ("dtype", "shape after the batch dim")[kind]
            return (
                f"{name}: {what} {first[kind]} on rank 0 but {theirs[kind]} on rank {r}; "
                f"every rank must pass the same {'dtype' if kind == 0 else 'embedding sizes'} "
                "(only the batch size may differ) to gather them (every rank raises it)"
            )
    return None


def _exchange_header(header: Tensor) -> Tensor:
    """Every rank's header ``(world, _HEADER)``: one ``all_gather`` that every rank makes,
    checks on or off (functional, so that it is traced under ``torch.compile``); nothing
    is read back here."""
    from torch.distributed import _functional_collectives as fc

    # torch >= 2.13 names it all_gather_single; 2.3-2.12 all_gather_tensor.
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    out = gather(header, 0, typing.cast(dist.ProcessGroup, dist.group.WORLD))
    return fc.wait_tensor(out).view(dist.get_world_size(), _HEADER)


def _raise_disagreement(
    rows: list[list[int]],
    names: list[str],
    printed: Callable[[], list[tuple[str, str, str]]],
    error: Exception | None,
    name: str,
    min_global: int,
) -> None:
    """Raise what the gathered headers say is wrong, the same on every checking rank:
    ``names`` are the gathered tensors', ``printed()`` this rank's settings as
    :func:`~contrastive_losses._rank_agreement._printed_settings` words them."""
    off = [r for r, row in enumerate(rows) if row[0] == _OFF]
    if off:  # no further collective: the ranks without checks would not make it
        values = ", ".join(f"{bool(row[0])} on rank {r}" for r, row in enumerate(rows))
        raise ValueError(
            f"validate_args: the value checks run on some ranks only ({values}; False: "
            "validate_args=False, set_default_validate_args(False) or torch.compile there); "
            "under gather every rank must run them or none, or the ranks cannot check "
            "together (ranks without checks wait in their next collective until this "
            "process ends)"
        ) from error
    failed = [r for r, row in enumerate(rows) if row[1]]
    if failed:
        info = (type(error).__name__, str(error)) if error is not None else None
        infos = _gather_objects(info, len(rows))
        kind, message = typing.cast(tuple[str, str], infos[failed[0]])
        cls = TypeError if kind == "TypeError" else ValueError
        raise cls(f"{message} (on rank {failed[0]}; every rank raises it)") from error
    if len({row[0] for row in rows}) > 1:  # eager and compiled: no size exchange there
        values = ", ".join(f"{row[0] == _COMPILED} on rank {r}" for r, row in enumerate(rows))
        raise ValueError(
            f"torch.compile: the loss runs compiled on some ranks only ({values}); under "
            "gather every rank must compile it or none: a compiled loss exchanges no batch "
            "sizes and the ranks' collectives would not pair. A rank whose code is compiled "
            "also runs it eager when dynamo reaches its recompile limit (torch._dynamo."
            f"config.{_compat.recompile_limit_name()}, default 8, counted per function; its "
            "warning 'torch._dynamo hit config...' in that rank's log): raise the limit on "
            "every rank or keep the shapes and settings that the loss sees fixed (every rank "
            "raises it)"
        ) from error
    settings = [row[3 : 3 + _SETTING * _MAX_SETTINGS] for row in rows]
    if not _settings_agree(settings, dtypes=False):
        _raise_settings(printed(), len(rows))
    slots = [row[3 + _SETTING * _MAX_SETTINGS :] for row in rows]
    mismatch = _disagreement(names, slots)
    if mismatch is not None:
        raise ValueError(mismatch)
    if not _settings_agree(settings):  # the scale's dtype, once the inputs' agree
        _raise_settings(printed(), len(rows))
    sizes = [row[2] for row in rows]
    if rows[0][0] == _COMPILED and len(set(sizes)) > 1:
        each = ", ".join(f"{b} on rank {r}" for r, b in enumerate(sizes))
        raise ValueError(
            f"{name}: batch sizes differ across ranks ({each}) under torch.compile; a "
            "compiled loss exchanges no sizes (no host sync), so every rank must hold the "
            "same batch size, e.g. drop_last=True in the DataLoader (every rank raises it)"
        )
    total = sum(sizes)
    if total < min_global:
        raise ValueError(
            f"{name}: global batch size {total} over {len(rows)} ranks is too small; a "
            f"contrastive loss needs at least {min_global} samples so that each has a negative"
        )


def _raise_settings(mine: list[tuple[str, str, str]], world: int) -> typing.NoReturn:
    """Raise the settings' disagreement, worded from every rank's fingerprint."""
    prints = _gather_objects(mine, world)
    raise ValueError(_settings_message(typing.cast(list[list[tuple[str, str, str]]], prints)))


def _first_difference(orders: list[str]) -> str:
    """Where the ranks' call orders
    (:func:`~contrastive_losses._rank_agreement._call_order`) first differ, worded."""
    runs = [[part.split(": ", 1) for part in order.split("; ") if part] for order in orders]
    for i, (owner, _) in enumerate(runs[0]):
        kinds = []  # each rank's runs of this owner: [[count, kind], ...]
        for rank_runs in runs:
            mine = rank_runs[i][1] if i < len(rank_runs) else ""
            kinds.append([item.split(" ", 1) for item in mine.split(", ") if item])
        position = 1
        while True:
            now = [_kind_at(k, position) for k in kinds]
            if len(set(now)) > 1:
                each = ", ".join(f"{k or 'none'} on rank {r}" for r, k in enumerate(now))
                return f"call {position} of {owner} was {each}"
            if now[0] is None:
                break
            position += 1
    return "the ranks' calls differ in order"


def _kind_at(runs: list[list[str]], position: int) -> str | None:
    """The kind of call ``position`` (from 1) in run-length encoded ``runs``."""
    for count, kind in runs:
        if position <= int(count):
            return kind
        position -= int(count)
    return None
