"""Hugging Face ClapModel: what its built-in loss trains, and our symmetric loss instead."""

import torch
from transformers import ClapConfig, ClapModel

from contrastive_losses import InfoNCELoss, KCLLoss, SupportVectorRegularizer

# A tiny random ClapModel and batch, so this runs offline in seconds. For real work:
# ClapModel.from_pretrained("laion/clap-htsat-unfused") and its ClapProcessor.
text_config = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37, max_position_embeddings=64,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
audio_config = dict(
    spec_size=64, window_size=4, num_mel_bins=16, patch_size=2, patch_stride=2,
    hidden_size=32, patch_embeds_hidden_size=16, depths=[2, 2],
    num_attention_heads=[2, 2], num_hidden_layers=2, hidden_dropout_prob=0.0,
)  # fmt: skip
config = ClapConfig(text_config=text_config, audio_config=audio_config, projection_dim=16)
torch.manual_seed(0)
model = ClapModel(config)


def batch(clips, captions=1, seed=0):
    """Spectrograms and clip-major token ids, as ClapProcessor returns them."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_features": torch.randn(clips, 1, 60, 16, generator=g),
        "input_ids": torch.randint(3, 99, (clips * captions, 7), generator=g),
        "attention_mask": torch.ones(clips * captions, 7, dtype=torch.long),
    }


out = model(**batch(8), return_loss=True)
scale = model.logit_scale_a.exp()  # ClapModel's two scales start equal
symmetric = InfoNCELoss()
loss, terms = symmetric(out.audio_embeds, out.text_embeds, logit_scale=scale, return_terms=True)
print(f"ClapModel's loss {out.loss:.4f}, our text->audio {terms['loss_t2a']:.4f},")
print(f"audio->text {terms['loss_a2t']:.4f}, symmetric {loss:.4f}")

# Fine-tune with KCL (2 captions per clip) + SupCLAP's regulariser on the model's scale.
loss_fn = SupportVectorRegularizer(KCLLoss(), radius="dynamic")
model.logit_scale_t.requires_grad_(False)  # one scale trained, as LAION-CLAP does
optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()], lr=1e-3)
inputs = batch(8, captions=2)
losses = []
for _ in range(8):
    out = model(**inputs)
    text = out.text_embeds.view(8, 2, -1)  # (B, K, D): the captions are clip-major
    loss = loss_fn(out.audio_embeds, text, logit_scale=model.logit_scale_a.exp())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"KCL + SVR: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
