"""A LightningModule whose model owns the logit scale (Lightning is not a dependency of
this library; our tests run training_step with a stand-in LightningModule)."""

import math

import lightning as L
import torch
from torch import nn

from contrastive_losses import KCLLoss, SupportVectorRegularizer


class CLAP(L.LightningModule):
    def __init__(self, audio_encoder: nn.Module, text_encoder: nn.Module) -> None:
        super().__init__()
        self.audio_encoder, self.text_encoder = audio_encoder, text_encoder
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's start
        # An attribute, so a submodule: self.parameters() holds the radius predictor's
        # weights and the DDP strategy averages their gradients.
        self.loss_fn = SupportVectorRegularizer(KCLLoss(), radius="dynamic")

    def training_step(self, batch, batch_idx):
        audio = self.audio_encoder(batch["audio"]).float()  # (B, D)
        b, k = batch["mask"].shape
        text = self.text_encoder(batch["tokens"]).float().view(b, k, -1)  # (B, K, D)
        scale = self.logit_scale.exp()
        loss, terms = self.loss_fn(audio, text, batch["mask"], logit_scale=scale, return_terms=True)
        self.log_dict({f"train/{name}": value.mean() for name, value in terms.items()})
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=5e-5)
