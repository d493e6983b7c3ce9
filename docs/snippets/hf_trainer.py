"""transformers.Trainer with our loss: override compute_loss."""

import tempfile

from hf_tiny_clap import tiny_batch, tiny_clap  # a tiny random ClapModel, offline
from transformers import Trainer, TrainingArguments

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


model = tiny_clap()
# A submodule: the loss's parameters (SVR's radius, if you wrap it) train and save with
# the model, and DDP averages their gradients.
model.contrastive_loss = InfoNCELoss()
model.logit_scale_t.requires_grad_(False)  # one scale trained, as LAION-CLAP does
batch = tiny_batch(clips=32)  # stands in for a dataset of processor outputs
dataset = [{key: value[i] for key, value in batch.items()} for i in range(32)]
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
