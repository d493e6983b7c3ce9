"""Gradient caching (Gao et al. 2021, "Scaling deep contrastive learning batch size under memory
limited setup") for the text tower.

KCL encodes ``K`` captions per clip, so its text activations are ``K`` times the random-language
baseline's. GradCache removes that factor:

1. embed all ``M <= B*K`` captions **without autograd**, in chunks of ``chunk_size`` rows,
   remembering the RNG state before each chunk (dropout masks);
2. compute the loss on those embeddings made leaf tensors, backpropagate it: this gives the
   gradients of the loss parameters, of the audio tower (its graph is ordinary), and the
   gradient of the loss with respect to every text embedding -- the *cached gradients*;
3. re-run each chunk **with** autograd under the same RNG state and backpropagate its slice of
   the cached gradient, accumulating into the text tower's parameters.

Peak text activation memory is that of one chunk; the result equals the ordinary backward pass
(exactly, up to float summation order) because the re-run reproduces the first pass bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Chunk = dict[str, Tensor]


@dataclass
class RngState:
    """The CPU RNG state and, on CUDA, the state of the given device's generator."""

    cpu: Tensor
    cuda: Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with this RNG state, then put back the state found on entry."""
        entry = RngState.capture(self.device)
        self.restore()
        try:
            yield
        finally:
            entry.restore()


def split_chunks(batch: Chunk, chunk_size: int) -> list[Chunk]:
    """Split every tensor of ``batch`` along dim 0 into chunks of ``chunk_size`` rows."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    n = next(iter(batch.values())).shape[0]
    return [
        {key: value[start : start + chunk_size] for key, value in batch.items()}
        for start in range(0, n, chunk_size)
    ]


@dataclass
class CachedEmbeddings:
    """Output of :func:`embed_without_grad`: a leaf tensor that collects the cached gradient."""

    embeddings: Tensor
    chunks: list[Chunk]
    states: list[RngState]
    after: RngState


def embed_without_grad(
    encode: Callable[[Chunk], Tensor], chunks: Sequence[Chunk], device: torch.device
) -> CachedEmbeddings:
    """Step 1: embed every chunk under ``torch.no_grad``; the result requires grad as a leaf."""
    states: list[RngState] = []
    outputs: list[Tensor] = []
    with torch.no_grad():
        for chunk in chunks:
            states.append(RngState.capture(device))
            outputs.append(encode(chunk))
    after = RngState.capture(device)
    embeddings = torch.cat(outputs).detach().requires_grad_(True)
    return CachedEmbeddings(embeddings, list(chunks), states, after)


def backward_chunks(encode: Callable[[Chunk], Tensor], cached: CachedEmbeddings) -> None:
    """Step 3: re-run each chunk with autograd and backpropagate its cached gradient slice.

    Call after the loss's ``backward()`` filled ``cached.embeddings.grad``. The RNG is left as it
    was after step 1, so the rest of the step does not depend on whether caching is on.
    """
    grad = cached.embeddings.grad
    if grad is None:
        raise RuntimeError(
            "gradcache: the cached embeddings have no gradient; call loss.backward() first "
            "(and make sure the loss uses them)"
        )
    offset = 0
    for chunk, state in zip(cached.chunks, cached.states, strict=True):
        with state.replay():
            out = encode(chunk)
        n = out.shape[0]
        out.backward(grad[offset : offset + n].to(out.dtype))
        offset += n
    cached.after.restore()


def grad_cache_backward(
    encode: Callable[[Chunk], Tensor],
    batch: Chunk,
    loss_from_embeddings: Callable[[Tensor], tuple[Tensor, Any]],
    chunk_size: int,
    device: torch.device,
) -> tuple[Tensor, Any]:
    """Steps 1-3 in one call; returns whatever ``loss_from_embeddings`` returned.

    ``loss_from_embeddings(text_embeddings)`` builds the loss (it may run the audio tower with
    autograd) and returns ``(loss, extra)``; this function calls ``loss.backward()``.
    """
    cached = embed_without_grad(encode, split_chunks(batch, chunk_size), device)
    loss, extra = loss_from_embeddings(cached.embeddings)
    loss.backward()
    backward_chunks(encode, cached)
    return loss, extra
