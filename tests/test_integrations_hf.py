"""Hugging Face ``ClapModel``'s built-in loss, pinned on a tiny random model (no download):
with ``return_loss=True`` it averages ``contrastive_loss(logits_per_text)`` and
``contrastive_loss(logits_per_audio.t())``, whose rows are both texts, so both are
text->audio cross-entropies and audio->text is never trained (``CLIPModel``'s
``clip_loss`` takes both directions). The docs page "Use it in your trainer" says so and
gives the fix, our symmetric loss on the model's scale."""

from __future__ import annotations

import math

import pytest
import torch

from contrastive_losses.functional import info_nce

pytest.importorskip("transformers", reason="the examples extra (transformers) is not installed")
from hf_tiny_clap import tiny_batch, tiny_clap


def test_clap_model_loss_is_text_to_audio_at_both_scales():
    model = tiny_clap()
    with torch.no_grad():
        model.logit_scale_t.fill_(math.log(20.0))  # the two scales apart: each one shows
    with torch.no_grad():
        out = model(**tiny_batch(clips=8), return_loss=True)
    audio, text = out.audio_embeds, out.text_embeds
    with torch.no_grad():
        scale_a, scale_t = model.logit_scale_a.exp(), model.logit_scale_t.exp()

    def terms(scale: torch.Tensor) -> dict[str, torch.Tensor]:
        _, t = info_nce(audio, text, logit_scale=scale, normalize=False, return_terms=True)
        return t

    at_a, at_t = terms(scale_a), terms(scale_t)
    text_to_audio = (at_t["loss_t2a"] + at_a["loss_t2a"]) / 2
    symmetric = info_nce(audio, text, logit_scale=scale_a, normalize=False)
    print(
        f"ClapModel loss {out.loss:.4f}; ours: text->audio at (scale_t, scale_a) "
        f"({at_t['loss_t2a']:.4f}, {at_a['loss_t2a']:.4f}) -> mean {text_to_audio:.4f}; "
        f"audio->text {at_a['loss_a2t']:.4f}; symmetric at scale_a {symmetric:.4f}"
    )
    torch.testing.assert_close(out.loss, text_to_audio, rtol=1e-5, atol=1e-6)
    assert abs(float(out.loss) - float(symmetric)) > 0.05
    # and none of it is audio->text: the same value with the audio->text terms swapped in
    assert abs(float((at_t["loss_a2t"] + at_a["loss_a2t"]) / 2 - out.loss)) > 0.05
