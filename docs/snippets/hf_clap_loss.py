"""Hugging Face ClapModel: what its built-in loss trains, and our symmetric loss instead."""

import torch
from hf_tiny_clap import tiny_batch, tiny_clap  # a tiny random ClapModel, offline

from contrastive_losses import InfoNCELoss, KCLLoss, SupportVectorRegularizer

model = tiny_clap()
out = model(**tiny_batch(clips=8), return_loss=True)
scale = model.logit_scale_a.exp()  # ClapModel's two scales start equal
symmetric = InfoNCELoss()
loss, terms = symmetric(out.audio_embeds, out.text_embeds, logit_scale=scale, return_terms=True)
print(f"ClapModel's loss {out.loss:.4f}, our text->audio {terms['loss_t2a']:.4f},")
print(f"audio->text {terms['loss_a2t']:.4f}, symmetric {loss:.4f}")

# Fine-tune with KCL (2 captions per clip) + SupCLAP's regulariser on the model's scale.
loss_fn = SupportVectorRegularizer(KCLLoss(), radius="dynamic")
model.logit_scale_t.requires_grad_(False)  # one scale trained, as LAION-CLAP does
optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()], lr=1e-3)
batch = tiny_batch(clips=8, captions=2)
losses = []
for _ in range(8):
    out = model(**batch)
    text = out.text_embeds.view(8, 2, -1)  # (B, K, D): the captions are clip-major
    loss = loss_fn(out.audio_embeds, text, logit_scale=model.logit_scale_a.exp())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"KCL + SVR: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
