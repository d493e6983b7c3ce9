r"""Retrieval and cross-lingual consistency metrics for audio-text retrieval.

Pure functions on a similarity matrix or on embeddings, CPU or CUDA, chunked over queries.
From embeddings (:func:`audio_text_retrieval`, :func:`retrieval_report`) a 50k x 10k
evaluation never holds more than one block of scores: about 15 MB of reused buffers with
the default block of ~1M scores (14 bytes per score), whatever the sizes.

Conventions (the ones of the ML-CLAP / ATRI / SupCLAP / ASK tables, see DESIGN.md §3):

* Rows of ``sim`` are queries, columns the gallery. Text-to-audio (T2A) has one relevant
  audio per caption; audio-to-text (A2T) counts every caption of the clip as relevant
  (5 per clip in the AudioCaps and Clotho test sets).
* ``R@k`` is the share of queries with at least one relevant item in the top ``k`` (a
  hit rate; with one relevant item it is also the recall).
* ``mAP@k`` is the mean over queries of :math:`\sum_{r \le k} P@r \cdot rel(r) / n_q` with
  :math:`n_q` the number of relevant items of the query (ML-CLAP / DCASE convention);
  ``denominator="min_n_relevant_k"`` divides by :math:`\min(n_q, k)` instead.
* Negative similarities are ordinary scores (no score is dropped for being <= 0).
* Ties are broken pessimistically: an irrelevant item with the same score as a relevant
  one ranks ahead of it. A rank is therefore
  :math:`\mathrm{rank}_r = r + \#\{\text{irrelevant } g : s_g \ge s_{(r)}\}` for the
  r-th best relevant item.
* Scalar summaries (R@k, mAP@k, MRV) are returned as Python ``float``; per-item results
  (ranks, per-language gap and distance) as tensors on the input's device.

What each function takes (a wrong layout is refused with the function that fits):

* :func:`retrieval_ranks`, :func:`recall_at_k`, :func:`map_at_k`: a similarity matrix
  ``sim`` ``(Q, G)`` and a bool ``relevance`` ``(Q, G)`` or ``query_ids``/``gallery_ids``;
  with neither, ``sim`` must be square (the relevant item of row ``i`` is column ``i``).
  A relevance under which every gallery item is relevant to every query is refused (every
  ranking would score 1); one under which a random ranking scores R@1 above 1/2 warns.
  Scores are similarities, higher first: ranks far below chance (``torch.cdist`` distances
  passed as ``sim``) warn, naming ``-distances``; these and the embedding functions also
  warn for all-tied scores (collapsed embeddings).
* :func:`audio_text_retrieval`: embeddings, audio ``(N, D)`` and text ``(N, C, D)`` or
  ``(N, D)``, one language.
* :func:`retrieval_report`: embeddings, audio ``(N, D)`` and text ``(N, K, C, D)``;
  ``(N, K, D)`` (KCLLoss's layout) with ``K`` language names; ``(N, C, D)`` with one.
* :func:`embedding_gap`, :func:`embedding_distance`: text ``(N, K, D)``.
* :func:`mean_rank_variance`: 1-based ranks ``(N, K)``.
"""

from ._consistency import embedding_distance, embedding_gap, mean_rank_variance
from ._retrieval import audio_text_retrieval, map_at_k, recall_at_k, retrieval_ranks
from ._retrieval_report import RetrievalReport, retrieval_report

# Not in __all__, importable from here as before the split: the mAP denominators and the
# type of the score and relevance block functions.
from ._retrieval_scan import DENOMINATORS as DENOMINATORS
from ._retrieval_scan import BlockFn as BlockFn

__all__ = [
    "RetrievalReport",
    "audio_text_retrieval",
    "embedding_distance",
    "embedding_gap",
    "map_at_k",
    "mean_rank_variance",
    "recall_at_k",
    "retrieval_ranks",
    "retrieval_report",
]
