r"""Loss Modules: the public face of the four contrastive losses' ``nn.Module`` s.

Each Module lives in its method's module beside its functional form
(:mod:`~contrastive_losses.infonce`, :mod:`~contrastive_losses.siglip`,
:mod:`~contrastive_losses.kcl`, :mod:`~contrastive_losses.cacl`): hyperparameters,
learnable parameters, and a ``forward`` that calls the function.

Each Module also tells which ``(anchor, candidates)`` pairs it contrasts
(:meth:`contrastive_pairs`), so wrappers such as the support-vector regulariser work on
any of them without an ``isinstance`` ladder.
"""

from __future__ import annotations

from ._common import ContrastivePair
from .cacl import CACLLoss
from .infonce import InfoNCELoss
from .kcl import KCLLoss
from .siglip import SigLIPLoss

__all__ = ["CACLLoss", "ContrastivePair", "InfoNCELoss", "KCLLoss", "SigLIPLoss"]
