"""Knowledge bank for ASK: audio-text embedding pairs, exact kNN search and prototypes.

``faiss`` is optional and imported lazily (``pip install contrastive-losses[faiss]``);
the ``"torch"`` backend never imports it.

:class:`KnowledgeBank` is the public face; its work is split by responsibility into private
modules: ``_bank_storage`` (what is stored, checked and gathered across ranks),
``_bank_search`` (torch and faiss top-k), ``_bank_prototypes`` (k-means and pooling) and
``_bank_refresh`` (re-encoding a dataset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ._bank_prototypes import _kmeans_torch, kmeans_faiss, make_prototypes
from ._bank_prototypes import pool_prototypes as _pool_prototypes
from ._bank_refresh import encode_pairs, eval_modules
from ._bank_search import check_queries, faiss_index, search_faiss, search_torch
from ._bank_storage import (
    BACKENDS,
    INDEX_TYPES,
    MODALITIES,
    STATE_TENSORS,
    _all_gather_rows,
    _broadcast_rows,
    _check_int_ids,
    _dist_world,
    _faiss_available,
    _import_faiss,
    check_state_rows,
    checked_pairs,
)
from ._checks import check_choice, check_int
from ._docs import init_doc
from .distributed import validate_together

__all__ = ["KnowledgeBank"]


@init_doc
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
        for name in STATE_TENSORS:
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
            audio, text, ids = checked_pairs(audio_emb, text_emb, ids, self.dim, v.min_batch)
            v.batch = audio.shape[0]
            v.agree(audio_emb=audio, text_emb=text)
        audio, text, ids = v.ordered(audio, text, ids)  # gathered after the ranks' exchange
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
            make = partial(make_prototypes, audio, text, self.num_prototypes, self._kmeans)
            if distributed:
                pa, pt = make() if torch.distributed.get_rank() == 0 else (None, None)
                pa, pt = _broadcast_rows(pa, audio), _broadcast_rows(pt, audio)
            else:
                pa, pt = make()
            self.prototype_audio, self.prototype_text = pa.to(self.dtype), pt.to(self.dtype)
        return self

    def _kmeans(self, pairs: Tensor, k: int) -> Tensor:
        if self._uses_faiss(torch.device("cpu")):
            return kmeans_faiss(_import_faiss(), pairs, k, self.kmeans_iters, self.seed)
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
        return _pool_prototypes(audio, text, labels, num_clusters)

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
        modules = eval_modules(encode_fn, model)
        audio, text, ids = encode_pairs(encode_fn, loader, modules, target, self.dtype, progress)
        return self.build(audio, text, ids, gather=gather)

    def should_refresh(self, epoch: int) -> bool:
        """True when the bank is empty, or ``epoch`` (0-based) is a positive multiple of
        ``refresh_every`` (ASK: 15)."""
        check_int(epoch, "epoch", 0)
        if self.is_empty:
            return True
        return self.refresh_every > 0 and epoch > 0 and epoch % self.refresh_every == 0

    # ------------------------------------------------------------------ search
    def _check_query(
        self, queries: object, k: int, exclude_ids: object
    ) -> tuple[Tensor, Tensor | None]:
        if self.is_empty:
            raise ValueError("bank: the knowledge bank is empty; call build() or refresh() first")
        queries = check_queries(queries, k, self.dim)
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

    def _search_faiss(
        self, queries: Tensor, k: int, modality: str, excl: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        index = self._faiss_index(modality)
        return search_faiss(index, self.ids, queries, k, excl, self._max_dup, self.nprobe)

    def _search_torch(
        self, queries: Tensor, k: int, modality: str, excl: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        dev = queries.device
        bank_ids = self._on("ids", dev) if excl is not None else None
        return search_torch(self._on(modality, dev), bank_ids, queries, k, excl, self.chunk_size)

    def _faiss_index(self, modality: str) -> Any:
        if modality not in self._faiss_indexes:
            fp16 = self.dtype in (torch.float16, torch.bfloat16)
            index, quantizer = faiss_index(
                _import_faiss(), self.embeddings(modality), self.index_type, self.nlist,
                self.nprobe, fp16,
            )  # fmt: skip
            self._faiss_indexes[modality] = index
            if quantizer is not None:
                self._faiss_indexes[modality + "/quantizer"] = quantizer  # keep it alive
        return self._faiss_indexes[modality]

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
        queries = check_queries(queries, k, self.dim)
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
        missing = {"dim", *STATE_TENSORS} - set(state)
        if missing:
            raise ValueError(f"state: missing key(s) {sorted(missing)}")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"state: dim {state['dim']} does not match the bank's dim {self.dim}")
        n = check_state_rows(state, self.dim)
        self._clear()
        self.audio = state["audio"].to(self.dtype)
        self.text = state["text"].to(self.dtype)
        self.ids = state["ids"].long()
        self.prototype_audio = state["prototype_audio"].to(self.dtype)
        self.prototype_text = state["prototype_text"].to(self.dtype)
        if n:
            self._max_dup = int(torch.unique(self.ids, return_counts=True)[1].max())
        return self
