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
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _compat
from ._ask_parts import (
    _ask_terms,
    _check_bool,
    _check_hparams,
    _checked_pair,
    _Hparams,
    _modulated_loss,
    _plans,
    _potentials,
    _realignment,
    _retrieval_pairs,
    _static_sinkhorn_method,
    inject,
    reliability,
)
from ._checks import (
    _shape,
    check_embeddings,
    check_ids,
    check_int,
    check_same_device_dtype,
    check_same_size,
    resolve_validate,
)
from ._common import TEMPERATURE_HABIT, _resolve_temperature, _scale_setting
from ._docs import init_doc
from ._settings import _habit_told
from ._warnings import told, warn_at_caller
from .bank import KnowledgeBank
from .distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    counted_call,
    resolve_gather,
    validate_together,
)

# inject, reliability and the other parts of the loss are defined in _ask_parts; import
# them from here.
__all__ = ["ASKLoss", "ask", "inject", "reliability"]


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
    hparams = _Hparams(
        injection_ratio, ot_weight, lambda_fine, lambda_coarse, epsilon, temperature,
        sinkhorn_iters, detach_plan, normalize, reduction,
    )  # fmt: skip
    knowledge = (fine_audio, fine_text, coarse_audio, coarse_text)
    return _checked_ask(audio, text, knowledge, hparams, logit_scale, plan, return_terms, validate)


# ask's default temperature, which the Module passes where the model's logit_scale replaces it.
_DEFAULT_TEMPERATURE = inspect.signature(ask).parameters["temperature"].default


def _checked_ask(
    audio: Tensor,
    text: Tensor,
    knowledge: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    hparams: _Hparams,
    logit_scale: Tensor | None,
    plan: Tensor | None,
    return_terms: bool,
    validate: bool,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """:func:`ask` on a pair already checked (by :func:`ask`, or by
    :meth:`ASKLoss.forward`, which checks its inputs once for the whole call); the
    knowledge ``(fine_audio, fine_text, coarse_audio, coarse_text)`` and the
    hyperparameters are checked here."""
    _check_hparams(*hparams)
    (injection_ratio, ot_weight, lambda_fine, lambda_coarse, epsilon, temperature,
     sinkhorn_iters, detach_plan, normalize, reduction) = hparams  # fmt: skip
    scale_or_temperature: float | Tensor = temperature
    if logit_scale is not None:
        scale_or_temperature = _resolve_temperature(temperature, logit_scale, audio, validate)
    # float16/bfloat16 inputs: all arithmetic in float32 (exp, log-sum-exp, Sinkhorn).
    cdt = torch.promote_types(audio.dtype, torch.float32)
    sources = _retrieval_pairs(audio, *knowledge, cdt, validate)
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
            check_same_device_dtype([(audio, "audio"), (text, "text")])
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
        hparams = _Hparams(*(getattr(self, name) for name in _Hparams._fields))
        if logit_scale is not None:
            hparams = hparams._replace(temperature=_DEFAULT_TEMPERATURE)
        # a temperature that warned when this Module was built does not warn per call
        quiet = _habit_told(self.temperature) and logit_scale is None
        with told(TEMPERATURE_HABIT) if quiet else contextlib.nullcontext():
            # the pair was checked above, once for the call: not again in ask
            out = _checked_ask(
                audio,
                text,
                tuple(knowledge[f"{g}_{m}"] for g in ("fine", "coarse") for m in ("audio", "text")),
                hparams,
                logit_scale,
                None,
                return_terms,
                validate,
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
