"""A tiny folder in the layout of Tux Paint's stamps, and the builder loaded from its file.

``make_stamps`` writes, per description, ``X.txt`` (English first line, ``ll.utf8=`` lines),
``X_desc.ogg`` (English) and ``X_desc_LL.ogg`` recordings (short Vorbis tones, a frequency per
description) and, for some stamps, a sound effect ``X.ogg``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
from helpers import load_file_module

BUILDER = Path(__file__).resolve().parents[2] / "examples" / "data_builders" / "tuxpaint.py"

NOUNS = (
    "owl", "apple", "boat", "tiger", "drum", "kite", "lamp", "horse", "rocket", "tulip",
    "violin", "bridge", "cactus", "dolphin", "engine", "falcon", "guitar", "hammer", "igloo",
    "jacket", "koala", "lemon", "mango", "needle", "octopus", "parrot", "quilt", "robot",
    "saddle", "turtle", "umbrella", "volcano",
)  # fmt: skip
#: Fake translations: the spoken languages of the tiny set and one text-only language.
LOCALES = ("fr", "ru", "de")
SPOKEN = ("en", "fr", "ru")


def load_builder() -> ModuleType:
    """``examples/data_builders/tuxpaint.py`` as a module (the folder is not a package)."""
    return load_file_module("tuxpaint_builder", BUILDER)


def tone(path: Path, freq: float, seconds: float = 0.3, sr: int = 22050) -> None:
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    wave = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    sf.write(str(path), wave, sr, format="OGG", subtype="VORBIS")


def caption(noun: str, locale: str) -> str:
    return f"A {noun}." if locale == "en" else f"{noun.capitalize()} ({locale})."


def make_stamps(root: Path, n: int = len(NOUNS), sound_effects: int = 4) -> Path:
    """``n`` stamps in two folders (``animals/``, ``things/``); returns ``root``."""
    for i, noun in enumerate(NOUNS[:n]):
        folder = root / ("animals" if i % 2 else "things")
        folder.mkdir(parents=True, exist_ok=True)
        lines = [caption(noun, "en")] + [f"{lc}.utf8={caption(noun, lc)}" for lc in LOCALES]
        (folder / f"{noun}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (folder / f"{noun}.png").write_bytes(b"")
        for locale in SPOKEN:
            suffix = "_desc" if locale == "en" else f"_desc_{locale}"
            tone(folder / f"{noun}{suffix}.ogg", 200.0 + 40 * i + 7 * SPOKEN.index(locale))
        if i < sound_effects:
            tone(folder / f"{noun}.ogg", 3000.0 - 50 * i)
    return root
