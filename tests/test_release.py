"""Gradient release (``optimizer.enable_gradient_release()``): each bucket stepped in backward as its
grads complete, bit for bit a normal ``backward(); step()``, with its grads freed; and the refusals
of what release cannot make exact, each before anything changes."""
import warnings

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
    with pytest.raises(RuntimeError, match="release is on"):  # its params would never be stepped
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1 and handle.buckets
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
