"""The torch.optim contract: groups, hooks, closures, state dicts, pickling, schedulers, compile."""
import collections
import copy
import pickle
import subprocess
import sys

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import fastoptim

from . import oracle, registry
from .test_adversarial import ENGINES as EVERY_ENGINE

OPTIMIZERS = [info.cls for info in registry.OPTIMIZERS]
ENGINES = [dict(foreach=False), dict(foreach=True)]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def train(model, optimizer, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_param_groups_keep_their_own_options(cls):
    model = tiny_model()
    first, second = model[0], model[2]
    opt = cls([{"params": first.parameters()}], lr=0.01)
    opt.add_param_group({"params": second.parameters(), "lr": 0.0, "weight_decay": 0.0})
    before = [p.detach().clone() for p in second.parameters()]
    train(model, opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, second.parameters()))
    lr = {param: group["lr"] for group in opt.param_groups for param in group["params"]}
    assert {lr[p] for p in second.parameters()} == {0.0} and {lr[p] for p in first.parameters()} == {0.01}


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_state_cleared_by_hand_saves_and_loads_as_torch_s_does(cls):
    """``optimizer.state[p].clear()`` (a reset of one param's moments) leaves an empty state that a state
    dict saves: its load refused it as a state of another optimizer's keys ([]). It loads as empty, and
    the next step makes it anew, as the run that was never saved does."""
    runs = []
    for reload in (False, True):
        model = tiny_model()
        opt = cls(model.parameters(), lr=0.01)
        train(model, opt, 2)
        opt.state[next(model.parameters())].clear()
        if reload:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            assert opt.state[next(model.parameters())] == {}
        train(model, opt, 2)
        runs.append(list(model.parameters()))
    assert all(map(torch.equal, *runs))


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_closure_hooks_and_zero_grad(cls):
    model = tiny_model()
    opt = cls(model.parameters(), lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 6)).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("engine", [dict(), dict(foreach=True, fused=False)], ids=["default", "foreach"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_step_runs_without_grad_and_leaves_grad_mode_as_it_found_it(cls, engine):
    """As torch.optim's: the closure runs with grad, the update without (foreach's in-place ops on the
    params raise under grad), hooks in the caller's mode; afterwards (also after a step that raised)
    grad mode is what it was."""
    model = tiny_model()
    opt = cls(model.parameters(), lr=0.01, **engine)
    modes = []
    opt.register_step_pre_hook(lambda *a: modes.append(("hook", torch.is_grad_enabled())))

    def closure():
        modes.append(("closure", torch.is_grad_enabled()))
        loss = model(torch.ones(2, 6)).sum()
        loss.backward()
        return loss

    for enabled in (True, False):
        modes.clear()
        with torch.set_grad_enabled(enabled):
            opt.step(closure)
            assert torch.is_grad_enabled() is enabled
        assert modes == [("hook", enabled), ("closure", True)]
        assert not any(p.requires_grad is False or p.grad_fn is not None for p in model.parameters())
    param = next(model.parameters())
    param.grad = torch.zeros_like(param).to_sparse()  # the step raises
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.is_grad_enabled()


def step_hook_calls(optimizer):
    """What the step hooks (global and the optimizer's, pre and post) saw of two steps, the second with
    a closure that a pre-hook replaces, and what the step returned."""
    calls = []

    def swap_closure(opt, args, kwargs):
        calls.append(("pre", type(opt).__name__, len(args), sorted(kwargs)))
        if kwargs:
            return args, {"closure": lambda: "replaced"}

    handles = [register_optimizer_step_pre_hook(lambda opt, a, k: calls.append("global pre")),
               register_optimizer_step_post_hook(lambda opt, a, k: calls.append("global post")),
               optimizer.register_step_pre_hook(swap_closure),
               optimizer.register_step_post_hook(lambda opt, a, k: calls.append(("post", sorted(k))))]
    try:
        calls.append(optimizer.step())
        calls.append(optimizer.step(closure=lambda: "original"))
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            optimizer.register_step_pre_hook(lambda *a: "bad")
            optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    return [call if not isinstance(call, tuple) or call[0] != "pre" else call[0::2] for call in calls]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_step_hooks_and_the_profiler_range_are_torchs(cls):
    """The step's wrapper is leaner than torch's (its profiler range only while a profiler runs), and
    runs the hooks as torch's does: the same calls, in the same order, as torch's AdamW sees."""
    def make(optimizer_cls):
        return optimizer_cls([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    assert step_hook_calls(make(cls)) == step_hook_calls(make(torch.optim.AdamW))
    opt = make(cls)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        opt.step()
    assert f"Optimizer.step#{cls.__name__}.step" in {event.name for event in profile.events()}


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_params_without_grads_are_skipped_and_no_grads_is_a_no_op(cls):
    params = oracle.make_params()
    opt = cls(params, lr=0.1)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and not opt.state
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert not torch.equal(before[0], params[0])
    assert all(torch.equal(a, b) for a, b in zip(before[1:], params[1:]))
    assert list(opt.state) == [params[0]]


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("source", ENGINES)
@pytest.mark.parametrize("target", ENGINES)
def test_state_dict_moves_between_engines(cls, source, target):
    reference = tiny_model()
    reference_opt = cls(reference.parameters(), lr=0.01, weight_decay=0.02, **source)
    train(reference, reference_opt, 3)
    model = copy.deepcopy(reference)
    opt = cls(model.parameters(), lr=0.01, weight_decay=0.02, **target)
    opt.load_state_dict(reference_opt.state_dict())
    assert opt.param_groups[0]["foreach"] == target["foreach"]
    assert train(model, opt, 4, seed=2) == train(reference, reference_opt, 4, seed=2)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_loaded_state_is_a_copy(cls):
    model = tiny_model()
    opt = cls(model.parameters(), lr=0.01)
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    other = cls(tiny_model().parameters(), lr=0.01)
    other.load_state_dict(saved)
    snapshot = copy.deepcopy(saved)
    train(model, other, 1)
    for key, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(value, snapshot["state"][key][name])


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_pickle_and_deepcopy(cls):
    model = tiny_model()
    opt = cls(model.parameters(), lr=0.01)
    train(model, opt, 2)
    clone = copy.deepcopy((model, opt))
    restored = pickle.loads(pickle.dumps((model, opt)))
    expected = train(model, opt, 3, seed=5)
    assert train(*clone, 3, seed=5) == expected
    assert train(*restored, 3, seed=5) == expected


# --- state-dict hooks, as torch's own tests (test/test_optim.py, TestOptimRenewed) run them ---------
# Torch's hooks keep entries in ``optimizer.state`` that are not a param's state: a key that is no param,
# a value that is no dict. ``optimizer.state`` takes whatever torch's ``defaultdict(dict)`` takes.

def _state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer, state_dict):
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _load_state_dict_pre_hook1(optimizer, state_dict):
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_state_dict_pre_hook2(optimizer, state_dict):
    my_state_dict = copy.deepcopy(state_dict)  # a hook that returns a new dict: that one is loaded
    my_state_dict["param_groups"][0]["lr"] = 0.003
    return my_state_dict


def _load_state_dict_post_hook(optimizer):
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


def hooked_optimizer(cls, stepped):
    """Torch's tests' optimizer (one (2, 3) param, no step), or with ``stepped`` one that has states."""
    param = torch.rand(2, 3, requires_grad=True)
    optimizer = cls([param], lr=0.001)
    if stepped:
        param.grad = torch.rand(2, 3)
        optimizer.step()
    return optimizer


def steps_on(optimizer):
    """A step after the hooks ran, with their entries in ``optimizer.state``: the param's state moves on."""
    (param,) = optimizer.param_groups[0]["params"]
    param.grad = torch.rand(2, 3)
    before = param.detach().clone()
    optimizer.step()
    assert not torch.equal(before, param)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_pre_hook(cls, stepped):
    optimizer = hooked_optimizer(cls, stepped)
    optimizer.register_state_dict_pre_hook(_state_dict_pre_hook)
    state_dict = optimizer.state_dict()
    assert state_dict["state"]["test"] == 1
    steps_on(optimizer)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_post_hook(cls, stepped):
    optimizer = hooked_optimizer(cls, stepped)
    optimizer.register_state_dict_post_hook(_state_dict_post_hook)
    assert optimizer.state_dict()["ran_state_dict_pre_hook"] is False


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_pre_post_hook(cls, stepped):
    optimizer = hooked_optimizer(cls, stepped)
    optimizer.register_state_dict_pre_hook(_state_dict_pre_hook)
    optimizer.register_state_dict_post_hook(_state_dict_post_hook)
    state_dict = optimizer.state_dict()
    assert "test" not in state_dict["state"] and state_dict["ran_state_dict_pre_hook"] is True
    steps_on(optimizer)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_state_dict_pre_hook_and_prepend(cls, stepped):
    optimizer = hooked_optimizer(cls, stepped)
    state_dict = optimizer.state_dict()
    optimizer.register_load_state_dict_pre_hook(_load_state_dict_pre_hook1)
    optimizer.load_state_dict(state_dict)
    assert optimizer.param_groups[0]["lr"] == 0.002
    optimizer.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2, prepend=True)
    optimizer.load_state_dict(state_dict)
    assert optimizer.param_groups[0]["lr"] == 0.002  # prepended, hook2 runs first, and hook1 has the last word


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_state_dict_post_hook(cls, stepped):
    optimizer = hooked_optimizer(cls, stepped)
    optimizer.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer.state["ran_load_state_dict_pre_hook2"] is False
    assert optimizer.state["ran_load_state_dict_post_hook"] is True
    steps_on(optimizer)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_state_dict_pre_post_hook(cls, stepped):
    optimizer = hooked_optimizer(cls, stepped)
    optimizer.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2)
    optimizer.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer.state["ran_load_state_dict_pre_hook2"] is True
    assert optimizer.state["ran_load_state_dict_post_hook"] is True
    steps_on(optimizer)


@pytest.mark.parametrize("engine", EVERY_ENGINE)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_entries_that_are_no_params_state_travel_as_torch_keeps_them(cls, engine):
    """Beside the params' states, ``optimizer.state`` keeps what a user or hook puts there, as torch's
    does: steps are those of an optimizer without it, and state dicts, loads and copies keep it."""
    ours, twin = (tiny_model(), tiny_model())
    opt = cls(ours.parameters(), lr=0.01, **EVERY_ENGINE[engine])
    twin_opt = cls(twin.parameters(), lr=0.01, **EVERY_ENGINE[engine])
    opt.state["test"], opt.state["notes"] = 1, {"seen": True}
    assert train(ours, opt, 3) == train(twin, twin_opt, 3)
    state_dict = opt.state_dict()
    assert state_dict["state"]["test"] == 1 and state_dict["state"]["notes"] == {"seen": True}
    loaded = cls(tiny_model().parameters(), lr=0.01, **EVERY_ENGINE[engine])
    loaded.load_state_dict(state_dict)
    for copied in (loaded, copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.state["test"] == 1 and copied.state["notes"] == {"seen": True}
    assert train(ours, opt, 2, seed=3) == train(twin, twin_opt, 2, seed=3)


FRESH_STATES = {"defaultdict": lambda: collections.defaultdict(dict), "dict": dict}


def built_now(cls, model, optimizer, **options):
    """A copy of ``model`` with a new optimizer of ``cls``, which continues ``optimizer``'s group counts
    (Adan's ``step`` is its group's, as official Adan keeps it, not a param's state)."""
    twin = copy.deepcopy(model)
    twin_optimizer = cls(twin.parameters(), lr=0.01, **options)
    for group, twin_group in zip(optimizer.param_groups, twin_optimizer.param_groups):
        if "step" in group:
            twin_group["step"] = group["step"].clone()
    return twin, twin_optimizer


@pytest.mark.parametrize("fresh", FRESH_STATES)
@pytest.mark.parametrize("engine", EVERY_ENGINE)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_fresh_state_assigned_between_steps_starts_the_states_again(cls, engine, fresh):
    """``optimizer.state = defaultdict(dict)`` (a common reset of the moments) or a plain dict: the
    next steps are those of an optimizer built then, and it is the state that they fill."""
    model = tiny_model()
    optimizer = cls(model.parameters(), lr=0.01, **EVERY_ENGINE[engine])
    train(model, optimizer, 3)
    twin, twin_optimizer = built_now(cls, model, optimizer, **EVERY_ENGINE[engine])
    optimizer.state = FRESH_STATES[fresh]()
    assert train(model, optimizer, 3, seed=2) == train(twin, twin_optimizer, 3, seed=2)
    assert len(optimizer.state) == len(twin_optimizer.state)


def assert_same_states(model, optimizer, twin, twin_optimizer):
    """The params of ``model`` and ``twin`` and their states in ``optimizer.state`` and ``twin_optimizer.state``
    agree to a few ulps."""
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert optimizer.state[a].keys() == twin_optimizer.state[b].keys()
        for key, value in optimizer.state[a].items():
            torch.testing.assert_close(value, twin_optimizer.state[b][key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("assigned", [*FRESH_STATES, "a copy with the same count"])
@pytest.mark.parametrize("flags", [dict(foreach=True), {}], ids=["foreach", "fused"])
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_a_state_assigned_between_compiled_steps_is_the_one_they_step(cls, flags, assigned):
    """A compiled step is traced again for a state assigned since: a fresh one, or a copy of the
    states (a snapshot restored) whose change count happens to be the traced one's, so that only its
    identity tells them apart."""
    model = tiny_model()
    optimizer = cls(model.parameters(), lr=0.01, **flags)
    torch._dynamo.reset()
    compiled_step = torch.compile(optimizer.step, backend="aot_eager", fullgraph=True)
    twin = None
    for step in range(6):
        if step == 3:
            if assigned in FRESH_STATES:
                twin, twin_optimizer = built_now(cls, model, optimizer, **flags)
                optimizer.state = FRESH_STATES[assigned]()
            else:
                twin, twin_optimizer = copy.deepcopy((model, optimizer))
                changes = optimizer.state.changes
                optimizer.state = {param: {key: value.clone() for key, value in state.items()}
                                   for param, state in optimizer.state.items()}
                optimizer.state.changes = changes
        for m in (model, twin) if twin is not None else (model,):
            m.zero_grad()
            m(torch.ones(4, 6) * step).pow(2).sum().backward()
        compiled_step()
        if twin is not None:
            twin_optimizer.step()
    assert_same_states(model, optimizer, twin, twin_optimizer)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_schedulers(cls, tensor_lr):
    model = tiny_model()
    opt = cls(model.parameters(), lr=torch.tensor(0.01) if tensor_lr else 0.01)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    for _ in range(5):
        train(model, opt, 1)
        one_cycle.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(one_cycle.get_last_lr()[0])
    opt = cls(model.parameters(), lr=torch.tensor(0.01) if tensor_lr else 0.01)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    plateau_opt = cls(model.parameters(), lr=0.01)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(plateau_opt, patience=0, factor=0.5)
    for _ in range(3):
        train(model, opt, 1)
        cosine.step()
        plateau.step(1.0)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(cosine.get_last_lr()[0])
    assert plateau_opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**2)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_tensor_lr_equals_float_lr(cls):
    results = []
    for lr in (0.01, torch.tensor(0.01)):
        model = tiny_model()
        results.append(train(model, cls(model.parameters(), lr=lr, foreach=True), 5))
    assert results[0] == pytest.approx(results[1], rel=1e-6)


@pytest.mark.parametrize("cls, options", [(fastoptim.Adan, dict(max_grad_norm=1.0)),
                                          (fastoptim.AdamW, dict(amsgrad=True))])
@pytest.mark.parametrize("flags", [dict(foreach=True), {}])  # {}: the fused engine, traced as its custom op
def test_compiled_step_has_no_graph_break_and_no_recompile_on_lr_change(cls, options, flags):
    model = tiny_model()
    opt = cls(model.parameters(), lr=torch.tensor(0.01), **flags, **options)
    reference = copy.deepcopy(model)
    reference_opt = cls(reference.parameters(), lr=torch.tensor(0.01), **flags, **options)
    torch._dynamo.reset()
    compiled_step = torch.compile(opt.step, fullgraph=True)  # fullgraph: a graph break raises
    for step in range(4):
        for m in (model, reference):
            m.zero_grad()
            m(torch.ones(4, 6) * step).pow(2).sum().backward()
        if step == 2:  # dynamo adds 'capturable' to the groups on the first call; then it is settled
            for o in (opt, reference_opt):
                o.param_groups[0]["lr"].fill_(0.005)
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):
            compiled_step()
        reference_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


RESUME_SCRIPT = """
import sys, torch, fastoptim
from tests.test_contract import tiny_model, train
cls, foreach, mode, path = getattr(fastoptim, sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4]
model = tiny_model()
opt = cls(model.parameters(), lr=0.01, weight_decay=0.02, foreach=foreach)
if mode == "resume":
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    losses = train(model, opt, 5, seed=9)
else:
    train(model, opt, 5, seed=8)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    losses = train(model, opt, 5, seed=9)
print(repr([p.detach().tolist() for p in model.parameters()]), losses)
"""


@pytest.mark.parametrize("cls, foreach", [("Adan", "1"), ("AdamW", "0")])  # a new process each: seconds
def test_resume_in_a_new_process_is_bit_identical(cls, foreach, tmp_path):
    path = str(tmp_path / "checkpoint.pt")

    def run(mode):
        out = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, cls, foreach, mode, path],
                             capture_output=True, text=True, check=True)
        return out.stdout

    uninterrupted = run("save")
    assert run("resume") == uninterrupted


def _adamw_run(betas_given, edit, reload=False, cls=fastoptim.AdamW, **options):
    """Three steps of lr 0.1 on one param; betas (0.81, 0.999) as tensors ``betas_given`` "at construction"
    or "between steps" (before the second), ``edit``: β1 written in place to 0.7 before the third."""
    param = torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(0)))
    betas = (torch.tensor(0.81), torch.tensor(0.999))
    opt = cls([param], lr=0.1, **({"betas": betas} if betas_given == "at construction" else {}), **options)
    grads = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1 and betas_given == "between steps":
            opt.param_groups[0]["betas"] = betas
        if step == 1 and reload:
            saved = copy.deepcopy(opt.state_dict())
            opt = cls([param], lr=0.1, **options)
            opt.load_state_dict(saved)
        if step == 2 and edit:
            opt.param_groups[0]["betas"][0].fill_(0.7)
        param.grad = torch.randn(7, generator=grads)
        opt.step()
    return param.detach()


@pytest.mark.parametrize("edit", [False, True], ids=["as given", "edited in place"])
@pytest.mark.parametrize("engine", ["loop", "default"])
def test_tensor_betas_are_read_at_every_step_however_they_reached_the_group(engine, edit):
    """Given to the constructor or loaded, tensor betas were taken as the numbers they held: a write in place
    was not followed, the step differed from torch's with the same tensors by 8 ulps, and a resume after
    tensor betas were written between steps differed from the run it resumed (helper-89). They are read at
    every step, as torch.optim reads them: the same run however they came, and a resumed run bit for bit."""
    options = dict(foreach=False, fused=False) if engine == "loop" else {}
    given = _adamw_run("at construction", edit, **options)
    assert torch.equal(given, _adamw_run("at construction", edit, reload=True, **options))
    assert torch.equal(_adamw_run("between steps", edit, **options),
                       _adamw_run("between steps", edit, reload=True, **options))
    theirs = _adamw_run("at construction", edit, cls=torch.optim.AdamW, foreach=False)
    torch.testing.assert_close(given, theirs, rtol=0, atol=2.5e-7)  # 2 ulp at these magnitudes
    if edit:
        assert not torch.equal(given, _adamw_run("at construction", False, **options))
