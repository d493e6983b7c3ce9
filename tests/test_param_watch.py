"""The "never changed" watch counts optimizer steps, judges each parameter on its own and
keeps nothing alive (issue 33 item 2); an SVR rebuilt inside the loop is named (issue 34).

Each case is a training loop as users write them: a learning-rate warm-up held at 0, a
param group of the loss at lr 0, 64 micro-batches per optimizer step, SigLIP's bias left
out of the optimizer while its scale trains, losses built and dropped by the thousand.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from contrastive_losses import InfoNCELoss, SigLIPLoss, SupportVectorRegularizer

D = 6


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    a = torch.randn(8, D, generator=g)
    return a, a + torch.randn(8, D, generator=g)


def _loop(loss_fn, steps: int, groups, *, accumulate: int = 1, schedule=None, enc=None):
    """``steps`` optimizer steps of a tiny encoder, ``accumulate`` micro-batches each;
    ``groups(enc, loss_fn)`` gives the optimizer's param groups. Returns the messages
    of the "never changed" warnings."""
    torch.manual_seed(0)
    enc = enc or nn.Linear(D, 4)
    opt = torch.optim.SGD(groups(enc, loss_fn), lr=0.05)
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(steps):
            for micro in range(accumulate):
                a, t = _batch(step * accumulate + micro)
                (loss_fn(enc(a), enc(t)) / accumulate).backward()
            opt.step()  # the line the warning names
            opt.zero_grad()
            if sched is not None:
                sched.step()
    return [w for w in record if "never changed" in str(w.message)]


def _all(enc, loss_fn):
    return [*enc.parameters(), *loss_fn.parameters()]


def _model_only(enc, loss_fn):
    return list(enc.parameters())


LEARNERS = {
    "InfoNCELoss": lambda: InfoNCELoss(0.07, learnable_temperature=True),
    "SigLIPLoss": SigLIPLoss,
    "SVR": lambda: SupportVectorRegularizer(InfoNCELoss(0.1), radius="dynamic"),
}


@pytest.mark.parametrize("name", list(LEARNERS))
def test_warm_up_held_at_zero_is_no_false_alarm(name):
    """lr 0 for the first 80 optimizer steps (default ``stuck_after`` 50), then 1: the
    loss's parameters are in the optimizer, so nothing warns, and they train after."""
    loss_fn = LEARNERS[name]()
    before = [p.detach().clone() for p in loss_fn.parameters()]
    record = _loop(loss_fn, 90, _all, schedule=lambda s: 0.0 if s < 80 else 1.0)
    assert record == []
    assert any(not torch.equal(p, q) for p, q in zip(loss_fn.parameters(), before, strict=True))


@pytest.mark.parametrize("name", list(LEARNERS))
def test_a_loss_param_group_at_lr_zero_is_no_false_alarm(name):
    """The loss's parameters in a group of their own held at lr 0 for 100 steps: they
    are in the optimizer (on purpose frozen), not left out."""
    loss_fn = LEARNERS[name]()
    record = _loop(
        loss_fn,
        100,
        lambda enc, fn: [{"params": enc.parameters()}, {"params": fn.parameters(), "lr": 0.0}],
    )
    assert record == []


@pytest.mark.parametrize("name", list(LEARNERS))
def test_gradient_accumulation_counts_optimizer_steps(name):
    """64 micro-batches per step: 3 steps are 192 backward passes, above ``stuck_after``
    (50), and nothing warns in the optimizer; left out, ``stuck_after = 3`` warns after
    the third optimizer step, not after the third backward pass."""
    assert _loop(LEARNERS[name](), 3, _all, accumulate=64) == []
    loss_fn = LEARNERS[name]()
    loss_fn.stuck_after = 3
    assert _loop(loss_fn, 2, _model_only, accumulate=64) == []  # 128 backward passes
    del loss_fn  # (an SVR alive, left out, would make the next one a "rebuilt" one)
    loss_fn = LEARNERS[name]()
    loss_fn.stuck_after = 3
    record = _loop(loss_fn, 3, _model_only, accumulate=8)
    assert len(record) == 1 and "3 optimizer steps" in str(record[0].message)
    assert record[0].filename == __file__
    line = open(__file__).read().splitlines()[record[0].lineno - 1]
    assert line.strip().startswith("opt.step()")


def test_siglip_bias_left_out_while_the_scale_trains_warns_naming_the_bias():
    loss_fn = SigLIPLoss()
    loss_fn.stuck_after = 5
    record = _loop(loss_fn, 10, lambda enc, fn: [*enc.parameters(), fn.log_scale])
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert "learnable bias ('bias')" in message and "log_scale" not in message
    assert "did not hold it and" in message  # one parameter: "it", not "them"
    # the scale left out instead: named alone
    loss_fn = SigLIPLoss()
    loss_fn.stuck_after = 5
    record = _loop(loss_fn, 10, lambda enc, fn: [*enc.parameters(), fn.bias])
    assert len(record) == 1 and "learnable scale ('log_scale')" in str(record[0].message)
    # both left out: named together, "them"
    loss_fn = SigLIPLoss()
    loss_fn.stuck_after = 5
    record = _loop(loss_fn, 10, lambda enc, fn: [*enc.parameters()])
    assert len(record) == 1 and "did not hold them and" in str(record[0].message)


def test_an_optimizer_stepping_without_the_loss_and_another_with_it_is_silent():
    """Two optimizers, the model's and the loss's: each step of the model's does not hold
    the loss's parameters, the loss's does; nothing warns."""
    loss_fn = SigLIPLoss()
    loss_fn.stuck_after = 2
    enc = nn.Linear(D, 4)
    opt_enc = torch.optim.SGD(enc.parameters(), lr=0.05)
    opt_loss = torch.optim.SGD(loss_fn.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(6):
            a, t = _batch(step)
            loss_fn(enc(a), enc(t)).backward()
            opt_enc.step()
            opt_loss.step()
            opt_enc.zero_grad()
            opt_loss.zero_grad()


def test_a_hand_written_update_is_not_watched():
    """No ``torch.optim`` optimizer steps (the model updated by hand): no step is counted,
    so nothing warns, however many backward passes (the docs say so)."""
    loss_fn = InfoNCELoss(0.07, learnable_temperature=True)
    loss_fn.stuck_after = 2
    enc = nn.Linear(D, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(10):
            a, t = _batch(step)
            loss_fn(enc(a), enc(t)).backward()
            with torch.no_grad():
                for p in enc.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
    assert loss_fn.log_logit_scale.grad is not None  # it got gradients all along


def _alive_after_dropping(build, n: int) -> int:
    """Build ``n`` losses with ``build`` (one training step each, so their watches hold
    copies and listen to the optimizer), drop them, collect: how many of them, their
    parameters or their watches are alive."""
    a = torch.randn(8, D, requires_grad=True)
    t = torch.randn(8, D)
    opt = torch.optim.SGD([a], lr=0.0)
    refs: list[weakref.ref] = []
    for i in range(n):
        loss_fn = build()
        if i % 10 == 0:  # a few train (a snapshot and a listener), every one is armed
            loss_fn(a, t).backward()
            opt.step()
        refs += [weakref.ref(loss_fn), weakref.ref(loss_fn._watch)]
        refs += [weakref.ref(p) for p in loss_fn.parameters()]
        del loss_fn
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize(
    "build",
    [
        lambda: SupportVectorRegularizer(InfoNCELoss(), radius="dynamic"),
        lambda: copy.deepcopy(SupportVectorRegularizer(InfoNCELoss(), radius="static")),
        lambda: InfoNCELoss(learnable_temperature=True),
        SigLIPLoss,
    ],
    ids=["SVR dynamic", "deep copies", "InfoNCELoss", "SigLIPLoss"],
)
def test_dropped_learnable_losses_are_freed(build):
    """1,000 built and dropped, none alive after ``gc.collect()`` (the hooks held the
    watch, the watch the parameters: torch does not collect that cycle)."""
    assert _alive_after_dropping(build, 1000) == 0


def test_an_svr_rebuilt_inside_the_loop_is_named():
    """``loss_fn = SupportVectorRegularizer(...)`` inside the loop: the previous one (still
    bound while the next is built) got gradients in a step of an optimizer without it,
    so the rebuild warns at the constructor's line; built once, nothing warns."""
    enc = nn.Linear(D, 4)
    opt = torch.optim.SGD(enc.parameters(), lr=0.05)
    loss_fn = None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(4):
            loss_fn = SupportVectorRegularizer(InfoNCELoss(0.1), radius="dynamic")  # named
            a, t = _batch(step)
            loss_fn(enc(a), enc(t)).backward()
            opt.step()
    rebuilt = [w for w in record if "inside the training loop" in str(w.message)]
    assert len(rebuilt) == 1, [str(w.message) for w in record]
    assert rebuilt[0].filename == __file__
    line = open(__file__).read().splitlines()[rebuilt[0].lineno - 1]
    assert line.strip().startswith("loss_fn = SupportVectorRegularizer(")
    del loss_fn
    # built once, in the optimizer, then a second of the same shape (an evaluation copy)
    first = SupportVectorRegularizer(InfoNCELoss(0.1), radius="dynamic")
    assert _loop(first, 3, _all) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SupportVectorRegularizer(InfoNCELoss(0.1), radius="dynamic")


# --- the user's optimizer.step() is never broken (issue 40 item 2) ---


def _user_hook_loop(loss_fn, steps: int, *, register_at: int, groups=_all, extra_opt=None):
    """Train with a global post-step hook of the user's registered before the backward
    of step ``register_at`` (0: before the first backward; 1: after the loss's first
    backward, the order that made torch raise when the watch removed its hook); returns
    how many times the user's hook ran."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    calls = []
    enc = nn.Linear(D, 4)
    opt = torch.optim.SGD(groups(enc, loss_fn), lr=0.05)
    handle = None
    try:
        for step in range(steps):
            a, t = _batch(step)
            loss_fn(enc(a), enc(t)).backward()
            if step == register_at and handle is None:
                handle = register_optimizer_step_post_hook(lambda o, args, kw: calls.append(o))
            opt.step()
            opt.zero_grad()
    finally:
        if handle is not None:
            handle.remove()
    return len(calls)


@pytest.mark.parametrize("register_at", [0, 1])
@pytest.mark.parametrize("name", list(LEARNERS))
def test_a_users_global_post_step_hook_before_or_after_the_first_backward(name, register_at):
    """The loss decides at its first step (in the optimizer) or after ``stuck_after``
    (left out) while the user's hook comes after the library's: ``optimizer.step()``
    never raises, the user's hook runs at every step."""
    loss_fn = LEARNERS[name]()
    loss_fn.stuck_after = 3
    assert _user_hook_loop(loss_fn, 6, register_at=register_at) == 6 - register_at
    loss_fn = LEARNERS[name]()
    loss_fn.stuck_after = 3
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calls = _user_hook_loop(loss_fn, 6, register_at=register_at, groups=_model_only)
    assert calls == 6 - register_at
    assert len([w for w in record if "never changed" in str(w.message)]) == 1


def test_torchs_mem_tracker_around_the_loop():
    """torch's ``MemTracker`` registers global optimizer hooks on entry and removes them
    on exit; entered after the loss's first step, the loss deciding inside it (in the
    optimizer, or left out after ``stuck_after``) leaves ``optimizer.step()`` alone."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    for groups in (_all, _model_only):
        loss_fn = InfoNCELoss(0.07, learnable_temperature=True)
        loss_fn.stuck_after = 2
        enc = nn.Linear(D, 4)
        opt = torch.optim.Adam(groups(enc, loss_fn), lr=0.01)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(enc, loss_fn, opt)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the "never changed" warning, left out)
            loss_fn(*_batch(99)).backward()  # a first backward before the tracker
            with tracker:
                for i in range(4):
                    tracker.reset_mod_stats()
                    a, t = enc(torch.cat(_batch(i))).chunk(2)  # (one call a module)
                    loss_fn(a, t).backward()
                    opt.step()
                    opt.zero_grad()
        assert loss_fn._watch.done


def test_threads_training_their_own_losses_side_by_side():
    """8 threads, each building and training its own losses and optimizers for many
    rounds (some in the optimizer, some left out), a user's global hook after the
    library's: no step raises, and a loss in its thread's optimizer trains."""
    import threading
    import traceback

    from torch.optim.optimizer import register_optimizer_step_post_hook

    errors: list[str] = []
    trained: list[bool] = []

    def work(seed: int) -> None:
        try:
            for round_ in range(12):
                loss_fn = LEARNERS[list(LEARNERS)[(seed + round_) % 3]]()
                loss_fn.stuck_after = 2
                enc = nn.Linear(D, 4)
                keep = (seed + round_) % 2 == 0
                opt = torch.optim.SGD((_all if keep else _model_only)(enc, loss_fn), lr=0.1)
                before = [p.detach().clone() for p in loss_fn.parameters()]
                for step in range(5):
                    a, t = _batch(step + seed)
                    loss_fn(enc(a), enc(t)).backward()
                    opt.step()
                    opt.zero_grad()
                if keep:
                    trained.append(
                        any(
                            not torch.equal(p, q)
                            for p, q in zip(loss_fn.parameters(), before, strict=True)
                        )
                    )
        except BaseException:  # reported by the test, with where it was raised
            errors.append(traceback.format_exc())

    # (a global hook registered while other threads step would race in torch itself)
    calls: list[object] = []
    handle = register_optimizer_step_post_hook(lambda o, args, kw: calls.append(o))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # left-out losses warn (recording is not thread-safe)
            threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        handle.remove()
    if errors:
        pytest.fail(f"{len(errors)} worker(s) failed:\n" + "\n".join(errors), pytrace=False)
    assert len(calls) == 8 * 12 * 5  # the user's hook ran at every step
    assert len(trained) == 48 and all(trained)


def test_the_temperatures_own_optimizer_starting_late_is_no_false_alarm():
    """The model's optimizer steps 60 times (``stuck_after`` 50) before the temperature's
    own optimizer first steps: the temperature is in a live optimizer, so nothing
    warns; a temperature in no optimizer at all still warns."""
    for own_optimizer in (True, False):
        loss_fn = InfoNCELoss(0.07, learnable_temperature=True)
        enc = nn.Linear(D, 4)
        opt_enc = torch.optim.SGD(enc.parameters(), lr=0.05)
        opt_loss = torch.optim.SGD(loss_fn.parameters(), lr=0.05) if own_optimizer else None
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for step in range(70):
                a, t = _batch(step)
                loss_fn(enc(a), enc(t)).backward()
                opt_enc.step()
                if opt_loss is not None and step >= 60:
                    opt_loss.step()
                opt_enc.zero_grad()
                loss_fn.zero_grad()
        stuck = [w for w in record if "never changed" in str(w.message)]
        assert len(stuck) == (0 if own_optimizer else 1)
        assert loss_fn._watch.done  # decided either way: its hooks are gone


def test_undecided_losses_alive_cost_one_listener_call_per_step(monkeypatch):
    """100 losses alive, each counted once (a gradient, then a step without it) and
    undecided: each optimizer step runs one table listener call, not one per loss, and
    the library has one global post-step hook, never removed."""
    from torch.optim import optimizer as torch_optimizer

    from contrastive_losses import _optimizer_steps, _param_watch

    losses = [InfoNCELoss(0.07, learnable_temperature=True) for _ in range(100)]
    a = torch.randn(8, D, requires_grad=True)
    opt = torch.optim.SGD([a], lr=0.0)
    for loss_fn in losses:
        loss_fn(a, torch.randn(8, D)).backward()
    opt.step()
    assert all(not fn._watch.done and fn._watch._counts == [1] for fn in losses)
    calls = []
    original = _param_watch._Table._optimizer_stepped
    monkeypatch.setattr(
        _param_watch._Table,
        "_optimizer_stepped",
        lambda self, o: (calls.append(o), original(self, o))[1],
    )
    for _ in range(5):
        opt.step()
    assert len(calls) == 5
    ours = [
        h
        for h in torch_optimizer._global_optimizer_pre_hooks.values()
        if h is _optimizer_steps._before_step
    ]
    assert len(ours) == 1
    assert _optimizer_steps._stepped not in torch_optimizer._global_optimizer_post_hooks.values()
    assert list(opt._optimizer_step_post_hooks.values()).count(_optimizer_steps._stepped) == 1


def test_a_global_hook_registered_while_the_checks_run_in_another_thread(monkeypatch):
    """Issue 48: a thread registers its own global post-step hook while another thread's
    ``optimizer.step()`` is inside the library's checks (held there on purpose). The
    checks run in that optimizer's own hooks, before torch iterates the global
    registry, so the step does not raise ``OrderedDict mutated during iteration`` (it
    did, whenever the library's global hook came before someone else's)."""
    import threading
    import traceback

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from contrastive_losses import _param_watch

    loss_fn = InfoNCELoss(0.07, learnable_temperature=True)  # left out: the table listens
    enc = nn.Linear(D, 4)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    calls: list[object] = []
    user = register_optimizer_step_post_hook(lambda o, args, kw: calls.append(o))
    entered, go = threading.Event(), threading.Event()
    original = _param_watch._Table._optimizer_stepped

    def held_inside_the_checks(self, optimizer):
        entered.set()
        go.wait(timeout=120)
        return original(self, optimizer)

    monkeypatch.setattr(_param_watch._Table, "_optimizer_stepped", held_inside_the_checks)
    errors: list[str] = []

    def step() -> None:
        try:
            a, t = _batch(0)
            loss_fn(enc(a), enc(t)).backward()
            opt.step()
        except BaseException:
            errors.append(traceback.format_exc())

    thread = threading.Thread(target=step)
    try:
        thread.start()
        assert entered.wait(timeout=120), "the step never reached the checks"
        other = register_optimizer_step_post_hook(lambda o, args, kw: None)
        go.set()
        thread.join(timeout=120)
        other.remove()
    finally:
        go.set()
        user.remove()
    if errors:
        pytest.fail("the step failed:\n" + "\n".join(errors), pytrace=False)
    assert calls == [opt]  # the user's hook ran after the checks


def test_losses_built_and_trained_leave_torchs_global_hooks_alone():
    """The library's one global hook, a pre-step hook, is registered when it is imported;
    building and training losses (each learner, in and out of the optimizer) neither
    adds nor removes a global hook (another thread may be iterating them)."""
    from torch.optim import optimizer as torch_optimizer

    from contrastive_losses import _optimizer_steps

    pre = torch_optimizer._global_optimizer_pre_hooks
    post = torch_optimizer._global_optimizer_post_hooks
    assert list(pre.values()).count(_optimizer_steps._before_step) == 1
    before = (list(pre.items()), list(post.items()))
    for name in LEARNERS:
        for groups in (_all, _model_only):
            loss_fn = LEARNERS[name]()
            loss_fn.stuck_after = 2
            _loop(loss_fn, 3, groups)
    assert (list(pre.items()), list(post.items())) == before


def test_a_gradient_noted_as_another_thread_decides_the_watch_is_dropped():
    """Issue 48: a thread's gradient hook passed its checks, then another thread's step
    decided the watch (its lists cleared) before the hook noted the gradient: the next
    step drops the note instead of raising ``IndexError`` inside ``optimizer.step()``;
    a hook left from an earlier arm (an index the watch no longer has) is ignored."""
    from contrastive_losses import _param_watch

    loss_fn = InfoNCELoss(0.07, learnable_temperature=True)
    (param,) = loss_fn.parameters()
    watch = loss_fn._watch
    watch._gradient(3, param)  # no parameter 3 (any more): ignored
    watch._finish()  # decided by another thread's step...
    _param_watch._TABLE.fresh_gradient(watch, 0, param)  # ...as this hook noted it
    opt = torch.optim.SGD(loss_fn.parameters(), lr=0.1)
    param.grad = torch.ones_like(param)
    opt.step()
    assert id(param) not in _param_watch._TABLE.undecided
