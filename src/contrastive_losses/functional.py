r"""The maths of every loss as pure functions: the public face, as ``torch.nn.functional``.

Each function lives in its method's module beside its Module
(:mod:`~contrastive_losses.infonce`, :mod:`~contrastive_losses.siglip`,
:mod:`~contrastive_losses.kcl`, :mod:`~contrastive_losses.cacl`,
:mod:`~contrastive_losses.svr`, :mod:`~contrastive_losses.ask`) and is imported from
here. Every function

* takes raw embeddings and L2-normalises them (``normalize=True``),
* validates its inputs (shapes, dtypes, devices, NaN/Inf, zero vectors) and raises a
  ``ValueError``/``TypeError`` naming the argument,
* returns a scalar for ``reduction="mean"``/``"sum"`` and per-sample losses for ``"none"``,
* returns ``(loss, terms)`` with ``return_terms=True``, ``terms`` a dict of detached
  tensors for logging,
* with ``gather`` on (default: when ``torch.distributed`` runs with world size > 1)
  computes this rank's rows against the batch of all ranks; see
  :mod:`contrastive_losses.distributed` for the scaling of the returned loss.

Notation: ``B`` batch, ``K`` languages (captions per clip), ``D`` embedding dim,
:math:`s(u, v) = \langle u, v\rangle / \tau` on normalised embeddings.
"""

from __future__ import annotations

# MAX_RADIUS, MIN_TEMPERATURE, check_radius and Terms are importable from here as before,
# outside __all__.
from ._common import MIN_TEMPERATURE as MIN_TEMPERATURE
from ._common import Terms as Terms
from ._kernels import l2_normalize
from ._svr_radius import MAX_RADIUS as MAX_RADIUS
from ._svr_radius import check_radius as check_radius
from .ask import ask
from .cacl import cacl, sample_languages
from .infonce import info_nce
from .kcl import kcl
from .ot import sinkhorn
from .siglip import siglip
from .svr import support_vector_term

__all__ = [
    "ask",
    "cacl",
    "info_nce",
    "kcl",
    "l2_normalize",
    "sample_languages",
    "siglip",
    "sinkhorn",
    "support_vector_term",
]
