"""Knowledge bank for ASK: audio-text embedding pairs, exact kNN search and prototypes.

``faiss`` is optional and imported lazily (``pip install contrastive-losses[faiss]``);
the ``"torch"`` backend never imports it.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import (
    _shape,
    check_choice,
    check_embeddings,
    check_finite,
    check_int,
    check_materialised,
    check_row_norms,
    check_tensor,
    stable_row_norms,
)
from .distributed import validate_together

__all__ = ["KnowledgeBank"]

BACKENDS = ("auto", "faiss", "torch")
MODALITIES = ("audio", "text")
INDEX_TYPES = ("flat", "ivf")
_FAISS_HINT = (
    "faiss is not installed; install the extra with `pip install contrastive-losses[faiss]` "
    "or use backend='torch'"
)


def _import_faiss() -> Any:
    try:
        return importlib.import_module("faiss")
    except ImportError as err:  # also raised when sys.modules["faiss"] is None
        raise ImportError(_FAISS_HINT) from err


def _faiss_available() -> bool:
    try:
        importlib.import_module("faiss")
    except ImportError:
        return False
    return True


def _check_int_ids(ids: object, name: str, n: int) -> Tensor:
    ids = check_tensor(ids, name)
    check_materialised(ids, name)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got dtype {ids.dtype}")
    if ids.dim() != 1 or ids.shape[0] != n:
        raise ValueError(
            f"{name}: expected shape ({n},) matching the embeddings, got {_shape(ids)}"
        )
    return ids.long()


def _unit_rows(x: Tensor, name: str) -> Tensor:
    """Detached float32 unit rows; raises on NaN/Inf, zero rows and unrepresentable norms.

    Not ``F.normalize``: its ``eps = 1e-12`` floor leaves rows with smaller norms
    un-normalised, and in float32 rows with entries above ~1e19 become zeros.
    """
    xf = x.detach().float()
    return xf / check_row_norms(xf, name).unsqueeze(-1)  # stable norms where squares overflow


def _dist_world() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _all_gather_rows(x: Tensor) -> Tensor:
    """Concatenate ``x`` (rows may differ per rank) from every rank, in rank order."""
    dist = torch.distributed
    world = dist.get_world_size()
    n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    counts = [int(s.item()) for s in sizes]
    pad = max(counts)
    buf = x.new_zeros((pad, *x.shape[1:]))
    buf[: x.shape[0]] = x
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf.contiguous())
    return torch.cat([o[:c] for o, c in zip(out, counts, strict=True)], dim=0)


def _broadcast_rows(x: Tensor | None, like: Tensor, src: int = 0) -> Tensor:
    """Rank ``src``'s ``x`` on every rank (other ranks pass ``None``); shape may vary."""
    dist = torch.distributed
    rank = dist.get_rank()
    n = torch.tensor([x.shape[0] if rank == src and x is not None else 0], device=like.device)
    dist.broadcast(n, src)
    rows = int(n.item())
    buf = x.contiguous() if rank == src and x is not None else like.new_empty((rows, like.shape[1]))
    dist.broadcast(buf, src)
    return buf


def _kmeans_torch(x: Tensor, k: int, niter: int, seed: int, chunk: int = 16384) -> Tensor:
    """Lloyd's k-means (squared L2), random distinct points as init; returns assignments."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    init = torch.randperm(x.shape[0], generator=gen)[:k].to(x.device)
    centroids = x[init].clone()  # (M, 2D)

    def assign(c: Tensor) -> Tensor:
        half_sq = 0.5 * (c * c).sum(-1)  # (M,)
        return torch.cat(
            [(x[i : i + chunk] @ c.T - half_sq).argmax(-1) for i in range(0, x.shape[0], chunk)]
        )

    for _ in range(niter):
        labels = assign(centroids)  # (N,)
        sums = torch.zeros_like(centroids).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=k).to(x.dtype)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled].unsqueeze(-1)  # empty: keep old
    return assign(centroids)


class KnowledgeBank:
    r"""Fine-grained bank of ``(audio, text, id)`` pairs with kNN search, plus prototypes.

    The fine-grained bank stores the L2-normalised embeddings of a dataset (one row per
    pair) and the dataset id of each row; :meth:`search` returns the exact top-``k`` rows
    by inner product, never a row whose id is in ``exclude_ids`` (so a training sample
    cannot retrieve itself or a caption sibling sharing its id).

    The coarse-grained bank is ``M <= num_prototypes`` paired prototypes: k-means on the
    concatenated pairs :math:`z_n = [\hat a_n; \hat t_n]`, then per cluster :math:`C_m`

    .. math::

        p^a_m = \frac{\max_{n \in C_m} \hat a_n}{\lVert \max_{n \in C_m} \hat a_n \rVert},
        \qquad
        p^t_m = \frac{\max_{n \in C_m} \hat t_n}{\lVert \max_{n \in C_m} \hat t_n \rVert},

    (element-wise max), so the m-th audio and m-th text prototype describe the same
    cluster. Empty clusters are dropped.

    Backends: ``"torch"`` (chunked ``matmul`` + ``topk`` on the queries' device, exact;
    never imports faiss), ``"faiss"`` (``IndexFlatIP``, or ``IndexScalarQuantizer`` fp16
    when ``dtype=torch.float16``, or IVF with ``index="ivf"`` for banks of millions;
    CPU), ``"auto"`` (faiss for CPU queries when it is installed, torch otherwise).
    k-means uses ``faiss.Kmeans`` when faiss is used, else a torch Lloyd's fallback.

    The bank is a plain object, not an ``nn.Module``: it is not part of a model's
    ``state_dict``; save it with :meth:`state_dict` (the index is rebuilt on load).

    Args:
        dim: embedding dimension ``D``.
        backend: ``"auto"``, ``"faiss"`` or ``"torch"``.
        num_prototypes: k-means clusters (``0`` disables prototypes). Clamped to the bank
            size with a warning.
        dtype: storage dtype of the embeddings (``torch.float16`` halves memory).
        index: ``"flat"`` (exact) or ``"ivf"`` (faiss only, approximate, for large banks).
        nlist: IVF cells (default ``4 * sqrt(N)``); nprobe: IVF cells visited per query.
        kmeans_iters: k-means iterations.
        refresh_every: period in epochs of :meth:`should_refresh` (``0`` = never).
        seed: k-means seed.
        chunk_size: bank rows per ``matmul`` block in the torch backend.

    Shape:
        - build: ``audio_emb``, ``text_emb`` ``(N, D)``, ``ids`` ``(N,)``
        - search: ``queries`` ``(B, D)``, ``exclude_ids`` ``(B,)`` -> ``(B, k)`` scores
          and ``(B, k)`` row indices

    Example:
        >>> import torch
        >>> from contrastive_losses import bank
        >>> kb = bank.KnowledgeBank(dim=8, backend="torch", num_prototypes=2)
        >>> g = torch.Generator().manual_seed(0)
        >>> kb = kb.build(torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g),
        ...               torch.arange(10))
        >>> scores, idx = kb.search(kb.audio[:3], k=2, exclude_ids=torch.arange(3))
        >>> idx.shape, bool((kb.ids[idx] != torch.arange(3)[:, None]).all())
        (torch.Size([3, 2]), True)
    """

    def __init__(
        self,
        dim: int,
        backend: str = "auto",
        num_prototypes: int = 512,
        *,
        dtype: torch.dtype = torch.float32,
        index: str = "flat",
        nlist: int | None = None,
        nprobe: int = 16,
        kmeans_iters: int = 20,
        refresh_every: int = 15,
        seed: int = 0,
        chunk_size: int = 65536,
    ) -> None:
        self.dim = check_int(dim, "dim", 1)
        check_choice(backend, "backend", BACKENDS)
        self.num_prototypes = check_int(num_prototypes, "num_prototypes", 0)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
        check_choice(index, "index", INDEX_TYPES)
        if index == "ivf" and backend == "torch":
            raise ValueError("index: 'ivf' needs the faiss backend, got backend='torch'")
        if nlist is not None:
            check_int(nlist, "nlist", 1)
        self.nlist = nlist
        self.nprobe = check_int(nprobe, "nprobe", 1)
        self.kmeans_iters = check_int(kmeans_iters, "kmeans_iters", 1)
        self.refresh_every = check_int(refresh_every, "refresh_every", 0)
        self.seed = check_int(seed, "seed", 0)
        self.chunk_size = check_int(chunk_size, "chunk_size", 1)
        if backend == "faiss":
            _import_faiss()  # fail now, with the install hint, not at the first search
        self.backend = backend
        self.dtype = dtype
        self.index_type = index
        self._clear()

    # ------------------------------------------------------------------ storage
    def _clear(self) -> None:
        empty = torch.empty(0, self.dim, dtype=self.dtype)
        self.audio: Tensor = empty
        self.text: Tensor = empty
        self.ids: Tensor = torch.empty(0, dtype=torch.long)
        self.prototype_audio: Tensor = empty
        self.prototype_text: Tensor = empty
        self._max_dup = 0
        self._drop_caches()

    def _drop_caches(self) -> None:
        self._faiss_indexes: dict[str, Any] = {}
        self._device_copies: dict[tuple[str, torch.device], Tensor] = {}

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def is_empty(self) -> bool:
        """``True`` while the bank holds no pairs (before :meth:`build` or :meth:`refresh`)."""
        return len(self) == 0

    @property
    def device(self) -> torch.device:
        """Device of the stored embeddings; :meth:`to` and ``refresh(device=...)`` move them.

        The torch backend searches on the queries' device, with a cached copy of the bank.
        """
        return self.audio.device

    @property
    def num_built_prototypes(self) -> int:
        """Number of prototypes ``M`` after dropping empty clusters."""
        return int(self.prototype_audio.shape[0])

    def to(self, device: torch.device | str) -> KnowledgeBank:
        """Move the stored tensors to ``device`` (in place); returns ``self``."""
        for name in ("audio", "text", "ids", "prototype_audio", "prototype_text"):
            setattr(self, name, getattr(self, name).to(device))
        self._drop_caches()
        return self

    def embeddings(self, modality: str) -> Tensor:
        """The stored ``(N, D)`` embeddings of ``modality`` (``"audio"`` or ``"text"``)."""
        check_choice(modality, "modality", MODALITIES)
        return self.audio if modality == "audio" else self.text

    def prototypes(self, modality: str) -> Tensor:
        """The ``(M, D)`` prototypes of ``modality``."""
        check_choice(modality, "modality", MODALITIES)
        return self.prototype_audio if modality == "audio" else self.prototype_text

    # ------------------------------------------------------------------ build
    def _uses_faiss(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "faiss":
            return True
        return device.type == "cpu" and _faiss_available()

    def build(
        self,
        audio_emb: Tensor,
        text_emb: Tensor,
        ids: Tensor,
        *,
        gather: bool | None = None,
    ) -> KnowledgeBank:
        """Fill the bank from precomputed embeddings (replacing its content); returns ``self``.

        Embeddings are L2-normalised (in float32) and stored in ``dtype`` on their device.
        With ``gather`` (default: when ``torch.distributed`` is initialised with world size
        > 1) every rank contributes its rows (sizes may differ) and every rank ends with the
        same bank, rows in rank order; the prototypes are computed on rank 0 and broadcast.
        """
        distributed = _dist_world() > 1 if gather is None else bool(gather)
        if distributed and not torch.distributed.is_initialized():
            raise ValueError("gather: True but torch.distributed is not initialised")
        # Under gather every rank raises together (no rank left waiting in the gather);
        # a rank may contribute no row as long as the bank gets one.
        with validate_together(distributed, audio_emb, name="audio_emb", min_global=1) as v:
            audio_emb = check_embeddings(
                audio_emb,
                "audio_emb",
                ndim=2,
                dims="(N, D)",
                min_batch=v.min_batch,
                check_values=False,
            )
            text_emb = check_embeddings(
                text_emb,
                "text_emb",
                ndim=2,
                dims="(N, D)",
                min_batch=v.min_batch,
                check_values=False,
            )
            for x, name in ((audio_emb, "audio_emb"), (text_emb, "text_emb")):
                if x.shape[1] != self.dim:
                    raise ValueError(
                        f"{name}: embedding dim {x.shape[1]} does not match the bank's dim "
                        f"{self.dim} (shape {_shape(x)})"
                    )
            if text_emb.shape[0] != audio_emb.shape[0]:
                raise ValueError(
                    f"text_emb: {text_emb.shape[0]} rows but audio_emb has {audio_emb.shape[0]}; "
                    "the bank stores pairs"
                )
            ids = _check_int_ids(ids, "ids", audio_emb.shape[0]).to(audio_emb.device)
            audio = _unit_rows(audio_emb, "audio_emb")
            text = _unit_rows(text_emb, "text_emb").to(audio.device)
            v.batch = audio_emb.shape[0]
            v.agree(audio_emb=audio, text_emb=text)
        if distributed:
            audio, text, ids = (
                _all_gather_rows(audio),
                _all_gather_rows(text),
                _all_gather_rows(ids),
            )
        self._clear()
        self.audio = audio.to(self.dtype)
        self.text = text.to(self.dtype)
        self.ids = ids
        _, counts = torch.unique(ids, return_counts=True)
        self._max_dup = int(counts.max())
        if self.num_prototypes > 0:
            if distributed:
                rank0 = torch.distributed.get_rank() == 0
                pa, pt = self._make_prototypes(audio, text) if rank0 else (None, None)
                pa = _broadcast_rows(pa, audio)
                pt = _broadcast_rows(pt, audio)
            else:
                pa, pt = self._make_prototypes(audio, text)
            self.prototype_audio, self.prototype_text = pa.to(self.dtype), pt.to(self.dtype)
        return self

    def _make_prototypes(self, audio: Tensor, text: Tensor) -> tuple[Tensor, Tensor]:
        n = audio.shape[0]
        k = self.num_prototypes
        if k > n:
            warnings.warn(
                f"num_prototypes={k} exceeds the bank size {n}; using {n} clusters",
                stacklevel=3,
            )
            k = n
        pairs = torch.cat([audio, text], dim=-1)  # (N, 2D)
        labels = self._kmeans(pairs, k)  # (N,)
        return self.pool_prototypes(audio, text, labels, k)

    def _kmeans(self, pairs: Tensor, k: int) -> Tensor:
        if self._uses_faiss(torch.device("cpu")):
            faiss = _import_faiss()
            x = pairs.cpu().float().contiguous().numpy()
            km = faiss.Kmeans(x.shape[1], k, niter=self.kmeans_iters, seed=self.seed, verbose=False)
            # faiss prints this warning to the C stderr; say it through `warnings` instead and
            # lower faiss's threshold (it only gates the message) so it stays quiet.
            wanted = k * int(km.cp.min_points_per_centroid)
            if x.shape[0] < wanted:
                warnings.warn(
                    f"k-means: clustering {x.shape[0]} points to {k} centroids: faiss advises at "
                    f"least {wanted} training points (fewer prototypes: num_prototypes)",
                    UserWarning,
                    stacklevel=4,
                )
            km.cp.min_points_per_centroid = 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                km.train(x)
            _, labels = km.index.search(x, 1)
            return torch.from_numpy(labels[:, 0]).long().to(pairs.device)
        return _kmeans_torch(pairs, k, self.kmeans_iters, self.seed)

    @staticmethod
    def pool_prototypes(
        audio: Tensor, text: Tensor, labels: Tensor, num_clusters: int
    ) -> tuple[Tensor, Tensor]:
        """Max-pool each cluster's audio and text rows, L2-normalise, drop empty clusters.

        Args:
            audio: ``(N, D)``; text: ``(N, D)``; labels: ``(N,)`` cluster of each row.
            num_clusters: number of clusters ``C`` the labels index into.

        Returns:
            ``(M, D)`` audio and text prototypes, ``M`` = number of non-empty clusters,
            in increasing cluster order.
        """
        dim = audio.shape[1]
        index = labels.unsqueeze(-1).expand(-1, dim)
        out = []
        for x in (audio, text):
            pooled = torch.full((num_clusters, dim), -math.inf, dtype=x.dtype, device=x.device)
            pooled.scatter_reduce_(0, index, x, reduce="amax", include_self=True)
            out.append(pooled)
        filled = torch.bincount(labels, minlength=num_clusters) > 0
        return F.normalize(out[0][filled], dim=-1), F.normalize(out[1][filled], dim=-1)

    # ------------------------------------------------------------------ refresh
    def refresh(
        self,
        encode_fn: Callable[[Any], tuple[Tensor, Tensor, Tensor]],
        loader: Iterable[Any],
        *,
        model: nn.Module | Sequence[nn.Module] | None = None,
        device: torch.device | str | None = None,
        progress: bool = True,
        gather: bool | None = None,
    ) -> KnowledgeBank:
        """Re-encode a dataset with the current model and rebuild the bank (the RDM reset).

        Runs under ``torch.no_grad()`` with ``model`` (or ``encode_fn`` itself when it is a
        module) in eval mode; every submodule's train/eval flag is restored afterwards,
        also on error. Each batch's embeddings are normalised and moved to ``device``
        (default: the bank's current device) in the storage dtype as soon as they are
        computed, so accelerator memory holds one batch at a time.

        Args:
            encode_fn: ``batch -> (audio_emb (b, D), text_emb (b, D), ids (b,))``.
            loader: iterable of batches (e.g. a ``DataLoader``; under DDP each rank's
                sharded loader; the shards are gathered, see :meth:`build`).
            model: module, or list/tuple of modules (e.g. ``[audio_encoder,
                text_encoder]``), whose mode is switched to eval during the pass.
            device: where the bank is stored.
            progress: show a tqdm bar (when tqdm is installed).
            gather: see :meth:`build`.
        """
        target = torch.device(device) if device is not None else self.device
        modules: list[nn.Module] = []
        if model is None:
            modules = [encode_fn] if isinstance(encode_fn, nn.Module) else []
        else:
            many = isinstance(model, (list, tuple))
            for pos, mod in enumerate(model if isinstance(model, (list, tuple)) else [model]):
                if not isinstance(mod, nn.Module):
                    where = f"model[{pos}]" if many else "model"
                    raise TypeError(f"{where}: expected an nn.Module, got {type(mod).__name__}")
                modules.append(mod)
        modes = [(sub, sub.training) for mod in modules for sub in mod.modules()]
        batches: Iterable[Any] = loader
        if progress:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                warnings.warn(
                    "tqdm is not installed: refresh() runs without a progress bar", stacklevel=2
                )
            else:
                batches = tqdm(loader, desc="refresh knowledge bank", unit="batch")
        audio_chunks: list[Tensor] = []
        text_chunks: list[Tensor] = []
        id_chunks: list[Tensor] = []
        try:
            for mod in modules:
                mod.eval()
            with torch.no_grad():
                for batch in batches:
                    encoded = encode_fn(batch)
                    if not isinstance(encoded, (tuple, list)) or len(encoded) != 3:
                        got = (
                            f"{len(encoded)} values"
                            if isinstance(encoded, (tuple, list))
                            else f"a {type(encoded).__name__}"
                        )
                        raise ValueError(
                            "encode_fn: must return 3 values (audio_emb (b, D), text_emb (b, D),"
                            f" ids (b,)), got {got}"
                        )
                    a, t, i = encoded
                    audio_chunks.append(_unit_rows(a, "encode_fn audio").to(target, self.dtype))
                    text_chunks.append(_unit_rows(t, "encode_fn text").to(target, self.dtype))
                    id_chunks.append(torch.as_tensor(i).to(target))
        finally:
            for m, was_training in modes:
                m.train(was_training)
        if not audio_chunks:
            raise ValueError("loader: yielded no batch; cannot refresh the bank from nothing")
        return self.build(
            torch.cat(audio_chunks), torch.cat(text_chunks), torch.cat(id_chunks), gather=gather
        )

    def should_refresh(self, epoch: int) -> bool:
        """True when the bank is empty, or ``epoch`` (0-based) is a positive multiple of
        ``refresh_every`` (ASK: 15)."""
        check_int(epoch, "epoch", 0)
        if self.is_empty:
            return True
        return self.refresh_every > 0 and epoch > 0 and epoch % self.refresh_every == 0

    # ------------------------------------------------------------------ search
    def _check_queries(self, queries: object, k: int) -> Tensor:
        """``(B, D)`` queries of the bank's dim and a ``k >= 1``, shared by both searches."""
        queries = check_embeddings(
            queries, "queries", ndim=2, dims="(B, D)", min_batch=1, check_values=False
        )
        if queries.shape[1] != self.dim:
            raise ValueError(
                f"queries: embedding dim {queries.shape[1]} does not match the bank's dim "
                f"{self.dim} (shape {_shape(queries)})"
            )
        check_int(k, "k", 1)
        check_finite(queries, "queries")  # a NaN query ranks rows arbitrarily
        # Scores are float32 inner products with unit rows: |score| <= ||query||.
        norms = stable_row_norms(queries)
        limit = torch.finfo(torch.float32).max
        if bool((norms > limit).any()):
            raise ValueError(
                f"queries: a row norm exceeds float32's max {limit:.3g}, so its scores "
                "overflow; normalise the queries"
            )
        return queries

    def _check_query(
        self, queries: object, k: int, exclude_ids: object
    ) -> tuple[Tensor, Tensor | None]:
        if self.is_empty:
            raise ValueError("bank: the knowledge bank is empty; call build() or refresh() first")
        queries = self._check_queries(queries, k)
        excl = None
        limit = len(self)
        if exclude_ids is not None:
            excl = _check_int_ids(exclude_ids, "exclude_ids", queries.shape[0])
            limit = len(self) - self._max_dup
        if k > limit:
            extra = (
                f" minus the {self._max_dup} row(s) a query may exclude "
                "(the most rows sharing one id)"
                if exclude_ids is not None
                else ""
            )
            raise ValueError(f"k: {k} exceeds the {len(self)} rows of the bank{extra}")
        return queries, excl

    def search(
        self,
        queries: Tensor,
        k: int,
        modality: str = "audio",
        exclude_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Exact top-``k`` bank rows of ``modality`` by inner product with ``queries``.

        Queries are used as given (normalise them for cosine similarity). Rows whose id
        equals the query's ``exclude_ids`` entry are never returned. Results are sorted
        by decreasing score and returned on the queries' device, without gradient.

        Returns:
            ``(scores, indices)``, both ``(B, k)``: float32 inner products and int64 row
            indices into :attr:`audio` / :attr:`text` / :attr:`ids`.
        """
        check_choice(modality, "modality", MODALITIES)
        queries, excl = self._check_query(queries, k, exclude_ids)
        if self._uses_faiss(queries.device):
            return self._search_faiss(queries, k, modality, excl)
        return self._search_torch(queries, k, modality, excl)

    def _on(self, name: str, device: torch.device) -> Tensor:
        src: Tensor = getattr(self, name)
        if src.device == device:
            return src
        key = (name, device)
        if key not in self._device_copies:
            self._device_copies[key] = src.to(device)
        return self._device_copies[key]

    def _search_torch(
        self, queries: Tensor, k: int, modality: str, excl: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        dev = queries.device
        keys = self._on(modality, dev)  # (N, D)
        bank_ids = self._on("ids", dev) if excl is not None else None
        q = queries.detach().float()
        ex = excl.to(dev) if excl is not None else None
        best_s = q.new_empty((q.shape[0], 0))
        best_i = torch.empty((q.shape[0], 0), dtype=torch.long, device=dev)
        with torch.no_grad():
            for start in range(0, keys.shape[0], self.chunk_size):
                block = keys[start : start + self.chunk_size].float()  # (C, D)
                s = q @ block.T  # (B, C)
                if ex is not None and bank_ids is not None:
                    same = bank_ids[start : start + block.shape[0]].unsqueeze(0) == ex.unsqueeze(1)
                    s = s.masked_fill(same, -math.inf)
                top_s, top_i = s.topk(min(k, block.shape[0]), dim=-1)
                best_s = torch.cat([best_s, top_s], dim=-1)
                best_i = torch.cat([best_i, top_i + start], dim=-1)
                if best_s.shape[1] > k:
                    best_s, pos = best_s.topk(k, dim=-1)
                    best_i = best_i.gather(-1, pos)
        return best_s, best_i

    def _faiss_index(self, modality: str) -> Any:
        if modality in self._faiss_indexes:
            return self._faiss_indexes[modality]
        faiss = _import_faiss()
        x = self.embeddings(modality).detach().float().cpu().contiguous().numpy()
        fp16 = self.dtype in (torch.float16, torch.bfloat16)
        metric = faiss.METRIC_INNER_PRODUCT
        if self.index_type == "ivf":
            nlist = self.nlist or max(1, min(len(self), int(4 * math.sqrt(len(self)))))
            quantizer = faiss.IndexFlatIP(self.dim)
            if fp16:
                index = faiss.IndexIVFScalarQuantizer(
                    quantizer, self.dim, nlist, faiss.ScalarQuantizer.QT_fp16, metric
                )
            else:
                index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, metric)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                index.train(x)
            index.nprobe = min(self.nprobe, nlist)
            self._faiss_indexes[modality + "/quantizer"] = quantizer  # keep it alive
        elif fp16:
            index = faiss.IndexScalarQuantizer(self.dim, faiss.ScalarQuantizer.QT_fp16, metric)
        else:
            index = faiss.IndexFlatIP(self.dim)
        index.add(x)
        self._faiss_indexes[modality] = index
        return index

    def _search_faiss(
        self, queries: Tensor, k: int, modality: str, excl: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        index = self._faiss_index(modality)
        q = queries.detach().float().cpu().contiguous().numpy()
        fetch = min(len(self), k + (self._max_dup if excl is not None else 0))
        dist, idx = index.search(q, fetch)
        scores = torch.from_numpy(dist)  # (B, fetch), sorted descending
        rows = torch.from_numpy(idx).long()
        valid = rows >= 0  # IVF returns -1 when a probe finds too few rows
        if excl is not None:
            bank_ids = self.ids.cpu()
            valid &= bank_ids[rows.clamp_min(0)] != excl.cpu().unsqueeze(1)
        # stable sort puts the valid rows first, keeping faiss's order among them
        order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices[:, :k]
        if not bool(valid.gather(-1, order).all()):
            raise RuntimeError(
                f"faiss returned fewer than k={k} valid rows; raise nprobe (now {self.nprobe}) "
                "or use index='flat'"
            )
        out_s = scores.gather(-1, order).to(queries.device)
        out_i = rows.gather(-1, order).to(queries.device)
        return out_s, out_i

    def search_prototypes(
        self, queries: Tensor, k: int, modality: str = "audio"
    ) -> tuple[Tensor, Tensor]:
        """Top-``k`` prototypes of ``modality`` by inner product (torch, queries' device).

        Returns:
            ``(scores, indices)``, both ``(B, k)``.
        """
        check_choice(modality, "modality", MODALITIES)
        if self.num_built_prototypes == 0:
            raise ValueError("bank: no prototypes; build() with num_prototypes > 0 first")
        queries = self._check_queries(queries, k)
        if k > self.num_built_prototypes:
            raise ValueError(
                f"k: {k} exceeds the {self.num_built_prototypes} prototypes of the bank"
            )
        protos = self._on("prototype_" + modality, queries.device).float()  # (M, D)
        with torch.no_grad():
            return (queries.detach().float() @ protos.T).topk(k, dim=-1)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the bank (tensors on their current device)."""
        return {
            "dim": self.dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "audio": self.audio,
            "text": self.text,
            "ids": self.ids,
            "prototype_audio": self.prototype_audio,
            "prototype_text": self.prototype_text,
        }

    def load_state_dict(self, state: dict[str, Any]) -> KnowledgeBank:
        """Restore from :meth:`state_dict`; search indexes are rebuilt lazily. Returns ``self``."""
        missing = {"dim", "audio", "text", "ids", "prototype_audio", "prototype_text"} - set(state)
        if missing:
            raise ValueError(f"state: missing key(s) {sorted(missing)}")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"state: dim {state['dim']} does not match the bank's dim {self.dim}")
        n = self._check_state_rows(state)
        self._clear()
        self.audio = state["audio"].to(self.dtype)
        self.text = state["text"].to(self.dtype)
        self.ids = state["ids"].long()
        self.prototype_audio = state["prototype_audio"].to(self.dtype)
        self.prototype_text = state["prototype_text"].to(self.dtype)
        if n:
            self._max_dup = int(torch.unique(self.ids, return_counts=True)[1].max())
        return self

    def _check_state_rows(self, state: dict[str, Any]) -> int:
        """Shapes of a state's tensors agree with each other and the bank; returns ``N``."""
        for key in ("audio", "text", "ids", "prototype_audio", "prototype_text"):
            check_materialised(check_tensor(state[key], f"state['{key}']"), f"state['{key}']")
        n = state["ids"].shape[0] if state["ids"].dim() == 1 else -1
        if n < 0 or state["ids"].dtype.is_floating_point or state["ids"].dtype == torch.bool:
            raise ValueError(
                f"state['ids']: expected an integer (N,) tensor, got dtype "
                f"{state['ids'].dtype} shape {_shape(state['ids'])}"
            )
        m = state["prototype_audio"].shape[0] if state["prototype_audio"].dim() == 2 else -1
        for key, rows in (("audio", n), ("text", n), ("prototype_audio", m), ("prototype_text", m)):
            x = state[key]
            if x.dim() != 2 or x.shape[1] != self.dim or x.shape[0] != rows:
                want = f"({n if rows == n else 'M'}, {self.dim})"
                raise ValueError(
                    f"state['{key}']: expected shape {want} (N = {n} ids), got {_shape(x)}"
                )
            if not x.dtype.is_floating_point:
                raise TypeError(f"state['{key}']: expected a floating tensor, got {x.dtype}")
            check_finite(x, f"state['{key}']")
        return n
