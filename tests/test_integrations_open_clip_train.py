"""``install()`` wires open_clip's own trainer to the drop-ins.

open_clip's package ``__init__`` and ``open_clip_train`` need torchvision, which the
project's environment lacks (tests/open_clip_reference.py), so the mechanism runs here
against stand-ins for ``open_clip``, ``open_clip.factory`` and ``open_clip_train.main``
that reproduce what open_clip 3.3's trainer does with its loss: ``create_loss(args)`` looks
``ClipLoss`` / ``SigLipLoss`` up in ``open_clip.factory``; ``main`` imports
``create_model_and_transforms`` and ``create_loss`` from ``open_clip``, builds the model,
then the optimizer from ``model.named_parameters()``, then the loss, and its train loop
calls ``loss(**model_out, output_dict=True)``, sums the entries and logs each one. The
reference losses are open_clip's own ``loss.py``. Where ``open_clip_train`` imports, the
last test runs the real ``open_clip_train.main``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import runpy
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from open_clip_reference import load_open_clip_loss
from torch import nn

from contrastive_losses import SupportVectorRegularizer
from contrastive_losses.integrations import open_clip as drop_ins
from contrastive_losses.integrations import open_clip_train as oct

B, VOCAB, LENGTH, DIM = 8, 50, 6, 16


class TinyClip(nn.Module):
    """open_clip's CLIP interface: ``forward(image, text)`` -> a dict of normalised
    features and the exp'd scale (and the bias for SigLIP)."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.visual = nn.Linear(12, DIM)
        self.token_embedding = nn.Embedding(VOCAB, DIM)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0)) if bias else None

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {
            "image_features": F.normalize(self.visual(image), dim=-1),
            "text_features": F.normalize(self.token_embedding(text).mean(1), dim=-1),
            "logit_scale": self.logit_scale.exp(),
        }
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, 12, generator=g), torch.randint(0, VOCAB, (B, LENGTH), generator=g))
            for _ in range(steps)]  # fmt: skip


@pytest.fixture
def fake_open_clip(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """``open_clip``, ``open_clip.factory`` and ``open_clip_train.main`` stand-ins on
    open_clip's real loss classes (skips, naming the install, without open_clip)."""
    reference = load_open_clip_loss()
    factory = types.ModuleType("open_clip.factory")
    for name in ("ClipLoss", "SigLipLoss", "DistillClipLoss", "CoCaLoss"):
        setattr(factory, name, getattr(reference, name))

    def create_loss(args: Any) -> nn.Module:  # open_clip 3.3's, abridged
        if args.distill:
            return factory.DistillClipLoss(rank=args.rank, world_size=args.world_size)
        if args.siglip:
            return factory.SigLipLoss(rank=args.rank, world_size=args.world_size, dist_impl=None)
        return factory.ClipLoss(local_loss=False, gather_with_grad=False, cache_labels=True,
                                rank=0, world_size=1, use_horovod=False)  # fmt: skip

    def create_model_and_transforms(name: str, **kwargs: Any) -> tuple[nn.Module, None, None]:
        torch.manual_seed(0)
        return TinyClip(bias=kwargs.get("init_logit_bias") is not None), None, None

    factory.create_loss = create_loss  # type: ignore[attr-defined]
    factory.create_model_and_transforms = create_model_and_transforms  # type: ignore[attr-defined]
    package = types.ModuleType("open_clip")
    package.create_loss = create_loss  # type: ignore[attr-defined]
    package.create_model_and_transforms = create_model_and_transforms  # type: ignore[attr-defined]
    package.factory = factory  # type: ignore[attr-defined]
    trainer = types.ModuleType("open_clip_train.main")
    trainer_package = types.ModuleType("open_clip_train")
    trainer_package.main = trainer  # type: ignore[attr-defined]
    for name, module in {"open_clip": package, "open_clip.factory": factory,
                         "open_clip_train": trainer_package,
                         "open_clip_train.main": trainer}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    trainer.runs = []  # type: ignore[attr-defined]
    trainer.main = lambda argv: trainer.runs.append(argv)  # type: ignore[attr-defined]
    yield types.SimpleNamespace(package=package, factory=factory, trainer=trainer)
    for active in list(oct._active):
        active.uninstall()


def _import_main(package: types.ModuleType) -> dict[str, Any]:
    """``from open_clip import create_model_and_transforms, create_loss``, as main.py does."""
    return {n: getattr(package, n) for n in ("create_model_and_transforms", "create_loss")}


def _train(names: dict[str, Any], steps: int = 6, siglip: bool = False,
           seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """open_clip_train.main's order and train loop (its ``random_seed(args.seed, 0)``
    before the model, accum_freq=1, the clamp); SGD, which shows a gradient change that
    AdamW's first step (+-lr) may hide."""
    model_kwargs = {"init_logit_bias": -10} if siglip else {}
    torch.manual_seed(seed)
    model, _, _ = names["create_model_and_transforms"]("tiny", output_dict=True, **model_kwargs)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    args = types.SimpleNamespace(distill=False, siglip=siglip, rank=0, world_size=1)
    loss = names["create_loss"](args)
    logged, totals = [], []
    for images, texts in _batches(steps):
        optimizer.zero_grad()
        model_out = model(images, texts)
        losses = loss(**model_out, output_dict=True)
        total = sum(losses.values())
        total.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        logged.append({k: v.item() for k, v in losses.items()})
        totals.append(total.item())
    return {"model": model, "optimizer": optimizer, "loss": loss, "logged": logged,
            "totals": totals}  # fmt: skip


@pytest.mark.parametrize("siglip", [False, True])
def test_installed_trainer_equals_open_clip_step_for_step(fake_open_clip, siglip):
    reference = _train(_import_main(fake_open_clip.package), siglip=siglip)
    with oct.install():
        ours = _train(_import_main(fake_open_clip.package), siglip=siglip)
    expected = drop_ins.SigLipLoss if siglip else drop_ins.ClipLoss
    assert isinstance(ours["loss"], expected)
    assert not isinstance(reference["loss"], drop_ins._OpenClipSettings)
    torch.testing.assert_close(ours["totals"], reference["totals"], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours["model"].parameters(), reference["model"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("radius", ["dynamic", "static"])
def test_learned_radius_reaches_the_optimizer_and_trains(fake_open_clip, radius):
    installed = oct.install(svr={"radius": radius})
    run = _train(_import_main(fake_open_clip.package), steps=8)
    model, optimizer, loss = run["model"], run["optimizer"], run["loss"]
    holder = getattr(model, oct.SUBMODULE)
    assert holder is installed.radius and installed.models == [model]
    regulariser = loss.loss.regulariser
    assert isinstance(regulariser, SupportVectorRegularizer)
    shared = regulariser.predictor if radius == "dynamic" else regulariser.radius
    assert shared is (holder.predictor if radius == "dynamic" else holder.radius)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    radius_params = list(holder.parameters())
    assert radius_params and all(id(p) in in_optimizer for p in radius_params)
    fresh = oct._radius_holder({"radius": radius})
    moved = [not torch.equal(a, b) for a, b in zip(radius_params, fresh.parameters(), strict=True)]
    assert any(moved), "the radius never trained"
    assert any(name.startswith(oct.SUBMODULE) for name in model.state_dict())


def test_svr_terms_are_logged_and_sum_to_the_regularised_loss(fake_open_clip):
    oct.install(svr={"radius": "dynamic", "alpha": 0.5, "beta": 0.1})
    run = _train(_import_main(fake_open_clip.package), steps=1)
    (entry,) = run["logged"]
    assert set(entry) == {"contrastive_loss", "svr_loss", "svr_constraint_loss",
                          "radius_mean", "radius_over_distance"}  # fmt: skip
    # the same first step by hand: the regulariser on the tiny model's first batch
    model, _, _ = fake_open_clip.factory.create_model_and_transforms("tiny")
    regulariser = SupportVectorRegularizer(
        drop_ins.InfoNCELoss(normalize=False), radius="dynamic", alpha=0.5, beta=0.1
    )
    images, texts = _batches(1)[0]
    out = model(images, texts)
    loss, terms = regulariser(out["image_features"], out["text_features"],
                              logit_scale=out["logit_scale"], return_terms=True)  # fmt: skip
    assert entry["contrastive_loss"] == pytest.approx(terms["base"].item(), abs=1e-6)
    assert entry["svr_loss"] == pytest.approx(0.5 * terms["svr"].item(), abs=1e-6)
    assert entry["svr_constraint_loss"] == pytest.approx(0.1 * terms["constraint"].item(), abs=1e-6)
    for name in ("radius_mean", "radius_over_distance"):  # logged, not added to the loss
        assert entry[name] == pytest.approx(terms[name].item(), abs=1e-6)
    assert run["totals"][0] == pytest.approx(loss.item(), abs=1e-6)


def test_fixed_radius_logs_the_svr_term_and_adds_no_parameters(fake_open_clip):
    installed = oct.install(svr={"radius": 0.05})
    run = _train(_import_main(fake_open_clip.package), steps=1)
    assert installed.radius is None and not hasattr(run["model"], oct.SUBMODULE)
    assert set(run["logged"][0]) == {"contrastive_loss", "svr_loss", "radius_mean",
                                     "radius_over_distance"}  # fmt: skip
    assert run["logged"][0]["radius_mean"] == pytest.approx(0.05)
    summed = run["logged"][0]["contrastive_loss"] + run["logged"][0]["svr_loss"]
    assert run["totals"][0] == pytest.approx(summed, abs=1e-6)


def _predictor_run(package: types.ModuleType, before: int, seed: int) -> dict[str, Any]:
    """``install(svr={"radius": "dynamic"})`` after the RNG was left at ``before`` (other
    code ran first), then open_clip's order with ``--seed seed``: the predictor's initial
    weights (a copy, taken when the model is built) and the run."""
    torch.manual_seed(before)
    torch.rand(before + 1)
    installed = oct.install(svr={"radius": "dynamic"})
    names = _import_main(package)
    start: dict[str, torch.Tensor] = {}
    create = names["create_model_and_transforms"]

    def create_and_copy(*args: Any, **kwargs: Any) -> Any:
        built = create(*args, **kwargs)
        start.update({k: v.clone() for k, v in installed.radius.state_dict().items()})
        return built

    run = _train({**names, "create_model_and_transforms": create_and_copy},
                 steps=4, seed=seed)  # fmt: skip
    installed.uninstall()
    return {"start": start, **run}


def test_same_seed_gives_the_same_predictor_and_losses(fake_open_clip):
    """The predictor is drawn from open_clip's seed when the model is built, not from
    whatever the RNG held at install(): two runs with the same seed start from the same
    weights and give the same losses; another seed, other weights."""
    first = _predictor_run(fake_open_clip.package, before=1, seed=3)
    second = _predictor_run(fake_open_clip.package, before=2, seed=3)
    other = _predictor_run(fake_open_clip.package, before=1, seed=4)
    assert first["start"].keys() == second["start"].keys()
    for key, value in first["start"].items():
        assert torch.equal(value, second["start"][key]), key
    assert first["totals"] == second["totals"] and first["logged"] == second["logged"]
    assert not torch.equal(first["start"]["predictor.mlp.0.weight"],
                           other["start"]["predictor.mlp.0.weight"])  # fmt: skip
    # the weights a regulariser built right after torch.manual_seed(3) gets
    torch.manual_seed(3)
    fresh = SupportVectorRegularizer(drop_ins.InfoNCELoss(normalize=False), radius="dynamic")
    for key, value in fresh.predictor.state_dict().items():
        assert torch.equal(first["start"]["predictor." + key], value), key


def test_building_the_model_leaves_the_global_rng_as_open_clip_left_it(fake_open_clip):
    create = fake_open_clip.package.create_model_and_transforms
    torch.manual_seed(5)
    create("tiny")
    expected = torch.rand(4)
    installed = oct.install(svr={"radius": "dynamic"})
    assert fake_open_clip.package.create_model_and_transforms is not create
    torch.manual_seed(5)
    model, _, _ = fake_open_clip.package.create_model_and_transforms("tiny")
    assert installed.models == [model]
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def _one_step(factory: types.ModuleType, ids: torch.Tensor | None) -> list[torch.Tensor]:
    """The tiny model after one SGD step on the drop-in, by hand."""
    model, _, _ = factory.create_model_and_transforms("tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    images, texts = _batches(1)[0]
    drop_ins.ClipLoss()(**model(images, texts), ids=ids).backward()
    optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_ids_reach_the_loss(fake_open_clip):
    """Rows 0 and 1 are two captions of one sample: with ``ids`` the step is the drop-in's
    with those ids, which differs from the one without."""
    ids = torch.tensor([0, 0, *range(1, B - 1)])
    seen = []

    def sample_ids(images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        seen.append((images.shape, texts.shape))
        return ids

    oct.install(ids=sample_ids, chunk_size=3)
    run = _train(_import_main(fake_open_clip.package), steps=1)
    assert seen == [((B, 12), (B, LENGTH))]
    assert run["loss"].loss.chunk_size == 3
    with_ids = _one_step(fake_open_clip.factory, ids)
    without = _one_step(fake_open_clip.factory, None)
    ours = list(run["model"].parameters())
    for a, b in zip(ours, with_ids, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(ours, without, strict=True))


def test_install_after_the_trainer_imported_and_uninstall(fake_open_clip):
    names = vars(fake_open_clip.trainer)
    names.update(_import_main(fake_open_clip.package))  # main.py imported before install
    originals = {n: names[n] for n in ("create_model_and_transforms", "create_loss")}
    factory_clip = fake_open_clip.factory.ClipLoss
    installed = oct.install(svr={"radius": "dynamic"})
    assert names["create_model_and_transforms"] is not originals["create_model_and_transforms"]
    run = _train(names, steps=1)
    assert hasattr(run["model"], oct.SUBMODULE)
    with pytest.raises(ValueError, match="already installed"):
        oct.install()
    installed.uninstall()
    assert names["create_model_and_transforms"] is originals["create_model_and_transforms"]
    assert fake_open_clip.factory.ClipLoss is factory_clip


def _patched_names(fake: types.SimpleNamespace) -> dict[str, Any]:
    return {name: getattr(module, name) for module in (fake.factory, fake.package)
            for name in ("ClipLoss", "SigLipLoss", "DistillClipLoss", "CoCaLoss",
                         "create_model_and_transforms") if hasattr(module, name)}  # fmt: skip


def _racing(threads: int, action: Any) -> list[Any]:
    """``action()`` in ``threads`` threads released at once; each one's result or error."""
    barrier = threading.Barrier(threads)
    results: list[Any] = [None] * threads

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = action()
        except Exception as error:  # the test counts them
            results[i] = error

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not any(worker.is_alive() for worker in workers), "a thread hung"
    return results


@pytest.fixture
def fast_switching() -> Any:
    """Switch threads every microsecond, so that an unlocked install races."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_concurrent_installs_give_exactly_one(fake_open_clip, fast_switching):
    original = _patched_names(fake_open_clip)
    for trial in range(200):
        results = _racing(8, lambda: oct.install(svr={"radius": "static"}))
        installed = [r for r in results if isinstance(r, oct.Installation)]
        errors = [r for r in results if not isinstance(r, oct.Installation)]
        assert len(installed) == 1, f"trial {trial}: {len(installed)} installs"
        assert all(isinstance(e, ValueError) and "already installed" in str(e)
                   for e in errors), errors  # fmt: skip
        assert oct._active == installed
        installed[0].uninstall()
        assert _patched_names(fake_open_clip) == original, f"trial {trial}: left patched"
        assert oct._active == []


def test_concurrent_install_and_uninstall_leave_open_clip_unpatched(fake_open_clip,
                                                                    fast_switching):  # fmt: skip
    """Threads that each install and uninstall as often as they can, and threads that
    uninstall the same installation at once: open_clip ends unpatched every time."""
    original = _patched_names(fake_open_clip)

    def install_then_uninstall() -> int:
        done = 0
        for _ in range(20):
            try:
                installed = oct.install()
            except ValueError:
                continue
            installed.uninstall()
            done += 1
        return done

    for trial in range(50):
        results = _racing(8, install_then_uninstall)
        assert all(isinstance(r, int) for r in results) and sum(results) >= 1, results
        assert _patched_names(fake_open_clip) == original, f"trial {trial}: left patched"
        assert oct._active == []
        installed = oct.install()
        assert _racing(8, installed.uninstall) == [None] * 8
        assert _patched_names(fake_open_clip) == original and oct._active == []


def test_distillation_and_coca_refuse(fake_open_clip):
    oct.install()
    args = types.SimpleNamespace(distill=True, siglip=False, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"DistillClipLoss: .* no drop-in"):
        fake_open_clip.factory.create_loss(args)
    with pytest.raises(ValueError, match="CoCaLoss"):
        fake_open_clip.factory.CoCaLoss()


def test_bad_arguments():
    with pytest.raises(TypeError, match="ids: expected"):
        oct.install(ids="captions")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="svr: expected"):
        oct.install(svr="dynamic")  # type: ignore[arg-type]


def test_command_line_installs_then_runs_open_clips_main(fake_open_clip):
    oct.main(["--cl-svr", '{"radius": "static"}', "--cl-chunk-size", "64", "--model", "RN50"])
    assert fake_open_clip.trainer.runs == [["--model", "RN50"]]
    (installed,) = oct._active
    assert installed.options == {
        "chunk_size": 64,
        "svr": {"radius": "static"},
        "validate_args": None,
    }


def test_command_line_help_says_the_other_flags_go_to_open_clip(capsys):
    with pytest.raises(SystemExit) as info:
        oct.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "every other flag goes to open_clip's trainer unchanged" in text, text
    assert "python -m open_clip_train.main --help" in text, text
    assert not oct._active  # --help installs nothing


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{radius: dynamic}", "keys and strings need double quotes"),
        ('["dynamic"]', "not an object"),
    ],
)
def test_command_line_svr_that_is_not_a_json_object_says_how_to_write_it(capsys, value, says):
    with pytest.raises(SystemExit) as info:
        oct.main(["--cl-svr", value])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert says in err and """--cl-svr '{"radius": "dynamic"}'""" in err, err
    assert "invalid loads value" not in err
    assert not oct._active


def test_missing_open_clip_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip -> ImportError
    monkeypatch.setitem(sys.modules, "open_clip.factory", None)
    with pytest.raises(ImportError, match=r"open_clip_torch\[training\]"):
        oct.install()


def test_importing_the_module_imports_no_open_clip():
    code = (
        "import sys, contrastive_losses.integrations.open_clip_train\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('open_clip', 'open_clip_train')])"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "[]"


def _real_trainer_importable() -> bool:
    try:
        return importlib.util.find_spec("open_clip_train") is not None and bool(
            __import__("open_clip_train.main")
        )
    except Exception:  # torchvision missing, or its CUDA build beside a CPU torch
        return False


@pytest.mark.skipif(
    not _real_trainer_importable(),
    reason="open_clip_train does not import here (it needs torchvision): "
    "pip install 'open_clip_torch[training]' in a venv with a matching torchvision",
)
def test_real_open_clip_trainer_trains_the_dynamic_radius(tmp_path, monkeypatch):
    """The docs' by-hand check (docs/snippets/open_clip_trainer_check.py), one epoch:
    open_clip_train.main with ``install(svr={"radius": "dynamic"})`` on 128 real PNGs,
    twice with ``--seed 0`` in one process (the RNG moved on by the first run): the same
    predictor at the start and the same losses."""
    check = runpy.run_path(str(Path(__file__).resolve().parents[1] / "docs" / "snippets"
                               / "open_clip_trainer_check.py"))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    check["make_data"]()
    flags = ["--train-data", "train.csv", "--csv-img-key", "filepath",
             "--csv-caption-key", "title", "--csv-separator", "\t",
             "--train-num-samples", "128", "--model", "cl-tiny", "--batch-size", "16",
             "--epochs", "1", "--lr", "1e-3", "--precision", "fp32", "--workers", "0",
             "--device", "cpu", "--seed", "0", "--log-every-n-steps", "1",
             "--logs", "logs"]  # fmt: skip
    handlers = list(logging.root.handlers)
    results, logs = [], []
    try:
        for name in ("svr", "svr_again"):
            check["run"]("svr", [*flags, "--name", name])
            for active in list(oct._active):
                active.uninstall()
            results.append(json.loads((tmp_path / "svr.json").read_text()))
            logs.append((tmp_path / "logs" / name / "out.log").read_text())
            for handler in set(logging.root.handlers) - set(handlers):  # open_clip's
                logging.root.removeHandler(handler)
                handler.close()
    finally:
        for active in list(oct._active):
            active.uninstall()
    result, again = results
    assert len(result["losses"]) == 8
    assert all(set(step) == {"contrastive_loss", "svr_loss", "svr_constraint_loss",
                             "radius_mean", "radius_over_distance"}
               for step in result["losses"])  # fmt: skip
    assert len(result["radius_parameters"]) == 6  # the predictor's, on the model
    assert all(change > 0 for change in result["radius_change"].values()), result
    saved = torch.load(tmp_path / "logs" / "svr" / "checkpoints" / "epoch_1.pt")
    assert set(result["radius_parameters"]) <= set(saved["state_dict"])
    for log in logs:
        assert log.count("Svr_loss") == 8 and "Svr_constraint_loss" in log
        assert log.count("Radius_mean") == 8 and "Radius_over_distance" in log
    assert again["radius_start"] == result["radius_start"]
    assert again["losses"] == result["losses"]
