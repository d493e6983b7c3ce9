"""Contrastive losses for multimodal retrieval (audio-text first).

Public names only; the maths lives in :mod:`contrastive_losses.functional`.
"""

from __future__ import annotations

from contrastive_losses import metrics

__version__ = "0.1.0"

__all__: list[str] = ["metrics"]
