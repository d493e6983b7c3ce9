"""The per-language report of :mod:`contrastive_losses.metrics`: :func:`retrieval_report`
(retrieval in both directions, gap, distance and mean rank variance for every language)
and :class:`RetrievalReport`, the ``dict`` it returns with its markdown and CSV tables.

Private: import the public names from :mod:`contrastive_losses.metrics`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import (
    _shape,
    check_embeddings,
    check_same_device_dtype,
    check_same_size,
    check_tensor,
)
from ._consistency import embedding_distance, embedding_gap, mean_rank_variance
from ._retrieval import _check_cutoffs, _direction
from ._retrieval_scan import _check_dim, _check_int, _prepare

# --------------------------------------------------------------------------- report


def _fmt(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


class RetrievalReport(dict[str, Any]):
    """The result of :func:`retrieval_report`: a plain ``dict`` plus table renderers.

    Keys (all values are plain Python, so ``json.dumps(report)`` works):

    - ``"languages"``: list of names; ``"anchor"``: the anchor's name.
    - ``"n_audio"``, ``"n_captions"``, ``"k"``, ``"map_k"``, ``"denominator"``,
      ``"normalize"``: the setting.
    - ``"per_language"``: ``{lang: {"t2a": {"R@1": ..., "mAP@10": ...}, "a2t": {...},
      "gap": float, "distance": float}}``; retrieval values are fractions in ``[0, 1]``.
    - ``"average"``: ``{"t2a": ..., "a2t": ...}`` averaged over all languages, plus
      ``"gap"`` and ``"distance"`` averaged over the non-anchor languages (None if K = 1).
    - ``"mrv"``: mean rank variance of the T2A ranks across languages (None if K = 1).
    """

    def table(self) -> tuple[list[str], list[list[float | str | None]]]:
        """The table as ``(header, rows)``: one row per language, then ``"average"``."""
        keys = [f"R@{k}" for k in self["k"]] + [f"mAP@{self['map_k']}"]
        header = ["language"]
        header += [f"T2A {key}" for key in keys] + [f"A2T {key}" for key in keys]
        header += ["gap", "distance", "MRV"]
        out: list[list[float | str | None]] = []
        entries = [(lang, self["per_language"][lang], None) for lang in self["languages"]]
        entries.append(("average", self["average"], self["mrv"]))
        for name, entry, mrv in entries:
            row: list[float | str | None] = [name]
            row += [entry["t2a"][key] for key in keys] + [entry["a2t"][key] for key in keys]
            row += [entry["gap"], entry["distance"], mrv]
            out.append(row)
        return header, out

    def to_markdown(self, *, percent: bool = True, digits: int = 2) -> str:
        """A GitHub markdown table.

        Args:
            percent: show R@k and mAP as percentages (as the papers' tables do; the
                header carries no unit) with ``digits`` decimals; otherwise as fractions
                with ``digits + 2`` decimals. Gap and distance get 4 decimals, MRV 2.
            digits: decimals of the percentages.
        """
        header, rows = self.table()
        n_retrieval = 2 * (len(self["k"]) + 1)
        scale = 100.0 if percent else 1.0
        lines = ["| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
        for row in rows:
            cells = [str(row[0])]
            for i, v in enumerate(row[1:], start=1):
                value = v if isinstance(v, float) or v is None else float(v)
                if i <= n_retrieval:
                    cells.append(_fmt(value, scale, digits if percent else digits + 2))
                elif header[i] == "MRV":
                    cells.append(_fmt(value, 1.0, 2))
                else:
                    cells.append(_fmt(value, 1.0, 4))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_csv(self) -> str:
        """CSV text: the :meth:`table`, full precision, R@k / mAP as fractions in [0, 1],
        an empty cell for None."""
        header, rows = self.table()
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        for row in rows:
            writer.writerow(["" if v is None else v for v in row])
        return buf.getvalue()


_REPORT_LAYOUTS = "(N, K, C, D), (N, K, D) with K language names, or (N, C, D) with one name"


def _language_names(languages: object) -> list[str] | None:
    if languages is None:
        return None
    if isinstance(languages, str) or not isinstance(languages, Sequence):
        raise TypeError(f"languages: expected a sequence of str, got {type(languages).__name__}")
    names = list(languages)
    if not all(isinstance(x, str) for x in names):
        raise TypeError(f"languages: expected a sequence of str, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"languages: names must be distinct, got {names}")
    return names


def _report_text(
    audio: Tensor, text: object, languages: object
) -> tuple[Tensor, list[str], Callable[[Tensor], Tensor]]:
    """``text`` validated as passed, the K language names, and the view that makes it
    ``(N, K, C, D)``. Every check runs on the tensor as passed (the caller normalises it
    before the view), so no message shows a shape or index the caller did not pass.

    A 3-D text is ``(N, K, D)`` (K languages, one caption each: KCLLoss's layout) or
    ``(N, C, D)`` (one language, C captions); ``languages`` says which: K names or one.
    Without it only a middle dimension of 1 is unambiguous."""
    text_t = check_tensor(text, "text")
    names = _language_names(languages)
    shape = _shape(text_t)
    if text_t.dim() not in (3, 4):
        raise ValueError(f"text: expected shape {_REPORT_LAYOUTS}, got {shape}")
    text_t = check_embeddings(
        text_t, "text", ndim=text_t.dim(), dims=_REPORT_LAYOUTS, min_batch=1, check_values=False
    )
    check_same_size(audio, "audio", text_t, "text", 0, "number of audio clips N")
    check_same_size(audio, "audio", text_t, "text", -1, "embedding dimension D")
    check_same_device_dtype([(audio, "audio"), (text_t, "text")])
    if any(size == 0 for size in text_t.shape[1:-1]):
        raise ValueError(f"text: needs at least one language and one caption, got {shape}")
    if text_t.dim() == 3:
        middle = text_t.shape[1]
        if names is None and middle > 1:
            raise ValueError(
                f"text: shape {shape} is ambiguous: (N, K, D) with K = {middle} languages, "
                f"one caption each (KCLLoss's layout), or (N, C, D) with one language and "
                f"C = {middle} captions per clip; say which with languages=: {middle} names "
                "for K languages, one name for one language (or pass (N, K, C, D): "
                "text[:, :, None] for K languages, text[:, None] for one)"
            )
        if names is not None and len(names) not in (1, middle):
            raise ValueError(
                f"languages: {len(names)} name(s) {names} for text of shape {shape}, read as "
                f"(N, K, D) with K = {middle} languages (pass {middle} names) or as (N, C, D) "
                "with one language (pass one name)"
            )
        one_language = names is not None and len(names) == 1 and middle > 1
        view = _one_language if one_language else _one_caption
    else:
        view = _as_is
    n_lang = view(text_t).shape[1]
    if names is None:
        names = [f"lang{i}" for i in range(n_lang)]
    elif len(names) != n_lang:
        raise ValueError(
            f"languages: {len(names)} name(s) {names} for K = {n_lang} languages in text "
            f"of shape {shape}"
        )
    return text_t, names, view


def _one_language(text: Tensor) -> Tensor:
    return text[:, None]  # (N, C, D) -> (N, 1, C, D)


def _one_caption(text: Tensor) -> Tensor:
    return text[:, :, None]  # (N, K, D) -> (N, K, 1, D)


def _as_is(text: Tensor) -> Tensor:
    return text


def retrieval_report(
    audio: Tensor,
    text: Tensor,
    languages: Sequence[str] | None = None,
    *,
    anchor: int | str = 0,
    k: Sequence[int] = (1, 5, 10),
    map_k: int = 10,
    denominator: str = "n_relevant",
    normalize: bool = True,
    chunk_size: int | None = None,
    dim: int | None = None,
) -> RetrievalReport:
    r"""Per-language retrieval and cross-lingual consistency report (ATRI Tab. 1-3 numbers).

    For every language ``k``: T2A and A2T ``R@k`` and ``mAP@map_k`` of the captions of
    language ``k`` against the audio (:func:`audio_text_retrieval`), the embedding gap and
    distance to the anchor language (:func:`embedding_gap`, :func:`embedding_distance`,
    computed over the ``N*C`` captions, caption ``c`` of clip ``i`` in language ``k`` being
    the translation of the same caption in the anchor language). Then the average over
    languages, and the mean rank variance

    .. math::

        \mathrm{MRV} = \frac{1}{NCK} \sum_{i,c,k}
        (\mathrm{rank}_{ick} - \overline{\mathrm{rank}}_{ic})^2

    where :math:`\mathrm{rank}_{ick}` is the T2A rank (pessimistic, 1-based, among the
    ``N`` clips) of audio ``i`` for caption ``c`` in language ``k`` and the bar is the mean
    over languages (:func:`mean_rank_variance`).

    Args:
        audio: audio embeddings.
        text: caption embeddings, ``(N, K, C, D)``: ``K`` languages, ``C`` captions per
            clip. A 3-D text needs ``languages`` to say what dim 1 is: ``K`` names read it
            as ``(N, K, D)``, ``K`` languages with one caption each (KCLLoss's layout);
            one name as ``(N, C, D)``, one language with ``C`` captions. Without
            ``languages`` a 3-D text is refused unless its dim 1 is 1.
        languages: ``K`` distinct names, in the order of dim 1 of ``text``
            (default ``"lang0"``, ``"lang1"``, ...; required for a 3-D text, see above).
        anchor: index or name of the reference language for gap and distance (English).
        k: recall cut-offs, each in ``[1, N]``.
        map_k: mAP cut-off in ``[1, N]``.
        denominator: mAP denominator, see :func:`map_at_k`.
        normalize: L2-normalise embeddings before retrieval and gap/distance.
        chunk_size: query rows per block; results do not depend on it.
        dim: use only the first ``dim`` features (a Matryoshka prefix), re-normalised
            with ``normalize``; ``None``: all ``D``. An int in ``[1, D]``.

    Returns:
        :class:`RetrievalReport`, a ``dict`` with ``to_markdown()`` and ``to_csv()``.

    Shape:
        - audio: :math:`(N, D)`.
        - text: :math:`(N, K, C, D)`; :math:`(N, K, D)` with ``K`` names; :math:`(N, C, D)`
          with one name.

    Example:
        >>> import torch
        >>> from contrastive_losses.metrics import retrieval_report
        >>> audio = torch.eye(10)
        >>> text = torch.stack([torch.eye(10), torch.eye(10)], dim=1)[:, :, None]
        >>> report = retrieval_report(audio, text, ["en", "fr"], k=(1,))
        >>> report["average"]["t2a"]
        {'R@1': 1.0, 'mAP@10': 1.0}
        >>> print(report.to_markdown())
        | language | T2A R@1 | T2A mAP@10 | A2T R@1 | A2T mAP@10 | gap | distance | MRV |
        |---|---:|---:|---:|---:|---:|---:|---:|
        | en | 100.00 | 100.00 | 100.00 | 100.00 | 0.0000 | 0.0000 | - |
        | fr | 100.00 | 100.00 | 100.00 | 100.00 | 0.0000 | 0.0000 | - |
        | average | 100.00 | 100.00 | 100.00 | 100.00 | 0.0000 | 0.0000 | 0.00 |
    """
    audio_t = check_embeddings(
        audio, "audio", ndim=2, dims="(N, D)", min_batch=1, check_values=False
    )
    text_t, names, view = _report_text(audio_t, text, languages)
    n, n_lang, c = view(text_t).shape[:3]
    if isinstance(anchor, str):
        if anchor not in names:
            raise ValueError(f"anchor: {anchor!r} is not one of languages {names}")
        anchor_idx = names.index(anchor)
    else:
        anchor_idx = _check_int(anchor, "anchor", 0, n_lang - 1, "the last language index K - 1")
    ks, mk = _check_cutoffs(k, map_k, n, denominator)

    dim = _check_dim(dim, audio_t.shape[-1])
    audio_n = _prepare(audio_t.detach(), "audio", normalize, dim)  # (N, D) or (N, dim)
    text_n = view(_prepare(text_t.detach(), "text", normalize, dim))  # (N, K, C, D or dim)
    audio_ids = torch.arange(n, device=audio_n.device)  # (N,)
    caption_ids = audio_ids.repeat_interleave(c)  # (N*C,)

    setting = (ks, mk, denominator, chunk_size)
    per_language: dict[str, dict[str, Any]] = {}
    t2a_ranks = []
    by_sentence = text_n.transpose(1, 2).reshape(n * c, n_lang, -1)  # (N*C, K, D)
    gaps = embedding_gap(by_sentence, anchor_idx, normalize=False).tolist()
    dists = embedding_distance(by_sentence, anchor_idx, normalize=False).tolist()
    for i, lang in enumerate(names):
        flat = by_sentence[:, i]  # (N*C, D)
        t2a, ranks = _direction(flat, audio_n, caption_ids, audio_ids, *setting, "text")
        a2t, _ = _direction(audio_n, flat, audio_ids, caption_ids, *setting, "audio")
        t2a_ranks.append(ranks)
        per_language[lang] = {"t2a": t2a, "a2t": a2t, "gap": gaps[i], "distance": dists[i]}

    average: dict[str, Any] = {}
    for direction in ("t2a", "a2t"):
        keys = per_language[names[0]][direction].keys()
        average[direction] = {
            key: sum(per_language[lang][direction][key] for lang in names) / n_lang for key in keys
        }
    others = [lang for i, lang in enumerate(names) if i != anchor_idx]
    for key in ("gap", "distance"):
        values = [per_language[lang][key] for lang in others]
        average[key] = sum(values) / len(values) if values else None
    mrv = mean_rank_variance(torch.stack(t2a_ranks, dim=1)) if n_lang > 1 else None
    return RetrievalReport(
        languages=names,
        anchor=names[anchor_idx],
        n_audio=n,
        n_captions=c,
        k=list(ks),
        map_k=mk,
        denominator=denominator,
        normalize=normalize,
        per_language=per_language,
        average=average,
        mrv=mrv,
    )
