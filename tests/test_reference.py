"""The loop engine against float64 re-statements of the equations and against peers."""
import functools

import pytest
import torch

import fastoptim
from fastoptim.bench.peers import timm_adan_class
from fastoptim.optimizers.algorithm import StepInputs
from fastoptim.optimizers.scalars import count_after, step_arguments

from . import oracle
from .test_lion import timm_lion_class

STEPS = 20


@pytest.mark.parametrize("no_prox", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("maximize", [False, True])
def test_adan_matches_float64_equations(no_prox, max_grad_norm, maximize):
    params = oracle.make_params()
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS)
    expected = oracle.adan(params, grads, lr=0.01, weight_decay=0.02, no_prox=no_prox,
                           max_grad_norm=max_grad_norm, maximize=maximize)
    opt = fastoptim.Adan(params, lr=0.01, weight_decay=0.02, no_prox=no_prox, max_grad_norm=max_grad_norm,
                         maximize=maximize, foreach=False)
    oracle.run(opt, params, grads)
    assert oracle.relative_error(params, expected) < 1e-5


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_adamw_matches_float64_equations(amsgrad, maximize, max_grad_norm):
    params = oracle.make_params()
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS)
    expected = oracle.adamw(params, grads, lr=0.01, amsgrad=amsgrad, maximize=maximize,
                            max_grad_norm=max_grad_norm)
    opt = fastoptim.AdamW(params, lr=0.01, amsgrad=amsgrad, maximize=maximize, max_grad_norm=max_grad_norm,
                          foreach=False)
    oracle.run(opt, params, grads)
    assert oracle.relative_error(params, expected) < 1e-5


@pytest.mark.parametrize("no_prox", [False, True])
@pytest.mark.parametrize("timm_foreach", [False, True])
def test_adan_matches_timm(no_prox, timm_foreach):
    params = oracle.make_params()
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS)
    options = dict(lr=0.01, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02, no_prox=no_prox)
    oracle.run(fastoptim.Adan(params, foreach=False, **options), params, grads)
    oracle.run(timm_adan_class()(peer_params, foreach=timm_foreach, **options), peer_params, grads)
    assert oracle.relative_error(params, peer_params) < 1e-5


@pytest.mark.parametrize("engine", [dict(foreach=False), dict(foreach=True)])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_matches_torch(engine, amsgrad, maximize):
    params = oracle.make_params()
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS)
    options = dict(lr=0.01, weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    oracle.run(fastoptim.AdamW(params, **engine, **options), params, grads)
    oracle.run(torch.optim.AdamW(peer_params, **options), peer_params, grads)
    assert oracle.relative_error(params, peer_params) < 1e-5


ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}
MATRICES = [(32, 16), (16, 32), (24, 24)]
# What the README states, optimizer: (its reference, the options, the params, the most ulps apart after 20
# steps on the loop and foreach engines, on the fused ones). AdamW's last operation divides the
# denominator by the step size where torch's multiplies the quotient by it (the form both take for a
# tensor lr); timm's Adan orders its terms apart from the official code's; the C kernels use fused
# multiply-adds. Measured on an AVX-512 CPU (2026-11-28): AdamW 2/8, Adan 23/12, Lion 0/8, Muon 0/0.
STATED_ULPS = {
    "AdamW": (lambda ps, **o: torch.optim.AdamW(ps, **o), dict(lr=0.01, weight_decay=0.05), oracle.SHAPES, 2, 16),
    "Adan": (lambda ps, **o: timm_adan_class()(ps, **o), dict(lr=0.01, betas=(0.98, 0.92, 0.99), weight_decay=0.02),
             oracle.SHAPES, 32, 32),
    "Lion": (lambda ps, **o: timm_lion_class()(ps, **o), dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
             oracle.SHAPES, 0, 16),
    "Muon": (lambda ps, **o: torch.optim.Muon(ps, **o), dict(lr=0.02, weight_decay=0.1), MATRICES, 0, 0),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", STATED_ULPS)
def test_each_engine_is_within_the_ulps_the_readme_states_of_its_reference(name, engine):
    reference, options, shapes, unfused, fused = STATED_ULPS[name]
    grads = oracle.grad_sequence(shapes, STEPS)
    params, peer_params = oracle.make_params(shapes), oracle.make_params(shapes)
    oracle.run(getattr(fastoptim, name)(params, **options, **ENGINES[engine]), params, grads)
    oracle.run(reference(peer_params, **options), peer_params, grads)
    apart = max(oracle.ulps_apart(a, b) for a, b in zip(params, peer_params))
    assert apart <= (fused if "fused" in engine else unfused), apart


def test_adamw_skips_like_torch_when_some_params_have_no_grad():
    """Per-parameter step counts: a param without a grad keeps its own count, as in torch."""
    params = oracle.make_params()
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    opt, peer = fastoptim.AdamW(params, lr=0.01), torch.optim.AdamW(peer_params, lr=0.01)
    for step, grads in enumerate(oracle.grad_sequence(oracle.SHAPES, 10)):
        for i, (p, q, g) in enumerate(zip(params, peer_params, grads)):
            p.grad = q.grad = None if (i == 0 and step % 3) else g.clone()
        opt.step()
        peer.step()
    assert oracle.relative_error(params, peer_params) < 1e-5


def test_counts_on_the_host_are_python_floats_each_param_its_own_as_torch_reads_them():
    """A step's scalars cost Python arithmetic where the counts live on the host (as torch's
    single-tensor and foreach AdamW compute them, a bound step's native rule too): one float per
    param, the count + 1 (a step GradScaler skips reads no scalars); each param at its own count gets
    its own arguments. Elsewhere (a tensor lr, another device) float64 tensors."""
    equal, unequal = torch.full((3,), 4.0), torch.tensor([4.0, 1.0, 4.0])
    eager = functools.partial(count_after, traced=False)
    assert eager(equal, 1, 0.1) == [5.0] * 3 and eager(equal, torch.tensor(0.0), 0.1) == [5.0] * 3
    assert eager(torch.tensor(2.0), 1, 0.1) == [3.0] and eager(unequal, 1, 0.1) == [5.0, 2.0, 5.0]
    for count, lr, traced in ((equal, torch.tensor(0.1), False), (equal.to("meta"), 0.1, False), (equal, 0.1, True)):
        result = count_after(count, 1, lr, traced)
        assert isinstance(result, torch.Tensor) and result.dtype == torch.float64 and result.shape == count.shape
    group = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    inputs = StepInputs(0.1, None, None, torch.float32, None, None)
    args, per_param = step_arguments(fastoptim.AdamW.algorithm, group, equal, 1, inputs, traced=False)
    assert per_param == set() and args["step_size"] == 0.1 / (1 - 0.9**5)
    args, per_param = step_arguments(fastoptim.AdamW.algorithm, group, unequal, 1, inputs, traced=False)
    assert per_param == {"step_size", "bias_correction2_sqrt"}
    assert args["step_size"].tolist() == [torch.tensor(0.1 / (1 - 0.9**t)).item() for t in (5.0, 2.0, 5.0)]


def test_adan_resumes_a_timm_checkpoint_on_the_same_trajectory():
    params = oracle.make_params()
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS)
    peer = timm_adan_class()(peer_params, lr=0.01, weight_decay=0.02)
    oracle.run(peer, peer_params, grads[:10])
    with torch.no_grad():
        for p, q in zip(params, peer_params):
            p.copy_(q)
    opt = fastoptim.Adan(params, lr=0.01, weight_decay=0.02)
    opt.load_state_dict(peer.state_dict())
    assert float(opt.param_groups[0]["step"]) == 10
    oracle.run(peer, peer_params, grads[10:])
    oracle.run(opt, params, grads[10:])
    assert oracle.relative_error(params, peer_params) < 1e-5


def test_adan_restart_opt_matches_timm():
    params = oracle.make_params()
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS)
    opt = fastoptim.Adan(params, lr=0.01)
    peer = timm_adan_class()(peer_params, lr=0.01)
    for optimizer, ps in ((opt, params), (peer, peer_params)):
        oracle.run(optimizer, ps, grads[:5])
        optimizer.restart_opt()
        oracle.run(optimizer, ps, grads[5:])
    assert oracle.relative_error(params, peer_params) < 1e-5


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_match_a_rounded_oracle(cls, dtype):
    """fp32 math and fp32 states; the param is rounded to its dtype after every step."""
    params = oracle.make_params(dtype=dtype)
    grads = oracle.grad_sequence(oracle.SHAPES, STEPS, scale=0.1)
    reference = oracle.adan if cls is fastoptim.Adan else oracle.adamw
    expected = reference(params, [[g.to(dtype) for g in gs] for gs in grads], lr=0.01, round_to=dtype)
    for engine in (False, True):
        ps = [p.detach().clone().requires_grad_() for p in params]
        opt = cls(ps, lr=0.01, foreach=engine)
        oracle.run(opt, ps, grads)
        assert all(p.dtype == dtype for p in ps)
        assert all(s.dtype == torch.float32 for state in opt.state.values() for s in state.values())
        ulp = torch.finfo(dtype).eps
        for p, e in zip(ps, expected):
            assert torch.allclose(p.double(), e, rtol=2 * ulp, atol=1e-6)
