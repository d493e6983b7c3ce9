"""The trainer's ``--grad-cache`` step (both towers through ``contrastive_losses.GradCache``)
gives the gradients of its ordinary step: KCL on the K*B captions, a CED audio tower with its
mel-band batch-norm in training mode and dropout in both towers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from clap_example.ced import CEDAudioEncoder, CEDConfig
from clap_example.model import ClapModel
from clap_example.objective import Trainable, _Tower, grad_cache_backward
from clap_example.sonar import load_sonar_encoder
from clap_example.train import select_texts

from contrastive_losses import KCLLoss

LANGS = ["eng_Latn", "fra_Latn", "deu_Latn"]
CAPTIONS = [
    ["a loud high beeping tone", "un bip aigu fort", "ein lauter hoher piepton"],
    ["a soft low humming tone", "un bourdonnement grave doux", None],
    ["short white noise hissing", "un bruit blanc bref qui siffle", "ein kurzer weisses rauschen"],
    ["a loud rising chirp", "un gazouillis montant fort", "ein lauter steigendes zwitschern"],
]


def build(sonar_dir: Path, dropout: float) -> Trainable:
    torch.manual_seed(0)
    audio = CEDAudioEncoder(CEDConfig(embed_dim=32, depth=1, num_heads=2, drop_rate=dropout))
    text = load_sonar_encoder(
        sonar_dir,
        config_overrides={
            "dropout": dropout,
            "attention_dropout": dropout,
            "activation_dropout": dropout,
        },
    )
    model = ClapModel(audio, text, 16).double()
    loss_fn = KCLLoss(temperature=0.1, learnable_temperature=True).double()
    return Trainable(model, loss_fn, None, torch.device("cpu")).train()


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def batch_inputs(trainable: Trainable) -> tuple[tuple[torch.Tensor, ...], Any]:
    mask = torch.tensor([[c is not None for c in row] for row in CAPTIONS])
    batch = {"captions": CAPTIONS, "mask": mask, "index": torch.arange(4)}
    texts, langs, arrange = select_texts(batch, "all", LANGS, torch.Generator().manual_seed(0))
    assert len(texts) == 11  # one German caption missing: 11 of 12 encoded
    tokens = trainable.model.text.tokenize(texts, langs)
    wave = torch.randn(4, 16000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lengths = torch.full((4,), 16000)
    return (wave, lengths, tokens["input_ids"], tokens["attention_mask"]), arrange


def chunked_plain_step(trainable: Trainable, inputs: tuple[torch.Tensor, ...], arrange: Any,
                       chunk: int) -> torch.Tensor:  # fmt: skip
    """Each tower with autograd on the same chunks as the cached step (the same dropout
    draws, per-chunk padding trim and batch-norm statistics), then one backward."""
    wave, lengths, ids, attention = inputs
    audio_tower, text_tower = _Tower(trainable, audio=True), _Tower(trainable, audio=False)
    audio = torch.cat(
        [audio_tower(w, n) for w, n in zip(wave.split(chunk), lengths.split(chunk), strict=True)]
    )
    text = torch.cat(
        [text_tower(i, m) for i, m in zip(ids.split(chunk), attention.split(chunk), strict=True)]
    )
    loss, _ = trainable.compute_loss(audio, text, arrange)
    loss.backward()
    return loss.detach()


def check_cached_step(sonar_dir: Path, chunk: int, dropout: float, reference: Any) -> None:
    trainable = build(sonar_dir, dropout)
    inputs, arrange = batch_inputs(trainable)
    torch.manual_seed(5)
    loss = reference(trainable, inputs, arrange)
    expected = grads(trainable)
    stats = [b.clone() for b in trainable.buffers()]
    rng = torch.get_rng_state()

    trainable = build(sonar_dir, dropout)
    torch.manual_seed(5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    got_loss, terms = grad_cache_backward(trainable, scaler, inputs, arrange, chunk)
    got = grads(trainable)
    assert not got_loss.requires_grad and "temperature" in terms
    torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=0)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-12, msg=name)
    for a, b in zip(trainable.buffers(), stats, strict=True):  # statistics updated once
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_cached_step_equals_the_chunked_plain_step(sonar_dir: Path, chunk: int) -> None:
    """Dropout 0.2 in both towers, the CED's batch-norm in training mode."""
    check_cached_step(sonar_dir, chunk, 0.2, lambda t, i, a: chunked_plain_step(t, i, a, chunk))


def test_cached_step_equals_the_trainers_plain_step(sonar_dir: Path) -> None:
    """Without dropout, one audio chunk (4 clips) and text chunks of 4 of the 11 captions:
    the trainer's own plain step (one forward of both towers, untrimmed captions)."""

    def plain(trainable: Trainable, inputs: tuple[torch.Tensor, ...], arrange: Any) -> Any:
        loss, _ = trainable(*inputs, arrange)
        loss.backward()
        return loss.detach()

    check_cached_step(sonar_dir, 4, 0.0, plain)
