"""KnowledgeBank: exact search against a loop, self-hit exclusion, faiss == torch,
prototypes, refresh, state round trip, distributed build, optional faiss, bad input."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import init_gloo, spawn_ranks
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from contrastive_losses import bank as bank_mod
from contrastive_losses.bank import KnowledgeBank, _kmeans_torch

HAS_FAISS = bank_mod._faiss_available()
needs_faiss = pytest.mark.skipif(not HAS_FAISS, reason="faiss not installed")


def _data(n: int, d: int, seed: int, dup: int = 1):
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(n, d, generator=g)
    text = torch.randn(n, d, generator=g)
    ids = torch.arange(n) // dup  # `dup` consecutive rows share an id (caption siblings)
    return audio, text, ids


def _ref_search(keys, bank_ids, queries, k, exclude=None):
    """Plain loop: score every row, skip excluded ids, keep the k best."""
    keys = F.normalize(keys.float(), dim=-1)
    out_s, out_i = [], []
    for b in range(queries.shape[0]):
        cand = []
        for n in range(keys.shape[0]):
            if exclude is not None and int(bank_ids[n]) == int(exclude[b]):
                continue
            cand.append((float(queries[b] @ keys[n]), n))
        cand.sort(key=lambda c: -c[0])
        out_s.append([c[0] for c in cand[:k]])
        out_i.append([c[1] for c in cand[:k]])
    return torch.tensor(out_s), torch.tensor(out_i)


BACKENDS = ["torch", pytest.param("faiss", marks=needs_faiss)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("modality", ["audio", "text"])
def test_search_matches_reference_loop(backend, modality):
    audio, text, ids = _data(60, 8, seed=0, dup=2)
    kb = KnowledgeBank(8, backend=backend, num_prototypes=0).build(audio, text, ids)
    q = F.normalize(torch.randn(5, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    excl = torch.tensor([0, 3, 7, 29, 11])
    keys = audio if modality == "audio" else text
    for exclude in (None, excl):
        s, i = kb.search(q, 4, modality=modality, exclude_ids=exclude)
        rs, ri = _ref_search(keys, ids, q, 4, exclude)
        assert torch.equal(i, ri)
        torch.testing.assert_close(s, rs, atol=1e-5, rtol=0)


@given(
    n=st.integers(4, 40),
    dup=st.integers(1, 3),
    k=st.integers(1, 5),
    seed=st.integers(0, 1000),
    backend=st.sampled_from(["torch", "faiss"] if HAS_FAISS else ["torch"]),
)
def test_a_sample_never_retrieves_its_own_id(n, dup, k, seed, backend):
    audio, text, ids = _data(n, 6, seed, dup=dup)
    kb = KnowledgeBank(6, backend=backend, num_prototypes=0).build(audio, text, ids)
    k = min(k, len(kb) - kb._max_dup)
    if k < 1:
        return
    # queries are the bank rows themselves: the best match of each is its own row
    for modality in ("audio", "text"):
        q = kb.embeddings(modality).float()
        _, idx = kb.search(q, k, modality=modality, exclude_ids=ids)
        assert not (kb.ids[idx] == ids.unsqueeze(1)).any()
        _, idx_all = kb.search(q, 1, modality=modality)
        assert torch.equal(kb.ids[idx_all[:, 0]], ids)  # without exclusion it would leak


@needs_faiss
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_faiss_and_torch_backends_agree(dtype):
    audio, text, ids = _data(300, 16, seed=2, dup=3)
    q = F.normalize(torch.randn(20, 16, generator=torch.Generator().manual_seed(3)), dim=-1)
    excl = torch.randint(0, 100, (20,), generator=torch.Generator().manual_seed(4))
    res = {}
    for backend in ("torch", "faiss"):
        kb = KnowledgeBank(16, backend=backend, num_prototypes=0, dtype=dtype)
        res[backend] = kb.build(audio, text, ids).search(q, 10, "text", exclude_ids=excl)
    torch.testing.assert_close(res["faiss"][0], res["torch"][0], atol=1e-5, rtol=0)
    assert torch.equal(res["faiss"][1], res["torch"][1])


@needs_faiss
def test_ivf_with_all_cells_probed_is_exact():
    audio, text, ids = _data(400, 16, seed=5)
    q = F.normalize(torch.randn(8, 16, generator=torch.Generator().manual_seed(6)), dim=-1)
    flat = KnowledgeBank(16, backend="faiss", num_prototypes=0).build(audio, text, ids)
    ivf = KnowledgeBank(16, backend="faiss", num_prototypes=0, index="ivf", nlist=8, nprobe=8)
    ivf.build(audio, text, ids)
    a, b = (
        flat.search(q, 5, exclude_ids=torch.arange(8)),
        ivf.search(q, 5, exclude_ids=torch.arange(8)),
    )
    assert torch.equal(a[1], b[1])


def test_torch_search_chunks_equal_one_block():
    audio, text, ids = _data(50, 8, seed=7, dup=2)
    q = F.normalize(torch.randn(6, 8, generator=torch.Generator().manual_seed(8)), dim=-1)
    big = KnowledgeBank(8, backend="torch", num_prototypes=0).build(audio, text, ids)
    small = KnowledgeBank(8, backend="torch", num_prototypes=0, chunk_size=7).build(
        audio, text, ids
    )
    excl = torch.arange(6)
    assert torch.equal(
        big.search(q, 9, exclude_ids=excl)[1], small.search(q, 9, exclude_ids=excl)[1]
    )


def test_build_normalises_and_stores_dtype():
    audio, text, ids = _data(10, 8, seed=9)
    kb = KnowledgeBank(8, backend="torch", num_prototypes=0, dtype=torch.float16)
    kb.build(audio * 5, text * 0.1, ids)
    assert kb.audio.dtype == torch.float16 and kb.text.dtype == torch.float16
    assert kb.audio.element_size() * 2 == F.normalize(audio).element_size()
    torch.testing.assert_close(kb.audio.float(), F.normalize(audio, dim=-1), atol=1e-3, rtol=0)
    torch.testing.assert_close(kb.text.float().norm(dim=-1), torch.ones(10), atol=1e-3, rtol=0)
    assert len(kb) == 10 and not kb.is_empty and kb.ids.dtype == torch.long


def test_pool_prototypes_matches_loop():
    g = torch.Generator().manual_seed(10)
    audio, text = (
        F.normalize(torch.randn(30, 5, generator=g), dim=-1),
        torch.randn(30, 5, generator=g),
    )
    labels = torch.randint(0, 6, (30,), generator=g)
    labels[labels == 2] = 3  # cluster 2 empty -> dropped
    pa, pt = KnowledgeBank.pool_prototypes(audio, text, labels, 6)
    used = [c for c in range(6) if (labels == c).any()]
    assert pa.shape == (len(used), 5) and 2 not in used
    for row, c in enumerate(used):
        members = [n for n in range(30) if int(labels[n]) == c]
        for x, p in ((audio, pa), (text, pt)):
            pooled = torch.stack([x[n] for n in members]).max(dim=0).values
            torch.testing.assert_close(p[row], pooled / pooled.norm())


def _blobs(per: int, centers: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    c = F.normalize(torch.randn(centers, d, generator=g), dim=-1) * 4
    audio = c.repeat_interleave(per, 0) + 0.05 * torch.randn(per * centers, d, generator=g)
    text = c.flip(0).repeat_interleave(per, 0) + 0.05 * torch.randn(per * centers, d, generator=g)
    truth = torch.arange(centers).repeat_interleave(per)
    return audio, text, truth


def test_torch_kmeans_recovers_separated_clusters():
    audio, text, truth = _blobs(20, 4, 8, seed=11)
    pairs = torch.cat([F.normalize(audio, dim=-1), F.normalize(text, dim=-1)], dim=-1)
    labels = _kmeans_torch(pairs, 4, niter=20, seed=0)
    # same partition up to relabelling: two rows share a label iff they share a blob
    assert torch.equal(labels[:, None] == labels[None, :], truth[:, None] == truth[None, :])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prototypes_pair_up_per_cluster(backend):
    audio, text, truth = _blobs(15, 3, 8, seed=12)
    kb = KnowledgeBank(8, backend=backend, num_prototypes=3).build(audio, text, torch.arange(45))
    assert kb.num_built_prototypes == 3
    torch.testing.assert_close(kb.prototype_audio.norm(dim=-1), torch.ones(3))
    expect_a, expect_t = KnowledgeBank.pool_prototypes(kb.audio, kb.text, truth, 3)
    # each (audio, text) prototype pair equals one blob's pair, in some order
    match = (kb.prototype_audio @ expect_a.T).argmax(-1)
    assert sorted(match.tolist()) == [0, 1, 2]
    torch.testing.assert_close(kb.prototype_audio, expect_a[match], atol=1e-5, rtol=0)
    torch.testing.assert_close(kb.prototype_text, expect_t[match], atol=1e-5, rtol=0)


def test_too_many_prototypes_warns_and_clamps():
    audio, text, ids = _data(5, 4, seed=13)
    with pytest.warns(UserWarning, match="num_prototypes"):
        kb = KnowledgeBank(4, backend="torch", num_prototypes=50).build(audio, text, ids)
    assert 1 <= kb.num_built_prototypes <= 5


def test_search_prototypes():
    audio, text, ids = _data(40, 8, seed=14)
    kb = KnowledgeBank(8, backend="torch", num_prototypes=4).build(audio, text, ids)
    q = F.normalize(torch.randn(3, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    s, i = kb.search_prototypes(q, 2, "text")
    ref = (q @ kb.prototype_text.T).topk(2, dim=-1)
    assert torch.equal(i, ref.indices)
    torch.testing.assert_close(s, ref.values)
    with pytest.raises(ValueError, match="k"):
        kb.search_prototypes(q, kb.num_built_prototypes + 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trip(backend):
    audio, text, ids = _data(80, 8, seed=15, dup=2)
    kb = KnowledgeBank(8, backend=backend, num_prototypes=5, dtype=torch.float16)
    kb.build(audio, text, ids)
    q = F.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    before = kb.search(q, 3, "audio", exclude_ids=torch.arange(4))
    buf = io.BytesIO()
    torch.save(kb.state_dict(), buf)
    buf.seek(0)
    kb2 = KnowledgeBank(8, backend=backend, num_prototypes=5, dtype=torch.float16)
    kb2.load_state_dict(torch.load(buf))
    for name in ("audio", "text", "ids", "prototype_audio", "prototype_text"):
        assert torch.equal(getattr(kb, name), getattr(kb2, name))
    after = kb2.search(q, 3, "audio", exclude_ids=torch.arange(4))
    assert torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])
    assert kb2._max_dup == kb._max_dup == 2
    with pytest.raises(ValueError, match="dim"):
        KnowledgeBank(4, backend="torch").load_state_dict(kb.state_dict())
    with pytest.raises(ValueError, match="missing"):
        KnowledgeBank(8, backend="torch").load_state_dict({"dim": 8})


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.audio = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5))
        self.text = nn.Linear(4, 6)

    def forward(self, batch):
        x, i = batch
        return self.audio(x), self.text(x), i


def test_refresh_no_grad_restores_modes_and_equals_eval_build():
    torch.manual_seed(0)
    enc = _Encoder().train()
    enc.text.eval()  # a submodule already in eval must stay so
    g = torch.Generator().manual_seed(16)
    loader = [(torch.randn(5, 4, generator=g), torch.arange(5 * b, 5 * b + 5)) for b in range(3)]
    kb = KnowledgeBank(6, backend="torch", num_prototypes=2)
    kb.refresh(enc, loader, progress=False)
    assert enc.training and enc.audio.training and enc.audio[1].training and not enc.text.training
    assert len(kb) == 15 and not kb.audio.requires_grad
    with torch.no_grad():
        enc.eval()
        a, t, i = zip(*(enc(b) for b in loader), strict=True)
    ref = KnowledgeBank(6, backend="torch", num_prototypes=2).build(
        torch.cat(a), torch.cat(t), torch.cat(i)
    )
    torch.testing.assert_close(kb.audio, ref.audio)  # eval mode: dropout off
    assert torch.equal(kb.ids, ref.ids)


def test_refresh_restores_mode_on_error_and_rejects_empty_loader():
    enc = _Encoder().train()
    enc.text.eval()

    def bad(batch):
        assert not enc.training
        raise RuntimeError("encoder failed")

    kb = KnowledgeBank(6, backend="torch", num_prototypes=0)
    with pytest.raises(RuntimeError, match="encoder failed"):
        kb.refresh(bad, [(torch.randn(2, 4), torch.arange(2))], model=enc, progress=False)
    assert enc.training and not enc.text.training
    with pytest.raises(ValueError, match="loader"):
        kb.refresh(enc, [], progress=False)


def test_should_refresh():
    kb = KnowledgeBank(4, backend="torch", num_prototypes=0, refresh_every=15)
    assert kb.should_refresh(0)  # empty bank
    kb.build(*_data(5, 4, seed=0))
    assert [e for e in range(46) if kb.should_refresh(e)] == [15, 30, 45]
    never = KnowledgeBank(4, backend="torch", num_prototypes=0, refresh_every=0)
    never.build(*_data(5, 4, seed=0))
    assert not any(never.should_refresh(e) for e in range(40))
    with pytest.raises(ValueError, match="epoch"):
        kb.should_refresh(-1)


def test_torch_backend_never_imports_faiss(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("faiss touched")

    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` now raises ImportError
    monkeypatch.setattr(bank_mod, "_import_faiss", boom)
    monkeypatch.setattr(bank_mod, "_faiss_available", boom)
    kb = KnowledgeBank(8, backend="torch", num_prototypes=3).build(*_data(30, 8, seed=1))
    _, idx = kb.search(kb.audio[:2].float(), 2, exclude_ids=torch.arange(2))
    assert idx.shape == (2, 2) and kb.num_built_prototypes == 3


def test_missing_faiss_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(ImportError, match=r"contrastive-losses\[faiss\]"):
        KnowledgeBank(8, backend="faiss")
    # auto falls back to torch search and torch k-means
    kb = KnowledgeBank(8, backend="auto", num_prototypes=2).build(*_data(20, 8, seed=2))
    ref = KnowledgeBank(8, backend="torch", num_prototypes=2).build(*_data(20, 8, seed=2))
    assert torch.equal(kb.prototype_audio, ref.prototype_audio)
    q = kb.audio[:3].float()
    assert torch.equal(kb.search(q, 2)[1], ref.search(q, 2)[1])


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: KnowledgeBank(8, backend="annoy"), ValueError, "backend"),
        (lambda: KnowledgeBank(0), ValueError, "dim"),
        (lambda: KnowledgeBank(8, num_prototypes=-1), ValueError, "num_prototypes"),
        (lambda: KnowledgeBank(8, dtype=torch.int8), TypeError, "dtype"),
        (lambda: KnowledgeBank(8, index="hnsw"), ValueError, "index"),
        (lambda: KnowledgeBank(8, backend="torch", index="ivf"), ValueError, "index"),
    ],
)
def test_bad_constructor_args(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_bad_build_and_search_input():
    kb = KnowledgeBank(8, backend="torch", num_prototypes=0)
    audio, text, ids = _data(10, 8, seed=3, dup=2)
    q = torch.randn(3, 8)
    with pytest.raises(ValueError, match="empty"):
        kb.search(q, 1)
    with pytest.raises(ValueError, match="audio_emb"):
        kb.build(torch.randn(10, 6), text, ids)
    with pytest.raises(ValueError, match="text_emb"):
        kb.build(audio, text[:9], ids)
    with pytest.raises(ValueError, match="ids"):
        kb.build(audio, text, ids[:9])
    with pytest.raises(TypeError, match="ids"):
        kb.build(audio, text, ids.float())
    with pytest.raises(ValueError, match="audio_emb"):
        kb.build(audio.clone().fill_(float("nan")), text, ids)
    kb.build(audio, text, ids)
    with pytest.raises(ValueError, match="queries"):
        kb.search(torch.randn(3, 6), 1)
    with pytest.raises(ValueError, match="k"):
        kb.search(q, 11)
    kb.search(q, 10)  # the whole bank is fine without exclusion
    with pytest.raises(ValueError, match="k"):
        kb.search(q, 9, exclude_ids=torch.arange(3))  # 10 rows minus 2 siblings
    with pytest.raises(ValueError, match="exclude_ids"):
        kb.search(q, 2, exclude_ids=torch.arange(4))
    with pytest.raises(ValueError, match="modality"):
        kb.search(q, 2, modality="video")
    with pytest.raises(TypeError, match="k"):
        kb.search(q, 2.0)


# ---------------------------------------------------------------------- distributed


def _dist_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    init_gloo(rank, world, init_method)
    try:
        torch.set_num_threads(1)
        audio, text, ids = _data(13, 8, seed=21)
        lo, hi = (0, 5) if rank == 0 else (5, 13)  # uneven shards
        kb = KnowledgeBank(8, backend="torch", num_prototypes=3)
        kb.build(audio[lo:hi], text[lo:hi], ids[lo:hi])
        torch.save(kb.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_build_gives_every_rank_the_same_bank(tmp_path):
    states = spawn_ranks(_dist_worker, tmp_path)
    audio, text, ids = _data(13, 8, seed=21)
    ref = KnowledgeBank(8, backend="torch", num_prototypes=3).build(audio, text, ids)
    for st_ in states:
        for name in ("audio", "text", "ids", "prototype_audio", "prototype_text"):
            torch.testing.assert_close(st_[name], getattr(ref, name))
