"""open_clip's training step with our drop-in: change the import, keep the rest."""

import math

import torch
import torch.nn.functional as F
from torch import nn

# was: from open_clip.loss import ClipLoss
from contrastive_losses.integrations.open_clip import ClipLoss


class TinyCLIP(nn.Module):
    """open_clip's CLIP in miniature: normalised features and a learnable log scale,
    returned as open_clip's models return them (``output_dict=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.visual, self.text = nn.Linear(40, 32), nn.Linear(30, 32)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "image_features": F.normalize(self.visual(image), dim=-1),
            "text_features": F.normalize(self.text(text), dim=-1),
            "logit_scale": self.logit_scale.exp(),
        }


torch.manual_seed(0)
meaning = torch.randn(512, 16)  # what each pair shares
images, texts = meaning @ torch.randn(16, 40), meaning @ torch.randn(16, 30)
model = TinyCLIP()
# open_clip's create_loss(args) arguments; under torchrun pass rank=args.rank,
# world_size=args.world_size as open_clip does. chunk_size is ours: the exact tiled path.
loss = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, chunk_size=32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
history = []
for _ in range(30):
    idx = torch.randint(0, 512, (64,))
    losses = loss(**model(images[idx], texts[idx]), output_dict=True)  # as in open_clip
    total_loss = sum(losses.values())
    optimizer.zero_grad()
    total_loss.backward()
    optimizer.step()
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))  # open_clip's train loop does this
    history.append(total_loss.item())
print(f"open_clip drop-in: loss {history[0]:.3f} -> {history[-1]:.3f}")
