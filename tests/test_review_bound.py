"""An adversarial review of the bound step (6d667b0): a bound optimizer's run against a twin whose every
step takes the checked way (``_engine_caches["bound"]`` popped before each step), bit for bit, where
a user changes something between steps."""
import warnings

import pytest
import torch

import fastoptim
from fastoptim import engines
from fastoptim.engines.backends import cpu as cpu_backend

pytestmark = pytest.mark.skipif(not cpu_backend.AVAILABLE, reason="the native library is not built")

SHAPES = [(5, 7), (300,), (3,), (4, 4)]


def grad_for(param, step):
    values = torch.linspace(-1, 1, param.numel()).reshape(param.shape).mul(step + 1).sin()
    return values.to(param.dtype)


def _run(factory, change, checked, steps=6, dtypes=None, bound_calls=None):
    """``factory(params)``'s optimizer over ``steps`` steps, ``change(step, opt, params)`` made before
    each; ``checked``: every step takes the checked way. ``bound_calls``: a list that gets each bound
    step's answer (whether its native call ran)."""
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(d))
              for i, (s, d) in enumerate(zip(SHAPES, dtypes))]
    opt = factory(params)
    for step in range(steps):
        for param in params:
            param.grad = grad_for(param, step)
        with torch.no_grad():
            change(step, opt, params)
        if checked:
            opt.__dict__.get("_engine_caches", {}).pop("bound", None)
        torch.manual_seed(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return params, opt


def _bound_and_checked(factory, change, monkeypatch, **kwargs):
    calls, real = [], engines.fused.run_batch
    monkeypatch.setattr(engines.fused, "run_batch", lambda batch, clip=None: calls.append(real(batch, clip)) or calls[-1])
    bound = _run(factory, change, False, **kwargs)
    ran_bound = list(calls)
    checked = _run(factory, change, True, **kwargs)
    return bound, checked, ran_bound


@pytest.mark.parametrize("engine", [dict(foreach=False, fused=True), dict(foreach=True, fused=True)])
@pytest.mark.parametrize("count", [10, torch.tensor(10.0), torch.tensor(10.0, dtype=torch.float64)],
                         ids=["int", "tensor", "float64"])
def test_an_adan_group_count_set_anew_is_the_count_the_bound_steps_read_and_advance(count, engine, monkeypatch):
    """``group["step"] = 10`` (official Adan's int, or another tensor) between steps: the group's
    count is then a new tensor. The tables bound to the old one must be bound again, else every later
    bound step reads the old count (its bias corrections) and advances it, not the group's."""
    def change(step, opt, params):
        if step == 2:
            opt.param_groups[0]["step"] = count.clone() if torch.is_tensor(count) else count

    (params, opt), (twin_params, twin), ran_bound = _bound_and_checked(
        lambda ps: fastoptim.Adan(ps, lr=1e-2, weight_decay=0.02, **engine), change, monkeypatch)
    assert ran_bound[-2:] == [True, True]  # the last steps ran bound
    assert opt.param_groups[0]["step"].item() == twin.param_groups[0]["step"].item() == 14.0
    for param, expected in zip(params, twin_params):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan, fastoptim.Lion])
def test_a_tensor_lr_in_a_later_group_draws_no_rounding_seed_for_the_earlier_ones(cls, monkeypatch):
    """A bound step that finds a tensor lr (which the native rules do not take) goes the checked way;
    it must not have drawn stochastic rounding seeds for the groups before it first, or every step
    draws twice and its bf16 params round apart from a checked twin's."""
    def factory(params):
        return cls([{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(1e-3)}], lr=1e-2,
                   stochastic_rounding=True, fused=True)

    (params, _), (twin_params, _), _ = _bound_and_checked(factory, lambda *args: None, monkeypatch,
                                                          dtypes=[torch.bfloat16] * len(SHAPES))
    for param, expected in zip(params, twin_params):
        assert torch.equal(param, expected)


@pytest.mark.xfail(strict=True, reason="a bound step draws each bucket's stochastic rounding seed before its native "
                   "call checks the tables; when that call answers STALE (a param given new storage), the checked "
                   "step that follows draws again, so the global RNG (and the rounding) runs apart from a twin "
                   "whose steps are all checked. Pre-existing (the bound path drew seeds before launching before "
                   "6d667b0 too); fixing it needs the seeds drawn after the check or the RNG state restored")
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_bound_step_refused_as_stale_leaves_the_rng_as_it_found_it(cls, monkeypatch):
    def change(step, opt, params):
        if step == 3:
            params[3].data = params[3].data.clone()

    (params, _), (twin_params, _), ran_bound = _bound_and_checked(
        lambda ps: cls(ps, lr=1e-2, stochastic_rounding=True, fused=True), change, monkeypatch,
        dtypes=[torch.bfloat16] * len(SHAPES))
    assert False in ran_bound  # the step after the change was refused natively
    for param, expected in zip(params, twin_params):
        assert torch.equal(param, expected)
