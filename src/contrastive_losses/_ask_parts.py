"""The parts of the ASK loss (:func:`~contrastive_losses.ask.ask`): its hyperparameters
and their checks, knowledge injection (:func:`inject`, Eq. 8), the reliability weights
and knowledge potential (:func:`reliability`, Eq. 10-12, 16), the checks of the retrieved
knowledge, the Sinkhorn re-alignment (Eq. 14), the modulation (Eq. 15, 17, 18) and the
``terms``.

Private: :mod:`contrastive_losses.ask` imports from here and re-exports :func:`inject`
and :func:`reliability`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._checks import (
    _shape,
    check_embeddings,
    check_int,
    check_materialised,
    check_non_negative,
    check_positive,
    check_reduction,
    check_row_norms,
    check_same_device_dtype,
    check_same_size,
)
from ._common import _temperature
from .ot import EXP_MAX_RANGE, sinkhorn

GRANULARITIES = ("fine", "coarse")
DIRECTIONS = ("t2a", "a2t")


class _Hparams(NamedTuple):
    """The hyperparameters of :func:`~contrastive_losses.ask.ask`, in the order
    :func:`_check_hparams` takes them; :class:`~contrastive_losses.ASKLoss` holds them as
    attributes of these names."""

    injection_ratio: float
    ot_weight: float
    lambda_fine: float
    lambda_coarse: float
    epsilon: float
    temperature: float
    sinkhorn_iters: int
    detach_plan: bool
    normalize: bool
    reduction: str


def _check_ratio(value: float, name: str) -> None:
    check_non_negative(value, name)
    if value > 1:
        raise ValueError(f"{name}: must be in [0, 1], got {value}")


def _check_bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _check_hparams(
    injection_ratio: float,
    ot_weight: float,
    lambda_fine: float,
    lambda_coarse: float,
    epsilon: float,
    temperature: float,
    sinkhorn_iters: int,
    detach_plan: bool,
    normalize: bool,
    reduction: str,
) -> None:
    """Hyperparameters shared by :func:`ask` and :class:`ASKLoss`; errors name the argument."""
    _check_ratio(injection_ratio, "injection_ratio")
    _check_ratio(ot_weight, "ot_weight")
    check_non_negative(lambda_fine, "lambda_fine")
    check_non_negative(lambda_coarse, "lambda_coarse")
    # F lies in [-1, 1] for unit embeddings, so 1 + lambda_f F_f + lambda_c F_c > 0 needs
    # lambda_f + lambda_c < 1: a larger sum can make the modulation negative and turn
    # minimising the loss into maximising the contrastive term.
    if lambda_fine + lambda_coarse >= 1:
        raise ValueError(
            f"lambda_fine + lambda_coarse: must be below 1 so that the modulation "
            f"1 + lambda_f F_f + lambda_c F_c stays positive (F lies in [-1, 1]), got "
            f"{lambda_fine} + {lambda_coarse}"
        )
    check_positive(epsilon, "epsilon")
    _temperature(temperature)  # the library's floor, 1e-4: 1e-30 gave a loss of 6e29
    check_int(sinkhorn_iters, "sinkhorn_iters", 1)
    _check_bool(detach_plan, "detach_plan")
    _check_bool(normalize, "normalize")
    check_reduction(reduction)


def inject(x: Tensor, knowledge: Tensor, injection_ratio: float) -> Tensor:
    r"""Knowledge injection (Eq. 8): interpolate each embedding with the mean of its knowledge.

    .. math::

        x'_i = (1 - \rho)\, x_i + \rho\, \frac1K \sum_{l=1}^{K} \kappa_{il}

    with :math:`\rho` the share of knowledge (Eq. 8 as printed puts :math:`\rho` on
    :math:`x_i`; Appendix A, Eq. 19, on the knowledge — see the docs). No re-normalisation.

    Args:
        x: embeddings ``(B, D)``.
        knowledge: the rows retrieved for each embedding, ``(B, K, D)``.
        injection_ratio: :math:`\rho \in [0, 1]`.

    Shape:
        - x: ``(B, D)``; knowledge: ``(B, K, D)``; output: ``(B, D)``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import inject
        >>> x, kn = torch.tensor([[1.0, 0.0]]), torch.tensor([[[0.0, 1.0], [0.0, 3.0]]])
        >>> inject(x, kn, injection_ratio=0.5)
        tensor([[0.5000, 1.0000]])
    """
    return (1.0 - injection_ratio) * x + injection_ratio * knowledge.mean(dim=1)


def reliability(anchor: Tensor, partners: Tensor, retrieved: Tensor) -> tuple[Tensor, Tensor]:
    r"""Reliability weights (Eq. 10-11) and log knowledge potential (Eq. 12) of one direction.

    Text-to-audio: ``anchor`` = :math:`u_i`, ``partners`` = the audios
    :math:`u^{k'}_j` of the pairs retrieved by the text, ``retrieved`` = the audios
    :math:`\mathcal U_r = \{u^k_l\}` retrieved by the audio:

    .. math::

        \bar s_j = \frac1K \sum_{l} \langle u^{k'}_j, u^k_l \rangle,\qquad
        w_j = \operatorname{softmax}_j(\bar s),\qquad
        \Psi_i = \sum_j w_j\, e^{\langle u_i, u^{k'}_j \rangle}.

    Audio-to-text is the same call with :math:`v_i`, the captions of the audio-retrieved
    pairs and the text-retrieved texts. The weights are constants (no gradient);
    :math:`\log\Psi_i` is differentiable in ``anchor`` and ``partners`` and computed as a
    log-sum-exp, so it never overflows. No temperature, as printed.

    Args:
        anchor: :math:`u_i` ``(B, D)``.
        partners: :math:`u^{k'}_j` ``(B, K, D)``.
        retrieved: :math:`u^k_l` ``(B, L, D)``.

    Returns:
        ``(log_psi, weights)``: :math:`\log\Psi_i` ``(B,)`` and :math:`w` ``(B, K)``.

    Shape:
        - anchor: ``(B, D)``; partners: ``(B, K, D)``; retrieved: ``(B, L, D)``
        - output: ``(B,)`` and ``(B, K)``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import reliability
        >>> u = torch.tensor([[1.0, 0.0]])
        >>> partners = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])   # agrees / disagrees
        >>> retrieved = torch.tensor([[[1.0, 0.0]]])
        >>> log_psi, w = reliability(u, partners, retrieved)
        >>> w
        tensor([[0.7311, 0.2689]])
    """
    with torch.no_grad():
        # mean_l <u'_j, u_l> = <u'_j, mean_l u_l>: one (B, K) product instead of (B, K, L)
        s = torch.einsum("bkd,bd->bk", partners.detach(), retrieved.detach().mean(dim=1))
        log_w = s.log_softmax(dim=-1)  # (B, K)
    sims = torch.einsum("bd,bkd->bk", anchor, partners)  # (B, K)
    return (log_w + sims).logsumexp(dim=-1), log_w.exp()


# Knowledge rows are used as given; a KnowledgeBank stores unit rows. Up to this norm the
# injected similarities stay below 1e8 and their logits and Sinkhorn exponents finite in
# float32; beyond it the rows are no embeddings of the space (products overflow at ~1e19).
MAX_KNOWLEDGE_NORM = 1e4


def _check_knowledge(
    t: Tensor | None, name: str, ref: Tensor, validate: bool = True
) -> Tensor | None:
    if t is None:
        return None
    t = check_embeddings(t, name, ndim=4, dims="(B, K, 2, D)", min_batch=1, check_values=False)
    # Knowledge is never normalised here, so zero rows are fine; one norm pass (one host
    # sync) finds NaN/Inf and oversized rows alike (the comparison is False for NaN).
    check_materialised(t, name)
    norms_ok = validate and bool(
        (torch.linalg.vector_norm(t.detach(), dim=-1) <= MAX_KNOWLEDGE_NORM).all()
    )
    if validate and not norms_ok:
        norms = check_row_norms(t, name, nonzero=False)  # raises on NaN/Inf
        raise ValueError(
            f"{name}: a knowledge row has L2 norm {float(norms.max()):.3g}, above "
            f"{MAX_KNOWLEDGE_NORM:g} (a KnowledgeBank stores unit rows; rows this large "
            "overflow the similarities)"
        )
    check_same_size(ref, "audio", t, name, 0, "batch size B")
    check_same_size(ref, "audio", t, name, -1, "embedding dim D")
    if t.shape[1] == 0:
        raise ValueError(f"{name}: K = 0 knowledge pairs (shape {_shape(t)})")
    if t.shape[2] != 2:
        raise ValueError(
            f"{name}: expected (audio, text) pairs on dim 2, shape (B, K, 2, D), got {_shape(t)}"
        )
    if t.device != ref.device:
        raise ValueError(f"{name}: on device {t.device} but audio is on {ref.device}")
    if t.dtype != ref.dtype:  # no silent cast; ASKLoss.retrieve returns the queries' dtype
        raise TypeError(
            f"{name}: dtype {t.dtype} differs from audio's {ref.dtype}; pass the knowledge "
            "in the queries' dtype (ASKLoss casts the bank's rows to it)"
        )
    return t


def _plans(plan: Tensor | None, n: int, b: int) -> list[Tensor | None]:
    """One ``(B, B)`` plan per granularity from ``plan`` of shape ``(B, B)`` or ``(n, B, B)``."""
    if plan is None:
        return [None] * n
    if tuple(plan.shape) == (b, b):
        return [plan] * n
    if tuple(plan.shape) == (n, b, b):
        return list(plan.unbind(0))
    raise ValueError(f"plan: expected shape ({b}, {b}) or ({n}, {b}, {b}), got {_shape(plan)}")


def _checked_pair(audio: object, text: object, validate: bool = True) -> tuple[Tensor, Tensor]:
    """The batch's ``(B, D)`` audio and text, checked as a pair (values with ``validate``)."""
    audio = check_embeddings(audio, "audio", ndim=2, dims="(B, D)", check_values=validate)
    text = check_embeddings(text, "text", ndim=2, dims="(B, D)", check_values=validate)
    check_same_size(audio, "audio", text, "text", 0, "batch size B")
    check_same_size(audio, "audio", text, "text", 1, "embedding dim D")
    check_same_device_dtype([(audio, "audio"), (text, "text")])
    return audio, text


def _retrieval_pairs(
    audio: Tensor,
    fine_audio: Tensor | None,
    fine_text: Tensor | None,
    coarse_audio: Tensor | None,
    coarse_text: Tensor | None,
    cdt: torch.dtype,
    validate: bool = True,
) -> dict[str, tuple[Tensor, Tensor]]:
    """The retrieved knowledge pairs of each granularity present, checked and cast to the
    compute dtype ``cdt``: ``g -> (pairs retrieved by the audio, by the text)``, each
    ``(B, K, 2, D)``; fine always, coarse when both its tensors are given."""
    if fine_audio is None or fine_text is None:
        raise ValueError(
            "fine_audio, fine_text: both are required (the fine granularity is always used); "
            f"got {type(fine_audio).__name__} and {type(fine_text).__name__}"
        )
    if (coarse_audio is None) != (coarse_text is None):
        raise ValueError(
            f"coarse_audio, coarse_text: pass both or neither (got "
            f"{type(coarse_audio).__name__} and {type(coarse_text).__name__})"
        )
    sources: dict[str, tuple[Tensor, Tensor]] = {}
    for g, ka, kt in (("fine", fine_audio, fine_text), ("coarse", coarse_audio, coarse_text)):
        ka = _check_knowledge(ka, f"{g}_audio", audio, validate)
        kt = _check_knowledge(kt, f"{g}_text", audio, validate)
        if ka is not None and kt is not None:
            sources[g] = (ka.to(cdt), kt.to(cdt))
    return sources


def _potentials(
    u: Tensor, v: Tensor, u_partner: Tensor, u_ret: Tensor, v_partner: Tensor, v_ret: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""One granularity's potentials (Eq. 16) from its reliability (Eq. 10-12):
    :math:`F^{t\to a} = \operatorname{mean}_i -\log\Psi^{t\to a}_i`, :math:`F^{a\to t}`
    likewise, and the mean entropy of the reliability weights of both directions."""
    log_psi_t2a, w_t2a = reliability(u, u_partner, u_ret)  # Eq. 10-12
    log_psi_a2t, w_a2t = reliability(v, v_partner, v_ret)
    potential_t2a = -log_psi_t2a.mean()  # Eq. 16
    potential_a2t = -log_psi_a2t.mean()
    entropy = 0.5 * (
        torch.special.entr(w_t2a).sum(-1).mean() + torch.special.entr(w_a2t).sum(-1).mean()
    )
    return potential_t2a, potential_a2t, entropy


def _realignment(
    sim: Tensor,
    q: Tensor | None,
    eye: Tensor,
    ot_weight: float,
    epsilon: float,
    sinkhorn_iters: int,
    detach_plan: bool,
    method: str = "auto",
) -> Tensor:
    r"""The re-alignment matrix of Eq. 14, :math:`A_g = (1-\beta) I + \beta B Q_g` (rows
    sum to 1), with :math:`Q_g` the given plan ``q`` or the Sinkhorn plan of
    :math:`S_g` = ``sim`` (its ``method`` as in :func:`~contrastive_losses.ot.sinkhorn`,
    whose value checks run only with ``"auto"``); ``eye`` itself when there is no
    transport."""
    if q is None and ot_weight > 0:
        q = sinkhorn(
            sim.detach() if detach_plan else sim,
            epsilon,
            max_iter=sinkhorn_iters,
            method=method,
            validate_args=method == "auto",
        )
    if q is None:
        return eye
    b = sim.shape[0]
    return (1.0 - ot_weight) * eye + (ot_weight * b) * q.to(eye.dtype)  # Eq. 14


def _modulated_loss(
    ce: dict[tuple[str, str], Tensor],
    potential: dict[tuple[str, str], Tensor],
    granularities: list[str],
    lambdas: dict[str, float],
    zero: Tensor,
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """Per direction the cross-entropies summed over the granularities (Eq. 15) and the
    modulation by the potentials (Eq. 17); the per-sample loss, their mean (Eq. 18)."""
    per_dir: dict[str, Tensor] = {}
    modulation: dict[str, Tensor] = {}
    for d in DIRECTIONS:
        per_dir[d] = sum(ce[g, d] for g in granularities)  # type: ignore[assignment]  # Eq. 15
        modulation[d] = 1.0 + sum(
            (lambdas[g] * potential[g, d] for g in granularities), zero
        )  # Eq. 17
    per_sample = 0.5 * (
        modulation["t2a"] * per_dir["t2a"] + modulation["a2t"] * per_dir["a2t"]
    )  # Eq. 18
    return per_dir, modulation, per_sample


def _ask_terms(
    ce: dict[tuple[str, str], Tensor],
    potential: dict[tuple[str, str], Tensor],
    per_dir: dict[str, Tensor],
    modulation: dict[str, Tensor],
    entropy: dict[str, Tensor],
    zero: Tensor,
) -> dict[str, Tensor]:
    """The detached ``terms`` of :func:`ask`; an absent granularity gives 0 (NaN entropy)."""
    nan = zero.new_full((), float("nan"))
    terms: dict[str, Tensor] = {}
    for g in GRANULARITIES:
        for d in DIRECTIONS:
            terms[f"ce_{g}_{d}"] = ce[g, d].mean() if (g, d) in ce else zero
    for d in DIRECTIONS:
        terms[f"loss_{d}"] = per_dir[d].mean()
    terms["contrastive"] = 0.5 * (terms["loss_t2a"] + terms["loss_a2t"])
    for g in GRANULARITIES:
        for d in DIRECTIONS:
            terms[f"potential_{g}_{d}"] = potential.get((g, d), zero)
    for d in DIRECTIONS:
        terms[f"modulation_{d}"] = modulation[d]
    for g in GRANULARITIES:
        terms[f"weight_entropy_{g}"] = entropy.get(g, nan)
    return {k: t.detach() for k, t in terms.items()}


def _static_sinkhorn_method(audio: Tensor, normalize: bool, epsilon: float) -> str:
    """Sinkhorn's method chosen without reading the scores (no value checks): ``"exp"``
    on CPU when ``(max S - min S) / epsilon <= 200`` follows from the arguments, i.e.
    ``normalize`` with knowledge rows of norm at most 1 (``|S| <= 1``), else ``"log"``."""
    bounded = normalize and 2.0 / epsilon <= EXP_MAX_RANGE
    return "exp" if audio.device.type == "cpu" and bounded else "log"
