"""An adversarial review of the plans of 1d22343 (fused Muon's ``Directions``, planned once per bucket
and direction dtype) and 4781b1a (``BoundStep`` planned once; its rule reads ``OptimizerState.changes``,
which ParamStates bump through their ``owners``): what a user writes between steps must reach the plan
or make a new one. A bound optimizer runs against a twin whose every step is checked
(``_plans.bound`` dropped), a fused Muon against foreach, bit for bit; each also asserts
that the plan was really used (or refused, then used again) where it should be."""
import copy
import pickle
import warnings
from collections import defaultdict

import numpy as np
import pytest
import torch

import fastoptim
from fastoptim.bound_step import BoundStep
from fastoptim.engines import foreach
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.optimizers import muon_parts

native = pytest.mark.skipif(not cpu_backend.AVAILABLE, reason="the native library is not built")

SHAPES = [(5, 7), (300,), (3,), (4, 4)]


def grad_for(param, step):
    return torch.linspace(-1, 1, param.numel()).reshape(param.shape).mul(step + 1).sin().to(param.dtype)


def make(shapes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(d))
            for i, (s, d) in enumerate(zip(shapes, dtypes))]


def _run(factory, change, checked, steps=6, shapes=SHAPES, dtype=torch.float32):
    """``factory(params)`` stepped ``steps`` times, ``change(step, box)`` before each (``box`` holds
    "opt" and "params", which a change may replace: a deep copy); ``checked``: every step checked.
    Fallback warnings (float64 params under fused=True) are not the point here: ignored."""
    params = make(shapes, [dtype] * len(shapes))
    box = {"opt": factory(params), "params": params}
    for step in range(steps):
        for param in box["params"]:
            param.grad = grad_for(param, step)
        with torch.no_grad():
            change(step, box)
        if checked:
            box["opt"]._plans.bound = None
        torch.manual_seed(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            box["opt"].step()
    return box


def _bound_and_checked(factory, change, monkeypatch, **kwargs):
    calls, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: calls.append(real(self, *args)) or calls[-1])
    bound = _run(factory, change, False, **kwargs)
    ran = list(calls)
    checked = _run(factory, change, True, **kwargs)
    for param, expected in zip(bound["params"], checked["params"]):
        assert torch.equal(param, expected)
    return ran


def _at(step, write):
    return lambda now, box: write(box["opt"], box["params"]) if now == step else None


def _exp_avg_doubled(opt, params):
    return opt.state[params[0]]["exp_avg"] * 2


def _copied(how):
    def change(step, box):
        if step == 2:
            box["opt"] = how(box["opt"])
            box["params"] = [p for group in box["opt"].param_groups for p in group["params"]]
            for param in box["params"]:  # a copy's params come without grads
                param.grad = grad_for(param, step)
        if step == 4:  # a write to the copy's states: the copy's OptimizerState must count it
            box["opt"].state[box["params"][0]]["exp_avg"] = _exp_avg_doubled(box["opt"], box["params"])
    return change


def _reassigned(step, box):
    opt, params = box["opt"], box["params"]
    if step == 2:  # a mapping assigned: an OptimizerState of the same ParamStates, now owned by two
        opt.state = defaultdict(dict, opt.state)
    if step == 4:
        opt.state[params[0]]["exp_avg"] = _exp_avg_doubled(opt, params)


# Each write to a state dict, through every way ParamState and OptimizerState count it. The step after
# it must be refused by the rule (False), and the step after that bound again (True).
STATE_WRITES = {
    "assign a key": _at(3, lambda o, ps: o.state[ps[0]].__setitem__("exp_avg", _exp_avg_doubled(o, ps))),
    "update": _at(3, lambda o, ps: o.state[ps[0]].update(exp_avg=_exp_avg_doubled(o, ps))),
    "|=": _at(3, lambda o, ps: o.state[ps[0]].__ior__({"exp_avg": _exp_avg_doubled(o, ps)})),
    "pop": _at(3, lambda o, ps: o.state[ps[0]].pop("exp_avg_sq")),
    "clear": _at(3, lambda o, ps: o.state[ps[0]].clear()),
    "state[p] = {...}": _at(3, lambda o, ps: o.state.__setitem__(ps[0], dict(o.state[ps[0]], exp_avg=_exp_avg_doubled(o, ps)))),
    "del state[p]": _at(3, lambda o, ps: o.state.__delitem__(ps[3])),
    "state.update": _at(3, lambda o, ps: o.state.update({ps[1]: {}})),
    "a count set by hand": _at(3, lambda o, ps: o.state[ps[2]].__setitem__("step", 7)),
}


@native
@pytest.mark.parametrize("write", STATE_WRITES)
def test_every_counted_state_write_refuses_the_bound_step_once_and_binds_again(write, monkeypatch):
    ran = _bound_and_checked(lambda ps: fastoptim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=True),
                             STATE_WRITES[write], monkeypatch)
    assert ran == [True, True, False, True, True]


@native
@pytest.mark.parametrize("change, expected", [
    (_copied(copy.deepcopy), [True, True, False, True]),  # the copy's first step is checked (no caches)
    (_copied(lambda opt: pickle.loads(pickle.dumps(opt))), [True, True, False, True]),
    (_copied(lambda opt: opt.load_state_dict(opt.state_dict()) or opt), [True, True, False, True]),
    # the same ParamStates in another OptimizerState: the work holds them, and the bound step goes on
    (_reassigned, [True, True, True, False, True]),
], ids=["deepcopy", "pickle", "load_state_dict", "state reassigned"])
def test_states_copied_loaded_or_reassigned_count_their_writes_in_their_new_optimizer_state(change, expected,
                                                                                            monkeypatch):
    """A deep copy, a pickle, a load or ``opt.state = mapping`` holds its ParamStates in another
    OptimizerState: a later write to one must be counted there (its ``owners`` must name it)."""
    assert _bound_and_checked(lambda ps: fastoptim.Adan(ps, lr=1e-2, fused=True), change, monkeypatch) == expected


@native
@pytest.mark.parametrize("share", ["param states", "optimizer state"])
def test_two_optimizers_sharing_states_each_follow_a_write_made_through_the_other(share, monkeypatch):
    """``b.state[p] = a.state[p]`` (one ParamState, two owners) or ``b.state = a.state``: a state
    replaced through ``a`` must refuse ``b``'s bound step too, else ``b`` steps the old tensor."""
    calls, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: calls.append(real(self, *args)) or calls[-1])

    def run(checked):
        params = make(SHAPES[:2])
        a, b = (fastoptim.AdamW(params, lr=1e-2, fused=True) for _ in range(2))
        for step in range(6):
            for opt in (a, b):
                for param in params:
                    param.grad = grad_for(param, step)
                if step == 1 and opt is b:
                    if share == "param states":
                        for param in params:
                            b.state[param] = a.state[param]
                    else:
                        b.state = a.state
                if step == 3 and opt is b:
                    a.state[params[0]]["exp_avg"] = a.state[params[0]]["exp_avg"] * 2
                if checked:
                    opt._plans.bound = None
                opt.step()
        return params

    bound = run(False)
    ran = list(calls)
    for param, expected in zip(bound, run(True)):
        assert torch.equal(param, expected)
    assert ran[-5:] == [False, False, True, True, True]  # step 3: both refused; then both bound again


@native
def test_a_scaler_s_tensors_written_in_place_and_an_lr_schedule_run_bound(monkeypatch):
    """GradScaler's ``grad_scale``/``found_inf`` written in place (an inf step among them), a float lr
    set every step and maximize turned on: read at each bound step, which stays bound."""
    def change(step, box):
        opt, group = box["opt"], box["opt"].param_groups[0]
        group["lr"] = 1e-2 / (step + 1)
        if step == 1:
            opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)
        elif step > 1:
            opt.grad_scale.fill_(2.0 ** step)
            opt.found_inf.fill_(float(step == 3))
        if step == 4:
            group["maximize"] = True

    ran = _bound_and_checked(lambda ps: fastoptim.AdamW(ps, lr=1e-2, max_grad_norm=0.5, fused=True), change,
                             monkeypatch)
    assert ran == [True] * 5


@native
def test_a_muon_of_companion_groups_runs_bound_and_again_once_a_group_turns_muon(monkeypatch):
    def factory(params):
        return fastoptim.Muon([{"params": [params[0], params[3]], "use_muon": False},
                               {"params": params[1:3], "use_muon": False}], lr=1e-2, fused=True)

    def change(step, box):
        if step == 4:
            box["opt"].param_groups[0]["use_muon"] = True  # its 2-D params: Muon's algorithm from now on

    # refused once the group turns Muon, then bound again, its Muon bucket's momentum in the native call
    assert _bound_and_checked(factory, change, monkeypatch) == [True, True, True, False, True]


BYPASSES = {
    "dict.update(state[p], ...)": lambda o, ps: dict.update(o.state[ps[0]], exp_avg=_exp_avg_doubled(o, ps)),
    "dict.__setitem__(state[p], ...)": lambda o, ps: dict.__setitem__(o.state[ps[0]], "exp_avg",
                                                                      _exp_avg_doubled(o, ps)),
    "dict.update(opt.state, ...)": lambda o, ps: dict.update(
        o.state, {ps[0]: dict(o.state[ps[0]], exp_avg=_exp_avg_doubled(o, ps))}),
}


@native
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a state replaced through dict's own methods (dict.update or "
                   "dict.__setitem__ on optimizer.state[p] or on optimizer.state) bumps no change counter, so "
                   "BoundStep.work still holds and every later bound step updates the old tensor, which only "
                   "the native tables still hold; the checked twin (GroupWork.holds compares each state's "
                   "tensors by identity) steps the new one. Pre-existing: the process-wide counter that "
                   "4781b1a replaced counted the same methods")
@pytest.mark.parametrize("write", BYPASSES)
def test_a_state_replaced_through_dict_s_methods_is_followed_by_the_bound_step(write, monkeypatch):
    _bound_and_checked(lambda ps: fastoptim.AdamW(ps, lr=1e-2, fused=True), _at(2, BYPASSES[write]), monkeypatch)


def test_an_optimizer_s_state_copies_with_dict_s_copy_as_torch_s_does():
    opt = fastoptim.AdamW(make(SHAPES[:1]), lr=1e-2)
    opt.param_groups[0]["params"][0].grad = torch.ones(5, 7)
    opt.step()
    copied = opt.state.copy()
    assert copied == opt.state and copied is not opt.state


# --- fused Muon's Directions ------------------------------------------------------------------------

FOREACH, FUSED = dict(foreach=True, fused=False), dict(foreach=True, fused=True)


def _muon_run(engine, shapes, change, dtypes=None, steps=4, **options):
    params = make(shapes, dtypes)
    box = {"opt": fastoptim.Muon(params, lr=0.02, **engine, **options), "params": params}
    for step in range(steps):
        for param in box["params"]:
            param.grad = grad_for(param, step)
        with torch.no_grad():
            change(step, box)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            box["opt"].step()
    return box["params"]


def _scaler_on_then_off(on, off=3):
    """A change that hands the step GradScaler's tensors from step ``on`` and takes them away at ``off``."""
    def change(step, box):
        if step == on:
            box["opt"].grad_scale, box["opt"].found_inf = torch.tensor(4.0), torch.tensor(0.0)
        if step == off:
            del box["opt"].grad_scale, box["opt"].found_inf
    return change


def _grads_come_and_go(step, box):
    box["params"][step % 3].grad = None


def _reordered(step, box):
    if step == 2:
        box["opt"].param_groups[0]["params"].reverse()


def _appended(step, box):
    if step == 1:  # a new matrix shape in the bucket: its slices and batches planned again
        box["params"].append(torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(9))))
        box["opt"].param_groups[0]["params"].append(box["params"][-1])


def _nesterov_off(step, box):
    if step == 2:
        box["opt"].param_groups[0]["nesterov"] = False


PARAM_WRITES = {  # a user's write to a param between steps, which the update's tables (bound once) follow
    "set_": lambda param: param.set_(param.detach().clone() * 0.5),
    ".data =": lambda param: setattr(param, "data", param.data * 0.5),
    "copy_": lambda param: param.copy_(param * 0.5),
    "mul_": lambda param: param.mul_(0.5),
}


def _param_written(write):
    def change(step, box):
        if step == 2:
            PARAM_WRITES[write](box["params"][3])
    return change


SMALL = [(8, 4), (8, 4), (4, 8), (6, 6), (2, 8, 4), (10, 10), (8, 4), (12, 5)]
MUON_CASES = {  # (shapes, dtype, options, change, Directions made: each bucket's)
    "slices, steady": (SMALL, torch.float32, {}, lambda s, b: None, 1),
    # the CPU kernel takes GradScaler's scale with the bf16 grads as they are: their directions stay bf16
    "slices, bf16, GradScaler on then off": (SMALL, torch.bfloat16, {}, _scaler_on_then_off(1), 1),
    "slices, clipped": (SMALL, torch.float32, dict(max_grad_norm=0.3), lambda s, b: None, 1),
    "slices, grads come and go": (SMALL, torch.float32, {}, _grads_come_and_go, 3),
    "slices, reordered in place": (SMALL, torch.float32, {}, _reordered, 2),
    "slices, a shape appended": (SMALL, torch.float32, {}, _appended, 2),
    "slices, nesterov turned off": (SMALL, torch.float32, {}, _nesterov_off, 1),
    # new storage plans the group again, with new Directions; a write in place is read where it is
    **{f"slices, a param written by {write}": (SMALL, torch.float32, {}, _param_written(write),
                                               2 if write in ("set_", ".data =") else 1) for write in PARAM_WRITES},
    # flatten: params of other shapes whose matrices agree (4x6) make one batch, 3-D ones beside 2-D ones
    "flatten, one matrix shape": ([(4, 6), (4, 2, 3), (4, 3, 2), (4, 6, 1), (6, 4), (3, 2, 4)], torch.bfloat16,
                                  dict(flatten=True), lambda s, b: None, 1),
    "zero-size matrices": ([(0, 5), (8, 4), (5, 0), (0, 5), (2, 0, 3)], torch.float32, {}, lambda s, b: None, 1),
}


@pytest.mark.parametrize("case", MUON_CASES)
def test_fused_muon_s_planned_directions_step_as_foreach_bit_for_bit(case, monkeypatch):
    """Fused Muon against foreach under what changes between steps, over several slices
    (MATRIX_SLICE_NUMEL cut small, so the slices share one buffer); the Directions are made once per
    bucket, and again only where the dtype, the grads' pattern or the params changed."""
    shapes, dtype, options, change, made_expected = MUON_CASES[case]
    monkeypatch.setattr(foreach, "MATRIX_SLICE_NUMEL", 100)
    made, real = [], muon_parts.Directions.of.__func__
    monkeypatch.setattr(muon_parts.Directions, "of", classmethod(
        lambda cls, part, dtype: made.append(dtype) or real(cls, part, dtype)))
    expected = _muon_run(FOREACH, shapes, change, [dtype] * len(shapes), **options)
    assert not made
    for param, want in zip(_muon_run(FUSED, shapes, change, [dtype] * len(shapes), **options), expected):
        assert torch.equal(param, want)
    assert len(made) == made_expected, made


@pytest.mark.filterwarnings("ignore:fastoptim. fused=True, but no fused kernel for torch.float64")
def test_fused_muon_steps_clipped_float64_params_as_foreach():
    expected = _muon_run(FOREACH, [(6, 4), (4, 6)], lambda s, b: None, [torch.float64] * 2, steps=2, max_grad_norm=0.5)
    got = _muon_run(FUSED, [(6, 4), (4, 6)], lambda s, b: None, [torch.float64] * 2, steps=2, max_grad_norm=0.5)
    for param, want in zip(got, expected):
        assert torch.equal(param, want)


# --- review of 835b524: fused Muon in the bound step (muon_parts.BoundMomentum) -----------------------------
# A fused Muon bound (its momentum tables in the step's one native call, then BoundMomentum.finish)
# against a twin whose every step is checked, under what users change between steps.

BOUND_SHAPES = [(8, 4), (4, 8), (16,)]  # two Muon matrices (one slice), an AdamW companion vector


def _muon_groups(params, **options):
    return fastoptim.Muon([{"params": params[:2]}, {"params": params[2:], "use_muon": False}], lr=0.02, **options)


def _muon_bound_and_checked(monkeypatch, change, factory=_muon_groups, shapes=BOUND_SHAPES, dtype=torch.float32,
                            steps=4):
    """The bound path's results (True/False per bound attempt) of ``factory`` stepped with ``change``
    before each step, its params and momentum buffers bit for bit a checked twin's."""
    calls, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: calls.append(real(self, *args)) or calls[-1])
    bound = _run(factory, change, False, steps, shapes, dtype)
    ran = list(calls)
    checked = _run(factory, change, True, steps, shapes, dtype)
    for ours, theirs in zip(bound["params"], checked["params"]):
        assert torch.equal(ours, theirs)
        for key, value in bound["opt"].state[ours].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, checked["opt"].state[theirs][key]), key
    return ran


def _set(step, **options):
    return lambda now, box: box["opt"].param_groups[0].update(options) if now == step else None


def _write(step, write):
    return lambda now, box: write(box["opt"], box["params"]) if now == step else None


def _momentum(opt, params):
    return opt.state[params[0]]["momentum_buffer"]


def _a_grad_gone_for_a_step(step, box):
    if step == 2:
        box["params"][0].grad = None


def _saved_then_loaded(step, box):
    if step == 1:
        box["saved"] = copy.deepcopy(box["opt"].state_dict())
    if step == 2:
        box["opt"].load_state_dict(box["saved"])


def _a_matrix_appended(step, box):
    if step == 2:
        box["params"].insert(2, torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(7))))
        box["params"][2].grad = grad_for(box["params"][2], step)
        box["opt"].param_groups[0]["params"].append(box["params"][2])


# change -> the bound attempts of steps 1..3: True ran bound, False refused (then checked)
BOUND_MUON_CHANGES = {
    "param mul_": (_write(2, lambda opt, params: params[0].mul_(0.5)), [True] * 3),
    # native code watches the params: one given other storage refuses a step, then binds again
    "param set_": (_write(2, lambda opt, params: params[0].set_(params[0].clone() * 0.5)), [True, False, True]),
    "momentum mul_": (_write(2, lambda opt, params: _momentum(opt, params).mul_(2)), [True] * 3),
    "momentum assigned": (_write(2, lambda opt, params: opt.state[params[0]].__setitem__(
        "momentum_buffer", _momentum(opt, params) * 2)), [True, False, True]),
    "lr schedule": (lambda step, box: [group.__setitem__("lr", 0.02 / (step + 1)) for group in box["opt"].param_groups],
                    [True] * 3),
    "tensor lr in the Muon group": (_set(2, lr=torch.tensor(0.01)), [True] * 3),
    "momentum": (_set(2, momentum=0.5), [True] * 3),
    "nesterov off": (_set(2, nesterov=False), [True] * 3),
    "ns_steps": (_set(2, ns_steps=2), [True] * 3),
    "ns_coefficients": (_set(2, ns_coefficients=(2.0, -1.5, 0.5)), [True] * 3),
    "maximize": (_set(2, maximize=True), [True] * 3),
    "adjust_lr_fn": (_set(2, adjust_lr_fn="match_rms_adamw"), [True, False, True]),
    "num_heads": (_set(2, num_heads=2), [True, False, True]),
    "use_muon off": (_set(2, use_muon=False, eps=1e-8, adamw_eps=1e-8), [True, False, True]),
    "GradScaler on then off": (_scaler_on_then_off(2), [True, True, True]),  # its scale is the native call's
    "a grad None for a step": (_a_grad_gone_for_a_step, [True, False, False]),
    "params reordered": (lambda step, box: box["opt"].param_groups[0]["params"].reverse() if step == 2 else None,
                         [True, False, True]),
    "a matrix appended": (_a_matrix_appended, [True, False, True]),
    "state dict loaded": (_saved_then_loaded, [True, True]),
}


@native
@pytest.mark.parametrize("change", BOUND_MUON_CHANGES)
def test_a_bound_fused_muon_follows_what_the_user_changes_between_steps(change, monkeypatch):
    """Each write between steps reaches BoundMomentum's next step (its group's options are read at each
    launch and finish) or makes a new plan, bit for bit a checked twin, params and momentum buffers."""
    write, expected = BOUND_MUON_CHANGES[change]
    assert _muon_bound_and_checked(monkeypatch, write) == expected


BOUND_MUON_SETUPS = {
    "split_sizes set": (lambda p: _muon_groups(p, foreach=True, fused=True),
                        _set(2, split_sizes=(4, 4)), [(8, 4), (8, 4), (16,)], torch.float32, [True, False, True]),
    "stochastic rounding on and off": (lambda p: _muon_groups(p, foreach=True, fused=True),
                                       lambda step, box: box["opt"].param_groups[0].__setitem__(
                                           "stochastic_rounding", step % 2 == 1),
                                       BOUND_SHAPES, torch.bfloat16, [True, True, True]),  # see fb6ac68
    "single, bf16, master_bits=32, param mul_": (lambda p: _muon_groups(p, foreach=False, fused=True, master_bits=32),
                                                 _write(2, lambda opt, params: params[0].mul_(0.5)), BOUND_SHAPES,
                                                 torch.bfloat16, [True] * 3),
    "8-bit momentum written in place": (
        lambda p: _muon_groups(p, foreach=True, fused=True, state_bits=8),
        _write(2, lambda opt, params: [t.mul_(0.5) for t in opt.state[params[0]].values()
                                       if isinstance(t, torch.Tensor) and t.is_floating_point()]),
        [(64, 80), (32, 128), (4096,)], torch.float32, [True] * 3),
    "Muon groups alone": (lambda p: fastoptim.Muon([{"params": p[:2]}, {"params": p[2:], "nesterov": False}],
                                                   lr=0.02, foreach=True, fused=True),
                          lambda step, box: None, [(8, 4), (4, 8), (6, 6)], torch.float32, [True] * 3),
    "companions first and last": (lambda p: fastoptim.Muon(
        [{"params": p[:1], "use_muon": False}, {"params": p[1:3]}, {"params": p[3:], "use_muon": False}], lr=0.02,
        foreach=True, fused=True), _write(2, lambda opt, params: params[1].mul_(0.5)),
        [(16,), (8, 4), (4, 8), (5,)], torch.float32, [True] * 3),
    "float64 (no fused kernel: never bound)": (lambda p: _muon_groups(p, foreach=True, fused=True),
                                              lambda step, box: None, BOUND_SHAPES, torch.float64, []),
    # clipped: the native call's coefficient multiplies the momentum kernel's grad scale, whose product the
    # kernel rounds as the checked step's scaled grads are (it took the checked way every step before)
    "max_grad_norm": (lambda p: _muon_groups(p, foreach=True, fused=True, max_grad_norm=0.5),
                      lambda step, box: None, [(4, 8), (8, 4), (4, 8), (16,)], torch.float32, [True] * 3),
    "max_grad_norm, bf16, nesterov off, maximize": (
        lambda p: _muon_groups(p, foreach=True, fused=True, max_grad_norm=0.5, nesterov=False, maximize=True),
        lambda step, box: None, BOUND_SHAPES, torch.bfloat16, [True] * 3),
    "max_grad_norm, 8-bit momentum, single": (
        lambda p: _muon_groups(p, foreach=False, fused=True, max_grad_norm=0.5, state_bits=8),
        lambda step, box: None, [(64, 80), (32, 128), (4096,)], torch.float32, [True] * 3),
    "max_grad_norm changed": (lambda p: _muon_groups(p, foreach=True, fused=True, max_grad_norm=0.5),
                              lambda step, box: box["opt"].defaults.update(max_grad_norm=step / 4),
                              BOUND_SHAPES, torch.float32, [True] * 3),
}


@native
@pytest.mark.parametrize("setup", BOUND_MUON_SETUPS)
def test_a_bound_fused_muon_under_other_options_follows_the_checked_twin(setup, monkeypatch):
    factory, change, shapes, dtype, expected = BOUND_MUON_SETUPS[setup]
    assert _muon_bound_and_checked(monkeypatch, change, factory, shapes, dtype) == expected


@native
def test_a_bound_clipped_muon_sums_the_norm_in_the_checked_step_s_order():
    """A bound step's native call sums its grads' squares for the clip in the order its tables list them,
    which for a Muon bucket is by matrix shape; the checked step sums them in the params' order. Grads of
    one element each, of magnitudes whose float64 sum in those two orders rounds to two fp32 norms (found
    by search; 1 + 2^-24 is the tie between 1 and the next fp32 number): the bound step sums in the
    checked order (``bind_call``'s ``norm_order``), so the two coefficients, and the momenta, are one."""
    def run(checked):
        params = [torch.nn.Parameter(torch.ones(shape)) for shape in [(4, 8), (8, 4), (4, 8)]]
        opt = fastoptim.Muon(params, lr=0.02, foreach=True, fused=True, max_grad_norm=0.5)
        for step in range(3):
            for param, value in zip(params, [0.00027276098, 1.0, 0.00021168547]):  # by shape: 1st, 3rd, 2nd
                param.grad = torch.zeros_like(param)
                param.grad[0, 0] = value * (step + 1)
            if checked:
                opt._plans.bound = None
            elif step == 2:
                assert opt._plans.bound is not None
            opt.step()
        return params, [opt.state[param]["momentum_buffer"] for param in params]

    (params, momenta), (checked_params, checked_momenta) = run(checked=False), run(checked=True)
    for ours, theirs in zip(params + momenta, checked_params + checked_momenta):
        assert torch.equal(ours, theirs)


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params])


def _bad_ns_coefficients(opt, params):
    opt.param_groups[0]["ns_coefficients"] = (1.0, float("nan"), 0.0)


def _param_resized_grad_stale(opt, params):
    params[0].data = torch.randn(6, 4)  # its grad, left from before, is (8, 4)


@native
@pytest.mark.parametrize("write", [_bad_ns_coefficients, _param_resized_grad_stale],
                         ids=lambda write: write.__name__)
def test_a_bound_fused_muon_step_that_raises_changes_nothing(write, monkeypatch):
    """ns_coefficients made invalid between steps, or a param given another shape by .data = while its
    grad keeps the old one: the bound step raises before its native call runs anything (the Muon
    group's arguments are computed first; native code watches the params, which finish updates), as
    the checked step does (found by the review of 835b524)."""
    calls, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: calls.append(real(self, *args)) or calls[-1])
    params = make(BOUND_SHAPES)
    opt = _muon_groups(params, foreach=True, fused=True)
    for step in range(2):
        for param in params:
            param.grad = grad_for(param, step)
        opt.step()
    assert calls == [True]
    for param in params:
        param.grad = grad_for(param, 2)
    with torch.no_grad():
        write(opt, params)
    before = _snapshot(opt, params)
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()
    after = _snapshot(opt, params)
    for ours, theirs in zip(after[0], before[0]):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(after[1], before[1]):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _grad_scale_alone_at_step_2(step, box):
    if step == 2:
        box["opt"].grad_scale = torch.tensor(4.0)


@native
def test_a_bound_muon_step_under_a_grad_scale_rounds_as_its_checked_twin(monkeypatch):
    """A tensor grad scale (``grad_scale`` set without found_inf) beside a companion group that rounds
    stochastically: the bound step refused it after the companions had drawn their seeds, so the checked
    step it fell back to rounded otherwise (found by the review of 835b524); the bound step now runs
    under it, the native call unscaling the momentum's grads, and draws its seeds as its twin does."""
    factory = lambda p: fastoptim.Muon([{"params": p[2:], "use_muon": False, "stochastic_rounding": True},  # noqa: E731
                                        {"params": p[:2]}], lr=0.02, foreach=True, fused=True)
    assert _muon_bound_and_checked(monkeypatch, _grad_scale_alone_at_step_2, factory, dtype=torch.bfloat16,
                                   steps=3) == [True, True]


@native
@pytest.mark.parametrize("order, bound", [("muon only", [True] * 4), ("companions first", [True] * 4),
                                          ("muon first", [False] * 4)])
def test_a_muon_group_that_rounds_stochastically_steps_bound_where_the_draws_keep_their_order(order, bound,
                                                                                              monkeypatch):
    """A Muon group of bf16 matrices with stochastic rounding: its update draws its random bits after the
    bound step's native call, and a group before it draws its kernel's seed before the call, as the checked
    step draws group by group. So it steps bound (it took the checked way at every step before), bit for bit
    as its checked twin, but where a group that draws a seed follows it (that seed would be drawn first)."""
    def factory(params):
        muon = {"params": params[:2], "stochastic_rounding": True}
        companions = {"params": params[2:], "use_muon": False, "stochastic_rounding": True}
        groups = {"muon only": [muon | {"params": params[:2]}], "companions first": [companions, muon],
                  "muon first": [muon, companions]}[order]
        return fastoptim.Muon(groups, lr=0.02, foreach=True, fused=True)

    shapes = BOUND_SHAPES[:2] if order == "muon only" else BOUND_SHAPES
    assert _muon_bound_and_checked(monkeypatch, lambda *args: None, factory, shapes, dtype=torch.bfloat16,
                                   steps=5) == bound


@native
@pytest.mark.parametrize("cls", ["AdamW", "Muon"])
def test_a_group_that_rounds_stochastically_without_grads_steps_bound_as_checked(cls):
    """A group that rounds stochastically and has no grads (frozen companions): the bound step read its
    device from its first grad to save its generator's state, and raised an AttributeError at every step
    (helper-53; reached by more Muon groups once they rounded bound). It draws no seed, as the checked
    step draws none, and both step alike."""
    def run(checked):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in BOUND_SHAPES]
        groups = [{"params": params[:2], "stochastic_rounding": True},
                  {"params": params[2:], "stochastic_rounding": True}]
        if cls == "Muon":
            groups[1]["use_muon"] = False
            opt = fastoptim.Muon(groups, lr=0.02, foreach=True, fused=True)
        else:
            opt = fastoptim.AdamW(groups, lr=0.02, fused=True)
        for step in range(4):
            for param in params[:2]:
                param.grad = grad_for(param, step)
            if checked:
                opt._plans.bound = None
            opt.step()
        return params, opt._plans.bound

    (bound, plan), (checked, _) = run(False), run(True)
    assert plan is not None and all(map(torch.equal, bound, checked))


# --- the review of 79bb6e6 (each group's work holds its structure; the bound step checks it by that rule) ----

@native
def test_a_compiled_step_that_takes_a_groups_states_again_refuses_the_bound_step_planned_before_it(monkeypatch):
    """A compiled step's preparation takes a replaced state into the group's work, whose bucket plans (and
    tables) are then new: the bound step planned before must not run on its old tables, which still
    hold the replaced tensor (it did, and the state in the state dict stopped moving: helper-40)."""
    def change(step, box):
        if step == 2:
            box["opt"].state[box["params"][0]]["exp_avg"] = _exp_avg_doubled(box["opt"], box["params"])

    def run(checked):
        params = make(SHAPES)
        opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
        compiled = torch.compile(opt.step, backend="aot_eager")
        states = []
        for step in range(6):
            for param in params:
                param.grad = grad_for(param, step)
            change(step, {"opt": opt, "params": params})
            if checked:
                opt._plans.bound = None
            compiled() if step == 2 else opt.step()
            states.append(opt.state[params[0]]["exp_avg"].clone())
        return params, states

    calls, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: calls.append(real(self, *args)) or calls[-1])
    torch._dynamo.reset()
    (bound, bound_states), (checked, checked_states) = run(False), run(True)
    assert all(map(torch.equal, bound, checked)) and all(map(torch.equal, bound_states, checked_states))
    assert calls == [True, False, True, True], calls  # steps 1, 3, 4, 5: after the compiled one refused once


@native
@pytest.mark.parametrize("engine", [dict(fused=True), dict(foreach=True, fused=False), dict(foreach=False)],
                         ids=["fused", "foreach", "loop"])
def test_an_option_a_numpy_array_holds_written_in_place_reaches_the_plan(engine, monkeypatch):
    """amsgrad held by a 0-d array, set in place between steps: the step keeps max_exp_avg_sq from then on,
    as one given amsgrad=True does (the work's structure was kept while the array was the same object:
    the fused step raised at every step, the others never made the state: helper-40)."""
    def change(as_array):
        def write(step, box):
            group = box["opt"].param_groups[0]
            if step == 1:
                group["amsgrad"] = np.array(False) if as_array else False
            if step == 3:
                if as_array:
                    group["amsgrad"][()] = True
                else:
                    group["amsgrad"] = True
        return write

    factory = lambda ps: fastoptim.AdamW(ps, lr=1e-2, **engine)  # noqa: E731
    written = _run(factory, change(as_array=True), checked=False)
    assigned = _run(factory, change(as_array=False), checked=True)
    for ours, theirs in zip(written["params"], assigned["params"]):
        assert torch.equal(ours, theirs)
        assert "max_exp_avg_sq" in written["opt"].state[ours]
        assert torch.equal(written["opt"].state[ours]["max_exp_avg_sq"], assigned["opt"].state[theirs]["max_exp_avg_sq"])


@native
def test_betas_a_numpy_array_holds_edited_in_place_reach_the_bound_step(monkeypatch):
    """AdamWSN's β1 set to 0 in an array of betas: its first moment goes, on the bound step as on the checked
    one (the bound step kept its planned flags and wrote exp_avg on: helper-40)."""
    def change(step, box):
        group = box["opt"].param_groups[0]
        if step == 1:
            group["betas"] = np.array([0.9, 0.999])
        if step == 3:
            group["betas"][0] = 0.0

    ran = _bound_and_checked(lambda ps: fastoptim.AdamWSN(ps, lr=1e-2, sn=True, fused=True), change, monkeypatch)
    assert ran[-1] is True  # bound again on the new flags


@native
@pytest.mark.parametrize("betas", [[], None, (torch.tensor([0.9, 0.8]), 0.99)], ids=["empty", "None", "a 1-d tensor"])
def test_invalid_betas_written_between_bound_steps_are_refused_by_name(betas):
    """The bound step checks the group's options before it computes their structure (which read ``betas[0]``,
    and raised IndexError, TypeError or a tensor's ambiguous truth: helper-40), and changes nothing."""
    params = make(SHAPES)
    opt = fastoptim.AdamWSN(params, lr=1e-2, sn=True, fused=True)
    for step in range(3):
        for param in params:
            param.grad = grad_for(param, step)
        opt.step()
    assert opt._plans.bound is not None
    before = _snapshot(opt, params)
    opt.param_groups[0]["betas"] = betas
    with pytest.raises(ValueError, match="Invalid betas"):
        opt.step()
    after = _snapshot(opt, params)
    assert all(map(torch.equal, after[0], before[0]))
    for ours, theirs in zip(after[1], before[1]):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@native
@pytest.mark.parametrize("found_inf", [torch.tensor, lambda value: torch.tensor([value])], ids=["0-d", "1-d"])
@pytest.mark.parametrize("dtype, options", [(torch.float32, {}), (torch.bfloat16, dict(master_bits=24))],
                         ids=["fp32", "bf16, master_bits=24"])
@pytest.mark.parametrize("inf_at", [(), (2,), (1, 3)], ids=["no inf", "an inf at step 2", "infs at steps 1 and 3"])
def test_a_bound_clipped_muon_under_gradscaler_skips_what_the_checked_step_skips(inf_at, dtype, options, found_inf,
                                                                                   monkeypatch):
    """GradScaler's scale and found_inf, handed to the step as it hands them: the Muon part runs bound (it
    took the checked way under any GradScaler), its momentum kernel unscaling the grads in the native call
    and rounding their product as the checked step's scaled grads are. A step GradScaler found an inf in
    takes the checked way, which skips it: skipped bound, the next step restarted the bf16 params' master
    remainders, their version counters not where the step noted them (helper-48). A found_inf of one value
    in one dimension is read as GradScaler's (the native call refused it: helper-48)."""
    def change(step, box):
        for param in box["params"]:
            param.grad = param.grad * 64
        box["opt"].grad_scale = torch.tensor(64.0)
        box["opt"].found_inf = found_inf(1.0 if step in inf_at else 0.0)

    factory = lambda p: _muon_groups(p, foreach=True, fused=True, max_grad_norm=0.5, **options)  # noqa: E731
    assert _muon_bound_and_checked(monkeypatch, change, factory, shapes=[(4, 8), (8, 4), (8, 8), (16,)], dtype=dtype,
                                   steps=5) == [step not in inf_at for step in range(1, 5)]
