"""The open_clip drop-ins against the real open_clip 3.x ``loss.py``: equal values and
gradients (features, ``logit_scale``, ``logit_bias``) in one process and on two gloo
ranks, and a few training steps of a tiny open_clip ``CLIP`` with the drop-in in place of
open_clip's loss. Without open_clip installed these tests skip, saying how to install it
(``tests/open_clip_reference.py``)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import RANK_SIZES, init_gloo, rank_rows, spawn_ranks
from open_clip_reference import load_open_clip_loss, load_open_clip_model

from contrastive_losses import functional as CF
from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

F64 = torch.float64
N, D = 8, 5  # global batch; two ranks hold 4 rows each (open_clip needs equal sizes)


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(N, D, generator=g, dtype=F64), dim=-1)
    text = F.normalize(torch.randn(N, D, generator=g, dtype=F64) + image, dim=-1)
    return {"image": image, "text": text}


def _run(loss_fn, rows: slice, bias: bool = True, **kwargs) -> tuple[torch.Tensor, ...]:
    """One forward and backward: ``(loss, image grad, text grad, log-scale grad, bias
    grad)``; the scale is ``exp`` of a leaf, as in open_clip's models."""
    data = _data()
    image = data["image"][rows].clone().requires_grad_()
    text = data["text"][rows].clone().requires_grad_()
    log_scale = torch.tensor(math.log(10.0), dtype=F64, requires_grad=True)
    logit_bias = torch.tensor(-4.0, dtype=F64, requires_grad=True)
    loss = loss_fn(image, text, log_scale.exp(), logit_bias if bias else None, **kwargs)
    loss.backward()
    bias_grad = logit_bias.grad if logit_bias.grad is not None else torch.zeros((), dtype=F64)
    return (loss.detach(), image.grad, text.grad, log_scale.grad, bias_grad)


def _assert_equal(ours, theirs, parts=range(5)) -> None:
    for i in parts:
        torch.testing.assert_close(ours[i], theirs[i], rtol=1e-6, atol=1e-9, msg=f"part {i}")


# ------------------------------------------------------------------------ one process


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_clip_loss_equals_open_clip(bias, chunk_size):
    oc = load_open_clip_loss()
    everything = slice(None)
    theirs = _run(oc.ClipLoss(), everything, bias)
    ours = _run(ClipLoss(chunk_size=chunk_size), everything, bias)
    _assert_equal(ours, theirs)
    out = ClipLoss()(*(_data()[k] for k in ("image", "text")), torch.tensor(10.0, dtype=F64),
                     output_dict=True)  # fmt: skip
    assert list(out) == ["contrastive_loss"]
    torch.testing.assert_close(out["contrastive_loss"], theirs[0])


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_siglip_loss_equals_open_clip(chunk_size):
    oc = load_open_clip_loss()
    everything = slice(None)
    _assert_equal(
        _run(SigLipLoss(chunk_size=chunk_size), everything),
        _run(oc.SigLipLoss(), everything),
    )
    # no bias: open_clip adds none
    ours = _run(SigLipLoss(), everything, bias=False)
    theirs = _run(oc.SigLipLoss(), everything, bias=False)
    _assert_equal(ours, theirs, parts=range(4))


@pytest.mark.parametrize("name", ["ClipLoss", "SigLipLoss"])
def test_signatures_are_open_clips(name):
    """open_clip's parameters of ``__init__`` and ``forward``, in order, with its defaults;
    ours add keyword-only ones after them."""
    import inspect

    oc = load_open_clip_loss()
    for method in ("__init__", "forward"):
        theirs = list(inspect.signature(getattr(getattr(oc, name), method)).parameters.values())
        ours = list(inspect.signature(getattr(globals()[name], method)).parameters.values())
        assert [(p.name, p.default) for p in ours[: len(theirs)]] == [
            (p.name, p.default) for p in theirs
        ]
        assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs) :])


def test_ids_make_duplicates_positives():
    """``ids`` is the extra open_clip lacks: the same clip twice is no false negative;
    it equals ``info_nce`` with ``ids`` and the same ``logit_scale``."""
    data = _data()
    image, text = data["image"], data["text"]
    ids = torch.tensor([0, 1, 2, 0, 3, 4, 5, 1])
    scale = torch.tensor(10.0, dtype=F64)
    ours = ClipLoss()(image, text, scale, ids=ids)
    expected = CF.info_nce(image, text, logit_scale=scale, ids=ids, normalize=False)
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(ours, ClipLoss()(image, text, scale))


def test_svr_adds_supclaps_term_on_the_models_scale():
    """``svr={...}``: the base plus SupCLAP's term at the model's scale, detached there
    (``logit_scale`` learns from the base alone), both directions halved."""
    data = _data()
    image = data["image"].clone().requires_grad_()
    log_scale = torch.tensor(math.log(10.0), dtype=F64, requires_grad=True)
    loss_fn = ClipLoss(svr={"radius": 0.1, "direction": "bi"}, chunk_size=3)
    loss = loss_fn(image, data["text"], log_scale.exp())
    loss.backward()
    assert list(loss_fn.parameters()) == []  # a fixed radius: nothing to learn

    image_ref = data["image"].clone().requires_grad_()
    log_scale_ref = torch.tensor(math.log(10.0), dtype=F64, requires_grad=True)
    base = CF.info_nce(image_ref, data["text"], logit_scale=log_scale_ref.exp(), normalize=False)
    tau = 0.1  # 1 / the scale, no gradient
    svr = sum(
        CF.support_vector_term(anchor, candidates, 0.1, tau, normalize=False)
        for anchor, candidates in ((data["text"], image_ref), (image_ref, data["text"]))
    )
    expected = base + svr / 2
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(image.grad, image_ref.grad)
    torch.testing.assert_close(log_scale.grad, log_scale_ref.grad)
    dynamic = SigLipLoss(svr={})  # the regulariser's defaults: a dynamic radius
    assert len(list(dynamic.parameters())) > 0


def test_unsupported_settings_raise():
    with pytest.raises(ValueError, match="use_horovod: Horovod is not supported"):
        ClipLoss(use_horovod=True)
    with pytest.raises(ValueError, match="dist_impl"):
        SigLipLoss(dist_impl="ring")
    with pytest.raises(ValueError, match="rank: 2 is not below world_size=2"):
        SigLipLoss(rank=2, world_size=2)
    with pytest.raises(TypeError, match="svr: expected None or a dict"):
        ClipLoss(svr="dynamic")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="gather_with_grad=False"):
        loss_fn = ClipLoss(local_loss=True, world_size=2)
    data = _data()
    with pytest.raises(ValueError, match=r"world_size: 2 needs torch\.distributed"):
        loss_fn(data["image"], data["text"], torch.tensor(10.0, dtype=F64))


# ------------------------------------------------------------------------- two ranks

CLIP_SETTINGS = [(True, True), (False, True), (True, False), (False, False)]


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method)
    warnings.filterwarnings("ignore", category=FutureWarning)  # open_clip's deprecated gathers
    try:
        oc = load_open_clip_loss()
        rows = slice(rank * N // world, (rank + 1) * N // world)
        common = {"rank": rank, "world_size": world}
        results = {}
        for local, with_grad in CLIP_SETTINGS:
            flags = {"local_loss": local, "gather_with_grad": with_grad, **common}
            results[f"clip_theirs_{local}_{with_grad}"] = _run(oc.ClipLoss(**flags), rows)
            for chunk in (None, 3):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ours = ClipLoss(**flags, chunk_size=chunk)
                results[f"warned_{local}_{with_grad}_{chunk}"] = len(caught)
                results[f"clip_ours_{local}_{with_grad}_{chunk}"] = _run(ours, rows)
        # open_clip needs equal batch sizes; the drop-in takes the last, uneven, batch too
        uneven = ClipLoss(local_loss=False, gather_with_grad=True, **common)
        results["clip_ours_uneven"] = _run(uneven, rank_rows(rank))
        for chunk in (None, 3):  # open_clip's per-rank value on uneven shards too
            local = ClipLoss(local_loss=True, gather_with_grad=True, chunk_size=chunk, **common)
            results[f"clip_ours_uneven_local_{chunk}"] = _run(local, rank_rows(rank))
            sig = SigLipLoss(chunk_size=chunk, **common)
            results[f"siglip_ours_uneven_{chunk}"] = _run(sig, rank_rows(rank))
        for impl in ("bidir", "shift", "reduce", "gather"):
            theirs = oc.SigLipLoss(dist_impl=impl, **common)
            results[f"siglip_theirs_{impl}"] = _run(theirs, rows)
            results[f"siglip_ours_{impl}"] = _run(SigLipLoss(dist_impl=impl, **common), rows)
        results["siglip_ours_chunk"] = _run(SigLipLoss(chunk_size=3, **common), rows)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    load_open_clip_loss()  # skip here, not in the workers, when open_clip is absent
    return spawn_ranks(_worker, tmp_path_factory.mktemp("open_clip"))


def _mean(ranks, key: str, part: int) -> torch.Tensor:
    return sum(r[key][part] for r in ranks) / len(ranks)


@pytest.mark.parametrize("impl", ["bidir", "shift", "reduce", "gather"])
def test_two_rank_siglip_equals_open_clip(ranks, impl):
    """Every rank's value and gradients, for each of open_clip's exchanges."""
    for r in ranks:
        _assert_equal(r[f"siglip_ours_{impl}"], r[f"siglip_theirs_{impl}"])
        _assert_equal(r["siglip_ours_chunk"], r[f"siglip_theirs_{impl}"])


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("local", [True, False])
def test_two_rank_clip_with_grad_equals_open_clip(ranks, local, chunk):
    """``gather_with_grad=True``: every rank's value and feature gradients, and the mean
    over ranks of the scale's and the bias' gradients (what DDP applies). Per rank those
    two differ: open_clip multiplies the gathered features by each rank's own scale (and
    without ``local_loss`` computes the global loss on every rank), ours scales each
    rank's rows before the gather, so part of a rank's scale gradient reaches its peers'
    copy of the scale; the sums over ranks agree."""
    ours_key, theirs_key = f"clip_ours_{local}_True_{chunk}", f"clip_theirs_{local}_True"
    for r in ranks:
        _assert_equal(r[ours_key], r[theirs_key], parts=(0, 1, 2))
    for part in (3, 4):
        torch.testing.assert_close(_mean(ranks, ours_key, part), _mean(ranks, theirs_key, part))


@pytest.mark.parametrize("local", [True, False])
def test_two_rank_clip_without_grad_gather(ranks, local):
    """``gather_with_grad=False``: open_clip's values; the gradient is the exact one
    (open_clip's with ``gather_with_grad=True``), where open_clip's own drops the part
    through other ranks (``local_loss``) or scales the features' by ``1/world``."""
    for r in ranks:
        ours, theirs = r[f"clip_ours_{local}_False_None"], r[f"clip_theirs_{local}_False"]
        exact = r[f"clip_theirs_{local}_True"]
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
        _assert_equal(ours, exact, parts=(0, 1, 2))
        if local:
            assert (theirs[1] - exact[1]).abs().max() > 1e-3  # truncated
        else:
            torch.testing.assert_close(theirs[1] * len(ranks), exact[1])


def test_two_rank_warnings_and_uneven_batches(ranks):
    """The constructor warns exactly for ``gather_with_grad=False`` on several ranks; and
    on uneven shards (5 + 3 rows) ``local_loss=False`` gives every rank the loss of the
    whole batch, which one process computes."""
    for r in ranks:
        for local, with_grad in CLIP_SETTINGS:
            for chunk in (None, 3):
                assert r[f"warned_{local}_{with_grad}_{chunk}"] == (0 if with_grad else 1)
    assert sum(RANK_SIZES) == N
    whole = _run(ClipLoss(), slice(None))
    for r in ranks:
        torch.testing.assert_close(r["clip_ours_uneven"][0], whole[0])


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_two_rank_uneven_value_is_open_clips_per_rank_mean(ranks, name, chunk):
    """On uneven shards (5 + 3 rows) each rank's value is open_clip's convention, the
    mean over its own rows of their losses against the global batch (``ClipLoss``
    with ``local_loss``, ``SigLipLoss``), while the gradients stay the exact ones: a
    rank's feature gradients are ``world`` times the global-batch loss's (each rank's
    loss counts its rows ``world / N`` times, so the sum over ranks is ``world`` times
    that loss), and the mean over ranks of the scale's and bias' gradients is the
    global-batch loss's."""
    key = f"clip_ours_uneven_local_{chunk}" if name == "clip" else f"siglip_ours_uneven_{chunk}"
    data = _data()
    image, text = data["image"].clone().requires_grad_(), data["text"].clone().requires_grad_()
    log_scale = torch.tensor(math.log(10.0), dtype=F64, requires_grad=True)
    logit_bias = torch.tensor(-4.0, dtype=F64, requires_grad=True)
    if name == "clip":
        rows = CF.info_nce(image, text, logit_scale=log_scale.exp(), normalize=False,
                           reduction="none")  # fmt: skip
        rows = rows + 0.0 * logit_bias
    else:
        rows = CF.siglip(image, text, logit_scale=log_scale.exp(), logit_bias=logit_bias,
                         normalize=False, reduction="none")  # fmt: skip
    rows.mean().backward()
    world = len(ranks)
    for rank, r in enumerate(ranks):
        part = rank_rows(rank)
        torch.testing.assert_close(r[key][0], rows[part].mean().detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(r[key][1], world * image.grad[part], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r[key][2], world * text.grad[part], rtol=1e-10, atol=1e-12)
    assert not torch.isclose(ranks[0][key][0] + ranks[1][key][0], 2 * rows.mean())  # uneven
    for part, leaf in ((3, log_scale), (4, logit_bias)):
        torch.testing.assert_close(_mean(ranks, key, part), leaf.grad, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ a tiny open_clip


def test_tiny_open_clip_model_trains_with_the_drop_in(monkeypatch):
    """A tiny open_clip ``CLIP`` (ViT + text transformer, open_clip's ``logit_scale``
    parameter) trained 8 steps with open_clip's ``ClipLoss`` and, from the same start,
    with the drop-in: the same losses step by step, and falling."""
    oc_loss = load_open_clip_loss()
    oc_model = load_open_clip_model(monkeypatch)

    def train(loss_fn) -> list[float]:
        torch.manual_seed(0)
        model = oc_model.CLIP(
            embed_dim=16,
            vision_cfg={"image_size": 16, "patch_size": 8, "width": 32, "layers": 1,
                        "head_width": 16},
            text_cfg={"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2,
                      "layers": 1},
            output_dict=True,
        )  # fmt: skip
        images, tokens = torch.randn(16, 3, 16, 16), torch.randint(1, 64, (16, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            out = model(images, tokens)  # open_clip's dict: image/text features, logit_scale
            loss = loss_fn(**out, output_dict=True)["contrastive_loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))  # open_clip's train loop does this
            losses.append(loss.item())
        return losses

    theirs, ours = train(oc_loss.ClipLoss()), train(ClipLoss())
    print(f"tiny open_clip CLIP: open_clip ClipLoss {theirs[0]:.4f} -> {theirs[-1]:.4f}, "
          f"drop-in {ours[0]:.4f} -> {ours[-1]:.4f}")  # fmt: skip
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)
    assert ours[-1] < ours[0] - 0.1
