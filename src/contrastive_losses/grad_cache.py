r"""Gradient caching: any loss of this library at a batch whose encoder activations do not fit.

Gao et al. 2021, *Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup*
(RepL4NLP). The loss needs every embedding of the batch; the encoders' activations for
backward need not all exist at once. With :math:`f` the audio encoder, :math:`g` the text
encoder, :math:`\mathcal{L}` the loss, and the batch split into chunks :math:`c`:

1. :math:`u_c = f(a_c)`, :math:`v_c = g(t_c)` for every chunk **without autograd**, the RNG
   state (CPU and every CUDA device the chunk touches) saved before each chunk;
2. :math:`\ell = \mathcal{L}(u, v)` on the concatenated embeddings made leaf tensors, and
   ``backward``: the loss's own parameters get their gradient, and
   :math:`\partial \ell / \partial u`, :math:`\partial \ell / \partial v` are *cached*;
3. each chunk re-encoded **with** autograd under its saved RNG state (same dropout masks) and
   back-propagated with its slice of the cached gradient:
   :math:`\nabla_\theta \ell = \sum_c (\partial u_c / \partial \theta)^\top
   \, \partial \ell / \partial u_c`.

Step 3 recomputes exactly what step 1 computed, so the gradients are those of the plain step
*run in the same chunks* up to float summation order (with dropout, the masks are drawn per
chunk: see the class); one extra forward of each encoder is the cost, and the largest set of
activations alive at once is one chunk's. What would make step 3 differ from step 1 is
refused (``_grad_cache_checks``), never turned into a silently wrong gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import _checks, distributed
from . import _grad_cache_checks as _gc_checks
from ._docs import init_doc

__all__ = ["GradCache"]

Inputs = Tensor | Mapping[str, Tensor] | Sequence[Tensor]
_BATCH_NORM_MODES = ("error", "per_chunk")


def _rows(inputs: Inputs, name: str) -> int:
    """The common dim-0 size of every tensor of ``inputs`` (checked)."""
    if isinstance(inputs, Tensor):
        tensors: list[tuple[str, Any]] = [(name, inputs)]
    elif isinstance(inputs, Mapping):
        tensors = [(f"{name}[{k!r}]", v) for k, v in inputs.items()]
    elif isinstance(inputs, Sequence) and not isinstance(inputs, str):
        tensors = [(f"{name}[{i}]", v) for i, v in enumerate(inputs)]
    else:
        raise TypeError(
            f"{name}: expected a Tensor, a mapping of tensors (a tokenizer's output) or a "
            f"tuple/list of tensors, got {type(inputs).__name__}"
        )
    if not tensors:
        raise ValueError(f"{name}: no tensors to split (empty {type(inputs).__name__})")
    sizes = {}
    for label, value in tensors:
        if not isinstance(value, Tensor):
            raise TypeError(f"{label}: expected a Tensor, got {type(value).__name__}")
        if value.dim() == 0:
            raise ValueError(f"{label}: expected at least one dimension to split, got a 0-d tensor")
        sizes[label] = value.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{name}: every tensor must have the same size along dim 0, got {sizes}")
    n = next(iter(sizes.values()))
    if n == 0:
        raise ValueError(f"{name}: empty batch (0 rows along dim 0)")
    return n


def _split(inputs: Inputs, chunk_size: int) -> list[Inputs]:
    """``inputs`` cut along dim 0 into chunks of ``chunk_size`` rows (views, no copy)."""
    if isinstance(inputs, Tensor):
        return list(inputs.split(chunk_size))
    if isinstance(inputs, Mapping):
        parts = {k: v.split(chunk_size) for k, v in inputs.items()}
        count = len(next(iter(parts.values())))
        return [{k: p[i] for k, p in parts.items()} for i in range(count)]
    columns = [v.split(chunk_size) for v in inputs]
    return [tuple(c[i] for c in columns) for i in range(len(columns[0]))]


def _call(encoder: Callable[..., Tensor], chunk: Inputs, name: str) -> Tensor:
    """``encoder(chunk)``; a mapping is passed as keywords, a tuple/list as positionals."""
    if isinstance(chunk, Tensor):
        out = encoder(chunk)
    elif isinstance(chunk, Mapping):
        out = encoder(**chunk)
    else:
        out = encoder(*chunk)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"{name}: the encoder must return a Tensor of embeddings, got {type(out).__name__} "
            "(wrap it: lambda **x: model(**x).pooler_output)"
        )
    return out


def _owner(encoder: Callable[..., Any]) -> nn.Module | None:
    """The Module behind ``encoder``: itself, or the object of a bound method."""
    if isinstance(encoder, nn.Module):
        return encoder
    owner = getattr(encoder, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _tensors(inputs: Inputs) -> list[Tensor]:
    if isinstance(inputs, Tensor):
        return [inputs]
    return list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)


@dataclass
class _RngState:
    """The CPU generator's state and the state of each given CUDA device's generator
    (what :func:`torch.utils.checkpoint.checkpoint` saves for its recompute)."""

    cpu: Tensor
    cuda: list[Tensor]
    devices: list[int]

    @classmethod
    def capture(cls, devices: list[int]) -> _RngState:
        return cls(torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], devices)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block from this state; every generator is put back as found on exit."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            yield


def _cuda_devices(inputs: Inputs, owner: nn.Module | None) -> list[int]:
    tensors = _tensors(inputs) + (list(owner.parameters()) if owner is not None else [])
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


@dataclass
class _Tower:
    """One encoder's cached pass: its chunks, their RNG states and output rows, its leaf
    embeddings, the batch-norm layers it called, its DDP (if any) and whether that DDP
    all-reduces in this step."""

    name: str
    encoder: Callable[..., Tensor]
    chunks: list[Inputs]
    states: list[_RngState]
    rows: list[int]
    embeddings: Tensor
    batch_norms: list[nn.Module]
    ddp: nn.parallel.DistributedDataParallel | None
    syncs: bool


def _ddp_of(encoder: Callable[..., Any]) -> nn.parallel.DistributedDataParallel | None:
    """The DDP behind ``encoder``: itself or the object of its bound method (``ddp.forward``)."""
    owner = _owner(encoder)
    return owner if isinstance(owner, nn.parallel.DistributedDataParallel) else None


def _snapshot(modules: list[nn.Module]) -> list[tuple[Tensor, Tensor]]:
    """(buffer, copy) of every buffer of ``modules``, to undo a replay's statistics update."""
    return [
        (b, b.detach().clone()) for m in modules for b in m.buffers(recurse=False) if b is not None
    ]


@init_doc
class GradCache:
    r"""One training step of ``loss_fn`` on two encoders, in the memory of ``chunk_size`` rows.

    ``loss = cache(audio_encoder, audio_inputs, text_encoder, text_inputs, **loss_kwargs)``
    leaves in every ``.grad`` what
    ``loss_fn(audio_encoder(audio_inputs), text_encoder(text_inputs), **loss_kwargs).backward()``
    leaves -- both encoders' parameters and the loss's own (a learnable temperature, SigLIP's
    bias, SVR's radius or :class:`~contrastive_losses.RadiusPredictor`) -- while no encoder
    ever holds the autograd graph of more than ``chunk_size`` rows (Gao et al. 2021):

    1. each encoder runs on chunks of ``chunk_size`` rows under :func:`torch.no_grad`, the
       RNG state (CPU and the CUDA devices of the chunk and of the encoder's parameters, as
       :func:`torch.utils.checkpoint.checkpoint` saves it) kept before each chunk;
    2. ``loss_fn`` runs once on the concatenated embeddings, leaf tensors, and is
       back-propagated (through ``scaler.scale(loss)`` when a ``scaler`` is given, so the
       cached gradients are scaled once);
    3. each chunk runs again with autograd under its saved RNG state (dropout draws the same
       masks) and ``backward`` pushes its slice of the cached gradient into the encoder.

    Afterwards every generator is in the state the plain step leaves. The cost is one extra
    forward of each encoder; the memory is one chunk's activations plus the ``(B, D)``
    embeddings and the loss's own memory (tile the loss with its ``chunk_size`` when the
    ``B x B`` logits are the larger part: the two compose).

    **Dropout**: the gradients are those of the plain step *run in the same chunks* (each
    encoder called on chunk after chunk with autograd, from the same RNG state: the same
    masks; equal to 6e-8 relative in float32), not those of one full-batch call, whose masks
    are other draws: with dropout 0.1 in the CED and transformer of
    ``benchmarks/bench_grad_cache_checks.py`` (B = 64, chunks of 16) the encoders'
    gradients are 0.30 apart (relative L2) from the full-batch step's, as far as two
    full-batch steps from different seeds are (0.36; 0.31-0.38 over 5 seeds). Without
    dropout the two are equal.

    **Refused, never silently wrong**: the replay must compute what the first pass computed.
    Each replayed chunk is compared with its cached embedding before its ``backward``
    (``check_replay``); a ``RuntimeError`` names the encoder, the chunk, the largest
    difference and the likely causes: randomness outside torch's generators (Python
    ``random``, numpy, a private ``torch.Generator``), state updated in forward, an
    in-place op on the input, a forward that reads grad mode. Before any gradient exists a
    ``ValueError`` refuses an input tensor changed in place by the first pass (its version
    counter), a buffer that the modules called in the first pass changed (a counter, a
    running normaliser, spectral norm's power iteration; batch-norm statistics are handled
    by ``batch_norm``), and trainable modules of a live ``DistributedDataParallel`` reached
    without its forward. The modules are those actually called (a global forward pre-hook
    during the first pass, this thread only), so a ``lambda`` or ``functools.partial``
    around a model hides nothing. Not seen: batch statistics computed without a module
    (``F.batch_norm(..., training=True)`` in a forward) and state outside buffers (a plain
    attribute, a write through ``.data``) -- unless they change the replayed output, which
    the replay check catches.

    Args:
        loss_fn: a loss of this library (any ``Module`` or function taking
            ``(audio_embeddings, text_embeddings, **loss_kwargs)`` and returning a scalar or
            ``(scalar, terms)``). For other layouts pass a function: CACL with English and
            another language stacked in ``text_inputs`` is
            ``lambda a, t, **kw: cacl(a, t[:B], t[B:], **kw)``.
        chunk_size: rows of ``audio_inputs`` / ``text_inputs`` (their dim 0) per encoder
            call, ``>= 1``.
        scaler: a :class:`torch.amp.GradScaler` (AMP with float16): the loss is scaled before
            its backward, hence every cached gradient and every encoder gradient; call
            ``scaler.step(optimizer)`` and ``scaler.update()`` afterwards as usual. ``None``
            (default): no scaling (float32, bfloat16).
        batch_norm: a batch-norm layer in training mode inside an encoder normalises each
            chunk by the chunk's statistics, not the batch's, so the step is no longer the
            plain step. ``"error"`` (default) refuses it with a ``ValueError`` when the
            encoder's inputs span more than one chunk (put those layers in ``eval()`` or use
            LayerNorm / GroupNorm); ``"per_chunk"`` accepts the chunk statistics, as DDP
            without ``SyncBatchNorm`` accepts each rank's (the gradient is then exact for
            that per-chunk forward). Either way the replay does not update the running
            statistics a second time. The layers are found among the modules called in the
            first pass (behind a bound method, a ``lambda`` or a ``functools.partial`` too);
            a layer in eval mode without running statistics also normalises by the batch.
        check_replay: compare each replayed chunk with its first pass before its
            ``backward`` (default ``True``): a difference beyond
            ``16 * finfo(dtype).eps * max |embedding of the chunk|`` raises a
            ``RuntimeError`` (the ``.grad`` of the chunks replayed before it and of the
            loss's parameters are then partial). On CPU the two passes are bit-identical;
            the margin covers GPU kernels without a fixed reduction order and fused
            inference paths (``nn.TransformerEncoderLayer`` in ``eval()``: 2-4 ulps). Its
            cost: one host sync per chunk; not measurable on CPU at ``B = 256``, chunks of
            32 (CPU-time ratio 1.000, runs 0.992-1.006:
            ``benchmarks/bench_grad_cache_checks.py``). ``False`` skips the comparison
            only: the other refusals above always run.
        validate_args: under a process group of more than one rank, check after the step
            that each ``DistributedDataParallel`` encoder's gradients are the same on every
            rank (one all-reduce of four float64 numbers per encoder and a host sync; a
            ``RuntimeError`` on every rank otherwise). ``None`` (default): the library's
            default (:func:`~contrastive_losses.set_default_validate_args`); skipped for a
            DDP inside the caller's own ``no_sync()``.

    Call:
        ``cache(audio_encoder, audio_inputs, text_encoder, text_inputs, **loss_kwargs)``.
        Each encoder is a callable (a Module, a bound method); its inputs are a tensor, a
        mapping of tensors (a tokenizer's output, passed as keywords: ``encoder(**chunk)``)
        or a tuple/list of tensors (passed as positionals), split along dim 0. K captions
        per clip: give ``text_inputs`` as ``(B, K, L)`` tokens to a text encoder that
        returns ``(b, K, D)``, and KCL's ``mask=`` among ``loss_kwargs``; or flatten the
        captions to ``(B*K, L)`` and reshape in ``loss_fn``. ``loss_kwargs`` go to
        ``loss_fn`` unchanged (``mask=``, ``ids=``, ``return_terms=True``, ...). Under
        ``torch.autocast`` both passes run under it. An encoder that is a
        :class:`~torch.nn.parallel.DistributedDataParallel` module re-runs every chunk but
        its last under ``no_sync()``: its gradients are all-reduced once per step (with
        ``static_graph=True``, which torch cannot run under ``no_sync()``, every chunk's
        backward all-reduces: the same gradients, ``B / chunk_size`` times the traffic).
        Pass the DDP itself: a tower reached around it (``ddp.module.encode_audio``, a
        submodule of ``ddp.module``, a lambda around either) would never be all-reduced
        and is refused; wrap each tower in its own DDP instead. The live DDPs are found
        once per module by a scan of the garbage collector's objects, and only under an
        initialised process group. A loss
        with ``gather=True`` gathers the embeddings across ranks as it does in the plain
        step (its own parameters are not DDP's business here any more than in the plain
        step: wrap the loss in DDP too, or average them, as you would there).

    Returns:
        The loss, detached (``(loss, terms)`` when ``loss_fn`` returns a pair).

    Shape:
        - ``audio_inputs``: ``(B, ...)``; ``text_inputs``: ``(B_t, ...)`` (``B_t = B``,
          ``B*K``, ``2B``: whatever ``loss_fn`` pairs with the audio).
        - The encoders' outputs: ``(b, D)`` (or ``(b, K, D)``) per chunk of ``b`` rows,
          concatenated along dim 0 into ``(B, D)`` / ``(B_t, D)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from contrastive_losses import GradCache, InfoNCELoss
        >>> audio_enc, text_enc = nn.Linear(6, 4), nn.Linear(5, 4)
        >>> cache = GradCache(InfoNCELoss(temperature=0.1), chunk_size=2)
        >>> loss = cache(audio_enc, torch.randn(8, 6), text_enc, torch.randn(8, 5))
        >>> loss.requires_grad, audio_enc.weight.grad.shape
        (False, torch.Size([4, 6]))
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        chunk_size: int,
        *,
        scaler: torch.amp.GradScaler | None = None,
        batch_norm: Literal["error", "per_chunk"] = "error",
        check_replay: bool = True,
        validate_args: bool | None = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable loss, got {type(loss_fn).__name__}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
        if scaler is not None and not callable(getattr(scaler, "scale", None)):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        if batch_norm not in _BATCH_NORM_MODES:
            raise ValueError(f"batch_norm: expected one of {_BATCH_NORM_MODES}, got {batch_norm!r}")
        if not isinstance(check_replay, bool):
            raise TypeError(f"check_replay: expected True or False, got {check_replay!r}")
        _checks.resolve_validate(validate_args)  # the type check
        self.loss_fn = loss_fn
        self.chunk_size = chunk_size
        self.scaler = scaler
        self.batch_norm = batch_norm
        self.check_replay = check_replay
        self.validate_args = validate_args

    def __repr__(self) -> str:
        return (
            f"GradCache({self.loss_fn!r}, chunk_size={self.chunk_size}, "
            f"scaler={self.scaler!r}, batch_norm={self.batch_norm!r}, "
            f"check_replay={self.check_replay}, validate_args={self.validate_args})"
        )

    def __call__(
        self,
        audio_encoder: Callable[..., Tensor],
        audio_inputs: Inputs,
        text_encoder: Callable[..., Tensor],
        text_inputs: Inputs,
        **loss_kwargs: Any,
    ) -> Any:
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "GradCache: called with gradients disabled (torch.no_grad / inference_mode); "
                "it runs a backward pass, call it in the training step"
            )
        towers = [
            self._encode("audio_encoder", audio_encoder, audio_inputs, "audio_inputs"),
            self._encode("text_encoder", text_encoder, text_inputs, "text_inputs"),
        ]
        out = self.loss_fn(towers[0].embeddings, towers[1].embeddings, **loss_kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn: GradCache needs a scalar loss to back-propagate, got {shape} "
                "(reduction='none'? reduce it in loss_fn)"
            )
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self._replay(towers)
        if distributed.is_distributed() and _checks.resolve_validate(self.validate_args):
            synced = {id(t.ddp): (t.name, t.ddp) for t in towers if t.ddp is not None and t.syncs}
            _gc_checks.check_ranks_agree(list(synced.values()))
        detached = loss.detach()
        return (detached, *out[1:]) if isinstance(out, tuple) else detached

    def _encode(
        self, name: str, encoder: Callable[..., Tensor], inputs: Inputs, inputs_name: str
    ) -> _Tower:
        """Step 1 for one encoder: chunks under ``no_grad``, RNG state before each; then
        refuse what the replay could not reproduce (module calls watched, inputs' versions)."""
        if not callable(encoder):
            raise TypeError(f"{name}: expected a callable encoder, got {type(encoder).__name__}")
        rows = _rows(inputs, inputs_name)
        owner = _owner(encoder)
        ddp = _ddp_of(encoder)
        versions = _gc_checks.InputVersions(inputs, inputs_name)
        refuse = self.batch_norm == "error" and rows > self.chunk_size
        watch = _gc_checks.ModuleWatch(name, owner, refuse_batch_norm=refuse)
        devices = _cuda_devices(inputs, owner)
        chunks = _split(inputs, self.chunk_size)
        states, outputs = [], []
        with torch.no_grad(), watch:
            for chunk in chunks:
                states.append(_RngState.capture(devices))
                outputs.append(_call(encoder, chunk, name))
        versions.check(name)
        watch.check_buffers()
        modules = list(watch.modules.values())
        _gc_checks.check_ddp_reached(name, encoder, modules)
        embeddings = torch.cat(outputs).detach().requires_grad_(True)
        # a DDP inside the caller's own no_sync() (accumulation) does not all-reduce now
        syncs = ddp is not None and ddp.require_backward_grad_sync
        return _Tower(
            name, encoder, chunks, states, [o.shape[0] for o in outputs], embeddings,
            watch.batch_norms, ddp, syncs,
        )  # fmt: skip

    def _replay(self, towers: list[_Tower]) -> None:
        """Step 3: re-encode each chunk with autograd, compare it with its first pass
        (``check_replay``) and back-propagate its cached slice; a DDP encoder all-reduces on
        its last chunk only (on every chunk with ``static_graph=True``, which torch cannot
        run under ``no_sync``); batch-norm statistics are put back as the first pass left
        them."""
        runs = [
            (tower, i) for tower in towers if tower.embeddings.grad is not None
            for i in range(len(tower.chunks))
        ]  # fmt: skip
        last = {id(tower.ddp): n for n, (tower, _) in enumerate(runs)}
        stop: set[int] = set()  # towers whose encoder has nothing to train
        saved = _snapshot([m for tower in towers for m in tower.batch_norms])
        try:
            for n, (tower, i) in enumerate(runs):
                if id(tower) in stop:
                    continue
                if not self._replay_chunk(tower, i, defer_sync=last[id(tower.ddp)] != n):
                    stop.add(id(tower))  # a frozen encoder: nothing to back-propagate
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    def _replay_chunk(self, tower: _Tower, i: int, defer_sync: bool) -> bool:
        """Chunk ``i`` of ``tower`` re-encoded and back-propagated; False when its output
        needs no gradient."""
        grad = tower.embeddings.grad
        assert grad is not None  # runs holds only towers the loss reached
        ddp = tower.ddp
        no_sync = ddp is not None and defer_sync and not ddp.static_graph
        start = sum(tower.rows[:i])
        rows = slice(start, start + tower.rows[i])
        sync_off = ddp.no_sync() if ddp is not None and no_sync else contextlib.nullcontext()
        with sync_off, tower.states[i].replay():
            out = _call(tower.encoder, tower.chunks[i], tower.name)
            if not out.requires_grad:
                return False
            if self.check_replay:
                cached = tower.embeddings.detach()[rows]
                _gc_checks.check_replay(tower.name, tower.encoder, i, rows, out, cached)
            out.backward(grad[rows].to(out.dtype))
        return True
