"""GradCache gives the gradients of the ordinary backward pass (KCL on K*B captions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clap_example.ced import CEDAudioEncoder, CEDConfig
from clap_example.gradcache import (
    RngState,
    backward_chunks,
    embed_without_grad,
    grad_cache_backward,
    split_chunks,
)
from clap_example.model import ClapModel
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


def build(sonar_dir: Path, dropout: float) -> tuple[ClapModel, KCLLoss]:
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
    return model, KCLLoss(temperature=0.1, learnable_temperature=True).double()


def inputs(model: ClapModel) -> tuple[dict[str, torch.Tensor], list[str], list[str], object]:
    mask = torch.tensor([[c is not None for c in row] for row in CAPTIONS])
    batch = {"captions": CAPTIONS, "mask": mask, "index": torch.arange(4)}
    texts, langs, arrange = select_texts(batch, "all", LANGS, torch.Generator().manual_seed(0))
    tokens = model.text.tokenize(texts, langs)
    return tokens, texts, langs, arrange


def grads(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if p.grad is not None:
                out[f"{i}.{name}"] = p.grad.detach().clone()
    return out


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_cached_gradients_equal_uncached(sonar_dir: Path, chunk_size: int) -> None:
    model, loss_fn = build(sonar_dir, dropout=0.0)
    tokens, texts, _, arrange = inputs(model)
    wave = torch.randn(4, 16000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model.train()

    # Ordinary backward: both towers with autograd on all K*B captions at once.
    audio = model.encode_audio(wave)
    text = model.encode_text(tokens["input_ids"], tokens["attention_mask"])
    positional, keyword = arrange(audio, text)
    loss = loss_fn(*positional, **keyword)
    loss.backward()
    expected = grads(model, loss_fn)
    model.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)

    def encode(part: dict[str, torch.Tensor]) -> torch.Tensor:
        return model.encode_text(part["input_ids"], part["attention_mask"])

    def loss_from(text_emb: torch.Tensor) -> tuple[torch.Tensor, None]:
        positional, keyword = arrange(model.encode_audio(wave), text_emb)
        return loss_fn(*positional, **keyword), None

    cached_loss, _ = grad_cache_backward(
        encode, dict(tokens), loss_from, chunk_size, torch.device("cpu")
    )
    got = grads(model, loss_fn)
    torch.testing.assert_close(cached_loss, loss)
    assert sorted(got) == sorted(expected)
    assert len(texts) == 11  # one German caption missing: 11 of 12 encoded
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-12, msg=name)


def test_rerun_replays_dropout_exactly(sonar_dir: Path) -> None:
    """With dropout the re-run chunk sees the same masks as the cached pass, so the cached
    gradient is the exact gradient of the loss that was computed."""
    model, loss_fn = build(sonar_dir, dropout=0.3)
    tokens, _, _, arrange = inputs(model)
    model.train()
    chunks = split_chunks(dict(tokens), 3)
    seen: list[torch.Tensor] = []

    def encode(part: dict[str, torch.Tensor]) -> torch.Tensor:
        out = model.encode_text(part["input_ids"], part["attention_mask"])
        seen.append(out.detach().clone())
        return out

    torch.manual_seed(123)
    cached = embed_without_grad(encode, chunks, torch.device("cpu"))
    after_first_pass = torch.get_rng_state()
    audio = torch.randn(4, 16, dtype=torch.float64)
    positional, keyword = arrange(audio, cached.embeddings)
    loss_fn(*positional, **keyword).backward()
    first = list(seen)
    seen.clear()
    backward_chunks(encode, cached)
    for a, b in zip(first, seen, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), after_first_pass)  # RNG continues as without caching
    # Reference: the same chunks with autograd under the same RNG states, concatenated.
    cached_grads = grads(model)
    model.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    outs = []
    for chunk, state in zip(chunks, cached.states, strict=True):
        with state.replay():
            outs.append(encode(chunk))
    positional, keyword = arrange(audio, torch.cat(outs))
    loss_fn(*positional, **keyword).backward()
    reference = grads(model)
    for name in reference:
        torch.testing.assert_close(
            cached_grads[name], reference[name], rtol=1e-9, atol=1e-12, msg=name
        )


def test_missing_cached_gradient_is_an_error() -> None:
    lin = torch.nn.Linear(2, 2)
    cached = embed_without_grad(
        lambda c: lin(c["x"]), [{"x": torch.randn(3, 2)}], torch.device("cpu")
    )
    with pytest.raises(RuntimeError, match=r"call loss.backward\(\) first"):
        backward_chunks(lambda c: lin(c["x"]), cached)
    state = RngState.capture(torch.device("cpu"))
    with state.replay():
        torch.rand(3)
    with pytest.raises(ValueError, match="chunk_size"):
        split_chunks({"x": torch.zeros(2)}, 0)
