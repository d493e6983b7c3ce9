"""transformers.Trainer with our loss: override compute_loss."""

import tempfile

import torch
from transformers import ClapConfig, ClapModel, Trainer, TrainingArguments

from contrastive_losses import InfoNCELoss


class ContrastiveTrainer(Trainer):
    """The model's embeddings and logit scale, our symmetric loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)  # no return_loss: ClapModel's own loss is text->audio only
        clap = getattr(model, "module", model)  # unwrapped under DDP
        loss = clap.contrastive_loss(
            out.audio_embeds, out.text_embeds, logit_scale=clap.logit_scale_a.exp()
        )
        return (loss, out) if return_outputs else loss


# The tiny random ClapModel of the recipe above, so this runs offline; for real work:
# ClapModel.from_pretrained("laion/clap-htsat-unfused") and its ClapProcessor.
config = ClapConfig(
    text_config=dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ),
    audio_config=dict(
        spec_size=64, window_size=4, num_mel_bins=16, patch_size=2, patch_stride=2,
        hidden_size=32, patch_embeds_hidden_size=16, depths=[2, 2],
        num_attention_heads=[2, 2], num_hidden_layers=2, hidden_dropout_prob=0.0,
    ),
    projection_dim=16,
)  # fmt: skip
torch.manual_seed(0)
model = ClapModel(config)
# A submodule: the loss's parameters (SVR's radius, if you wrap it) train and save with
# the model, and DDP averages their gradients.
model.contrastive_loss = InfoNCELoss()
model.logit_scale_t.requires_grad_(False)  # one scale trained, as LAION-CLAP does
g = torch.Generator().manual_seed(0)  # 32 synthetic ClapProcessor outputs
features = torch.randn(32, 1, 60, 16, generator=g)
tokens = torch.randint(3, 99, (32, 7), generator=g)
mask = torch.ones(7, dtype=torch.long)
dataset = [
    {"input_features": f, "input_ids": t, "attention_mask": mask}
    for f, t in zip(features, tokens, strict=True)
]
args = TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=16,
    max_steps=6,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
)
trainer = ContrastiveTrainer(model=model, args=args, train_dataset=dataset)
trainer.train()
losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
print(f"Trainer: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
