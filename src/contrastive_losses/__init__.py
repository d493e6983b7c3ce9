"""Contrastive losses for multimodal retrieval (audio-text first).

Public names only; the maths lives in :mod:`contrastive_losses.functional`.
"""

from __future__ import annotations

from . import diagnostics, distributed, functional, metrics
from .ask import ASKLoss
from .bank import KnowledgeBank
from .functional import sample_languages
from .losses import CACLLoss, ContrastivePair, InfoNCELoss, KCLLoss, SigLIPLoss
from .svr import RadiusPredictor, SupportVectorRegularizer

__version__ = "0.1.0"

__all__ = [
    "ASKLoss",
    "CACLLoss",
    "ContrastivePair",
    "InfoNCELoss",
    "KCLLoss",
    "KnowledgeBank",
    "RadiusPredictor",
    "SigLIPLoss",
    "SupportVectorRegularizer",
    "diagnostics",
    "distributed",
    "functional",
    "metrics",
    "sample_languages",
]
