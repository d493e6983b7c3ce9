"""A training loop with the compiled regulariser: python compile_svr_loop.py"""

import torch
from torch import nn

from contrastive_losses import InfoNCELoss, SupportVectorRegularizer


def main(steps: int = 20, backend="inductor") -> list[float]:
    torch.manual_seed(0)
    # A toy data set: 64 clips (40 features) and their captions (30 features).
    clips = torch.randn(64, 40)
    captions = clips[:, :30] + 0.5 * torch.randn(64, 30)

    audio_encoder, text_encoder = nn.Linear(40, 32), nn.Linear(30, 32)
    base = InfoNCELoss(learnable_temperature=True)
    loss_fn = SupportVectorRegularizer(base, radius="dynamic")
    # or compile the whole step
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    params = [
        *audio_encoder.parameters(),
        *text_encoder.parameters(),
        *loss_fn.parameters(),  # the temperature and the radius predictor
    ]
    optimizer = torch.optim.AdamW(params, lr=1e-2)

    losses = []
    for step in range(steps):
        rows = torch.arange(16) + 16 * (step % 4)  # batches of 16: keep B fixed
        audio = audio_encoder(clips[rows])  # (16, 32), new tensors every step
        text = text_encoder(captions[rows])  # (16, 32)
        loss = compiled(audio, text)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    losses = main()
    print(f"loss: first step {losses[0]:.3f}, last step {losses[-1]:.3f}")
