"""DDP training with a contrastive_losses loss: torchrun --nproc_per_node=2 ddp_train.py"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from contrastive_losses import InfoNCELoss


class DualEncoder(nn.Module):
    """Both towers *and the loss*: DDP then also averages the temperature's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = nn.Linear(40, 32)
        self.text = nn.Linear(30, 32)
        self.loss_fn = InfoNCELoss(learnable_temperature=True)  # gathers under DDP

    def forward(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.audio(audio), self.text(text))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    torch.manual_seed(0)  # the same synthetic data on every rank
    meaning = torch.randn(250, 16)
    data = TensorDataset(meaning @ torch.randn(16, 40), meaning @ torch.randn(16, 30))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)  # last batch is smaller: fine

    model = DistributedDataParallel(DualEncoder().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # includes the temperature
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for audio, text in loader:
            loss = model(audio.to(device), text.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        # Each rank's loss is scaled so that the *mean over ranks* is the global-batch loss.
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {float(logged) / dist.get_world_size():.3f}")
    temperature = model.module.loss_fn.temperature.detach().reshape(1)
    every_rank = [torch.zeros_like(temperature) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, temperature)
    if dist.get_rank() == 0:
        print("temperature on each rank:", [round(float(t), 5) for t in every_rank])
    # Free DDP's reducer while its process group is alive, then tear the group down
    # together: otherwise gloo can abort at exit ("terminate called without an active
    # exception").
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
