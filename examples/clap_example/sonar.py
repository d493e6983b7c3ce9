"""SONAR multilingual text encoder as a transformers ``M2M100Encoder`` with masked mean pooling.

SONAR's text encoder (Duquenne et al. 2023) is the NLLB-1B encoder (24 layers, d_model 1024,
16 heads, FFN 8192, ReLU, pre-norm, scaled embeddings) whose sentence embedding is the mean of
the encoder's last hidden states over the non-padding tokens. Its weights have been ported to the
transformers layout (e.g. the hub repository ``cointegrated/SONAR_200_text_encoder``: a
``config.json`` of model type ``m2m_100``, the encoder weights, and the NLLB tokenizer files).
Sentences are tokenised with the NLLB tokenizer in its default (non-legacy) mode:
``[lang_code] tokens </s>``, the language code being the NLLB one (``eng_Latn``, ``fra_Latn``...).

``sonar-space``/``fairseq2`` are not needed. :func:`fairseq2_to_m2m100_keys` maps a fairseq2
SONAR encoder state dict (as found inside the ML-CLAP checkpoint) to these names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .sources import HubRepo, hub_snapshot, locate

#: The eight languages of the papers' multilingual AudioCaps/Clotho, English first.
PAPER_LANGUAGES: tuple[str, ...] = (
    "eng_Latn",
    "fra_Latn",
    "deu_Latn",
    "spa_Latn",
    "nld_Latn",
    "cat_Latn",
    "jpn_Jpan",
    "zho_Hans",
)

#: Short names accepted in manifests and on the command line.
LANGUAGE_ALIASES: dict[str, str] = {
    "en": "eng_Latn", "eng": "eng_Latn", "english": "eng_Latn",
    "fr": "fra_Latn", "fra": "fra_Latn", "french": "fra_Latn",
    "de": "deu_Latn", "deu": "deu_Latn", "german": "deu_Latn",
    "es": "spa_Latn", "spa": "spa_Latn", "spanish": "spa_Latn",
    "nl": "nld_Latn", "nld": "nld_Latn", "dutch": "nld_Latn",
    "ca": "cat_Latn", "cat": "cat_Latn", "catalan": "cat_Latn",
    "ja": "jpn_Jpan", "jpn": "jpn_Jpan", "japanese": "jpn_Jpan",
    "zh": "zho_Hans", "zho": "zho_Hans", "chinese": "zho_Hans",
}  # fmt: skip

SONAR_HUB_ID = "cointegrated/SONAR_200_text_encoder"


def canonical_language(code: str) -> str:
    """``"fr"``/``"fra"``/``"fra_Latn"`` -> ``"fra_Latn"``; other NLLB codes pass through."""
    code = code.strip()
    return LANGUAGE_ALIASES.get(code.lower(), code)


def sonar_config(**overrides: Any) -> Any:
    """The ``M2M100Config`` of SONAR's text encoder (``text_sonar_basic_encoder``), plus overrides.

    Tests pass tiny sizes (``d_model=32, encoder_layers=2, ...``) to get a model of the same class.
    """
    from transformers import M2M100Config

    values: dict[str, Any] = {
        "vocab_size": 256206,
        "max_position_embeddings": 1024,
        "encoder_layers": 24,
        "decoder_layers": 0,
        "encoder_attention_heads": 16,
        "encoder_ffn_dim": 8192,
        "d_model": 1024,
        "encoder_layerdrop": 0.0,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation_dropout": 0.1,
        "activation_function": "relu",
        "scale_embedding": True,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }
    values.update(overrides)
    return M2M100Config(**values)


class SonarTextEncoder(nn.Module):
    """``M2M100Encoder`` + mean pooling over the attention mask -> ``(N, d_model)``.

    Args:
        encoder: a ``transformers`` ``M2M100Encoder``.
        tokenizer: an NLLB tokenizer (anything with ``src_lang`` and the NLLB language codes).
        max_length: captions are truncated to this many tokens (language code and ``</s>``
            included), as SONAR does (512 there; captions are far shorter).
    """

    encoder: Any  # transformers M2M100Encoder (typed loosely: transformers is optional)

    def __init__(self, encoder: nn.Module, tokenizer: Any, max_length: int = 128) -> None:
        super().__init__()
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_length = max_length

    @property
    def embed_dim(self) -> int:
        return int(self.encoder.config.d_model)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def tokenize(self, texts: Sequence[str], languages: Sequence[str]) -> dict[str, Tensor]:
        """Tokenise a mixed-language batch: each text gets its own language code.

        Texts are grouped by language (the tokenizer's ``src_lang`` is per call), then padded
        together so the encoder runs once on the whole batch. Returns ``input_ids`` and
        ``attention_mask`` ``(N, L)`` in the order of ``texts``.
        """
        return tokenize_multilingual(self.tokenizer, texts, languages, self.max_length)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return masked_mean(hidden, attention_mask)

    def encode(self, texts: Sequence[str], languages: Sequence[str]) -> Tensor:
        device = next(self.encoder.parameters()).device
        batch = self.tokenize(texts, languages)
        return self(batch["input_ids"].to(device), batch["attention_mask"].to(device))


def masked_mean(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of ``hidden`` ``(N, L, D)`` over positions where ``attention_mask`` ``(N, L)`` is 1."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (N, L, 1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def tokenize_multilingual(
    tokenizer: Any, texts: Sequence[str], languages: Sequence[str], max_length: int
) -> dict[str, Tensor]:
    """See :meth:`SonarTextEncoder.tokenize`."""
    if len(texts) != len(languages):
        raise ValueError(f"texts ({len(texts)}) and languages ({len(languages)}) differ in length")
    ids: list[list[int] | None] = [None] * len(texts)
    by_language: dict[str, list[int]] = {}
    for i, lang in enumerate(languages):
        by_language.setdefault(lang, []).append(i)
    previous = getattr(tokenizer, "src_lang", None)
    try:
        for lang, rows in by_language.items():
            if tokenizer.convert_tokens_to_ids(lang) == tokenizer.unk_token_id:
                raise ValueError(f"language {lang!r} is not a language code of the tokenizer")
            tokenizer.src_lang = lang
            encoded = tokenizer(
                [texts[i] for i in rows], truncation=True, max_length=max_length, padding=False
            )["input_ids"]
            for i, row in zip(rows, encoded, strict=True):
                ids[i] = list(row)
    finally:
        if previous is not None:
            tokenizer.src_lang = previous
    length = max(len(row) for row in ids if row is not None)
    input_ids = torch.full((len(texts), length), int(tokenizer.pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(texts), length), dtype=torch.long)
    for i, row in enumerate(ids):
        assert row is not None  # every index was filled above
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _resolve_dir(name_or_path: str | os.PathLike[str]) -> Path:
    """A local directory, or a hub repository asked for as ``hf:owner/name`` (see
    :mod:`clap_example.sources`)."""
    where = locate(name_or_path, "sonar")
    if isinstance(where, HubRepo):
        return hub_snapshot(where, "sonar")
    if not where.is_dir():
        raise ValueError(f"sonar: {where} is a file; pass the directory holding config.json")
    return where


_ENCODER_PREFIXES = ("model.encoder.", "encoder.", "")


def strip_encoder_prefix(state_dict: dict[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """Keys saved as ``M2M100Encoder`` (no prefix), ``M2M100EncoderModel`` (``encoder.``) or a
    full ``M2M100Model``/``ForConditionalGeneration`` (``model.encoder.``) -> encoder names."""
    for prefix in _ENCODER_PREFIXES:
        out = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if out and set(out) & expected:
            if "embed_tokens.weight" not in out:
                for shared in ("model.shared.weight", "shared.weight"):
                    if shared in state_dict:
                        out["embed_tokens.weight"] = state_dict[shared]
            return out
    raise ValueError(
        "sonar: the checkpoint holds no M2M100 encoder weights (looked for keys like "
        f"'layers.0.self_attn.q_proj.weight' under prefixes {_ENCODER_PREFIXES}); "
        f"first keys: {sorted(state_dict)[:5]}"
    )


def _read_weights(directory: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        state: dict[str, Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    files = sorted(directory.glob("pytorch_model*.bin"))
    if files:
        state = {}
        for file in files:
            state.update(torch.load(str(file), map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"sonar: no *.safetensors or pytorch_model*.bin in {directory}")


def load_sonar_tokenizer(name_or_path: str | os.PathLike[str]) -> Any:
    """The NLLB tokenizer saved with the encoder (``tokenizer.json`` or the sentencepiece file)."""
    from transformers import AutoTokenizer

    directory = _resolve_dir(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if tokenizer.convert_tokens_to_ids("eng_Latn") == tokenizer.unk_token_id:
        raise ValueError(f"sonar tokenizer in {directory} has no NLLB language codes (eng_Latn...)")
    return tokenizer


def load_sonar_encoder(
    name_or_path: str | os.PathLike[str],
    *,
    weights: bool = True,
    max_length: int = 128,
    config_overrides: dict[str, Any] | None = None,
) -> SonarTextEncoder:
    """Build the SONAR text encoder from a directory (or ``hf:owner/name``) with ``config.json``,
    weights and tokenizer.

    With ``weights=False`` the encoder is randomly initialised from the directory's config
    (tests, or training from scratch). Layer drop is forced to 0 unless overridden (it leaves
    parameters unused in a step, which DDP rejects).
    """
    directory = _resolve_dir(name_or_path)  # a missing path fails before the imports below
    from transformers import M2M100Config
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100Encoder

    config = M2M100Config.from_pretrained(str(directory))
    config.encoder_layerdrop = 0.0
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    encoder = M2M100Encoder(config)
    if weights:
        expected = set(encoder.state_dict())
        state = strip_encoder_prefix(_read_weights(directory), expected)
        state = {k: v for k, v in state.items() if k != "embed_positions.weights"}
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing:
            raise ValueError(f"sonar weights in {directory}: missing {missing[:8]}")
        encoder.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True)
        del unexpected
    tokenizer = load_sonar_tokenizer(directory)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"sonar: tokenizer has {len(tokenizer)} tokens but the encoder's vocab_size is "
            f"{config.vocab_size}"
        )
    return SonarTextEncoder(encoder, tokenizer, max_length=max_length)


def fairseq2_to_m2m100_keys(state_dict: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """Rename a fairseq2 SONAR text encoder state dict to ``M2M100Encoder`` names.

    fairseq2: ``encoder_frontend.embed.weight``, ``encoder.layers.{i}.self_attn.{q,k,v}_proj``,
    ``...self_attn.output_proj``, ``...self_attn_layer_norm``, ``...ffn.inner_proj``,
    ``...ffn.output_proj``, ``...ffn_layer_norm``, final ``layer_norm``. The special tokens of the
    fairseq2 vocabulary are ordered ``<pad> <unk> <s> </s>`` and NLLB's ``<s> <pad> </s> <unk>``:
    the first four embedding rows are permuted so the NLLB tokenizer can be used. Keys outside
    ``prefix`` and the sinusoidal position buffers are dropped.
    """
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix) :]
        if key == "encoder_frontend.embed.weight":
            value = value.clone()
            value[[0, 1, 2, 3]] = value[[2, 0, 3, 1]].clone()
            out["embed_tokens.weight"] = value
            continue
        if key.startswith("encoder_frontend."):
            continue  # position encoder buffers
        if key.startswith("encoder.layer_norm."):
            key = key[len("encoder.") :]
        elif key.startswith("encoder."):
            key = key[len("encoder.") :]
        key = (
            key.replace(".self_attn.output_proj.", ".self_attn.out_proj.")
            .replace(".ffn.inner_proj.", ".fc1.")
            .replace(".ffn.output_proj.", ".fc2.")
            .replace(".ffn_layer_norm.", ".final_layer_norm.")
        )
        out[key] = value
    return out
