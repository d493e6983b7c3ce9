"""Guided false-negative filtering (GISTEmbed): ``guide=`` on InfoNCE, SigLIP and KCL.

Each loss equals a plain-loop float64 reference written from the rule (a negative ``j``
of the anchor ``i`` leaves its denominator when ``G_ij > G_ii - m``, or
``G_ij > G_ii (1 - m)``; the text->audio anchor ``j`` compares with ``G_jj``), dense and
tiled, values and gradients; ``guide_masked`` equals the reference's count; properties,
2 gloo ranks, ``fullgraph`` compile, SVR, GradCache and the input checks follow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, outlasting, rank_rows, spawn_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import neg_log_softmax, sim, unit

from contrastive_losses import (
    GradCache,
    InfoNCELoss,
    KCLLoss,
    SigLIPLoss,
    SupportVectorRegularizer,
    _compat,
)
from contrastive_losses import functional as CF

B, D, DG, K = 7, 5, 3, 3
TAU = 0.3
FORMS = ("single", "pair")
STRATEGIES = ("absolute", "relative")
# Margins that exclude some negatives but not all with these seeds (each test checks it).
MARGIN = {"single": 0.5, "pair": 0.15}


def _data(seed: int = 0, b: int = B) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "audio": randn(b, D),
        "text": randn(b, D),
        "captions": randn(b, K, D),
        "guide_audio": randn(b, DG),
        "guide_text": randn(b, DG),
        "ids": torch.tensor([0, 1, 0, 2, 3, 1, 4, 5, 6][:b]),
        "mask": torch.rand(b, K, generator=g) < 0.7,
    }


def _guide(data: dict[str, torch.Tensor], form: str):
    if form == "single":
        return data["guide_audio"]
    return data["guide_audio"], data["guide_text"]


# --------------------------------------------------------------------------- reference


class Rule:
    """The exclusion rule written out on Python floats, from the guide's rows."""

    def __init__(self, guide, margin: float, strategy: str) -> None:
        ga, gt = (guide, guide) if isinstance(guide, torch.Tensor) else guide
        n = ga.shape[0]
        self.g = [[float((unit(ga[i]) * unit(gt[j])).sum()) for j in range(n)] for i in range(n)]
        diag = [self.g[i][i] for i in range(n)]
        if strategy == "absolute":
            self.thr = [d - margin for d in diag]
        else:
            self.thr = [d * (1 - margin) for d in diag]
        self.excluded = 0  # counted over every (anchor, negative) entry seen
        self.negatives = 0

    def keep_a2t(self, i: int, j: int, positive: bool) -> bool:
        """Candidate text ``j`` stays in audio ``i``'s denominator."""
        return self._count(positive or not self.g[i][j] > self.thr[i], positive)

    def keep_t2a(self, j: int, i: int, positive: bool) -> bool:
        """Candidate audio ``i`` stays in text ``j``'s denominator."""
        return self._count(positive or not self.g[i][j] > self.thr[j], positive)

    def _count(self, keep: bool, positive: bool) -> bool:
        if not positive:
            self.negatives += 1
            self.excluded += not keep
        return keep

    @property
    def fraction(self) -> float:
        return self.excluded / max(self.negatives, 1)


def ref_info_nce(audio, text, rule: Rule, ids=None) -> torch.Tensor:
    n = audio.shape[0]
    same = [[(i == j) if ids is None else ids[i] == ids[j] for j in range(n)] for i in range(n)]
    total = torch.zeros((), dtype=audio.dtype)
    for i in range(n):
        a2t_cols = [j for j in range(n) if rule.keep_a2t(i, j, same[i][j])]
        t2a_cols = [j for j in range(n) if rule.keep_t2a(i, j, same[i][j])]
        a2t = [sim(audio[i], text[j], TAU) for j in a2t_cols]
        t2a = [sim(text[i], audio[j], TAU) for j in t2a_cols]
        pos = [j for j in range(n) if same[i][j]]
        la = sum(neg_log_softmax(a2t, a2t_cols.index(p)) for p in pos) / len(pos)
        lt = sum(neg_log_softmax(t2a, t2a_cols.index(p)) for p in pos) / len(pos)
        total = total + (la + lt) / 2
    return total / n


def ref_siglip(audio, text, rule: Rule, scale: float, bias: float, ids=None) -> torch.Tensor:
    n = audio.shape[0]
    total = torch.zeros((), dtype=audio.dtype)
    excluded = negatives = 0
    for i in range(n):
        for j in range(n):
            positive = (i == j) if ids is None else ids[i] == ids[j]
            keep = rule.keep_a2t(i, j, positive) & rule.keep_t2a(j, i, positive)
            negatives += not positive
            excluded += not keep
            if keep:
                z = 1.0 if positive else -1.0
                logit = scale * (unit(audio[i]) * unit(text[j])).sum() + bias
                total = total - torch.log(1 / (1 + torch.exp(-z * logit)))
    rule.excluded, rule.negatives = 2 * excluded, 2 * negatives  # pairs, either anchor
    return total / n


def ref_kcl(audio, text, rule: Rule, mask) -> torch.Tensor:
    """Per-language negatives; the pair (audio i, caption (j, k)) has G_ij."""
    n, k_langs = text.shape[0], text.shape[1]
    total = torch.zeros((), dtype=audio.dtype)
    count = 0
    for k in range(k_langs):
        members = [j for j in range(n) if mask[j][k]]
        for i in members:
            a2t_cols = [j for j in members if rule.keep_a2t(i, j, i == j)]
            t2a_cols = [j for j in members if rule.keep_t2a(i, j, i == j)]
            a2t = [sim(audio[i], text[j, k], TAU) for j in a2t_cols]
            t2a = [sim(text[i, k], audio[j], TAU) for j in t2a_cols]
            total = total + neg_log_softmax(a2t, a2t_cols.index(i))
            total = total + neg_log_softmax(t2a, t2a_cols.index(i))
            count += 1
    return total / (2 * count)


def ref_kcl_all_languages(audio, text, rule: Rule, mask) -> torch.Tensor:
    n, k_langs = text.shape[0], text.shape[1]
    captions = [(j, k) for j in range(n) for k in range(k_langs) if mask[j][k]]
    total = torch.zeros((), dtype=audio.dtype)
    for i in range(n):
        cols = [(j, k) for (j, k) in captions if rule.keep_a2t(i, j, i == j)]
        scores = [sim(audio[i], text[j, k], TAU) for (j, k) in cols]
        own = [c for c, (j, _) in enumerate(cols) if j == i]
        a2t = sum(neg_log_softmax(scores, p) for p in own) / len(own)
        for k in range(k_langs):
            if not mask[i][k]:
                continue
            audios = [j for j in range(n) if rule.keep_t2a(i, j, i == j)]
            t2a = [sim(text[i, k], audio[j], TAU) for j in audios]
            total = total + (a2t + neg_log_softmax(t2a, audios.index(i))) / 2
    return total / len(captions)


# --------------------------------------------------------------------------- helpers


def _grads(fn, *inputs: torch.Tensor):
    xs = [x.clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return out, [x.grad for x in xs]


def _assert_matches_reference(ours, reference, inputs, rule: Rule) -> None:
    (loss, terms), grads = _grads(ours, *inputs)
    expected, expected_grads = _grads(reference, *inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
    assert 0 < rule.fraction < 1, "the data must exclude some negatives, not all"
    assert terms["guide_masked"].item() == pytest.approx(rule.fraction, abs=1e-12)


# --------------------------------------------------------------------------- the losses


@pytest.mark.parametrize("chunk", [None, 3], ids=["dense", "tiled"])
@pytest.mark.parametrize("with_ids", [False, True], ids=["diag", "ids"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("form", FORMS)
def test_info_nce_equals_reference(form, strategy, with_ids, chunk) -> None:
    data = _data()
    guide, margin = _guide(data, form), MARGIN[form]
    ids = data["ids"] if with_ids else None
    rule = Rule(guide, margin, strategy)

    def ours(a, t):
        return CF.info_nce(
            a, t, TAU, ids=ids, chunk_size=chunk, return_terms=True,
            guide=guide, guide_margin=margin, guide_strategy=strategy,
        )  # fmt: skip

    def reference(a, t):
        return ref_info_nce(a, t, rule, None if ids is None else ids.tolist())

    _assert_matches_reference(ours, reference, (data["audio"], data["text"]), rule)


@pytest.mark.parametrize("chunk", [None, 2], ids=["dense", "tiled"])
@pytest.mark.parametrize("with_ids", [False, True], ids=["diag", "ids"])
@pytest.mark.parametrize("form", FORMS)
def test_siglip_equals_reference(form, with_ids, chunk) -> None:
    data = _data(1)
    guide, margin = _guide(data, form), MARGIN[form]
    ids = data["ids"] if with_ids else None
    rule = Rule(guide, margin, "absolute")

    def ours(a, t):
        return CF.siglip(
            a, t, 3.0, -1.0, ids=ids, chunk_size=chunk, return_terms=True,
            guide=guide, guide_margin=margin,
        )  # fmt: skip

    def reference(a, t):
        return ref_siglip(a, t, rule, 3.0, -1.0, None if ids is None else ids.tolist())

    _assert_matches_reference(ours, reference, (data["audio"], data["text"]), rule)


@pytest.mark.parametrize("chunk", [None, 2], ids=["dense", "tiled"])
@pytest.mark.parametrize("negatives", ["per_language", "all_languages"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("form", FORMS)
def test_kcl_equals_reference(form, strategy, negatives, chunk) -> None:
    data = _data(2)
    guide, margin = _guide(data, form), MARGIN[form]
    mask = data["mask"]
    rule = Rule(guide, margin, strategy)

    def ours(a, t):
        return CF.kcl(
            a, t, TAU, mask=mask, negatives=negatives, chunk_size=chunk, return_terms=True,
            guide=guide, guide_margin=margin, guide_strategy=strategy,
        )  # fmt: skip

    ref = ref_kcl if negatives == "per_language" else ref_kcl_all_languages

    def reference(a, t):
        return ref(a, t, rule, mask.tolist())

    _assert_matches_reference(ours, reference, (data["audio"], data["captions"]), rule)


def test_kcl_without_a_mask_and_the_module_forward() -> None:
    """The fused one-process path (captions normalised through the scores) with the
    guide's two masks; the Module passes its settings (margin, strategy) through."""
    data = _data(3)
    guide = _guide(data, "pair")
    rule = Rule(guide, 0.2, "relative")
    loss_fn = KCLLoss(TAU, guide_margin=0.2, guide_strategy="relative").double()
    got = loss_fn(data["audio"], data["captions"], guide=guide)
    expected = ref_kcl(data["audio"], data["captions"], rule, [[True] * K] * B)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert 0 < rule.fraction < 1


@pytest.mark.parametrize("loss", ["info_nce", "siglip", "kcl"])
def test_gradcheck_tiled_and_dense(loss: str) -> None:
    data = _data(4, b=4)
    guide = (data["guide_audio"], data["guide_text"])
    text = data["captions"][:, :2] if loss == "kcl" else data["text"]
    fn = getattr(CF, loss)
    for chunk in (None, 3):
        kwargs = {"guide": guide, "guide_margin": 0.15, "chunk_size": chunk}
        if loss == "kcl":
            kwargs["mask"] = data["mask"][:, :2] | torch.eye(4, 2, dtype=torch.bool)
        a = data["audio"].clone().requires_grad_()
        t = text.clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, t, kw=kwargs: fn(a, t, **kw), (a, t))


# --------------------------------------------------------------------------- properties


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    margins=st.lists(st.floats(0.0, 1.5), min_size=2, max_size=2),
    strategy=st.sampled_from(STRATEGIES),
    form=st.sampled_from(FORMS),
    chunk=st.sampled_from([None, 2]),
)
def test_properties(seed, margins, strategy, form, chunk) -> None:
    """Excluding never raises the InfoNCE loss above the loss without a guide; a larger
    absolute margin excludes a superset, so the loss never rises with it;
    ``guide_masked`` is in [0, 1] and equals the rule's count."""
    data = _data(seed, b=5)
    guide = _guide(data, form)
    a, t = data["audio"], data["text"]
    small, large = sorted(margins)
    plain = CF.info_nce(a, t, TAU, chunk_size=chunk)
    losses = []
    for margin in (small, large):
        loss, terms = CF.info_nce(
            a, t, TAU, chunk_size=chunk, return_terms=True,
            guide=guide, guide_margin=margin, guide_strategy=strategy,
        )  # fmt: skip
        rule = Rule(guide, margin, strategy)
        ref_info_nce(a, t, rule)  # counts the exclusions
        assert 0 <= terms["guide_masked"].item() <= 1
        assert terms["guide_masked"].item() == pytest.approx(rule.fraction, abs=1e-12)
        losses.append(loss)
    for loss in losses:  # excluding negatives never raises the loss
        assert loss <= plain + 1e-12
    if strategy == "absolute" or form == "single":  # relative: G_ii (1 - m) rises in m
        assert losses[1] <= losses[0] + 1e-12  # where G_ii < 0 (a pair guide)


@pytest.mark.parametrize("chunk", [None, 2])
def test_a_guide_that_excludes_nothing_or_everything(chunk) -> None:
    """One-hot guide rows (G = I): nothing lies above 1 - m for m < 1, the loss without a
    guide; m >= 2 (absolute) lies below every cosine: every negative leaves, loss 0."""
    data = _data(5)
    a, t = data["audio"], data["text"]
    one_hot = torch.eye(B, dtype=torch.float64)
    plain = CF.info_nce(a, t, TAU, chunk_size=chunk)
    same, terms = CF.info_nce(
        a, t, TAU, chunk_size=chunk, guide=one_hot, guide_margin=0.9, return_terms=True
    )
    torch.testing.assert_close(same, plain, rtol=1e-12, atol=0)
    assert terms["guide_masked"].item() == 0
    none_left, terms = CF.info_nce(
        a, t, TAU, chunk_size=chunk, guide=data["guide_audio"], guide_margin=2.5,
        return_terms=True,
    )  # fmt: skip
    torch.testing.assert_close(none_left, torch.zeros((), dtype=torch.float64))
    assert terms["guide_masked"].item() == 1


# --------------------------------------------------------------------------- two ranks


def _rank_losses(gather: bool) -> dict:
    """name -> fn(audio, text, captions, mask, ids, guide_audio, guide_text)."""

    def info(chunk, ids):
        return lambda a, t, c, m, i, ga, gt: CF.info_nce(
            a, t, TAU, ids=i if ids else None, chunk_size=chunk, gather=gather,
            guide=(ga, gt), guide_margin=0.15, return_terms=True,
        )  # fmt: skip

    def sig(chunk):
        return lambda a, t, c, m, i, ga, gt: CF.siglip(
            a, t, 3.0, -1.0, chunk_size=chunk, gather=gather, guide=(ga, gt),
            guide_margin=0.15, return_terms=True,
        )  # fmt: skip

    def kcl(chunk, negatives):
        return lambda a, t, c, m, i, ga, gt: CF.kcl(
            a, c, TAU, mask=m, negatives=negatives, chunk_size=chunk, gather=gather,
            guide=ga, guide_margin=0.5, guide_strategy="relative", return_terms=True,
        )  # fmt: skip

    out = {}
    for chunk in (None, 3):
        out[f"info_nce_{chunk}"] = info(chunk, False)
        out[f"info_nce_ids_{chunk}"] = info(chunk, True)
        out[f"siglip_{chunk}"] = sig(chunk)
        out[f"kcl_{chunk}"] = kcl(chunk, "per_language")
        out[f"kcl_all_{chunk}"] = kcl(chunk, "all_languages")
    return out


def _rank_data() -> dict[str, torch.Tensor]:
    data = _data(6, b=8)
    data["mask"] = data["mask"] | torch.eye(8, K, dtype=torch.bool)  # a caption each
    return data


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    try:
        data, rows = _rank_data(), rank_rows(rank)
        results = {}
        for name, fn in _rank_losses(gather=True).items():
            a = data["audio"][rows].clone().requires_grad_()
            t = data["text"][rows].clone().requires_grad_()
            c = data["captions"][rows].clone().requires_grad_()
            loss, terms = fn(
                a, t, c, data["mask"][rows], data["ids"][rows],
                data["guide_audio"][rows], data["guide_text"][rows],
            )  # fmt: skip
            loss.backward()
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (a, t, c)]
            results[name] = (loss.detach(), terms["guide_masked"], *grads)
        try:  # the ranks disagree on whether a guide is given: both refuse
            CF.info_nce(
                data["audio"][rows], data["text"][rows], gather=True,
                guide=data["guide_audio"][rows] if rank == 0 else None,
            )  # fmt: skip
            results["disagree"] = ""
        except ValueError as err:
            results["disagree"] = str(err)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@outlasting(300)
def test_two_gloo_ranks_equal_one_process(tmp_path) -> None:
    ranks = spawn_ranks(_worker, tmp_path)
    data = _rank_data()
    for name, fn in _rank_losses(gather=False).items():
        a, t, c = (data[k].clone().requires_grad_() for k in ("audio", "text", "captions"))
        loss, terms = fn(
            a, t, c, data["mask"], data["ids"], data["guide_audio"], data["guide_text"]
        )
        loss.backward()
        mean = sum(r[name][0] for r in ranks) / 2
        torch.testing.assert_close(mean, loss.detach(), rtol=1e-9, atol=0, msg=name)
        for r in ranks:  # the fraction is over the global batch on every rank
            torch.testing.assert_close(r[name][1], terms["guide_masked"], msg=name)
        for i, x in enumerate((a, t, c), start=2):
            want = x.grad if x.grad is not None else torch.zeros_like(x)
            got = torch.cat([r[name][i] for r in ranks]) / 2
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12, msg=name)
    for r in ranks:
        assert "guide_given" in r["disagree"]


# --------------------------------------------------------------------------- composition


@pytest.mark.skipif(
    _compat.TORCH[:2] < _compat.MIN_TORCH_COMPILE, reason="torch.compile refused on this torch"
)
@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("loss", ["infonce", "siglip", "kcl"])
def test_fullgraph_compile_equals_eager(loss: str, chunk) -> None:
    torch._dynamo.reset()
    data = {k: v.float() if v.is_floating_point() else v for k, v in _data(7, b=6).items()}
    guide = (data["guide_audio"], data["guide_text"])
    build = {
        "infonce": lambda: InfoNCELoss(TAU, chunk_size=chunk, guide_margin=0.15),
        "siglip": lambda: SigLIPLoss(chunk_size=chunk, guide_margin=0.15),
        "kcl": lambda: KCLLoss(TAU, chunk_size=chunk, guide_strategy="relative", guide_margin=0.5),
    }[loss]
    text = data["captions"] if loss == "kcl" else data["text"]
    results = []
    for compiled in (False, True):
        loss_fn = build()
        fn = torch.compile(loss_fn, fullgraph=True, backend="aot_eager") if compiled else loss_fn
        a, t = data["audio"].clone().requires_grad_(), text.clone().requires_grad_()
        out, terms = fn(a, t, guide=guide, return_terms=True)
        out.backward()
        results.append((out.detach(), terms["guide_masked"], a.grad, t.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert 0 < results[0][1] < 1


def test_svr_forwards_the_guide() -> None:
    """SVR(base)(..., guide=g) is the base with the guide plus the SVR term, which the
    guide leaves alone (it regularises the positives' radii)."""
    data = _data(8)
    guide = _guide(data, "pair")
    a, t = data["audio"], data["text"]
    base = InfoNCELoss(TAU, guide_margin=0.15).double()
    torch.manual_seed(0)
    svr = SupportVectorRegularizer(base, radius="static", num_features=4).double()
    with_guide, terms = svr(a, t, guide=guide, return_terms=True)
    plain, plain_terms = svr(a, t, return_terms=True)
    base_guided = base(a, t, guide=guide)
    assert not torch.allclose(base_guided, base(a, t))  # the guide changes the base
    torch.testing.assert_close(terms["base"], base_guided)
    torch.testing.assert_close(with_guide - base_guided, plain - plain_terms["base"])
    assert 0 < terms["guide_masked"] < 1


@pytest.mark.parametrize("chunk", [None, 3])
def test_grad_cache_passes_the_guide(chunk) -> None:
    torch.manual_seed(0)
    audio_enc = torch.nn.Linear(6, D).double()
    text_enc = torch.nn.Linear(4, D).double()
    g = torch.Generator().manual_seed(9)
    x_a = torch.randn(B, 6, generator=g, dtype=torch.float64)
    x_t = torch.randn(B, 4, generator=g, dtype=torch.float64)
    guide = _guide(_data(9), "pair")
    loss_fn = InfoNCELoss(TAU, chunk_size=chunk, guide_margin=0.15)
    plain = loss_fn(audio_enc(x_a), text_enc(x_t), guide=guide)
    plain.backward()
    expected = [p.grad.clone() for p in (*audio_enc.parameters(), *text_enc.parameters())]
    audio_enc.zero_grad()
    text_enc.zero_grad()
    got = GradCache(loss_fn, chunk_size=3)(audio_enc, x_a, text_enc, x_t, guide=guide)
    torch.testing.assert_close(got, plain.detach())
    assert not torch.allclose(plain, loss_fn(audio_enc(x_a), text_enc(x_t)))
    params = (*audio_enc.parameters(), *text_enc.parameters())
    for p, want in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, want)


# --------------------------------------------------------------------------- bad input


def _bad_guides():
    g = torch.randn(B, DG)
    nan = g.clone()
    nan[1, 0] = float("nan")
    zero = g.clone()
    zero[2] = 0
    return [
        (torch.randn(B - 1, DG), ValueError, r"guide: batch size"),
        (torch.randn(B, DG, 2), ValueError, r"guide: expected shape \(B, Dg\)"),
        ((g, g, g), ValueError, r"guide: expected a tensor .* or a pair"),
        ((g, torch.randn(B, DG + 1)), ValueError, r"guide: the pair's dims differ"),
        ((g, torch.randn(B + 1, DG)), ValueError, r"guide\[1\]: batch size"),
        (nan, ValueError, r"guide: .*NaN"),
        (zero, ValueError, r"guide: .*zero"),
        (torch.ones(B, DG, dtype=torch.long), TypeError, r"guide: expected a floating"),
        ("text", TypeError, r"guide: expected a torch.Tensor"),
        (torch.empty(B, DG, device="meta"), ValueError, r"guide: on device meta"),
    ]


@pytest.mark.parametrize("fn", ["info_nce", "siglip", "kcl"])
@pytest.mark.parametrize(("guide", "error", "match"), _bad_guides())
def test_bad_guides_are_named(fn, guide, error, match) -> None:
    text = torch.randn(B, K, D) if fn == "kcl" else torch.randn(B, D)
    with pytest.raises(error, match=match):
        getattr(CF, fn)(torch.randn(B, D), text, guide=guide)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"guide_margin": -0.1}, ValueError, r"guide_margin: must be finite and >= 0"),
        ({"guide_margin": float("nan")}, ValueError, r"guide_margin: must be finite"),
        ({"guide_margin": float("inf")}, ValueError, r"guide_margin: must be finite"),
        ({"guide_margin": "0.1"}, TypeError, r"guide_margin: expected a float"),
        ({"guide_margin": True}, TypeError, r"guide_margin: expected a float"),
        ({"guide_strategy": "ratio"}, ValueError, r"guide_strategy: expected one of"),
    ],
)
def test_bad_settings_are_named(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        CF.info_nce(torch.randn(B, D), torch.randn(B, D), guide=torch.randn(B, DG), **kwargs)
    for cls in (InfoNCELoss, SigLIPLoss, KCLLoss):
        with pytest.raises(error, match=match):
            cls(**kwargs)


def test_guide_gets_no_gradient_and_is_normalised() -> None:
    data = _data(10)
    ga = data["guide_audio"].clone().requires_grad_()
    a = data["audio"].clone().requires_grad_()
    loss = CF.info_nce(a, data["text"], guide=ga * 1.0, guide_margin=0.5)
    loss.backward()
    assert ga.grad is None and a.grad is not None
    scaled = CF.info_nce(data["audio"], data["text"], guide=ga.detach() * 7.0, guide_margin=0.5)
    torch.testing.assert_close(scaled, loss.detach())
    assert not torch.allclose(loss, CF.info_nce(data["audio"], data["text"]))


@pytest.mark.parametrize("chunk", [None, 3])
def test_checks_off_give_the_same_loss(chunk) -> None:
    data = _data(13)
    guide = _guide(data, "pair")
    kwargs = {"guide": guide, "guide_margin": 0.15, "chunk_size": chunk, "return_terms": True}
    on, terms_on = CF.info_nce(data["audio"], data["text"], **kwargs)
    off, terms_off = CF.info_nce(data["audio"], data["text"], validate_args=False, **kwargs)
    torch.testing.assert_close(off, on, rtol=0, atol=0)
    torch.testing.assert_close(terms_off["guide_masked"], terms_on["guide_masked"])


def test_half_inputs_take_a_float32_guide() -> None:
    data = _data(11)
    a, t = data["audio"].half(), data["text"].half()
    loss = CF.info_nce(a, t, guide=data["guide_audio"], guide_margin=0.5)
    ref = CF.info_nce(a.float(), t.float(), guide=data["guide_audio"].float(), guide_margin=0.5)
    assert loss.dtype == torch.float16
    torch.testing.assert_close(loss.float(), ref, rtol=1e-3, atol=1e-3)


def test_guide_dense_rows_are_finite_in_backward() -> None:
    """A row whose every negative is excluded: finite loss and gradients (no NaN)."""
    data = _data(12)
    a = data["audio"].clone().requires_grad_()
    loss = CF.info_nce(a, data["text"], ids=data["ids"], guide=data["guide_audio"],
                       guide_margin=3.0)  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()
