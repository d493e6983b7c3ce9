r"""ASK: knowledge injection, reliability-aware potentials and Sinkhorn re-alignment.

Guo et al., "ASK: Adaptive Self-improving Knowledge Framework for Audio Text Retrieval"
(arXiv 2512.19703), Sections 4.2-4.5 and Appendix C. :func:`ask` is the pure function on
tensors (the knowledge already retrieved); :class:`ASKLoss` holds a
:class:`~contrastive_losses.bank.KnowledgeBank`, retrieves from it and calls :func:`ask`.

Notation (per sample :math:`i` of a batch of :math:`B`, granularity
:math:`g \in \{\text{fine}, \text{coarse}\}`): :math:`u_i, v_i` the L2-normalised audio
and text embeddings. The knowledge of a granularity is two sets of bank *pairs*:

* retrieved by the audio (audio-audio similarity to :math:`u_i`): the audios
  :math:`\mathcal U_r = \{u^k_l\}` and their captions :math:`\{v^{k'}_l\}`;
* retrieved by the text (text-text similarity to :math:`v_i`): the texts
  :math:`\{v^k_j\}` and their audios :math:`\{u^{k'}_j\}`.

Fine pairs are bank entries, coarse pairs are prototypes (the m-th audio and m-th text
prototype are partners).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _compat
from ._checks import (
    _shape,
    check_embeddings,
    check_ids,
    check_int,
    check_materialised,
    check_non_negative,
    check_positive,
    check_reduction,
    check_row_norms,
    check_same_device_dtype,
    check_same_size,
    resolve_validate,
)
from ._common import (
    TEMPERATURE_HABIT,
    _habit_told,
    _resolve_temperature,
    _scale_setting,
    _temperature,
)
from ._docs import init_doc
from ._warnings import told, warn_at_caller
from .bank import KnowledgeBank
from .distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    counted_call,
    resolve_gather,
    validate_together,
)
from .ot import EXP_MAX_RANGE, sinkhorn

__all__ = ["ASKLoss", "ask", "inject", "reliability"]

GRANULARITIES = ("fine", "coarse")
DIRECTIONS = ("t2a", "a2t")


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


@_compat.autocast_off
def ask(
    audio: Tensor,
    text: Tensor,
    fine_audio: Tensor,
    fine_text: Tensor,
    coarse_audio: Tensor | None = None,
    coarse_text: Tensor | None = None,
    *,
    injection_ratio: float = 0.2,
    ot_weight: float = 0.2,
    lambda_fine: float = 0.2,
    lambda_coarse: float = 0.3,
    epsilon: float = 0.05,
    temperature: float = 0.07,
    logit_scale: Tensor | None = None,
    sinkhorn_iters: int = 50,
    detach_plan: bool = True,
    plan: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    return_terms: bool = False,
    validate_args: bool | None = None,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    r"""ASK loss on one batch (Eq. 8-18), given the knowledge pairs retrieved for it.

    For each granularity :math:`g` present (fine, and coarse if given):

    1. **Injection** (Eq. 8), :func:`inject`: one enhanced pair per granularity,
       :math:`u'_{i,g} = (1-\rho)u_i + \rho\,\operatorname{mean}_l u^k_l` from the audios
       retrieved by the audio, :math:`v'_{i,g}` likewise from the texts retrieved by the
       text.
    2. **Potentials** (Eq. 10-12, 16), :func:`reliability`:
       :math:`F^{t\to a}_g = \frac1B\sum_i -\log\Psi^{t\to a}_{i,g}` and
       :math:`F^{a\to t}_g` likewise; differentiable in :math:`u_i, v_i` (the weights
       :math:`w` are constants). :math:`F` can be negative (:math:`\Psi > 1` whenever
       the weighted similarities are positive).
    3. **Re-alignment** (Eq. 14, App. C): :math:`S_g = u'_g v'^\top_g`,
       :math:`Q_g = \text{sinkhorn}(S_g, \epsilon)` (uniform marginals, detached by default),
       :math:`A_g = (1-\beta) I + \beta B Q_g` (rows sum to 1) and the logits
       :math:`A_g S_g/\tau` (audio to text), :math:`A_g^\top S_g^\top/\tau` (text to audio).
    4. **Loss** (Eq. 15, 17, 18): per direction the sum over granularities of the
       cross-entropies with the diagonal as target, modulated by that direction's potentials:

       .. math::

           \mathcal L^*_{t\to a} = \big(1 + \lambda_f F^{t\to a}_{\text{fine}}
               + \lambda_c F^{t\to a}_{\text{coarse}}\big)
               \sum_g \mathrm{CE}\big(A_g^\top S_g^\top/\tau\big),
           \qquad
           \mathcal L = \tfrac12\big(\mathcal L^*_{t\to a} + \mathcal L^*_{a\to t}\big).

    Without coarse knowledge only the fine terms remain. With ``injection_ratio=0``,
    ``ot_weight=0``, ``lambda_fine=0`` and fine knowledge only this is the symmetric
    InfoNCE loss. The arithmetic runs in float32 (or float64) whatever the input dtype;
    the loss is returned in the input dtype.

    Args:
        audio: audio embeddings ``(B, D)``.
        text: text embeddings ``(B, D)``; pair ``i`` is ``(audio[i], text[i])``.
        fine_audio: the ``K`` bank pairs retrieved by audio-audio similarity,
            ``(B, K, 2, D)``: ``[..., 0, :]`` the bank audios :math:`u^k_l`,
            ``[..., 1, :]`` their captions :math:`v^{k'}_l`.
        fine_text: the ``K`` bank pairs retrieved by text-text similarity,
            ``(B, K, 2, D)``: ``[..., 0, :]`` the audio partners :math:`u^{k'}_j`,
            ``[..., 1, :]`` the bank texts :math:`v^k_j`.
        coarse_audio, coarse_text: the same with prototype pairs, ``(B, Kc, 2, D)``, or
            ``None`` (both). All knowledge has the dtype and device of ``audio``.
        injection_ratio: :math:`\rho \in [0, 1]`, share of knowledge in the injected embedding.
        ot_weight: :math:`\beta \in [0, 1]`, share of the transported similarities.
        lambda_fine: :math:`\lambda_f \ge 0`; lambda_coarse: :math:`\lambda_c \ge 0`, with
            :math:`\lambda_f + \lambda_c < 1` so that the modulation stays positive.
        epsilon: Sinkhorn regularisation, in cosine-similarity units.
        temperature: :math:`\tau \ge 10^{-4}` of the logits (the potentials have none,
            as printed).
        logit_scale: the model's exp'd scale :math:`1/\tau` as a 0-d tensor, used
            instead of ``temperature`` (leave that at its default), with gradient.
        sinkhorn_iters: Sinkhorn iterations.
        detach_plan: treat :math:`Q_g` as a constant (no gradient through the iterations).
        plan: use this plan instead of computing it (tests, diagnostics): ``(B, B)`` for
            every granularity, or ``(G, B, B)``, fine first.
        normalize: L2-normalise ``audio`` and ``text`` first (knowledge is used as given;
            a :class:`~contrastive_losses.bank.KnowledgeBank` stores unit rows).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``: per sample,
            :math:`\tfrac12\big(m^{t\to a}\sum_g \mathrm{CE}^{t\to a}_{g,i}
            + m^{a\to t}\sum_g \mathrm{CE}^{a\to t}_{g,i}\big)` with the batch-level
            modulations :math:`m`; its mean is the loss.
        return_terms: also return a dict of detached parts.
        validate_args: the value checks (NaN/Inf and zero embeddings, oversized
            knowledge rows, and Sinkhorn's: host syncs) on, off or ``None`` (the global
            default, :func:`contrastive_losses.set_default_validate_args`). Off (or under
            ``torch.compile``) Sinkhorn runs in the exp domain on CPU when
            ``normalize`` and ``epsilon >= 0.01`` (its bound holds for unit embeddings
            and knowledge rows of norm at most 1, as a
            :class:`~contrastive_losses.bank.KnowledgeBank` stores), else in the log
            domain; no host sync.

    Returns:
        The loss, or ``(loss, terms)`` with batch means ``ce_{g}_{d}`` (each cross-entropy,
        ``g`` in fine/coarse, ``d`` in t2a/a2t), ``loss_t2a``, ``loss_a2t`` (their sums over
        ``g``), ``contrastive`` (the unmodulated mean of the two), ``potential_{g}_{d}``
        (:math:`F`), ``modulation_t2a``, ``modulation_a2t`` and ``weight_entropy_{g}``
        (mean entropy of the reliability weights :math:`w`, both directions). An absent
        coarse granularity contributes ``0`` to its ``ce`` and ``potential`` terms; its
        ``weight_entropy`` is NaN.

    Shape:
        - audio, text: ``(B, D)``
        - fine_audio, fine_text: ``(B, K, 2, D)``; coarse_audio, coarse_text: ``(B, Kc, 2, D)``
        - output: scalar, or ``(B,)`` with ``reduction="none"``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import ask
        >>> g = torch.Generator().manual_seed(0)
        >>> a, t = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        >>> fa, ft = torch.randn(4, 3, 2, 8, generator=g), torch.randn(4, 3, 2, 8, generator=g)
        >>> loss, terms = ask(a, t, fa, ft, return_terms=True)
        >>> loss.shape, float(terms["ce_coarse_t2a"])
        (torch.Size([]), 0.0)
    """
    validate = resolve_validate(validate_args)
    audio, text = _checked_pair(audio, text, validate)
    _check_hparams(
        injection_ratio, ot_weight, lambda_fine, lambda_coarse, epsilon, temperature,
        sinkhorn_iters, detach_plan, normalize, reduction,
    )  # fmt: skip
    scale_or_temperature: float | Tensor = temperature
    if logit_scale is not None:
        scale_or_temperature = _resolve_temperature(temperature, logit_scale, audio, validate)
    # float16/bfloat16 inputs: all arithmetic in float32 (exp, log-sum-exp, Sinkhorn).
    cdt = torch.promote_types(audio.dtype, torch.float32)
    sources = _retrieval_pairs(
        audio, fine_audio, fine_text, coarse_audio, coarse_text, cdt, validate
    )
    method = "auto" if validate else _static_sinkhorn_method(audio, normalize, epsilon)

    b = audio.shape[0]
    u, v = audio.to(cdt), text.to(cdt)
    if normalize:
        u, v = F.normalize(u, dim=-1), F.normalize(v, dim=-1)
    plans = _plans(plan, len(sources), b)
    eye = torch.eye(b, dtype=cdt, device=u.device)
    target = torch.arange(b, device=u.device)
    ce: dict[tuple[str, str], Tensor] = {}  # (granularity, direction) -> (B,)
    potential: dict[tuple[str, str], Tensor] = {}  # -> scalar F
    entropy: dict[str, Tensor] = {}
    for (g, (ka, kt)), q in zip(sources.items(), plans, strict=True):
        u_ret, v_partner = ka[:, :, 0], ka[:, :, 1]  # retrieved by the audio
        u_partner, v_ret = kt[:, :, 0], kt[:, :, 1]  # retrieved by the text
        potential[g, "t2a"], potential[g, "a2t"], entropy[g] = _potentials(
            u, v, u_partner, u_ret, v_partner, v_ret
        )
        sim = inject(u, u_ret, injection_ratio) @ inject(v, v_ret, injection_ratio).T  # S_g
        mix = _realignment(sim, q, eye, ot_weight, epsilon, sinkhorn_iters, detach_plan, method)
        tau = scale_or_temperature
        ce[g, "a2t"] = F.cross_entropy((mix @ sim) / tau, target, reduction="none")
        ce[g, "t2a"] = F.cross_entropy((sim @ mix).T / tau, target, reduction="none")

    zero = u.new_zeros(())
    lambdas = {"fine": lambda_fine, "coarse": lambda_coarse}
    per_dir, modulation, per_sample = _modulated_loss(ce, potential, list(sources), lambdas, zero)
    out = (
        per_sample.mean()
        if reduction == "mean"
        else per_sample.sum()
        if reduction == "sum"
        else per_sample
    )
    loss = out.to(audio.dtype)
    if not return_terms:
        return loss
    return loss, _ask_terms(ce, potential, per_dir, modulation, entropy, zero)


# The ASKLoss attributes that must be the same on every rank under gather.
_AGREED = (
    "k",
    "k_coarse",
    "use_coarse",
    "injection_ratio",
    "ot_weight",
    "lambda_fine",
    "lambda_coarse",
    "epsilon",
    "temperature",
    "sinkhorn_iters",
    "detach_plan",
    "normalize",
    "reduction",
)


def _search_backend(bank: KnowledgeBank, device: torch.device) -> str:
    """What searches ``bank`` for queries on ``device``: ``"torch"``, or faiss and its
    index (faiss and torch find other neighbours among near-ties; an IVF index misses
    some): ranks that differ compute different losses (1.3% apart in issue 33)."""
    if not bank._uses_faiss(device):
        return "torch"
    if bank.index_type == "ivf":
        return f"faiss ivf (nlist={bank.nlist}, nprobe={bank.nprobe})"
    return f"faiss {bank.index_type}"


@init_doc
class ASKLoss(nn.Module):
    r"""ASK loss with retrieval from a :class:`~contrastive_losses.bank.KnowledgeBank`.

    For each batch: normalise; for each audio the ``k`` bank pairs whose audio is nearest
    to it, for each text the ``k`` pairs whose text is nearest (rows with the sample's own
    id excluded); the same with the ``k_coarse`` nearest prototype pairs; then :func:`ask`
    (Eq. 8-18):

    .. math::

        \mathcal{L} = \tfrac12\sum_{d \in \{t\to a,\, a\to t\}}
        \big(1 + \lambda_f F^{d}_{\text{fine}} + \lambda_c F^{d}_{\text{coarse}}\big)
        \sum_{g} \mathrm{CE}^{d}\big(((1-\beta)I + \beta BQ_g)\,S_g / \tau\big)

    with :math:`S_g` the similarities of the granularity's knowledge-injected embeddings
    and :math:`F^d_g` its potentials. Retrieval runs without gradient; the knowledge is a
    constant for the encoders. The bank is held by reference (not a submodule, not in
    ``state_dict``); refresh it with :meth:`KnowledgeBank.refresh` every
    ``bank.refresh_every`` epochs. Every hyperparameter is validated here, at construction.

    Args:
        bank: a :class:`KnowledgeBank` whose ``dim`` matches the embeddings.
        k: fine neighbours per sample (ASK: 10).
        injection_ratio: see :func:`ask`; likewise ``ot_weight``, ``lambda_fine``,
            ``lambda_coarse``, ``epsilon``, ``temperature``, ``sinkhorn_iters``,
            ``detach_plan``, ``normalize`` and ``reduction``.
        k_coarse: prototypes per sample (ASK: "an identical procedure", so 10). If the
            bank built fewer prototypes (k-means drops empty clusters), all of them are
            used, with a warning.
        use_coarse: use the prototypes (the bank must have some).
        validate_args: the value checks of :func:`ask` and of the batch on, off or
            ``None`` (the global default,
            :func:`contrastive_losses.set_default_validate_args`); under gather, off
            also means no joint check across ranks and equal batch sizes on every rank.
            The bank search reads the batch back to the host (faiss) either way.
        gather: all-gather across ranks (``None``: when ``torch.distributed`` runs with
            more than one rank). Every rank then evaluates the loss of the global batch —
            Sinkhorn couples all its pairs — and gradients flow back to the owning ranks;
            the mean over ranks equals the single-process loss. ``reduction="none"``
            returns this rank's samples.

    Shape:
        - audio, text: ``(B, D)``; ids: ``(B,)`` integer dataset ids
        - output: scalar, or ``(B,)`` with ``reduction="none"``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import ASKLoss
        >>> from contrastive_losses.bank import KnowledgeBank
        >>> g = torch.Generator().manual_seed(0)
        >>> kb = KnowledgeBank(8, backend="torch", num_prototypes=12)
        >>> kb = kb.build(torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g),
        ...               torch.arange(50))
        >>> loss_fn = ASKLoss(kb, k=5)
        >>> a = torch.randn(6, 8, generator=g, requires_grad=True)
        >>> loss = loss_fn(a, torch.randn(6, 8, generator=g), ids=torch.arange(6))
        >>> loss.backward(); a.grad.shape
        torch.Size([6, 8])
    """

    def __init__(
        self,
        bank: KnowledgeBank,
        k: int = 10,
        injection_ratio: float = 0.2,
        ot_weight: float = 0.2,
        lambda_fine: float = 0.2,
        lambda_coarse: float = 0.3,
        epsilon: float = 0.05,
        temperature: float = 0.07,
        *,
        k_coarse: int = 10,
        use_coarse: bool = True,
        sinkhorn_iters: int = 50,
        detach_plan: bool = True,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
        validate_args: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(bank, KnowledgeBank):
            raise TypeError(f"bank: expected a KnowledgeBank, got {type(bank).__name__}")
        check_int(k, "k", 1)
        check_int(k_coarse, "k_coarse", 1)
        _check_bool(use_coarse, "use_coarse")
        _check_hparams(
            injection_ratio, ot_weight, lambda_fine, lambda_coarse, epsilon, temperature,
            sinkhorn_iters, detach_plan, normalize, reduction,
        )  # fmt: skip
        if gather is not None:
            _check_bool(gather, "gather")
        resolve_validate(validate_args)  # the type
        self.bank = bank
        self.k = k
        self.k_coarse = k_coarse
        self.use_coarse = use_coarse
        self.injection_ratio = injection_ratio
        self.ot_weight = ot_weight
        self.lambda_fine = lambda_fine
        self.lambda_coarse = lambda_coarse
        self.epsilon = epsilon
        self.temperature = temperature
        self.sinkhorn_iters = sinkhorn_iters
        self.detach_plan = detach_plan
        self.normalize = normalize
        self.reduction = reduction
        self.gather = gather
        self.validate_args = validate_args

    def retrieve(self, audio: Tensor, text: Tensor, ids: Tensor) -> dict[str, Tensor | None]:
        """The knowledge :func:`ask` takes: ``fine_audio``, ``fine_text`` ``(B, k, 2, D)``
        and ``coarse_audio``, ``coarse_text`` ``(B, k_coarse, 2, D)`` (or ``None``).

        ``fine_audio[i]`` are the (audio, text) bank pairs whose *audio* is nearest to
        ``audio[i]``, ``fine_text[i]`` those whose *text* is nearest to ``text[i]``. The
        search runs without gradient; the rows are gathered from the bank tensors, so
        they carry a gradient only if those tensors require one (see
        :func:`~contrastive_losses.diagnostics.out_of_batch_influence`). They are cast to
        the queries' device and dtype (the bank's ``dtype`` is a storage choice; :func:`ask`
        takes knowledge in the queries' dtype only)."""
        bank = self.bank
        if bank.is_empty:
            raise ValueError(
                "bank: the knowledge bank is empty; call bank.build() or bank.refresh() first"
            )
        if audio.shape[-1] != bank.dim:
            raise ValueError(
                f"audio: embedding dim {audio.shape[-1]} does not match the bank's dim {bank.dim} "
                f"(shape {_shape(audio)})"
            )
        k_coarse = 0
        if self.use_coarse:
            n_protos = bank.num_built_prototypes
            if n_protos == 0:
                raise ValueError(
                    "bank: has no prototypes; build it with num_prototypes > 0 or pass "
                    "use_coarse=False"
                )
            k_coarse = min(self.k_coarse, n_protos)
            if k_coarse < self.k_coarse:
                warn_at_caller(
                    "k_coarse",
                    f"k_coarse: {self.k_coarse} exceeds the bank's {n_protos} prototypes; "
                    f"using {n_protos}",
                )
        out: dict[str, Tensor | None] = {"coarse_audio": None, "coarse_text": None}
        for modality, x in (("audio", audio), ("text", text)):
            with torch.no_grad():
                q = F.normalize(x.detach().float(), dim=-1)
                _, rows = bank.search(q, self.k, modality, exclude_ids=ids)  # (B, k)
                protos = bank.search_prototypes(q, k_coarse, modality)[1] if k_coarse else None
            # Gather outside no_grad: a bank tensor that requires grad (diagnostics) gets one.
            out[f"fine_{modality}"] = self._pairs(bank.audio, bank.text, rows, x)
            if protos is not None:
                out[f"coarse_{modality}"] = self._pairs(
                    bank.prototype_audio, bank.prototype_text, protos, x
                )
        return out

    @staticmethod
    def _pairs(audio_table: Tensor, text_table: Tensor, rows: Tensor, like: Tensor) -> Tensor:
        """``(B, k, 2, D)``: the (audio, text) pairs at ``rows``, on ``like``'s device."""
        rows = rows.to(audio_table.device)
        pairs = torch.stack([audio_table[rows], text_table[rows]], dim=2)
        return pairs.to(like.device, like.dtype)

    @counted_call
    @_compat.autocast_off
    def forward(
        self,
        audio: Tensor,
        text: Tensor,
        ids: Tensor | None = None,
        return_terms: bool = False,
        *,
        logit_scale: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        r"""The loss of one batch: retrieve its knowledge from the bank, then :func:`ask`.

        Args:
            audio: audio embeddings ``(B, D)``.
            text: text embeddings ``(B, D)``; pair ``i`` is ``(audio[i], text[i])``.
            ids: the dataset ids ``(B,)`` of the pairs (required): a sample never
                retrieves itself (or its caption siblings) from the bank.
            return_terms: also return the detached terms of :func:`ask`.
            logit_scale: the model's exp'd scale :math:`1/\tau`, a 0-d tensor, used
                instead of ``temperature``, with gradient.

        Returns:
            The loss, a scalar (``(B,)`` with ``reduction="none"``), or ``(loss, terms)``.
        """
        enabled = resolve_gather(self.gather)
        validate = resolve_validate(self.validate_args)
        # Under gather a check failing on one rank is raised on every rank (no rank is left
        # waiting in the gather); the global batch needs 2 samples, a rank 1.
        with validate_together(enabled, audio, validate=validate) as v:
            audio = check_embeddings(
                audio,
                "audio",
                ndim=2,
                dims="(B, D)",
                min_batch=v.min_batch,
                check_values=validate,
            )
            text = check_embeddings(
                text, "text", ndim=2, dims="(B, D)", min_batch=v.min_batch, check_values=validate
            )
            if audio.shape[0] == 0:
                raise ValueError(
                    "audio: batch size 0 on this rank; ASKLoss needs a sample on every rank "
                    "(each rank searches the bank with its own samples)"
                )
            check_same_size(audio, "audio", text, "text", 0, "batch size B")
            check_same_size(audio, "audio", text, "text", 1, "embedding dim D")
            if ids is None:
                raise ValueError(
                    "ids: required; pass the dataset id of each pair so that a sample never "
                    "retrieves itself (or its caption siblings) from the bank"
                )
            ids = check_ids(ids, "ids", audio.shape[0], audio)
            knowledge: dict[str, Any] = self.retrieve(audio, text, ids)
            v.batch = audio.shape[0]
            # The knowledge is gathered too: its dtype and (k, 2, D) shapes must agree.
            present = {key: x for key, x in knowledge.items() if x is not None}
            v.agree(audio=audio, text=text, **present)
            coarse = knowledge["coarse_audio"]
            v.settings(
                **{k: getattr(self, k) for k in _AGREED},
                **({} if logit_scale is None else _scale_setting(1.0, logit_scale)),
                # min(k_coarse, the bank's prototypes): banks of 3 and 5 prototypes differ
                k_coarse_effective=0 if coarse is None else coarse.shape[1],
                bank_backend=_search_backend(self.bank, audio.device),
            )
        audio, text = v.ordered(audio, text)  # gathered only after the ranks' exchange
        knowledge = dict(zip(knowledge, v.ordered(*knowledge.values()), strict=True))
        b, offset = audio.shape[0], 0
        if enabled:
            # Sinkhorn couples every pair of the batch, so each rank evaluates the loss of
            # the global batch (cheap next to the encoders) and its gradient reaches the
            # owners through the gather; the mean over ranks is the single-process loss.
            audio, offset = all_gather_with_grad(audio, equal_sizes=not validate)
            text, _ = all_gather_with_grad(text, equal_sizes=not validate)
            knowledge = {
                key: None
                if value is None
                else all_gather_no_grad(value.detach(), equal_sizes=not validate)
                for key, value in knowledge.items()
            }
        scale: dict[str, Any] = (
            {"temperature": self.temperature}
            if logit_scale is None
            else {"logit_scale": logit_scale}
        )
        # a temperature that warned when this Module was built does not warn per call
        quiet = _habit_told(self.temperature) and logit_scale is None
        with told(TEMPERATURE_HABIT) if quiet else contextlib.nullcontext():
            out = ask(
                audio,
                text,
                knowledge["fine_audio"],
                knowledge["fine_text"],
                knowledge["coarse_audio"],
                knowledge["coarse_text"],
                injection_ratio=self.injection_ratio,
                ot_weight=self.ot_weight,
                lambda_fine=self.lambda_fine,
                lambda_coarse=self.lambda_coarse,
                epsilon=self.epsilon,
                sinkhorn_iters=self.sinkhorn_iters,
                detach_plan=self.detach_plan,
                normalize=self.normalize,
                reduction=self.reduction,
                return_terms=return_terms,
                validate_args=validate,
                **scale,
            )
        if self.reduction != "none" or audio.shape[0] == b:
            return out
        # reduction="none" under gather: this rank's samples only.
        if isinstance(out, tuple):
            loss, terms = out
            return loss[offset : offset + b], terms
        return out[offset : offset + b]

    def extra_repr(self) -> str:
        return (
            f"k={self.k}, k_coarse={self.k_coarse}, injection_ratio={self.injection_ratio}, "
            f"ot_weight={self.ot_weight}, lambda_fine={self.lambda_fine}, "
            f"lambda_coarse={self.lambda_coarse}, epsilon={self.epsilon}, "
            f"temperature={self.temperature}, use_coarse={self.use_coarse}, "
            f"sinkhorn_iters={self.sinkhorn_iters}, detach_plan={self.detach_plan}, "
            f"normalize={self.normalize}, reduction={self.reduction!r}, gather={self.gather}, "
            f"validate_args={self.validate_args}, bank_size={len(self.bank)}"
        )
