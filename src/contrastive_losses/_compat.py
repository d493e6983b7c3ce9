"""What differs between the torch releases the package admits: one place for the shims,
and for the refusals, each naming the torch version and what to do.

The measured matrix (which release ran what, with which result) is in the docs, page
"Supported versions".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch

# The floor: the oldest torch on which the compat subset passed (every loss eager, dense
# and tiled; docs: "Supported versions", which says what of the whole suite did not).
MIN_TORCH = (2, 1)
# The oldest torch under which dynamo traces every loss with fullgraph=True (older ones
# cannot trace the losses' context managers, e.g. distributed.validate_together).
MIN_TORCH_COMPILE = (2, 7)
# SupportVectorRegularizer's checks: dynamo 2.7 and 2.8 fail on them ("Graph break under
# GenericContextWrappingVariable"); 2.9 is the oldest measured to trace it (2.9.1, 2.10.0:
# compiled == eager, one graph; docs: "Supported versions").
MIN_TORCH_COMPILE_SVR = (2, 9)


def torch_version(version: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``version`` (default: the running torch), local and
    pre-release tags dropped: ``"2.11.0+cu130"`` and ``"2.12.0a0"`` give ``(2, 11, 0)``
    and ``(2, 12, 0)``."""
    text = torch.__version__ if version is None else version
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]] + [0, 0]
    return parts[0], parts[1], parts[2]


TORCH = torch_version()

if hasattr(torch.compiler, "is_compiling"):  # torch >= 2.3
    is_compiling = torch.compiler.is_compiling
else:  # torch 2.1, 2.2: the same flag, under dynamo's name
    from torch._dynamo import is_compiling as is_compiling


def check_compile_supported(
    minimum: tuple[int, int] = MIN_TORCH_COMPILE, what: str = "contrastive_losses"
) -> None:
    """Raise while dynamo traces ``what`` on a torch older than ``minimum``, the oldest
    measured to trace it whole.

    Called where each loss starts (a Module's forward, a functional form's first check),
    so the error names the version instead of an ``Unsupported`` from deep inside dynamo.
    """
    if TORCH[:2] < minimum and is_compiling():
        _refuse_compile(minimum, what)


def _compile_refusal(minimum: tuple[int, int], what: str) -> str:
    return (
        f"{what} under torch.compile needs torch>={minimum[0]}.{minimum[1]}; this is torch "
        f"{torch.__version__}, whose dynamo cannot trace it (docs: 'Supported versions'). "
        "Run the loss eager (outside the compiled region) or upgrade torch."
    )


def _raise_compile_refusal(minimum: tuple[int, int], what: str) -> bool:
    # the message is built here, untraced: dynamo 2.3 cannot format torch.__version__
    raise RuntimeError(_compile_refusal(minimum, what))


if TORCH[:2] < max(MIN_TORCH_COMPILE, MIN_TORCH_COMPILE_SVR):  # some refusal may fire
    import torch._dynamo

    # run for real while dynamo traces (not traced), so the message reaches the user:
    # a traced raise reaches them as "call_function BuiltinVariable(RuntimeError)"
    _refuse_compile = torch._dynamo.assume_constant_result(_raise_compile_refusal)
else:
    _refuse_compile = _raise_compile_refusal


def recompile_limit_name() -> str:
    """The name of dynamo's per-function recompile limit in this torch: ``recompile_limit``,
    which older releases name ``cache_size_limit``; past it dynamo runs the function
    eager (with ``fullgraph=True`` it raises)."""
    import torch._dynamo.config as config

    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


def _cpu_half_bmm() -> bool:
    """Whether this torch has a float16 ``bmm`` on CPU (torch 2.1 has none)."""
    try:
        half = torch.ones(1, 1, 1, dtype=torch.float16)
        return bool((half @ half).item() == 1)
    except RuntimeError:
        return False


_CPU_HALF_BMM = _cpu_half_bmm()


def matmul_supported(x: torch.Tensor) -> bool:
    """Whether a batched matmul of ``x``'s dtype runs on ``x``'s device."""
    return _CPU_HALF_BMM or x.dtype != torch.float16 or x.device.type != "cpu"


_F = TypeVar("_F", bound=Callable[..., Any])
_AUTOCAST_DEVICES = ("cpu", "cuda")  # have autocast in every torch (no query needed)
# the installed torch's API (fixed at import: tests that simulate another release patch TORCH)
_AUTOCAST_BY_DEVICE = TORCH[:2] >= (2, 4)


# Whether a region is on for CPU, CUDA or a few other devices (not MPS), one query without
# a device string (private: where a torch lacks it, the per-device query runs).
_ANY_AUTOCAST: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)


def _no_cpu_cuda_autocast(x: torch.Tensor) -> bool:
    """Quickly, whether ``x`` is on the CPU or a CUDA device with no autocast region on
    there: ``False`` says nothing (another device, no quick query, or dynamo tracing,
    which need not know the private query)."""
    return (
        _ANY_AUTOCAST is not None
        and (x.is_cpu or x.is_cuda)
        and not is_compiling()
        and not _ANY_AUTOCAST()
    )


def _autocast_enabled(device_type: str) -> bool:
    """Whether an autocast region is on for ``device_type`` (torch < 2.4: CUDA and CPU
    only, the two it has)."""
    if _AUTOCAST_BY_DEVICE:  # (asked of a device without autocast, "meta", it raises)
        known = device_type in _AUTOCAST_DEVICES or torch.amp.is_autocast_available(device_type)
        return known and bool(torch.is_autocast_enabled(device_type))
    if device_type == "cuda":
        return bool(torch.is_autocast_enabled())
    return device_type == "cpu" and bool(torch.is_autocast_cpu_enabled())


def autocast_off(fn: _F) -> _F:
    """``fn`` (a loss: its first tensor argument gives the device) run with autocast off
    on that device: inside a user's ``torch.autocast`` region a loss computes in its
    inputs' dtypes exactly as outside it, so float32 inputs give the plain float32 loss
    (autocast would run its matmuls, ``addmm`` and softplus in half precision: SigLIP
    returned bfloat16). Free outside a region (one query on CPU and CUDA);
    traced by ``torch.compile`` without a graph break."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args and type(args[0]) is torch.Tensor else None  # the usual call
        if first is None:
            first = next(
                (x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None
            )
        if first is None or _no_cpu_cuda_autocast(first):
            return fn(*args, **kwargs)
        if not _autocast_enabled(first.device.type):
            return fn(*args, **kwargs)
        with torch.autocast(first.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
