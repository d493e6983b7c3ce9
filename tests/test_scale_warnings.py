"""No silent mistakes with the model's scale (issue 28 item 2).

Four mistakes a new user makes with open_clip's or Hugging Face's scale, each of which
used to train silently on a wrong objective: the raw ``nn.Parameter`` (the log of the
scale) passed as ``logit_scale``; a temperature passed as the scale (below 1); a learnable
temperature, SigLIP scale and bias or SVR radius that never reach the optimizer (also
under ``torch.compile``); and the scale passed positionally where ``ids`` goes. Each
warns (once, at the caller's line, this file) or raises, and says the fix.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings

import pytest
import torch
import torch._dynamo
from helpers import CountingBackend
from torch import nn

from contrastive_losses import InfoNCELoss, KCLLoss, SigLIPLoss, SupportVectorRegularizer
from contrastive_losses import functional as CF
from contrastive_losses.integrations.open_clip import ClipLoss, SigLipLoss

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch._prims_common.check` is deprecated:FutureWarning"
)

B, D = 8, 6


def _pair(seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, D, generator=g, dtype=dtype)
    return a, torch.randn(B, D, generator=g, dtype=dtype) + a


def _recorded(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return [w for w in record if issubclass(w.category, UserWarning)]


def _only(record, text: str) -> list[warnings.WarningMessage]:
    return [w for w in record if text in str(w.message)]


# --------------------------------------------------------------- the raw log-scale


RAW_CALLS = {
    "InfoNCELoss": lambda a, t, s: InfoNCELoss()(a, t, logit_scale=s),
    "KCLLoss": lambda a, t, s: KCLLoss()(a, t[:, None], logit_scale=s),
    "SigLIPLoss": lambda a, t, s: SigLIPLoss(learnable=False)(a, t, logit_scale=s),
    "info_nce": lambda a, t, s: CF.info_nce(a, t, logit_scale=s),
    "siglip": lambda a, t, s: CF.siglip(a, t, logit_scale=s),
    "SVR": lambda a, t, s: SupportVectorRegularizer(InfoNCELoss(), radius=0.1)(a, t, logit_scale=s),
    "open_clip ClipLoss": lambda a, t, s: ClipLoss()(a, t, s),
    "open_clip SigLipLoss": lambda a, t, s: SigLipLoss()(a, t, s, None),
}


@pytest.mark.parametrize("name", list(RAW_CALLS))
def test_raw_parameter_as_logit_scale_warns_once_at_the_callers_line(name):
    """``logit_scale=model.logit_scale`` (open_clip keeps log(1/0.07) = 2.66 there): one
    warning over three calls from one line, pointing at this file, naming the fix."""
    a, t = _pair()
    log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    call = RAW_CALLS[name]
    message = _warned_once_at_the_caller(call, a, t, log_scale, "got an nn.Parameter itself")
    assert "logit_scale=model.logit_scale.exp()" in message


def _warned_once_at_the_caller(call, a, t, scale, match: str) -> str:
    """``call(a, t, scale)`` three times from one line gives one warning matching
    ``match``, at that line of this file; its message."""

    def three_calls():
        for _ in range(3):
            call(a, t, scale)

    record = _only(_recorded(three_calls), match)
    assert len(record) == 1, [str(w.message) for w in record]
    _assert_points_at(record[0], call)
    return str(record[0].message)


def _assert_points_at(record: warnings.WarningMessage, call) -> None:
    """The warning names this file, at the line of ``call`` (a lambda above) that called
    the loss: the first frame outside the library and torch."""
    assert record.filename == __file__
    first = call.__code__.co_firstlineno
    assert first <= record.lineno <= first + 3, (record.lineno, first)


def test_exped_or_plain_tensor_scale_does_not_warn():
    """The right habits are silent: ``model.logit_scale.exp()`` (not a leaf), a plain
    tensor (no Parameter), the bias Parameter of SigLIP (used as is)."""
    a, t = _pair()
    log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    bias = nn.Parameter(torch.tensor(-10.0))

    def right():
        InfoNCELoss()(a, t, logit_scale=log_scale.exp())
        InfoNCELoss()(a, t, logit_scale=torch.tensor(14.3))
        SigLipLoss()(a, t, log_scale.exp(), bias)

    assert _recorded(right) == []


# --------------------------------------------------------- a temperature as the scale


@pytest.mark.parametrize("name", ["InfoNCELoss", "info_nce", "siglip", "open_clip ClipLoss"])
def test_scale_below_one_warns_once_with_the_inverse(name):
    """A temperature (0.07) passed as the scale leaves every loss near log B: one warning
    per line, naming 1/0.07; above 1 nothing."""
    a, t = _pair()
    call = RAW_CALLS[name]
    temperature = torch.tensor(0.07)  # the temperature, not 1/temperature
    match = "is below 1: it looks like a temperature"
    assert "logit_scale=14.29" in _warned_once_at_the_caller(call, a, t, temperature, match)
    assert not _only(_recorded(lambda: call(a, t, torch.tensor(1.0))), "below 1")


def test_scale_from_a_parameter_initialised_with_the_temperature_warns():
    """``nn.Parameter(torch.tensor(0.07)).exp()`` is 1.07: below 2, no CLIP/CLAP scale;
    one warning per line, at the caller's line, naming the log-scale initialisation. A
    scale of 2 or more is quiet."""
    a, t = _pair()
    param = nn.Parameter(torch.tensor(0.07))

    def calls():
        for _ in range(3):
            InfoNCELoss()(a, t, logit_scale=param.exp())  # the line named

    record = _only(_recorded(calls), "is below 2")
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert "logit_scale=1.073" in message and "math.log(1 / 0.07)" in message
    assert record[0].filename == __file__
    assert record[0].lineno == calls.__code__.co_firstlineno + 2
    quiet = _recorded(lambda: CF.info_nce(a, t, logit_scale=torch.tensor(2.0)))
    assert _only(quiet, "is below 2") == []


# each call line warns once per session: one log-scale per loss (CLIP's initial one, SigLIP's
# log 10, the largest, log 100)
LOG_SCALES = {
    "InfoNCELoss": math.log(1 / 0.07),
    "KCLLoss": math.log(100.0),
    "info_nce": math.log(1 / 0.07),
    "siglip": math.log(10.0),
    "SVR": math.log(1 / 0.07),
    "open_clip ClipLoss": math.log(1 / 0.07),
    "open_clip SigLipLoss": math.log(10.0),
}


@pytest.mark.parametrize("name", list(LOG_SCALES))
def test_a_log_scale_passed_without_exp_warns_naming_exp(name):
    """Issue 48: open_clip's log-scale detached from its Parameter (``log(1/0.07)`` =
    2.66, SigLIP's ``log 10`` = 2.30) is no ``nn.Parameter``, so it escaped the raw
    Parameter warning and scaled the logits by 2.66 instead of 14.3. One warning over
    three calls from one line, at the caller's line, naming ``.exp()`` and the scale the
    log stands for."""
    a, t = _pair()
    call, log_scale = RAW_CALLS[name], torch.tensor(LOG_SCALES[name])
    message = _warned_once_at_the_caller(call, a, t, log_scale, "looks like the log of the scale")
    assert "logit_scale=model.logit_scale.exp()" in message
    assert f"instead of {math.exp(LOG_SCALES[name]):.3g}" in message


def test_a_scale_of_five_or_more_or_a_temperature_setting_is_quiet():
    """The exp'd scales (CLIP's 14.3, SigLIP's 10), 5 itself, and the same value as a
    temperature setting give no warning; 4.9 does (its own line)."""
    a, t = _pair()
    for scale in (1 / 0.07, 10.0, 5.0):
        assert _recorded(lambda s=scale: CF.info_nce(a, t, logit_scale=torch.tensor(s))) == []
    assert _recorded(lambda: CF.info_nce(a, t, temperature=1 / math.log(1 / 0.07))) == []
    record = _recorded(lambda: CF.info_nce(a, t, logit_scale=torch.tensor(4.9)))
    assert len(_only(record, "looks like the log of the scale")) == 1


def test_a_frozen_parameter_holding_the_scale_is_named_the_scale():
    """``nn.Parameter(torch.tensor(14.29), requires_grad=False)``: its exp (1.6e6) would
    exceed every allowed scale, so it is the scale itself, not open_clip's log-scale."""
    a, t = _pair()
    scale = nn.Parameter(torch.tensor(14.29), requires_grad=False)
    call = lambda: InfoNCELoss()(a, t, logit_scale=scale)  # noqa: E731
    record = _recorded(call)
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert "which is the scale itself, not its log" in message
    assert "logit_scale=torch.tensor(14.29)" in message
    assert "2.66 instead of 14.3" not in message  # not the "Parameter itself" one
    assert (record[0].filename, record[0].lineno) == (__file__, call.__code__.co_firstlineno)


def test_a_modules_temperature_like_a_scale_warns_once_at_the_callers_line():
    """``InfoNCELoss(temperature=14.29)`` warns when built, at that line, and its calls
    (even under the default filters, from another line) do not warn again."""
    a, t = _pair()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        loss_fn = InfoNCELoss(temperature=14.29)
        line = sys._getframe().f_lineno - 1
        for _ in range(3):
            loss_fn(a, t)
        KCLLoss(14.29)(a, t[:, None])
    record = [w for w in record if "looks like a logit scale" in str(w.message)]
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line), (__file__, line + 4)]


@pytest.mark.parametrize(
    ("build", "text"),
    [
        (lambda: InfoNCELoss(temperature=0.8), "temperature=0.8 is above 0.5"),
        (lambda: SigLIPLoss(scale_init=1.5), "scale_init=1.5 is below 2"),
        (lambda: CF.siglip(*_pair(), 1.5), "scale=1.5 is below 2"),
        (
            lambda: SupportVectorRegularizer(InfoNCELoss(), radius=0.1, temperature=0.9),
            "temperature=0.9 is above 0.5",
        ),
    ],
    ids=["InfoNCELoss", "SigLIPLoss", "siglip", "SVR"],
)
def test_a_scale_below_two_warns_at_construction_or_first_call(build, text):
    record = _only(_recorded(build), text)
    assert len(record) == 1, [str(w.message) for w in _recorded(build)]
    _assert_points_at(record[0], build)


def test_scale_below_one_is_a_value_check():
    """It reads the value (a host sync): with the value checks off nothing is read, so
    nothing warns."""
    a, t = _pair()
    record = _recorded(
        lambda: CF.info_nce(a, t, logit_scale=torch.tensor(0.07), validate_args=False)
    )
    assert record == []


# ------------------------------------------------------------ the scale as ``ids``


@pytest.mark.parametrize(
    "call",
    [
        lambda a, t, s: InfoNCELoss()(a, t, s),
        lambda a, t, s: SigLIPLoss(learnable=False)(a, t, s),
        lambda a, t, s: SupportVectorRegularizer(InfoNCELoss(), radius=0.1)(a, t, s),
        lambda a, t, s: CF.info_nce(a, t, 0.07, ids=s),
    ],
    ids=["InfoNCELoss", "SigLIPLoss", "SVR", "info_nce"],
)
def test_scale_passed_positionally_names_logit_scale(call):
    a, t = _pair()
    with pytest.raises(ValueError, match=r"ids: .* 0-d tensor.*logit_scale=model\.logit_scale"):
        call(a, t, torch.tensor(14.3))


# ------------------------------------------------ learnable values that never train


LEARNERS = {
    "InfoNCELoss": (lambda: InfoNCELoss(0.07, learnable_temperature=True), "temperature"),
    "KCLLoss": (lambda: KCLLoss(0.07, learnable_temperature=True), "temperature"),
    "SigLIPLoss": (SigLIPLoss, "scale and bias"),
    "SVR": (lambda: SupportVectorRegularizer(InfoNCELoss(0.1), radius="dynamic"), "radius"),
}


def _train(loss_fn, steps: int, *, in_optimizer: bool, compiled=None, lr: float = 0.05):
    """``steps`` optimizer steps of a tiny encoder; the loss's parameters in the optimizer
    or not. Returns the UserWarnings recorded."""
    torch.manual_seed(0)
    enc = nn.Linear(D, 4)
    params = [*enc.parameters(), *(loss_fn.parameters() if in_optimizer else [])]
    opt = torch.optim.SGD(params, lr=lr)
    fn = loss_fn if compiled is None else compiled
    kcl = isinstance(loss_fn, KCLLoss)

    def loop():
        for _ in range(steps):
            a, t = _pair(seed=_)
            audio, text = enc(a), enc(t)
            loss = fn(audio, text[:, None] if kcl else text)
            opt.zero_grad()
            loss.backward()
            opt.step()  # the line the warning must name

    return _only(_recorded(loop), "never changed")


def _warned_line(record) -> str:
    return open(record.filename).read().splitlines()[record.lineno - 1].strip()


@pytest.mark.parametrize("name", list(LEARNERS))
def test_learnable_values_left_out_of_the_optimizer_warn_once(name):
    make, what = LEARNERS[name]
    loss_fn = make()
    loss_fn.stuck_after = 5
    record = _train(loss_fn, 20, in_optimizer=False)
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert what in message and "loss_fn.parameters()" in message and "5 optimizer steps" in message
    assert record[0].filename == __file__ and _warned_line(record[0]).startswith("opt.step()")


@pytest.mark.parametrize("name", list(LEARNERS))
def test_learnable_values_in_the_optimizer_are_silent(name):
    loss_fn = LEARNERS[name][0]()
    loss_fn.stuck_after = 5
    before = [p.detach().clone() for p in loss_fn.parameters()]
    assert _train(loss_fn, 20, in_optimizer=True) == []
    assert any(not torch.equal(p, q) for p, q in zip(loss_fn.parameters(), before, strict=True))


def test_no_stuck_warning_in_eval_with_checks_off_or_when_frozen():
    quiet = [
        InfoNCELoss(0.07, learnable_temperature=True).eval(),
        InfoNCELoss(0.07, learnable_temperature=True, validate_args=False),
        SigLIPLoss(validate_args=False),
    ]
    frozen = SigLIPLoss()
    for p in frozen.parameters():
        p.requires_grad_(False)
    for loss_fn in [*quiet, frozen]:
        loss_fn.stuck_after = 3
        assert _train(loss_fn, 10, in_optimizer=False) == []


def test_a_copy_watches_its_own_parameters():
    """``copy.deepcopy`` (and unpickling) drop tensor hooks: the copy arms its own."""
    loss_fn = copy.deepcopy(InfoNCELoss(0.07, learnable_temperature=True))
    loss_fn.stuck_after = 4
    assert len(_train(loss_fn, 10, in_optimizer=False)) == 1


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("name", list(LEARNERS))
def test_stuck_warning_under_torch_compile_with_one_graph(name):
    """The watch lives on autograd's and the optimizer's side (a post-accumulate-grad
    hook, the global optimizer post-step hook), so a compiled loss
    (``fullgraph=True``: a graph break would raise) warns the same, with one graph and no
    recompile, and in the optimizer stays silent."""
    for in_optimizer in (False, True):
        torch._dynamo.reset()
        loss_fn = LEARNERS[name][0]()
        loss_fn.stuck_after = 5
        counter = CountingBackend()
        compiled = torch.compile(loss_fn, fullgraph=True, backend=counter)
        record = _train(loss_fn, 12, in_optimizer=in_optimizer, compiled=compiled)
        assert counter.calls == 1, f"{counter.calls} graphs"
        assert len(record) == (0 if in_optimizer else 1)
        if record:
            assert record[0].filename == __file__
            assert _warned_line(record[0]).startswith("opt.step()")
