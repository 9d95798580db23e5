"""Gradient release (``optimizer.enable_gradient_release()``): each bucket stepped in backward as its
grads complete, bit for bit a normal ``backward(); step()``, with its grads freed; and the refusals
of what release cannot make exact, each before anything changes.

Under DDP and FSDP2 (``enable_gradient_release(model=...)``) on gloo: worker processes, started once
for the module on 2 and on 4 ranks (``python -m tests.test_release RANK DIR WORLD``, as
tests/test_distributed.py starts its own), run each case released and unreleased from the same start on
the same data and write whether their params and states are equal bit for bit, the refusals that need a
process group, and the bytes per param an FSDP2 rank keeps."""
import copy
import gc
import os
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch

import fastoptim

from .registry import OPTIMIZERS
from .test_adversarial import ENGINES
from .test_bad_input import assert_unchanged, snapshot
from .test_compile import assert_same
from .test_distributed import docs_snippet, joined, result, run_workers

SMALL_BUCKETS = 300  # elements: the model below is cut into several buckets


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 24), torch.nn.GELU(),
                               torch.nn.Linear(24, 3)).to(dtype)


def batches(steps):
    return [torch.randn(6, 12, generator=torch.Generator().manual_seed(step)) for step in range(steps)]


def train(module, optimizer, steps=4, dtype=torch.float32, check_freed=False):
    for x in batches(steps):
        module(x.to(dtype)).square().mean().backward()
        if check_freed:
            assert all(p.grad is None for p in module.parameters()), "release keeps no grad after backward"
        optimizer.step()
        optimizer.zero_grad()


def assert_equal_runs(normal, plain, released, opt):
    """Params and states bit for bit."""
    assert_same((list(normal.parameters()), plain), (list(released.parameters()), opt))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_released_run_is_a_normal_run_bit_for_bit(info, engine):
    normal, released = model(), model()
    options = dict(lr=1e-2, weight_decay=0.05, **ENGINES[engine]) | info.own_options
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastoptim: fused=True")
        plain = info.cls(list(normal.parameters()), **options)
        opt = info.cls(list(released.parameters()), **options)
        handle = opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
        assert len(handle.buckets) > 1
        train(normal, plain)
        train(released, opt, check_freed=True)
    assert_equal_runs(normal, plain, released, opt)
    assert [g.get("step") for g in plain.param_groups] == [g.get("step") for g in opt.param_groups]


ZERO_GRAD_LOOPS = {  # how a loop clears grads after step (and what else it does at a step): see below
    "set_to_none": {}, "in place": dict(set_to_none=False),
    "in place, a flat layer frozen at step 1": dict(set_to_none=False, flat=True, freeze=1),
    "in place, release removed after step 1": dict(set_to_none=False, remove=1),
    "in place once, then torch's module.zero_grad()": dict(set_to_none=False, module_zero_grad=1),
}


@pytest.mark.parametrize("loop", ZERO_GRAD_LOOPS)
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_released_run_with_a_branch_used_once_is_a_normal_run_bit_for_bit(cls, loop):
    """A layer that only the first step's forward uses: a loop that zeroes grads in place
    (``zero_grad(set_to_none=False)``) keeps its zero grad, and every later step() steps it (weight
    decay, momentum). Release frees each grad it steps, so it had no grad after the first step and
    was not stepped again (helper-28). A flat grad, zeroed in place anyway, of a layer frozen is
    dropped at step() as without release; after ``remove()`` the zero grads are the loop's own; a
    loop that turns to ``module.zero_grad()`` (grads to None, behind the optimizer) keeps none
    (helper-29)."""
    options = ZERO_GRAD_LOOPS[loop]

    def run(release):
        module, extra = model(), torch.nn.Linear(12, 3)
        both = torch.nn.ModuleList([module, extra])
        if options.get("flat"):
            fastoptim.flatten_parameters(both)
        opt = cls(both.parameters(), lr=1e-2, weight_decay=0.05)
        handle = opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS) if release else None
        for step, x in enumerate(batches(4)):
            if step == options.get("freeze"):
                module[0].requires_grad_(False)
            loss = module(x).square().mean() + (extra(x).square().mean() if step == 0 else 0)
            loss.backward()
            opt.step()
            if step >= options.get("module_zero_grad", 4):
                both.zero_grad()
            else:
                opt.zero_grad(set_to_none=options.get("set_to_none", True))
            if handle is not None and step == options.get("remove"):
                handle.remove()
        return list(both.parameters()), opt
    normal, released = run(False), run(True)
    assert_same(normal, released)
    if cls is fastoptim.AdamW:
        assert ([float(released[1].state[p]["step"]) for p in released[0]]
                == [float(normal[1].state[p]["step"]) for p in normal[0]])


def test_gradscaler_refused_under_release_leaves_no_scale_for_the_next_backward():
    """GradScaler takes its scale and found_inf back from the optimizer only after a step that returns:
    left there by release's refusal, the next backward's released steps read them (helper-29)."""
    module = model()
    opt = fastoptim.AdamW(module.parameters(), lr=1e-2)
    opt.enable_gradient_release()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(module(batches(1)[0]).sum()).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    opt.zero_grad()  # ends the step that backward began (see GradientRelease.zero_grad)
    module(batches(1)[0]).sum().backward()
    opt.step()


@pytest.mark.parametrize("compiled", ["training step", "optimizer step"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_compiled_step_under_release_is_the_normal_run_bit_for_bit(cls, compiled):
    """torch.compile over a training step (forward, backward, step, zero_grad) or over
    ``optimizer.step`` alone: the release hooks and ``step()``'s rest run eagerly (dynamo breaks the
    graph around them), on real tensors. Traced, a hook reached the native binds with fake tensors and
    raised; a compiled ``step()`` stepped the rest as a traced step and left release's own step
    unended (every ``zero_grad()`` warned that a backward had not reached its step)."""
    normal, released = model(), model()
    plain = cls(list(normal.parameters()), lr=1e-2, weight_decay=0.05)
    opt = cls(list(released.parameters()), lr=1e-2, weight_decay=0.05)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(normal, plain)

    def training_step(x):
        released(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    torch._dynamo.reset()
    if compiled == "training step":
        step = torch.compile(training_step, backend="aot_eager")
    else:
        compiled_step = torch.compile(opt.step, backend="aot_eager")

        def step(x):
            released(x).square().mean().backward()
            compiled_step()
            opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # release's warnings (a step left unended) among them
        warnings.filterwarnings("ignore", message=".*record_function")  # dynamo's, of the step's profile range
        for x in batches(4):
            step(x)
    assert_equal_runs(normal, plain, released, opt)
    assert [g.get("step") for g in plain.param_groups] == [g.get("step") for g in opt.param_groups]


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_lean_options_compose_with_release(cls):
    """bf16 params with master remainders and 8-bit states: the lean configuration release is for."""
    options = dict(lr=1e-2, master_bits=24, state_bits=8, fused=True)
    normal, released = model(torch.bfloat16), model(torch.bfloat16)
    plain, opt = cls(normal.parameters(), **options), cls(released.parameters(), **options)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(normal, plain, dtype=torch.bfloat16)
    train(released, opt, dtype=torch.bfloat16, check_freed=True)
    assert_equal_runs(normal, plain, released, opt)


def test_a_bucket_whose_params_got_no_grad_is_stepped_by_step():
    """A param that gets no grad (an unused layer) keeps its bucket from filling in backward: step()
    steps that bucket's other params, as a normal step would, and Adan's count advances once."""
    normal, released = model(), model()
    plain = fastoptim.Adan(normal.parameters(), lr=1e-2)
    opt = fastoptim.Adan(released.parameters(), lr=1e-2)
    opt.enable_gradient_release()  # one bucket: the whole model
    for module, optimizer in ((normal, plain), (released, opt)):
        for x in batches(3):
            module[:3](x).square().mean().backward()  # the last Linear gets no grad
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(normal.parameters(), released.parameters()))
    assert opt.param_groups[0]["step"] == plain.param_groups[0]["step"] == 3


def test_a_state_shared_across_two_released_buckets_is_refused_by_name():
    """A state set to another param's, where the two params step in separate released buckets (one param
    each): refused as the normal step refuses it (helper-66: each bucket's step checked its own params
    alone). As any state a step refuses, it is found at backward's first grad, which then steps nothing, and
    ``step()`` refuses it with nothing changed."""
    released = model()
    opt = fastoptim.AdamW(released.parameters(), lr=1e-2)
    opt.enable_gradient_release(bucket_numel=1)
    train(released, opt, steps=2)
    opt.state[released[0].bias]["exp_avg"] = opt.state[released[2].bias]["exp_avg"]  # both (24,)
    before = snapshot(list(released.parameters()), opt)
    released(batches(1)[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"state 'exp_avg' of a param of shape \(24,\) and state 'exp_avg' of"):
        opt.step()
    assert_unchanged(list(released.parameters()), opt, before)


def test_remove_turns_release_off():
    normal, released = model(), model()
    plain, opt = fastoptim.AdamW(normal.parameters(), lr=1e-2), fastoptim.AdamW(released.parameters(), lr=1e-2)
    handle = opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(normal, plain, steps=2)
    train(released, opt, steps=2)
    handle.remove()
    released[0](batches(1)[0]).sum().backward()
    assert released[0].weight.grad is not None  # kept, as without release
    opt.zero_grad()
    train(normal, plain, steps=2)
    train(released, opt, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(normal.parameters(), released.parameters()))
    assert opt.enable_gradient_release() is not None  # and on again


def test_what_release_cannot_make_exact_is_refused_before_anything_changes(monkeypatch):
    module = model()
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        fastoptim.Adan(module.parameters(), max_grad_norm=1.0).enable_gradient_release()
    opt = fastoptim.AdamW(module.parameters())
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="bucket_numel"):
            opt.enable_gradient_release(bucket_numel=bad)
    assert opt.__dict__.get("_release") is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="pass the model"):
        opt.enable_gradient_release()
    with pytest.raises(RuntimeError, match="Sequential: release follows"):
        opt.enable_gradient_release(model=module)
    monkeypatch.undo()
    handle = opt.enable_gradient_release()
    with pytest.raises(RuntimeError, match="on already"):
        opt.enable_gradient_release()
    assert handle.buckets
    train(module, opt, steps=1)
    x = batches(1)[0]
    params = list(module.parameters())
    module(x).sum().backward()  # stepped in backward
    stepped = snapshot(params, opt)
    with pytest.raises(RuntimeError, match="accumulation"):
        module(x).sum().backward()  # a second backward before step(): its first bucket refuses
    assert_unchanged(params, opt, stepped)
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="gradient release"):
        fastoptim.clip_grad_norm_(module.parameters(), 1.0)
    module(x).sum().backward()
    after_backward = snapshot(params, opt)
    opt.grad_scale = torch.tensor(256.0)  # as GradScaler hands it to step()
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step()
    assert_unchanged(params, opt, after_backward)


def test_gradscaler_after_unscale_is_refused_at_step_too():
    """torch's pattern for clipping under GradScaler (scale, backward, ``unscale_``, ``step``): after
    ``unscale_``, GradScaler hands the step found_inf alone (no scale). Release refused only the scale,
    so the step ran, and the only error was torch's from ``update()`` (helper-28)."""
    module = model()
    opt = fastoptim.AdamW(module.parameters(), lr=1e-2)
    opt.enable_gradient_release()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(module(batches(1)[0]).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)


def options_of(info):
    return dict(lr=1e-2, weight_decay=0.05) | info.own_options


def group_of(optimizer, param):
    """The first of ``optimizer``'s groups with a param of ``param``'s number of dims (MuonWithCompanions
    keeps matrices in a group of their own)."""
    return next(group for group in optimizer.param_groups if any(p.dim() == param.dim() for p in group["params"]))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_params_that_start_or_stop_requiring_grad_after_enable_are_stepped_as_without_release(info):
    """The buckets follow requires_grad: a layer unfrozen after enable_gradient_release() is stepped
    (at step() in the backward that finds it new, in backward after), a layer frozen is left alone."""
    normal, released = model(), model()
    for module in (normal, released):
        module[2].requires_grad_(False)
    plain, opt = info.cls(list(normal.parameters()), **options_of(info)), info.cls(list(released.parameters()),
                                                                                  **options_of(info))
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    for module, optimizer in ((normal, plain), (released, opt)):
        train(module, optimizer, steps=2)
        module[2].requires_grad_(True)
        module[0].requires_grad_(False)
        train(module, optimizer, steps=3)
    assert_equal_runs(normal, plain, released, opt)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("how", ["appended", "add_param_group"])
def test_params_added_while_release_is_on_are_stepped(info, how):
    """Params appended to a group's list (torch.optim lets them be) or added in a group of their own:
    release gives them buckets."""
    normal, released = model(), model()
    extras = []
    for module in (normal, released):
        torch.manual_seed(1)
        module.append(torch.nn.Linear(3, 3))
        extras.append(list(module[-1].parameters()))
    plain, opt = info.cls(list(normal[:-1].parameters()), **options_of(info)), info.cls(
        list(released[:-1].parameters()), **options_of(info))
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    for module, optimizer, extra in ((normal, plain, extras[0]), (released, opt, extras[1])):
        train(module[:-1], optimizer, steps=1)
        if how == "add_param_group":
            optimizer.add_param_group({"params": extra})
        for param in extra if how == "appended" else ():
            group_of(optimizer, param)["params"].append(param)
        train(module, optimizer, steps=3)
    assert_equal_runs(normal, plain, released, opt)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_an_optimizer_dropped_without_remove_lets_go_of_the_model(info):
    """Release's hooks hold their optimizer weakly and go with it: a new optimizer of the model then
    steps it alone, released or not, and fastoptim.clip_grad_norm_ takes the params again."""
    module = model()
    first = info.cls(module.parameters(), **options_of(info))
    first.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(module, first, steps=1)
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is None
    module(batches(1)[0]).sum().backward()
    fastoptim.clip_grad_norm_(module.parameters(), 1.0)  # no longer released
    for param in module.parameters():
        param.grad = None
    normal = copy.deepcopy(module)
    plain, second = info.cls(normal.parameters(), **options_of(info)), info.cls(module.parameters(),
                                                                                **options_of(info))
    second.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(normal, plain, steps=2)
    train(module, second, steps=2, check_freed=True)
    assert_equal_runs(normal, plain, module, second)


REFUSED_TWICE = "another optimizer's release .* steps some of these params in backward"


@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
def test_a_second_release_of_params_another_live_release_steps_is_refused(flat):
    """A new optimizer for a second phase, released while the first one's release lives on (its lr scheduler
    holds it): both stepped the model in backward, the second found the grads freed (flat ones zeroed, which
    its weight decay stepped), and the next backward raised about gradient accumulation (helper-87). Refused,
    with nothing hooked; once the first handle is removed, the second release runs as without release."""
    released, normal = model(), model()
    if flat:
        fastoptim.flatten_parameters(released)
        fastoptim.flatten_parameters(normal)
    first = fastoptim.AdamW(released.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1.0)  # noqa: F841 (holds first)
    handle = first.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(released, first, steps=2)
    train(normal, fastoptim.AdamW(normal.parameters(), lr=1e-2), steps=2)
    second = fastoptim.AdamW(released.parameters(), lr=1e-3, weight_decay=0.5)
    with pytest.raises(RuntimeError, match=REFUSED_TWICE):
        second.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    handle.remove()
    second.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    plain = fastoptim.AdamW(normal.parameters(), lr=1e-3, weight_decay=0.5)
    train(released, second, steps=2, check_freed=not flat)
    train(normal, plain, steps=2)
    assert_equal_runs(normal, plain, released, second)
    del first, handle, scheduler
    gc.collect()  # the first optimizer gone: the second release's params stay refused by clip_grad_norm_
    with pytest.raises(RuntimeError, match="gradient release stepped these params"):
        fastoptim.clip_grad_norm_(released.parameters(), 1.0)


def test_a_param_added_to_a_group_that_another_live_release_steps_is_refused_and_hooks_nothing():
    """Found as the buckets are made again, at backward's first grad: that backward steps none of the second
    optimizer's buckets and its ``step()`` raises, having changed nothing; the first release steps on."""
    module, normal = model(), model()
    first = fastoptim.AdamW(list(module[0].parameters()), lr=1e-2)
    first.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    second = fastoptim.AdamW(list(module[2].parameters()), lr=1e-2)
    second.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    second.param_groups[0]["params"].append(module[0].weight)  # first's
    before = snapshot(list(module[2].parameters()), second)
    module(batches(1)[0]).square().mean().backward()
    with pytest.raises(RuntimeError, match=REFUSED_TWICE):
        second.step()
    assert_unchanged(list(module[2].parameters()), second, before)
    second.param_groups[0]["params"].pop()
    first.zero_grad()
    second.zero_grad()
    plains = [fastoptim.AdamW(list(normal[i].parameters()), lr=1e-2) for i in (0, 2)]
    for step, x in enumerate(batches(3)):
        if step:
            module(x).square().mean().backward()
            for opt in (first, second):
                opt.step()
                opt.zero_grad()
        normal(x).square().mean().backward()
        for plain in plains if step else plains[:1]:
            plain.step()
        normal.zero_grad()
    assert all(map(torch.equal, normal.parameters(), module.parameters()))


def test_an_optimizer_dropped_in_a_cycle_does_not_hold_its_params_released():
    """One dropped in a reference cycle (a trainer object that refers to itself), which only the collector
    frees, steps nothing more: a new release of its params is not refused for it."""
    module = model()
    trainer = {"optimizer": fastoptim.AdamW(module.parameters(), lr=1e-2)}
    trainer["self"] = trainer
    trainer["optimizer"].enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(module, trainer["optimizer"], steps=1)
    dropped = weakref.ref(trainer["optimizer"])
    gc.disable()
    try:
        del trainer
        assert dropped() is not None  # alive until collected
        fastoptim.AdamW(module.parameters(), lr=1e-2).enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    finally:
        gc.enable()
    assert dropped() is None


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_release_on_a_flat_model_is_the_unreleased_flat_run_bit_for_bit(info):
    """Flat grads are always there (zeros where backward gave none), so a param that backward leaves out
    is stepped every step (weight decay): release keeps them, zeroed in place after each bucket's step,
    instead of freeing them, and steps at step() a bucket that backward did not fill."""
    normal, released = model(), model()
    for module in (normal, released):
        fastoptim.flatten_parameters(module)
    grads = [param.grad for param in released.parameters()]
    plain, opt = info.cls(normal.parameters(), **options_of(info)), info.cls(released.parameters(),
                                                                             **options_of(info))
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    for module, optimizer in ((normal, plain), (released, opt)):
        for x in batches(3):
            module[:3](x).square().mean().backward()  # the last Linear gets no grad
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_runs(normal, plain, released, opt)
    assert all(param.grad is grad and not grad.any() for param, grad in zip(released.parameters(), grads))


@pytest.mark.parametrize("lr", ["number", "tensor"])
def test_an_lr_set_between_backward_and_step_warns_once(lr):
    """Backward stepped the buckets with the lr it found: a scheduler stepped before optimizer.step()
    sets the lr too late for them, which release says, once."""
    module = model()
    opt = fastoptim.AdamW(module.parameters(), lr=torch.tensor(1e-2) if lr == "tensor" else 1e-2)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)

    def set_lr(value):
        if lr == "tensor":
            opt.param_groups[0]["lr"].fill_(value)
        else:
            opt.param_groups[0]["lr"] = value

    x = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_lr(2e-2)  # before backward: the buckets take it
        module(x).sum().backward()
        opt.step()
        opt.zero_grad()
    module(x).sum().backward()
    set_lr(3e-2)
    with pytest.warns(UserWarning, match="lr.*after backward"):
        opt.step()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(x).sum().backward()
        set_lr(4e-2)
        opt.step()


@pytest.mark.parametrize("betas", ["tensor filled in place", "list item replaced"])
def test_betas_edited_in_place_between_backward_and_step_warn_too(betas):
    """A β1 filled in place (a tensor beta) or set in its list: release held the betas option by reference
    and compared it with itself, so it said nothing (helper-90)."""
    module = model()
    given = [torch.tensor(0.9), torch.tensor(0.999)] if betas.startswith("tensor") else [0.9, 0.999]
    opt = fastoptim.AdamW(module.parameters(), lr=1e-2, betas=given)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    module(batches(1)[0]).sum().backward()
    if betas.startswith("tensor"):
        opt.param_groups[0]["betas"][0].fill_(0.5)
    else:
        opt.param_groups[0]["betas"][0] = 0.5
    with pytest.warns(UserWarning, match="betas.*after backward"):
        opt.step()


def test_options_release_holds_are_taken_as_they_come_without_a_false_warning():
    """Betas made under inference mode (no version counter: backward's hook raised reading it), and an
    option of the user's holding NaN, never written (compared item by item, NaN is no NaN: a warning at
    the first step) (helper-93)."""
    module = model()
    with torch.inference_mode():
        betas = (torch.tensor(0.9), torch.tensor(0.999))
    opt = fastoptim.AdamW(module.parameters(), lr=1e-2, betas=betas)
    opt.param_groups[0]["clip_range"] = (float("nan"), 1.0)
    opt.param_groups[0]["limits"] = [np.array([np.nan, 1.0])]
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(module, opt, steps=2)


class SharedBlock(torch.nn.Module):
    """A block applied twice, each time under a reentrant checkpoint: its params' grads accumulate in
    two inner backwards within one backward. No params before it: a bucket of the block's and the last
    layer's params (Muon's matrices) fills at the block's first accumulation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.GELU())
        self.last = torch.nn.Linear(12, 3)

    def forward(self, x):
        hidden = x.detach().requires_grad_()  # a reentrant checkpoint needs an input that requires grad
        for _ in range(2):
            hidden = torch.utils.checkpoint.checkpoint(self.block, hidden, use_reentrant=True)
        return self.last(hidden)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_a_shared_block_under_reentrant_checkpoint_steps_once_with_its_whole_grad(info):
    normal, released = SharedBlock(), SharedBlock()
    plain, opt = info.cls(list(normal.parameters()), **options_of(info)), info.cls(
        list(released.parameters()), **options_of(info))
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_reentrant")
        train(normal, plain)
        train(released, opt)
    assert_equal_runs(normal, plain, released, opt)


class FailInBackward(torch.autograd.Function):
    """Identity whose backward raises, as an out-of-memory error would, halfway through backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("out of memory (simulated)")


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_zero_grad_after_a_backward_that_raised_recovers(info):
    """An out-of-memory handler catches a backward that raised after release stepped some buckets and
    calls zero_grad(): that ends the step there (the stepped buckets keep their update, which cannot be
    undone, and say so), and training goes on as a normal run from where it stands."""
    module = model()
    groups = [{"params": module[0].parameters()}, {"params": module[1:].parameters()}]  # Muon: a bucket steps
    opt = info.cls(groups, **options_of(info))
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(module, opt, steps=1)
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="simulated"):
        module[1:](FailInBackward.apply(module[0](x))).square().mean().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
    normal = copy.deepcopy(module)
    plain = info.cls([{"params": normal[0].parameters()}, {"params": normal[1:].parameters()}], **options_of(info))
    plain.load_state_dict(opt.state_dict())
    train(normal, plain, steps=2)
    train(module, opt, steps=2, check_freed=True)
    assert_equal_runs(normal, plain, module, opt)
    assert any("and no step() followed" in str(warning.message) for warning in caught)


def test_after_a_backward_that_raised_the_next_backward_says_which_zero_grad_ends_the_step():
    """model.zero_grad(), which loops and frameworks call, leaves the half-done step: the error the next
    backward raises names the optimizer's zero_grad(), which ends it."""
    module = model()
    opt = fastoptim.AdamW(module.parameters(), lr=0.01)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="simulated"):
        module[1:](FailInBackward.apply(module[0](x))).square().mean().backward()
    module.zero_grad()
    with pytest.raises(RuntimeError, match=r"call the optimizer's zero_grad\(\), which ends that step"):
        module(x).square().mean().backward()


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_remove_between_backward_and_step_steps_each_param_once(info):
    """remove() after a backward that stepped some buckets leaves the rest to step(), which steps no param
    twice: flat grads, which release zeroes instead of freeing, are dropped there for the stepped params."""
    normal, released = model(), model()
    for module in (normal, released):
        fastoptim.flatten_parameters(module)
    plain, opt = info.cls(list(normal.parameters()), **options_of(info)), info.cls(list(released.parameters()),
                                                                                  **options_of(info))
    handle = opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(normal, plain, steps=2)
    train(released, opt, steps=2)
    x = batches(3)[-1]
    for module in (normal, released):  # the last Linear gets no grad: its bucket waits for step()
        module[:3](x).square().mean().backward()
    plain.step()
    handle.remove()
    opt.step()
    assert_equal_runs(normal, plain, released, opt)
    assert [g.get("step") for g in plain.param_groups] == [g.get("step") for g in opt.param_groups]


# --- under DDP and FSDP2 -----------------------------------------------------------------------

DIST_STEPS, DIST_BATCH = 4, 8
DIST_CASES = {
    # mode, optimizer, its options, bucket_numel (small: several buckets, none equal to a DDP bucket or
    # an FSDP2 unit), dtype
    "ddp-adamw-foreach": ("ddp", "AdamW", dict(foreach=True, fused=False), 300, torch.float32),
    "ddp-adan-fused": ("ddp", "Adan", dict(fused=True), 300, torch.float32),
    "ddp-muon-fused": ("ddp", "Muon", dict(fused=True), 300, torch.float32),
    "ddp-adamw-bucket-view": ("ddp", "AdamW", dict(fused=True, gradient_as_bucket_view=True), 300, torch.float32),
    "fsdp-adamw-foreach": ("fsdp", "AdamW", dict(foreach=True, fused=False), 300, torch.float32),
    "fsdp-adan-fused": ("fsdp", "Adan", dict(fused=True), 300, torch.float32),
    "fsdp-adamwsn-fused": ("fsdp", "AdamWSN", dict(fused=True, sn=True), 300, torch.float32),
    "fsdp-muon-fused": ("fsdp", "Muon", dict(fused=True), 300, torch.float32),
    "fsdp-adan-8bit": ("fsdp", "Adan", dict(fused=True, state_bits=8), 300, torch.float32),
    # the lean configuration release is for
    "fsdp-adamw-lean": ("fsdp", "AdamW", dict(fused=True, master_bits=24, state_bits=8, sn=True), 300,
                        torch.bfloat16),
    # HSDP, on 4 ranks only (a 2 x 2 mesh): FSDP2 runs the hooks once the replicas' all-reduce has landed
    "hsdp-adan-fused": ("hsdp", "Adan", dict(fused=True), 300, torch.float32),
    "hsdp-muon-fused": ("hsdp", "Muon", dict(fused=True), 300, torch.float32),
    "hsdp-adamw-lean": ("hsdp", "AdamW", dict(fused=True, master_bits=24, state_bits=8, sn=True), 300,
                        torch.bfloat16),
}
HSDP_MESH = (2, 2)  # (replicate, shard)
ACCUMULATED = ("ddp-adan-fused", "fsdp-adan-fused")  # two microbatches, the first reducing nothing


def dist_model(dtype):
    torch.manual_seed(0)
    # (3, 24): an empty shard on rank 3 of 4; 8192 elements: 8-bit blocks
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3)).to(dtype)


def dist_batch(step, rank, world, dtype, micro=None):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(DIST_BATCH * world, 16, generator=generator).to(dtype)
    x = x[rank * DIST_BATCH:(rank + 1) * DIST_BATCH]
    return x if micro is None else x.chunk(2)[micro]


def wrapped(mode, module, options):
    """``module`` under DDP, or each Linear and the whole under fully_shard (on HSDP_MESH for "hsdp")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    if mode == "ddp":
        return DistributedDataParallel(module, bucket_cap_mb=0.01,  # several DDP buckets
                                       gradient_as_bucket_view=options.pop("gradient_as_bucket_view", False))
    mesh = init_device_mesh("cpu", HSDP_MESH, mesh_dim_names=("replicate", "shard")) if mode == "hsdp" else None
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def dist_groups(cls_name, module):
    if cls_name == "Muon":
        return [{"params": [p for p in module.parameters() if p.ndim == 2]},
                {"params": [p for p in module.parameters() if p.ndim < 2], "use_muon": False}]
    return module.parameters()


def dist_run(name, rank, world, release, accumulate=False, kept=None):
    """The case's params and states after ``DIST_STEPS`` steps, as local tensors."""
    mode, cls_name, options, bucket_numel, dtype = DIST_CASES[name]
    options = dict(options)
    module = wrapped(mode, dist_model(dtype), options)
    inner = module.module if mode == "ddp" else module
    optimizer = getattr(fastoptim, cls_name)(dist_groups(cls_name, inner), lr=1e-2, weight_decay=0.05, **options)
    if release:
        optimizer.enable_gradient_release(bucket_numel, model=module)
    for step in range(DIST_STEPS):
        if accumulate:
            sync = module.no_sync() if mode == "ddp" else None
            if mode == "fsdp":
                module.set_requires_gradient_sync(False)
            with sync if sync is not None else contextlib_null():
                module(dist_batch(step, rank, world, dtype, 0)).float().square().mean().backward()
            if mode == "fsdp":
                module.set_requires_gradient_sync(True)
            module(dist_batch(step, rank, world, dtype, 1)).float().square().mean().backward()
        else:
            module(dist_batch(step, rank, world, dtype)).float().square().mean().backward()
        if release:  # every bucket stepped in backward
            assert optimizer._release.stepped == {id(p) for p in module.parameters()}
        if release and mode != "ddp":
            assert all(p.grad is None for p in module.parameters()), "release keeps no grad after backward"
        if kept is not None:
            kept.append(grad_storage_bytes(module.parameters()))
        optimizer.step()
        optimizer.zero_grad()
    return local_tensors(module, optimizer)


def contextlib_null():
    import contextlib
    return contextlib.nullcontext()


def local(tensor):
    return tensor.to_local() if isinstance(tensor, torch.distributed.tensor.DTensor) else tensor


def local_tensors(module, *optimizers):
    tensors = [local(p).detach() for p in module.parameters()]
    for optimizer in optimizers:
        for param in module.parameters():
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append(local(value))
    return tensors


def grad_storage_bytes(params):
    storages = {}
    for param in params:
        if param.grad is not None:
            storage = local(param.grad).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def equal(a, b):
    """Which of the tensors differ (their indices), or [] where all are equal bit for bit."""
    assert len(a) == len(b)
    return [index for index, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]


def kept_bytes(rank, world):
    """Bytes per param (of the whole model) that a rank keeps at the release point (after backward, before
    step) in the lean configuration: its param shards, their states and the grads held then, released
    and not; and the peak of grads held during a released backward."""
    mode, cls_name, options, bucket_numel, dtype = DIST_CASES["fsdp-adamw-lean"]
    torch.manual_seed(0)
    width = 512
    module = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(8)]).to(dtype)
    numel = sum(p.numel() for p in module.parameters())
    module = wrapped(mode, module, {})
    result = {}
    for release in (False, True):
        optimizer = getattr(fastoptim, cls_name)(module.parameters(), lr=1e-3, **options)
        peak = [0]

        def track(param):  # before release's hook: the grad FSDP2 just reduced is held
            peak[0] = max(peak[0], grad_storage_bytes(module.parameters()))
        handles = [p.register_post_accumulate_grad_hook(track) for p in module.parameters()]
        if release:
            optimizer.enable_gradient_release(width * width, model=module)  # a layer per bucket
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank)).to(dtype)
        for _ in range(2):
            module(x).float().square().mean().backward()
            held = grad_storage_bytes(module.parameters())
            params = sum(local(p).nbytes for p in module.parameters())
            states = sum(local(v).nbytes for p in module.parameters() for v in optimizer.state[p].values()
                         if isinstance(v, torch.Tensor))
            optimizer.step()
            optimizer.zero_grad()
        for handle in handles:
            handle.remove()
        if release:
            optimizer._release.remove()
        result["released" if release else "unreleased"] = dict(
            params=params / numel, states=states / numel, grads=held / numel, peak_grads=peak[0] / numel)
    return result


def refusals(rank, world):
    """What release refuses under a process group, each with nothing changed: the message, and whether
    anything changed (a comm hook, a param hook, the handle)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    out = {}

    def attempt(name, make):
        module, optimizer, ddp = make()
        hooks_before = [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in module.parameters()]
        try:
            optimizer.enable_gradient_release(model=ddp) if ddp is not False else optimizer.enable_gradient_release()
            out[name] = "not refused"
        except RuntimeError as error:
            hooks_after = [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in module.parameters()]
            changed = (optimizer.__dict__.get("_release") is not None or hooks_before != hooks_after
                       or (isinstance(ddp, DistributedDataParallel) and any(
                           hook is not default_hooks.allreduce_hook for hook, _ in ddp._comm_hooks)))
            out[name] = [str(error), changed]

    def plain_ddp(**options):
        def make():
            ddp = DistributedDataParallel(dist_model(torch.float32), **options)
            return ddp, fastoptim.AdamW(ddp.parameters(), lr=1e-2), False
        return make

    def ddp_with(model_options=None, hook=None, **optimizer_options):
        def make():
            ddp = DistributedDataParallel(dist_model(torch.float32), **(model_options or {}))
            if hook is not None:
                ddp.register_comm_hook(dist.group.WORLD, hook)
            return ddp, fastoptim.AdamW(ddp.parameters(), lr=1e-2, **optimizer_options), ddp
        return make

    def fsdp1():
        module = FullyShardedDataParallel(dist_model(torch.float32), device_id=torch.device("cpu"))
        return module, fastoptim.AdamW(module.parameters(), lr=1e-2), module

    def fsdp_missing():
        module = dist_model(torch.float32)
        fully_shard(module[0])
        extra = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(
            torch.zeros(4, 4), module[0].weight.device_mesh, [torch.distributed.tensor.Shard(0)]))
        return module, fastoptim.AdamW([*module[0].parameters(), extra], lr=1e-2), module

    def fsdp_clipped():
        module = wrapped("fsdp", dist_model(torch.float32), {})
        return module, fastoptim.Adan(module.parameters(), lr=1e-2, max_grad_norm=1.0), module

    attempt("no model", plain_ddp())
    attempt("find_unused_parameters", ddp_with(dict(find_unused_parameters=True)))
    attempt("another comm hook", ddp_with(hook=default_hooks.allreduce_hook))
    attempt("fsdp1", fsdp1)
    attempt("fsdp2 without the param", fsdp_missing)
    attempt("fsdp2 with clipping", fsdp_clipped)
    attempt("unwrapped module", lambda: (lambda m: (m, fastoptim.AdamW(m.parameters()), m))(dist_model(torch.float32)))
    return out


def ddp_remove_and_again(rank, world):
    """Release removed under DDP, then on again on the same DDP (whose comm hook stays): each phase equals
    the unreleased run bit for bit."""
    from torch.nn.parallel import DistributedDataParallel
    runs = []
    for release in (False, True):
        ddp = DistributedDataParallel(dist_model(torch.float32), bucket_cap_mb=0.01)
        optimizer = fastoptim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
        for phase in range(3):
            handle = optimizer.enable_gradient_release(300, model=ddp) if release and phase != 1 else None
            for step in range(2):
                ddp(dist_batch(2 * phase + step, rank, world, torch.float32)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            if handle is not None:
                handle.remove()
        runs.append(local_tensors(ddp, optimizer))
    return equal(*runs)


def second_backward(mode, rank, world):
    """A second backward before step() (AdamW and Muon, several DDP buckets): refused by step(), not inside
    DDP's comm hook or FSDP2's reduction, which a raise would leave half done (helper-108: DDP's reducer then
    failed every backward after, FSDP2's module kept other params); zero_grad() ends the step, and the run goes
    on as one without that backward (bit for bit). Returns each optimizer's [refused, differing tensors]."""
    out = []
    for name in ("AdamW", "Muon"):
        runs, refused = [], None
        for twice in (False, True):
            module = wrapped(mode, dist_model(torch.float32), {})
            inner = module.module if mode == "ddp" else module
            groups = [{"params": [p for p in inner.parameters() if p.ndim == 2 or name == "AdamW"]}] + (
                [{"params": [p for p in inner.parameters() if p.ndim < 2], "use_muon": False}] if name == "Muon" else [])
            optimizer = getattr(fastoptim, name)(groups, lr=1e-2, fused=True)
            optimizer.enable_gradient_release(300, model=module)
            module(dist_batch(0, rank, world, torch.float32)).square().mean().backward()
            if twice:
                try:
                    module(dist_batch(1, rank, world, torch.float32)).square().mean().backward()
                    optimizer.step()
                except RuntimeError as error:
                    refused = "accumulated into it again" in str(error)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # zero_grad() says it ends the step backward began
                optimizer.zero_grad()
            for step in range(2, 4):
                module(dist_batch(step, rank, world, torch.float32)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            runs.append(local_tensors(module, optimizer))
        out.append([refused, equal(*runs)])
    return out


def two_optimizers(mode, rank, world):
    """Muon on the matrices and AdamW on the rest, two optimizers on one model, both released (under
    DDP, on one comm hook): equal to both unreleased bit for bit."""
    runs = []
    for release in (False, True):
        module = wrapped(mode, dist_model(torch.float32), {})
        inner = module.module if mode == "ddp" else module
        matrices = [p for p in inner.parameters() if p.ndim == 2]
        optimizers = [fastoptim.Muon(matrices, lr=1e-2, fused=True),
                      fastoptim.AdamW([p for p in inner.parameters() if p.ndim < 2], lr=1e-2, fused=True)]
        if release:
            for optimizer in optimizers:
                optimizer.enable_gradient_release(300, model=module)
        for step in range(DIST_STEPS):
            module(dist_batch(step, rank, world, torch.float32)).square().mean().backward()
            for optimizer in optimizers:
                if release:
                    assert optimizer._release.stepped == {id(p) for g in optimizer.param_groups for p in g["params"]}
                optimizer.step()
                optimizer.zero_grad()
        runs.append(local_tensors(module, *optimizers))
    return equal(*runs)


class Layers(torch.nn.Module):
    """dist_model's Linear layers as a model's ``layers``, as docs/distributed.md's loop names them."""

    def __init__(self, dtype):
        super().__init__()
        self.layers = torch.nn.ModuleList(layer for layer in dist_model(dtype) if isinstance(layer, torch.nn.Linear))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def docs_release_loop(rank, world):
    """docs/distributed.md's FSDP2 loop with release, run as written in bf16, and without its
    enable_gradient_release line: which params and states differ, and whether the first released."""
    from torch.distributed.fsdp import fully_shard
    loop = docs_snippet("opt.enable_gradient_release(model=model)")
    runs, released = [], None
    for snippet in (loop, "\n".join(line for line in loop.splitlines() if "enable_gradient_release" not in line)):
        batches = [(dist_batch(step, rank, world, torch.bfloat16), torch.zeros(DIST_BATCH, 3)) for step in range(4)]
        namespace = dict(fastoptim=fastoptim, fully_shard=fully_shard, model=Layers(torch.bfloat16), batches=batches,
                         loss_fn=lambda out, target: (out.float() - target).square().mean())
        exec(snippet, namespace)
        runs.append(local_tensors(namespace["model"], namespace["opt"]))
        released = namespace["opt"]._release is not None if released is None else released
    return {"differ": equal(*runs), "released": released}


def dist_worker(rank, directory, world):
    import torch.distributed as dist

    record = joined(rank, directory, world)

    for name in [name for name in DIST_CASES if world == 4 or not name.startswith("hsdp")]:
        record(name, lambda: equal(dist_run(name, rank, world, False), dist_run(name, rank, world, True)))
    for name in ACCUMULATED:
        record("accumulated-" + name, lambda: equal(dist_run(name, rank, world, False, accumulate=True),
                                                     dist_run(name, rank, world, True, accumulate=True)))
    record("ddp remove and again", lambda: ddp_remove_and_again(rank, world))
    for mode in ("ddp", "fsdp"):
        record(f"{mode} two optimizers", lambda: two_optimizers(mode, rank, world))
        record(f"{mode} second backward", lambda: second_backward(mode, rank, world))
    if world == 2:
        record("refusals", lambda: refusals(rank, world))
        record("kept bytes", lambda: kept_bytes(rank, world))
        record("docs release loop", lambda: docs_release_loop(rank, world))
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort at interpreter exit


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def dist_runs(request, tmp_path_factory):
    return run_workers(tmp_path_factory.mktemp(f"release-{request.param}"), request.param, 300, "tests.test_release")


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*DIST_CASES, *("accumulated-" + name for name in ACCUMULATED),
                                  "ddp remove and again", "ddp two optimizers", "fsdp two optimizers"])
def test_a_released_sharded_run_is_the_unreleased_run_bit_for_bit(dist_runs, name):
    """DDP: each bucket stepped when its all-reduce lands; FSDP2: on its local shards when its units'
    reduce-scatters land (and its grads freed: the workers assert it after each backward); HSDP: when
    the replicas' all-reduce that follows has landed, so each replica steps the averaged grad."""
    if name.startswith("hsdp") and len(dist_runs[0]) != 4:
        pytest.skip("HSDP runs on 4 ranks, 2 x 2")
    for differing in result(dist_runs, name):
        assert differing == [], f"tensors {differing} differ"


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_second_backward_under_release_is_refused_and_zero_grad_goes_on_as_without_it(dist_runs, mode):
    for per_optimizer in result(dist_runs, f"{mode} second backward"):
        assert per_optimizer == [[True, []], [True, []]]


@pytest.mark.distributed
def test_what_release_cannot_hook_under_a_process_group_is_refused_with_nothing_changed(dist_runs):
    if len(dist_runs[0]) != 2:
        pytest.skip("checked on 2 ranks")
    expected = {"no model": "pass the model", "find_unused_parameters": "find_unused_parameters",
                "another comm hook": "comm hook already", "fsdp1": "FSDP1", "fsdp2 without the param":
                "not a param of a fully_shard module", "fsdp2 with clipping": "max_grad_norm",
                "unwrapped module": "Sequential: release follows"}
    for messages in result(dist_runs, "refusals"):
        for name, words in expected.items():
            assert messages[name] != "not refused", name
            message, changed = messages[name]
            assert words in message, (name, message)
            assert not changed, name



@pytest.mark.distributed
def test_under_fsdp2_release_keeps_no_grad_past_a_unit(dist_runs):
    """bf16, master_bits=24, 8-bit states, sn on 2 ranks: per param of the model, a rank keeps its
    param shard and states (<= 4.1 bytes / world) and, after backward, no grad; during backward at
    most one unit's reduced shard (1/8 of the model's bf16 grads / 2 ranks)."""
    if len(dist_runs[0]) != 2:
        pytest.skip("measured on 2 ranks")
    for kept in result(dist_runs, "kept bytes"):
        released, unreleased = kept["released"], kept["unreleased"]
        assert released["params"] + released["states"] + released["grads"] <= 4.1 / 2
        assert released["grads"] == 0 and unreleased["grads"] == 1.0
        assert released["peak_grads"] <= 2 / 8 / 2


@pytest.mark.distributed
def test_the_docs_fsdp2_loop_with_release_is_the_loop_without_it_bit_for_bit(dist_runs):
    """docs/distributed.md's port of an FSDP2 loop (bf16, master_bits=24, 8-bit states, sn), run as
    written on 2 ranks, against the same block without its enable_gradient_release line."""
    if len(dist_runs[0]) != 2:
        pytest.skip("run on 2 ranks")
    for measured in result(dist_runs, "docs release loop"):
        assert measured == {"differ": [], "released": True}


if __name__ == "__main__":
    dist_worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))


def test_betas_written_as_a_numpy_array_under_release_step_and_warn_only_when_changed_after_backward():
    """A numpy array of betas (which the step reads as its numbers): release compared it with ``==`` and
    raised numpy's ambiguous truth in step(), after backward had stepped the buckets (helper-42). Edited
    in place after backward, it is a change that came too late, which release says."""
    module = model()
    opt = fastoptim.AdamW(module.parameters(), lr=1e-2)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    x = batches(1)[0]
    opt.param_groups[0]["betas"] = np.array([0.9, 0.999])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(x).sum().backward()
        opt.step()
        opt.zero_grad()
    module(x).sum().backward()
    opt.param_groups[0]["betas"][1] = 0.99
    with pytest.warns(UserWarning, match="betas.*after backward"):
        opt.step()


@pytest.mark.parametrize("write", [
    lambda opt: opt.param_groups[1].update(lr=float("nan")),
    lambda opt: opt.param_groups[1].update(betas=(1.5, 0.999)),
    lambda opt: opt.param_groups[1].update(weight_decay="0.1"),
], ids=["NaN lr", "betas", "text weight_decay"])
@pytest.mark.parametrize("mend", ["zero_grad", "step again"])
def test_an_option_written_invalid_is_refused_under_release_before_any_bucket_steps(write, mend):
    """Release steps each bucket as its grads are final, and each bucket's step checked its own group: an
    option written invalid into a group that backward reaches last was refused after the others' buckets
    had stepped (helper-57), and raised inside FSDP2's hook, which left its backward half done (helper-59).
    Every group's options are checked at backward's first grad: what fails there makes backward step
    nothing, and ``step()`` refuses it. Mended, ``step()`` steps this backward's grads (or, after
    ``zero_grad()``, the next one's) as a run without release does."""
    def run(release):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        opt = fastoptim.AdamW([{"params": model[1].parameters()}, {"params": model[0].parameters()}], lr=1e-2)
        if release:
            opt.enable_gradient_release(bucket_numel=8)
        write(opt)
        before = [param.detach().clone() for param in model.parameters()]
        model(torch.ones(2, 4)).sum().backward()  # whole: the refusal is step()'s, out of autograd's hooks
        assert all(param.grad is not None for param in model.parameters())
        with pytest.raises(ValueError, match="Invalid"):
            opt.step()
        assert all(map(torch.equal, before, model.parameters())) and not opt.state
        opt.param_groups[1].update(lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2)
        if mend == "zero_grad":
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
        opt.step()  # mended: on this backward's grads, or on a new one's
        return [param.detach().clone() for param in model.parameters()]

    assert all(map(torch.equal, run(True), run(False)))


@pytest.mark.parametrize("write", [
    lambda opt, params: opt.param_groups[0]["params"].append(params[2]),
    lambda opt, params: opt.param_groups.append(opt.param_groups[0]),
    lambda opt, params: opt.param_groups[0]["params"].append(params[0]),
], ids=["a param in two groups", "a group listed twice", "a param twice in its group"])
def test_a_param_listed_twice_is_refused_under_release_before_any_bucket_steps(write):
    """Under release a duplicate was caught by the step of the bucket that held it, after the buckets
    backward reached first had stepped (or, twice in its own group, not at all): helper-58. The buckets are
    made again when the groups change, at backward's first grad, which finds it: backward then steps
    nothing, and ``step()`` refuses it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    params, data = list(model.parameters()), torch.randn(16, 8)
    opt = fastoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    opt.enable_gradient_release(bucket_numel=64)
    model(data).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    write(opt, params)
    before = snapshot(params, opt)
    model(data).pow(2).mean().backward()  # steps nothing: the refusal is step()'s, out of autograd's hooks
    with pytest.raises(ValueError, match="appears"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    assert all(torch.equal(opt.state_dict()["state"][k][name], value)
               for k, state in before[1]["state"].items() for name, value in state.items())


def test_an_adan_count_written_between_backward_and_step_under_release_is_checked_at_step():
    """An Adan group count written as a tensor of 2.5 between backward and ``step()``: release's ``step()``
    advanced it unchecked where a number was refused (helper-58). It is refused by name at ``step()``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = fastoptim.Adan(model.parameters(), lr=1e-2)
    opt.enable_gradient_release()
    model(torch.ones(2, 4)).sum().backward()
    opt.param_groups[0]["step"] = torch.tensor(2.5)
    with pytest.raises(ValueError, match=r"Invalid step: 2.5"):
        opt.step()


def _first_layer_state_writes():
    """Writes to the state of a param of the first layer (the bucket backward reaches last) that a step refuses."""
    return {
        "a state of another shape": lambda opt, param: opt.state[param].update(exp_avg=torch.zeros(3)),
        "a state given other storage in place": lambda opt, param: opt.state[param]["exp_avg"].set_(torch.zeros(3)),
        "a count of 2.5": lambda opt, param: opt.state[param].update(step=torch.tensor(2.5)),
        "a state of another dtype": lambda opt, param: opt.state[param].update(
            exp_avg_sq=opt.state[param]["exp_avg_sq"].double()),
        "a subset-norm record deleted": lambda opt, param: opt.state[param].pop("reduce_dim"),
        # helper-74: not through the state dict's counted methods, and a count's value written in place
        "a state of another shape through dict's own method": lambda opt, param: dict.__setitem__(
            opt.state[param], "exp_avg", torch.zeros(3)),
        "a count filled with -1 in place": lambda opt, param: opt.state[param]["step"].fill_(-1),
        "a count filled with 2.5 in place": lambda opt, param: opt.state[param]["step"].fill_(2.5),
    }


@pytest.mark.parametrize("write", list(_first_layer_state_writes()))
def test_a_state_written_invalid_is_refused_under_release_before_any_bucket_steps(write):
    """A state that a step refuses, written into a param of the bucket backward reaches last: its bucket's
    step raised inside autograd's hook, after the other buckets had stepped (helper-71). Every bucket's
    states are checked at backward's first grad where their plan no longer holds them: backward then steps
    nothing, and ``step()`` refuses it with nothing changed."""
    released = model()
    options = dict(sn=True) if write == "a subset-norm record deleted" else {}
    opt = fastoptim.AdamW(released.parameters(), lr=1e-2, **options)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(released, opt, steps=2)
    params = list(released.parameters())
    _first_layer_state_writes()[write](opt, params[0])
    before = snapshot(params, opt)
    released(batches(1)[0]).square().mean().backward()  # steps nothing: the refusal is step()'s
    assert all(map(torch.equal, params, before[0]))
    with pytest.raises((RuntimeError, ValueError)):
        opt.step()
    assert_unchanged(params, opt, before)


def test_what_step_steps_under_release_is_checked_in_every_group_before_any_steps():
    """``step()`` under release steps what backward did not (here every param: grads set by hand, which no
    hook sees), group by group: a sparse grad in the second group was refused after the first group had
    stepped. Every group's rest is checked before any steps."""
    module = model()
    params = list(module.parameters())
    opt = fastoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(module, opt, steps=1)
    for param in params:
        param.grad = torch.ones_like(param)
    params[-1].grad = torch.ones_like(params[-1]).to_sparse()
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_unchanged(params, opt, before)


@pytest.mark.parametrize("release", [False, True], ids=["unreleased", "released"])
@pytest.mark.parametrize("order", ["count's owner first", "count's owner last"])
def test_a_count_given_to_another_param_is_each_param_s_own_from_that_step_on(order, release):
    """A param's count set to another param's count tensor (``state[p]["step"] = state[q]["step"]``): a step
    gives each its own, of the value it holds then, as it does for a count shared by hand. Where ``q``'s
    group (or released bucket) still held its plan and stepped first, it advanced that tensor in place,
    and ``p`` then read it one step ahead (helper-74: a released run differed from an unreleased one)."""
    def run(shared):
        module = model()
        params = list(module.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:]}]
        opt = fastoptim.AdamW(groups if order == "count's owner last" else groups[::-1], lr=1e-2)
        if release:
            opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
        train(module, opt, steps=2)
        owner = opt.state[params[-1]]["step"]
        opt.state[params[0]]["step"] = owner if shared else owner.clone()
        train(module, opt, steps=2)
        return params, opt

    (params, opt), (twin_params, twin) = run(shared=True), run(shared=False)
    assert_same((params, opt), (twin_params, twin))
    assert opt.state[params[0]]["step"].item() == opt.state[params[-1]]["step"].item() == 4


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Lion, fastoptim.AdamWSN], ids=lambda cls: cls.__name__)
def test_a_released_bucket_steps_on_its_bound_step(cls, monkeypatch):
    """A released bucket's step is planned as a whole step is: after its first (checked) step, it runs on
    tables bound to native code, and Python checks none of its tensors (the checked step is made to raise),
    bit for bit the unreleased run. (Official Adan's group count, which advances once at ``step()``, keeps
    its buckets on the checked step: test_a_released_run_is_a_normal_run_bit_for_bit.)"""
    from fastoptim.optimizers.step_path import StepPath

    normal, released = model(), model()
    plain = cls(normal.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    opt = cls(released.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
    train(normal, plain, steps=2)
    train(released, opt, steps=2)
    assert len(opt._plans.released) > 1 and all(opt._plans.released.values())

    def checked(*args, **kwargs):
        raise AssertionError("a released bucket's step checked its tensors in Python")
    monkeypatch.setattr(StepPath, "_group_work", checked)
    train(released, opt, steps=3)
    monkeypatch.undo()
    train(normal, plain, steps=3)
    assert_equal_runs(normal, plain, released, opt)


def test_state_bits_set_anew_under_release_is_refused_before_any_bucket_steps():
    """``state_bits=8`` set between steps, where a param's fp32 states were made before: a step refuses them
    by name. The first-grad check compared the states by identity alone, which still held, and the 80x80
    weight's bucket raised from inside backward after the last layer's bucket had stepped (helper-76). The
    check applies the plan's whole rule: options that give another structure make it check the states."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(12, 80), torch.nn.Linear(80, 80), torch.nn.Linear(80, 3))
    params = list(module.parameters())
    opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
    opt.enable_gradient_release(bucket_numel=5000)
    x = torch.randn(6, 12)
    for _ in range(3):
        module(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["state_bits"] = 8  # the 80x80 weight's states (6,400 elements) would be 8-bit
    before = snapshot(params, opt)
    module(x).square().mean().backward()  # steps nothing: the refusal is step()'s
    with pytest.raises(RuntimeError, match=r"state 'exp_avg' is torch.float32 \(80, 80\)"):
        opt.step()
    assert_unchanged(params, opt, before)


RELEASED_BOUND_WRITES = {  # between steps, once the released buckets step bound
    "param.data = a copy": lambda module, opt: setattr(module[0].weight, "data", module[0].weight.detach().clone()),
    "param.set_ to a copy": lambda module, opt: module[2].bias.data.set_(module[2].bias.detach().clone()),
    "state set_ to a copy": lambda module, opt: opt.state[module[0].bias]["exp_avg"].set_(
        opt.state[module[0].bias]["exp_avg"].clone()),
    "state replaced": lambda module, opt: opt.state[module[4].weight].update(
        exp_avg_sq=opt.state[module[4].weight]["exp_avg_sq"] * 2),
    "count filled in place": lambda module, opt: opt.state[module[2].weight]["step"].fill_(7),
    "lr and betas changed": lambda module, opt: opt.param_groups[0].update(lr=3e-2, betas=(0.8, 0.99)),
    "a param frozen": lambda module, opt: module[2].weight.requires_grad_(False),
    "params reordered": lambda module, opt: opt.param_groups[0]["params"].reverse(),
    "a param group added": lambda module, opt: opt.add_param_group({"params": [module.extra]}),
}


@pytest.mark.parametrize("write", list(RELEASED_BOUND_WRITES))
def test_a_released_bucket_s_bound_step_follows_what_the_user_writes(write):
    """Each released bucket keeps a bound step (PlanStore.released): a write between steps to what it was
    planned from is followed, bit for bit as by the unreleased run given the same write."""
    def run(release):
        module = model()
        opt = fastoptim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
        module.extra = torch.nn.Parameter(torch.ones(3))  # after the optimizer: no param of its groups yet
        if release:
            opt.enable_gradient_release(bucket_numel=SMALL_BUCKETS)
        train(module, opt, steps=3)
        if release:
            assert len(opt._plans.released) > 1 and all(opt._plans.released.values())
        RELEASED_BOUND_WRITES[write](module, opt)
        for x in batches(3):
            (module(x).square().mean() + module.extra.sum()).backward()
            opt.step()
            opt.zero_grad()
        return list(module.parameters()), opt

    assert_same(run(False), run(True))
