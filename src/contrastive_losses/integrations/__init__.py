"""Drop-ins with other libraries' loss signatures, backed by this library's losses.

Each submodule is named after the library whose interface it reproduces and imports
nothing from it: :mod:`contrastive_losses.integrations.open_clip` holds ``ClipLoss`` and
``SigLipLoss`` with open_clip's constructor and ``forward`` signatures, and
:mod:`contrastive_losses.integrations.open_clip_train` puts them into open_clip's own
trainer (``install()``, which imports open_clip when called). Import the
submodule itself (``from contrastive_losses.integrations.open_clip import ClipLoss``).
"""

from __future__ import annotations

__all__: list[str] = []
