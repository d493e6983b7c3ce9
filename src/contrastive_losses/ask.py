r"""ASK: knowledge injection, reliability weighting and Sinkhorn re-alignment.

Guo et al., "ASK: Adaptive Self-improving Knowledge Framework for Audio Text Retrieval"
(arXiv 2512.19703). :func:`ask` is the pure function on tensors (the knowledge already
retrieved); :class:`ASKLoss` holds a :class:`~contrastive_losses.bank.KnowledgeBank`,
retrieves from it and calls :func:`ask`.

Notation (per sample :math:`i` of a batch of :math:`B`, granularity
:math:`g \in \{\text{fine}, \text{coarse}\}`): :math:`u_i, v_i` the L2-normalised audio
and text embeddings; :math:`\kappa^{a,g}_i` the mean of the knowledge rows retrieved for
the audio (its ``K`` nearest bank audios, or nearest audio prototypes), and
:math:`\kappa^{t,g}_i` the same for the text.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import (
    _shape,
    check_embeddings,
    check_ids,
    check_int,
    check_non_negative,
    check_positive,
    check_reduction,
    check_same_device_dtype,
    check_same_size,
)
from .bank import KnowledgeBank
from .distributed import all_gather_no_grad, all_gather_with_grad, resolve_gather
from .ot import sinkhorn

__all__ = ["ASKLoss", "ask", "inject", "reliability"]


def _nt_xent_rows(logits: Tensor) -> Tensor:
    """Per-row cross-entropy with the diagonal as target, ``(B, B) -> (B,)``."""
    target = torch.arange(logits.shape[0], device=logits.device)
    return F.cross_entropy(logits, target, reduction="none")


def reliability(knowledge_audio: Tensor, knowledge_text: Tensor, temperature: float) -> Tensor:
    r"""Cross-modal consistency :math:`\Psi_i \in (0, 1]` of the knowledge of each pair.

    The knowledge retrieved for audio :math:`i` and for text :math:`i` should describe the
    same thing; :math:`\Psi_i` is the geometric mean of the probabilities that they pick
    each other out of the batch (ASK Eq. 10-12, our reading; see the module notes):

    .. math::

        r_{ij} = \frac{\langle \bar\kappa^a_i, \bar\kappa^t_j \rangle}{\tau},
        \qquad
        \Psi_i = \left(\frac{e^{r_{ii}}}{\sum_j e^{r_{ij}}}
                       \cdot \frac{e^{r_{ii}}}{\sum_j e^{r_{ji}}}\right)^{1/2},

    with :math:`\bar\kappa = \kappa / \lVert\kappa\rVert`. Computed without gradient.

    Args:
        knowledge_audio: :math:`\kappa^a`, ``(B, D)``.
        knowledge_text: :math:`\kappa^t`, ``(B, D)``.
        temperature: :math:`\tau`.

    Shape:
        - knowledge_audio, knowledge_text: ``(B, D)``
        - output: ``(B,)``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import reliability
        >>> k = torch.eye(3)
        >>> psi = reliability(k, k, temperature=0.07)
        >>> bool((psi > 0.99).all()), bool((reliability(k, k.roll(1, 0), 0.07) < 0.01).all())
        (True, True)
    """
    with torch.no_grad():
        ka = F.normalize(knowledge_audio.detach(), dim=-1)
        kt = F.normalize(knowledge_text.detach(), dim=-1)
        r = ka @ kt.T / temperature  # (B, B)
        log_psi = 0.5 * (r.log_softmax(dim=1).diagonal() + r.log_softmax(dim=0).diagonal())
        return log_psi.exp()


def inject(
    x: Tensor, knowledge: list[Tensor], weights: list[Tensor], injection_ratio: float
) -> Tensor:
    r"""Mix each embedding with its knowledge, each source weighted by its reliability.

    .. math::

        x'_i = \operatorname{normalize}\!\Big(x_i + \frac{\rho}{G}\sum_{g=1}^{G}
               \Psi^g_i\,(\kappa^g_i - x_i)\Big)

    i.e. :math:`\operatorname{normalize}((1-\rho)x_i + \rho\,\kappa_i)` for one fully
    reliable source (:math:`\rho` = share of knowledge, DESIGN §3).

    Args:
        x: normalised embeddings ``(B, D)``.
        knowledge: ``G`` tensors :math:`\kappa^g`, each ``(B, D)``.
        weights: ``G`` reliability vectors :math:`\Psi^g`, each ``(B,)``.
        injection_ratio: :math:`\rho`.

    Shape:
        - x: ``(B, D)``; output ``(B, D)``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import inject
        >>> x, kn = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> inject(x, [kn], [torch.ones(1)], injection_ratio=0.5)
        tensor([[0.7071, 0.7071]])
    """
    if not knowledge:
        return x
    delta = sum(w.unsqueeze(-1) * (kn - x) for kn, w in zip(knowledge, weights, strict=True))
    return F.normalize(x + (injection_ratio / len(knowledge)) * delta, dim=-1)


def _check_knowledge(t: Tensor | None, name: str, ref: Tensor) -> Tensor | None:
    if t is None:
        return None
    t = check_embeddings(t, name, ndim=3, dims="(B, K, D)", min_batch=1)
    check_same_size(ref, "audio", t, name, 0, "batch size B")
    check_same_size(ref, "audio", t, name, -1, "embedding dim D")
    if t.shape[1] == 0:
        raise ValueError(f"{name}: K = 0 knowledge rows (shape {_shape(t)})")
    return t


def ask(
    audio: Tensor,
    text: Tensor,
    fine_audio: Tensor | None,
    fine_text: Tensor | None,
    coarse_audio: Tensor | None = None,
    coarse_text: Tensor | None = None,
    *,
    injection_ratio: float = 0.2,
    ot_weight: float = 0.2,
    lambda_fine: float = 0.2,
    lambda_coarse: float = 0.3,
    epsilon: float = 0.05,
    temperature: float = 0.07,
    sinkhorn_iters: int = 50,
    detach_plan: bool = True,
    plan: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    return_terms: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    r"""ASK loss on one batch, given the knowledge retrieved for it.

    1. **Reliability** (Eq. 10-12) per granularity, :func:`reliability`:
       :math:`\Psi^g_i` from :math:`\kappa^{a,g}_i = \frac1K\sum_k` ``fine_audio[i, k]``
       and :math:`\kappa^{t,g}_i`.
    2. **Injection** (Eq. 8-9), :func:`inject`: :math:`u' = \text{inject}(u, \kappa^{a,\cdot},
       \Psi^\cdot)`, :math:`v' = \text{inject}(v, \kappa^{t,\cdot}, \Psi^\cdot)`.
    3. **Re-alignment** (Eq. 14): :math:`C = u' v'^\top`,
       :math:`Q = \text{sinkhorn}(C, \epsilon)` (uniform marginals, detached by default),
       :math:`A = (1-\beta) I + \beta B Q` (rows sum to 1) and

       .. math::

           S^{a \to t} = A\,\frac{C}{\tau}, \qquad S^{t \to a} = A^{\top} \frac{C^\top}{\tau}.

    4. **NT-Xent** both ways (Eq. 15):
       :math:`\ell_i = \tfrac12\big(\text{CE}(S^{a\to t}_{i\cdot}, i)
       + \text{CE}(S^{t\to a}_{i\cdot}, i)\big)`.
    5. **Potentials** (Eq. 16) :math:`F_g = \frac1B\sum_i -\log \Psi^g_i` and the
       **modulated total** (Eq. 17-18)

       .. math::

           \mathcal{L} = \big(1 + \lambda_f F_{\text{fine}} + \lambda_c F_{\text{coarse}}\big)
           \cdot \frac1B \sum_i \ell_i .

    Reliabilities and potentials are weights, computed without gradient. A granularity
    whose knowledge is ``None`` is skipped (its potential is 0). With no knowledge and
    ``ot_weight=0`` this is the symmetric InfoNCE loss.

    Args:
        audio: audio embeddings ``(B, D)``.
        text: text embeddings ``(B, D)``; pair ``i`` is ``(audio[i], text[i])``.
        fine_audio: bank audio rows retrieved for each audio, ``(B, K, D)``, or ``None``.
        fine_text: bank text rows retrieved for each text, ``(B, K, D)``, or ``None``.
        coarse_audio: audio prototypes retrieved for each audio, ``(B, Kc, D)``, or ``None``.
        coarse_text: text prototypes retrieved for each text, ``(B, Kc, D)``, or ``None``.
        injection_ratio: :math:`\rho`, share of knowledge in the injected embedding.
        ot_weight: :math:`\beta`, share of the transported similarities.
        lambda_fine: :math:`\lambda_f`; lambda_coarse: :math:`\lambda_c`.
        epsilon: Sinkhorn regularisation, in cosine-similarity units.
        temperature: :math:`\tau` of the logits and of the reliability.
        sinkhorn_iters: Sinkhorn iterations.
        detach_plan: treat :math:`Q` as a constant (no gradient through the iterations).
        plan: use this ``(B, B)`` plan instead of computing it (tests, diagnostics).
        normalize: L2-normalise ``audio`` and ``text`` first.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-sample modulated
            :math:`\ell_i`).
        return_terms: also return a dict of detached parts.

    Returns:
        The loss, or ``(loss, terms)`` with ``loss_a2t``, ``loss_t2a``, ``contrastive``
        (unmodulated mean), ``potential_fine``, ``potential_coarse``, ``modulation``,
        ``reliability_fine``, ``reliability_coarse`` (batch means; NaN if absent) and
        ``reliability`` (mean over the granularities present).

    Shape:
        - audio, text: ``(B, D)``
        - fine_audio, fine_text: ``(B, K, D)``; coarse_audio, coarse_text: ``(B, Kc, D)``
        - output: scalar, or ``(B,)`` with ``reduction="none"``

    Example:
        >>> import torch
        >>> from contrastive_losses.ask import ask
        >>> g = torch.Generator().manual_seed(0)
        >>> a, t = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        >>> fa, ft = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)
        >>> loss, terms = ask(a, t, fa, ft, return_terms=True)
        >>> loss.shape, sorted(terms)[:3]
        (torch.Size([]), ['contrastive', 'loss_a2t', 'loss_t2a'])
    """
    audio = check_embeddings(audio, "audio", ndim=2, dims="(B, D)")
    text = check_embeddings(text, "text", ndim=2, dims="(B, D)")
    check_same_size(audio, "audio", text, "text", 0, "batch size B")
    check_same_size(audio, "audio", text, "text", 1, "embedding dim D")
    check_same_device_dtype([(audio, "audio"), (text, "text")])
    check_non_negative(injection_ratio, "injection_ratio")
    if injection_ratio > 1:
        raise ValueError(f"injection_ratio: must be in [0, 1], got {injection_ratio}")
    check_non_negative(ot_weight, "ot_weight")
    if ot_weight > 1:
        raise ValueError(f"ot_weight: must be in [0, 1], got {ot_weight}")
    check_non_negative(lambda_fine, "lambda_fine")
    check_non_negative(lambda_coarse, "lambda_coarse")
    check_positive(temperature, "temperature")
    check_reduction(reduction)
    sources: dict[str, tuple[Tensor, Tensor]] = {}
    for g, ka, kt in (("fine", fine_audio, fine_text), ("coarse", coarse_audio, coarse_text)):
        if (ka is None) != (kt is None):
            raise ValueError(
                f"{g}_audio, {g}_text: pass both or neither (got {type(ka).__name__} "
                f"and {type(kt).__name__})"
            )
        ka = _check_knowledge(ka, f"{g}_audio", audio)
        kt = _check_knowledge(kt, f"{g}_text", audio)
        if ka is not None and kt is not None:
            sources[g] = (ka.mean(dim=1).to(audio.dtype), kt.mean(dim=1).to(audio.dtype))  # (B, D)

    b = audio.shape[0]
    u = F.normalize(audio, dim=-1) if normalize else audio
    v = F.normalize(text, dim=-1) if normalize else text
    psi = {g: reliability(ka, kt, temperature) for g, (ka, kt) in sources.items()}  # (B,)
    potentials = {g: -p.log().mean() for g, p in psi.items()}
    u_inj = inject(u, [ka for ka, _ in sources.values()], list(psi.values()), injection_ratio)
    v_inj = inject(v, [kt for _, kt in sources.values()], list(psi.values()), injection_ratio)

    cos = u_inj @ v_inj.T  # (B, B)
    if plan is None:
        if ot_weight > 0:
            plan = sinkhorn(cos.detach() if detach_plan else cos, epsilon, max_iter=sinkhorn_iters)
        else:
            plan = torch.zeros_like(cos)
    elif tuple(plan.shape) != (b, b):
        raise ValueError(f"plan: expected shape ({b}, {b}), got {_shape(plan)}")
    eye = torch.eye(b, dtype=cos.dtype, device=cos.device)
    mix = (1.0 - ot_weight) * eye + ot_weight * b * plan  # (B, B), rows sum to 1
    logits = cos / temperature
    loss_a2t = _nt_xent_rows(mix @ logits)  # (B,)
    loss_t2a = _nt_xent_rows(mix.T @ logits.T)  # (B,)
    per_sample = 0.5 * (loss_a2t + loss_t2a)
    zero = cos.new_zeros(())
    modulation = (
        1.0
        + lambda_fine * potentials.get("fine", zero)
        + lambda_coarse * potentials.get("coarse", zero)
    )
    out = modulation * per_sample
    loss = out.mean() if reduction == "mean" else out.sum() if reduction == "sum" else out
    if not return_terms:
        return loss
    nan = cos.new_full((), float("nan"))
    terms = {
        "loss_a2t": loss_a2t.mean(),
        "loss_t2a": loss_t2a.mean(),
        "contrastive": per_sample.mean(),
        "potential_fine": potentials.get("fine", zero),
        "potential_coarse": potentials.get("coarse", zero),
        "modulation": modulation,
        "reliability_fine": psi["fine"].mean() if "fine" in psi else nan,
        "reliability_coarse": psi["coarse"].mean() if "coarse" in psi else nan,
        "reliability": torch.stack([p.mean() for p in psi.values()]).mean() if psi else nan,
    }
    return loss, {k: t.detach() for k, t in terms.items()}


class ASKLoss(nn.Module):
    r"""ASK loss with retrieval from a :class:`~contrastive_losses.bank.KnowledgeBank`.

    For each batch: normalise, retrieve the ``k`` nearest bank audios of each audio and
    the ``k`` nearest bank texts of each text (rows with the sample's own id excluded),
    the ``k_coarse`` nearest prototypes of each, and evaluate :func:`ask`:

    .. math::

        \mathcal{L} = \big(1 + \lambda_f F_{\text{fine}} + \lambda_c F_{\text{coarse}}\big)
        \cdot \frac{1}{2B}\sum_i \Big[\text{CE}\big(((1-\beta)I + \beta BQ)\,S\big)_{i}
        + \text{CE}\big(((1-\beta)I + \beta BQ)^{\top} S^{\top}\big)_{i}\Big]

    with :math:`S` the similarities of the knowledge-injected embeddings. Retrieval runs
    without gradient; the knowledge is a constant for the encoders. The bank is held by
    reference (not a submodule, not in ``state_dict``); refresh it with
    :meth:`KnowledgeBank.refresh` every ``bank.refresh_every`` epochs.

    Args:
        bank: a built :class:`KnowledgeBank` whose ``dim`` matches the embeddings.
        k: fine neighbours per sample (ASK: 10).
        k_coarse: prototypes per sample.
        injection_ratio: see :func:`ask`; likewise ``ot_weight``, ``lambda_fine``,
            ``lambda_coarse``, ``epsilon``, ``temperature``, ``sinkhorn_iters``,
            ``detach_plan``, ``normalize`` and ``reduction``.
        use_coarse: use the prototypes (the bank must have some).
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
        >>> kb = KnowledgeBank(8, backend="torch", num_prototypes=4)
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
        k_coarse: int = 1,
        use_coarse: bool = True,
        sinkhorn_iters: int = 50,
        detach_plan: bool = True,
        normalize: bool = True,
        reduction: str = "mean",
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(bank, KnowledgeBank):
            raise TypeError(f"bank: expected a KnowledgeBank, got {type(bank).__name__}")
        for value, name in ((k, "k"), (k_coarse, "k_coarse"), (sinkhorn_iters, "sinkhorn_iters")):
            check_int(value, name, 1)
        check_positive(temperature, "temperature")
        check_positive(epsilon, "epsilon")
        check_reduction(reduction)
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

    def retrieve(self, audio: Tensor, text: Tensor, ids: Tensor) -> dict[str, Tensor | None]:
        """The knowledge :func:`ask` takes: ``fine_audio``, ``fine_text`` ``(B, k, D)`` and
        ``coarse_audio``, ``coarse_text`` ``(B, k_coarse, D)`` (or ``None``).

        The search runs without gradient; the rows are gathered from the bank tensors, so
        they carry a gradient only if those tensors require one (see
        :func:`~contrastive_losses.diagnostics.out_of_batch_influence`)."""
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
        if self.use_coarse and bank.num_built_prototypes == 0:
            raise ValueError(
                "bank: has no prototypes; build it with num_prototypes > 0 or pass use_coarse=False"
            )
        if self.use_coarse and self.k_coarse > bank.num_built_prototypes:
            raise ValueError(
                f"k_coarse: {self.k_coarse} exceeds the bank's "
                f"{bank.num_built_prototypes} prototypes"
            )
        out: dict[str, Tensor | None] = {"coarse_audio": None, "coarse_text": None}
        for modality, x in (("audio", audio), ("text", text)):
            with torch.no_grad():
                q = F.normalize(x.detach().float(), dim=-1)
                _, rows = bank.search(q, self.k, modality, exclude_ids=ids)  # (B, k)
                protos = (
                    bank.search_prototypes(q, self.k_coarse, modality)[1]
                    if self.use_coarse
                    else None
                )
            # Gather outside no_grad: a bank tensor that requires grad (diagnostics) gets one.
            table = bank.embeddings(modality)
            out[f"fine_{modality}"] = table[rows.to(table.device)].to(
                x.device, x.dtype
            )  # (B, k, D)
            if protos is not None:
                ptable = bank.prototypes(modality)
                out[f"coarse_{modality}"] = ptable[protos.to(ptable.device)].to(x.device, x.dtype)
        return out

    def forward(
        self, audio: Tensor, text: Tensor, ids: Tensor | None = None, return_terms: bool = False
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Loss for the batch; ``ids`` are the dataset ids (a sample never retrieves itself)."""
        audio = check_embeddings(audio, "audio", ndim=2, dims="(B, D)")
        text = check_embeddings(text, "text", ndim=2, dims="(B, D)")
        check_same_size(audio, "audio", text, "text", 0, "batch size B")
        if ids is None:
            raise ValueError(
                "ids: required; pass the dataset id of each pair so that a sample never "
                "retrieves itself (or its caption siblings) from the bank"
            )
        ids = check_ids(ids, "ids", audio.shape[0], audio)
        knowledge: dict[str, Any] = self.retrieve(audio, text, ids)
        b, offset = audio.shape[0], 0
        if resolve_gather(self.gather):
            # Sinkhorn couples every pair of the batch, so each rank evaluates the loss of
            # the global batch (cheap next to the encoders) and its gradient reaches the
            # owners through the gather; the mean over ranks is the single-process loss.
            audio, offset = all_gather_with_grad(audio)
            text, _ = all_gather_with_grad(text)
            knowledge = {
                key: None if value is None else all_gather_no_grad(value.detach())
                for key, value in knowledge.items()
            }
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
            temperature=self.temperature,
            sinkhorn_iters=self.sinkhorn_iters,
            detach_plan=self.detach_plan,
            normalize=self.normalize,
            reduction=self.reduction,
            return_terms=return_terms,
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
            f"temperature={self.temperature}, bank_size={len(self.bank)}"
        )
