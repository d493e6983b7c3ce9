"""Controlled CPU study: InfoNCE vs ASKLoss (knowledge bank from the training set).

Long-tail synthetic pairs (``common.paired_clusters`` with Zipf cluster frequencies,
exponent 1.1 over 100 clusters: the 10 head clusters hold ~63% of the training pairs, the
50 tail clusters 6-14 pairs each). A batch of 128 rarely holds two pairs of one tail
cluster, so the in-batch loss sees little of the tail's structure; the bank holds all of
it. That is where out-of-batch knowledge could plausibly help. The held-out set is
balanced (10 pairs per cluster), so the tail weighs as much as the head. Two training
conditions: ``clean``, and ``mismatch20`` where 20% of the training pairs carry another
pair's caption (as web-crawled captions do): the kind of noise that knowledge from the
pair's neighbours, reliability weighting and Sinkhorn re-alignment are meant to soften.

Arms (same initialisation, data order, optimiser and epochs):

* ``infonce`` -- symmetric InfoNCE;
* ``ask`` -- ``ASKLoss`` defaults (the paper's Eq. 8-18: k = 10 neighbours and
  k_coarse = 10 prototypes, injection 0.2, Sinkhorn weight 0.2, lambda_f 0.2, lambda_c
  0.3) with a ``KnowledgeBank`` of the training set (64 prototypes), built at epoch 0
  with the initial encoders and refreshed every 5 epochs (the paper's 15 scaled to this
  shorter run);
* ``ask_refresh1`` -- the same, refreshed every epoch (less stale knowledge).

Logged per epoch: held-out T2A / A2T R@1 (all, head clusters 0-9, tail clusters 50-99,
via ``metrics.retrieval_ranks``), and cluster-level T2A R@1 (the top audio is from the
caption's cluster, ``metrics.recall_at_k`` with cluster ids); the out-of-batch influence
(``diagnostics.out_of_batch_influence``, ASK Eq. 2) of one fixed probe batch on the
bank's rows: its mean per row, the share of rows it touches, and its norm relative to the
in-batch gradient norm; the representation drift mismatch between the bank and the
current encoders (ASK Eq. 3-4). For InfoNCE the influence is measured against the same
kind of bank (the training set encoded by the current model): zero by construction.

    PYTHONPATH=src python benchmarks/studies/ask.py [--epochs 20] [--seeds 5]

Writes ``benchmarks/results/studies/ask.{md,json,png}``.
"""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")
import common
import torch
from torch import nn

from contrastive_losses import ASKLoss, InfoNCELoss, KnowledgeBank, diagnostics, metrics

TEMPERATURE = 0.07
BATCH = 128
N_TRAIN, N_TEST = 4096, 1000
CLUSTERS, ZIPF = 100, 1.1
HEAD, TAIL = range(0, 10), range(50, 100)
METHODS = ("infonce", "ask", "ask_refresh1")
CONDITIONS = {"clean": 0.0, "mismatch20": 0.2}  # share of training pairs with a wrong caption
REFRESH = {"ask": 5, "ask_refresh1": 1}
# Hand-written after looking at the committed run (re-read it if you re-run).
INTERPRETATION = """## Interpretation

This run uses ASK written to the paper's Eq. 8-18 (one injected pair per granularity, a
cross-entropy per granularity summed per direction, potentials with gradient modulating
each direction, k_coarse = 10). The previous implementation (one reliability-weighted,
re-normalised injection, potentials without gradient, k_coarse = 1) gave -0.3 (clean) and
+3.5 (mismatch20) T2A R@1 at the last epoch and -0.9 / +1.4 at each run's best epoch.

Now ASK beats InfoNCE in every seed of both conditions. Clean: +1.8 ± 0.9 T2A R@1 at
the last epoch and +1.0 ± 0.5 at each run's best epoch (5/5 seeds each), head and tail
alike; it starts slower (29.4 vs 35.3 after epoch 1, with a bank encoded by the random
initial encoders) and is ahead from epoch 3. With 20% wrong captions the gap is large:
+19.2 ± 3.1 at the last epoch and +10.6 ± 1.8 at each run's best (66.4 vs 55.7). Every
method still peaks early and then memorises the wrong pairs, but ASK later (epoch 7 vs 6)
and more slowly (65.8 -> 56.5 over the last 13 epochs, InfoNCE 55.3 -> 37.2), so
early-stopped ASK now beats early-stopped InfoNCE by ~10 points. This study has no
ablation: whether the coarse cross-entropy on prototype-injected embeddings, the
potentials (which pull each audio towards the audios paired with its caption's
neighbours, whatever its own caption says) or the injection does it is not separated
here. The out-of-batch influence touches ~41-43% of the bank rows and is ~5-6% of the
in-batch gradient norm (3-7x the previous implementation: the potentials now read the
partner rows with gradient); the bank rows are constants to the encoders, so it reaches
no parameter. Refreshing every epoch instead of every 5 keeps the bank fresher (RDM
0.004 vs 0.007 clean at the end; ~0.3-0.5 during the first cycle, built from the random
initial encoders) without changing retrieval (within 0.5 points).
"""
COLOURS = {"infonce": "tab:gray", "ask": "tab:orange", "ask_refresh1": "tab:red"}


def subset_r1(ranks: torch.Tensor, labels: torch.Tensor, clusters: range) -> float:
    keep = (labels >= clusters.start) & (labels < clusters.stop)
    return float((ranks[keep] == 1).float().mean())


def evaluate(audio_enc: nn.Module, text_enc: nn.Module, data: dict) -> dict[str, float]:
    a = torch.nn.functional.normalize(common.embed(audio_enc, data["audio"]), dim=-1)
    t = torch.nn.functional.normalize(common.embed(text_enc, data["text"]), dim=-1)
    out = {}
    for direction, sim in (("t2a", t @ a.T), ("a2t", a @ t.T)):
        ranks = metrics.retrieval_ranks(sim)  # (N,): pair i is the relevant item of query i
        out[f"{direction}_r1"] = float((ranks == 1).float().mean())
        out[f"{direction}_head_r1"] = subset_r1(ranks, data["label"], HEAD)
        out[f"{direction}_tail_r1"] = subset_r1(ranks, data["label"], TAIL)
    out["t2a_cluster_r1"] = metrics.recall_at_k(
        t @ a.T, query_ids=data["label"], gallery_ids=data["label"], k=1
    )
    return out


def train_one(method: str, seed: int, epochs: int, train_data, test_data) -> dict:
    torch.manual_seed(seed)
    audio_enc, text_enc = common.mlp(64), common.mlp(48)
    encoders = nn.ModuleList([audio_enc, text_enc])
    xa, xt = train_data["audio"], train_data["text"]
    n = len(xa)
    ids = torch.arange(n)
    bank = KnowledgeBank(
        32,
        backend="torch",
        num_prototypes=64,
        refresh_every=REFRESH.get(method, 0),
        seed=seed,
    )
    loss_fn = ASKLoss(bank, k=10, temperature=TEMPERATURE) if method != "infonce" else None
    info_nce = InfoNCELoss(TEMPERATURE)
    probe = torch.randperm(n, generator=common.generator(20_000 + seed))[:BATCH]

    def encode(idx: torch.Tensor):
        return audio_enc(xa[idx]), text_enc(xt[idx]), idx

    def refresh() -> None:
        bank.refresh(encode, ids.split(1024), model=encoders, progress=False)

    def start_epoch(epoch: int) -> None:
        if loss_fn is not None and bank.should_refresh(epoch):
            refresh()

    def step(idx: torch.Tensor, epoch: int) -> torch.Tensor:
        a, t = audio_enc(xa[idx]), text_enc(xt[idx])
        return info_nce(a, t) if loss_fn is None else loss_fn(a, t, idx)

    log: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        log.setdefault(key, []).append(value)

    def end_epoch(epoch: int) -> None:
        for key, value in evaluate(audio_enc, text_enc, test_data).items():
            record(key, value)
        with torch.no_grad():
            cur_a, cur_t, _ = encode(ids)
        if loss_fn is None:  # the bank InfoNCE would have: the current encodings
            bank.build(cur_a, cur_t, ids)
        else:  # staleness before the next refresh (bank rows are in id order)
            record("rdm_audio", float(diagnostics.representation_drift_mismatch(cur_a, bank.audio)))
            record("rdm_text", float(diagnostics.representation_drift_mismatch(cur_t, bank.text)))
        with torch.no_grad():
            pa, pt = audio_enc(xa[probe]), text_enc(xt[probe])
        pa.requires_grad_(True)
        pt.requires_grad_(True)

        def probe_loss(a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return info_nce(a, t) if loss_fn is None else loss_fn(a, t, probe)

        influence = diagnostics.out_of_batch_influence(
            probe_loss, pa, pt, outside=(bank.audio, bank.text)
        )  # (N,): ||dL/d(bank row n)||, both modalities
        in_batch = torch.autograd.grad(probe_loss(pa, pt), (pa, pt))
        in_norm = float(torch.cat([g.flatten() for g in in_batch]).double().norm())
        out_of_batch = influence[~torch.isin(ids, probe)]  # rows outside the probe batch
        record("obi_mean", float(out_of_batch.mean()))
        record("obi_share", float((out_of_batch > 0).double().mean()))
        record("obi_relative", float(out_of_batch.norm()) / in_norm)

    common.train(
        [*audio_enc.parameters(), *text_enc.parameters()],
        n,
        epochs=epochs,
        batch=BATCH,
        seed=seed,
        step=step,
        start_epoch=start_epoch,
        end_epoch=end_epoch,
    )
    return log


def markdown(runs: dict[str, dict[str, list[dict]]], args, seconds: float) -> str:
    def final(c: str, m: str, key: str) -> list[float]:
        return [r[key][-1] for r in runs[c][m]] if key in runs[c][m][0] else [float("nan")]

    def peak(c: str, m: str, key: str) -> list[float]:
        return [max(r[key]) for r in runs[c][m]]

    header = [
        "training pairs",
        "method",
        "T2A R@1",
        "A2T R@1",
        "T2A R@1 head",
        "T2A R@1 tail",
        "A2T R@1 tail",
        "T2A cluster R@1",
        "T2A R@1 at best epoch",
        "OBI per bank row",
        "OBI rows touched",
        "OBI / in-batch grad",
        "RDM (text)",
    ]
    rows = []
    for c in CONDITIONS:
        for m in METHODS:
            rows.append(
                [
                    c,
                    m,
                    common.pm(final(c, m, "t2a_r1"), 100),
                    common.pm(final(c, m, "a2t_r1"), 100),
                    common.pm(final(c, m, "t2a_head_r1"), 100),
                    common.pm(final(c, m, "t2a_tail_r1"), 100),
                    common.pm(final(c, m, "a2t_tail_r1"), 100),
                    common.pm(final(c, m, "t2a_cluster_r1"), 100),
                    common.pm(peak(c, m, "t2a_r1"), 100),
                    f"{common.mean_std(final(c, m, 'obi_mean'))[0]:.2e}",
                    common.pm(final(c, m, "obi_share"), 100, 1) + " %",
                    common.pm(final(c, m, "obi_relative"), 1, 3),
                    common.pm(final(c, m, "rdm_text"), 1, 3),
                ]
            )
    lines = [
        "# ASK: InfoNCE vs ASKLoss with a knowledge bank",
        "",
        f"Long-tail synthetic pairs (`benchmarks/studies/ask.py`): {N_TRAIN} training pairs "
        f"over {CLUSTERS} clusters with Zipf({ZIPF}) frequencies (`clean`, or `mismatch20`: "
        "20% of the training captions swapped between pairs), "
        f"{N_TEST} balanced clean held-out pairs (10 per cluster; head = clusters 0-9, "
        f"tail = 50-99), MLP encoders to D = 32, {args.epochs} epochs, batch {BATCH}, "
        f"temperature {TEMPERATURE}, Adam 1e-3; ASKLoss defaults (Eq. 8-18, k = k_coarse = 10), "
        "bank of the training set "
        "with 64 prototypes, refreshed every 5 epochs (`ask`) or every epoch "
        f"(`ask_refresh1`). {args.seeds} seeds, mean ± sample std; last-epoch values (and "
        "each run's best epoch: held-out early stopping, an oracle); R@1 in %; cluster "
        "R@1: the top-ranked audio is from the caption's cluster. OBI: "
        "out-of-batch influence of one fixed probe batch on the bank rows outside it "
        "(ASK Eq. 2), at the last epoch; RDM: representation drift mismatch between the "
        "bank and the current text encoder at the last epoch (ASK Eq. 3-4; `1 - cos`). "
        f"{seconds / 60:.1f} min wall-clock on 1 thread of a shared, loaded 2-core machine.",
        "",
        common.table(header, rows),
        "",
    ]
    return "\n".join(lines)


def checks(runs: dict[str, dict[str, list[dict]]]) -> str:
    """Each ASK arm against InfoNCE, seed-paired (same data, initialisation and order)."""

    def final(c: str, m: str, key: str) -> list[float]:
        return [r[key][-1] for r in runs[c][m]]

    def peak(c: str, m: str, key: str) -> list[float]:
        return [max(r[key]) for r in runs[c][m]]

    rows = []
    for c in CONDITIONS:
        for m in METHODS[1:]:
            for key, what in (
                ("t2a_r1", "T2A R@1"),
                ("a2t_r1", "A2T R@1"),
                ("t2a_tail_r1", "T2A R@1 tail"),
                ("t2a_cluster_r1", "T2A cluster R@1"),
            ):
                diff = common.paired(final(c, m, key), final(c, "infonce", key), 100)
                rows.append([c, m, f"{what} (points)", diff])
            diff = common.paired(peak(c, m, "t2a_r1"), peak(c, "infonce", "t2a_r1"), 100)
            rows.append([c, m, "T2A R@1 at each run's best epoch (points)", diff])
    return common.table(["training pairs", "arm", "minus InfoNCE", "seed-paired difference"], rows)


def plot(runs: dict[str, dict[str, list[dict]]], path) -> None:
    fig, flat = common.panel_grid(4 * len(CONDITIONS))
    axes = [flat[4 * i : 4 * i + 4] for i in range(len(CONDITIONS))]  # a condition a row pair
    panels = [
        ("t2a_r1", "held-out T2A R@1 (all clusters)", METHODS),
        ("t2a_tail_r1", "held-out T2A R@1 (tail clusters 50-99)", METHODS),
        ("obi_relative", "out-of-batch influence / in-batch gradient", METHODS),
        ("rdm_text", "bank staleness: RDM text (1 - cos)", METHODS[1:]),
    ]
    for row, c in zip(axes, CONDITIONS, strict=True):
        for ax, (key, title, methods) in zip(row, panels, strict=True):
            for m in methods:
                curve = common.curves(runs[c][m], key)
                common.band(ax, curve["mean"], curve["std"], label=m, color=COLOURS[m])
            ax.set_title(f"{c}: {title}", fontsize=8)
            ax.set_xlabel("epoch", fontsize=8)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    common.save_figure(fig, path)


def run(args) -> dict[str, dict[str, list[dict]]]:
    runs: dict[str, dict[str, list[dict]]] = {c: {m: [] for m in METHODS} for c in CONDITIONS}
    for seed in range(args.seeds):
        for c, mismatch in CONDITIONS.items():
            train_data, test_data = common.paired_clusters(
                seed,
                N_TRAIN,
                N_TEST,
                clusters=CLUSTERS,
                zipf=ZIPF,
                balanced_test=True,
                mismatch=mismatch,
            )
            for m in METHODS:
                t0 = time.perf_counter()
                runs[c][m].append(train_one(m, seed, args.epochs, train_data, test_data))
                log = runs[c][m][-1]
                print(
                    f"seed {seed} {c:<10} {m:<13} T2A R@1 {log['t2a_r1'][-1]:.3f} tail "
                    f"{log['t2a_tail_r1'][-1]:.3f} OBI/grad {log['obi_relative'][-1]:.3f} "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return runs


def main() -> None:
    args = common.parse_args(__doc__, epochs=20, seeds=5)
    runs, seconds, saved = common.run_or_load(args, "ask", run)
    md = markdown(runs, args, seconds)
    md += "\n## Against InfoNCE, seed by seed\n\n" + checks(runs) + "\n\n" + INTERPRETATION
    print(md)
    plot(runs, args.out_dir / "ask.png")
    setup = {
        "epochs": args.epochs,
        "seeds": args.seeds,
        "batch": BATCH,
        "train_pairs": N_TRAIN,
        "test_pairs": N_TEST,
        "clusters": CLUSTERS,
        "zipf": ZIPF,
        "temperature": TEMPERATURE,
        "refresh_every": REFRESH,
        "conditions": CONDITIONS,
        "quick": args.quick,
    }
    results = {
        "summary": {
            c: {m: {k: common.curves(runs[c][m], k) for k in runs[c][m][0]} for m in METHODS}
            for c in CONDITIONS
        },
        "runs": runs,
        "seconds": seconds,
    }
    common.save_study(args, "ask", md, setup, saved, results)


if __name__ == "__main__":
    main()
