"""Bad input gets a clear error and changes nothing."""
import copy
import inspect
import pickle
import warnings
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

import fastoptim

from . import oracle
from .registry import OPTIMIZERS, WITH_BETAS

ALL = [info.cls for info in OPTIMIZERS]


def snapshot(params, opt):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(params, opt, before):
    values, state = before
    assert all(torch.equal(a, b) for a, b in zip(values, params))
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"] or str(after["param_groups"]) == str(state["param_groups"])
    assert after["state"].keys() == state["state"].keys()
    for key in state["state"]:
        for name, value in state["state"][key].items():
            now = after["state"][key][name]
            assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value, (key, name)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("name, value", [
    ("lr", -1.0), ("lr", float("nan")), ("lr", float("inf")), ("eps", -1e-8), ("weight_decay", -0.1),
    ("weight_decay", float("inf")), ("max_grad_norm", -1.0), ("lr", "0.1"), ("lr", torch.tensor([0.1, 0.2]))])
def test_invalid_hyperparameters_name_the_argument(info, name, value):
    if not info.takes(name):
        pytest.skip(f"{info.name} takes no {name}")
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        info.cls(oracle.make_params(), **{name: value})


@pytest.mark.parametrize("info", WITH_BETAS, ids=repr)
def test_invalid_betas(info):
    n = info.cls.algorithm.n_betas
    for betas, message in [((0.9, 1.0, 0.9)[:n], r"Invalid betas\[1\]"), ((-0.1, 0.9, 0.9)[:n], r"Invalid betas\[0\]"),
                           ((1.0, 0.9, 0.9)[:n], r"Invalid betas\[0\]"),
                           ((0.9, float("nan"), 0.9)[:n], r"Invalid betas\[1\]"),
                           ((0.9,) * (n + 1), "Invalid betas:"), ((0.9,) * (n - 1), "Invalid betas:")]:
        with pytest.raises(ValueError, match=message):
            info.cls(oracle.make_params(), betas=betas)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("value", [4, 0, 64, "8", True, 8.0, None])
def test_invalid_state_bits_are_refused(info, value):
    with pytest.raises(ValueError, match="Invalid state_bits"):
        info.cls(oracle.make_params(), state_bits=value)


@pytest.mark.parametrize("info", [info for info in OPTIMIZERS if not info.second_moment], ids=repr)
def test_sn_is_refused_where_no_second_moment_is_kept(info):
    """In the constructor, a group, a group added later and a loaded group: nothing changes."""
    params = oracle.make_params()
    with pytest.raises((TypeError, ValueError), match="sn"):
        info.cls(params, sn=True)
    with pytest.raises(ValueError, match=f"Invalid sn: {info.name} keeps no second moment"):
        info.cls([{"params": params[:2], "sn": True}, {"params": params[2:]}])
    optimizer = info.cls(params[:2])
    groups = len(optimizer.param_groups)
    with pytest.raises(ValueError, match="Invalid sn"):
        optimizer.add_param_group({"params": params[2:], "sn": True})
    assert len(optimizer.param_groups) == groups
    saved = optimizer.state_dict()
    saved["param_groups"][0]["sn"] = True
    with pytest.raises(ValueError, match="Invalid sn"):
        optimizer.load_state_dict(saved)
    assert "sn" not in optimizer.param_groups[0] or optimizer.param_groups[0]["sn"] is False


@pytest.mark.parametrize("cls", ALL)
def test_invalid_group_options_leave_the_groups_as_they_were(cls):
    params = oracle.make_params()
    opt = cls(params[:2])
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="Invalid lr"):
        opt.add_param_group({"params": params[2:], "lr": -1})
    with pytest.raises(ValueError, match="Invalid max_grad_norm"):
        opt.add_param_group({"params": params[2:], "max_grad_norm": 3.0})
    with pytest.raises(ValueError, match="Invalid foreach"):
        opt.add_param_group({"params": params[2:], "foreach": "yes"})
    assert len(opt.param_groups) == groups


@pytest.mark.parametrize("cls", ALL)
def test_empty_param_list_is_refused(cls):
    with pytest.raises(ValueError, match="empty parameter list"):
        cls([])


@pytest.mark.parametrize("cls", ALL)
def test_mixed_devices_in_a_group_are_refused(cls):
    with pytest.raises(ValueError, match="one device"):
        cls([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, device="meta"))])


def stepped(cls, **options):
    params = oracle.make_params()
    opt = cls(params, lr=0.1, **options)
    oracle.run(opt, params, oracle.grad_sequence(oracle.SHAPES, 2))
    return params, opt


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("bad_grad, message", [
    (lambda p: torch.zeros_like(p).to_sparse(), "sparse"),
    (lambda p: torch.zeros(p.numel() + 1), "must match"),
    (lambda p: torch.zeros_like(p, dtype=torch.float64), "must match"),
])
def test_bad_grads_raise_before_anything_is_touched(cls, foreach, bad_grad, message):
    params, opt = stepped(cls, foreach=foreach, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    # The last param: everything before it would have been updated. torch refuses a mismatched
    # grad on assignment, but `.data` skips that check, as code that swaps grads in place can.
    bad = bad_grad(params[-1])
    if bad.is_sparse:
        params[-1].grad = bad
    else:
        params[-1].grad.data = bad
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert_unchanged(params, opt, before)


@pytest.mark.parametrize("cls", ALL)
def test_non_contiguous_params_are_updated_correctly(cls):
    base = torch.randn(6, 5)
    view = torch.nn.Parameter(base.t())  # a transposed, non-contiguous parameter
    dense = torch.nn.Parameter(base.t().contiguous())
    assert not view.is_contiguous()
    grads = oracle.grad_sequence([(5, 6)], 3)
    for p in (view, dense):
        oracle.run(cls([p], lr=0.1, foreach=True), [p], grads)
    torch.testing.assert_close(view, dense)


@pytest.mark.parametrize("cls", ALL)
def test_load_state_dict_mismatches_raise_without_partial_load(cls):
    params, opt = stepped(cls)
    before = snapshot(params, opt)
    good = opt.state_dict()

    fewer = copy.deepcopy(good)
    fewer["param_groups"][0]["params"] = fewer["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="does not match"):
        opt.load_state_dict(fewer)

    wrong_shape = copy.deepcopy(good)
    last = wrong_shape["param_groups"][0]["params"][-1]
    key = next(key for key, value in wrong_shape["state"][last].items() if torch.is_tensor(value) and value.dim())
    wrong_shape["state"][last][key] = torch.zeros(99)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(wrong_shape)

    bad_lr = copy.deepcopy(good)
    bad_lr["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid lr"):
        opt.load_state_dict(bad_lr)
    assert_unchanged(params, opt, before)


@pytest.mark.parametrize("source, target", [
    (torch.optim.Adam, fastoptim.Adan), (fastoptim.AdamW, fastoptim.Adan), (fastoptim.Adan, fastoptim.AdamW),
    (torch.optim.SGD, fastoptim.AdamW), (fastoptim.Adan, fastoptim.Lion), (torch.optim.SGD, fastoptim.Lion),
    (fastoptim.AdamW, fastoptim.Lion),
    (fastoptim.RMSPropSN, fastoptim.AdamW)])  # no exp_avg in any state: AdamW keeps one always (helper-65)
def test_state_dicts_of_other_optimizers_are_refused(source, target):
    params = oracle.make_params()
    options = dict(momentum=0.9) if source is torch.optim.SGD else {}
    other = source(params, lr=0.1, **options)
    oracle.run(other, params, oracle.grad_sequence(oracle.SHAPES, 2))
    params2, opt = stepped(target)
    before = snapshot(params2, opt)
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(other.state_dict())
    assert_unchanged(params2, opt, before)


PLAN_OPTIONS_WRITTEN = [("fused", "bad"), ("foreach", "bad"), ("maximize", None), ("stochastic_rounding", "x"),
                        ("master_bits", 5), ("state_bits", 7), ("sn", "x"), ("subset_size", 0), ("subset_size", "x")]


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "checked"])
@pytest.mark.parametrize("key, value", PLAN_OPTIONS_WRITTEN, ids=[f"{k}={v!r}" for k, v in PLAN_OPTIONS_WRITTEN])
def test_an_option_that_decides_the_plan_written_between_steps_is_checked_as_the_constructor_checks_it(
        key, value, bound):
    """The engine, formats, subset norms and rounding, written between steps: refused by name, as the
    constructor refuses them, when the group's plan is made again (they were taken by their truth, or
    ignored), and nothing changes; on the bound step as on the checked one."""
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    opt = fastoptim.AdamWSN(params, lr=1e-2, sn=True, fused=True)
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        opt.step()
    assert opt._plans.bound is not None
    with pytest.raises(ValueError, match=f"Invalid {key}: {value!r}") as constructed:
        fastoptim.AdamWSN(params, lr=1e-2, **{"sn": True, key: value})
    opt.param_groups[0][key] = value
    if not bound:
        opt._plans.bound = None
    before = [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()
                                                     if isinstance(v, torch.Tensor)} for p in params]
    with pytest.raises(ValueError) as written:
        opt.step()
    assert str(written.value) == str(constructed.value)
    assert all(map(torch.equal, params, before[0]))
    for param, state in zip(params, before[1]):
        assert all(torch.equal(opt.state[param][k], v) for k, v in state.items())


@pytest.mark.parametrize("cls, dtype, key, value, why", [
    (fastoptim.Lion, torch.float32, "sn", True, "Invalid sn: Lion keeps no second moment"),
    (fastoptim.AdamW, torch.float16, "master_bits", 24, "Invalid master_bits: 24 keeps remainders of bf16 params"),
    (fastoptim.AdamW, torch.float32, "differentiable", True, "Invalid differentiable: True: fastoptim's step runs"),
    (fastoptim.AdamW, torch.float32, "capturable", "yes", "Invalid capturable: 'yes'")],
    ids=["Lion sn", "fp16 master_bits", "AdamW differentiable", "AdamW capturable"])
def test_a_plan_option_its_algorithm_or_params_rule_out_written_between_steps_is_refused(cls, dtype, key, value, why):
    """What the constructor refuses of the algorithm (Lion has no second moment to take subset norms of) and
    the params (an fp16 param's bits keep no remainder), written between steps: refused by name (Lion's state
    took a subset-norm record its state dict then refused to load; fp16 remainders were ignored: helper-42), and
    AdamW's torch options it takes only as torch's defaults (differentiable=True was taken, and ignored)."""
    params = [torch.nn.Parameter(torch.randn(4, 4, dtype=dtype)) for _ in range(2)]
    opt = cls(params, lr=1e-2)
    for param in params:
        param.grad = torch.ones_like(param)
    opt.step()
    opt.param_groups[0][key] = value
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=why):
        opt.step()
    assert all(map(torch.equal, params, before))


@pytest.mark.parametrize("key, flag", [("maximize", 1), ("stochastic_rounding", 0), ("sn", 1)])
def test_a_flag_written_as_0_or_1_between_steps_steps_as_its_truth(key, flag):
    """torch.optim takes a flag's 0 or 1: so do the constructor and the plan's check (which refused them)."""
    def run(value):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4).bfloat16()) for _ in range(2)]
        opt = fastoptim.AdamWSN(params, lr=1e-2)
        for step in range(3):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (step + 1))
            if step == 1:
                opt.param_groups[0][key] = value
            opt.step()
        return params

    assert all(map(torch.equal, run(flag), run(bool(flag))))
    fastoptim.AdamWSN([torch.nn.Parameter(torch.zeros(4, 4))], **{key: flag})


GRAD_SCALER_VALUES = [("found_inf", 0.0), ("found_inf", True), ("found_inf", "0"), ("found_inf", torch.zeros(2)),
                      ("grad_scale", 1.0), ("grad_scale", torch.ones(2))]


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("fused", [True, None], ids=["fused", "foreach"])
@pytest.mark.parametrize("way", ["bound", "checked", "first"])
@pytest.mark.parametrize("name, value", GRAD_SCALER_VALUES, ids=[f"{k}={v!r}" for k, v in GRAD_SCALER_VALUES])
def test_grad_scaler_attributes_other_than_a_tensor_of_one_value_are_refused(cls, fused, way, name, value):
    """GradScaler's ``found_inf`` and ``grad_scale``, set by hand as a number or a tensor of several values:
    refused by name on every way of the step, changing nothing (the checked step raised AttributeError on
    a number where the bound one took it, and a tensor of two values failed in a kernel's argument)."""
    if way == "first":
        params = oracle.make_params()
        opt = cls(params, lr=0.1, fused=fused)
        for p in params:
            p.grad = torch.randn_like(p)
    else:
        params, opt = stepped(cls, fused=fused)
        if way == "checked":
            opt._plans.bound = None
    setattr(opt, name, value)
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=f"Invalid {name}: "):
        opt.step()
    assert_unchanged(params, opt, before)
    if way == "bound" and fused:  # what a GradScaler gives, in another shape: one value, read as 0-d
        setattr(opt, name, torch.ones(1, 1) if name == "grad_scale" else torch.zeros(1))
        opt.step()
        assert opt._plans.bound is not None


def _clipped(cls, write, way):
    """Params and ``cls`` clipped at 1.0, stepped twice, then ``write(optimizer)`` and one more step
    (``way``: "bound", or "checked" with the bound step dropped first)."""
    params = oracle.make_params()
    opt = cls(params, lr=0.1, max_grad_norm=1.0, fused=True)
    grads = oracle.grad_sequence(oracle.SHAPES, 3)
    oracle.run(opt, params, grads[:2])
    write(opt)
    if way == "checked":
        opt._plans.bound = None
    oracle.run(opt, params, grads[2:])
    return params, opt


def _groups_write(value):
    def write(opt):
        for group in opt.param_groups:
            group["max_grad_norm"] = value
    return write


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("way", ["bound", "checked"])
def test_max_grad_norm_written_into_the_groups_or_the_defaults_between_steps_clips_the_next_step(cls, way):
    """max_grad_norm, written between steps into every group (torch.optim's way) or into ``defaults``
    (official Adan's): the next step clips by it either way, and both then hold it (a write into the
    groups was ignored: the step read the defaults alone)."""
    by_groups, opt = _clipped(cls, _groups_write(1e-4), way)
    by_defaults, other = _clipped(cls, lambda o: o.defaults.update(max_grad_norm=1e-4), way)
    unwritten, _ = _clipped(cls, lambda o: None, way)
    assert all(map(torch.equal, by_groups, by_defaults))
    assert not all(map(torch.equal, by_groups, unwritten))
    for optimizer in (opt, other):
        assert optimizer.defaults["max_grad_norm"] == 1e-4
        assert all(group["max_grad_norm"] == 1e-4 for group in optimizer.param_groups)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("write, message", [
    (lambda o: o.param_groups[0].update(max_grad_norm=0.5) or o.defaults.update(max_grad_norm=0.25), "one value"),
    (_groups_write(-1.0), "Invalid max_grad_norm: -1.0"), (_groups_write("1"), "Invalid max_grad_norm: '1'"),
    (lambda o: o.defaults.update(max_grad_norm=None), "Invalid max_grad_norm: None")],
    ids=["two values", "negative", "text", "None"])
def test_max_grad_norm_written_as_two_values_or_no_number_is_refused_with_nothing_changed(cls, write, message):
    params, opt = stepped(cls, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    write(opt)
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_unchanged(params, opt, before)


@pytest.mark.parametrize("value", [torch.tensor([1.0, 2.0]), np.array([1.0, 2.0]), [1.0]],
                         ids=["tensor", "array", "list"])
def test_max_grad_norm_written_as_several_values_is_refused_by_name(value):
    params, opt = stepped(fastoptim.AdamW, max_grad_norm=1.0)
    before = snapshot(params, opt)
    opt.param_groups[0]["max_grad_norm"] = value
    with pytest.raises(ValueError, match="Invalid max_grad_norm"):
        opt.step()
    opt.param_groups[0]["max_grad_norm"] = 1.0
    assert_unchanged(params, opt, before)


NUMPY_OPTIONS = [("lr", np.float32(0.01)), ("lr", np.array(0.01)), ("lr", np.array([0.01])),
                 ("weight_decay", np.float32(0.25)), ("max_grad_norm", np.float32(0.5)), ("max_grad_norm", np.int64(1))]


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("way", ["bound", "checked"])
@pytest.mark.parametrize("key, value", NUMPY_OPTIONS, ids=[f"{k}={v!r}" for k, v in NUMPY_OPTIONS])
def test_numpy_numbers_given_to_the_constructor_step_as_their_python_values(cls, way, key, value):
    """A numpy number or an array of one element, given to the constructor as torch.optim takes it, steps as
    its Python value, as it does written between steps (the constructor refused np.float32 and arrays)."""
    def run(option):
        params = oracle.make_params()
        opt = cls(params, **{"lr": 0.1, "max_grad_norm": 0.0, key: option})
        for step, grads in enumerate(oracle.grad_sequence(oracle.SHAPES, 3)):
            if way == "checked":
                opt._plans.bound = None
            for param, grad in zip(params, grads):
                param.grad = grad
            opt.step()
        return params

    if key not in inspect.signature(cls).parameters:
        pytest.skip(f"{cls.__name__} takes no {key}")
    assert all(map(torch.equal, run(value), run(value.item())))


@pytest.mark.parametrize("where", ["groups", "defaults"])
def test_max_grad_norm_written_under_gradient_release_is_refused_with_nothing_changed(where):
    """Release steps each bucket in backward, so it never holds the norm of all grads: a threshold written
    after it was enabled is refused, as enabling it with one is (a bucket's step clipped by its own norm).
    Backward finds it and steps nothing; ``step()`` raises (not a hook inside backward: helper-59)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = fastoptim.AdamW(model.parameters(), lr=0.1)
    opt.enable_gradient_release()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    for options in opt.param_groups if where == "groups" else [opt.defaults]:
        options["max_grad_norm"] = 0.5
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(ValueError, match="Invalid max_grad_norm: 0.5: it clips by the norm of all grads"):
        opt.step()
    assert all(map(torch.equal, before, model.parameters()))


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda opt: pickle.loads(pickle.dumps(opt))],
                         ids=["deepcopy", "pickle"])
def test_a_copy_made_between_a_max_grad_norm_write_and_the_next_step_clips_by_the_write(copy_of):
    """The threshold last taken travels with a copy, beside which the copy tells the write (helper-49: a copy
    took the defaults' new value for the one last taken, and the groups' old one for a write)."""
    params, opt = stepped(fastoptim.AdamW, max_grad_norm=1.0)
    opt.defaults["max_grad_norm"] = 1e-4
    other = copy_of(opt)
    grads = oracle.grad_sequence(oracle.SHAPES, 1)
    oracle.run(opt, params, grads)
    oracle.run(other, other.param_groups[0]["params"], grads)
    assert all(map(torch.equal, params, other.param_groups[0]["params"]))
    assert other.defaults["max_grad_norm"] == 1e-4 == other.param_groups[0]["max_grad_norm"]


def test_a_group_added_after_a_max_grad_norm_write_holds_the_written_value():
    """add_param_group takes a threshold written into the groups since the last step before it checks the new
    group against it (it refused the written value and took the old one)."""
    params = oracle.make_params()
    opt = fastoptim.AdamW(params[:2], lr=0.1, max_grad_norm=1.0)
    opt.param_groups[0]["max_grad_norm"] = 1e-3
    with pytest.raises(ValueError, match="Invalid max_grad_norm: 1.0: .* the optimizer's, 0.001"):
        opt.add_param_group({"params": params[2:], "max_grad_norm": 1.0})
    opt.add_param_group({"params": params[2:], "max_grad_norm": 1e-3})
    assert opt.defaults["max_grad_norm"] == 1e-3


def test_max_grad_norm_written_into_some_groups_only_is_refused_with_nothing_changed():
    """A threshold written into one group of two reads as a per-group one, which clipping by the norm over
    all groups is not: refused by name (it was taken for every group, silently: helper-49)."""
    params = oracle.make_params()
    opt = fastoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.1, max_grad_norm=1.0)
    oracle.run(opt, params, oracle.grad_sequence(oracle.SHAPES, 2))
    opt.param_groups[1]["max_grad_norm"] = 0.5
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match="Invalid max_grad_norm: 0.5 written into 1 of the 2 groups"):
        opt.step()
    assert_unchanged(params, opt, before)
    opt.param_groups[0]["max_grad_norm"] = 0.5
    opt.step()
    assert opt.defaults["max_grad_norm"] == 0.5


TENSOR_OPTIONS = [(fastoptim.AdamW, "weight_decay"), (fastoptim.AdamW, "eps"), (fastoptim.Adan, "weight_decay"),
                  (fastoptim.Lion, "weight_decay"), (fastoptim.AdamWSN, "weight_decay"), (fastoptim.Muon, "weight_decay"),
                  (fastoptim.Muon, "momentum")]


@pytest.mark.parametrize("cls, key", TENSOR_OPTIONS, ids=[f"{cls.__name__} {key}" for cls, key in TENSOR_OPTIONS])
def test_a_0d_tensor_option_is_taken_by_the_constructor_and_a_load_as_between_steps(cls, key):
    """A 0-d tensor weight_decay, eps or Muon momentum (torch.optim.Muon takes one), which a step written
    between steps took: the constructor and load_state_dict take it too, and the steps are the written
    ones', bound and checked (both refused it, so a state dict saved after such a write did not load,
    under a message that named the betas: helper-50)."""
    def run(construct):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
        value = torch.tensor(1e-6 if key == "eps" else 0.5)
        opt = cls(params, lr=0.01, **({key: value} if construct else {}))
        if not construct:
            opt.param_groups[0][key] = value
        for step in range(4):
            for param in params:
                param.grad = torch.randn_like(param)
            if step == 2:
                opt._plans.bound = None
            opt.step()
            if step == 1:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        return params

    assert all(map(torch.equal, run(True), run(False)))
    with pytest.raises(ValueError, match=f"Invalid {key}: -0.5"):
        cls([torch.nn.Parameter(torch.randn(6, 4))], **{key: torch.tensor(-0.5)})


@pytest.mark.parametrize("cls", [*ALL, fastoptim.Muon])
@pytest.mark.parametrize("engine", [dict(fused=True), dict(foreach=True, fused=False), dict(foreach=False, fused=False)],
                         ids=["fused", "foreach", "loop"])
@pytest.mark.parametrize("way", ["bound", "checked"])
def test_a_param_written_into_a_second_group_between_steps_is_refused_with_nothing_changed(cls, engine, way):
    """A param appended to another group's params after it was added (``add_param_group`` refuses it):
    torch.optim steps it once per group, and advances its count as often; the steps moved it once per group
    and advanced its count once (helper-54). It is refused by name before anything changes, on every path,
    and once taken out again the optimizer steps on."""
    params = [torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.003}]
    if cls is fastoptim.Muon:
        groups[1]["use_muon"] = False
    opt = cls(groups, lr=0.01, **engine)
    for step in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 + step))
        opt.step()
    opt.param_groups[1]["params"].append(params[0])
    if way == "checked":
        opt._plans.bound = None
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match="a parameter appears in more than one param group"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before[0], params))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[k][name], value) for k, state in before[1]["state"].items()
               for name, value in state.items())
    opt.param_groups[1]["params"].pop()
    opt.step()
    assert not torch.equal(params[0], before[0][0])


RANGE_WRITES = [("lr", float("nan")), ("lr", float("inf")), ("lr", np.float64("nan")), ("lr", 10 ** 400),
                ("eps", float("-inf")), ("weight_decay", float("nan"))]


@pytest.mark.parametrize("way", ["bound", "checked"])
@pytest.mark.parametrize("cls, key, value", [(cls, key, value) for cls in [*ALL, fastoptim.Muon]
                                             for key, value in RANGE_WRITES
                                             if key != "eps" or "eps" in inspect.signature(cls).parameters]
                         + [(fastoptim.Muon, "momentum", 1.5), (fastoptim.Muon, "momentum", 1), (fastoptim.Muon, "adamw_eps", float("nan"))])
def test_a_number_option_written_out_of_its_range_between_steps_is_refused_with_nothing_changed(cls, key, value, way):
    """An option written between steps as a number that is no finite one (a NaN lr from a schedule), or
    Muon's momentum from 1: it was taken as it was, and a NaN or an infinity made the params NaN, where
    betas written out of range are refused (helper-55). It is refused by name before any group steps."""
    params = [torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    if cls is fastoptim.Muon and key != "momentum":
        groups[1]["use_muon"] = False  # the companions read lr, eps, weight_decay and adamw_eps too
    opt = cls(groups, lr=0.01)
    for step in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 + step))
        opt.step()
    if way == "checked":
        opt._plans.bound = None
    before = [param.detach().clone() for param in params], copy.deepcopy(opt.state_dict()["state"])
    opt.param_groups[-1][key] = value
    with pytest.raises(ValueError, match=rf"Invalid {key}: .* \(must be a finite number( below 1)?\)"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[k][name], value) for k, state in before[1].items() for name, value in state.items())


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan, fastoptim.Lion])
def test_a_schedule_that_decays_to_a_hair_below_0_steps_as_torch_steps(cls):
    """torch's ``LinearLR(end_factor=0)`` ends at lr -4e-22 (its float arithmetic), and keeps it: a step refused
    every value below 0 between steps, so training stopped (helper-56). Between steps only what is no finite
    number is refused; the optimizer steps as torch.optim's does with that lr."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = cls([param], lr=0.01)
    schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=0.0, total_iters=13)
    for _ in range(16):
        param.grad = torch.ones(3)
        opt.step()
        schedule.step()
    assert opt.param_groups[0]["lr"] < 0 and torch.isfinite(param).all()


@pytest.mark.parametrize("way", ["bound", "checked"])
def test_a_param_group_listed_twice_is_refused_with_nothing_changed(way):
    """``opt.param_groups.append(opt.param_groups[0])``: torch.optim steps its params twice a step. The
    bound step took the group once and the checked step twice, so the two ways parted (helper-56). It is
    refused by name before anything changes, as a param in two groups is."""
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, step + 1.0)
        opt.step()
    opt.param_groups.append(opt.param_groups[0])
    if way == "checked":
        opt._plans.bound = None
    before = [param.detach().clone() for param in params], copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError, match="a parameter appears in more than one param group"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[k][name], value) for k, state in before[1].items() for name, value in state.items())


DUPLICATES = {
    "in two groups": lambda opt, params: opt.param_groups[1]["params"].append(params[0]),
    "twice in its group": lambda opt, params: opt.param_groups[0]["params"].append(params[0]),
    "a group listed twice": lambda opt, params: opt.param_groups.append(opt.param_groups[0]),
}


@pytest.mark.parametrize("write", DUPLICATES)
@pytest.mark.parametrize("engine", [dict(fused=True), dict(foreach=False, fused=False)], ids=["fused", "loop"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_param_listed_twice_is_refused_at_every_step_while_it_is(cls, engine, write):
    """A duplicate was refused once, and the next step took it: the refused step's plan was kept before its
    params were checked, and a kept plan's params are not checked again (helper-71: Adan then stepped a param
    twice, and fused AdamW raised from native code). A plan takes its params only once they are checked."""
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, **engine)
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, step + 1.0)
        opt.step()
    DUPLICATES[write](opt, params)
    before = [param.detach().clone() for param in params], copy.deepcopy(opt.state_dict()["state"])
    for _ in range(3):
        with pytest.raises(ValueError, match="appears (in more than one param group|twice in its param group)"):
            opt.step()
        assert all(map(torch.equal, params, before[0]))
        after = opt.state_dict()["state"]
        assert all(torch.equal(after[k][name], value) if torch.is_tensor(value) else after[k][name] == value
                   for k, state in before[1].items() for name, value in state.items())


def test_a_param_without_a_grad_written_into_a_second_group_is_refused():
    """The check looked at the params with grads alone: a param of another group whose grad is None this
    step (gradient release had freed it, helper-56) passed unseen. It is a duplicate all the same."""
    params = [torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    opt = fastoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    for param in params:
        param.grad = torch.ones(4)
    opt.step()
    params[2].grad = None
    opt.param_groups[0]["params"].append(params[2])
    with pytest.raises(ValueError, match="a parameter appears in more than one param group"):
        opt.step()


@pytest.mark.parametrize("engine", ["foreach", "fused"])
@pytest.mark.parametrize("value", [None, [0.0] * 7, 0.0])
def test_a_state_set_to_no_tensor_between_steps_is_refused_by_name_with_nothing_changed(engine, value):
    """A state of the second group's param set to what no step reads as a tensor (None, a list, a number):
    refused naming the state before any group steps (helper-64: an AttributeError from inside the fused
    engine), and the step goes on once the state is deleted, which the step makes anew."""
    params = [torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    flags = dict(foreach=True, fused=engine == "fused")
    opt = fastoptim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, **flags)
    for step in range(2):
        for param in params:
            param.grad = torch.randn(7, generator=torch.Generator().manual_seed(10 + step))
        opt.step()
    opt.state[params[1]]["exp_avg"] = value
    before = [param.detach().clone() for param in params], {k: v.clone() for k, v in opt.state[params[0]].items()}
    with pytest.raises(RuntimeError, match=r"AdamW: state 'exp_avg' of a param of shape \(7,\) is .*not a tensor"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    assert all(torch.equal(opt.state[params[0]][key], held) for key, held in before[1].items())
    del opt.state[params[1]]["exp_avg"]
    opt.step()
    assert torch.equal(opt.state[params[1]]["exp_avg"], params[1].grad * 0.1)


def _set_state(param_index, key, to):
    """A write of ``optimizer.state[params[param_index]][key]`` to what ``to(optimizer, params)`` gives."""
    return lambda opt, params: opt.state[params[param_index]].__setitem__(key, to(opt, params))


ALIASES = {  # a state written between steps as memory that a step also updates through another tensor
    "its param": (_set_state(1, "exp_avg", lambda opt, params: params[1].detach()),
                  r"state 'exp_avg' of a param of shape \(7,\) and its param share memory"),
    "another state": (_set_state(1, "exp_avg_sq", lambda opt, params: opt.state[params[1]]["exp_avg"]),
                      r"state 'exp_avg(_sq)?' of a param of shape \(7,\) and its 'exp_avg(_sq)?' share memory"),
    "another param's state": (_set_state(1, "exp_avg", lambda opt, params: opt.state[params[0]]["exp_avg"]),
                              r"state 'exp_avg' of a param of shape \(7,\) and state 'exp_avg' of a param"),
    # torch's own error came midway, after the param or other states had changed (helper-88)
    "itself": (_set_state(1, "exp_avg_sq", lambda opt, params: torch.zeros(1).expand(7)),
               r"state 'exp_avg_sq' of a param of shape \(7,\) has elements that share memory \(strides \(0,\)\)"),
}


@pytest.mark.parametrize("engine", ["loop", "foreach", "fused"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("alias", ALIASES)
def test_a_state_that_shares_memory_with_what_a_step_updates_is_refused_with_nothing_changed(alias, groups, engine):
    """The fused kernels read every element before they write any, the other engines in their ops' order
    (torch's): a state that shares memory with its param or another state made them differ silently
    (helper-64). Refused by name before anything changes, in one group or across two (helper-65); params
    that share memory step as before."""
    params = [torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(n))) for n in range(2)]
    flags = dict(foreach=engine != "loop", fused=engine == "fused")
    opt = fastoptim.AdamW([{"params": params[:1]}, {"params": params[1:]}] if groups == 2 else params, lr=1e-2,
                          **flags)
    for step in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step))
        opt.step()
    write, message = ALIASES[alias]
    write(opt, params)
    before = [param.detach().clone() for param in params], [
        {key: value.clone() for key, value in opt.state[param].items()} for param in params]
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    assert all(torch.equal(opt.state[param][key], held) for param, state in zip(params, before[1])
               for key, held in state.items())


def _eight_bit_adamw(engine):
    param = torch.nn.Parameter(torch.randn(64, 80, generator=torch.Generator().manual_seed(0)))
    opt = fastoptim.AdamW([param], lr=1e-2, state_bits=8, **ENGINE_FLAGS[engine])
    for step in range(2):
        param.grad = torch.randn(64, 80, generator=torch.Generator().manual_seed(step))
        opt.step()
    param.grad = torch.randn(64, 80, generator=torch.Generator().manual_seed(2))
    return param, opt


ENGINE_FLAGS = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
                "fused-single": dict(foreach=False, fused=True), "fused": dict(foreach=True, fused=True)}


@pytest.mark.parametrize("engine", ENGINE_FLAGS)
def test_8bit_block_maxima_that_overlap_themselves_are_refused_with_nothing_written(engine):
    """An expanded view as an 8-bit state's block maxima: the fused kernels wrote every block's maximum
    through its one element, into the memory after it (a corrupted heap where that was the allocation's
    end: helper-88). Refused by name before anything changes."""
    param, opt = _eight_bit_adamw(engine)
    storage = torch.zeros(32)
    opt.state[param]["exp_avg_absmax"] = storage[:1].expand(20)
    before = snapshot([param], opt)
    with pytest.raises(RuntimeError, match=r"state 'exp_avg_absmax' of a param of shape \(64, 80\) has elements "
                                           "that share memory"):
        opt.step()
    assert_unchanged([param], opt, before)
    assert not storage.any()


@pytest.mark.parametrize("engine", ENGINE_FLAGS)
def test_strided_8bit_block_maxima_are_read_and_written_where_they_are(engine):
    """Block maxima given as a strided view (every other float of a buffer): the fused kernels read them as
    contiguous, so the gaps (1e30 here) moved the params by 4e28 and took the writes (helper-88). They are
    left to foreach, which steps them where they are."""
    param, opt = _eight_bit_adamw(engine)
    twin_param, twin = _eight_bit_adamw(engine)
    held = opt.state[param]["exp_avg_absmax"]
    buffer = torch.full((2 * held.numel(),), 1e30)
    buffer[::2] = held
    opt.state[param]["exp_avg_absmax"] = buffer[::2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fused engines' fallback warning
        opt.step()
    twin.step()
    assert torch.equal(buffer[1::2], torch.full_like(buffer[1::2], 1e30))
    torch.testing.assert_close(buffer[::2], twin.state[twin_param]["exp_avg_absmax"], rtol=1e-6, atol=0)
    torch.testing.assert_close(param, twin_param, rtol=1e-6, atol=1e-6)


def test_params_that_share_memory_step_as_before_on_foreach():
    """Two params that overlap (not tied: two Parameters) are taken as before, in torch's ops' order."""
    ours, theirs = ([torch.nn.Parameter(base[0:10]), torch.nn.Parameter(base[5:15])]
                    for base in (torch.randn(20, generator=torch.Generator().manual_seed(0)) for _ in range(2)))
    for params, opt in ((ours, fastoptim.AdamW(ours, lr=1e-2, foreach=True, fused=False)),
                        (theirs, torch.optim.AdamW(theirs, lr=1e-2, foreach=True))):
        for step in range(3):
            for index, param in enumerate(params):
                param.grad = torch.randn(10, generator=torch.Generator().manual_seed(10 * step + index))
            opt.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("engine", ["loop", "foreach", "fused-single", "fused"])
@pytest.mark.parametrize("when", ["first step", "after bound steps"])
@pytest.mark.parametrize("cls, shape", [(fastoptim.AdamW, (7,)), (fastoptim.Muon, (7, 3))])
def test_a_grad_that_is_its_param_s_memory_is_refused_with_nothing_changed(cls, shape, when, engine):
    """``param.grad = param.detach()``: the fused kernels read each grad element as they write the param's,
    the other engines (and torch) decay the param first and read the grad after: they differed silently
    (helper-64). Refused on every engine, the checked step's way, and the bound step's: its native check,
    and for Muon, whose tables pair no grad with its param, by the params' pointers (helper-65)."""
    params = [torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(n))) for n in range(2)]
    flags = dict(foreach=engine != "loop", fused=engine.startswith("fused"))
    if engine == "fused-single":
        flags["foreach"] = False
    opt = cls(params, lr=1e-2, **flags)
    for step in range(2 if when == "after bound steps" else 0):
        for param in params:
            param.grad = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        opt.step()
    assert (opt._plans.bound is not None) == (when == "after bound steps" and engine.startswith("fused"))
    params[0].grad = torch.randn(shape)
    params[1].grad = params[1].detach()
    before = [param.detach().clone() for param in params], [
        {key: value.clone() for key, value in opt.state[param].items()} for param in params]
    with pytest.raises(RuntimeError, match=rf"{cls.__name__}: a gradient is its param.s own memory"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    assert all(torch.equal(opt.state[param][key], held) for param, state in zip(params, before[1])
               for key, held in state.items())
    params[1].grad = params[1].detach().clone()  # memory of its own: it steps
    opt.step()


SEVERAL_VALUES = [(fastoptim.AdamW, "amsgrad", torch.tensor([1.0, 2.0]), r"Invalid amsgrad: a tensor of shape \(2,\)"),
                  (fastoptim.Adan, "no_prox", torch.tensor([1.0, 0.0]), r"Invalid no_prox: a tensor of shape \(2,\)"),
                  (fastoptim.Lion, "maximize", torch.ones(2, 1), r"Invalid maximize: a tensor of shape \(2, 1\)"),
                  (fastoptim.Muon, "use_muon", torch.tensor([1.0, 2.0]), r"Invalid use_muon: tensor"),
                  (fastoptim.Muon, "adjust_lr_fn", [], r"Invalid adjust_lr_fn: \[\]"),
                  (fastoptim.Muon, "adjust_lr_fn", {"a": 1}, r"Invalid adjust_lr_fn: \{'a': 1\}")]


@pytest.mark.parametrize("when", ["constructor", "between steps"])
@pytest.mark.parametrize("cls, key, value, message", SEVERAL_VALUES,
                         ids=[f"{cls.__name__}.{key}={type(value).__name__}" for cls, key, value, _ in SEVERAL_VALUES])
def test_an_option_of_one_value_given_several_or_an_unhashable_one_is_refused_by_name(cls, key, value, message, when):
    """A flag given as a tensor of several values raised torch's "Boolean value of Tensor ... is ambiguous",
    and Muon's adjust_lr_fn as a list "unhashable type" (helper-89), naming no option."""
    param = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    if when == "constructor":
        with pytest.raises(ValueError, match=message):
            cls([param], **{key: value})
        return
    opt = cls([param], lr=1e-2)
    param.grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    opt.step()
    before = snapshot([param], opt)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert all(map(torch.equal, [param], before[0]))


def test_sequence_options_keep_their_own_messages_and_a_numpy_string_is_a_string():
    """The check of one-value options given several (helper-90): Muon's ns_coefficients and split_sizes are
    sequences, named with what they take; adjust_lr_fn as numpy's str (a str subclass) is taken, as torch's."""
    param = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"Invalid ns_coefficients: tensor.* \(must be three finite numbers"):
        fastoptim.Muon([param], ns_coefficients=torch.tensor([3.4445, -4.7750, 2.0315]))
    with pytest.raises(ValueError, match=r"Invalid split_sizes: array\(\[2, 2\]\) \(must be None or a non-empty"):
        fastoptim.Muon([param], split_sizes=np.array([2, 2]))
    opt = fastoptim.Muon([param], adjust_lr_fn=np.str_("match_rms_adamw"))
    param.grad = torch.ones(4, 4)
    opt.step()


TENSOR_OPTIONS = [(cls, key, value) for cls, key in [(fastoptim.Muon, "momentum"), (fastoptim.AdamW, "eps"),
                                                      (fastoptim.AdamW, "weight_decay"), (fastoptim.AdamW, "lr")]
                  for value in (float("nan"), float("inf"), *((1.5,) if key == "momentum" else ()))]


@pytest.mark.parametrize("cls, key, value", TENSOR_OPTIONS,
                         ids=[f"{cls.__name__}.{key}={value}" for cls, key, value in TENSOR_OPTIONS])
def test_a_0d_tensor_option_written_between_steps_is_checked_as_a_number_is(cls, key, value):
    """A tensor momentum of NaN written between steps made the params NaN, where the same float, and a tensor
    given to the constructor, were refused (helper-92): a CPU tensor's value is checked as a tensor beta's."""
    param = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
    opt = cls([param], lr=1e-2)
    param.grad = torch.ones(4, 4)
    opt.step()
    before = snapshot([param], opt)
    opt.param_groups[0][key] = torch.tensor(value)
    with pytest.raises(ValueError, match=f"Invalid {key}"):
        opt.step()
    assert all(map(torch.equal, [param], before[0]))


def test_a_list_flag_is_quoted_as_written():
    """The plan's structure reads a group through a copy that notes the items read: an error quoted a list
    flag as a tuple (helper-93)."""
    param = torch.nn.Parameter(torch.randn(4))
    opt = fastoptim.AdamW([param], lr=1e-2)
    param.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["amsgrad"] = [True]
    with pytest.raises(ValueError, match=r"Invalid amsgrad: \[True\]"):
        opt.step()


BETA_WRITES = {"Fraction": Fraction(1, 2), "Decimal": Decimal("0.5"), "array of two": np.array([0.5, 0.5]),
               "text": "0.5", "bool": False, "numpy bool": np.False_}  # bools: as the constructor (helper-99)
ENGINE_OPTIONS = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
                  "fused-multi": dict(fused=True)}


@pytest.mark.parametrize("engine", list(ENGINE_OPTIONS))
@pytest.mark.parametrize("write", list(BETA_WRITES))
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.Lion])
def test_a_beta_written_between_steps_as_what_the_constructor_refuses_is_refused_before_any_group_steps(
        cls, write, engine):
    """A Fraction or Decimal beta passed the check between steps (it compares with floats): the fused kernels
    stepped with float(beta), and the loop and foreach engines' ops refused it midway, the weight decay or
    the first group already applied (helper-96). Refused by name, as the constructor refuses it."""
    params = [torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=0.01, weight_decay=0.1, **ENGINE_OPTIONS[engine])
    for step in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 + step))
        opt.step()
    before = snapshot(params, opt)
    opt.param_groups[-1]["betas"] = (BETA_WRITES[write], *opt.param_groups[-1]["betas"][1:])
    with pytest.raises(ValueError, match="Invalid betas"):
        opt.step()
    opt.param_groups[-1]["betas"] = before[1]["param_groups"][-1]["betas"]
    assert_unchanged(params, opt, before)


ONE_ELEMENT = {"betas": lambda betas: (np.array([betas[0]]), *betas[1:]),
               "betas, 2-d": lambda betas: (np.array([[betas[0]]]), *betas[1:]),
               "betas, a column": lambda betas: np.array(betas).reshape(-1, 1),  # helper-99: nested lists
               "eps": lambda eps: np.array([eps])}


@pytest.mark.parametrize("engine", list(ENGINE_OPTIONS))
@pytest.mark.parametrize("write", list(ONE_ELEMENT))
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.Lion])
def test_a_numpy_array_of_one_element_written_between_steps_steps_as_its_value(cls, write, engine):
    """An array of one element is its value, as the contract says: a beta was kept a list of one number by the
    checked step (its scalars then raised, after the first group stepped), and the clip read an eps array as
    it was, which the foreach and fused norms refused (helper-96). Both groups, clipped, step as with the
    value."""
    key = write.split(",")[0]
    if key not in inspect.signature(cls).parameters:
        pytest.skip(f"{cls.__name__} takes no {key}")
    runs = []
    for written in (False, True):
        params = [torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
        opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=0.01, max_grad_norm=0.1,
                  **ENGINE_OPTIONS[engine])
        for step in range(4):
            for param in params:
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 + step))
            if step == 2 and written:
                for group in opt.param_groups:
                    group[key] = ONE_ELEMENT[write](group[key])
            opt.step()
        runs.append(params)
    assert all(map(torch.equal, *runs))


def test_a_tensor_eps_of_one_dimension_written_between_steps_is_refused_by_what_it_may_be():
    """The message named "a floating-point tensor of one value", which is what it refused (helper-96): an option
    other than lr takes a 0-d one."""
    params, opt = stepped(fastoptim.AdamW)
    before = snapshot(params, opt)
    opt.param_groups[0]["eps"] = torch.tensor([1e-3])
    with pytest.raises(ValueError, match=r"Invalid eps: .* \(must be .*a 0-d floating-point tensor\)"):
        opt.step()
    opt.param_groups[0]["eps"] = before[1]["param_groups"][0]["eps"]
    assert_unchanged(params, opt, before)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32])
@pytest.mark.parametrize("cls", ALL)
def test_a_param_of_a_dtype_no_step_takes_is_refused_by_name_with_nothing_changed(cls, dtype):
    """float8 params failed midway through a step, an fp32 param already stepped, and complex32 ones with a bare
    KeyError (helper-100): refused when added, and when given such data between steps."""
    def odd():
        return torch.nn.Parameter(torch.zeros(4, 4).to(dtype))

    message = f"is {dtype}; the optimizers step float32"
    with pytest.raises(ValueError, match=message):
        cls([torch.nn.Parameter(torch.randn(4, 4)), odd()])
    params, opt = stepped(cls)
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [odd()]})
    before = snapshot(params, opt)
    held = params[-1].data
    params[-1].data = torch.zeros(params[-1].shape).to(dtype)
    params[-1].grad = torch.zeros(params[-1].shape).to(dtype)
    with pytest.raises(ValueError, match=message):
        opt.step()
    params[-1].data, params[-1].grad = held, torch.zeros_like(held)
    assert_unchanged(params, opt, before)


@pytest.mark.parametrize("cls", ALL)
def test_a_frozen_param_of_a_dtype_no_step_takes_is_taken_and_never_stepped(cls):
    """A quantized model's int8 weights, frozen, passed with its other params: torch.optim takes them, and the
    dtype check refused them when added (helper-103)."""
    params = oracle.make_params()
    frozen = [torch.nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False),
              torch.nn.Parameter(torch.ones(4, 4).to(torch.float8_e4m3fn), requires_grad=False)]
    opt = cls(params + frozen, lr=0.1)
    oracle.run(opt, params, oracle.grad_sequence(oracle.SHAPES, 2))
    assert all(torch.equal(param.float(), torch.ones(4, 4)) for param in frozen)
