"""The public names of the package and of its public faces, pinned.

Internal moves (issue 15: one module per method) must leave every name users import
where it was, with the same signature. A change here is a change of the public API: make
it on purpose, and note it in CHANGELOG.md.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

PUBLIC_ALL = {
    "contrastive_losses": [
        "ASKLoss",
        "CACLLoss",
        "ContrastivePair",
        "GradCache",
        "InfoNCELoss",
        "KCLLoss",
        "KnowledgeBank",
        "MatryoshkaLoss",
        "RadiusPredictor",
        "SigLIPLoss",
        "SupportVectorRegularizer",
        "diagnostics",
        "distributed",
        "functional",
        "metrics",
        "sample_languages",
        "set_default_validate_args",
    ],
    "contrastive_losses.diagnostics": [
        "Forces",
        "force_decomposition",
        "out_of_batch_influence",
        "representation_drift_mismatch",
        "trajectory_drift",
    ],
    "contrastive_losses.functional": [
        "ask",
        "cacl",
        "info_nce",
        "kcl",
        "l2_normalize",
        "sample_languages",
        "siglip",
        "sinkhorn",
        "support_vector_term",
    ],
    "contrastive_losses.integrations": [],
    "contrastive_losses.integrations.open_clip": ["ClipLoss", "SigLipLoss"],
    "contrastive_losses.integrations.open_clip_train": ["Installation", "install", "main"],
    "contrastive_losses.losses": [
        "CACLLoss",
        "ContrastivePair",
        "InfoNCELoss",
        "KCLLoss",
        "SigLIPLoss",
    ],
    "contrastive_losses.metrics": [
        "RetrievalReport",
        "audio_text_retrieval",
        "embedding_distance",
        "embedding_gap",
        "map_at_k",
        "mean_rank_variance",
        "recall_at_k",
        "retrieval_ranks",
        "retrieval_report",
    ],
}

# Importable from contrastive_losses.functional although not in its __all__ (docs and
# user code read them: the temperature floor, the radius bound and its check).
FUNCTIONAL_EXTRAS = ["MAX_RADIUS", "MIN_TEMPERATURE", "check_radius"]

# Submodules reachable as attributes of the package.
SUBMODULES = [
    "ask",
    "bank",
    "diagnostics",
    "distributed",
    "functional",
    "grad_cache",
    "losses",
    "matryoshka",
    "metrics",
    "ot",
    "svr",
]

SIGNATURES = {
    "contrastive_losses.ASKLoss": (
        "(bank: 'KnowledgeBank', k: 'int' = 10, injection_ratio: 'float' = 0.2, ot_weight: "
        "'float' = 0.2, lambda_fine: 'float' = 0.2, lambda_coarse: 'float' = 0.3, epsilon: "
        "'float' = 0.05, temperature: 'float' = 0.07, *, k_coarse: 'int' = 10, use_coarse: 'bool' "
        "= True, sinkhorn_iters: 'int' = 50, detach_plan: 'bool' = True, normalize: 'bool' = "
        "True, reduction: 'str' = 'mean', gather: 'bool | None' = None, validate_args: 'bool | "
        "None' = None) -> 'None'"
    ),
    "contrastive_losses.CACLLoss": (
        "(temperature: 'float' = 0.07, *, english_index: 'int' = 0, learnable_temperature: 'bool' "
        "= False, max_logit_scale: 'float' = 100.0, normalize: 'bool' = True, reduction: 'str' = "
        "'mean', gather: 'bool | None' = None, chunk_size: 'int | None' = None, validate_args: "
        "'bool | None' = None) -> 'None'"
    ),
    "contrastive_losses.ContrastivePair": (
        "(audio: ForwardRef('Tensor'), text: ForwardRef('Tensor'), mask: "
        "ForwardRef('Tensor | None') = None)"
    ),
    "contrastive_losses.InfoNCELoss": (
        "(temperature: 'float' = 0.07, *, learnable_temperature: 'bool' = False, "
        "max_logit_scale: 'float' = 100.0, normalize: 'bool' = True, reduction: 'str' = "
        "'mean', gather: 'bool | None' = None, chunk_size: 'int | None' = None, "
        "validate_args: 'bool | None' = None, guide_margin: 'float' = 0.0, guide_strategy: "
        "'str' = 'absolute') -> 'None'"
    ),
    "contrastive_losses.KCLLoss": (
        "(temperature: 'float' = 0.07, *, negatives: 'str' = 'per_language', "
        "learnable_temperature: 'bool' = False, max_logit_scale: 'float' = 100.0, normalize: "
        "'bool' = True, reduction: 'str' = 'mean', gather: 'bool | None' = None, chunk_size: "
        "'int | None' = None, validate_args: 'bool | None' = None, guide_margin: 'float' = "
        "0.0, guide_strategy: 'str' = 'absolute') -> 'None'"
    ),
    "contrastive_losses.KnowledgeBank": (
        "(dim: 'int', backend: 'str' = 'auto', num_prototypes: 'int' = 512, *, dtype:"
        " 'torch.dtype' = torch.float32, index: 'str' = 'flat', nlist: 'int | None' ="
        " None, nprobe: 'int' = 16, kmeans_iters: 'int' = 20, refresh_every: 'int' = "
        "15, seed: 'int' = 0, chunk_size: 'int' = 65536) -> 'None'"
    ),
    "contrastive_losses.MatryoshkaLoss": (
        "(base: 'nn.Module', dims: 'Sequence[int]', weights: 'Sequence[float] | None' = None) "
        "-> 'None'"
    ),
    "contrastive_losses.RadiusPredictor": (
        "(num_features: 'int' = 32, hidden: 'int' = 64, radius_init: 'float' = 0.1, *, "
        "validate_args: 'bool | None' = None) -> 'None'"
    ),
    "contrastive_losses.SigLIPLoss": (
        "(scale_init: 'float' = 10.0, bias_init: 'float' = -10.0, *, learnable: 'bool' = "
        "True, normalize: 'bool' = True, reduction: 'str' = 'mean', gather: 'bool | None' = "
        "None, chunk_size: 'int | None' = None, validate_args: 'bool | None' = None, "
        "guide_margin: 'float' = 0.0, guide_strategy: 'str' = 'absolute') -> 'None'"
    ),
    "contrastive_losses.SupportVectorRegularizer": (
        "(base: 'nn.Module', radius: 'str | float' = 'dynamic', direction: 'str' = 'bi', alpha: "
        "'float' = 1.0, beta: 'float' = 1.0, constraint: 'bool | None' = None, radius_init: "
        "'float' = 0.1, num_features: 'int' = 32, hidden: 'int' = 64, temperature: 'float | None' "
        "= None, *, validate_args: 'bool | None' = None) -> 'None'"
    ),
    "contrastive_losses.diagnostics.Forces": (
        "(pull: ForwardRef('Tensor'), push: ForwardRef('Tensor'), direction: "
        "ForwardRef('Tensor'), push_parallel: ForwardRef('Tensor'), "
        "push_perpendicular: ForwardRef('Tensor'), negative_parallel: "
        "ForwardRef('Tensor'), negative_perpendicular: ForwardRef('Tensor'), "
        "distance: ForwardRef('Tensor'), radius: ForwardRef('Tensor | None'))"
    ),
    "contrastive_losses.diagnostics.force_decomposition": (
        "(anchor: 'Tensor', candidates: 'Tensor', temperature: 'float | Tensor', "
        "radius: 'float | Tensor | None' = None, *, normalize: 'bool' = True, mask: "
        "'Tensor | None' = None) -> 'Forces'"
    ),
    "contrastive_losses.diagnostics.out_of_batch_influence": (
        "(loss_fn: 'Callable[..., Tensor]', *args: 'Any', outside: 'Tensor | "
        "Sequence[Tensor]', reduction: 'str' = 'none', **kwargs: 'Any') -> 'Tensor'"
    ),
    "contrastive_losses.diagnostics.representation_drift_mismatch": (
        "(current: 'Tensor', stale: 'Tensor', *, metric: 'str' = 'cosine', reduction:"
        " 'str' = 'mean') -> 'Tensor'"
    ),
    "contrastive_losses.diagnostics.trajectory_drift": (
        "(update: 'Tensor', pull: 'Tensor', *, eps: 'float' = 1e-12) -> 'Tensor'"
    ),
    "contrastive_losses.functional.ask": (
        "(audio: 'Tensor', text: 'Tensor', fine_audio: 'Tensor', fine_text: 'Tensor', "
        "coarse_audio: 'Tensor | None' = None, coarse_text: 'Tensor | None' = None, *, "
        "injection_ratio: 'float' = 0.2, ot_weight: 'float' = 0.2, lambda_fine: 'float' = 0.2, "
        "lambda_coarse: 'float' = 0.3, epsilon: 'float' = 0.05, temperature: 'float' = 0.07, "
        "logit_scale: 'Tensor | None' = None, sinkhorn_iters: 'int' = 50, detach_plan: 'bool' = "
        "True, plan: 'Tensor | None' = None, normalize: 'bool' = True, reduction: 'str' = "
        "'mean', return_terms: 'bool' = False, validate_args: 'bool | None' = None) -> 'Tensor "
        "| tuple[Tensor, dict[str, Tensor]]'"
    ),
    "contrastive_losses.functional.cacl": (
        "(audio: 'Tensor', english: 'Tensor', other: 'Tensor', temperature: 'float | Tensor' = "
        "0.07, *, logit_scale: 'Tensor | None' = None, normalize: 'bool' = True, reduction: "
        "'str' = 'mean', gather: 'bool | None' = None, return_terms: 'bool' = False, "
        "chunk_size: 'int | None' = None, validate_args: 'bool | None' = None) -> 'Tensor | "
        "tuple[Tensor, Terms]'"
    ),
    "contrastive_losses.functional.info_nce": (
        "(audio: 'Tensor', text: 'Tensor', temperature: 'float | Tensor' = 0.07, *, "
        "logit_scale: 'Tensor | None' = None, ids: 'Tensor | None' = None, normalize: 'bool' = "
        "True, reduction: 'str' = 'mean', gather: 'bool | None' = None, return_terms: 'bool' = "
        "False, chunk_size: 'int | None' = None, validate_args: 'bool | None' = None, "
        "hard_negatives: 'Tensor | None' = None, hard_negatives_mask: 'Tensor | None' = None, "
        "audio_hard_negatives: 'Tensor | None' = None, audio_hard_negatives_mask: 'Tensor | "
        "None' = None, guide: 'Tensor | tuple[Tensor, Tensor] | None' = None, guide_margin: "
        "'float' = 0.0, guide_strategy: 'str' = 'absolute') -> 'Tensor | tuple[Tensor, Terms]'"
    ),
    "contrastive_losses.functional.kcl": (
        "(audio: 'Tensor', text: 'Tensor', temperature: 'float | Tensor' = 0.07, *, "
        "logit_scale: 'Tensor | None' = None, mask: 'Tensor | None' = None, negatives: 'str' = "
        "'per_language', normalize: 'bool' = True, reduction: 'str' = 'mean', gather: 'bool | "
        "None' = None, return_terms: 'bool' = False, chunk_size: 'int | None' = None, "
        "validate_args: 'bool | None' = None, hard_negatives: 'Tensor | None' = None, "
        "hard_negatives_mask: 'Tensor | None' = None, audio_hard_negatives: 'Tensor | None' = "
        "None, audio_hard_negatives_mask: 'Tensor | None' = None, guide: 'Tensor | "
        "tuple[Tensor, Tensor] | None' = None, guide_margin: 'float' = 0.0, guide_strategy: "
        "'str' = 'absolute') -> 'Tensor | tuple[Tensor, Terms]'"
    ),
    "contrastive_losses.functional.l2_normalize": (
        "(x: 'Tensor', norms: 'Tensor | None' = None) -> 'Tensor'"
    ),
    "contrastive_losses.functional.sample_languages": (
        "(mask_or_num_languages: 'Tensor | int', batch_size: 'int | None' = None, *, "
        "generator: 'torch.Generator | None' = None, english_index: 'int' = 0, "
        "include_english: 'bool' = False) -> 'Tensor'"
    ),
    "contrastive_losses.functional.siglip": (
        "(audio: 'Tensor', text: 'Tensor', scale: 'float | Tensor' = 10.0, bias: 'float | "
        "Tensor' = -10.0, *, logit_scale: 'Tensor | None' = None, logit_bias: 'Tensor | None' ="
        " None, ids: 'Tensor | None' = None, normalize: 'bool' = True, reduction: 'str' = "
        "'mean', gather: 'bool | None' = None, return_terms: 'bool' = False, chunk_size: 'int |"
        " None' = None, validate_args: 'bool | None' = None, hard_negatives: 'Tensor | None' = "
        "None, hard_negatives_mask: 'Tensor | None' = None, audio_hard_negatives: 'Tensor | "
        "None' = None, audio_hard_negatives_mask: 'Tensor | None' = None, guide: 'Tensor | "
        "tuple[Tensor, Tensor] | None' = None, guide_margin: 'float' = 0.0, guide_strategy: "
        "'str' = 'absolute') -> 'Tensor | tuple[Tensor, Terms]'"
    ),
    "contrastive_losses.functional.sinkhorn": (
        "(scores: 'Tensor', epsilon: 'float' = 0.05, max_iter: 'int' = 100, tol: 'float | None' = "
        "None, *, method: 'str' = 'auto', check_every: 'int' = 10, validate_args: 'bool | None' = "
        "None) -> 'Tensor'"
    ),
    "contrastive_losses.functional.support_vector_term": (
        "(anchor: 'Tensor', candidates: 'Tensor', radius: 'float | Tensor', temperature: 'float "
        "| Tensor' = 0.07, *, logit_scale: 'Tensor | None' = None, normalize: 'bool' = True, "
        "mask: 'Tensor | None' = None, reduction: 'str' = 'mean', gather: 'bool | None' = None, "
        "chunk_size: 'int | None' = None, validate_args: 'bool | None' = None) -> 'Tensor'"
    ),
    "contrastive_losses.integrations.open_clip.ClipLoss": (
        "(local_loss: 'bool' = False, gather_with_grad: 'bool' = False, cache_labels: 'bool' = "
        "False, rank: 'int' = 0, world_size: 'int' = 1, use_horovod: 'bool' = False, *, "
        "chunk_size: 'int | None' = None, svr: 'Mapping[str, Any] | None' = None, "
        "validate_args: 'bool | None' = None) -> 'None'"
    ),
    "contrastive_losses.integrations.open_clip.SigLipLoss": (
        "(cache_labels: 'bool' = False, rank: 'int' = 0, world_size: 'int' = 1, dist_impl: 'str "
        "| None' = None, *, chunk_size: 'int | None' = None, svr: 'Mapping[str, Any] | None' = "
        "None, validate_args: 'bool | None' = None) -> 'None'"
    ),
    "contrastive_losses.losses.CACLLoss": (
        "(temperature: 'float' = 0.07, *, english_index: 'int' = 0, learnable_temperature: 'bool' "
        "= False, max_logit_scale: 'float' = 100.0, normalize: 'bool' = True, reduction: 'str' = "
        "'mean', gather: 'bool | None' = None, chunk_size: 'int | None' = None, validate_args: "
        "'bool | None' = None) -> 'None'"
    ),
    "contrastive_losses.losses.ContrastivePair": (
        "(audio: ForwardRef('Tensor'), text: ForwardRef('Tensor'), mask: "
        "ForwardRef('Tensor | None') = None)"
    ),
    "contrastive_losses.losses.InfoNCELoss": (
        "(temperature: 'float' = 0.07, *, learnable_temperature: 'bool' = False, "
        "max_logit_scale: 'float' = 100.0, normalize: 'bool' = True, reduction: 'str' = "
        "'mean', gather: 'bool | None' = None, chunk_size: 'int | None' = None, "
        "validate_args: 'bool | None' = None, guide_margin: 'float' = 0.0, guide_strategy: "
        "'str' = 'absolute') -> 'None'"
    ),
    "contrastive_losses.losses.KCLLoss": (
        "(temperature: 'float' = 0.07, *, negatives: 'str' = 'per_language', "
        "learnable_temperature: 'bool' = False, max_logit_scale: 'float' = 100.0, normalize: "
        "'bool' = True, reduction: 'str' = 'mean', gather: 'bool | None' = None, chunk_size: "
        "'int | None' = None, validate_args: 'bool | None' = None, guide_margin: 'float' = "
        "0.0, guide_strategy: 'str' = 'absolute') -> 'None'"
    ),
    "contrastive_losses.losses.SigLIPLoss": (
        "(scale_init: 'float' = 10.0, bias_init: 'float' = -10.0, *, learnable: 'bool' = "
        "True, normalize: 'bool' = True, reduction: 'str' = 'mean', gather: 'bool | None' = "
        "None, chunk_size: 'int | None' = None, validate_args: 'bool | None' = None, "
        "guide_margin: 'float' = 0.0, guide_strategy: 'str' = 'absolute') -> 'None'"
    ),
    "contrastive_losses.metrics.audio_text_retrieval": (
        "(audio: 'Tensor', text: 'Tensor', *, k: 'Sequence[int]' = (1, 5, 10), map_k:"
        " 'int' = 10, denominator: 'str' = 'n_relevant', normalize: 'bool' = True, "
        "chunk_size: 'int | None' = None, dim: 'int | None' = None) -> 'dict[str, dict[str, "
        "float]]'"
    ),
    "contrastive_losses.metrics.embedding_distance": (
        "(text: 'Tensor', anchor: 'int' = 0, *, normalize: 'bool' = True) -> 'Tensor'"
    ),
    "contrastive_losses.metrics.embedding_gap": (
        "(text: 'Tensor', anchor: 'int' = 0, *, normalize: 'bool' = True) -> 'Tensor'"
    ),
    "contrastive_losses.metrics.map_at_k": (
        "(sim: 'Tensor', relevance: 'Tensor | None' = None, *, query_ids: 'Tensor | "
        "None' = None, gallery_ids: 'Tensor | None' = None, k: 'int' = 10, "
        "denominator: 'str' = 'n_relevant', chunk_size: 'int | None' = None) -> "
        "'float'"
    ),
    "contrastive_losses.metrics.mean_rank_variance": "(ranks: 'Tensor') -> 'float'",
    "contrastive_losses.metrics.recall_at_k": (
        "(sim: 'Tensor', relevance: 'Tensor | None' = None, *, query_ids: 'Tensor | "
        "None' = None, gallery_ids: 'Tensor | None' = None, k: 'int | Sequence[int]' "
        "= (1, 5, 10), chunk_size: 'int | None' = None) -> 'float | dict[int, float]'"
    ),
    "contrastive_losses.metrics.retrieval_ranks": (
        "(sim: 'Tensor', relevance: 'Tensor | None' = None, *, query_ids: 'Tensor | "
        "None' = None, gallery_ids: 'Tensor | None' = None, chunk_size: 'int | None' "
        "= None) -> 'Tensor'"
    ),
    "contrastive_losses.metrics.retrieval_report": (
        "(audio: 'Tensor', text: 'Tensor', languages: 'Sequence[str] | None' = None, "
        "*, anchor: 'int | str' = 0, k: 'Sequence[int]' = (1, 5, 10), map_k: 'int' = "
        "10, denominator: 'str' = 'n_relevant', normalize: 'bool' = True, chunk_size:"
        " 'int | None' = None, dim: 'int | None' = None) -> 'RetrievalReport'"
    ),
    "contrastive_losses.set_default_validate_args": "(value: 'bool') -> 'None'",
    "contrastive_losses.sample_languages": (
        "(mask_or_num_languages: 'Tensor | int', batch_size: 'int | None' = None, *, "
        "generator: 'torch.Generator | None' = None, english_index: 'int' = 0, "
        "include_english: 'bool' = False) -> 'Tensor'"
    ),
}


# forward of every loss Module: the per-call arguments (logit_scale: issue 21).
FORWARD_SIGNATURES = {
    "ASKLoss": (
        "(self, audio: 'Tensor', text: 'Tensor', ids: 'Tensor | None' = None, return_terms: "
        "'bool' = False, *, logit_scale: 'Tensor | None' = None) -> 'Tensor | tuple[Tensor, "
        "dict[str, Tensor]]'"
    ),
    "CACLLoss": (
        "(self, audio: 'Tensor', english_or_text: 'Tensor', other: 'Tensor | None' = None, *, "
        "mask: 'Tensor | None' = None, generator: 'torch.Generator | None' = None, logit_scale: "
        "'Tensor | None' = None, return_terms: 'bool' = False) -> 'Tensor | tuple[Tensor, "
        "dict[str, Tensor]]'"
    ),
    "InfoNCELoss": (
        "(self, audio: 'Tensor', text: 'Tensor', ids: 'Tensor | None' = None, *, logit_scale: "
        "'Tensor | None' = None, return_terms: 'bool' = False, hard_negatives: 'Tensor | None' "
        "= None, hard_negatives_mask: 'Tensor | None' = None, audio_hard_negatives: 'Tensor | "
        "None' = None, audio_hard_negatives_mask: 'Tensor | None' = None, guide: 'Tensor | "
        "tuple[Tensor, Tensor] | None' = None) -> 'Tensor | tuple[Tensor, dict[str, Tensor]]'"
    ),
    "KCLLoss": (
        "(self, audio: 'Tensor', text: 'Tensor', mask: 'Tensor | None' = None, *, logit_scale: "
        "'Tensor | None' = None, return_terms: 'bool' = False, hard_negatives: 'Tensor | None' "
        "= None, hard_negatives_mask: 'Tensor | None' = None, audio_hard_negatives: 'Tensor | "
        "None' = None, audio_hard_negatives_mask: 'Tensor | None' = None, guide: 'Tensor | "
        "tuple[Tensor, Tensor] | None' = None) -> 'Tensor | tuple[Tensor, dict[str, Tensor]]'"
    ),
    "MatryoshkaLoss": (
        "(self, *inputs: 'Any', return_terms: 'bool' = False, **kwargs: 'Any') -> 'Tensor | "
        "tuple[Tensor, dict[str, Tensor]]'"
    ),
    "SigLIPLoss": (
        "(self, audio: 'Tensor', text: 'Tensor', ids: 'Tensor | None' = None, *, logit_scale: "
        "'Tensor | None' = None, logit_bias: 'Tensor | None' = None, return_terms: 'bool' = "
        "False, hard_negatives: 'Tensor | None' = None, hard_negatives_mask: 'Tensor | None' = "
        "None, audio_hard_negatives: 'Tensor | None' = None, audio_hard_negatives_mask: 'Tensor"
        " | None' = None, guide: 'Tensor | tuple[Tensor, Tensor] | None' = None) -> 'Tensor | "
        "tuple[Tensor, dict[str, Tensor]]'"
    ),
    "SupportVectorRegularizer": (
        "(self, *args: 'Any', logit_scale: 'Tensor | None' = None, logit_bias: 'Tensor | None' "
        "= None, return_terms: 'bool' = False, **kwargs: 'Any') -> 'Tensor | tuple[Tensor, "
        "dict[str, Tensor]]'"
    ),
}


@pytest.mark.parametrize("module", sorted(PUBLIC_ALL))
def test_all_is_pinned(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == PUBLIC_ALL[module]
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ lists {name}, which it lacks"


def test_functional_extras_and_submodules() -> None:
    functional = importlib.import_module("contrastive_losses.functional")
    for name in FUNCTIONAL_EXTRAS:
        assert hasattr(functional, name), name
    package = importlib.import_module("contrastive_losses")
    for name in SUBMODULES:
        assert isinstance(getattr(package, name), types.ModuleType), name


def test_same_object_everywhere() -> None:
    """A name exported by two faces is one object (no copies drifting apart)."""
    import contrastive_losses as cl
    from contrastive_losses import functional, losses

    assert cl.sample_languages is functional.sample_languages
    for name in losses.__all__:
        assert getattr(losses, name) is getattr(cl, name)


@pytest.mark.parametrize("qualified", sorted(SIGNATURES))
def test_signature_is_pinned(qualified: str) -> None:
    module, _, name = qualified.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    assert str(inspect.signature(obj)) == SIGNATURES[qualified]


@pytest.mark.parametrize("name", sorted(FORWARD_SIGNATURES))
def test_forward_signature_is_pinned(name: str) -> None:
    import contrastive_losses as cl

    assert str(inspect.signature(getattr(cl, name).forward)) == FORWARD_SIGNATURES[name]
