"""Tests for contrastive_losses.metrics.

References are plain Python loops written from the definitions (DESIGN.md §3 "Metrics"):
sort each query's gallery by score, descending, with irrelevant items first among equal
scores (pessimistic ties), then read R@k / AP@k / ranks off the sorted relevance list.
"""

from __future__ import annotations

import csv
import doctest
import io
import json
import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from contrastive_losses import _retrieval_scan, metrics
from contrastive_losses.metrics import (
    RetrievalReport,
    audio_text_retrieval,
    embedding_distance,
    embedding_gap,
    map_at_k,
    mean_rank_variance,
    recall_at_k,
    retrieval_ranks,
    retrieval_report,
)

# The reference and property tests draw relevance matrices that are dense on purpose; the
# warning about a dense relevance is tested with pytest.warns in test_metrics_misuse.py.
pytestmark = pytest.mark.filterwarnings("ignore:relevance.* random ranking:UserWarning")

# --------------------------------------------------------------------------- references


def ref_sorted_relevance(scores: list[float], rel: list[bool]) -> list[bool]:
    """Relevance flags in ranked order: score descending, irrelevant first among ties."""
    order = sorted(range(len(scores)), key=lambda g: (-scores[g], rel[g]))
    return [rel[g] for g in order]


def ref_rows(sim: torch.Tensor, rel: torch.Tensor) -> list[list[bool]]:
    return [ref_sorted_relevance(s, r) for s, r in zip(sim.tolist(), rel.tolist(), strict=True)]


def ref_ranks(sim: torch.Tensor, rel: torch.Tensor) -> list[int]:
    return [row.index(True) + 1 for row in ref_rows(sim, rel)]


def ref_recall(sim: torch.Tensor, rel: torch.Tensor, k: int) -> float:
    rows = ref_rows(sim, rel)
    return sum(any(row[:k]) for row in rows) / len(rows)


def ref_map(sim: torch.Tensor, rel: torch.Tensor, k: int, denominator: str = "n_relevant") -> float:
    total = 0.0
    rows = ref_rows(sim, rel)
    for row in rows:
        n_rel = sum(row)
        denom = n_rel if denominator == "n_relevant" else min(n_rel, k)
        ap = 0.0
        for r in range(1, k + 1):
            if row[r - 1]:
                ap += sum(row[:r]) / r  # P@r * rel(r)
        total += ap / denom
    return total / len(rows)


def ref_mrv(ranks: list[list[float]]) -> float:
    total, count = 0.0, 0
    for row in ranks:
        mean = sum(row) / len(row)
        for v in row:
            total += (v - mean) ** 2
            count += 1
    return total / count


def ref_normalize(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def ref_gap_distance(text: torch.Tensor, anchor: int, normalize: bool) -> tuple[list, list]:
    t = text.tolist()  # [N][K][D]
    if normalize:
        t = [[ref_normalize(v) for v in sent] for sent in t]
    n, n_lang, d = len(t), len(t[0]), len(t[0][0])
    gaps, dists = [], []
    for k in range(n_lang):
        mean_a = [sum(t[i][anchor][j] for i in range(n)) / n for j in range(d)]
        mean_k = [sum(t[i][k][j] for i in range(n)) / n for j in range(d)]
        gaps.append(math.sqrt(sum((x - y) ** 2 for x, y in zip(mean_a, mean_k, strict=True))))
        dists.append(
            sum(
                math.sqrt(sum((x - y) ** 2 for x, y in zip(t[i][anchor], t[i][k], strict=True)))
                for i in range(n)
            )
            / n
        )
    return gaps, dists


# --------------------------------------------------------------------------- data


def random_relevance(q: int, g: int, p: float, gen: torch.Generator) -> torch.Tensor:
    """Bool (q, g) with ~p relevant per row and at least one relevant item per row."""
    rel = torch.rand(q, g, generator=gen) < p
    rel[torch.arange(q), torch.randint(0, g, (q,), generator=gen)] = True
    return rel


def random_scores(q: int, g: int, tied: bool, gen: torch.Generator) -> torch.Tensor:
    """float64 scores, half negative; ``tied``: 5 integer levels so ties are everywhere."""
    if tied:
        return torch.randint(-2, 3, (q, g), generator=gen).double()
    return torch.randn(q, g, generator=gen, dtype=torch.float64)


def ids_for(q: int, g: int, n_classes: int, gen: torch.Generator):
    """query_ids (q,), gallery_ids (g,) where every query id occurs in the gallery."""
    gallery_ids = torch.randint(0, n_classes, (g,), generator=gen)
    gallery_ids[:n_classes] = torch.arange(n_classes)
    query_ids = torch.randint(0, n_classes, (q,), generator=gen)
    return query_ids, gallery_ids


# --------------------------------------------------------------------------- vs reference


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2, 0.7])
def test_relevance_matrix_matches_reference(gen, tied, p):
    q, g = 23, 17
    sim = random_scores(q, g, tied, gen)
    rel = random_relevance(q, g, p, gen)
    assert retrieval_ranks(sim, rel).tolist() == ref_ranks(sim, rel)
    got = recall_at_k(sim, rel, k=(1, 2, 5, 10, g))
    assert got == {k: ref_recall(sim, rel, k) for k in (1, 2, 5, 10, g)}
    for k in (1, 3, 10, g):
        for denominator in ("n_relevant", "min_n_relevant_k"):
            want = ref_map(sim, rel, k, denominator)
            assert map_at_k(sim, rel, k=k, denominator=denominator) == pytest.approx(
                want, abs=1e-12
            )


@pytest.mark.parametrize("tied", [False, True])
def test_ids_match_reference(gen, tied):
    q, g, n_classes = 31, 19, 6
    sim = random_scores(q, g, tied, gen)
    query_ids, gallery_ids = ids_for(q, g, n_classes, gen)
    rel = query_ids[:, None] == gallery_ids[None, :]
    kw = {"query_ids": query_ids, "gallery_ids": gallery_ids}
    assert retrieval_ranks(sim, **kw).tolist() == ref_ranks(sim, rel)
    assert recall_at_k(sim, **kw, k=(1, 4, 9)) == {k: ref_recall(sim, rel, k) for k in (1, 4, 9)}
    for denominator in ("n_relevant", "min_n_relevant_k"):
        got = map_at_k(sim, **kw, k=4, denominator=denominator)
        assert got == pytest.approx(ref_map(sim, rel, 4, denominator), abs=1e-12)


def test_default_relevance_is_the_diagonal(gen):
    sim = random_scores(12, 12, True, gen)
    eye = torch.eye(12, dtype=torch.bool)
    assert retrieval_ranks(sim).tolist() == ref_ranks(sim, eye)
    assert recall_at_k(sim, k=3) == ref_recall(sim, eye, 3)
    assert map_at_k(sim, k=5) == pytest.approx(ref_map(sim, eye, 5), abs=1e-12)


@pytest.mark.parametrize("force_sort", [False, True])
def test_sort_path_matches_reference(gen, monkeypatch, force_sort):
    # k = G with ~60% relevant items ranks up to ~24 relevant items per query, above
    # _LOOP_MAX_RELEVANT = 16: the row-sort + searchsorted path. force_sort sends every
    # call through it.
    if force_sort:
        monkeypatch.setattr(_retrieval_scan, "_LOOP_MAX_RELEVANT", 0)
    q, g = 9, 40
    for tied in (False, True):
        sim = random_scores(q, g, tied, gen)
        rel = random_relevance(q, g, 0.6, gen)
        assert int(rel.sum(1).max()) > _retrieval_scan._LOOP_MAX_RELEVANT or force_sort
        assert retrieval_ranks(sim, rel).tolist() == ref_ranks(sim, rel)
        for k in (5, g):
            for denominator in ("n_relevant", "min_n_relevant_k"):
                want = ref_map(sim, rel, k, denominator)
                got = map_at_k(sim, rel, k=k, denominator=denominator)
                assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_scores(gen, dtype):
    # Integer scores in [-2, 2] are exact in every float dtype: same answers as float64.
    sim = random_scores(20, 11, True, gen)
    rel = random_relevance(20, 11, 0.3, gen)
    low = sim.to(dtype)
    assert retrieval_ranks(low, rel).tolist() == ref_ranks(sim, rel)
    assert map_at_k(low, rel, k=5) == pytest.approx(ref_map(sim, rel, 5), abs=1e-12)


# --------------------------------------------------------------------------- hand-built


def test_perfect_retrieval_with_negative_scores(gen):
    # Every score is negative; the relevant item still has the highest score of its row.
    sim = -5.0 - torch.rand(8, 8, generator=gen)
    sim.fill_diagonal_(-1.0)
    assert recall_at_k(sim, k=(1, 5)) == {1: 1.0, 5: 1.0}
    assert map_at_k(sim, k=1) == 1.0
    assert retrieval_ranks(sim).tolist() == [1] * 8


def test_reversed_retrieval(gen):
    g = 6
    sim = 1.0 + torch.rand(g, g, generator=gen)
    sim.fill_diagonal_(0.0)  # relevant item scored lowest: rank G
    assert retrieval_ranks(sim).tolist() == [g] * g
    assert recall_at_k(sim, k=(1, g - 1, g)) == {1: 0.0, g - 1: 0.0, g: 1.0}
    assert map_at_k(sim, k=g - 1) == 0.0
    assert map_at_k(sim, k=g) == pytest.approx(1 / g)  # P@G = 1/G, one relevant item


def test_ties_are_pessimistic():
    # Row 0: relevant col 0 ties with irrelevant col 1 -> rank 2, not 1.
    # Row 1: all equal -> relevant item last, rank 3.
    sim = torch.tensor([[0.5, 0.5, 0.1], [0.2, 0.2, 0.2], [0.0, 0.0, 0.3]])
    assert retrieval_ranks(sim).tolist() == [2, 3, 1]
    assert recall_at_k(sim, k=1) == pytest.approx(1 / 3)
    assert map_at_k(sim, k=3) == pytest.approx((1 / 2 + 1 / 3 + 1) / 3)


def test_tied_relevant_items_are_ranked_after_tied_irrelevant_ones():
    # All 4 scores equal, 2 relevant: pessimistic order irr, irr, rel, rel.
    # AP@4 = (P@3 + P@4) / 2 = (1/3 + 2/4) / 2 = 5/12; AP@3 = (1/3) / 2 = 1/6;
    # with min(n_relevant, k) = 2 at k = 3 the same 1/6, at k = 2 it is 0.
    sim = torch.zeros(1, 4)
    rel = torch.tensor([[True, False, True, False]])
    assert map_at_k(sim, rel, k=4) == pytest.approx(5 / 12)
    assert map_at_k(sim, rel, k=3) == pytest.approx(1 / 6)
    assert map_at_k(sim, rel, k=2, denominator="min_n_relevant_k") == 0.0
    assert retrieval_ranks(sim, rel).tolist() == [3]


def test_map_denominators_by_hand():
    # 20 items, 5 relevant at ranks 1, 3, 12, 13, 14 (scores 20 - rank).
    g = 20
    sim = torch.tensor([[float(g - r) for r in range(1, g + 1)]])
    rel = torch.zeros(1, g, dtype=torch.bool)
    rel[0, [0, 2, 11, 12, 13]] = True
    # k = 10: (P@1 + P@3) / 5 = (1 + 2/3) / 5 = 1/3 for both (min(5, 10) = 5).
    assert map_at_k(sim, rel, k=10) == pytest.approx(1 / 3)
    assert map_at_k(sim, rel, k=10, denominator="min_n_relevant_k") == pytest.approx(1 / 3)
    # k = 3: (1 + 2/3) / 5 = 1/3 versus (1 + 2/3) / min(5, 3) = 5/9.
    assert map_at_k(sim, rel, k=3) == pytest.approx(1 / 3)
    assert map_at_k(sim, rel, k=3, denominator="min_n_relevant_k") == pytest.approx(5 / 9)
    # k = 14: (1 + 2/3 + 3/12 + 4/13 + 5/14) / 5.
    want = (1 + 2 / 3 + 3 / 12 + 4 / 13 + 5 / 14) / 5
    assert map_at_k(sim, rel, k=14) == pytest.approx(want)


def test_a2t_hit_rate_not_fraction_of_relevant():
    # 1 query, 3 relevant of 4; top-1 relevant -> R@1 = 1 (a hit), not 1/3.
    sim = torch.tensor([[0.9, 0.8, 0.1, 0.0]])
    rel = torch.tensor([[True, False, True, True]])
    assert recall_at_k(sim, rel, k=1) == 1.0


def test_return_types():
    sim = torch.eye(4)
    r = recall_at_k(sim, k=2)
    assert isinstance(r, float)
    rs = recall_at_k(sim, k=[1, 2])
    assert isinstance(rs, dict) and list(rs) == [1, 2]
    assert isinstance(map_at_k(sim, k=2), float)
    ranks = retrieval_ranks(sim)
    assert ranks.dtype == torch.int64 and ranks.shape == (4,)


# --------------------------------------------------------------------------- torchmetrics


def _tm_inputs(sim: torch.Tensor, rel: torch.Tensor):
    q, g = sim.shape
    return sim.flatten().float(), rel.flatten(), torch.arange(q).repeat_interleave(g)


def test_agrees_with_torchmetrics_single_relevant(gen):
    # torchmetrics drops scores <= 0 and breaks ties by sort order: compare on positive,
    # continuous (tie-free) scores. With one relevant item per query RetrievalRecall (a
    # fraction of relevant retrieved) is our hit-rate R@k, and RetrievalMAP(top_k) (which
    # divides by the relevant items found in the top k) is our mAP@k.
    tm = pytest.importorskip("torchmetrics.retrieval")
    q, g = 40, 25
    sim = torch.rand(q, g, generator=gen, dtype=torch.float64) + 0.01
    query_ids = torch.randint(0, g, (q,), generator=gen)
    rel = query_ids[:, None] == torch.arange(g)[None, :]
    preds, target, indexes = _tm_inputs(sim, rel)
    for k in (1, 5, 10):
        theirs = tm.RetrievalRecall(top_k=k)(preds, target, indexes=indexes)
        assert recall_at_k(sim, query_ids=query_ids, k=k) == pytest.approx(float(theirs), abs=1e-6)
        theirs = tm.RetrievalMAP(top_k=k)(preds, target, indexes=indexes)
        assert map_at_k(sim, query_ids=query_ids, k=k) == pytest.approx(float(theirs), abs=1e-6)


def test_agrees_with_torchmetrics_multi_relevant(gen):
    # Several relevant items (A2T): RetrievalHitRate is our R@k; RetrievalMAP without top_k
    # (all relevant items retrieved, so its denominator is n_relevant) is our mAP@G.
    # RetrievalMAP(top_k < G) divides by the relevant items found and is NOT compared.
    tm = pytest.importorskip("torchmetrics.retrieval")
    q, g = 30, 20
    sim = torch.rand(q, g, generator=gen, dtype=torch.float64) + 0.01
    rel = random_relevance(q, g, 0.25, gen)
    preds, target, indexes = _tm_inputs(sim, rel)
    for k in (1, 5, 10):
        theirs = tm.RetrievalHitRate(top_k=k)(preds, target, indexes=indexes)
        assert recall_at_k(sim, rel, k=k) == pytest.approx(float(theirs), abs=1e-6)
    theirs = tm.RetrievalMAP()(preds, target, indexes=indexes)
    assert map_at_k(sim, rel, k=g) == pytest.approx(float(theirs), abs=1e-6)


# --------------------------------------------------------------------------- properties

sizes = st.tuples(st.integers(1, 12), st.integers(2, 12), st.integers(0, 2**31 - 1))


def _draw(q: int, g: int, seed: int, tied: bool, p: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    sim, rel = random_scores(q, g, tied, gen), random_relevance(q, g, p, gen)
    if bool(rel.all()):  # refused: every ranking would be perfect (row 0 keeps g - 1 >= 1)
        rel[0, 0] = False
    return sim, rel, gen


@given(sizes, st.booleans())
def test_gallery_permutation_invariance(size, tied):
    q, g, seed = size
    sim, rel, gen = _draw(q, g, seed, tied)
    perm = torch.randperm(g, generator=gen)
    ps, pr = sim[:, perm], rel[:, perm]
    assert retrieval_ranks(ps, pr).tolist() == retrieval_ranks(sim, rel).tolist()
    assert recall_at_k(ps, pr, k=(1, g)) == recall_at_k(sim, rel, k=(1, g))
    assert map_at_k(ps, pr, k=g) == pytest.approx(map_at_k(sim, rel, k=g), abs=1e-12)


@given(sizes, st.booleans())
def test_query_permutation_permutes_ranks(size, tied):
    q, g, seed = size
    sim, rel, gen = _draw(q, g, seed, tied)
    perm = torch.randperm(q, generator=gen)
    assert (
        retrieval_ranks(sim[perm], rel[perm]).tolist() == retrieval_ranks(sim, rel)[perm].tolist()
    )


@given(sizes, st.booleans())
def test_monotonic_in_k(size, tied):
    q, g, seed = size
    sim, rel, _ = _draw(q, g, seed, tied)
    ks = list(range(1, g + 1))
    rec = recall_at_k(sim, rel, k=ks)
    maps = [map_at_k(sim, rel, k=k) for k in ks]
    capped = [map_at_k(sim, rel, k=k, denominator="min_n_relevant_k") for k in ks]
    for i in range(1, g):
        assert rec[ks[i]] >= rec[ks[i - 1]]
        assert maps[i] >= maps[i - 1] - 1e-12  # n_relevant denominator: only adds terms
    assert rec[g] == 1.0
    for k, m, c in zip(ks, maps, capped, strict=True):
        assert 0.0 <= m <= c + 1e-12  # min(n, k) <= n
        assert c <= rec[k] + 1e-12  # AP@k <= 1 and is 0 without a hit in the top k


@given(sizes)
def test_invariant_to_increasing_affine_map(size):
    # Integer scores: 3 * s - 7 is exact in float64 and keeps every tie.
    q, g, seed = size
    sim, rel, _ = _draw(q, g, seed, True)
    moved = 3.0 * sim - 7.0
    assert retrieval_ranks(moved, rel).tolist() == retrieval_ranks(sim, rel).tolist()
    assert map_at_k(moved, rel, k=g) == map_at_k(sim, rel, k=g)


@given(sizes, st.integers(1, 15), st.booleans())
def test_chunked_equals_unchunked(size, chunk, tied):
    q, g, seed = size
    sim, rel, _ = _draw(q, g, seed, tied, p=0.5)
    k = min(3, g)
    whole = dict(chunk_size=q)
    assert (
        retrieval_ranks(sim, rel, chunk_size=chunk).tolist()
        == retrieval_ranks(sim, rel, **whole).tolist()
    )
    assert recall_at_k(sim, rel, k=(1, k), chunk_size=chunk) == recall_at_k(
        sim, rel, k=(1, k), **whole
    )
    assert map_at_k(sim, rel, k=k, chunk_size=chunk) == pytest.approx(
        map_at_k(sim, rel, k=k, **whole), abs=1e-12
    )


def test_default_chunking_splits_rows(gen, monkeypatch):
    sim = random_scores(50, 7, True, gen)
    rel = random_relevance(50, 7, 0.3, gen)
    whole = map_at_k(sim, rel, k=4, chunk_size=50), retrieval_ranks(sim, rel, chunk_size=50)
    monkeypatch.setattr(_retrieval_scan, "_CHUNK_ELEMENTS", 20)  # 20 // 7 = 2 rows per chunk
    assert _retrieval_scan._chunk_rows(None, 7) == 2
    assert map_at_k(sim, rel, k=4) == pytest.approx(whole[0], abs=1e-12)
    assert torch.equal(retrieval_ranks(sim, rel), whole[1])


# --------------------------------------------------------------------------- embeddings


def _embeddings(n: int, n_lang: int, c: int, d: int, gen: torch.Generator, noise: float = 1.0):
    audio = torch.randn(n, d, generator=gen, dtype=torch.float64)
    text = audio[:, None, None, :] + noise * torch.randn(
        n, n_lang, c, d, generator=gen, dtype=torch.float64
    )
    return audio, text


def _cos(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("c", [1, 3])
def test_audio_text_retrieval_equals_sim_functions(gen, c):
    n = 15
    audio, text = _embeddings(n, 1, c, 8, gen)
    text = text[:, 0]  # (N, C, D)
    flat = _cos(text).reshape(n * c, -1)
    a = _cos(audio)
    cap_audio = torch.arange(n).repeat_interleave(c)
    got = audio_text_retrieval(audio, text, k=(1, 5, 10), map_k=10)
    t2a_sim, a2t_sim = flat @ a.T, a @ flat.T
    want_t2a = {f"R@{k}": v for k, v in recall_at_k(t2a_sim, query_ids=cap_audio).items()}
    want_t2a["mAP@10"] = map_at_k(t2a_sim, query_ids=cap_audio, k=10)
    want_a2t = {f"R@{k}": v for k, v in recall_at_k(a2t_sim, gallery_ids=cap_audio).items()}
    want_a2t["mAP@10"] = map_at_k(a2t_sim, gallery_ids=cap_audio, k=10)
    assert got["t2a"] == pytest.approx(want_t2a, abs=1e-12)
    assert got["a2t"] == pytest.approx(want_a2t, abs=1e-12)
    assert list(got["t2a"]) == ["R@1", "R@5", "R@10", "mAP@10"]
    # chunking does not change anything
    assert audio_text_retrieval(audio, text, chunk_size=4) == got
    if c == 1:
        assert audio_text_retrieval(audio, text[:, 0]) == got  # (N, D) text means C = 1


def test_audio_text_retrieval_normalize_flag(gen):
    # Scaling one clip's embedding up changes raw inner products but not cosines.
    audio, text = _embeddings(12, 1, 2, 6, gen)
    text = text[:, 0]
    scaled = audio.clone()
    scaled[0] *= 50.0
    assert audio_text_retrieval(scaled, text) == audio_text_retrieval(audio, text)
    raw = audio_text_retrieval(scaled, text, normalize=False)
    flat = text.reshape(24, -1)
    want = recall_at_k(flat @ scaled.T, query_ids=torch.arange(12).repeat_interleave(2), k=1)
    assert raw["t2a"]["R@1"] == want


# --------------------------------------------------------------------------- consistency


def test_mean_rank_variance_matches_reference(gen):
    ranks = torch.randint(1, 50, (13, 4), generator=gen)
    assert mean_rank_variance(ranks) == pytest.approx(ref_mrv(ranks.tolist()), rel=1e-12)
    f = ranks.float() + 0.5
    assert mean_rank_variance(f) == pytest.approx(ref_mrv(f.tolist()), rel=1e-12)


def test_mean_rank_variance_by_hand():
    # Sample 0: ranks 1, 3 -> mean 2, squared deviations 1, 1. Sample 1: 5, 5 -> 0.
    # MRV = (1 + 1 + 0 + 0) / (N K = 4) = 0.5 (population variance; std would be 0.707).
    assert mean_rank_variance(torch.tensor([[1, 3], [5, 5]])) == 0.5
    assert mean_rank_variance(torch.tensor([[7], [2]])) == 0.0  # K = 1
    assert mean_rank_variance(torch.full((3, 5), 4)) == 0.0


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("anchor", [0, 2])
def test_gap_and_distance_match_reference(gen, normalize, anchor):
    text = torch.randn(9, 3, 5, generator=gen, dtype=torch.float64)
    gaps, dists = ref_gap_distance(text, anchor, normalize)
    got_gap = embedding_gap(text, anchor, normalize=normalize)
    got_dis = embedding_distance(text, anchor, normalize=normalize)
    assert got_gap.tolist() == pytest.approx(gaps, abs=1e-12)
    assert got_dis.tolist() == pytest.approx(dists, abs=1e-12)
    assert got_gap[anchor] == 0 and got_dis[anchor] == 0
    assert got_gap.shape == (3,) and got_gap.dtype == torch.float64


def test_gap_and_distance_by_hand():
    # Language 1 is language 0 shifted by v = (3, 4) for every sentence (raw embeddings):
    # gap = distance = ||v|| = 5. Language 2 = language 0 shifted by +v for sentence 0 and
    # -v for sentence 1: centroids equal (gap 0) but every pair is 5 apart (distance 5).
    base = torch.tensor([[1.0, 2.0], [-3.0, 0.5]])
    v = torch.tensor([3.0, 4.0])
    text = torch.stack([base, base + v, base + torch.stack([v, -v])], dim=1)  # (2, 3, 2)
    assert embedding_gap(text, normalize=False).tolist() == pytest.approx([0.0, 5.0, 0.0])
    assert embedding_distance(text, normalize=False).tolist() == pytest.approx([0.0, 5.0, 5.0])
    # normalize=True: a scaled copy of the anchor has gap and distance 0.
    scaled = torch.stack([base, 7.0 * base], dim=1)
    assert embedding_gap(scaled).tolist() == pytest.approx([0.0, 0.0], abs=1e-7)
    assert embedding_distance(scaled).tolist() == pytest.approx([0.0, 0.0], abs=1e-7)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_distance_at_least_gap(n, n_lang, d, seed):
    text = torch.randn(
        n, n_lang, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    for normalize in (True, False):
        gap = embedding_gap(text, normalize=normalize)
        dis = embedding_distance(text, normalize=normalize)
        assert bool((dis >= gap - 1e-12).all())


# --------------------------------------------------------------------------- report


def test_report_matches_building_blocks(gen):
    n, n_lang, c, d = 14, 3, 2, 8
    audio, text = _embeddings(n, n_lang, c, d, gen, noise=1.5)
    langs = ["en", "fr", "de"]
    report = retrieval_report(audio, text, langs)
    assert isinstance(report, dict) and isinstance(report, RetrievalReport)
    assert report["languages"] == langs and report["anchor"] == "en"
    cap_audio = torch.arange(n).repeat_interleave(c)
    a = _cos(audio)
    ranks = []
    for i, lang in enumerate(langs):
        entry = report["per_language"][lang]
        assert entry["t2a"] == audio_text_retrieval(audio, text[:, i])["t2a"]
        assert entry["a2t"] == audio_text_retrieval(audio, text[:, i])["a2t"]
        ranks.append(retrieval_ranks(_cos(text[:, i]).reshape(n * c, d) @ a.T, query_ids=cap_audio))
    by_sentence = text.transpose(1, 2).reshape(n * c, n_lang, d)  # caption (i, c) across languages
    gaps, dists = ref_gap_distance(by_sentence, 0, True)
    for i, lang in enumerate(langs):
        assert report["per_language"][lang]["gap"] == pytest.approx(gaps[i], abs=1e-12)
        assert report["per_language"][lang]["distance"] == pytest.approx(dists[i], abs=1e-12)
    for direction in ("t2a", "a2t"):
        for key, value in report["average"][direction].items():
            mean = sum(report["per_language"][lang][direction][key] for lang in langs) / 3
            assert value == pytest.approx(mean, abs=1e-15)
    assert report["average"]["gap"] == pytest.approx((gaps[1] + gaps[2]) / 2, abs=1e-12)
    assert report["average"]["distance"] == pytest.approx((dists[1] + dists[2]) / 2, abs=1e-12)
    stacked = torch.stack(ranks, dim=1)  # (N*C, K)
    assert report["mrv"] == pytest.approx(ref_mrv(stacked.tolist()), rel=1e-12)
    assert report["mrv"] > 0  # the languages disagree on this noisy data
    json.dumps(report)  # plain Python values only
    assert retrieval_report(audio, text, langs, chunk_size=3) == report


def test_report_anchor_and_single_language(gen):
    audio, text = _embeddings(12, 2, 1, 4, gen)
    by_name = retrieval_report(audio, text, ["fr", "en"], anchor="en")
    by_index = retrieval_report(audio, text, ["fr", "en"], anchor=1)
    assert by_name == by_index and by_name["anchor"] == "en"
    assert by_name["per_language"]["en"]["gap"] == 0.0
    single = retrieval_report(audio, text[:, 0])  # (N, C, D): one language
    assert single["languages"] == ["lang0"]
    assert single["mrv"] is None and single["average"]["gap"] is None
    assert single["average"]["t2a"] == single["per_language"]["lang0"]["t2a"]


def test_report_rendering(gen):
    audio, text = _embeddings(12, 2, 2, 4, gen)
    report = retrieval_report(audio, text, ["en", "es"], k=(1, 5))
    header, rows = report.table()
    assert header == [
        "language",
        "T2A R@1",
        "T2A R@5",
        "T2A mAP@10",
        "A2T R@1",
        "A2T R@5",
        "A2T mAP@10",
        "gap",
        "distance",
        "MRV",
    ]
    assert [r[0] for r in rows] == ["en", "es", "average"]
    parsed = list(csv.reader(io.StringIO(report.to_csv())))
    assert parsed[0] == header
    assert float(parsed[2][1]) == report["per_language"]["es"]["t2a"]["R@1"]  # full precision
    assert float(parsed[3][-1]) == report["mrv"] and parsed[1][-1] == ""
    md = report.to_markdown().splitlines()
    assert len(md) == 2 + 3 and md[0].startswith("| language | T2A R@1 |")
    cells = [x.strip() for x in md[3].strip("|").split("|")]
    assert cells[0] == "es"
    assert cells[1] == f"{100 * report['per_language']['es']['t2a']['R@1']:.2f}"
    assert cells[-1] == "-"
    frac = report.to_markdown(percent=False).splitlines()[2]
    assert f"{report['per_language']['en']['t2a']['R@1']:.4f}" in frac


# --------------------------------------------------------------------------- bad inputs

META = "meta"  # a second device available on every machine: device checks fire before compute


def _sim():
    return torch.rand(4, 4)


BAD_SIM_CALLS = [
    (lambda: recall_at_k([[1.0]]), TypeError, "^sim: expected a torch.Tensor"),
    (lambda: recall_at_k(torch.rand(5)), ValueError, r"^sim: expected shape \(Q, G\)"),
    (lambda: recall_at_k(torch.rand(2, 3, 4)), ValueError, "^sim: expected shape"),
    (lambda: recall_at_k(torch.ones(3, 3, dtype=torch.int64)), TypeError, "^sim: .*floating"),
    (lambda: recall_at_k(torch.rand(0, 3)), ValueError, "^sim: needs at least one"),
    (
        lambda: map_at_k(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), k=1),
        ValueError,
        r"^sim: NaN/Inf similarity in query row\(s\) \[0\]",
    ),
    (
        lambda: retrieval_ranks(torch.tensor([[1.0, 0.0], [float("inf"), 1.0]])),
        ValueError,
        r"^sim: NaN/Inf .*\[1\]",
    ),
    (
        lambda: recall_at_k(
            torch.tensor([[0.5, 1.0, float("-inf")], [0.0, 1.0, 2.0]], dtype=torch.float16),
            gallery_ids=torch.arange(3),
            query_ids=torch.arange(2),
            k=1,
        ),
        ValueError,
        r"^sim: NaN/Inf .*\[0\]",
    ),
    (
        lambda: map_at_k(
            torch.rand(3, 3, dtype=torch.bfloat16).index_fill(1, torch.tensor([2]), float("nan")),
            k=1,
        ),
        ValueError,
        r"^sim: NaN/Inf .*\[0, 1, 2\]",
    ),
    (lambda: recall_at_k(_sim(), k=0), ValueError, "^k: must be >= 1, got 0"),
    (lambda: recall_at_k(_sim(), k=(1, -2)), ValueError, "^k: must be >= 1"),
    (lambda: recall_at_k(_sim(), k=5), ValueError, r"^k: 5 exceeds the gallery size"),
    (lambda: map_at_k(_sim(), k=5), ValueError, r"^k: 5 exceeds the gallery size"),
    (lambda: map_at_k(_sim(), k=0), ValueError, "^k: must be >= 1"),
    (lambda: recall_at_k(_sim(), k=1.0), TypeError, "^k: expected an int"),
    (lambda: recall_at_k(_sim(), k=True), TypeError, "^k: expected an int"),
    (lambda: recall_at_k(_sim(), k=()), ValueError, "^k: expected at least one"),
    (lambda: map_at_k(_sim(), k=2, denominator="min"), ValueError, "^denominator: expected one of"),
    (lambda: recall_at_k(_sim(), k=1, chunk_size=0), ValueError, "^chunk_size: must be >= 1"),
    (
        lambda: recall_at_k(torch.rand(5, 4), k=1),
        ValueError,
        r"^sim: shape \(5, 4\) is not square",
    ),
    (
        lambda: recall_at_k(_sim(), torch.zeros(4, 4, dtype=torch.bool), k=1),
        ValueError,
        r"^relevance: query row\(s\) \[0, 1, 2, 3\] have no relevant",
    ),
    (
        lambda: recall_at_k(_sim(), torch.ones(5, 4, dtype=torch.bool), k=1),
        ValueError,
        r"^relevance: expected shape \(4, 4\)",
    ),
    (lambda: recall_at_k(_sim(), torch.ones(4, 4), k=1), TypeError, "^relevance: expected a bool"),
    (
        lambda: recall_at_k(_sim(), torch.eye(4, dtype=torch.bool), query_ids=torch.arange(4)),
        ValueError,
        "^relevance: pass either",
    ),
    (
        lambda: recall_at_k(_sim(), torch.eye(4, dtype=torch.bool, device=META)),
        ValueError,
        "^relevance: on device meta but sim is on cpu",
    ),
    (
        lambda: recall_at_k(_sim(), query_ids=torch.arange(3)),
        ValueError,
        r"^query_ids: expected shape \(4,\)",
    ),
    (
        lambda: recall_at_k(_sim(), query_ids=torch.arange(4.0)),
        TypeError,
        "^query_ids: expected an integer tensor",
    ),
    (
        lambda: recall_at_k(_sim(), gallery_ids=torch.arange(5)),
        ValueError,
        r"^gallery_ids: expected shape \(4,\)",
    ),
    (
        lambda: recall_at_k(_sim(), gallery_ids=torch.arange(4, device=META)),
        ValueError,
        "^gallery_ids: on device meta",
    ),
    (
        lambda: map_at_k(_sim(), query_ids=torch.tensor([0, 1, 2, 9]), k=1),
        ValueError,
        r"^query_ids/gallery_ids: query row\(s\) \[3\] have no relevant",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_SIM_CALLS)
def test_bad_sim_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _a():
    return torch.randn(6, 4)


def _t():
    return torch.randn(6, 2, 4)


BAD_EMBEDDING_CALLS = [
    (
        lambda: audio_text_retrieval(torch.randn(6, 2, 4), _t()),
        ValueError,
        r"^audio: expected shape \(N, D\)",
    ),
    (
        lambda: audio_text_retrieval(_a(), torch.randn(6, 2, 1, 4)),
        ValueError,
        "^text: expected shape",
    ),
    (
        lambda: audio_text_retrieval(_a(), torch.randn(5, 2, 4)),
        ValueError,
        "^text: number of audio clips N 5 does not match audio's 6",
    ),
    (
        lambda: audio_text_retrieval(_a(), torch.randn(6, 2, 3)),
        ValueError,
        "^text: embedding dimension D",
    ),
    (
        lambda: audio_text_retrieval(_a(), _t().double()),
        TypeError,
        "^text: dtype torch.float64 differs",
    ),
    (
        lambda: audio_text_retrieval(_a(), torch.randn(6, 2, 4, device=META)),
        ValueError,
        "^text: on device meta",
    ),
    (
        lambda: audio_text_retrieval(_a().long(), _t().long()),
        TypeError,
        "^audio: expected a floating",
    ),
    (
        lambda: audio_text_retrieval(_a(), _t().index_fill(0, torch.tensor([2]), float("nan"))),
        ValueError,
        "^text: contains",
    ),
    (
        lambda: audio_text_retrieval(_a().index_fill(0, torch.tensor([1]), 0.0), _t()),
        ValueError,
        r"^audio: embedding at index \(1,\) is all zeros",
    ),
    (
        lambda: audio_text_retrieval(_a(), _t(), k=(1, 7)),
        ValueError,
        "^k: 7 exceeds the number of audio",
    ),
    (lambda: audio_text_retrieval(_a(), _t(), k=5), TypeError, "^k: expected a sequence"),
    (lambda: audio_text_retrieval(_a(), _t(), k=(1,), map_k=0), ValueError, "^map_k: must be >= 1"),
    (lambda: audio_text_retrieval(_a(), _t(), k=(1,), map_k=7), ValueError, "^map_k: 7 exceeds"),
    (lambda: mean_rank_variance(torch.ones(5)), ValueError, r"^ranks: expected shape \(N, K\)"),
    (
        lambda: mean_rank_variance(torch.ones(2, 2, dtype=torch.bool)),
        TypeError,
        "^ranks: expected an integer",
    ),
    (lambda: mean_rank_variance(torch.ones(0, 2)), ValueError, "^ranks: needs at least one"),
    (
        lambda: mean_rank_variance(torch.tensor([[1.0, float("nan")]])),
        ValueError,
        "^ranks: contains",
    ),
    (lambda: mean_rank_variance([[1, 2]]), TypeError, "^ranks: expected a torch.Tensor"),
    (lambda: embedding_gap(torch.randn(4, 3)), ValueError, r"^text: expected shape \(N, K, D\)"),
    (lambda: embedding_gap(torch.randn(4, 3, 2), anchor=3), ValueError, "^anchor: 3 exceeds"),
    (
        lambda: embedding_distance(torch.randn(4, 3, 2), anchor=-1),
        ValueError,
        "^anchor: must be >= 0",
    ),
    (
        lambda: embedding_distance(torch.randn(4, 3, 2), anchor="en"),
        TypeError,
        "^anchor: expected an int",
    ),
    (
        lambda: embedding_distance(torch.randn(4, 3, 2).long()),
        TypeError,
        "^text: expected a floating",
    ),
    (lambda: embedding_gap(torch.zeros(4, 3, 2)), ValueError, "^text: embedding at index"),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 2, 1, 4), ["en"]),
        ValueError,
        r"^languages: 1 name\(s\) \['en'\] for K = 2",
    ),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 2, 1, 4), ["en", "en"]),
        ValueError,
        "^languages: names must be distinct",
    ),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 2, 1, 4), "en"),
        TypeError,
        "^languages: expected",
    ),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 2, 1, 4), ["en", 3]),
        TypeError,
        "^languages: expected",
    ),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 2, 1, 4), ["en", "fr"], anchor="de"),
        ValueError,
        "^anchor: 'de' is not one of",
    ),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 1, 2, 1, 4)),
        ValueError,
        "^text: expected shape",
    ),
    (
        lambda: retrieval_report(_a(), torch.randn(6, 2, 1, 4), k=(1, 5, 10)),
        ValueError,
        "^k: 10 exceeds the number of audio clips N",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_EMBEDDING_CALLS)
def test_bad_embedding_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# --------------------------------------------------------------------------- docs, devices


def test_docstring_examples_run():
    # testmod finds only what a module defines: run the modules behind metrics' names too.
    names = {sys.modules[getattr(metrics, name).__module__] for name in metrics.__all__}
    attempted = 0
    for module in sorted(names | {metrics}, key=lambda m: m.__name__):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        attempted += result.attempted
        assert result.failed == 0, module.__name__
    assert attempted >= 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(gen):
    sim = random_scores(40, 30, True, gen)
    rel = random_relevance(40, 30, 0.3, gen)
    cuda = sim.cuda(), rel.cuda()
    assert retrieval_ranks(*cuda).cpu().tolist() == retrieval_ranks(sim, rel).tolist()
    assert map_at_k(*cuda, k=30) == pytest.approx(map_at_k(sim, rel, k=30), abs=1e-12)
    audio, text = _embeddings(12, 2, 2, 4, gen)
    on_gpu, on_cpu = retrieval_report(audio.cuda(), text.cuda()), retrieval_report(audio, text)
    for lang in on_cpu["languages"]:
        for direction in ("t2a", "a2t"):
            got = on_gpu["per_language"][lang][direction]
            assert got == pytest.approx(on_cpu["per_language"][lang][direction], abs=1e-12)


def test_inputs_that_require_grad(gen):
    # Metrics detach: no graph is built and the out= buffers do not trip autograd.
    sim = random_scores(10, 10, False, gen).requires_grad_()
    assert retrieval_ranks(sim).tolist() == retrieval_ranks(sim.detach()).tolist()
    assert map_at_k(sim, k=3) == map_at_k(sim.detach(), k=3)
    audio, text = _embeddings(10, 2, 2, 4, gen)
    report = retrieval_report(audio.requires_grad_(), text.requires_grad_())
    assert report == retrieval_report(audio.detach(), text.detach())
    assert audio_text_retrieval(audio, text[:, 0]) == audio_text_retrieval(
        audio.detach(), text[:, 0].detach()
    )


def test_no_full_matrix_allocation(gen):
    # From embeddings, no single allocation may approach the (N*C, N) score matrix: every
    # (block, G) temporary is a reused buffer of chunk_size rows.
    n, c, d, chunk = 100, 2, 4, 4
    audio, text = _embeddings(n, 1, c, d, gen)
    text = text[:, 0]
    full = n * c * n * 8  # float64 scores of either direction: 160 KB
    block = chunk * n * c * 8  # the widest block: A2T, 4 rows x 200 captions: 6.4 KB
    with torch.profiler.profile(profile_memory=True) as prof:
        audio_text_retrieval(audio, text, chunk_size=chunk)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert block <= largest <= 2 * block < full
