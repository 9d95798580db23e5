"""Gradient release (``optimizer.enable_gradient_release()``): each bucket stepped in backward as its
grads complete, bit for bit a normal ``backward(); step()``, with its grads freed; and the refusals
of what release cannot make exact, each before anything changes."""
import copy
import gc
import warnings
import weakref

import pytest
import torch

import fastoptim

from .registry import OPTIMIZERS
from .test_adversarial import ENGINES
from .test_bad_input import assert_unchanged, snapshot
from .test_compile import assert_same

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
    with pytest.raises(RuntimeError, match="one process"):
        opt.enable_gradient_release()
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
    assert any("did not reach step()" in str(warning.message) for warning in caught)


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
