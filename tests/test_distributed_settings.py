"""Two gloo ranks that disagree on a setting (issue 22): every rank raises the same
``ValueError`` naming the setting and each rank's value, instead of a gloo abort of both
processes (``chunk_size`` ``None`` against 2, ``validate_args`` on against off) or two
silently different losses (temperature 0.05 against 0.07, ``reduction`` mean against
sum, KCL's ``negatives``). One spawn runs every case; the ranks with the checks on
against a rank with them off run last, as that rank is then left in its gather until
the other process ends (gloo raises a connection error there, not an abort)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, outlasting, spawn_ranks

from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses import functional as CF

DEADLINE_S = 240
pytestmark = outlasting(DEADLINE_S)


def _ask(k: int) -> ASKLoss:
    g = torch.Generator().manual_seed(3)
    kb = KnowledgeBank(4, backend="torch", num_prototypes=2, dtype=torch.float64)
    audio, text = torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    kb.build(audio.double(), text.double(), torch.arange(12), gather=False)
    return ASKLoss(kb, k=k, k_coarse=1, gather=True)


def _ask_prototypes(n: int) -> ASKLoss:
    """A bank of ``n`` prototypes and ``k_coarse=5``: the effective k_coarse is min(5, n)."""
    g = torch.Generator().manual_seed(3)
    kb = KnowledgeBank(4, backend="torch", num_prototypes=n, dtype=torch.float64)
    audio, text = torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    kb.build(audio.double(), text.double(), torch.arange(12), gather=False)
    return ASKLoss(kb, k=2, k_coarse=5, gather=True)


def _extra_call(r: int, a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Rank 0 calls a loss once more than rank 1 before both call a second loss of the
    same settings: rank 0's extra call meets rank 1's call of the other loss."""
    first, second = InfoNCELoss(0.1, gather=True), InfoNCELoss(0.1, gather=True)
    first(a, t)
    if r == 0:
        first(a, t)
    return second(a, t)


def _svr(base: torch.nn.Module, **kwargs) -> SupportVectorRegularizer:
    torch.manual_seed(0)  # the same predictor on every rank
    return SupportVectorRegularizer(base, **kwargs).double()


def _svr_case(setting: str, printed: tuple[str, str], **kwargs) -> tuple:
    """A CASES entry: SupportVectorRegularizer(InfoNCELoss) whose one argument given as a
    pair (rank 0's, rank 1's) differs; the other ``kwargs`` are the same on both."""
    (name, values), *_ = ((k, v) for k, v in kwargs.items() if isinstance(v, tuple))
    same = {k: v for k, v in kwargs.items() if k != name}

    def loss(r, a, t, m):
        return _svr(InfoNCELoss(0.1, gather=True), **{name: values[r]}, **same)(a, t[:, 0])

    return setting, printed, loss


# case -> (setting named in the message, its printed value on rank 0 and on rank 1,
#          loss(rank, audio (b, D), text (b, K, D), mask (b, K)) with that rank's value)
CASES = {
    "temperature": (
        "temperature",
        ("0.05", "0.07"),
        lambda r, a, t, m: CF.info_nce(a, t[:, 0], (0.05, 0.07)[r], gather=True),
    ),
    "reduction": (
        "reduction",
        ("'mean'", "'sum'"),
        lambda r, a, t, m: CF.info_nce(a, t[:, 0], 0.1, reduction=("mean", "sum")[r], gather=True),
    ),
    "info_nce chunk_size": (
        "chunk_size",
        ("None", "2"),
        lambda r, a, t, m: InfoNCELoss(0.1, chunk_size=(None, 2)[r], gather=True)(a, t[:, 0]),
    ),
    "normalize": (
        "normalize",
        ("True", "False"),
        lambda r, a, t, m: CF.info_nce(a, t[:, 0], 1.0, normalize=r == 0, gather=True),
    ),
    "ids": (
        "ids_given",
        ("True", "False"),
        lambda r, a, t, m: CF.info_nce(
            a, t[:, 0], ids=torch.arange(len(a)) if r == 0 else None, gather=True
        ),
    ),
    "logit_scale": (
        "logit_scale",
        ("20", "14"),
        lambda r, a, t, m: InfoNCELoss(gather=True)(
            a, t[:, 0], logit_scale=torch.tensor((20.0, 14.0)[r], dtype=torch.float64)
        ),
    ),
    "siglip logit_bias": (
        "logit_bias",
        ("-10", "-5"),
        lambda r, a, t, m: CF.siglip(
            a,
            t[:, 0],
            logit_scale=torch.tensor(10.0, dtype=torch.float64),
            logit_bias=torch.tensor((-10.0, -5.0)[r], dtype=torch.float64),
            gather=True,
        ),
    ),
    "module temperature": (
        "temperature",
        ("0.05", "0.07"),
        lambda r, a, t, m: InfoNCELoss((0.05, 0.07)[r], learnable_temperature=True, gather=True)(
            a, t[:, 0]
        ),
    ),
    "siglip scale": (
        "scale",
        ("10", "5"),
        lambda r, a, t, m: CF.siglip(a, t[:, 0], (10.0, 5.0)[r], -10.0, gather=True),
    ),
    "siglip bias": (
        "bias",
        ("-10", "-5"),
        lambda r, a, t, m: SigLIPLoss(bias_init=(-10.0, -5.0)[r], gather=True).double()(a, t[:, 0]),
    ),
    "siglip chunk_size": (
        "chunk_size",
        ("None", "2"),
        lambda r, a, t, m: CF.siglip(a, t[:, 0], chunk_size=(None, 2)[r], gather=True),
    ),
    "kcl negatives": (
        "negatives",
        ("'per_language'", "'all_languages'"),
        lambda r, a, t, m: KCLLoss(
            0.1, negatives=("per_language", "all_languages")[r], gather=True
        )(a, t, m),
    ),
    "kcl chunk_size": (
        "chunk_size",
        ("None", "2"),
        lambda r, a, t, m: CF.kcl(a, t, 0.1, mask=m, chunk_size=(None, 2)[r], gather=True),
    ),
    "kcl mask": (
        "mask_given",
        ("True", "False"),
        lambda r, a, t, m: CF.kcl(a, t, 0.1, mask=m if r == 0 else None, gather=True),
    ),
    "cacl chunk_size": (
        "chunk_size",
        ("None", "2"),
        lambda r, a, t, m: CACLLoss(0.1, chunk_size=(None, 2)[r], gather=True)(
            a, t, torch.ones(len(a), dtype=torch.long)
        ),
    ),
    "cacl temperature": (
        "temperature",
        ("0.05", "0.07"),
        lambda r, a, t, m: CF.cacl(a, t[:, 0], t[:, 1], (0.05, 0.07)[r], gather=True),
    ),
    "svr_term radius": (
        "radius",
        ("0.1", "0.2"),
        lambda r, a, t, m: CF.support_vector_term(a, t[:, 0], (0.1, 0.2)[r], 0.1, gather=True),
    ),
    "svr_term chunk_size": (
        "chunk_size",
        ("None", "2"),
        lambda r, a, t, m: CF.support_vector_term(
            a, t[:, 0], 0.1, 0.1, chunk_size=(None, 2)[r], gather=True
        ),
    ),
    "svr direction": (
        "direction",
        ("'uni'", "'bi'"),
        lambda r, a, t, m: _svr(InfoNCELoss(0.1, gather=True), direction=("uni", "bi")[r])(
            a, t[:, 0]
        ),
    ),
    "svr radius mode": (
        "radius",
        ("'static'", "'fixed'"),
        lambda r, a, t, m: _svr(InfoNCELoss(0.1, gather=True), radius=("static", 0.1)[r])(
            a, t[:, 0]
        ),
    ),
    "svr alpha": (
        "alpha",
        ("1", "2"),
        lambda r, a, t, m: _svr(KCLLoss(0.1, gather=True), alpha=(1.0, 2.0)[r])(a, t, m),
    ),
    "svr beta": (
        "beta",
        ("0.01", "0.1"),
        lambda r, a, t, m: _svr(InfoNCELoss(0.1, gather=True), beta=(0.01, 0.1)[r])(a, t[:, 0]),
    ),
    "svr temperature": (
        "temperature",
        ("0.05", "0.07"),
        lambda r, a, t, m: _svr(InfoNCELoss(0.1, gather=True), temperature=(0.05, 0.07)[r])(
            a, t[:, 0]
        ),
    ),
    "svr base chunk_size": (
        "chunk_size",
        ("None", "2"),
        lambda r, a, t, m: _svr(KCLLoss(0.1, chunk_size=(None, 2)[r], gather=True), radius=0.1)(
            a, t, m
        ),
    ),
    "ask k": (
        "k",
        ("2", "3"),
        lambda r, a, t, m: _ask((2, 3)[r])(a, t[:, 0], torch.arange(100, 100 + len(a))),
    ),
    # Issue 29: what the fingerprint missed (an abort, or a silently different loss).
    "svr fixed radius": _svr_case("radius value", ("0.2", "0.3"), radius=(0.2, 0.3)),
    "svr static radius_init": _svr_case(
        "radius value", ("0.1", "0.2"), radius_init=(0.1, 0.2), radius="static"
    ),
    "svr dynamic radius_init": _svr_case("radius_init", ("0.1", "0.2"), radius_init=(0.1, 0.2)),
    "svr predictor num_features": _svr_case("num_features", ("2", "3"), num_features=(2, 3)),
    "svr predictor hidden": _svr_case("hidden", ("8", "16"), hidden=(8, 16)),
    "cacl english_index": (
        "english_index",
        ("0", "1"),
        lambda r, a, t, m: CACLLoss(0.1, english_index=(0, 1)[r], gather=True)(a, t),
    ),
    "ask effective k_coarse": (
        "k_coarse_effective",
        ("3", "5"),
        lambda r, a, t, m: _ask_prototypes((3, 5)[r])(a, t[:, 0], torch.arange(100, 100 + len(a))),
    ),
    "ask logit_scale dtype": (
        "logit_scale dtype",
        ("torch.float16", "torch.float32"),
        lambda r, a, t, m: _ask_prototypes(3)(
            a,
            t[:, 0],
            torch.arange(100, 100 + len(a)),
            logit_scale=torch.tensor(16.0, dtype=(torch.float16, torch.float32)[r]),
        ),
    ),
    "logit_scale dtype": (
        "logit_scale dtype",
        ("torch.float16", "torch.float32"),
        lambda r, a, t, m: InfoNCELoss(gather=True)(
            a.float(),
            t[:, 0].float(),
            logit_scale=torch.tensor(16.0, dtype=(torch.float16, torch.float32)[r]),
        ),
    ),
    "temperature dtype": (
        "temperature dtype",
        ("torch.float64", "torch.float32"),
        lambda r, a, t, m: CF.kcl(
            a, t, torch.tensor(0.1, dtype=(torch.float64, torch.float32)[r]), gather=True
        ),
    ),
    "siglip scale dtype": (
        "scale dtype",
        ("torch.float16", "torch.float32"),
        lambda r, a, t, m: CF.siglip(
            a.float(),
            t[:, 0].float(),
            logit_scale=torch.tensor(16.0, dtype=(torch.float16, torch.float32)[r]),
            logit_bias=torch.tensor(-8.0),
            gather=True,
        ),
    ),
    "extra loss call": (
        "call of InfoNCELoss",
        ("2", "1"),
        lambda r, a, t, m: _extra_call(r, a, t[:, 0]),
    ),
}
# The dtype of a gathered tensor (issue 29: ids int32 on one rank and int64 on the other
# aborted one rank after the other returned a loss built from garbage ids).
TENSOR_CASES = {
    "info_nce ids dtype": lambda r, a, t, m: CF.info_nce(
        a, t[:, 0], ids=torch.arange(len(a), dtype=(torch.int32, torch.int64)[r]), gather=True
    ),
    "siglip ids dtype": lambda r, a, t, m: SigLIPLoss(gather=True, chunk_size=2).double()(
        a, t[:, 0], torch.arange(len(a), dtype=(torch.int32, torch.int64)[r])
    ),
}
# validate_args on against off, per loss: run after every other case (see the docstring).
MIXED = {
    "info_nce": lambda v, a, t, m: CF.info_nce(a, t[:, 0], validate_args=v, gather=True),
}


def _outcome(fn, *args) -> tuple:
    try:
        loss = fn(*args)
    except (ValueError, TypeError) as err:
        return ("error", type(err).__name__, str(err))
    except RuntimeError as err:  # gloo: the peer process ended
        return ("runtime", type(err).__name__, str(err))
    return ("value", float(loss))


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=60)
    results: dict[str, object] = {}
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(3, 4, generator=g, dtype=torch.float64)
    t = torch.randn(3, 3, 4, generator=g, dtype=torch.float64)
    m = torch.ones(3, 3, dtype=torch.bool)
    try:
        for case, (_, _, fn) in CASES.items():
            results[case] = _outcome(fn, rank, a, t, m)
        for case, fn in TENSOR_CASES.items():
            results[case] = _outcome(fn, rank, a, t, m)
        # Both ranks call one Module twice: the counts agree.
        loss = InfoNCELoss(0.1, gather=True)
        results["same calls"] = _outcome(lambda: (loss(a, t[:, 0]), loss(a, t[:, 0]))[1])
        results["scale vs temperature"] = _outcome(
            lambda r, a, t, m: CF.info_nce(
                a,
                t[:, 0],
                logit_scale=torch.tensor(10.0, dtype=torch.float64) if r == 0 else None,
                temperature=0.07 if r == 0 else 0.1,
                gather=True,
            ),
            rank,
            a,
            t,
            m,
        )
        # The same settings on both ranks still agree (a float temperature of a
        # learnable Module passes through the same exchange).
        results["agree"] = _outcome(CASES["module temperature"][2], 0, a, t, m)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        for case, fn in MIXED.items():
            results[f"mixed {case}"] = _outcome(fn, rank == 0, a, t, m)
            torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_settings"), deadline_s=DEADLINE_S)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_disagree_on_a_setting_raise_the_same_error_naming_it(results, case):
    setting, (v0, v1), _ = CASES[case]
    outcomes = [r[case] for r in results]
    assert outcomes[0] == outcomes[1], outcomes  # the same type and message on every rank
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    message = outcomes[0][2]
    assert message.startswith(f"{setting}: differs across ranks ("), message
    assert f"{v0} on rank 0, {v1} on rank 1" in message, message


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_ranks_that_gather_ids_of_different_dtypes_raise_the_same_error(results, case):
    outcomes = [r[case] for r in results]
    assert outcomes[0] == outcomes[1], outcomes  # no abort: the same error on every rank
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith(
        "ids: dtype torch.int32 on rank 0 but torch.int64 on rank 1; every rank must pass "
        "the same dtype"
    ), outcomes[0]


def test_ranks_that_call_a_module_equally_often_agree(results):
    assert [r["same calls"][0] for r in results] == ["value", "value"], results


def test_a_model_scale_on_one_rank_and_a_temperature_on_the_other(results):
    outcomes = [r["scale vs temperature"] for r in results]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    assert outcomes[0][2].startswith("settings: the ranks call different losses or forms"), (
        outcomes[0]
    )
    assert "rank 0: logit_scale," in outcomes[0][2], outcomes[0]
    assert "rank 1: temperature," in outcomes[0][2], outcomes[0]


def test_ranks_with_the_same_settings_agree(results):
    assert [r["agree"][0] for r in results] == ["value", "value"], results


@pytest.mark.parametrize("case", list(MIXED))
def test_checks_on_against_off_raise_on_the_checking_rank_and_abort_nothing(results, case):
    checking, unchecked = (r[f"mixed {case}"] for r in results)
    assert checking[:2] == ("error", "ValueError"), checking
    assert checking[2].startswith("validate_args: the value checks run on some ranks only"), (
        checking
    )
    assert "True on rank 0, False on rank 1" in checking[2], checking
    # The rank without checks cannot know without a host sync: it waits in its gather
    # until rank 0's process group goes away, then gloo raises (a Python error, the
    # process lives: it saved this result).
    assert unchecked[0] == "runtime", unchecked
