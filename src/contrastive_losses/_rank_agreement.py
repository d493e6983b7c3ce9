"""Rank agreement behind :mod:`contrastive_losses.distributed`: the checks that make
every rank raise together (:func:`validate_together`, eager and under ``torch.compile``
through the custom op ``contrastive_losses::rank_header``), the numbering of a loss
Module's gathered calls (:func:`counted_call`, :func:`call_count`,
:func:`check_call_counts`) and a wrapper's own settings (:func:`outer_settings`).

Private: import from :mod:`contrastive_losses.distributed`. The header's layout, its
encoding and the messages are in :mod:`contrastive_losses._rank_header`.
"""

from __future__ import annotations

import functools
import json
import typing
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import Tensor

from . import _compat
from ._gather import _device, is_distributed
from ._rank_header import (
    _CALL_KEY,
    _COMPILED,
    _COUNT_KEY,
    _EAGER,
    _FLOAT_TAG,
    _HEADER,
    _MAX_AGREE,
    _MAX_SETTINGS,
    _MAX_TRAILING,
    _ORDER_KEY,
    _SETTING,
    _SLOT,
    Validation,
    _dtype_code,
    _exchange_header,
    _float_of,
    _printed,
    _raise_disagreement,
)

# The loss Module call that is running ([owner, its number or 0 until its first
# exchange]), set by counted_call; validate_together numbers the call at its first
# exchange and puts the number in the fingerprint.
_CALL: ContextVar[list[typing.Any] | None] = ContextVar("contrastive_losses_call", default=None)
_CALLS: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
# Each owner's calls in order, run-length encoded: [[kind, how many in a row], ...], the
# kind "training" (grad mode on) or "evaluation" (off), as the call's first exchange saw.
_KINDS: weakref.WeakKeyDictionary[object, list[list[typing.Any]]] = weakref.WeakKeyDictionary()
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


# Settings of a wrapper around a loss (open_clip's drop-ins: ``local_loss``) that change
# what it does across ranks after the loss: added to every exchange made inside it.
_OUTER: ContextVar[tuple[tuple[str, object], ...]] = ContextVar(
    "contrastive_losses_outer", default=()
)


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
