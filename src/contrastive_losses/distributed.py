"""All-gather across ranks with gradients flowing back to the owning rank.

Every loss computes its *local* rows (this rank's samples) against the *global* batch
(all ranks' samples), the "local loss" form of open_clip. Batch sizes may differ across
ranks (the last batch of an epoch, a dataset that does not divide evenly): tensors are
padded to the largest local batch, gathered, and the padding is cut off again. Finding the
sizes is a small collective and a host sync; with the losses' value checks off
(``validate_args=False``, or under ``torch.compile``) it is skipped and every rank must
hold the same batch size.

Rank agreement: before the first gather of a call, every rank shares one fixed-length
header (:func:`validate_together`): whether its checks run, whether they failed, its batch
size, a fingerprint of the loss's effective settings (temperature and the scale's dtype,
reduction, ``chunk_size``, an SVR radius, CACL's ``english_index``, ASK's effective
``k_coarse`` and bank backend, a dynamic radius predictor's checksum, a wrapper's own
settings such as the drop-in ``ClipLoss``'s ``local_loss``, ...), the number of this call
among the loss Module's gathered calls, and the dtype, trailing shape and autograd state
(``requires_grad`` with grad mode on) of what it will gather (embeddings, ids, knowledge).
:func:`check_call_counts` compares the ranks' totals of calls, and the order of their kinds
(training, evaluation), through the same exchange. Under ``torch.compile`` the header is
built in the graph and exchanged by a custom op that runs eager (see
:func:`validate_together`).
Ranks whose checks run compare
the headers and raise one clear error together; a rank with the checks off sends its
header (zeros, made on the device) without reading anything back, so the collectives stay
paired whatever each rank's ``validate_args`` and no host sync is added there.

The returned loss on each rank is scaled so that the *average over ranks* — what
``DistributedDataParallel`` does to gradients — equals the single-process loss on the
concatenated batch, and its gradient equals the single-process gradient.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import struct
import typing
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from . import _compat

__all__ = [
    "all_gather_no_grad",
    "all_gather_with_grad",
    "call_count",
    "check_call_counts",
    "is_distributed",
    "resolve_gather",
    "validate_together",
]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve_gather(gather: bool | None) -> bool:
    """``None`` means "gather when running distributed"; ``True`` requires it."""
    if gather is None:
        return is_distributed()
    if not isinstance(gather, bool):
        raise TypeError(f"gather: expected None, True or False, got {gather!r}")
    if gather and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "gather: True needs torch.distributed to be initialised "
            "(torch.distributed.init_process_group); pass gather=None to gather only when it is"
        )
    return gather


# The loss Module call that is running ([owner, its number or 0 until its first
# exchange]), set by counted_call; validate_together numbers the call at its first
# exchange and puts the number in the fingerprint.
_CALL: ContextVar[list[typing.Any] | None] = ContextVar("contrastive_losses_call", default=None)
_CALLS: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
# Each owner's calls in order, run-length encoded: [[kind, how many in a row], ...], the
# kind "training" (grad mode on) or "evaluation" (off), as the call's first exchange saw.
_KINDS: weakref.WeakKeyDictionary[object, list[list[typing.Any]]] = weakref.WeakKeyDictionary()
_CALL_KEY = "call of "  # the fingerprint entry's name: "call of InfoNCELoss"
_COUNT_KEY = "calls of "  # check_call_counts' entry: "calls of InfoNCELoss (evaluation)"
_ORDER_KEY = "order of the calls of "  # its second entry: the kinds in order
_F = typing.TypeVar("_F", bound=Callable[..., typing.Any])


def counted_call(forward: _F) -> _F:
    """Decorate a loss Module's ``forward``: under gather, each call's exchange
    (:func:`validate_together`) carries how many gathered calls this Module has made on
    this rank. A rank that calls a loss more often than its peers (a second call in a
    step, an evaluation on one rank only) then meets its peers' exchange of another
    call, and with the checks on every rank raises a ``ValueError`` naming the Module
    and each rank's count, instead of pairing different collectives (a gloo abort or a
    hang). Where the extra call's exchange meets another collective of a peer (its
    backward's gradient exchange) no count can be compared: that rank waits there until
    the process group's timeout. Nothing is counted in one process or under
    ``torch.compile``."""

    @functools.wraps(forward)
    def counted(self: object, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        _compat.check_compile_supported()  # first: a too-old dynamo fails further in
        if _compat.is_compiling() or not is_distributed():
            return forward(self, *args, **kwargs)
        token = _CALL.set([self, 0])
        try:
            return forward(self, *args, **kwargs)
        finally:
            _CALL.reset(token)

    return typing.cast(_F, counted)


def call_count(module: torch.nn.Module) -> int:
    """The gathered calls this rank has made of ``module`` and its submodules (a
    regulariser and its base count one each), as :func:`counted_call` numbers them: 0 in
    one process, under ``torch.compile``, or for the functional forms."""
    return sum(_CALLS.get(m, 0) for m in module.modules())


def check_call_counts(module: torch.nn.Module, what: str = "evaluation") -> None:
    """Raise one ``ValueError`` on every rank when the ranks made different numbers of
    gathered calls of ``module`` (:func:`call_count`); every rank must call it, at a point
    where the counts must agree (the end of an evaluation, of an epoch). Nothing in one
    process.

    The exchange of each call compares the call's number, so a rank's extra call raises
    there only when it meets a peer's call of another number; where the peer's next call
    of the same loss is the one it meets (an extra evaluation batch on one rank, then
    the next training step) both count alike and every later call pairs one rank's batch
    with the peer's previous one, silently. The totals differ from then on: this compares
    them in the loss's own exchange (one ``all_gather`` of its fixed-length header), so it
    also pairs with a peer's extra loss call that is still to come, and both raise. It
    also compares the order of the calls' kinds ("training", grad mode on; "evaluation",
    off): two offsetting extra calls, one per rank, give equal totals but another order
    when their kinds differ from the calls they displaced, and raise, naming the first
    call that differs. Offsetting calls of the same kind cannot be told apart: check
    after each evaluation. Calls made under ``torch.compile`` are not counted.

    Example (in a training loop, after the evaluation, on every rank)::

        from contrastive_losses.distributed import check_call_counts

        check_call_counts(loss_fn, "evaluation of epoch 3")
    """
    if not is_distributed():
        return
    name = f"{type(module).__name__} ({what})"
    with validate_together(True, None, min_global=0) as v:
        v.settings(**{f"{_COUNT_KEY}{name}": call_count(module)})
        v.settings(**{f"{_ORDER_KEY}{name}": _call_order(module)})


def _device(ref: object) -> torch.device:
    """The device that carries a collective: the current CUDA device under NCCL (it moves
    CUDA tensors only), else ``ref``'s (CPU when it is not a tensor)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(ref, Tensor) and ref.device.type != "meta":
        return ref.device
    return torch.device("cpu")


def _number_call() -> tuple[str, int] | None:
    """The running Module call's fingerprint entry, numbering the call at its first
    exchange (a call may exchange more than once: CACL checks its inputs, then its loss)."""
    call = _CALL.get()
    if call is None:
        return None
    owner = call[0]
    if call[1] == 0:
        call[1] = _CALLS[owner] = _CALLS.get(owner, 0) + 1
        kind = "training" if torch.is_grad_enabled() else "evaluation"
        runs = _KINDS.setdefault(owner, [])
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return _CALL_KEY + type(owner).__name__, call[1]


def _call_order(module: torch.nn.Module) -> str:
    """The kinds of ``module``'s gathered calls (and its submodules') in order, run-length
    encoded: ``"InfoNCELoss: 3 training, 1 evaluation"``; modules joined by ``"; "``."""
    parts = []
    for m in module.modules():
        runs = _KINDS.get(m)
        if runs:
            parts.append(f"{type(m).__name__}: " + ", ".join(f"{n} {k}" for k, n in runs))
    return "; ".join(parts)


def _first_difference(orders: list[str]) -> str:
    """Where the ranks' call orders (:func:`_call_order`) first differ, worded."""
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


# Settings of a wrapper around a loss (open_clip's drop-ins: ``local_loss``) that change
# what it does across ranks after the loss: added to every exchange made inside it.
_OUTER: ContextVar[tuple[tuple[str, object], ...]] = ContextVar(
    "contrastive_losses_outer", default=()
)


# Modes in a header's first long: the checks off (zeros, nothing read back), on eager, on
# compiled (the header built in the graph, read by the op rank_header).
_OFF, _EAGER, _COMPILED = 0, 1, 2
# The wrapper settings (outer_settings) while dynamo traces, where a ContextVar cannot be
# read: dynamo records the pushes and pops on this list as side effects of the trace.
_OUTER_TRACED: list[tuple[str, object]] = []


@contextmanager
def outer_settings(**values: object) -> Iterator[None]:
    """Add ``values`` (``name=value``, as :meth:`Validation.settings` takes them) to the
    fingerprint of every exchange made inside the block: a wrapper whose own setting
    changes a collective it makes after the loss (the drop-in ``ClipLoss``'s
    ``local_loss``: an int64 all-reduce or a float one) has it compared with the loss's,
    so ranks that differ raise one ``ValueError`` naming it before either collective."""
    if _compat.is_compiling():  # a ContextVar cannot be traced; dynamo records the list's
        _OUTER_TRACED.extend(values.items())
        yield
        del _OUTER_TRACED[len(_OUTER_TRACED) - len(values) :]
        return
    token = _OUTER.set(_OUTER.get() + tuple(values.items()))
    try:
        yield
    finally:
        _OUTER.reset(token)


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


def validate_together(
    enabled: bool,
    ref: object,
    *,
    name: str = "audio",
    min_global: int = 2,
    validate: bool = True,
    requested: bool | None = False,
) -> AbstractContextManager[Validation]:
    """Run a loss's input checks so that all ranks raise together or none does.

    Without gathering this only passes ``min_batch = min_global`` to the checks. Under
    gather a check that fails on one rank only would leave the other ranks waiting in the
    first collective forever (a hang, not an error). So the checks run with no local
    minimum (a rank may even hold no sample), and on leaving the block every rank shares,
    in one small ``all_gather`` of a fixed-length header, whether its checks ran and
    failed, its batch size, the settings registered with :meth:`Validation.settings` and
    the dtype and trailing shape of the tensors registered with :meth:`Validation.agree`:

    * if any rank failed, every rank raises that rank's error (the lowest failing rank's,
      same type and message everywhere);
    * if the ranks disagree on a setting (``temperature`` 0.05 and 0.07, ``reduction``,
      ``chunk_size`` ``None`` and 2, the scale's dtype, ...), on which tensors they
      gather, or on the number of this call among a loss Module's gathered calls
      (:func:`counted_call`), every rank raises a ``ValueError`` naming it and each
      rank's value;
    * if they disagree on a registered tensor's dtype or its sizes after the batch dim
      (``D = 8`` on one rank, ``16`` on another; ``ids`` int32 and int64: the gather
      would abort a rank), or on whether autograd records it (``torch.no_grad()`` or an
      input that requires grad on one rank only: that rank's backward would wait for a
      peer that makes none) every rank raises a ``ValueError`` naming it and both values;
    * if the *global* batch is below ``min_global`` every rank raises a ``ValueError``
      naming ``name``. Splits 1 + 6 and 0 + 2 are legal, 1 + 0 is not.

    ``ref`` is the first input; its device carries the collective (CPU when it is not a
    tensor; the current CUDA device under NCCL).

    Under ``torch.compile`` (``validate`` is then False: the value checks step aside)
    ``requested``, the caller's ``validate_args`` (``None``: the global default), decides:
    when on, the header is built in the graph and the custom op
    ``contrastive_losses::rank_header`` exchanges and reads it eager at every call, raising
    what eager raises (and, the ranks compiled, unequal batch sizes: a compiled loss
    exchanges none); a rank compiled while a peer runs eager raises on both. What the
    caller gathers after the block goes through :meth:`Validation.ordered`, so that no
    compiler can issue the gather before the exchange. A static check
    that fails while dynamo traces with ``fullgraph`` makes this rank's exchange at trace
    time, so its peers raise its error. Calls are not numbered there.

    With ``validate`` False (``validate_args=False``) the
    block's checks are the static ones and nothing is read back (no host sync), but under
    gather the rank still sends its header, all zeros, made on the device: the ranks
    whose checks run then see a rank without them and raise a ``ValueError`` naming
    ``validate_args`` and each rank's value, instead of pairing their header with that
    rank's first gather (a gloo abort of both processes). The rank without checks cannot
    learn of it without a sync: it goes on into its gather and waits there until the
    raising ranks' processes end (gloo then raises a connection error) or the process
    group times out. With the checks off on every rank a check that fails on one rank
    raises there alone (its peers wait in the next collective), and neither the
    settings, the shapes nor the global batch size are compared.
    """
    if not enabled:  # one process: nothing to exchange (a plain block, no generator)
        return nullcontext(Validation(min_batch=min_global))
    return _validate_together(ref, name, min_global, validate, requested)


@contextmanager
def _validate_together(
    ref: object, name: str, min_global: int, validate: bool, requested: bool | None
) -> Iterator[Validation]:
    """:func:`validate_together` under gather."""
    v = Validation(min_batch=0)
    device = _device(ref)
    if _compat.is_compiling():  # traced: no ContextVar, no object collective
        with _validate_traced(v, device, name, min_global, _requested(requested)):
            yield v
        return
    call = _number_call()  # counted with the checks off too: the counts stay equal
    if not validate:
        try:
            yield v
        finally:  # sent even when a check fails here: the collectives stay paired
            _exchange_header(torch.zeros(_HEADER, dtype=torch.long, device=device))
        return
    v.active = True
    if call is not None:
        v.fingerprint.append(call)
    v.settings(**dict(_OUTER.get()))
    error: Exception | None = None
    try:
        yield v
    except Exception as err:  # re-raised below, on every rank
        error = err
    shared = [_EAGER, int(error is not None), v.batch]
    if error is None:  # which tensors are gathered, by name: compared before their slots
        v.fingerprint.append(("gathered", ", ".join(n for n, _ in v.tensors)))
        shared += v._encoded_settings() + v._encoded()
    else:  # the same length, nothing to compare: the error is raised first
        shared += [0] * (_HEADER - 3)
    gathered = _exchange_header(torch.tensor(shared, device=device, dtype=torch.long))
    rows = gathered.tolist()
    names = [n for n, _ in v.tensors]
    _raise_disagreement(rows, names, lambda: _printed_settings(v), error, name, min_global)


def _printed_settings(v: Validation) -> list[tuple[str, str, str]]:
    """Each setting's name, printed value and ``repr`` (to word a disagreement)."""
    return [(k, _printed(x), repr(x)) for k, x in v.fingerprint]


def _requested(requested: bool | None) -> bool:
    """Whether a caller's ``validate_args`` asks for the checks (``None``: the global
    default); under ``torch.compile`` it decides whether the rank checks run."""
    if requested is None:
        from ._checks import default_validate_args

        return default_validate_args()
    return bool(requested)


@contextmanager
def _validate_traced(
    v: Validation, device: torch.device, name: str, min_global: int, checks: bool
) -> Iterator[None]:
    """:func:`validate_together` while dynamo traces. With the checks requested the header
    is built in the graph (the settings known at trace time as constants, a tensor
    setting's value and a symbolic size as tensors) and exchanged by the custom op
    ``contrastive_losses::rank_header``, which runs eager at every call of the compiled
    code: it gathers the ranks' headers, reads them and raises the same ``ValueError`` on
    every rank as the eager exchange. No ContextVar and no object collective is traced;
    calls are not numbered. Without the checks: the header of zeros, nothing read back."""
    if not checks:
        try:
            yield
        finally:
            rows = _exchange_header(torch.zeros(_HEADER, dtype=torch.long, device=device))
            # int64, exactly zero and read after the exchange (inductor folds `* 0` away)
            v.exchanged = rows[0, 0] - rows[0, 0]
        return
    v.active = True
    v.settings(**dict(_OUTER_TRACED))
    try:
        yield
    except (TypeError, ValueError) as err:  # a static check, failing while dynamo traces
        # dynamo reports the error re-raised here (fullgraph: as Unsupported, with its
        # message), once the peers have it
        _failed_while_tracing(type(err).__name__, str(err), str(device))
        raise
    v.fingerprint.append(("gathered", ", ".join(n for n, _ in v.tensors)))
    header, meta = _traced_header(v, device, name, min_global)
    v.exchanged = torch.ops.contrastive_losses.rank_header(header, meta)


def _traced_header(
    v: Validation, device: torch.device, name: str, min_global: int
) -> tuple[Tensor, str]:
    """The header as a tensor of the graph and what the op needs to word an error (the
    names, the printed constants) as one string, a constant of the trace.

    Every number goes in as a tensor (a float as its float64 bits): dynamo may have made
    a size, a float temperature or an int setting symbolic after a recompile, and only
    the names, types, strings and dtypes are trace-time constants."""
    numbers: list[tuple[int, object, bool]] = []  # (position, value, as float64 bits)
    template: list[tuple[str, object]] = []  # the settings with each number zeroed
    printed: list[bool] = []  # whether the setting's value is a constant to print
    for i, (key, value) in enumerate(v.fingerprint):
        at = 3 + i * _SETTING + 2
        if isinstance(value, bool):  # before int: a bool is one
            numbers.append((at, value, False))
            template.append((key, False))
        elif isinstance(value, int):
            numbers.append((at, value, False))
            template.append((key, 0))
        elif isinstance(value, (Tensor, float)):
            numbers.append((at, value, True))
            template.append((key, 0.0))
        else:  # None, a string, a dtype: a constant of the trace
            template.append((key, value))
        printed.append(not isinstance(value, (bool, int, float, Tensor)))
    slots: list[tuple[torch.dtype, bool, int]] = []
    for i, (_, x) in enumerate(v.tensors):
        dims = x.shape[1:]
        if len(dims) > _MAX_TRAILING:
            raise RuntimeError(f"validate_together: over {_MAX_TRAILING} trailing dims")
        base = 3 + _SETTING * _MAX_SETTINGS + i * _SLOT
        numbers.extend((base + 3 + j, d, False) for j, d in enumerate(dims))
        slots.append((x.dtype, bool(x.requires_grad and torch.is_grad_enabled()), len(dims)))
    numbers.append((2, v.batch, False))
    codes = _constant_codes(tuple(template), tuple(slots))
    header = torch.tensor([_COMPILED, 0, 0, *codes], dtype=torch.long, device=device)
    where = torch.tensor([at for at, _, _ in numbers], dtype=torch.long, device=device)
    values = torch.stack([_as_long(x, bits, device) for _, x, bits in numbers])
    header = header.index_put((where,), values)
    meta = _meta(tuple(template), tuple(printed), tuple(n for n, _ in v.tensors), name, min_global)
    return header, meta


def _failed_while_tracing(kind: str, message: str, device: str) -> tuple[str, str]:
    """A static check failed while dynamo traces this rank's call: with ``fullgraph=True``
    no graph will run, so the rank makes its exchange here, for real, at trace time (its
    peers' compiled or eager exchanges pair with it, and every rank raises this error;
    the ``(kind, message)`` returned is what this rank raises). Without ``fullgraph``
    dynamo breaks the graph there and runs the call eager, whose exchange is the one made:
    nothing is exchanged here."""
    try:  # dynamo's own record of the trace (private: a torch without it exchanges nothing)
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return kind, message
    if not (getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False)):
        return kind, message
    error = (TypeError if kind == "TypeError" else ValueError)(message)
    header = torch.zeros(_HEADER, dtype=torch.long, device=torch.device(device))
    header[0], header[1] = _COMPILED, 1
    rows = _exchange_header(header).tolist()
    try:
        _raise_disagreement(rows, [], list, error, "audio", 0)
    except (TypeError, ValueError) as raised:
        return type(raised).__name__, str(raised)
    return kind, message  # not reached: this rank failed, so every rank raises


def _as_long(x: object, bits: bool, device: torch.device) -> Tensor:
    """A 0-d int64 of a (maybe symbolic) int, or of the float64 bits of a float or a 0-d
    tensor (``bits``)."""
    if isinstance(x, Tensor):
        return x.detach().reshape(()).to(torch.float64).view(torch.int64)
    if bits:
        return torch.tensor(x, dtype=torch.float64, device=device).view(torch.int64)
    return torch.tensor(x, dtype=torch.long, device=device)


def _constant_codes(
    settings: tuple[tuple[str, object], ...], slots: tuple[tuple[torch.dtype, bool, int], ...]
) -> tuple[int, ...]:
    """The settings' and tensor slots' longs of a header, from trace-time constants (each
    number zero: set in the graph)."""
    v = Validation(min_batch=0, fingerprint=list(settings))
    out = v._encoded_settings() + [0] * (_SLOT * _MAX_AGREE)
    for i, (dtype, grad, ndim) in enumerate(slots):
        base = _SETTING * _MAX_SETTINGS + i * _SLOT
        out[base : base + 3] = [_dtype_code(dtype), int(grad), ndim]
    return tuple(out)


def _meta(
    settings: tuple[tuple[str, object], ...],
    printed: tuple[bool, ...],
    tensors: tuple[str, ...],
    name: str,
    min_global: int,
) -> str:
    """What the op needs to word an error, as JSON: every setting's name with its printed
    value and ``repr`` (``None`` for a number's: read from the header at run time)."""
    words = [
        [k, _printed(x), repr(x)] if constant else [k, None, None]
        for (k, x), constant in zip(settings, printed, strict=True)
    ]
    return json.dumps(
        {"settings": words, "tensors": list(tensors), "name": name, "min": min_global}
    )


if hasattr(torch.library, "custom_op"):  # torch >= 2.4; compile needs 2.7 (_compat)
    _constant_codes = torch.compiler.assume_constant_result(_constant_codes)
    _meta = torch.compiler.assume_constant_result(_meta)
    _failed_while_tracing = torch.compiler.assume_constant_result(_failed_while_tracing)

    @torch.library.custom_op("contrastive_losses::rank_header", mutates_args=())
    def _rank_header(header: Tensor, meta: str) -> Tensor:
        """Run eager inside compiled code: gather the ranks' headers, read them, raise
        what they disagree on (the same ``ValueError`` on every rank)."""
        info = json.loads(meta)
        rows = _exchange_header(header).tolist()
        mine = rows[dist.get_rank()]
        fingerprint = []
        for i, (key, printed, text) in enumerate(info["settings"]):
            if printed is None:  # a number: its code in this rank's header
                tag, code = mine[3 + i * _SETTING + 1 : 3 + i * _SETTING + 3]
                value = _float_of(code) if tag == _FLOAT_TAG else bool(code) if tag == 1 else code
                printed, text = _printed(value), repr(value)
            fingerprint.append((key, printed, text))
        _raise_disagreement(
            rows, info["tensors"], lambda: fingerprint, None, info["name"], info["min"]
        )
        return header.new_zeros(())

    @_rank_header.register_fake
    def _(header: Tensor, meta: str) -> Tensor:
        return header.new_zeros(())

    # its result is unused: without this the graph would drop the exchange
    torch.fx.node.has_side_effect(torch.ops.contrastive_losses.rank_header.default)


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
    :func:`_printed_settings` words them."""
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


@torch.compiler.disable
def _gather_objects(mine: object, world: int) -> list[object]:
    """Every rank's ``mine``: an object collective, never traced (dynamo fails inside
    one; after a graph break, ``torch.compile`` without ``fullgraph`` would try)."""
    out: list[object] = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _raise_settings(mine: list[tuple[str, str, str]], world: int) -> typing.NoReturn:
    """Raise the settings' disagreement, worded from every rank's fingerprint."""
    prints = _gather_objects(mine, world)
    raise ValueError(_settings_message(typing.cast(list[list[tuple[str, str, str]]], prints)))


def _local_sizes(n: int, device: torch.device) -> list[int]:
    size = torch.tensor([n], device=device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    return [int(s) for s in sizes]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def _unpad(gathered: Tensor, sizes: list[int], max_rows: int) -> Tensor:
    if all(s == max_rows for s in sizes):
        return gathered
    chunks = gathered.split(max_rows, dim=0)
    return torch.cat([c[:s] for c, s in zip(chunks, sizes, strict=False)], dim=0)


def _autograd_all_gather(x: Tensor) -> Tensor:
    """Gather along dim 0 with a backward that reduce-scatters (sums) into the owner."""
    from torch.distributed import _functional_collectives as fc

    group = dist.group.WORLD
    # torch >= 2.13 names it all_gather_single_autograd; 2.3–2.12 all_gather_tensor_autograd.
    fn = getattr(fc, "all_gather_single_autograd", None) or getattr(
        fc, "all_gather_tensor_autograd", None
    )
    if fn is not None:
        return fn(x.contiguous(), gather_dim=0, group=group)
    # torch 2.1–2.2: the older autograd-aware collective (backward is all_reduce + slice).
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous(), group=group), dim=0)


def _sizes(n: int, device: torch.device, equal_sizes: bool) -> list[int]:
    """Every rank's batch size: exchanged (one small ``all_gather`` and a host sync), or
    with ``equal_sizes`` taken to be this rank's ``n`` on every rank (no sync)."""
    if equal_sizes:
        return [n] * dist.get_world_size()
    return _local_sizes(n, device)


def all_gather_with_grad(x: Tensor, *, equal_sizes: bool = False) -> tuple[Tensor, int]:
    """Concatenate ``x`` from every rank along dim 0, keeping the autograd graph.

    Args:
        x: this rank's tensor ``(b_r, ...)``; ``b_r`` may differ across ranks.
        equal_sizes: promise that every rank passes the same ``b_r``: the sizes are not
            exchanged (no extra collective, no host sync). Unequal sizes then fail in the
            collective or gather garbage. The losses pass it with ``validate_args=False``.

    Returns:
        ``(gathered, offset)``: ``gathered`` is ``(sum_r b_r, ...)`` in rank order and
        ``gathered[offset:offset + b_r]`` are this rank's rows. Gradients that any rank
        sends into ``gathered`` are summed into the owner's ``x``.
    """
    sizes = _sizes(x.shape[0], x.device, equal_sizes)
    max_rows = max(sizes)
    gathered = _autograd_all_gather(_pad_rows(x, max_rows))
    offset = sum(sizes[: dist.get_rank()])
    return _unpad(gathered, sizes, max_rows), offset


def all_gather_no_grad(x: Tensor, *, equal_sizes: bool = False) -> Tensor:
    """Concatenate ``x`` (ids, masks, ...) from every rank along dim 0; no autograd.
    ``equal_sizes`` as in :func:`all_gather_with_grad`."""
    is_bool = x.dtype == torch.bool
    if is_bool:  # gloo cannot all_gather bool tensors
        x = x.to(torch.uint8)
    sizes = _sizes(x.shape[0], x.device, equal_sizes)
    max_rows = max(sizes)
    padded = _pad_rows(x, max_rows).contiguous()
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    gathered = _unpad(torch.cat(out, dim=0), sizes, max_rows)
    return gathered.bool() if is_bool else gathered
