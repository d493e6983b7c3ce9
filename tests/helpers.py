"""Small helpers shared by the test modules: seeded float64 data and 2-process runs."""

from __future__ import annotations

import importlib.util
import sys
import time
import types
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

F64 = torch.float64


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal float64 tensor from ``gen``."""
    return torch.randn(*shape, generator=gen, dtype=F64)


def random_mask(gen: torch.Generator, b: int, k: int, p: float = 0.7) -> torch.Tensor:
    """``(b, k)`` presence mask, each caption present with probability ``p``; every clip
    keeps its English caption (column 0)."""
    mask = torch.rand(b, k, generator=gen) < p
    mask[:, 0] = True
    return mask


def init_gloo(rank: int, world: int, init_method: str, timeout_s: float | None = None) -> None:
    """``init_process_group("gloo")`` in a worker of :func:`spawn_ranks`."""
    # no timeout argument unless given: torch 2.1 refuses timeout=None
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, **timeout)


SPAWN_DEADLINE_S = 300  # spawn_ranks' default deadline
# What a test may take beyond its own deadline (loading results, comparing, teardown).
TIMEOUT_MARGIN_S = 120


def outlasting(deadline_s: float) -> pytest.MarkDecorator:
    """pytest-timeout's mark for a test (or a module, as ``pytestmark``) whose own deadline
    for the processes it runs is ``deadline_s``: the test's timeout must come later, or
    pytest kills a slow but healthy run (a module fixture's spawn included, which counts
    in its first test) before the harness can say which rank hangs."""
    return pytest.mark.timeout(deadline_s + TIMEOUT_MARGIN_S)


def spawn_ranks(
    worker: Callable[..., None],
    out_dir: Path,
    world: int = 2,
    deadline_s: float = SPAWN_DEADLINE_S,
) -> list[dict]:
    """Run ``worker(rank, world, init_method, out_dir)`` in ``world`` processes that call
    :func:`init_gloo`; each saves ``out_dir/rank{r}.pt``. Returns the loaded results in
    rank order. Past ``deadline_s`` the processes are killed and the test fails: a rank
    waiting forever in a collective is a failure, not a stuck CI job.

    The ranks meet through a fresh file in ``out_dir`` (``file://``), not a TCP port: a
    free port picked here and bound later by rank 0 could be taken in between by another
    test run (seen as gloo aborts under load). gloo's own connections use ports that the
    ranks bind themselves and exchange through that file."""
    rendezvous = Path(out_dir).resolve() / f"rendezvous-{uuid.uuid4().hex}"
    ctx = mp.start_processes(
        worker, args=(world, rendezvous.as_uri(), str(out_dir)), nprocs=world, join=False
    )
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish in {deadline_s:g} s (a rank hangs)")
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


RANK_SIZES = (5, 3)  # uneven on purpose: the last batch of an epoch


def rank_data(k: int = 3, d: int = 4) -> dict[str, torch.Tensor]:
    """The global batch that the 2-process tests split by ``RANK_SIZES``."""
    g = torch.Generator().manual_seed(0)
    n = sum(RANK_SIZES)
    return {
        "audio": randn(g, n, d),
        "text": randn(g, n, k, d),
        "mask": random_mask(g, n, k, p=0.6),
        "ids": torch.tensor([0, 1, 2, 3, 0, 4, 2, 5]),
    }


def rank_rows(rank: int) -> slice:
    lo = sum(RANK_SIZES[:rank])
    return slice(lo, lo + RANK_SIZES[rank])


def assert_ddp_average_matches(
    rank_results: list[dict], name: str, loss: torch.Tensor, *inputs: torch.Tensor
) -> None:
    """What DDP sees equals the single-process run: the mean over ranks of the rank losses
    is ``loss``, and the rank input gradients (``rank_results[r][name] = (loss, grad, ...)``
    in input order), averaged the same way, are the rows of ``inputs[i].grad``."""
    world = len(rank_results)
    mean_loss = sum(r[name][0] for r in rank_results) / world
    torch.testing.assert_close(mean_loss, loss.detach(), rtol=1e-6, atol=0)
    for i, x in enumerate(inputs, start=1):
        grad = torch.cat([r[name][i] for r in rank_results]) / world
        torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-12)


class HostSyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that read a value back to the host (a host-device sync on
    CUDA): ``.item()``, ``bool``/``float``/``int``/``index`` of a tensor, ``.tolist()``,
    ``.numpy()``, ``nonzero``, ``torch.equal``/``allclose``/``is_nonzero`` and indexing
    with a boolean tensor (which runs ``nonzero``). ``counts`` maps name -> calls."""

    SYNCS: ClassVar[dict[Any, str]] = {
        torch.Tensor.item: "item",
        torch.Tensor.__bool__: "bool",
        torch.Tensor.__float__: "float",
        torch.Tensor.__int__: "int",
        torch.Tensor.__index__: "index",
        torch.Tensor.__complex__: "complex",
        torch.Tensor.tolist: "tolist",
        torch.Tensor.numpy: "numpy",
        torch.Tensor.nonzero: "nonzero",
        torch.nonzero: "nonzero",
        torch.argwhere: "argwhere",
        torch.masked_select: "masked_select",
        torch.Tensor.masked_select: "masked_select",
        torch.equal: "equal",
        torch.allclose: "allclose",
        torch.is_nonzero: "is_nonzero",
        torch.unique: "unique",
    }

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _hit(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = self.SYNCS.get(func)
        if name is not None:
            self._hit(name)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self._hit("bool_index")
        return func(*args, **kwargs)


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it is given (one per compile or
    recompile) and hands them to ``inner`` (``"aot_eager"``, ``"inductor"``...)."""

    def __init__(self, inner: str = "aot_eager") -> None:
        import torch._dynamo

        self.inner = torch._dynamo.lookup_backend(inner)
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.calls += 1
        return self.inner(gm, example_inputs)


def load_file_module(name: str, path: Path) -> types.ModuleType:
    """A script that is not in a package (``docs/screenshot_check.py``) as module ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
