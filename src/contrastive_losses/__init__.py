"""Contrastive losses for multimodal retrieval (audio-text first).

Public names only. Each method has one module holding its functional form and its
Module (:mod:`~contrastive_losses.infonce`, :mod:`~contrastive_losses.siglip`,
:mod:`~contrastive_losses.kcl`, :mod:`~contrastive_losses.cacl`,
:mod:`~contrastive_losses.svr`, :mod:`~contrastive_losses.ask`);
:class:`MatryoshkaLoss` (:mod:`~contrastive_losses.matryoshka`) wraps any of the losses;
:mod:`contrastive_losses.functional` gathers the functions.
"""

from __future__ import annotations

from . import diagnostics, distributed, functional, metrics
from ._checks import set_default_validate_args
from .ask import ASKLoss
from .bank import KnowledgeBank
from .cacl import sample_languages
from .grad_cache import GradCache
from .losses import CACLLoss, ContrastivePair, InfoNCELoss, KCLLoss, SigLIPLoss
from .matryoshka import MatryoshkaLoss
from .svr import RadiusPredictor, SupportVectorRegularizer

__version__ = "0.1.0"

__all__ = [
    "ASKLoss",
    "CACLLoss",
    "ContrastivePair",
    "GradCache",
    "InfoNCELoss",
    "KCLLoss",
    "KnowledgeBank",
    "MatryoshkaLoss",
    "RadiusPredictor",
    "SigLIPLoss",
    "SupportVectorRegularizer",
    "diagnostics",
    "distributed",
    "functional",
    "metrics",
    "sample_languages",
    "set_default_validate_args",
]
