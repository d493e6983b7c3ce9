"""A compiled loss in a training loop, on the model's own logit scale."""

import math

import torch
from torch import nn

from contrastive_losses import InfoNCELoss, SupportVectorRegularizer

torch.manual_seed(0)
meaning = torch.randn(512, 16)
audio_x, text_x = meaning @ torch.randn(16, 40), meaning @ torch.randn(16, 30)
audio_enc, text_enc = nn.Linear(40, 32), nn.Linear(30, 32)
log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # the model's, as in CLIP
# Value checks on (the default): under compile they step aside, one graph, no host sync.
loss_fn = SupportVectorRegularizer(InfoNCELoss(), radius="static")
compiled = torch.compile(loss_fn, fullgraph=True)
parameters = [
    *audio_enc.parameters(),
    *text_enc.parameters(),
    log_scale,
    *loss_fn.parameters(),  # the static radius
]
optimizer = torch.optim.AdamW(parameters, lr=1e-2)
history = []
for _ in range(20):
    idx = torch.randint(0, 512, (64,))
    audio, text = audio_enc(audio_x[idx]), text_enc(text_x[idx])
    loss = compiled(audio, text, logit_scale=log_scale.exp())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    history.append(loss.item())
print(f"compiled: loss {history[0]:.3f} -> {history[-1]:.3f}")
