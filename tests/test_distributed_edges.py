"""Two gloo processes with a rank holding one sample (or none, or a NaN): legal global
batches (1 + 1, 1 + 6) give the single-process loss and gradient, illegal inputs raise
the same error on every rank (the functional losses, SVR around InfoNCE and KCL, ASK).
A check failing on one rank only used to leave the other waiting in the first
collective: the spawn below has a deadline, so a hang fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    assert_ddp_average_matches,
    init_gloo,
    outlasting,
    rank_data,
    spawn_ranks,
)

from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    SupportVectorRegularizer,
)
from contrastive_losses import functional as CF

# name -> (sizes per rank, rank holding a NaN or None)
CASES = {
    "1+1": ((1, 1), None),
    "1+6": ((1, 6), None),
    "0+2": ((0, 2), None),
    "1+0": ((1, 0), None),
    "nan_on_rank1": ((2, 2), 1),
}
BANK_CASES = {
    "bank 0+3": ((0, 3), None),
    "bank nan_on_rank0": ((2, 3), 0),
}
# ASK: every rank searches the bank with its own samples, so a rank needs one.
ASK_CASES = {
    "1+6": None,
    "0+2": r"^audio: batch size 0 on this rank; .*\(on rank 0; every",
    "nan_on_rank1": None,
}
DEADLINE_S = 240  # the whole spawn; gloo's own timeout below is shorter
pytestmark = outlasting(DEADLINE_S)  # each test needs one of the two spawns


def _svr(base, radius):
    torch.manual_seed(0)  # the same predictor on every rank
    return SupportVectorRegularizer(base, radius=radius).double()


def _ask(gather: bool) -> ASKLoss:
    g = torch.Generator().manual_seed(3)
    kb = KnowledgeBank(4, backend="torch", num_prototypes=2, dtype=torch.float64)
    audio, text = torch.randn(12, 4, generator=g), torch.randn(12, 4, generator=g)
    kb.build(audio.double(), text.double(), torch.arange(12), gather=False)
    return ASKLoss(kb, k=2, k_coarse=1, gather=gather)


def _losses(gather: bool):
    return {
        "info_nce": lambda a, t, m: CF.info_nce(a, t[:, 0], 0.2, gather=gather),
        "siglip": lambda a, t, m: CF.siglip(a, t[:, 0], 3.0, -1.0, gather=gather),
        "kcl": lambda a, t, m: CF.kcl(a, t, 0.2, mask=m, gather=gather),
        "kcl_all": lambda a, t, m: CF.kcl(
            a, t, 0.2, mask=m, negatives="all_languages", gather=gather
        ),
        "cacl": lambda a, t, m: CF.cacl(a, t[:, 0], t[:, 1], 0.2, gather=gather),
        # the (B, K, D) form: its language checks run before cacl's gather
        "cacl_module": lambda a, t, m: CACLLoss(0.2, gather=gather)(
            a, t, torch.ones(len(a), dtype=torch.long)
        ),
        "svr_term": lambda a, t, m: CF.support_vector_term(a, t[:, 0], 0.1, 0.2, gather=gather),
        "svr_info_nce": lambda a, t, m: _svr(InfoNCELoss(0.2, gather=gather), "dynamic")(
            a, t[:, 0]
        ),
        "svr_kcl": lambda a, t, m: _svr(KCLLoss(0.2, gather=gather), 0.1)(a, t, m),
    }


def _run(fn, a: torch.Tensor, t: torch.Tensor, *args) -> tuple:
    """``(loss, a.grad, t.grad)``, or ``("error", type, message)``."""
    a, t = a.clone().requires_grad_(), t.clone().requires_grad_()
    try:
        loss = fn(a, t, *args)
    except (ValueError, TypeError) as err:
        return ("error", type(err).__name__, str(err))
    loss.backward()
    return (loss.detach(), a.grad, t.grad)


def _rows(sizes: tuple[int, ...], rank: int) -> slice:
    lo = sum(sizes[:rank])
    return slice(lo, lo + sizes[rank])


def _case_data(case: str, cases: dict = CASES) -> dict[str, torch.Tensor]:
    sizes, nan_rank = cases[case]
    data = {k: v[: sum(sizes)].clone() for k, v in rank_data().items() if k != "ids"}
    if nan_rank is not None:
        data["audio"][_rows(sizes, nan_rank).start, 1] = float("nan")
    return data


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=60)
    try:
        results: dict[str, object] = {}
        for case, (sizes, _) in CASES.items():
            data = _case_data(case)
            rows = _rows(sizes, rank)
            for name, fn in _losses(gather=True).items():
                results[case, name] = _run(
                    fn, data["audio"][rows], data["text"][rows], data["mask"][rows]
                )
            if case in ASK_CASES:
                ids = torch.arange(100, 100 + sum(sizes))[rows]
                results[case, "ask"] = _run(
                    _ask(True), data["audio"][rows], data["text"][rows, 0], ids
                )
        for case, (sizes, _) in BANK_CASES.items():
            data = _case_data(case, BANK_CASES)
            rows = _rows(sizes, rank)
            kb = KnowledgeBank(4, backend="torch", num_prototypes=0)
            try:
                kb.build(data["audio"][rows], data["text"][rows, 0], torch.arange(sum(sizes))[rows])
                results[case, "bank"] = kb.state_dict()
            except (ValueError, TypeError) as err:
                results[case, "bank"] = ("error", type(err).__name__, str(err))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dist_edges"), deadline_s=DEADLINE_S)


@pytest.mark.parametrize("name", list(_losses(gather=False)))
@pytest.mark.parametrize("case", ["1+1", "1+6", "0+2"])
def test_a_rank_with_one_sample_or_none_is_legal(rank_results, case, name):
    data = _case_data(case)
    a = data["audio"].clone().requires_grad_()
    t = data["text"].clone().requires_grad_()
    loss = _losses(gather=False)[name](a, t, data["mask"])
    loss.backward()
    per_rank = [{name: r[case, name]} for r in rank_results]
    assert_ddp_average_matches(per_rank, name, loss, a, t)


@pytest.mark.parametrize("name", list(_losses(gather=False)))
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("1+0", r"^(audio|anchor): global batch size 1 over 2 ranks is too small"),
        (
            "nan_on_rank1",
            r"^(audio|anchor): contains 1 NaN/Inf value.* \(on rank 1; every rank raises it\)",
        ),
    ],
)
def test_an_error_on_one_rank_is_raised_on_every_rank(rank_results, case, message, name):
    outcomes = [r[case, name] for r in rank_results]
    assert outcomes[0] == outcomes[1]  # same type and message everywhere
    kind, text = outcomes[0][0], outcomes[0][2]
    assert kind == "error" and outcomes[0][1] == "ValueError"
    assert __import__("re").search(message, text), text


def test_a_bank_build_with_an_empty_rank_or_a_nan_on_one_rank(rank_results):
    data = _case_data("bank 0+3", BANK_CASES)
    ref = KnowledgeBank(4, backend="torch", num_prototypes=0)
    ref.build(data["audio"], data["text"][:, 0], torch.arange(3))
    for r in rank_results:
        torch.testing.assert_close(r["bank 0+3", "bank"]["audio"], ref.audio)
    outcomes = [r["bank nan_on_rank0", "bank"] for r in rank_results]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "error"
    assert outcomes[0][2].startswith("audio_emb: contains 1 NaN/Inf"), outcomes[0]
    assert outcomes[0][2].endswith("(on rank 0; every rank raises it)"), outcomes[0]


def test_ask_one_sample_on_a_rank_none_or_a_nan(rank_results):
    """ASKLoss under gather: 1 + 6 is the single-process loss and gradient (DDP's average);
    a rank with no sample (nothing to search the bank with) or a NaN raises the same error
    on both ranks instead of leaving the other in the gather."""
    for case, message in ASK_CASES.items():
        outcomes = [r[case, "ask"] for r in rank_results]
        if case == "nan_on_rank1":
            message = r"^audio: contains 1 NaN/Inf value.* \(on rank 1; every rank raises it\)"
        if message is None:
            data = _case_data(case)
            a, t = (
                data["audio"].clone().requires_grad_(),
                data["text"][:, 0].clone().requires_grad_(),
            )
            loss = _ask(False)(a, t, torch.arange(100, 100 + a.shape[0]))
            loss.backward()
            assert_ddp_average_matches([{"ask": o} for o in outcomes], "ask", loss, a, t)
            continue
        assert outcomes[0] == outcomes[1], outcomes
        assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
        assert __import__("re").search(message, outcomes[0][2]), outcomes[0][2]


# ------------------------------------------------------------------ ranks that disagree
# Rank 0 and rank 1 pass embeddings of another width (D = 8 vs 16) or dtype (float32 vs
# float64). Gathering them used to abort one rank in gloo (SIGABRT) and reset the other's
# connection; every rank must raise the same ValueError naming the argument and both values.
DISAGREE = {
    "width": ((8, torch.float64), (16, torch.float64)),
    "dtype": ((8, torch.float32), (8, torch.float64)),
}


def _disagree_losses():
    def svr(base, radius, dtype):
        torch.manual_seed(0)
        return SupportVectorRegularizer(base, radius=radius).to(dtype)

    def ask_loss(a, t, m):
        g = torch.Generator().manual_seed(3)
        d = a.shape[1]
        kb = KnowledgeBank(d, backend="torch", num_prototypes=2, dtype=a.dtype)
        kb.build(
            torch.randn(12, d, generator=g),
            torch.randn(12, d, generator=g),
            torch.arange(12),
            gather=False,
        )
        return ASKLoss(kb, k=2, k_coarse=1, gather=True)(
            a, t[:, 0], torch.arange(100, 100 + len(a))
        )

    def bank(a, t, m):
        kb = KnowledgeBank(a.shape[1], backend="torch", num_prototypes=0)
        built = kb.build(a, t[:, 0], torch.arange(len(a)), gather=True)
        return built.audio.sum() + 0 * a.sum()  # a loss for _run to backward

    out = dict(_losses(gather=True))
    out["svr_info_nce"] = lambda a, t, m: svr(InfoNCELoss(0.2, gather=True), "dynamic", a.dtype)(
        a, t[:, 0]
    )
    out["svr_kcl"] = lambda a, t, m: svr(KCLLoss(0.2, gather=True), 0.1, a.dtype)(a, t, m)
    out["ask"] = ask_loss
    out["bank"] = bank
    return out


def _disagree_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    init_gloo(rank, world, init_method, timeout_s=60)
    try:
        results: dict[tuple[str, str], object] = {}
        g = torch.Generator().manual_seed(rank)
        for case, per_rank in DISAGREE.items():
            d, dtype = per_rank[rank]
            a = torch.randn(3, d, generator=g, dtype=dtype)
            t = torch.randn(3, 3, d, generator=g, dtype=dtype)
            m = torch.ones(3, 3, dtype=torch.bool)
            for name, fn in _disagree_losses().items():
                results[case, name] = _run(fn, a, t, m)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def disagree_results(tmp_path_factory):
    return spawn_ranks(
        _disagree_worker, tmp_path_factory.mktemp("dist_disagree"), deadline_s=DEADLINE_S
    )


@pytest.mark.parametrize("name", list(_disagree_losses()))
@pytest.mark.parametrize("case", list(DISAGREE))
def test_ranks_that_disagree_on_width_or_dtype_raise_the_same_error(disagree_results, case, name):
    outcomes = [r[case, name] for r in disagree_results]
    if case == "dtype" and name == "bank":
        # build() stores float32 unit rows whatever the input dtype: nothing to disagree on
        assert all(isinstance(o[0], torch.Tensor) for o in outcomes), outcomes
        torch.testing.assert_close(outcomes[0][0].double(), outcomes[1][0].double())  # one bank
        return
    assert outcomes[0] == outcomes[1], outcomes  # the same type and message everywhere
    assert outcomes[0][:2] == ("error", "ValueError"), outcomes[0]
    message = outcomes[0][2]
    arg = {"svr_term": "anchor", "bank": "audio_emb"}.get(name, "audio")
    values = ("(8,)", "(16,)") if case == "width" else ("torch.float32", "torch.float64")
    assert message.startswith(f"{arg}: "), message
    assert f"{values[0]} on rank 0" in message and f"{values[1]} on rank 1" in message, message
