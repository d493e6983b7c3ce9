"""Adversarial sweep: well over 1,000 bad inputs thrown at every public loss, metric,
diagnostic and bank entry point.

Each case replaces one argument of a valid call by a bad value (wrong type, shape,
dtype, device, NaN/Inf, zero rows, huge or tiny norms, K or batch mismatch, bad masks,
bad scalars). A case passes when the call either raises ``ValueError``/``TypeError``
whose message names the argument, or returns finite values (and finite gradients). It
fails as *unclear* (an error naming no argument), *crash* (any other exception) or
*silent* (a NaN/Inf result or gradient).

``python tests/test_adversarial.py`` prints the counts per entry point.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import contrastive_losses as cl
from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    RadiusPredictor,
    SigLIPLoss,
    SupportVectorRegularizer,
)
from contrastive_losses import diagnostics as D
from contrastive_losses import functional as CF
from contrastive_losses import metrics as M

B, K, DIM = 6, 3, 8
_DEFAULT = object()  # "argument not replaced by this case" where None is a bad value


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _emb(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


def _bank() -> KnowledgeBank:
    kb = KnowledgeBank(dim=DIM, backend="torch", num_prototypes=2)
    return kb.build(_emb(12, DIM, seed=5), _emb(12, DIM, seed=6), torch.arange(100, 112))


# ------------------------------------------------------------------ bad values by kind


def _set(x: torch.Tensor, idx: tuple[int, ...], value: float) -> torch.Tensor:
    x = x.clone()
    x[idx] = value
    return x


def _bad_embeddings(x: torch.Tensor) -> dict[str, object]:
    """Bad versions of a valid float32 embedding tensor ``x`` (``(B, ..., D)``)."""
    first = (0,) * x.dim()
    row = (1,) + (0,) * (x.dim() - 2)
    return {
        "none": None,
        "list": x.tolist(),
        "int": 3,
        "0-d": torch.tensor(1.0),
        "1-d": x.reshape(-1),
        "extra dim": x.unsqueeze(1),
        "batch 0": x[:0],
        "batch 1": x[:1],
        "D 0": x[..., :0],
        "batch mismatch": x[:-1],
        "D mismatch": x[..., :-1],
        "int64": x.long(),
        "bool": x > 0,
        "complex": x.to(torch.complex64),
        "float64": x.double(),
        "float16": x.half(),
        "bfloat16": x.bfloat16(),
        "nan": _set(x, first, float("nan")),
        "inf": _set(x, first, float("inf")),
        "-inf": _set(x, first, float("-inf")),
        "all nan": torch.full_like(x, float("nan")),
        "zero row": _set(x, row, 0.0)
        if x.dim() == 2
        else x.clone().index_fill_(1, torch.tensor([0]), 0.0),
        "all zeros": torch.zeros_like(x),
        "huge 1e20": x * 1e20,
        "huge 1e37": x * 1e37,
        "max": torch.full_like(x, torch.finfo(torch.float32).max),
        "tiny 1e-25": x * 1e-25,
        "subnormal 1e-44": x * 1e-44,
        "one row huge one tiny": torch.cat([x[:1] * 1e30, x[1:2] * 1e-30, x[2:]]),
        "fp16 huge": (x * 3e3).half(),
        "fp16 tiny": (x * 1e-3).half(),
        "fp16 max": torch.full_like(x, 65504.0).half(),
        "non-contiguous": x.transpose(0, -1).contiguous().transpose(0, -1),
        "meta": x.to("meta"),
        "requires_grad nan": _set(x, first, float("nan")).requires_grad_(),
        "constant rows": torch.ones_like(x),
    }


def _bad_scalars(positive: bool = True) -> dict[str, object]:
    out: dict[str, object] = {
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": float("-inf"),
        "1e40": 1e40,
        "string": "0.1",
        "none": None,
        "bool": True,
        "vector tensor": torch.tensor([0.1, 0.2]),
        "nan tensor": torch.tensor(float("nan")),
        "complex": 1j,
    }
    if positive:
        out.update({"zero": 0.0, "negative": -1.0, "1e-40": 1e-40, "1e-300": 1e-300})
    return out


def _bad_ints(minimum: int) -> dict[str, object]:
    return {
        "below": minimum - 1,
        "negative": -5,
        "float": 1.5,
        "huge": 10**9,
        "string": "2",
        "bool": True,
        "none": None,
        "tensor": torch.tensor(2),
    }


def _bad_mask(shape: tuple[int, ...]) -> dict[str, object]:
    m = torch.ones(*shape, dtype=torch.bool)
    return {
        "int": m.long(),
        "float": m.float(),
        "wrong shape": m[:-1],
        "transposed": m.T if m.dim() == 2 else m[None],
        "all false": torch.zeros_like(m),
        "one row false": _set(m.long(), (0,) * 1, 0).bool()
        if m.dim() == 1
        else torch.cat([torch.zeros_like(m[:1]), m[1:]]),
        "meta": m.to("meta"),
        "list": m.tolist(),
    }


def _bad_ids(n: int) -> dict[str, object]:
    ids = torch.arange(n)
    return {
        "float": ids.float(),
        "bool": ids > 2,
        "short": ids[:-1],
        "2-d": ids[:, None],
        "list": ids.tolist(),
        "meta": ids.to("meta"),
        "none-ok": None,
    }


def _bad_strings(choices: tuple[str, ...]) -> dict[str, object]:
    return {"unknown": "bogus", "upper": choices[0].upper(), "none": None, "int": 1}


# ------------------------------------------------------------------ entry points


@dataclass
class Entry:
    """``call(**kwargs)`` with valid ``base`` kwargs; ``bad`` maps an argument to its
    bad values; ``names`` are the words an error about that argument may use."""

    call: Callable[..., Any]
    base: Callable[[], dict[str, Any]]
    bad: dict[str, dict[str, object]]
    names: dict[str, tuple[str, ...]]
    # arguments whose errors must name them (or ``names``): not some other argument
    strict: tuple[str, ...] = ()


def _pair() -> dict[str, Any]:
    return {"audio": _emb(B, DIM, seed=1), "text": _emb(B, DIM, seed=2)}


def _multi() -> dict[str, Any]:
    mask = torch.ones(B, K, dtype=torch.bool)
    mask[0, 2] = mask[3, 1] = False
    return {"audio": _emb(B, DIM, seed=1), "text": _emb(B, K, DIM, seed=2), "mask": mask}


def _entries() -> dict[str, Entry]:
    a2, t3 = _emb(B, DIM), _emb(B, K, DIM)
    emb2 = _bad_embeddings(a2)
    emb3 = _bad_embeddings(t3)
    emb3.update({"K 0": t3[:, :0], "K mismatch mask": t3[:, :2]})
    mask2 = _bad_mask((B, K))
    red = {"reduction": _bad_strings(("mean", "sum", "none"))}
    temp = {"temperature": _bad_scalars()}
    e: dict[str, Entry] = {}

    def f_info(audio, text, temperature=0.1, ids=None, reduction="mean"):
        return CF.info_nce(audio, text, temperature, ids=ids, reduction=reduction)

    e["functional.info_nce"] = Entry(
        f_info,
        _pair,
        {"audio": emb2, "text": emb2, "ids": _bad_ids(B), **temp, **red},
        {},
    )

    def f_siglip(audio, text, scale=10.0, bias=-10.0, ids=None):
        return CF.siglip(audio, text, scale, bias, ids=ids)

    e["functional.siglip"] = Entry(
        f_siglip,
        _pair,
        {
            "audio": emb2,
            "text": emb2,
            "scale": _bad_scalars(),
            "bias": _bad_scalars(positive=False),
            "ids": _bad_ids(B),
        },
        {},
    )

    def f_kcl(audio, text, mask=None, temperature=0.1, negatives="per_language"):
        return CF.kcl(audio, text, temperature, mask=mask, negatives=negatives)

    e["functional.kcl"] = Entry(
        f_kcl,
        _multi,
        {
            "audio": emb2,
            "text": emb3,
            "mask": mask2,
            "negatives": _bad_strings(("per_language",)),
            **temp,
        },
        {},
    )

    def f_kcl_all(audio, text, mask=None):
        return CF.kcl(audio, text, 0.1, mask=mask, negatives="all_languages")

    e["functional.kcl(all_languages)"] = Entry(
        f_kcl_all, _multi, {"audio": emb2, "text": emb3, "mask": mask2}, {}
    )

    def f_cacl(audio, text, other=None, temperature=0.1):
        return CF.cacl(audio, text, _emb(B, DIM, seed=3) if other is None else other, temperature)

    e["functional.cacl"] = Entry(
        f_cacl,
        _pair,
        {"audio": emb2, "text": emb2, "other": emb2, **temp},
        {"text": ("english",)},
    )

    e["functional.l2_normalize"] = Entry(
        lambda x: CF.l2_normalize(x), lambda: {"x": _emb(B, DIM)}, {"x": emb2}, {}
    )

    def f_sample(mask, english_index=0):
        return CF.sample_languages(mask, generator=_g(), english_index=english_index)

    e["functional.sample_languages"] = Entry(
        f_sample,
        lambda: {"mask": torch.ones(B, K, dtype=torch.bool)},
        {"mask": mask2, "english_index": _bad_ints(0)},
        {"mask": ("mask_or_num_languages",)},
    )

    def f_svt(anchor, candidates, radius=0.2, temperature=0.1, mask=None):
        return CF.support_vector_term(anchor, candidates, radius, temperature, mask=mask)

    e["functional.support_vector_term"] = Entry(
        f_svt,
        lambda: {"anchor": _emb(B, DIM, seed=1), "candidates": _emb(B, DIM, seed=2)},
        {
            "anchor": emb2,
            "candidates": emb2,
            "radius": _bad_scalars(positive=False),
            "mask": _bad_mask((B,)),
            **temp,
        },
        {},
    )

    # ask() takes the retrieved bank pairs, (B, K, 2, D): [..., 0, :] audio, [..., 1, :] text.
    # The defaults are built only for an argument the case leaves alone (a bad value,
    # None included, is passed as is).
    def f_ask(
        audio,
        text,
        fine_audio=_DEFAULT,
        fine_text=_DEFAULT,
        epsilon=0.05,
        injection_ratio=0.2,
        temperature=0.07,
    ):
        fa = _emb(B, K, 2, DIM, seed=7) if fine_audio is _DEFAULT else fine_audio
        ft = _emb(B, K, 2, DIM, seed=8) if fine_text is _DEFAULT else fine_text
        return CF.ask(
            audio,
            text,
            fa,
            ft,
            epsilon=epsilon,
            injection_ratio=injection_ratio,
            temperature=temperature,
        )

    emb_k = _bad_embeddings(_emb(B, K, 2, DIM, seed=7))
    emb_k.update({"K 0": emb_k["non-contiguous"][:, :0], "not pairs": _emb(B, K, 3, DIM)})
    e["functional.ask"] = Entry(
        f_ask,
        _pair,
        {
            "audio": emb2,
            "text": emb2,
            "fine_audio": emb_k,
            "fine_text": emb_k,
            "epsilon": _bad_scalars(),
            "injection_ratio": _bad_scalars(positive=False),
            "temperature": {**_bad_scalars(), "1e-30": 1e-30, "1e-45": 1e-45},
        },
        {},
    )

    def f_sinkhorn(scores, epsilon=0.05):
        return CF.sinkhorn(scores, epsilon)

    e["functional.sinkhorn"] = Entry(
        f_sinkhorn,
        lambda: {"scores": _emb(B, B)},
        {"scores": emb2, "epsilon": _bad_scalars()},
        {},
    )

    # Modules
    def m_info(audio, text, temperature=0.1):
        return InfoNCELoss(temperature)(audio, text)

    e["InfoNCELoss"] = Entry(m_info, _pair, {"audio": emb2, "text": emb2, **temp}, {})

    def m_siglip(audio, text, scale_init=10.0):
        return SigLIPLoss(scale_init)(audio, text)

    e["SigLIPLoss"] = Entry(
        m_siglip, _pair, {"audio": emb2, "text": emb2, "scale_init": _bad_scalars()}, {}
    )

    def m_kcl(audio, text, mask=None, max_logit_scale=100.0):
        return KCLLoss(0.1, max_logit_scale=max_logit_scale)(audio, text, mask)

    e["KCLLoss"] = Entry(
        m_kcl,
        _multi,
        {"audio": emb2, "text": emb3, "mask": mask2, "max_logit_scale": _bad_scalars()},
        {},
    )

    def m_cacl(audio, text, mask=None, english_index=0, other=None):
        loss = CACLLoss(0.1, english_index=english_index)
        return loss(audio, text, other, mask=mask, generator=_g())

    e["CACLLoss"] = Entry(
        m_cacl,
        _multi,
        {
            "audio": emb2,
            "text": emb3,
            "mask": mask2,
            "english_index": _bad_ints(0),
            "other": _bad_ids(B),
        },
        {"other": ("other",)},
        # the (B, K, D) form: an error about text names text, not english or mask
        strict=("text",),
    )

    def m_svr(audio, text, alpha=1.0, radius="dynamic"):
        return SupportVectorRegularizer(InfoNCELoss(0.1), radius=radius, alpha=alpha)(audio, text)

    e["SupportVectorRegularizer"] = Entry(
        m_svr,
        _pair,
        {
            "audio": emb2,
            "text": emb2,
            "alpha": _bad_scalars(positive=False),
            "radius": {**_bad_scalars(positive=False), "unknown": "bogus"},
        },
        {},
    )

    def m_svr_kcl(audio, text, mask=None):
        return SupportVectorRegularizer(KCLLoss(0.1), radius=0.1)(audio, text, mask)

    e["SupportVectorRegularizer(KCL)"] = Entry(
        m_svr_kcl, _multi, {"audio": emb2, "text": emb3, "mask": mask2}, {}
    )

    def m_radius(similarities, offset=0, mask=None):
        return RadiusPredictor(num_features=4)(similarities, offset, mask)

    e["RadiusPredictor"] = Entry(
        m_radius,
        lambda: {"similarities": _emb(B, B).tanh()},
        {
            "similarities": emb2,
            "offset": _bad_ints(0),
            "mask": {**_bad_mask((B,)), "numpy": torch.ones(B, dtype=torch.bool).numpy()},
        },
        {},
    )

    def m_ask(audio, text, ids=None, k=2, temperature=0.07):
        return ASKLoss(_bank(), k=k, k_coarse=1, temperature=temperature)(
            audio, text, torch.arange(B) if ids is None else ids
        )

    e["ASKLoss"] = Entry(
        m_ask,
        _pair,
        {
            "audio": emb2,
            "text": emb2,
            "ids": _bad_ids(B),
            "k": _bad_ints(1),
            "temperature": {**_bad_scalars(), "1e-30": 1e-30, "1e-45": 1e-45},
        },
        {},
    )

    # Metrics
    def r_at_k(sim, k=1):
        return M.recall_at_k(sim, k=k)

    e["metrics.recall_at_k"] = Entry(
        r_at_k, lambda: {"sim": _emb(B, B)}, {"sim": emb2, "k": _bad_ints(1)}, {}
    )

    def map_k(sim, k=3):
        return M.map_at_k(sim, k=k)

    e["metrics.map_at_k"] = Entry(
        map_k, lambda: {"sim": _emb(B, B)}, {"sim": emb2, "k": _bad_ints(1)}, {}
    )

    e["metrics.retrieval_ranks"] = Entry(
        lambda sim: M.retrieval_ranks(sim), lambda: {"sim": _emb(B, B)}, {"sim": emb2}, {}
    )

    def atr(audio, text):
        return M.audio_text_retrieval(audio, text, k=(1, 5), map_k=5)

    e["metrics.audio_text_retrieval"] = Entry(
        atr,
        lambda: {"audio": _emb(B, DIM), "text": _emb(B, K, DIM)},
        {"audio": emb2, "text": emb3},
        {},
    )

    def gap(text, anchor=0):
        return M.embedding_gap(text, anchor)

    e["metrics.embedding_gap"] = Entry(
        gap, lambda: {"text": _emb(B, K, DIM)}, {"text": emb3, "anchor": _bad_ints(0)}, {}
    )

    def dis(text, anchor=0):
        return M.embedding_distance(text, anchor)

    e["metrics.embedding_distance"] = Entry(
        dis, lambda: {"text": _emb(B, K, DIM)}, {"text": emb3, "anchor": _bad_ints(0)}, {}
    )

    e["metrics.mean_rank_variance"] = Entry(
        lambda ranks: M.mean_rank_variance(ranks),
        lambda: {"ranks": torch.randint(1, 6, (B, K), generator=_g())},
        {"ranks": {**emb2, "zero rank": torch.zeros(B, K, dtype=torch.long)}},
        {},
    )

    # Diagnostics
    def forces(anchor, candidates, temperature=0.1):
        return D.force_decomposition(anchor, candidates, temperature)

    e["diagnostics.force_decomposition"] = Entry(
        forces,
        lambda: {"anchor": _emb(B, DIM, seed=1), "candidates": _emb(B, DIM, seed=2)},
        {"anchor": emb2, "candidates": emb2, **temp},
        {},
    )

    def drift(update, pull, eps=1e-12):
        return D.trajectory_drift(update, pull, eps=eps)

    e["diagnostics.trajectory_drift"] = Entry(
        drift,
        lambda: {"update": _emb(B, DIM, seed=1), "pull": _emb(B, DIM, seed=2)},
        {"update": emb2, "pull": emb2, "eps": _bad_scalars()},
        {},
    )

    def rdm(current, stale):
        return D.representation_drift_mismatch(current, stale)

    e["diagnostics.representation_drift_mismatch"] = Entry(
        rdm,
        lambda: {"current": _emb(B, DIM, seed=1), "stale": _emb(B, DIM, seed=2)},
        {"current": emb2, "stale": emb2},
        {},
    )

    # Bank
    def build(audio_emb, text_emb, ids=None):
        kb = KnowledgeBank(dim=DIM, backend="torch", num_prototypes=2)
        return kb.build(audio_emb, text_emb, torch.arange(B) if ids is None else ids).audio

    e["KnowledgeBank.build"] = Entry(
        build,
        lambda: {"audio_emb": _emb(B, DIM, seed=1), "text_emb": _emb(B, DIM, seed=2)},
        {"audio_emb": emb2, "text_emb": emb2, "ids": _bad_ids(B)},
        {},
    )

    def search(queries, k=2, exclude_ids=None):
        return _bank().search(queries, k, exclude_ids=exclude_ids)

    e["KnowledgeBank.search"] = Entry(
        search,
        lambda: {"queries": _emb(B, DIM, seed=1)},
        {"queries": emb2, "k": _bad_ints(1), "exclude_ids": _bad_ids(B)},
        {},
    )

    def protos(queries, k=1):
        return _bank().search_prototypes(queries, k)

    e["KnowledgeBank.search_prototypes"] = Entry(
        protos,
        lambda: {"queries": _emb(B, DIM, seed=1)},
        {"queries": emb2, "k": _bad_ints(1)},
        {},
    )

    def load(key, value):
        state = dict(_bank().state_dict(), **{key: value})
        return KnowledgeBank(dim=DIM, backend="torch").load_state_dict(state).audio

    bad_state = _bad_embeddings(_emb(12, DIM))
    e["KnowledgeBank.load_state_dict"] = Entry(
        lambda audio=None, ids=None: load(*(("audio", audio) if ids is None else ("ids", ids))),
        lambda: {},
        {"audio": bad_state, "ids": _bad_ids(12)},
        {"audio": ("state['audio']",), "ids": ("state['ids']", "state['audio']")},
    )
    return e


# ------------------------------------------------------------------ the sweep


def _finite(out: object) -> bool:
    if isinstance(out, torch.Tensor):
        if out.device.type == "meta":  # no values: nothing was checked or computed
            return False
        if out.is_floating_point() or out.is_complex():
            return bool(torch.isfinite(out).all())
        return True
    if isinstance(out, float):
        return math.isfinite(out)
    if isinstance(out, dict):
        return all(_finite(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return all(_finite(v) for v in out)
    return True


def _grads_finite(out: object, kwargs: dict[str, Any]) -> bool:
    leaves = [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    loss = out[0] if isinstance(out, tuple) else out
    if not leaves or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return True
    loss.sum().backward()
    return all(v.grad is None or bool(torch.isfinite(v.grad).all()) for v in leaves)


def cases() -> Iterator[tuple[str, str, str, Entry, dict[str, Any]]]:
    for name, entry in _entries().items():
        for arg, values in entry.bad.items():
            for label, value in values.items():
                kwargs = entry.base()
                kwargs[arg] = value
                yield name, arg, label, entry, kwargs


def classify(arg: str, entry: Entry, kwargs: dict[str, Any]) -> tuple[str, str]:
    """One of ``"clear"``, ``"finite"``, ``"unclear"``, ``"crash"``, ``"silent"``."""
    # Embedding inputs are differentiable where a loss would train them.
    for key, v in list(kwargs.items()):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.device.type != "meta":
            if not v.requires_grad and v.is_leaf:
                kwargs[key] = v.detach().clone().requires_grad_()
    try:
        out = entry.call(**kwargs)
    except (ValueError, TypeError) as err:
        names = (arg, *entry.names.get(arg, ()))
        msg = str(err)
        named = any(re.search(rf"(^|\W){re.escape(n)}(\W|$)", msg) for n in names)
        # An argument whose bad value makes another one look wrong (a batch mismatch in
        # ``text`` reported by ``text``, a dtype clash named by both) still names one.
        other_ok = arg not in entry.strict and _names_any(msg, kwargs)
        return ("clear" if named or other_ok else "unclear"), msg
    except Exception as err:  # the point is to catch everything
        return "crash", f"{type(err).__name__}: {err}"
    if not _finite(out):
        return "silent", "non-finite output"
    try:
        ok = _grads_finite(out, kwargs)
    except Exception as err:
        return "crash", f"backward {type(err).__name__}: {err}"
    return ("finite", "") if ok else ("silent", "non-finite gradient")


def _names_any(msg: str, kwargs: dict[str, Any]) -> bool:
    return any(re.match(rf"{re.escape(k)}\W", msg) for k in kwargs)


def run() -> tuple[Counter, list[tuple[str, str, str, str, str]]]:
    counts: Counter = Counter()
    bad: list[tuple[str, str, str, str, str]] = []
    for name, arg, label, entry, kwargs in cases():
        kind, msg = classify(arg, entry, kwargs)
        counts[kind] += 1
        counts[name, kind] += 1
        if kind in ("unclear", "crash", "silent"):
            bad.append((name, arg, label, kind, msg[:160]))
    return counts, bad


def test_adversarial_sweep():
    counts, bad = run()
    tried = sum(counts[k] for k in ("clear", "finite", "unclear", "crash", "silent"))
    assert tried >= 1000
    assert not bad, "\n".join(" | ".join(b) for b in bad)


if __name__ == "__main__":
    counts, bad = run()
    kinds = ("clear", "finite", "unclear", "crash", "silent")
    print("tried", sum(counts[k] for k in kinds), {k: counts[k] for k in kinds})
    for name in _entries():
        print(f"{name:45s}", {k: counts[name, k] for k in kinds if counts[name, k]})
    for b in bad:
        print(" | ".join(b))


# ------------------------------------------------------------------ issue 22
# Values never depend on a switch (validate_args, chunk_size); inputs whose logits or
# gradients overflow are refused by name; the library's messages survive torch.compile
# and name the argument that is wrong.


def _switch_configs() -> dict[str, Callable[..., torch.Tensor]]:
    """Every loss, dense and tiled: ``f(audio (B, D), text (B, K, D), validate_args)``."""

    def svr(base):
        torch.manual_seed(0)
        return SupportVectorRegularizer(base, radius="dynamic")

    out: dict[str, Callable[..., torch.Tensor]] = {}
    for cs in (None, 2):
        out[f"info_nce chunk={cs}"] = lambda a, t, v, cs=cs: CF.info_nce(
            a, t[:, 0], 0.1, chunk_size=cs, validate_args=v
        )
        out[f"siglip chunk={cs}"] = lambda a, t, v, cs=cs: CF.siglip(
            a, t[:, 0], chunk_size=cs, validate_args=v
        )
        for neg in ("per_language", "all_languages"):
            out[f"kcl {neg} chunk={cs}"] = lambda a, t, v, cs=cs, neg=neg: CF.kcl(
                a, t, 0.1, negatives=neg, chunk_size=cs, validate_args=v
            )
        out[f"cacl chunk={cs}"] = lambda a, t, v, cs=cs: CF.cacl(
            a, t[:, 0], t[:, 1], 0.1, chunk_size=cs, validate_args=v
        )
        out[f"support_vector_term chunk={cs}"] = lambda a, t, v, cs=cs: CF.support_vector_term(
            t[:, 0], a, 0.2, 0.1, chunk_size=cs, validate_args=v
        )
        out[f"SVR(KCLLoss) chunk={cs}"] = lambda a, t, v, cs=cs: svr(
            KCLLoss(chunk_size=cs, validate_args=v)
        )(a, t)
        out[f"SVR(InfoNCELoss) chunk={cs}"] = lambda a, t, v, cs=cs: svr(
            InfoNCELoss(chunk_size=cs, validate_args=v)
        )(a, t[:, 0])
    return out


def _value_and_grads(fn, a, t, validate):
    a, t = a.clone().requires_grad_(), t.clone().requires_grad_()
    loss = fn(a, t, validate)
    loss.backward()
    return loss.detach(), a.grad, t.grad


def test_issue22_values_do_not_depend_on_validate_args_or_chunk_size():
    """float32 rows of 1e-30 (valid: the checks accept them) gave NaN with the checks
    off in 42 of 44 configurations; now every configuration gives the value and the
    gradient of the same rows at scale 1 (the losses normalise), checks on or off, dense
    or tiled (the gradient scales by 1e30, the norm's reciprocal)."""
    a, t = _emb(B, DIM, seed=1), _emb(B, K, DIM, seed=2)
    configs = _switch_configs()
    ref = {}
    for name, fn in configs.items():
        ref[name] = _value_and_grads(fn, a.double(), t.double(), True)
        for validate in (True, False):
            for scale in (1.0, 1e-30):
                loss, ga, gt = _value_and_grads(fn, a * scale, t * scale, validate)
                case = f"{name} validate_args={validate} scale={scale:g}"
                torch.testing.assert_close(
                    loss.double(), ref[name][0], rtol=1e-5, atol=1e-6, msg=case
                )
                for g, g_ref in ((ga, ref[name][1]), (gt, ref[name][2])):
                    torch.testing.assert_close(
                        (g * scale).double(), g_ref, rtol=1e-4, atol=1e-5, msg=case
                    )
        # float64: the switches agree to 1e-10
        v64 = _value_and_grads(fn, a.double(), t.double(), False)
        for x, y in zip(v64, ref[name], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=name)


def _rows(value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((4, 8), value, dtype=dtype)


@pytest.mark.parametrize("chunk_size", [None, 2, 3])
@pytest.mark.parametrize(
    ("label", "x"),
    [
        ("float16 rows of 65504", _rows(65504.0, torch.float16)),
        ("float32 max", _rows(torch.finfo(torch.float32).max, torch.float32)),
        ("x 1e30", _emb(4, 8) * 1e30),
    ],
)
def test_issue22_normalize_false_logits_that_overflow_are_refused(label, x, chunk_size):
    """normalize=False: float16 rows of 65504 gave NaN dense, 4096 and 3840 tiled (the
    true value is log 4); float32-max and 1e30 rows gave NaN. Refused, naming both."""
    with pytest.raises(ValueError, match=r"^audio, text: with normalize=False their logits"):
        CF.info_nce(x, x, 1.0, normalize=False, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"^audio, text: with normalize=False"):
        CF.kcl(x, x[:, None], 1.0, normalize=False, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"^audio, text: with normalize=False"):
        CF.siglip(x, x, 1.0, 0.0, normalize=False, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"^audio, english: with normalize=False"):
        CF.cacl(x, x, x, 1.0, normalize=False, chunk_size=chunk_size)
    if x.dtype == torch.float16:  # computed in float32 inside, where these logits fit
        got = CF.support_vector_term(x, x, 0.1, 1.0, normalize=False, chunk_size=chunk_size)
        want = CF.support_vector_term(x.float(), x.float(), 0.1, 1.0, normalize=False)
        torch.testing.assert_close(got.float(), want, rtol=1e-3, atol=1e-3)
        return
    with pytest.raises(ValueError, match=r"^anchor, candidates: with normalize=False"):
        CF.support_vector_term(x, x, 0.1, 1.0, normalize=False, chunk_size=chunk_size)


def test_issue22_normalize_false_moderate_rows_agree_dense_and_tiled():
    """Rows whose logits fit (float16, norms near 10 at temperature 1): dense, tiled
    and float32 agree."""
    x = (_emb(6, 8) * 3).half()
    ref = CF.info_nce(x.float(), x.float(), 1.0, normalize=False)
    for cs in (None, 2, 3):
        got = CF.info_nce(x, x, 1.0, normalize=False, chunk_size=cs)
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_issue22_half_norm_guards():
    """A float16 anchor row of 6e-8 gave support_vector_term a NaN gradient (it skipped
    the float16 norm check); a bfloat16 row of 1e-38 an inf gradient in InfoNCELoss
    (reduction="none"): the gradient through the normalisation, over the norm, did not
    fit the dtype. Both refused by name; a row just inside the floor trains finitely."""
    anchor = _emb(4, 8).half()
    anchor[1] = 0
    anchor[1, 0] = 6e-8
    with pytest.raises(ValueError, match=r"^anchor: embedding at index \(1,\) has L2 norm"):
        CF.support_vector_term(anchor, _emb(4, 8, seed=3).half(), 0.1, 0.1)
    audio = _emb(4, 8).bfloat16()
    audio[1] = 0
    audio[1, 0] = 1e-38
    with pytest.raises(ValueError, match=r"^audio: embedding at index \(1,\) has L2 norm"):
        InfoNCELoss(reduction="none")(audio, _emb(4, 8, seed=3).bfloat16())
    audio[1, 0] = 1e-36
    audio.requires_grad_()
    InfoNCELoss(reduction="none")(audio, _emb(4, 8, seed=3).bfloat16()).sum().backward()
    assert torch.isfinite(audio.grad).all()


def test_issue22_cacl_empty_mask_rows_with_checks_off():
    """CACLLoss(validate_args=False) with an all-False mask raised torch's "invalid
    multinomial distribution"; now such a sample draws among the non-English languages
    (defined, finite), and with the checks on the mask is refused by name."""
    audio, text = _emb(4, 8), _emb(4, 3, 8, seed=2)
    empty = torch.zeros(4, 3, dtype=torch.bool)
    loss = CACLLoss(validate_args=False)(audio, text, mask=empty, generator=_g(0))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"^mask: sample\(s\) \[0, 1, 2, 3\] have no present"):
        CACLLoss()(audio, text, mask=empty)


def test_issue22_the_wrong_argument_is_named():
    a, e, o = _emb(4, 8), _emb(4, 8, seed=2), _emb(4, 8, seed=3)
    with pytest.raises(ValueError, match=r"^english: expected shape \(B, D\)"):
        CACLLoss()(a, e.reshape(-1), o)
    with pytest.raises(ValueError, match=r"^similarities: shape \(5, 4\) has B = 5 rows"):
        RadiusPredictor(4)(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"^offset: rows 2..6 exceed the 6 columns"):
        RadiusPredictor(4)(torch.randn(5, 6), offset=2)


# One bad value of each kind a static check catches (with the checks off too).
_STATIC = ("1-d", "D mismatch", "int64", "unknown", "wrong shape", "int", "short", "float")


def _compile_specs() -> dict[str, tuple[Callable[..., Any], Callable[[], dict[str, Any]], dict]]:
    """Every loss: ``(callable, valid kwargs, {argument: bad values})`` for the compile
    sweep."""
    emb2 = _bad_embeddings(_emb(B, DIM))
    emb3 = _bad_embeddings(_emb(B, K, DIM))
    red = _bad_strings(("mean", "sum", "none"))
    pair_bad = {"audio": emb2, "text": emb2}

    def triplet(first: str = "english") -> Callable[[], dict[str, Any]]:
        return lambda: {
            "audio": _emb(B, DIM),
            first: _emb(B, DIM, seed=2),
            "other": _emb(B, DIM, seed=3),
        }

    def svt() -> dict[str, Any]:  # (radius given: without it every case was its TypeError)
        return {"anchor": _emb(B, DIM), "candidates": _emb(B, DIM, seed=2), "radius": 0.1}

    def ask() -> dict[str, Any]:
        return {
            **_pair(),
            "fine_audio": _emb(B, K, 2, DIM, seed=7),
            "fine_text": _emb(B, K, 2, DIM, seed=8),
        }

    def svr_module() -> SupportVectorRegularizer:
        torch.manual_seed(0)
        return SupportVectorRegularizer(InfoNCELoss(), radius="dynamic")

    mask = _bad_mask((B, K))
    cacl_bad = {"audio": emb2, "english": emb2, "other": emb2}
    return {
        "info_nce": (CF.info_nce, _pair, {**pair_bad, "reduction": red, "ids": _bad_ids(B)}),
        "siglip": (CF.siglip, _pair, {**pair_bad, "reduction": red}),
        "kcl": (
            CF.kcl,
            _multi,
            {"audio": emb2, "text": emb3, "mask": mask, "negatives": _bad_strings(("a",))},
        ),
        "cacl": (CF.cacl, triplet(), {**cacl_bad, "reduction": red}),
        "support_vector_term": (CF.support_vector_term, svt, {"anchor": emb2, "candidates": emb2}),
        "ask": (CF.ask, ask, pair_bad),
        "InfoNCELoss": (InfoNCELoss(), _pair, pair_bad),
        "SigLIPLoss": (SigLIPLoss(), _pair, pair_bad),
        "KCLLoss": (KCLLoss(), _multi, {"audio": emb2, "text": emb3, "mask": mask}),
        "CACLLoss": (
            CACLLoss(),
            triplet("english_or_text"),
            {"audio": emb2, "english_or_text": emb2, "other": emb2},
        ),
        "SupportVectorRegularizer": (svr_module(), _pair, pair_bad),
        "RadiusPredictor": (
            RadiusPredictor(4),
            lambda: {"similarities": _emb(B, B)},
            {"similarities": emb2},
        ),
    }


def _raised(fn: Callable[..., Any], kwargs: dict[str, Any]) -> BaseException | None:
    try:
        fn(**kwargs)
    except Exception as err:  # the point is to see what comes out
        return err
    return None


@pytest.mark.slow
def test_issue22_static_errors_survive_torch_compile():
    """Every loss and argument, one bad value of each kind a static check catches (the
    checks that run with validate_args off and under compile): compiled with
    ``fullgraph=True`` dynamo reports any exception leaving the graph as ``Unsupported``
    ("Observed exception"), and its message must carry the library's own text, the same
    as eager (the argument named included). Before, a shape formatted with ``str()``
    failed to trace ("Failed to trace builtin operator str") and the text was lost.
    (Without ``fullgraph`` dynamo falls back to eager there: the library's error itself,
    see the next test.)"""
    import torch._dynamo

    seen = 0
    cl.set_default_validate_args(False)
    try:
        for name, (fn, base, bad) in _compile_specs().items():
            for arg, values in bad.items():
                for label in _STATIC:
                    if label not in values:
                        continue
                    kwargs = base()
                    kwargs[arg] = values[label]
                    eager = _raised(fn, kwargs)
                    if not isinstance(eager, (ValueError, TypeError)):
                        continue  # valid, or caught by a value check only
                    seen += 1
                    torch._dynamo.reset()
                    err = _raised(torch.compile(fn, backend="eager", fullgraph=True), kwargs)
                    case = f"{name}({arg}={label}): eager {eager!r}, compiled {err!r}"
                    assert err is not None, case
                    if type(err) is not type(eager):
                        assert type(err).__name__ == "Unsupported", case
                    text = str(err)
                    assert str(eager) in text or repr(str(eager))[1:-1] in text, case
    finally:
        cl.set_default_validate_args(True)
        torch._dynamo.reset()
    assert seen >= 60, seen


@pytest.mark.parametrize("fullgraph", [False, True])
def test_issue22_a_bad_shape_after_a_good_compiled_call(fullgraph):
    """The recompile for a new shape used to lose the message (``str`` of a symbolic
    size); ``siglip(..., reduction="avg")`` gave "Observed exception" alone."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        fn = torch.compile(CF.info_nce, backend="eager", fullgraph=fullgraph)
        fn(_emb(4, 8), _emb(4, 8, seed=2))
        want = r"text: embedding dim D 6 does not match audio's 8"
        with pytest.raises(Exception, match=want) as info:
            fn(_emb(4, 8), _emb(4, 6, seed=2))
        assert fullgraph or info.type is ValueError
        fn = torch.compile(KCLLoss(), backend="eager", fullgraph=fullgraph)
        fn(_emb(4, 8), _emb(4, 2, 8, seed=2))
        with pytest.raises(Exception, match=r"text: expected shape \(B, K, D\), got 2-d"):
            fn(_emb(5, 8), _emb(5, 8, seed=2))
        fn = torch.compile(CF.siglip, backend="eager", fullgraph=fullgraph)
        with pytest.raises(Exception, match=r"reduction: expected one of \['mean', 'sum'"):
            fn(_emb(4, 8), _emb(4, 8, seed=2), reduction="avg")
    finally:
        torch._dynamo.reset()
