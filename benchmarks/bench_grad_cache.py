"""Peak memory and time of a training step with :class:`contrastive_losses.GradCache` against
the plain step, open_clip's ``--accum-freq`` step and the PyPI GradCache package.

    python benchmarks/bench_grad_cache.py [--quick] [--batches 128 256 512 1024] [--chunk 32]
        [--peer-path DIR]   # an unpacked grad-cache-con-learning wheel (optional peer)

**Encoders** (CPU, one thread, float32): audio, the example trainer's CED
(``examples/clap_example/ced.py``: log-mel front end, 16 x 16 patches, ViT blocks, mean pooling;
width 128, depth 2, 4 heads) on 1 s clips at 16 kHz, projected to D = 64; text, a 2-layer
``nn.TransformerEncoder`` (width 128, 4 heads, FFN 512, 32 tokens, vocabulary 1000, masked
mean pooling) projected to D = 64. No dropout, and the CED's mel-band batch-norm in eval mode:
all the steps below then compute the same function, which the run checks. Loss:
``InfoNCELoss`` with the model's learnable log-scale passed as ``logit_scale`` (open_clip's
layout).

**Steps** at each batch B:

* ``plain``: ``loss_fn(audio_enc(a), text_enc(t), logit_scale=s).backward()``;
* ``grad_cache``: ``GradCache(loss_fn, chunk)(audio_enc, a, text_enc, t, logit_scale=s)``;
* ``accum_freq``: open_clip's ``--accum-freq`` step (``open_clip_train/train.py``,
  ``train_one_epoch``, the ``accum_freq > 1`` branch, reimplemented here on the same
  encoders: that trainer needs its own model and data pipeline): every micro-batch of
  ``chunk`` rows is encoded under ``no_grad`` and its features cached; then for each
  micro-batch ``j`` both towers are re-run on it with autograd, its features replace the
  cached ones in the concatenation, the loss is computed on the whole batch and
  back-propagated. Its encoders' gradients are the plain step's; the model's logit scale
  receives the full gradient once per micro-batch (``B / chunk`` times the plain one; the
  run reports the ratio); it does not replay the RNG (dropout masks differ between passes).
* ``grad-cache-con-learning`` 1.0.2 (PyPI, the GradCache package the issue names): its
  ``GradCache`` takes one model and its own SimCLR/SupCon/SelfCon losses only (an
  ``isinstance`` check); ``import grad_cache_con_learning`` succeeds without it (its
  ``from losses import ...`` is a top-level import that fails and is swallowed), and its
  SimCLR/SupCon backward reads an undefined ``y1``. With ``--peer-path`` the run tries its
  SimCLR step on the audio encoder and records what happens.

**Memory** (a fresh process per step and B, like ``bench_memory.py``): the child builds
the encoders, runs the same step once at B = 2 * chunk (one-time allocations), creates the
inputs, frees the allocator's caches, resets the kernel's high-water mark and reads VmRSS;
after one step ``extra = VmHWM - baseline``: the activations, the embeddings, the logits and
the gradients of the parameters (which every step pays) -- not the inputs or the weights.
glibc's mmap threshold is fixed at 64 KiB so RSS follows the live tensors.

**Time** (a fresh process per B): the steps interleaved in a new random order each round
after a warm-up, median wall and CPU seconds of each; ratios against ``plain``. The machine
was shared with other jobs: the CPU-time ratio is the less noisy one. ``--runs`` (default 3)
repeats the timing processes, interleaved B by B (run 1 of every B, then run 2, ...); each
committed ratio is the median over the runs with its range.

Results: ``results/grad_cache.json``; ``--quick`` (B = 64, 128, chunk 16) writes
``results/quick/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from bench_memory import MMAP_THRESHOLD, _status_kib, _trim  # noqa: E402
from timing import (  # noqa: E402
    combine_runs,
    interleaved_wall_and_cpu,
    markdown_table,
    warm_up,
    write_results,
)

from contrastive_losses import GradCache, InfoNCELoss  # noqa: E402

D, WIDTH, TOKENS, VOCAB, SAMPLES = 64, 128, 32, 1000, 16000
STEPS = ("plain", "grad_cache", "accum_freq")


class TextEncoder(nn.Module):
    """Token embeddings + positions, a 2-layer transformer, masked mean pooling, projection."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(TOKENS, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=dropout, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.proj = nn.Linear(WIDTH, D)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        x = self.blocks(x, src_key_padding_mask=attention_mask == 0)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        return self.proj((x * m).sum(1) / m.sum(1).clamp_min(1))


class AudioEncoder(nn.Module):
    """The example's CED (small) with a projection to ``D``; mel-band norm frozen."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        from clap_example.ced import CEDAudioEncoder, CEDConfig

        config = CEDConfig(embed_dim=WIDTH, depth=2, num_heads=4, drop_rate=dropout)
        self.ced = CEDAudioEncoder(config)
        self.proj = nn.Linear(WIDTH, D)

    def forward(self, waveform: Tensor) -> Tensor:
        return self.proj(self.ced(waveform))

    def train(self, mode: bool = True) -> AudioEncoder:
        super().train(mode)
        self.ced.encoder.init_bn.eval()  # fixed statistics: every step computes the same function
        return self


class Setup:
    """Encoders (``dropout`` in both: 0 for the timings), the model-owned log-scale and the
    loss, seeded."""

    def __init__(self, dropout: float = 0.0) -> None:
        torch.manual_seed(0)
        self.audio = AudioEncoder(dropout).train()
        self.text = TextEncoder(dropout).train()
        self.log_scale = nn.Parameter(torch.tensor(2.0))
        self.loss_fn = InfoNCELoss()
        self.params = [*self.audio.parameters(), *self.text.parameters(), self.log_scale]

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self) -> list[Tensor]:
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]


def make_inputs(b: int, seed: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    wave = torch.randn(b, SAMPLES, generator=g) * 0.1
    ids = torch.randint(0, VOCAB, (b, TOKENS), generator=g)
    lengths = torch.randint(8, TOKENS + 1, (b,), generator=g)
    mask = (torch.arange(TOKENS)[None] < lengths[:, None]).long()
    return wave, {"input_ids": ids, "attention_mask": mask}


def plain_step(s: Setup, wave: Tensor, tokens: dict[str, Tensor], chunk: int) -> Tensor:
    loss = s.loss_fn(s.audio(wave), s.text(**tokens), logit_scale=s.log_scale.exp())
    loss.backward()
    return loss.detach()


def grad_cache_step(s: Setup, wave: Tensor, tokens: dict[str, Tensor], chunk: int) -> Tensor:
    cache = GradCache(s.loss_fn, chunk)
    return cache(s.audio, wave, s.text, tokens, logit_scale=s.log_scale.exp())


def accum_freq_step(s: Setup, wave: Tensor, tokens: dict[str, Tensor], chunk: int) -> Tensor:
    """open_clip_train/train.py, train_one_epoch, ``accum_freq > 1`` (open_clip 3.3): cache
    every micro-batch's features without grad, then per micro-batch re-encode it with grad,
    splice it into the cached features, take the whole loss and back-propagate."""
    waves = wave.split(chunk)
    parts = [{k: v.split(chunk)[i] for k, v in tokens.items()} for i in range(len(waves))]
    with torch.no_grad():
        audio_feats = [s.audio(w) for w in waves]
        text_feats = [s.text(**p) for p in parts]
    total = torch.zeros(())
    for j in range(len(waves)):
        audio_j, text_j = s.audio(waves[j]), s.text(**parts[j])
        audio = torch.cat([*audio_feats[:j], audio_j, *audio_feats[j + 1 :]])
        text = torch.cat([*text_feats[:j], text_j, *text_feats[j + 1 :]])
        loss = s.loss_fn(audio, text, logit_scale=s.log_scale.exp())
        loss.backward()
        total = loss.detach()
    return total


STEP_FNS = {"plain": plain_step, "grad_cache": grad_cache_step, "accum_freq": accum_freq_step}


# ------------------------------------------------------------------------- children


def memory_child(case: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    s = Setup()
    step = STEP_FNS[case["step"]]
    step(s, *make_inputs(2 * case["chunk"]), case["chunk"])  # one-time allocations
    s.zero()
    wave, tokens = make_inputs(case["b"])
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    step(s, wave, tokens, case["chunk"])
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {**case, "extra_mib": (peak - base) / 1024, "seconds": seconds}


def time_child(case: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    s = Setup()
    wave, tokens = make_inputs(case["b"])

    def run(name: str) -> Any:
        def fn() -> None:
            s.zero()
            STEP_FNS[name](s, wave, tokens, case["chunk"])

        return fn

    warm_up(case["warmup"])
    wall, cpu = interleaved_wall_and_cpu({n: run(n) for n in STEPS}, case["rounds"])
    out: dict[str, Any] = dict(case)
    for name in STEPS:
        out[f"{name}_s"] = statistics.median(wall[name])
        out[f"{name}_cpu_s"] = statistics.median(cpu[name])
    return out


def run_child(mode: str, case: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    if mode == "--memory-case":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    proc = subprocess.run(
        [sys.executable, __file__, mode, json.dumps(case)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------- checks


def check_values(b: int, chunk: int) -> dict[str, Any]:
    """The three steps on one batch: loss values, the largest relative gradient difference
    of the encoders against ``plain``, and the log-scale gradient ratio."""
    out: dict[str, Any] = {"b": b, "chunk": chunk}
    s = Setup()
    wave, tokens = make_inputs(b)
    ref_loss = plain_step(s, wave, tokens, chunk)
    ref = s.grads()
    for name in ("grad_cache", "accum_freq"):
        s.zero()
        loss = STEP_FNS[name](s, wave, tokens, chunk)
        got = s.grads()
        rel = max(
            float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
            for g, r in zip(got[:-1], ref[:-1], strict=True)
        )
        out[name] = {
            "loss": float(loss),
            "loss_rel_diff": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "encoder_grad_max_rel_diff": rel,
            "log_scale_grad_ratio": float(got[-1] / ref[-1]),
        }
    out["plain_loss"] = float(ref_loss)
    return out


def try_peer(path: str | None) -> dict[str, Any]:
    """grad-cache-con-learning 1.0.2: import it as installed, then with its own folder on
    sys.path (so its ``from losses import`` resolves), and run its SimCLR step."""
    if path is None:
        return {"ran": False, "why": "not given (--peer-path: an unpacked wheel)"}
    sys.path.insert(0, path)
    out: dict[str, Any] = {}
    try:
        import grad_cache_con_learning as peer

        out["import_as_installed_has_GradCache"] = hasattr(peer, "GradCache")
        sys.path.insert(0, str(Path(path) / "grad_cache_con_learning"))
        from grad_cache_con_learning.grad_cache import GradCache as PeerCache
        from losses import SupConLoss  # the class its isinstance check sees

        s = Setup()
        wave, _ = make_inputs(8)
        cache = PeerCache(s.audio, 4, SupConLoss(), loss_type="SimCLR")
        cache(wave)  # SimCLR: each chunk's rows are its two views, halved by the package
        out["ran"] = True
    except Exception as exc:  # recorded, not hidden: this is the finding
        out.update(ran=False, why=f"{type(exc).__name__}: {exc}")
        out["traceback_tail"] = traceback.format_exc().strip().splitlines()[-3:]
    return out


# ------------------------------------------------------------------------- main


# per timing run: each step's ratio to the plain step (CPU time, wall time)
RATIO_FIELDS = (*(f"{n}_{c}ratio" for n in STEPS[1:] for c in ("cpu_", "")), "plain_cpu_s")


def with_ratios(t: dict[str, Any]) -> dict[str, Any]:
    """One timing run's row with each step's ratios to the plain step."""
    out = dict(t)
    for name in STEPS[1:]:
        out[f"{name}_cpu_ratio"] = t[f"{name}_cpu_s"] / t["plain_cpu_s"]
        out[f"{name}_ratio"] = t[f"{name}_s"] / t["plain_s"]
    return out


def summarise(mem: list[dict[str, Any]], tim: list[dict[str, Any]]) -> str:
    def ratio(t: dict[str, Any], name: str) -> str:
        cpu = f"{name}_cpu_ratio"
        spread = f"{t.get(cpu + '_min', t[cpu]):.2f}-{t.get(cpu + '_max', t[cpu]):.2f}"
        return f"{t[cpu]:.2f}x [{spread}] ({t[f'{name}_ratio']:.2f}x)"

    rows = []
    for t in tim:
        b = t["b"]
        extra = {m["step"]: m["extra_mib"] for m in mem if m["b"] == b}
        rows.append(
            [
                b,
                f"{extra['plain']:.0f}",
                f"{extra['grad_cache']:.0f} ({extra['grad_cache'] / extra['plain']:.2f}x)",
                f"{extra['accum_freq']:.0f} ({extra['accum_freq'] / extra['plain']:.2f}x)",
                f"{t['plain_cpu_s']:.2f}",
                ratio(t, "grad_cache"),
                ratio(t, "accum_freq"),
            ]
        )
    header = [
        "B",
        "plain extra MiB",
        "GradCache MiB",
        "accum-freq MiB",
        "plain CPU s",
        "GradCache time, CPU [range over runs] (wall)",
        "accum-freq time, CPU [range over runs] (wall)",
    ]
    return markdown_table(header, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=3, help="timing runs, interleaved B by B")
    p.add_argument("--peer-path", default=None)
    p.add_argument("--memory-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--time-case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_case:
        print(json.dumps(memory_child(json.loads(args.memory_case))))
        return
    if args.time_case:
        print(json.dumps(time_child(json.loads(args.time_case))))
        return
    batches = args.batches or ([64, 128] if args.quick else [128, 256, 512, 1024])
    chunk = args.chunk or (16 if args.quick else 32)
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(1)
    values = check_values(min(batches), chunk)
    print(json.dumps(values, indent=1), flush=True)
    peer = try_peer(args.peer_path)
    print("grad-cache-con-learning:", json.dumps(peer), flush=True)
    mem: list[dict[str, Any]] = []
    for b in batches:
        for step in STEPS:
            mem.append(run_child("--memory-case", {"b": b, "chunk": chunk, "step": step}))
            print(f"memory B={b} {step}: {mem[-1]['extra_mib']:.0f} MiB", flush=True)
    runs: list[list[dict[str, Any]]] = []
    for _ in range(1 if args.quick else args.runs):  # run r of every B, then r + 1
        runs.append([])
        for b in batches:
            case = {"b": b, "chunk": chunk, "rounds": rounds, "warmup": 1.0 if args.quick else 3.0}
            runs[-1].append(with_ratios(run_child("--time-case", case)))
            timed = {k: v for k, v in runs[-1][-1].items() if k.endswith("_s")}
            print(f"time run {len(runs)} B={b}: {json.dumps(timed)}", flush=True)
    tim = combine_runs(runs, ("b",), RATIO_FIELDS)
    table = summarise(mem, tim)
    print(table)
    write_results(
        "grad_cache",
        {"values": values, "peer": peer, "memory": mem, "time": tim, "table": table,
         "load_avg": os.getloadavg()},
        quick=args.quick,
    )  # fmt: skip


if __name__ == "__main__":
    main()
