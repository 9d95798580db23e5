"""The bound step (scalars, clip and counts in its native call) against the checked step, where a user
changes something between steps: a bound optimizer's run against a twin whose every step takes the
checked way (``_plans.bound`` dropped before each step), bit for bit; and the native ops'
refusals of rules that do not fit their kernel. Found by an adversarial review of 6d667b0."""
import collections
import subprocess
import sys
import warnings
from decimal import Decimal

import numpy as np
import pytest
import torch

import fastoptim

from fastoptim.bound_step import BoundStep
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.optimizers import checks

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
            opt._plans.bound = None
        torch.manual_seed(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return params, opt


def _bound_and_checked(factory, change, monkeypatch, **kwargs):
    calls, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: calls.append(real(self, *args)) or calls[-1])
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


@pytest.mark.parametrize("options", [dict(), dict(stochastic_rounding=True, max_grad_norm=0.5), dict(state_bits=8),
                                     dict(maximize=True, weight_decay=0.1)],
                         ids=["plain", "rounded-clipped", "8-bit", "maximize"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan, fastoptim.Lion, fastoptim.AdamWSN])
def test_a_tensor_lr_steps_bound_and_as_the_checked_step(cls, options, monkeypatch):
    """A tensor lr (a scheduler's, or one that keeps a compiled step from recompiling), set in place each
    step: the bound step computes its scalars in Python as the checked step does, as tensors, instead of
    taking the checked way every step (seven times a float lr's host time, where it is now 2.5 times),
    bit for bit a checked twin's, with bf16 params, GradScaler's factors and a param at another count."""
    def factory(params):
        return cls([{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(2e-3)}],
                    lr=torch.tensor(1e-2), fused=True, **options)

    def change(step, opt, params):
        for group in opt.param_groups:
            group["lr"].mul_(0.9)  # as a scheduler writes a tensor lr
        if step in (3, 4):  # as GradScaler hands its scale and found_inf to step()
            opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(float(step == 4))
        else:
            opt.__dict__.pop("grad_scale", None), opt.__dict__.pop("found_inf", None)
        if step == 1:
            params[1].grad = None  # a param at another count from then on

    dtypes = [torch.bfloat16, torch.float32] * (len(SHAPES) // 2)
    (params, opt), (twin_params, twin), ran_bound = _bound_and_checked(factory, change, monkeypatch, steps=8,
                                                                       dtypes=dtypes)
    assert ran_bound[-3:] == [True] * 3
    for param, expected in zip(params, twin_params):
        assert torch.equal(param, expected)
    for param, expected in zip(params, twin_params):
        for key, value in twin.state[expected].items():
            assert torch.equal(opt.state[param][key], value), key


@pytest.mark.parametrize("write", ["set_", "data", "packed"])
@pytest.mark.parametrize("lr", [1e-2, torch.tensor(1e-2)], ids=["float lr", "tensor lr"])
def test_a_count_written_by_hand_is_the_count_the_bound_steps_read_and_advance(lr, write, monkeypatch):
    """A param's count (a slot of the group's one count tensor, ``StepCounts``) given a value of its own
    between steps: ``set_`` or ``.data =`` on the slot (storage of its own, which no version counter
    and no native check sees), or ``.data =`` on the tensor it is a slot of (the slots, which the user
    sees, keep their storage and their values). With a tensor lr the bound
    step computes its scalars in Python: both ways must read the count written, advance it where the
    user sees it, and match a checked twin bit for bit."""
    def change(step, opt, params):
        if step != 2:
            return
        slot = opt.state[params[1]]["step"]
        if write == "set_":
            slot.set_(torch.tensor(9.0))
        elif write == "data":
            slot.data = torch.tensor(9.0)
        else:
            packed = slot._base
            packed.data = torch.full_like(packed, 9.0)

    (params, opt), (twin_params, twin), ran_bound = _bound_and_checked(
        lambda ps: fastoptim.AdamW(ps, lr=lr.clone() if torch.is_tensor(lr) else lr, fused=True), change,
        monkeypatch)
    assert ran_bound[-2:] == [True, True]  # planned again after the write, then bound
    counts = [opt.state[param]["step"].item() for param in params]
    assert counts == [twin.state[param]["step"].item() for param in twin_params]
    # the slots are what the user sees: a new storage under the tensor they were slots of leaves them be
    assert counts == ([6.0] * 4 if write == "packed" else [6.0, 9.0 + 4, 6.0, 6.0])
    for param, expected in zip(params, twin_params):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_bound_step_refused_as_stale_leaves_the_rng_as_it_found_it(cls, monkeypatch):
    """A bound step draws each bucket's stochastic rounding seed before its native call checks the
    tables; when that call answers STALE (a param given new storage), the checked step that follows
    draws them again: the generator's state is given back, so the rounding runs as a twin's whose
    steps are all checked."""
    def change(step, opt, params):
        if step == 3:
            params[3].data = params[3].data.clone()

    (params, _), (twin_params, _), ran_bound = _bound_and_checked(
        lambda ps: cls(ps, lr=1e-2, stochastic_rounding=True, fused=True), change, monkeypatch,
        dtypes=[torch.bfloat16] * len(SHAPES))
    assert False in ran_bound  # the step after the change was refused natively
    for param, expected in zip(params, twin_params):
        assert torch.equal(param, expected)


def _in_subprocess(script):
    """Run ``script`` in a fresh interpreter (a native op that writes out of bounds would corrupt this one)."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


def test_a_rule_refuses_a_count_of_scalars_other_than_its_kernels():
    """``rule_scalars`` writes every scalar of its kernel: asked for fewer, it must refuse, not write past them."""
    code, out = _in_subprocess("""
import torch, fastoptim
from fastoptim.engines.backends import cpu  # loads the native library
try:
    torch.ops.fastoptim.rule_scalars("adan", [0.01, 0.9, 0.9, 0.9, 1e-8, 0.0, 0.0], 1.0, 4)
except RuntimeError as error:
    print("refused:", error)
""")
    assert code == 0 and "refused:" in out and "16 scalars of the adan kernel" in out, out


@pytest.mark.parametrize("rule, n_scalars", [("adan", 11), ("adamw", 3), ("lion", 11)])
def test_bind_refuses_a_rule_of_another_kernel_or_scalar_count(rule, n_scalars):
    """A table bound to the adamw kernel with another kernel's rule (or too few scalars for its rule) must be
    refused at bind: a ruled step would write the rule's scalars past the table's, and the kernel read them."""
    code, out = _in_subprocess(f"""
import torch, fastoptim
from fastoptim.engines.backends import cpu  # loads the native library
from fastoptim.multi_tensor import PointerTable
from fastoptim.optimizers.adamw import SPEC
params = [torch.randn(5, 7), torch.randn(300)]
states = {{"exp_avg": [torch.zeros_like(p) for p in params], "exp_avg_sq": [torch.zeros_like(p) for p in params]}}
counts = [torch.zeros(()) for p in params]
table = PointerTable({{"param": params, "grad": params, **states}}, SPEC.rows)
rows = [SPEC.rows.index(role) for role in ("param", "exp_avg", "exp_avg_sq")]
held = params + states["exp_avg"] + states["exp_avg_sq"]
try:
    handle = torch.ops.fastoptim.bind("adamw", held, rows, 2, len(SPEC.rows), {n_scalars},
                                      torch.from_numpy(table.chunks), None, [], [], [], {rule!r}, counts)
except RuntimeError as error:
    print("refused:", error)
""")
    assert code == 0 and "refused:" in out and f"rule {rule} computes" in out, out


def test_a_bound_step_with_bad_flags_on_its_second_table_changes_nothing():
    """bound_step ran its tables one after another and found bad flags (no kernel variant) only when a
    table ran, after the earlier tables stepped their params. It asks every kernel first."""
    tables, grads, params = [], [], []
    for seed in range(2):
        torch.manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(300))]
        opt = fastoptim.AdamW(ps, lr=1e-2, fused=True)
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        run_tables, _, _ = opt._plans.bound.groups[0].runs[0]
        tables.append((opt, run_tables.tables[0][2]))
        grads += [p.grad for p in ps]
        params += ps
    before = [p.detach().clone() for p in params]
    n = len(fastoptim.optimizers.adamw.SPEC.all_scalars)
    with pytest.raises(RuntimeError, match="no variant"):
        cpu_backend.StepCall([bound for _, bound in tables], [False, False], [False, False]).run(
            grads, [[0.0] * n, [0.0] * n], [0, 1 << 20], [])
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("engine", [dict(fused=True), dict(foreach=True, fused=False), dict(foreach=False, fused=False)],
                         ids=["fused", "foreach", "loop"])
def test_two_adan_groups_given_one_count_step_as_official_adan_s_two_ints(engine, monkeypatch):
    """Two Adan groups given one count tensor between steps (``group["step"] = other["step"]``): official
    Adan keeps an int, so that write gives the second group the first's value, each then advanced once a
    step. The steps advanced the shared tensor once per group, both stepping with one count, so the next
    step skipped one (helper-55); bound, they were not bound at all. Each group now gets a tensor of its
    own at the next step, which steps bound, bit for bit as the groups given the value as an int."""
    def shared(step, opt, params):
        if step == 2:
            opt.param_groups[1]["step"] = opt.param_groups[0]["step"]

    def as_int(step, opt, params):
        if step == 2:
            opt.param_groups[1]["step"] = int(opt.param_groups[0]["step"].item())

    def factory(params):
        return fastoptim.Adan([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, **engine)

    (params, opt), (twin_params, twin), ran = _bound_and_checked(factory, shared, monkeypatch)
    int_params, int_opt = _run(factory, as_int, False)
    if engine["fused"]:
        assert ran[-2:] == [True, True]
    for run in (opt, twin, int_opt):
        assert [group["step"].item() for group in run.param_groups] == [6.0, 6.0]
    for param, expected, official in zip(params, twin_params, int_params):
        assert torch.equal(param, expected) and torch.equal(param, official)


@pytest.mark.parametrize("lr", [1e-2, torch.tensor(1e-2)], ids=["number lr", "tensor lr"])
@pytest.mark.parametrize("way", ["bound", "checked"])
@pytest.mark.parametrize("write", ["assigned", "in place"])
@pytest.mark.parametrize("value", [-1.0, 1.5, float("nan"), float("inf")])
def test_an_adan_group_count_tensor_that_is_no_whole_number_is_refused_with_nothing_changed(value, write, way, lr):
    """An fp32 0-d CPU tensor written into an Adan group's count, assigned or in place: as a number, or a
    tensor of another dtype, it was refused by name, but as the count's own kind it was taken as it was
    (helper-55): 1.5 stepped, NaN made the params NaN, -1 raised ZeroDivisionError after the first group
    had stepped. It is refused by name before anything changes; written in place, by the checked step that
    the bound step's native call hands it to (which took 1.5 and inf as they were), or with a tensor lr (whose
    scalars Python computes) by the bound step itself."""
    params = [torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = fastoptim.Adan([{"params": params[:1]}, {"params": params[1:]}], lr=lr, fused=True)
    for step in range(2):
        for param in params:
            param.grad = grad_for(param, step)
        opt.step()
    if write == "assigned":
        opt.param_groups[1]["step"] = torch.tensor(value)
    else:
        opt.param_groups[1]["step"].fill_(value)
    if way == "checked":
        opt._plans.bound = None
    before = [param.detach().clone() for param in params], [dict(opt.state[p]) for p in params]
    states = [{key: value.clone() for key, value in state.items()} for state in before[1]]
    with pytest.raises(ValueError, match=r"Invalid step: .* \(must be a whole number >= 0\)"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    for param, state in zip(params, states):
        assert all(torch.equal(opt.state[param][key], value) for key, value in state.items())


class _ConfigList(list):
    """A list of a config system's own (a subclass of list)."""


@pytest.mark.parametrize("container", [list, _ConfigList])
@pytest.mark.parametrize("schedule", [(0.0, 0.0, 0.9, 0.9, 0.9, 0.9), (0.9, 0.9, 0.0, 0.0, 0.9, 0.9)],
                         ids=["from 0", "to 0 and back"])
def test_a_beta_edited_in_place_in_its_list_reaches_the_bound_step(schedule, container, monkeypatch):
    """AdamWSN's β1 decides whether it keeps a first moment (a kernel flag). Set in its list of betas
    (the same list object), the bound step plans again, as the checked step does: bit for bit, with the
    same states. (The bound step kept the first β1's flag: from 0 it never made the first moment, to 0
    it went on updating it; before it held its flags, a β1 from 0 crashed in the kernel. In a subclass of
    list, the change was missed on every path: helper-90.)"""

    def change(step, opt, params):
        opt.param_groups[0]["betas"][0] = schedule[step]

    def factory(params):
        return fastoptim.AdamWSN(params, lr=0.1, betas=container([schedule[0], 0.999]), sn=True, fused=True)

    (bound, bound_opt), (checked, checked_opt), ran_bound = _bound_and_checked(factory, change, monkeypatch)
    assert all(map(torch.equal, bound, checked))
    for ours, theirs in zip(bound, checked):
        assert sorted(bound_opt.state[ours]) == sorted(checked_opt.state[theirs])
        assert "exp_avg" in bound_opt.state[ours]  # β1 ends at 0.9: a first moment kept
    assert ran_bound.count(True) >= 2, ran_bound


def test_betas_set_as_a_numpy_array_between_steps_step_bound_as_checked(monkeypatch):
    """A group's betas replaced by a numpy array (the constructor takes only a tuple or list, a
    scheduler may write anything the checked step reads): the bound step reads its numbers as the
    checked step does, at every step (it raised at every other step, reading the array as one number)."""
    import numpy as np

    def change(step, opt, params):
        opt.param_groups[0]["betas"] = np.array([0.9, 0.99 + step / 1000])

    (bound, _), (checked, _), ran_bound = _bound_and_checked(
        lambda params: fastoptim.AdamW(params, lr=0.1, fused=True), change, monkeypatch)
    assert all(map(torch.equal, bound, checked))
    assert ran_bound.count(True) >= 4, ran_bound


def test_a_tensor_beta_edited_in_place_reaches_the_bound_step():
    """A β1 that a 0-d tensor holds (set between steps), filled in place from 0: its flags (a first moment) are the
    kernel's, which the step's tables were bound without, so the step plans again, as a checked one
    does. In a subprocess: it crashed in the kernel before the bound step compared its flags."""
    code, out = _in_subprocess("""
import torch, fastoptim
def run(checked):
    beta1 = torch.tensor(0.0)
    param = torch.nn.Parameter(torch.ones(4, 4))
    opt = fastoptim.AdamWSN([param], lr=0.1, betas=(0.0, 0.999), sn=True, fused=True)
    for step in range(5):
        param.grad = torch.full((4, 4), float(step + 1))
        if step == 1:
            opt.param_groups[0]["betas"] = (beta1, 0.999)
        if step == 3:
            beta1.fill_(0.9)
        if checked:
            opt._plans.bound = None
        opt.step()
    return param.detach(), sorted(opt.state[param])
(ours, keys), (theirs, their_keys) = run(False), run(True)
print(torch.equal(ours, theirs), keys == their_keys, "exp_avg" in keys)
""")
    assert code == 0 and out.split()[-3:] == ["True", "True", "True"], out


def test_a_bound_step_refuses_flags_that_keep_a_state_its_tables_lack():
    """Native code's safety net: flags that keep a state the table was bound without (amsgrad's, on
    an AdamW table bound with amsgrad off) would have the kernel walk null pointers: the call answers
    STALE and changes nothing."""
    from fastoptim.optimizers.adamw import SPEC

    params = [torch.nn.Parameter(torch.randn(8))]
    params[0].grad = torch.ones(8)
    opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
    opt.step()
    calls, real = [], cpu_backend.StepCall.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_backend.StepCall, "run", lambda call, *args: calls.append((call, args)) or real(call, *args))
        opt.step()
    (call, (grads, values, _, options, clip, amp_scale)), = calls
    before = params[0].detach().clone()
    assert call.run(grads, values, [SPEC.flag_bits(dict(amsgrad=True, first_moment=True))], options, clip,
                    amp_scale) == cpu_backend.STALE
    assert torch.equal(params[0], before)
    assert call.run(*calls[0][1]) == cpu_backend.STEPPED


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW], ids=lambda cls: cls.__name__)
def test_a_count_written_below_zero_in_place_fails_as_the_checked_step_does(cls):
    """A step count filled with -1 in place (the group's, official Adan's; a param's, AdamW's): its
    bias corrections divide by zero. The bound step left it to no one and wrote NaN params; native
    code now refuses it, and the checked step raises, changing nothing, as it does unbound."""

    def run(checked):
        param = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))
        opt = cls([param], lr=1e-2, fused=True)
        for _ in range(3):
            param.grad = torch.ones(4)
            opt.step()
        count = opt.param_groups[0]["step"] if cls is fastoptim.Adan else opt.state[param]["step"]
        count.fill_(-1)
        before = param.detach().clone()
        if checked:
            opt._plans.bound = None
        with pytest.raises(Exception) as raised:
            opt.step()
        assert torch.equal(param, before) and count.item() == -1
        return type(raised.value)

    assert run(False) is run(True)


@pytest.mark.parametrize("way", ["bound", "checked"])
@pytest.mark.parametrize("value", [-1.0, 1.5, float("nan"), float("inf")])
def test_a_count_of_an_adan_group_without_grads_written_in_place_is_refused_with_nothing_changed(value, way):
    """A group whose params have no grads this step: Python advances its count, which no native call reads,
    and a bound step took 1.5 or inf (and -1, NaN) as they were (helper-63), where the checked step refuses."""
    params = [torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = fastoptim.Adan([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, fused=True)
    for step in range(3):
        params[0].grad = grad_for(params[0], step)
        opt.step()
    assert opt._plans.bound is not None
    opt.param_groups[1]["step"].fill_(value)
    if way == "checked":
        opt._plans.bound = None
    before = params[0].detach().clone(), opt.param_groups[0]["step"].clone()
    with pytest.raises(ValueError, match=r"Invalid step: .* \(must be a whole number >= 0\)"):
        opt.step()
    assert torch.equal(params[0], before[0]) and torch.equal(opt.param_groups[0]["step"], before[1])


REFUSALS = {  # what the checked step refuses once the bound step's native call handed the step to it
    "a count filled with 1.5": (lambda opt, params: opt.param_groups[1]["step"].fill_(1.5),
                                ValueError, r"Invalid step: 1.5"),
    "a sparse grad": (lambda opt, params: setattr(params[1], "grad", params[1].grad.to_sparse()),
                      RuntimeError, "does not support sparse gradients"),
}


@pytest.mark.parametrize("clipped", [False, True])
@pytest.mark.parametrize("cls, refusal", [(fastoptim.Adan, "a count filled with 1.5"), *(
    (cls, "a sparse grad") for cls in (fastoptim.Adan, fastoptim.AdamW, fastoptim.Muon))])
def test_a_refused_bound_step_leaves_the_master_remainders_of_a_param_written_since(cls, refusal, clipped):
    """A bf16 param with master remainders, written in place, and in another group what native code refuses
    and the checked step then refuses too: the bound step restarted the written param's remainders before
    its native call, and the refusal left them zeroed (helper-63 with a count, helper-64 with a sparse grad).
    Now a refused call puts them back, and the refused step changes nothing."""
    write, error, message = REFUSALS[refusal]  # a count of its group's: official Adan's
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(i)).bfloat16())
              for i in range(2)]
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, master_bits=24, fused=True,
              max_grad_norm=1.0 if clipped else 0.0)
    for step in range(3):
        for param in params:
            param.grad = grad_for(param, step)
        opt.step()
    assert opt._plans.bound is not None
    with torch.no_grad():
        params[0].mul_(1.5)
    write(opt, params)
    before = {key: value.clone() for key, value in opt.state[params[0]].items()}
    assert before["master_remainder"].abs().sum() > 0
    with pytest.raises(error, match=message):
        opt.step()
    assert all(torch.equal(opt.state[params[0]][key], value) for key, value in before.items())


@pytest.mark.parametrize("value", [1.5, float("inf"), -1.0, float("nan")])
@pytest.mark.parametrize("plan", ["bound", "checked", "made again"])
def test_a_param_count_written_in_place_to_no_whole_number_is_refused_by_name(value, plan):
    """A param's count (AdamW's ``state["step"]``) filled in place with what is no whole number >= 0 is refused
    by name with nothing changed, as a count set anew is, whether the step is bound, checked, or makes its
    plan again (a grad dropped: another pattern of grads). A step held by its plan took 1.5 as torch.optim
    does, and one that made its plan again refused it, so a released run (whose ``step()`` makes a plan of
    what backward left) and an unreleased one parted (helper-74)."""
    params = [torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
    for step in range(3):
        for param in params:
            param.grad = grad_for(param, step)
        opt.step()
    opt.state[params[0]]["step"].fill_(value)
    if plan == "checked":
        opt._plans.bound = None
    elif plan == "made again":
        params[1].grad = None
    before = [param.detach().clone() for param in params], [opt.state[param]["step"].clone() for param in params]
    with pytest.raises(ValueError, match=r"Invalid step of a param of shape \(4,\): .* \(must be a whole number >= 0\)"):
        opt.step()
    assert all(map(torch.equal, params, before[0]))
    assert all(torch.allclose(opt.state[param]["step"], count, rtol=0, atol=0, equal_nan=True)  # NaN as NaN
               for param, count in zip(params, before[1]))


def test_two_adan_groups_given_one_count_at_construction_count_as_the_checked_step(monkeypatch):
    """Two groups given one count tensor when the optimizer is made: a checked step advances it once
    per group; the bound step, whose native call advances each count it holds once, advanced it once
    in all (found by helper-23). Such groups are not bound: every step counts as the checked one."""
    def factory(params):
        count = torch.zeros(())
        return fastoptim.Adan([{"params": params[:2], "step": count}, {"params": params[2:], "step": count}],
                              lr=1e-2, fused=True)

    (params, opt), (twin_params, twin), _ = _bound_and_checked(factory, lambda step, opt, params: None, monkeypatch)
    assert opt.param_groups[0]["step"].item() == twin.param_groups[0]["step"].item()
    assert all(map(torch.equal, params, twin_params))


@pytest.mark.parametrize("engine, compiled", [(dict(), False), (dict(), True), (dict(fused=False), False),
                                              (dict(foreach=False, fused=False), False)],
                         ids=["fused", "fused-compiled", "foreach", "loop"])
@pytest.mark.parametrize("cls, betas", [(fastoptim.Adan, (0.98, 0.92)), (fastoptim.AdamW, (0.9, 0.99, 0.999)),
                                        (fastoptim.AdamW, (1.0, 0.999)), (fastoptim.Adan, (0.98, 1.5, 0.99)),
                                        (fastoptim.AdamW, (torch.tensor(1.0), 0.999)),
                                        (fastoptim.AdamW, (torch.tensor([0.9]), torch.tensor([0.999])))],
                         ids=["Adan length", "AdamW length", "AdamW beta 1", "Adan beta 1.5", "AdamW tensor beta 1",
                              "AdamW 1-d tensor betas"])
def test_betas_of_another_length_or_range_set_between_steps_are_refused_by_name_changing_nothing(
        cls, betas, engine, compiled):
    """Betas of the wrong length, or out of [0, 1) (a CPU tensor's too), or tensors of one dimension (a step's
    scalar tensors of one dimension hold one value per param), written into a group after the first step:
    every path refuses them as the constructor does, before anything changes. A bound step's native call read the
    wrong count of rule numbers and failed as "table 0 has no rule", or wrote non-finite params for a
    beta of 1; a compiled one failed on fake tensors; the checked steps raised a bare unpack error or
    ZeroDivisionError."""
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(SHAPES)]
    opt = cls(params, lr=0.1, **engine)
    step = torch.compile(opt.step) if compiled else opt.step
    for param in params:
        param.grad = grad_for(param, 0)
    step()
    step()
    before = [param.clone() for param in params]
    before_states = [{key: value.clone() for key, value in opt.state[param].items()} for param in params]
    opt.param_groups[0]["betas"] = betas
    with pytest.raises(Exception, match=r"Invalid betas: \(.*\) \(expected \d numbers in \[0, 1\)\)"):
        step()
    assert all(map(torch.equal, params, before))
    for param, state in zip(params, before_states):
        assert sorted(opt.state[param]) == sorted(state)
        assert all(torch.equal(opt.state[param][key], value) for key, value in state.items())


@pytest.mark.parametrize("cls, key", [(fastoptim.AdamWSN, "correct_bias"), (fastoptim.Adan, "no_prox")])
@pytest.mark.parametrize("value", ["0", "False", (0,), ()])
def test_a_flag_set_to_text_or_a_sequence_is_refused_by_name_with_nothing_changed(cls, key, value):
    """A flag read only by its truth: "0" and "False" (a config file's) are true, so Adan's no_prox="False"
    switched its weight decay rule silently (helper-93), and the bound step once read "0" as 0."""
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(SHAPES)]
    with pytest.raises(ValueError, match=f"Invalid {key}"):
        cls(params, lr=0.1, **{key: value})
    opt = cls(params, lr=0.1)
    for step in range(2):
        for param in params:
            param.grad = grad_for(param, step)
        opt.step()
    before = [param.detach().clone() for param in params]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=f"Invalid {key}"):
        opt.step()
    assert all(map(torch.equal, params, before))


@pytest.mark.parametrize("value", [None])
def test_an_option_set_to_what_no_rule_reads_steps_bound_as_checked_and_compiled(value, monkeypatch):
    """``correct_bias`` written into an AdamWSN group between steps as what is no number (the constructor
    takes only a bool; the checked step reads its truth): the bound step raised a TypeError reading None
    as a number. Now the bound step leaves such an option to the checked step, and bound, checked and
    compiled steps agree bit for bit. (Text and sequences are refused: the test above.)"""
    def change(step, opt, params):
        if step == 2:
            opt.param_groups[0]["correct_bias"] = value

    factory = lambda params: fastoptim.AdamWSN(params, lr=0.1)  # noqa: E731
    (bound, _), (checked, _), _ = _bound_and_checked(factory, change, monkeypatch)
    assert all(map(torch.equal, bound, checked))
    if value is not None:
        return
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(SHAPES)]
    opt = factory(params)
    step = torch.compile(opt.step)
    for i in range(6):
        for param in params:
            param.grad = grad_for(param, i)
        change(i, opt, params)
        step()
    assert all(map(torch.equal, params, checked))


@pytest.mark.parametrize("value", [Decimal("0.01"), np.complex64(0.01)], ids=["Decimal", "numpy complex"])
def test_an_lr_the_checked_step_does_not_read_as_a_float_is_left_to_it(value):
    """An lr written between steps as a Decimal (which the checked step's float arithmetic refused) or a numpy
    complex number: the bound step leaves it to the checked step (it stepped a Decimal lr as float(lr), so
    whether the option worked hung on the path), which refuses it by name, as no real number, on both."""
    outcomes = []
    for checked in (False, True):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                  for i, s in enumerate(SHAPES)]
        opt = fastoptim.AdamW(params, lr=0.1)
        for step in range(3):
            for param in params:
                param.grad = grad_for(param, step)
            if step == 2:
                opt.param_groups[0]["lr"] = value
            if checked:
                opt._plans.bound = None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt.step()
            except ValueError as error:
                outcomes.append((str(error), [param.clone() for param in params]))
                break
        else:
            outcomes.append((None, [param.clone() for param in params]))
    (bound_error, bound), (checked_error, checked) = outcomes
    assert bound_error == checked_error == f"Invalid lr: {value!r} (must be {checks.NUMBER_TERMS})"
    assert all(map(torch.equal, bound, checked))


NUMPY_WRITES = {"fp32 numbers": lambda value: np.float32(value), "float64 numbers": lambda value: np.float64(value)}


@pytest.mark.parametrize("kind", list(NUMPY_WRITES))
@pytest.mark.parametrize("engine", [dict(), dict(foreach=False, fused=True), dict(fused=False),
                                    dict(foreach=False, fused=False)], ids=["fused-multi", "fused-single", "foreach",
                                                                            "loop"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan, fastoptim.AdamWSN])
def test_options_written_as_numpy_numbers_step_as_their_python_values_on_every_path(cls, engine, kind):
    """A scheduler that writes numpy numbers (lr, weight decay, eps, betas) between steps: the checked
    step's arithmetic rounded a numpy fp32 number's products to fp32 (an ulp apart from the bound and
    compiled steps, which take its value as a float64), on the engines that step checked. Every
    path now steps as with the numbers' Python values, bit for bit."""
    betas = {fastoptim.Adan: (0.98, 0.92, 0.99)}.get(cls, (0.9, 0.999))

    def change(write):
        def edit(step, opt, params):
            if step in (1, 3):
                opt.param_groups[0].update(lr=write(1e-3 * (step + 1)), weight_decay=write(0.1), eps=write(1e-7),
                                           betas=tuple(map(write, betas)))
        return edit

    as_numpy = NUMPY_WRITES[kind]
    ours, opt = _run(lambda params: cls(params, lr=1e-2, **engine), change(as_numpy), checked=False)
    plain, _ = _run(lambda params: cls(params, lr=1e-2, **engine), change(lambda v: as_numpy(v).item()), checked=False)
    assert all(map(torch.equal, ours, plain))
    assert type(opt.param_groups[0]["lr"]) is type(as_numpy(0.0))  # the group keeps what was written (a scheduler's)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("engine", [dict(), dict(fused=False)], ids=["fused", "foreach"])
def test_betas_of_numpy_numbers_in_a_namedtuple_step_as_their_python_values(engine, compiled):
    """A namedtuple of numpy betas: giving the betas their Python values built one from a list, which a
    namedtuple refuses (a TypeError at the step, after another group's params had stepped)."""
    betas_type = collections.namedtuple("Betas", "beta1 beta2")
    runs = []
    for make in (np.float64, float):
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
        opt = fastoptim.AdamW([{"params": params[:1]}, {"params": params[1:], "betas": betas_type(make(0.9), make(0.99))}],
                              lr=1e-2, **engine)
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        for index in range(2):
            for param in params:
                param.grad = torch.full_like(param, index + 1.0)
            step()
        assert type(opt.param_groups[1]["betas"]) is betas_type
        runs.append(params)
    assert all(map(torch.equal, *runs))


def _snapshot_of(opt, params):
    return [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()
                                                    if isinstance(v, torch.Tensor)]


def _assert_unchanged(opt, params, before):
    """That ``params`` and every state tensor of theirs are as ``_snapshot_of`` found them in ``before``."""
    after = _snapshot_of(opt, params)
    assert len(after) == len(before) and all(map(torch.equal, after, before))


@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("engine", [dict(fused=True), dict(foreach=True, fused=False), dict(foreach=False)],
                         ids=["fused", "foreach", "loop"])
def test_an_option_written_as_an_array_steps_as_its_one_value_or_is_refused_by_name(key, engine):
    """``group["lr"] = np.array([1e-3])``, in the second of two groups, steps as 1e-3 does (as a one-element
    tensor lr does: it raised a TypeError naming nothing, after the first group had stepped); an array of
    two values is refused by name before any group steps, every param and state as it was."""
    def run(value_of):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4) + i) for i in range(4)]
        opt = fastoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, **engine)
        for step in range(4):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (step + 1))
            if step == 2:
                opt.param_groups[1][key] = value_of(opt.param_groups[1][key])
            opt.step()
        return params, opt

    (ours, _), (theirs, _) = run(lambda value: np.array([value])), run(lambda value: value)
    assert all(map(torch.equal, ours, theirs))
    params, opt = run(lambda value: value)
    opt.param_groups[1][key] = np.array([1e-3, 2e-3])
    before = _snapshot_of(opt, params)
    with pytest.raises(ValueError, match=rf"Invalid {key}: array\(\[.*\]\) \(an array of shape \(2,\)"):
        opt.step()
    _assert_unchanged(opt, params, before)


@pytest.mark.parametrize("cls, key, value", [(fastoptim.AdamW, "maximize", True), (fastoptim.AdamW, "foreach", True),
                                             (fastoptim.AdamW, "stochastic_rounding", False),
                                             (fastoptim.Muon, "momentum", 0.9)],
                         ids=["maximize", "foreach", "stochastic_rounding", "Muon momentum"])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "checked"])
def test_a_plan_option_or_a_muon_number_written_as_a_one_element_array_steps_as_its_value(cls, key, value, bound):
    """The plan's check read a one-element array as a list and refused it; Muon's bound part handed it to
    native code, which refused it (helper-43)."""
    def run(written):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 20).reshape(4, 5) + i) for i in range(3)]
        opt = cls(params, lr=1e-2)
        for step in range(5):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (step + 1))
            if step == 3:
                opt.param_groups[0][key] = written
            if not bound:
                opt._plans.bound = None
            opt.step()
        return params

    assert all(map(torch.equal, run(np.array([value])), run(value)))


@pytest.mark.parametrize("key, value, dtype", [("master_bits", 24, torch.bfloat16), ("master_bits", 32, torch.bfloat16),
                                               ("state_bits", 16, torch.float32), ("sn", True, torch.float32),
                                               ("subset_size", 4, torch.float32), ("foreach", False, torch.float32)])
@pytest.mark.parametrize("given", ["constructor", "between steps"])
@pytest.mark.parametrize("as_numpy", [np.array, lambda value: np.array([value]),
                                      lambda value: np.bool_(value) if isinstance(value, bool) else np.int64(value)],
                         ids=["0-d array", "one-element array", "numpy scalar"])
def test_a_plan_option_given_as_a_numpy_value_plans_as_its_python_value(key, value, dtype, given, as_numpy):
    """``master_bits=np.array(24)`` raised numpy's "unhashable type" making the remainders (helper-43), and
    ``foreach=np.False_`` ran foreach, not the loop that ``foreach=False`` selects: every option that decides
    a group's plan (its engine, state formats, subset norms) is read as its Python value wherever it is."""
    if given == "between steps" and key in ("state_bits", "sn", "subset_size"):
        pytest.skip("a change of the states' format is refused between steps, whatever its type")

    def run(written):
        params = [torch.nn.Parameter((torch.linspace(-1, 1, 64).reshape(8, 8) + i).to(dtype)) for i in range(3)]
        extra = {"sn": True} if key == "subset_size" else {}
        opt = fastoptim.AdamW(params, lr=1e-2, **extra, **({key: written} if given == "constructor" else {}))
        for step in range(4):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (step + 1))
            if step == 2 and given == "between steps":
                opt.param_groups[0][key] = written
            opt.step()
        return params, opt

    (ours, opt), (theirs, reference) = run(as_numpy(value)), run(value)
    assert all(map(torch.equal, ours, theirs))
    assert opt._plans.current[0].engine == reference._plans.current[0].engine
    for mine, other in zip(ours, theirs):
        assert {k: (v.dtype, v.shape) for k, v in opt.state[mine].items() if isinstance(v, torch.Tensor)} == {
            k: (v.dtype, v.shape) for k, v in reference.state[other].items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("case", ["AdamW amsgrad", "Muon adamw_eps"])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "checked"])
def test_a_flag_or_an_alias_written_as_an_array_of_two_values_is_refused_by_name(case, bound):
    """An array of two values in AdamW's ``amsgrad`` (a kernel flag) or in Muon's ``adamw_eps`` (compared with
    ``eps``) raised numpy's "truth value of an array ... is ambiguous" (helper-43): it is refused naming the
    option, every param and state as it was."""
    matrices = [torch.nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4) + i) for i in range(2)]
    vector = torch.nn.Parameter(torch.linspace(-1, 1, 4))
    if case == "AdamW amsgrad":
        opt, key, value = fastoptim.AdamW(matrices + [vector], lr=1e-2), "amsgrad", np.array([True, False])
    else:
        opt = fastoptim.Muon([{"params": matrices}, {"params": [vector], "use_muon": False}], lr=1e-2)
        key, value = "adamw_eps", np.array([1e-8, 1e-8])
    params = matrices + [vector]
    for step in range(3):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        opt.step()
    opt.param_groups[-1][key] = value
    if not bound:
        opt._plans.bound = None
    before = _snapshot_of(opt, params)
    with pytest.raises(ValueError, match=rf"Invalid {key}: array\(\[.*\]\) \(an array of shape \(2,\)"):
        opt.step()
    _assert_unchanged(opt, params, before)


@pytest.mark.parametrize("false", [0, np.int64(0), np.array(0), np.array([0]), np.float64(0.0), torch.tensor(False)],
                         ids=["0", "np.int64(0)", "0-d array", "one-element array", "np.float64(0.0)", "tensor(False)"])
@pytest.mark.parametrize("fused, engine", [(False, "loop"), (True, "fused-single")])
def test_a_false_foreach_of_any_type_selects_the_engine_that_false_does(false, fused, engine):
    """``foreach=0`` (or a numpy zero) passed the check, which takes 0 and 1 as torch.optim does, and then ran
    foreach (or fused-multi), where ``foreach=False`` runs the loop (or fused-single) (helper-44)."""
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    opt = fastoptim.AdamW([param], foreach=false, fused=fused)
    opt.step()
    assert opt._plans.current[0].engine == engine
    opt.param_groups[0]["foreach"] = None
    opt.step()
    opt.param_groups[0]["foreach"] = false  # written between steps: the same
    opt.step()
    assert opt._plans.current[0].engine == engine


def test_fused_1_on_params_the_kernels_do_not_take_warns_as_fused_true_does():
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    param.grad = torch.ones(4, dtype=torch.float64)
    for fused in (True, 1, np.int64(1)):
        with pytest.warns(UserWarning, match="foreach"):
            fastoptim.AdamW([param], fused=fused).step()


@pytest.mark.parametrize("amsgrad", [np.True_, np.array(True), np.array([True]), 1])
def test_amsgrad_takes_one_rule_in_the_constructor_between_steps_and_on_load(amsgrad):
    """The constructor (and a load) refused ``amsgrad=np.True_`` and ``1``, which a write between steps took
    (helper-44): each is taken everywhere, and steps as True does."""
    def run(first, later):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 12) + i) for i in range(2)]
        opt = fastoptim.AdamW(params, lr=1e-2, amsgrad=first)
        for step in range(4):
            for param in params:
                param.grad = torch.full_like(param, 0.1 * (step + 1)) * (-1) ** step
            if step == 2:
                opt.param_groups[0]["amsgrad"] = later
            opt.step()
        opt.load_state_dict(opt.state_dict())
        return params

    assert all(map(torch.equal, run(amsgrad, amsgrad), run(True, True)))
    assert all(map(torch.equal, run(False, amsgrad), run(False, True)))


@pytest.mark.parametrize("eps, adamw_eps", [(1e-8, np.array([1e-8, 1e-8])), (np.array([1e-8, 1e-8]), 1e-8),
                                            (1e-8, np.float32(1e-8))], ids=["adamw_eps", "eps", "float32"])
def test_muon_companion_eps_and_its_alias_are_compared_by_one_rule(eps, adamw_eps):
    """A Muon group of ``use_muon=False`` given ``eps`` and ``adamw_eps`` apart is refused naming them, in
    the constructor as between steps: the constructor raised numpy's ambiguous truth for an array of two,
    and took ``np.float32(1e-8)`` beside ``1e-8``, which a write between steps refused (helper-44)."""
    def groups(**companion):
        return [{"params": [torch.nn.Parameter(torch.ones(4, 4))]},
                {"params": [torch.nn.Parameter(torch.ones(4))], "use_muon": False, **companion}]

    name = "adamw_eps" if isinstance(eps, float) and isinstance(adamw_eps, np.ndarray) else "eps"
    with pytest.raises(ValueError, match=rf"Invalid {name}"):
        fastoptim.Muon(groups(eps=eps, adamw_eps=adamw_eps))
    opt = fastoptim.Muon(groups())
    for param in (p for group in opt.param_groups for p in group["params"]):
        param.grad = torch.ones_like(param)
    opt.step()
    opt.param_groups[1].update(eps=eps, adamw_eps=adamw_eps)
    with pytest.raises(ValueError, match=rf"Invalid {name}"):
        opt.step()


class _PassingKeywordsOn(fastoptim.AdamW):
    def __init__(self, params, **options):  # its base's options, which its own signature does not name
        super().__init__(params, **options)


@pytest.mark.parametrize("bad", [None, "1e-3", 1j, [0.1], np.array(0.01 + 1j), np.array("0.01"),
                                 torch.tensor([0.01, 0.02]), torch.tensor([[0.01]]), torch.tensor(True)],
                         ids=["None", "text", "complex", "list", "complex array", "text array", "two-value tensor",
                              "2-D one-value tensor", "bool tensor"])
@pytest.mark.parametrize("cls, key, options", [(fastoptim.AdamW, "lr", {}), (fastoptim.AdamW, "eps", {}),
                                               (fastoptim.Adan, "weight_decay", {}), (fastoptim.Lion, "lr", {}),
                                               (fastoptim.AdamWSN, "eps", dict(sn=True)),
                                               (fastoptim.AdamW, "lr", dict(master_bits=24)),
                                               (_PassingKeywordsOn, "weight_decay", {})],
                         ids=["AdamW lr", "AdamW eps", "Adan weight_decay", "Lion lr", "AdamWSN eps", "master_bits=24",
                              "a subclass passing **options on"])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "checked"])
def test_a_number_option_written_as_no_number_is_refused_by_name_before_any_group_steps(cls, key, options, bad,
                                                                                      bound):
    """``group["lr"] = None`` (or text, a complex number, a list) in the second of two groups raised a
    TypeError from the step's arithmetic after the first group had stepped, its count not advanced (and
    with master_bits, its remainders zeroed first) (helper-45): it is refused by name, nothing changed; so
    are their numpy and tensor forms, and in a subclass whose signature names no option (helper-46)."""
    if key == "lr" and isinstance(bad, torch.Tensor) and bad.numel() == 1 and bad.is_floating_point():
        pytest.skip("a tensor lr of one value, of any shape, is an lr (as torch.optim takes it)")
    dtype = torch.bfloat16 if options.get("master_bits") else torch.float32
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(4, 3).to(dtype) + i) for i in range(2)]
    opt = cls([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, **options)
    for step in range(3):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        opt.step()
    opt.param_groups[1][key] = bad
    if not bound:
        opt._plans.bound = None
    with torch.no_grad():
        params[0].mul_(1.5)  # a write the next step notes (master_bits: the remainders restart)
    before = _snapshot_of(opt, params)
    with pytest.raises(ValueError, match=rf"Invalid {key}: "):
        opt.step()
    _assert_unchanged(opt, params, before)


@pytest.mark.parametrize("write", [
    dict(eps=None), dict(momentum=None), dict(ns_coefficients=(1.0, 2.0)),
    dict(ns_steps=4, ns_coefficients=[(3.4445, -4.7750, 2.0315)] * 5), dict(ns_steps=2.0),
    dict(use_muon="no"), dict(nesterov="no"), dict(flatten="no"), dict(weight_decay=torch.tensor([0.1])),
    dict(momentum=torch.tensor(True)), dict(adjust_lr_fn="bogus")],
    ids=["eps None", "momentum None", "a pair", "a schedule of another length", "ns_steps a float", "use_muon text",
         "nesterov text", "flatten text", "weight_decay a 1-D tensor", "momentum a bool tensor", "adjust_lr_fn unknown"])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "checked"])
def test_a_muon_option_made_invalid_between_steps_is_refused_before_any_group_steps(write, bound):
    """Muon's schedule, flags and numbers written into its second group: refused by name, as the constructor
    refuses them, before the first group steps (the checked step had stepped it; eps=None raised from the
    iterations after the momentum kernel had run; text flags were taken by their truth) (helper-45)."""
    matrices = [torch.nn.Parameter(torch.linspace(-1, 1, 48).reshape(8, 6) + i) for i in range(2)]
    opt = fastoptim.Muon([{"params": matrices[:1]}, {"params": matrices[1:]}], lr=1e-2)
    for step in range(3):
        for param in matrices:
            param.grad = torch.full_like(param, 0.1 * (step + 1)) * torch.linspace(-1, 1, 48).reshape(8, 6)
        opt.step()
    opt.param_groups[1].update(write)
    if not bound:
        opt._plans.bound = None
    before = _snapshot_of(opt, matrices)
    with pytest.raises(ValueError, match=rf"Invalid ({'|'.join(write)})"):
        opt.step()
    _assert_unchanged(opt, matrices, before)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5], ids=["unclipped", "clipped"])
def test_a_bound_muon_of_two_dtypes_gives_each_matrix_its_own_lr_factor(max_grad_norm, monkeypatch):
    """A Muon group of a bf16 and two fp32 matrices makes two buckets, the second's slice cut by shape (the
    (8, 4) matrix before the (4, 8)). Its bound step cut the per-matrix step sizes by the index the checked
    step had kept for the slice, which counts from the bucket's first param, not the group's: the two fp32
    matrices stepped with each other's lr factor (helper-46). Bit for bit the checked twin, and foreach."""
    ran, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: ran.append(real(self, *args)) or ran[-1])

    def run(engine, checked):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 32).reshape(shape).to(dtype) + i) for i, (shape, dtype)
                  in enumerate([((4, 8), torch.bfloat16), ((8, 4), torch.float32), ((4, 8), torch.float32)])]
        opt = fastoptim.Muon(params, lr=0.02, max_grad_norm=max_grad_norm, **engine)
        for step in range(4):
            for param in params:
                param.grad = (torch.linspace(-1, 1, 32).reshape(param.shape) * (step + 1)).to(param.dtype)
            if checked:
                opt._plans.bound = None
            opt.step()
        return params

    bound = run(dict(foreach=True, fused=True), checked=False)
    assert ran and all(ran)
    for ours, checked, foreach in zip(bound, run(dict(foreach=True, fused=True), checked=True),
                                      run(dict(foreach=True, fused=False), checked=False)):
        assert torch.equal(ours, checked) and torch.equal(ours, foreach)


class _ScalingRows(fastoptim.AdamW):
    """A subclass with an option of its own, a number by default, that its own step reads as a tensor."""

    def __init__(self, params, lr=1e-3, row_scale=1.0, **options):
        super().__init__(params, lr=lr, **options)
        for group in self.param_groups:
            group.setdefault("row_scale", row_scale)

    def step(self, closure=None):
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    param.grad.mul_(torch.as_tensor(group["row_scale"]).reshape(-1, 1))
        return super().step(closure)


def test_a_subclass_s_own_number_option_is_its_own_to_read():
    """The number check covers the options fastoptim's classes read, not a subclass's own (it refused a
    row_scale of four values, which the subclass reads itself: helper-47)."""
    param = torch.nn.Parameter(torch.ones(4, 6))
    opt = _ScalingRows([param])
    opt.param_groups[0]["row_scale"] = torch.tensor([1.0, 0.5, 0.5, 1.0])
    param.grad = torch.ones(4, 6)
    before = param.detach().clone()
    opt.step()
    assert not torch.equal(param.grad[0], param.grad[1]) and not torch.equal(param, before)


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan, fastoptim.Lion], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("odd", ["transposed", "expanded"])
def test_a_grad_the_kernel_cannot_walk_leaves_only_its_own_step_to_foreach(cls, odd):
    """A grad the fused kernel cannot walk (transposed against its param, or expanded) is stepped by
    foreach that step. The kernel's split kept leaving that param to foreach at every later step, on
    grads it can walk (helper-74: the next steps differed from an optimizer loaded with the same state
    dict), and the group never ran bound again. The split follows the grads: the next step is the
    kernel's again, and bound."""
    def params():
        return [torch.nn.Parameter(torch.randn(6, 5, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    ran, fresh_params = params(), params()
    opt = cls(ran, lr=1e-2, fused=True)
    for step in range(4):
        for param in ran:
            param.grad = grad_for(param, step)
        if step == 1:
            grad = ran[0].grad
            ran[0].grad = grad.t().contiguous().t() if odd == "transposed" else grad[:1].expand_as(grad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        if step == 1:
            with torch.no_grad():
                for mine, theirs in zip(fresh_params, ran):
                    mine.copy_(theirs)
            fresh = cls(fresh_params, lr=1e-2, fused=True)
            fresh.load_state_dict(opt.state_dict())
        elif step > 1:
            for param in fresh_params:
                param.grad = grad_for(param, step)
            fresh.step()
    assert all(map(torch.equal, ran, fresh_params))
    assert all(torch.equal(value, fresh.state[theirs][key]) for mine, theirs in zip(ran, fresh_params)
               for key, value in opt.state[mine].items() if isinstance(value, torch.Tensor))
    assert opt._plans.bound is not None
