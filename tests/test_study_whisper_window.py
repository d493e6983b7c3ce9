"""benchmarks/studies/whisper_window.py: its transcript score and clip choice (no model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
sys.path.insert(0, str(STUDIES))

window = pytest.importorskip("whisper_window", reason="needs the examples extra (soundfile)")


def test_char_error_rate_is_edit_distance_over_the_reference_length() -> None:
    assert window.char_error_rate("Un coucou.", "un Coucou") == 0.0  # case, punctuation
    assert window.char_error_rate("un jage", "un jars") == pytest.approx(2 / 7)
    assert window.char_error_rate("", "abc") == 1.0
    assert window.char_error_rate("abcd", "abc") == pytest.approx(1 / 3)
    assert window.char_error_rate("Кукушка", "Кукушка.") == 0.0
    # the best word prefix: a decoder that repeats itself is judged on its first words
    assert window.prefix_cer("Коник, коник, коник", "Конік.") == pytest.approx(1 / 5)
    assert window.prefix_cer("", "abc") == 1.0


def test_validation_clips_round_robin_over_spoken_languages(tmp_path: Path) -> None:
    galleries = tmp_path / "galleries"
    galleries.mkdir()
    for spoken, n in (("fra_Latn", 3), ("rus_Cyrl", 1)):
        rows = []
        for i in range(n):
            for lang, text in (("eng_Latn", f"A thing {i}."), (spoken, f"{spoken} {i}")):
                rows.append(
                    {
                        "audio_id": f"{spoken}/{i}",
                        "audio_path": f"{i}.ogg",
                        "caption": text,
                        "language": lang,
                        "spoken_language": spoken,
                    }
                )
        (galleries / f"val_{spoken}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    clips = window.validation_clips(tmp_path, 3)
    assert [c["audio_id"] for c in clips] == ["fra_Latn/0", "rus_Cyrl/0", "fra_Latn/1"]
    assert [c["spoken_caption"] for c in clips] == ["fra_Latn 0", "rus_Cyrl 0", "fra_Latn 1"]
    with pytest.raises(SystemExit, match="no galleries"):
        window.validation_clips(tmp_path / "missing", 3)
