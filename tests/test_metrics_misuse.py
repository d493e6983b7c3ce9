"""Issue 42 item 1: every metric refuses what it does not take, so no misuse gives a number.

Each test is a call a new user made (or would make) that returned a plausible number on
main 3ee2316: embeddings handed to the similarity-matrix functions, a relevance cast from
embeddings (True almost everywhere: R@k = 1.0 on random data), KCLLoss's ``(B, K, D)``
read by ``retrieval_report`` as one language with K captions, similarity scores handed
to ``mean_rank_variance`` as ranks. Each now raises (or warns) and names the function or
the layout that fits; a 3-D text with ``languages`` of length K is read as K languages.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from contrastive_losses import InfoNCELoss, KCLLoss
from contrastive_losses.metrics import (
    audio_text_retrieval,
    embedding_distance,
    embedding_gap,
    map_at_k,
    mean_rank_variance,
    recall_at_k,
    retrieval_ranks,
    retrieval_report,
)

N, K, D = 40, 3, 16
SIM_FUNCTIONS = [
    pytest.param(lambda *a, **kw: recall_at_k(*a, k=1, **kw), id="recall_at_k"),
    pytest.param(lambda *a, **kw: map_at_k(*a, k=1, **kw), id="map_at_k"),
    pytest.param(retrieval_ranks, id="retrieval_ranks"),
]


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrelated random audio (N, D) and KCL-layout text (N, K, D): chance-level data."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randn(N, K, D, generator=g)


def _multilingual(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Audio (N, D) and text (N, K, D) whose languages retrieve differently well."""
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(N, D, generator=g)
    noise = torch.tensor([0.3, 1.0, 1.6])[:, None]  # (K, 1): language k is noisier
    return audio, audio[:, None] + noise * torch.randn(N, K, D, generator=g)


# ------------------------------------------------------------ similarity-matrix functions


@pytest.mark.parametrize("fn", SIM_FUNCTIONS)
def test_two_embedding_matrices_are_refused_and_pointed_to_the_embedding_api(fn):
    audio, text = _data()
    with pytest.raises(TypeError, match=r"^relevance: .*audio_text_retrieval\(audio, text\)"):
        fn(audio, text[:, 0])  # recall_at_k(audio, text): the first call a user tries
    with pytest.raises(TypeError) as err:
        fn(audio, text[:, 0])
    assert ".bool()" not in str(err.value)  # that hint led to R@k = 1.0 on random data


@pytest.mark.parametrize("fn", SIM_FUNCTIONS)
def test_a_relevance_cast_from_embeddings_is_refused(fn):
    # The old hint's result: relevance True everywhere, every R@k 1.0 whatever the scores.
    audio, text = _data()
    with pytest.raises(ValueError, match=r"^relevance: every gallery item is relevant") as err:
        fn(audio, text[:, 0].bool())
    assert "audio_text_retrieval" in str(err.value)
    with pytest.raises(ValueError, match=r"^query_ids/gallery_ids: every gallery item"):
        fn(torch.randn(4, 4), query_ids=torch.zeros(4).long(), gallery_ids=torch.zeros(4).long())


def test_a_relevance_true_almost_everywhere_warns_with_the_chance_level():
    g = torch.Generator().manual_seed(0)
    sim = torch.randn(20, 10, generator=g)
    rel = torch.ones(20, 10, dtype=torch.bool)
    rel[:, :2] = False  # 80% relevant: a random ranking scores R@1 = 0.8
    with pytest.warns(UserWarning, match=r"^relevance: 80\.0% .* R@1 = 0\.80") as record:
        recall_at_k(sim, rel, k=1)
    assert record[0].filename == __file__  # points at the caller's line
    sparse = torch.zeros(20, 10, dtype=torch.bool)
    sparse[torch.arange(20), torch.arange(20) % 10] = True  # 10%: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recall_at_k(sim, sparse, k=1)


def test_a_binary_float_mask_still_gets_the_bool_hint():
    sim = torch.randn(5, 5)
    with pytest.raises(TypeError, match=r"holding only 0 and 1 \(use relevance\.bool\(\)\)"):
        recall_at_k(sim, torch.eye(5), k=1)


@pytest.mark.parametrize("fn", SIM_FUNCTIONS)
def test_one_embedding_matrix_as_sim_is_refused(fn):
    # (N, D) with N < D used to give a number (the "diagonal" of N rows in D columns);
    # with N > D an error that named query_ids/gallery_ids only.
    audio, _ = _data()
    for emb in (audio, audio[: D // 2]):  # (40, 16), (8, 16)
        with pytest.raises(ValueError, match=r"^sim: shape \(\d+, 16\) is not square") as err:
            fn(emb)
        assert "audio_text_retrieval" in str(err.value)
    with pytest.raises(ValueError, match=r"^sim: expected shape \(Q, G\).*audio_text_retrieval"):
        fn(torch.randn(N, K, D))


def test_a2t_scores_without_gallery_ids_are_refused():
    # audio @ captions.T is (N, N*C): without gallery_ids only caption i counted for clip i.
    audio, text = _data()
    flat = text.reshape(N * K, D)
    with pytest.raises(ValueError, match=r"not square.*gallery_ids=caption_to_audio"):
        recall_at_k(audio @ flat.T, k=1)
    caption_to_audio = torch.arange(N).repeat_interleave(K)
    got = recall_at_k(audio @ flat.T, gallery_ids=caption_to_audio, k=1)
    assert 0.0 <= got <= 1.0


# ------------------------------------------------------------------ retrieval_report


def test_report_reads_kcl_layout_with_k_names_as_k_languages():
    audio, text = _multilingual()  # (N, D), (N, K, D): KCLLoss's layout
    names = ["en", "fr", "de"]
    got = retrieval_report(audio, text, names)
    assert got == retrieval_report(audio, text[:, :, None], names)  # (N, K, 1, D)
    assert got["languages"] == names and got["n_captions"] == 1
    r1 = [got["per_language"][lang]["t2a"]["R@1"] for lang in names]
    assert r1[0] > r1[2]  # the languages differ: a K-language report, not one language
    assert got["mrv"] is not None and got["mrv"] > 0


def test_report_reads_one_name_as_one_language_with_c_captions():
    audio, text = _multilingual()
    got = retrieval_report(audio, text, ["en"])
    assert got == retrieval_report(audio, text[:, None], ["en"])  # (N, 1, C, D)
    assert got["languages"] == ["en"] and got["n_captions"] == K


def test_report_refuses_an_ambiguous_3d_text_without_languages():
    audio, text = _multilingual()
    with pytest.raises(ValueError, match=r"^text: shape \(40, 3, 16\) is ambiguous") as err:
        retrieval_report(audio, text)  # main: a silent one-language report over 3 "captions"
    msg = str(err.value)
    assert "languages=" in msg and "text[:, :, None]" in msg and "text[:, None]" in msg
    one = retrieval_report(audio, text[:, :1])  # (N, 1, D): nothing to disambiguate
    assert one["languages"] == ["lang0"]


def _shapes_in(msg: str) -> list[str]:
    """The shapes a message shows (an ``index (i, j)`` is no shape)."""
    return re.findall(r"\((?:\d+, )+\d+\)", re.sub(r"index \([\d, ]+\)", "", msg))


@pytest.mark.parametrize(
    ("text", "languages"),
    [
        pytest.param(torch.randn(N, K, D), ["en", "fr"], id="3 names expected"),
        pytest.param(torch.randn(N, K, D), ["en", "en", "fr"], id="duplicate names"),
        pytest.param(torch.randn(N - 1, K, D), ["en", "fr", "de"], id="N mismatch"),
        pytest.param(torch.randn(N, K, D + 1), ["en", "fr", "de"], id="D mismatch"),
        pytest.param(torch.randn(N, K, D).index_fill(0, torch.tensor([3]), 0.0), ["en"], id="zero"),
        pytest.param(torch.randn(N, 0, D), ["en"], id="empty"),
    ],
)
def test_report_errors_show_only_shapes_the_user_passed(text, languages):
    audio = torch.randn(N, D)
    with pytest.raises((ValueError, TypeError)) as err:
        retrieval_report(audio, text, languages)
    msg = str(err.value)
    passed = {str(tuple(text.shape)), str(tuple(audio.shape))}
    assert set(_shapes_in(msg)) <= passed, msg
    if "index" in msg:  # an index into the tensor as passed: 2 coordinates for 3-D text
        index = re.search(r"index (\([\d, ]+\))", msg)
        assert index is not None and len(eval(index.group(1))) == 2, msg


# ------------------------------------------------------------ the other functions


def test_audio_text_retrieval_points_several_languages_to_the_report():
    audio, text = _multilingual()
    with pytest.raises(ValueError, match=r"^text: .*metrics\.retrieval_report"):
        audio_text_retrieval(audio, text[:, :, None])  # (N, K, C, D)


@pytest.mark.parametrize("fn", [embedding_gap, embedding_distance])
def test_gap_and_distance_refuse_two_embedding_matrices(fn):
    audio, text = _multilingual()
    with pytest.raises(TypeError, match=r"^anchor: .*one text tensor \(N, K, D\)"):
        fn(audio, text)
    with pytest.raises(ValueError, match=r"^text: .*transpose\(1, 2\)\.flatten\(0, 1\)"):
        fn(text[:, :, None])  # (N, K, C, D)


def test_mean_rank_variance_refuses_similarity_scores():
    audio, text = _multilingual()
    sim = (
        torch.nn.functional.normalize(audio, dim=-1)
        @ torch.nn.functional.normalize(text[:, 0], dim=-1).T
    )
    with pytest.raises(ValueError, match=r"^ranks: expected 1-based ranks .*retrieval_ranks"):
        mean_rank_variance(sim)  # main: a "variance" of cosines
    with pytest.raises(ValueError, match=r"^ranks: expected 1-based"):
        mean_rank_variance(torch.zeros(3, 2, dtype=torch.long))


# ------------------------------------------------------------ the losses (issue 42, smaller)


def test_a_list_of_tensors_gets_a_stack_hint():
    rows = [torch.randn(D) for _ in range(4)]
    with pytest.raises(TypeError, match=r"^audio: .*list of 4 tensors.*torch\.stack\(audio\)"):
        InfoNCELoss()(rows, torch.randn(4, D))
    with pytest.raises(TypeError, match=r"^sim: .*torch\.stack\(sim\)"):
        recall_at_k([torch.randn(4) for _ in range(4)], k=1)


def test_kcl_says_masked_out_captions_must_be_finite():
    audio, text = _multilingual()
    mask = torch.ones(N, K, dtype=torch.bool)
    mask[5, 2] = False
    text = text.clone()
    text[5, 2] = float("nan")  # an absent caption padded with NaN
    with pytest.raises(ValueError, match=r"^text: NaN/Inf in the masked-out .*\(5, 2\)") as err:
        KCLLoss()(audio, text, mask=mask)
    assert "must still be finite" in str(err.value) and "masked_fill" in str(err.value)
    ok = KCLLoss()(audio, text.masked_fill(~mask[..., None], 0), mask=mask)  # the fix works
    assert torch.isfinite(ok)


# ------------------------------------------------- far below chance (issue 48 item 7)


def _paired(n: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Audio (n, D) and captions (n, D) that retrieve well (text i is audio i plus noise)."""
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(n, D, generator=g)
    return audio, audio + 0.8 * torch.randn(n, D, generator=g)


def _below_chance(record) -> list[str]:
    return [str(w.message) for w in record if "far below chance" in str(w.message)]


@pytest.mark.parametrize("fn", SIM_FUNCTIONS)
def test_distances_passed_as_similarities_warn_and_name_the_fix(fn):
    """``recall_at_k(torch.cdist(text, audio))`` ranks every caption's audio near the end:
    R@1 = 0 where the similarities give most right. It warns, naming distances and
    ``-distances``; the negated distances give the right numbers and no warning."""
    audio, text = _paired(N)
    distances = torch.cdist(text, audio)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(distances)
    (message,) = _below_chance(record)
    assert "distance matrix" in message and "-distances" in message
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn(-distances)
    assert _below_chance(record) == []
    assert recall_at_k(-distances, k=1) > 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (told once per line: above, for the first fn)
        assert recall_at_k(distances, k=1) == 0.0


def test_a2t_distances_with_several_relevant_items_warn():
    """A2T, every caption of a clip relevant (gallery ids): distances still warn."""
    g = torch.Generator().manual_seed(3)
    audio = torch.randn(N, D, generator=g)
    text = (audio[:, None] + 0.8 * torch.randn(N, 5, D, generator=g)).reshape(N * 5, D)
    ids = torch.arange(N).repeat_interleave(5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        recall_at_k(torch.cdist(audio, text), gallery_ids=ids, k=(1, 5, 10))
        recall_at_k(-torch.cdist(audio, text), gallery_ids=ids, k=(1, 5, 10))
    assert len(_below_chance(record)) == 1


@pytest.mark.parametrize(("n", "warns"), [(26, False), (27, True)])
def test_below_chance_warns_only_where_the_sizes_can_tell(n, warns):
    """The worst ranking of ``n`` paired items: no query has its item in the top
    ``ceil(n / 2)``, where a random ranking puts ``ceil(n / 2)`` on average; the
    Chernoff bound ``exp(-ceil(n / 2))`` falls below 1e-6 (``ceil(n / 2) > ln 1e6 =
    13.8``) from n = 27 on (ceil(27 / 2) = 14), not at 26 (13)."""
    sim = -torch.arange(n * n, dtype=torch.float32).reshape(n, n)
    sim = sim - 1e6 * torch.eye(n)  # every relevant item scored last, no ties
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert int(retrieval_ranks(sim).min()) == n
    assert len(_below_chance(record)) == (1 if warns else 0)


def test_random_scores_never_warn_below_chance():
    """Random rankings, small to large galleries, one or several relevant items: a
    random ranking warns with probability below 1e-6, so none of these does."""
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n_q, n_g in [(2, 2), (30, 2), (40, 40), (200, 50), (50, 400)]:
            for _ in range(20):
                sim = torch.randn(n_q, n_g, generator=g)
                recall_at_k(sim, query_ids=torch.arange(n_q) % n_g, k=1)
                relevance = torch.rand(n_q, n_g, generator=g) < 0.1
                relevance[:, 0] = True
                map_at_k(sim, relevance, k=1)
    assert _below_chance(record) == []


def test_collapsed_embeddings_warn_about_ties_not_distances():
    """All scores equal (collapsed embeddings): ties count against the query, every rank
    is the last; the warning names ties, not distances, from a matrix or embeddings."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        recall_at_k(torch.ones(N, N), k=1)
        audio_text_retrieval(torch.ones(N, D), torch.ones(N, D))
    messages = _below_chance(record)
    assert len(messages) == 3  # the matrix, then T2A and A2T of the embeddings
    assert all("collapsed" in m and "distance" not in m for m in messages)
    audio, text = _paired(N)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        audio_text_retrieval(audio, text)
    assert _below_chance(record) == []


def test_chance_of_a_relevant_item_in_the_top_m_is_the_hypergeometric_one():
    """The per-query chance the warning sums: 1 - C(G - n, m) / C(G, m) for n relevant
    items, m / G for one, 1 where the relevant items cannot all fall outside the top m."""
    import math

    from contrastive_losses._retrieval_scan import _chance_in_top

    n_relevant = torch.tensor([1, 2, 5, 7, 10])
    got = _chance_in_top(n_relevant, 12, 6).tolist()
    want = [1 - math.comb(12 - n, 6) / math.comb(12, 6) for n in n_relevant.tolist()]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] == pytest.approx(6 / 12) and got[-1] == 1.0
