"""What a user sees when they look (issue 21 item 5): ``print(loss_fn)`` shows the
settings, ``help(Module.forward)`` documents the arguments, shapes and returns, and a
base loss' setting given to the regulariser says where it belongs."""

from __future__ import annotations

import inspect

import pytest
import torch

from contrastive_losses import (
    ASKLoss,
    CACLLoss,
    InfoNCELoss,
    KCLLoss,
    KnowledgeBank,
    RadiusPredictor,
    SigLIPLoss,
    SupportVectorRegularizer,
)

MODULES = [
    InfoNCELoss,
    SigLIPLoss,
    KCLLoss,
    CACLLoss,
    SupportVectorRegularizer,
    RadiusPredictor,
    ASKLoss,
]


@pytest.mark.parametrize(
    "loss_fn, expected",
    [
        (
            InfoNCELoss(chunk_size=64),
            "InfoNCELoss(temperature=0.07, normalize=True, reduction='mean', gather=None, "
            "chunk_size=64, validate_args=None)",
        ),
        (
            InfoNCELoss(0.05, learnable_temperature=True, validate_args=False),
            "InfoNCELoss(temperature=0.05, learnable_temperature=True, max_logit_scale=100.0, "
            "normalize=True, reduction='mean', gather=None, chunk_size=None, "
            "validate_args=False)",
        ),
        (
            KCLLoss(negatives="all_languages", reduction="sum"),
            "KCLLoss(temperature=0.07, negatives='all_languages', normalize=True, "
            "reduction='sum', gather=None, chunk_size=None, validate_args=None)",
        ),
        (
            CACLLoss(english_index=2, gather=False),
            "CACLLoss(temperature=0.07, english_index=2, normalize=True, reduction='mean', "
            "gather=False, chunk_size=None, validate_args=None)",
        ),
        (
            SigLIPLoss(5.0, -2.0, learnable=False, chunk_size=16),
            "SigLIPLoss(scale=5, bias=-2, learnable=False, normalize=True, reduction='mean', "
            "gather=None, chunk_size=16, validate_args=None)",
        ),
        (
            RadiusPredictor(num_features=8, hidden=4, validate_args=True),
            "num_features=8, validate_args=True",
        ),
    ],
)
def test_repr_shows_the_settings(loss_fn, expected: str) -> None:
    assert expected in repr(loss_fn)


def test_repr_shows_a_learnable_temperatures_current_value() -> None:
    loss_fn = InfoNCELoss(0.07, learnable_temperature=True)
    with torch.no_grad():
        loss_fn.log_logit_scale.fill_(torch.log(torch.tensor(1 / 0.05)))
    assert "temperature=0.05, learnable_temperature=True" in repr(loss_fn)


def test_regulariser_repr_shows_radius_weights_and_its_base() -> None:
    svr = SupportVectorRegularizer(
        KCLLoss(chunk_size=8), radius="static", direction="uni", alpha=0.5, beta=0.2
    )
    text = repr(svr)
    assert "radius='static' (0.1), direction='uni', alpha=0.5, beta=0.2" in text
    assert "constraint=False, temperature=None (the base's), validate_args=None" in text
    assert "(base): KCLLoss(temperature=0.07, negatives='per_language'" in text
    assert "chunk_size=8" in text
    fixed = SupportVectorRegularizer(InfoNCELoss(), radius=0.3, temperature=0.05)
    assert "radius='fixed' (0.3)" in repr(fixed) and "temperature=0.05" in repr(fixed)
    dynamic = SupportVectorRegularizer(InfoNCELoss(), num_features=8)
    assert "radius='dynamic'," in repr(dynamic)
    assert "(predictor): RadiusPredictor(\n    num_features=8" in repr(dynamic)


def test_ask_repr_shows_its_settings() -> None:
    g = torch.Generator().manual_seed(0)
    bank = KnowledgeBank(8, backend="torch", num_prototypes=2)
    bank.build(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.arange(6))
    text = repr(ASKLoss(bank, k=3, reduction="sum", validate_args=False))
    for part in (
        "k=3",
        "temperature=0.07",
        "reduction='sum'",
        "validate_args=False",
        "bank_size=6",
    ):
        assert part in text, text


def test_repr_of_a_module_on_the_meta_device() -> None:
    with torch.device("meta"):
        assert "temperature=<meta>" in repr(InfoNCELoss())


@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_every_forward_documents_arguments_and_returns(cls) -> None:
    doc = inspect.getdoc(cls.forward)
    assert doc is not None and doc != inspect.getdoc(torch.nn.Module.forward), cls
    assert "Args:" in doc and "Returns:" in doc, doc
    params = [p for p in inspect.signature(cls.forward).parameters if p != "self"]
    for name in params:
        assert name.lstrip("*") in doc, f"{cls.__name__}.forward does not document {name}"
    assert "(B, " in doc or "(..., B, N)" in doc, "no shapes"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"chunk_size": 8},
            "chunk_size: belongs to the base loss, not the regulariser: "
            "SupportVectorRegularizer(InfoNCELoss(chunk_size=8))",
        ),
        (
            {"reduction": "sum", "learnable_temperature": True},
            "reduction, learnable_temperature: belong to the base loss, not the regulariser: "
            "SupportVectorRegularizer(InfoNCELoss(reduction='sum', learnable_temperature=True))",
        ),
        ({"normalize": False}, "SupportVectorRegularizer(InfoNCELoss(normalize=False))"),
        ({"gather": True}, "SupportVectorRegularizer(InfoNCELoss(gather=True))"),
    ],
)
def test_base_settings_given_to_the_regulariser_say_where_they_go(kwargs, message) -> None:
    with pytest.raises(TypeError) as info:
        SupportVectorRegularizer(InfoNCELoss(), **kwargs)
    assert message in str(info.value)


def test_base_settings_name_the_base_given() -> None:
    with pytest.raises(TypeError, match=r"SupportVectorRegularizer\(KCLLoss\(negatives="):
        SupportVectorRegularizer(base=KCLLoss(), negatives="all_languages")
    with pytest.raises(TypeError, match=r"SupportVectorRegularizer\(SigLIPLoss\(scale_init="):
        SupportVectorRegularizer(SigLIPLoss(), scale_init=5.0)


def test_the_regulariser_keeps_its_signature_and_other_errors() -> None:
    params = inspect.signature(SupportVectorRegularizer).parameters
    assert "chunk_size" not in params and "base" in params  # help() shows the real one
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        SupportVectorRegularizer(InfoNCELoss(), foo=1)  # type: ignore[call-arg]
