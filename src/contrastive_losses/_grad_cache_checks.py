"""What :class:`~contrastive_losses.GradCache` checks so that it never returns a silently
wrong gradient.

GradCache's gradient is right only when the replay (step 3) computes what the first pass
(step 1) computed. These checks refuse, with an error that names the cause and the fix,
what breaks that:

* :class:`ModuleWatch` sees the modules actually *called* in the first pass (a global
  forward pre-hook, this thread only, installed for that pass alone: a ``lambda`` or a
  ``functools.partial`` cannot hide a module) -- the batch-norm layers that use batch
  statistics, and the buffers those modules changed;
* :class:`InputVersions`: an input tensor changed in place by the first pass (its version
  counter);
* :func:`check_replay`: a replayed chunk that differs from its cached embedding;
* :func:`check_ddp_reached`: trainable modules that belong to a live
  ``DistributedDataParallel`` whose forward the encoder never calls (its gradients would
  not be all-reduced);
* :func:`check_ranks_agree`: after the step, the DDP encoders' gradients are the same on
  every rank (one small all-reduce).

What it cannot see: batch statistics computed without a module (``F.batch_norm(...,
training=True)`` called in a forward), state kept outside buffers (a plain attribute or
a Python list updated in forward, a buffer written through ``.data``) unless it changes
the replayed output, which :func:`check_replay` then catches.
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

DDP = nn.parallel.DistributedDataParallel

# A replayed chunk may differ from its first pass by this many ulps of its dtype times the
# chunk's largest magnitude: on CPU the two passes are bit-identical (difference 0); the
# margin is for kernels that do not reduce in a fixed order (GPU atomics) and for fused
# inference paths taken under no_grad (nn.TransformerEncoderLayer in eval(): 2-4 ulps
# measured at depth 4-24).
REPLAY_ULPS = 16

# Relative spread of the ranks' gradient fingerprints (sum of |grad| in float64) that
# still counts as equal: DDP leaves bit-identical gradients on every rank (spread 0).
RANK_RTOL = 1e-5

_CAUSES = (
    "randomness outside torch's global generators (Python `random`, numpy, a private "
    "torch.Generator: draw from torch's generator instead, e.g. seed yours inside forward "
    "with g.manual_seed(int(torch.randint(2**62, ()))), which GradCache replays); a buffer "
    "or attribute updated in forward; an in-place op on the input; a forward that reads "
    "grad mode (torch.is_grad_enabled(), a fused inference path such as "
    "nn.TransformerEncoderLayer's in eval() under no_grad)"
)


def describe(encoder: Any) -> str:
    """A short name for an encoder in messages: ``Model``, ``Model.encode_audio``,
    ``partial(f)``, ``<lambda>``."""
    if isinstance(encoder, functools.partial):
        return f"partial({describe(encoder.func)})"
    owner = getattr(encoder, "__self__", None)
    if owner is not None and hasattr(encoder, "__func__"):
        return f"{type(owner).__name__}.{encoder.__func__.__name__}"
    if isinstance(encoder, nn.Module):
        return type(encoder).__name__
    return getattr(encoder, "__qualname__", type(encoder).__name__)


def uses_batch_statistics(module: nn.Module) -> bool:
    """A batch-norm layer that normalises by the batch's statistics: in training mode, or
    in eval mode without running statistics (``track_running_stats=False``)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or module.running_mean is None
    )


def _names(modules: list[nn.Module]) -> dict[int, str]:
    """``id(module) -> name`` relative to the first module (the outermost one called)."""
    names = {id(m): type(m).__name__ for m in modules}
    if modules:
        names.update({id(m): n or type(m).__name__ for n, m in modules[0].named_modules()})
    return names


class ModuleWatch:
    """The modules called in a first pass (in call order, each once) and their buffers'
    version counters before their first call; refuses a batch-norm layer that uses batch
    statistics before it runs when ``refuse_batch_norm``.

    ``owner`` (the Module of a bound-method encoder, called without ``__call__``) is
    watched from the start."""

    def __init__(self, name: str, owner: nn.Module | None, refuse_batch_norm: bool) -> None:
        self.name = name
        self.refuse_batch_norm = refuse_batch_norm
        self.modules: dict[int, nn.Module] = {}
        self.buffers: list[tuple[nn.Module, str, Tensor, int]] = []
        self._thread = threading.get_ident()
        self._handle: Any = None
        if owner is not None:
            self._see(owner)

    def __enter__(self) -> ModuleWatch:
        hooks = torch.nn.modules.module
        self._handle = hooks.register_module_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _hook(self, module: nn.Module, args: object) -> None:
        # another thread's modules are not this encoder's
        if threading.get_ident() == self._thread and id(module) not in self.modules:
            self._see(module)

    def _see(self, module: nn.Module) -> None:
        self.modules[id(module)] = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if uses_batch_statistics(module) and self.refuse_batch_norm:
                label = _names(list(self.modules.values()))[id(module)]
                raise ValueError(
                    f"{self.name}: batch-norm layers in training mode or without running "
                    f"statistics ({label}: {type(module).__name__}) normalise each chunk by its "
                    "own statistics, so GradCache would not give the plain step; put them in "
                    "eval() (or use LayerNorm/GroupNorm), or pass "
                    "GradCache(..., batch_norm='per_chunk') to accept the per-chunk statistics"
                )
            return  # its running statistics: restored after the replay, not refused
        self.buffers += [
            (module, key, b, b._version) for key, b in module._buffers.items() if b is not None
        ]

    @property
    def batch_norms(self) -> list[nn.Module]:
        """The batch-norm layers called that use batch statistics."""
        return [m for m in self.modules.values() if uses_batch_statistics(m)]

    def check_buffers(self) -> None:
        """Refuse buffers that the first pass replaced or changed in place."""
        changed = [
            (m, key) for m, key, b, v in self.buffers
            if m._buffers.get(key) is not b or b._version != v
        ]  # fmt: skip
        if not changed:
            return
        names = _names(list(self.modules.values()))
        listed = ", ".join(f"{names[id(m)]}.{key}" for m, key in changed[:6])
        raise ValueError(
            f"{self.name}: its forward changed buffers ({listed}) in GradCache's first pass; "
            "the replay would run with the changed values and change them again, so the "
            "gradients would not be the plain step's. Typical: a counter or a running "
            "normaliser updated in forward, spectral norm's power iteration in training mode "
            "(torch.nn.utils.spectral_norm or parametrizations.spectral_norm). Fix: update "
            "such state once per step outside the encoder's forward; for spectral norm, run "
            "the encoder once under torch.no_grad() before the step (one power iteration) and "
            "put the spectral-normed layers in eval() for the GradCache call. The first pass "
            "has updated the buffers once; no gradient was accumulated"
        )


def _tensors(inputs: Any, name: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(inputs, Tensor):
        yield name, inputs
    elif isinstance(inputs, Mapping):
        yield from ((f"{name}[{k!r}]", v) for k, v in inputs.items())
    else:
        yield from ((f"{name}[{i}]", v) for i, v in enumerate(inputs))


class InputVersions:
    """The version counters of an encoder's input tensors (a chunk is a view: it shares
    its tensor's counter), to refuse an in-place op on them in the first pass."""

    def __init__(self, inputs: Any, name: str) -> None:
        self.seen = [(label, t, t._version) for label, t in _tensors(inputs, name)]

    def check(self, encoder_name: str) -> None:
        for label, tensor, version in self.seen:
            if tensor._version != version:
                raise ValueError(
                    f"{encoder_name}: {label} was modified in place by the encoder during "
                    f"GradCache's first pass (its version counter went from {version} to "
                    f"{tensor._version}): the replay would encode other inputs, and the "
                    "caller's batch has changed. Fix: make the op out of place, or clone in "
                    "the encoder first (x = x.clone()); no gradient was accumulated"
                )


def check_replay(
    name: str, encoder: Any, index: int, rows: slice, out: Tensor, cached: Tensor
) -> None:
    """Raise when a replayed chunk ``out`` differs from its first pass ``cached`` by more
    than :data:`REPLAY_ULPS` ulps of its dtype times the chunk's largest magnitude."""
    where = f"{name} ({describe(encoder)}), chunk {index} (rows {rows.start}:{rows.stop})"
    if out.shape != cached.shape or out.dtype != cached.dtype:
        gap = f"returned {tuple(out.shape)} {out.dtype}, the first pass {tuple(cached.shape)} "
        summary = gap + f"{cached.dtype}"
    else:
        out = out.detach()
        diff = (out - cached).abs().masked_fill(out == cached, 0)  # inf == inf: no gap
        scale = cached.abs().masked_fill(~cached.isfinite(), 0).amax() if cached.numel() else 0
        worst, scale = torch.stack([diff.amax(), torch.as_tensor(scale).to(diff)]).tolist()
        if worst != worst:  # NaN: the same NaN entries in both passes are no difference
            both = out.isnan() & cached.isnan()
            worst = float(diff.masked_fill(both, 0).amax())
        eps = torch.finfo(out.dtype).eps if out.is_floating_point() else 0.0
        bound = REPLAY_ULPS * eps * scale
        if worst <= bound:
            return
        summary = (
            f"differs from its first pass by up to {worst:.3g} (tolerance {bound:.3g}: "
            f"{REPLAY_ULPS} ulps of {out.dtype} x the chunk's largest magnitude {scale:.3g})"
        )
    raise RuntimeError(
        f"GradCache: the replay of {where} {summary}: the encoder did not compute the same "
        f"function twice, so the gradient would be silently wrong. Likely causes: {_CAUSES}. "
        "The .grad of the loss's parameters and of the chunks replayed before this one is "
        "partial: zero the gradients before the next step. GradCache(..., check_replay=False) "
        "skips this check (the gradients are then those of the replayed forward)"
    )


# module -> the DDP whose module tree holds it (a weak reference), or None: looked up once
# per module, by one scan of the garbage collector's objects
_WRAPPER: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _find_wrappers(modules: list[nn.Module]) -> None:
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads a stranger's __class__, which can run
        # code (a lazy module's import, a deprecated alias's warning) and hang a rank
        if issubclass(type(obj), DDP):
            ref = weakref.ref(obj)
            for m in obj.module.modules():
                _WRAPPER[m] = ref
    for m in modules:
        _WRAPPER.setdefault(m, None)


def check_ddp_reached(name: str, encoder: Any, modules: list[nn.Module]) -> None:
    """Refuse trainable modules called in the first pass that belong to a live DDP whose
    own forward was not called (a bound method of ``ddp.module``, a submodule of it, a
    lambda around either): DDP all-reduces only the gradients of the forward it runs."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # no process group, no DDP
    trainable = [m for m in modules if any(p.requires_grad for p in m.parameters(False))]
    unknown = [m for m in trainable if m not in _WRAPPER]
    if unknown:
        _find_wrappers(unknown)
    called = {id(m) for m in modules}
    for m in trainable:
        ref = _WRAPPER.get(m)
        ddp = ref() if ref is not None else None
        if ddp is not None and id(ddp) not in called:
            model = type(ddp.module).__name__
            raise ValueError(
                f"{name} ({describe(encoder)}): its modules belong to "
                f"DistributedDataParallel({model}) but that DDP's forward is never called: "
                "DDP all-reduces only the gradients of the forward it runs, so each rank "
                "would keep its own gradients. Wrap each tower in its own DDP and pass those "
                "(audio = DDP(model.audio_tower); cache(audio, a, text, t)), or keep these "
                "parameters out of DDP and all-reduce their gradients yourself after the step"
            )


def _fingerprint(ddp: DDP) -> Tensor:
    """``[sum of grad, sum of |grad|]`` in float64 over the parameters DDP synchronises."""
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    grads = [
        p.grad for n, p in ddp.module.named_parameters() if p.grad is not None and n not in ignored
    ]
    device = next(ddp.module.parameters()).device
    if not grads:
        return torch.zeros(2, dtype=torch.float64, device=device)
    return torch.stack(
        [
            torch.stack([g.sum(dtype=torch.float64) for g in grads]).sum(),
            torch.stack([g.abs().sum(dtype=torch.float64) for g in grads]).sum(),
        ]
    )


def check_ranks_agree(towers: list[tuple[str, DDP]]) -> None:
    """After the step: raise on every rank when a DDP encoder's gradients differ across
    ranks (one all-reduce of four float64 numbers per encoder, a host sync)."""
    for name, ddp in towers:
        f = _fingerprint(ddp)
        both = torch.cat([f, -f])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ddp.process_group)
        high, low = both[:2], -both[2:]
        spread, scale = float((high - low).abs().max()), float(high[1].abs())
        if spread > RANK_RTOL * scale:
            raise RuntimeError(
                f"GradCache: after the step the gradients of {name} (DistributedDataParallel"
                f"({type(ddp.module).__name__})) differ across ranks (sum of |grad| from "
                f"{float(low[1]):.6g} to {float(high[1]):.6g}, sum of grad from "
                f"{float(low[0]):.6g} to {float(high[0]):.6g}): DDP did not all-reduce them. "
                "Likely: parameters reached without the DDP's forward, a communication hook "
                "that leaves them different (local SGD: pass validate_args=False), "
                "or a no_sync() left open"
            )
