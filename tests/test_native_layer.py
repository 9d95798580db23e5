"""The native layer's contract (fastoptim/kernels/native.cpp): params and states bound to native
code once, a step that checks no tensor in Python, and native checks of every held tensor and grad
at every call. Whatever changes between two steps, the next step is the loop engine's with the same
change, or is refused with a clear error and changes nothing; never a stale pointer. The Triton
backend's tables are bound and checked natively too (its kernels run in Triton's interpreter here)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fastoptim
from fastoptim import engines
from fastoptim.bound_step import BoundStep, rule_numbers
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.specs import declared_specs
from fastoptim.states import master
from fastoptim.optimizers.algorithm import StepInputs
from fastoptim.optimizer_state import ParamState

from .registry import OPTIMIZERS

pytestmark = pytest.mark.skipif(not cpu_backend.AVAILABLE, reason="the native library is not built")

SHAPES = [(5, 7), (300,), (3,)]
# The backends whose tables native code checks; Triton's kernels take these CPU tensors in its interpreter.
TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton runs CPU tensors in its interpreter only"))
BACKENDS = ["cpu", TRITON]
ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}


def grad_for(param, step):
    values = torch.linspace(-1, 1, param.numel()).reshape(param.shape).mul(step + 1).sin()
    return values.to(param.dtype)


def states_of(opt):
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]


def _transposed_grad(opt, params):
    params[0].grad = params[0].grad.t().contiguous().t()  # same values, column-major


def _double_grad(opt, params):
    params[1].grad_dtype = None  # torch refuses a grad of another dtype unless told to take any
    params[1].grad = params[1].grad.double()


def _moved_states(move):
    def change(opt, params):
        for state in states_of(opt):
            move(state)
    return change


def _replaced_states(opt, params):
    for state in opt.state.values():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.dim():
                state[key] = value.clone()


def _reloaded(opt, params):
    opt.load_state_dict(opt.state_dict())


def _new_group(opt, params):
    extra = torch.nn.Parameter(torch.randn(4, 3))
    params.append(extra)
    opt.add_param_group({"params": [extra]})
    extra.grad = grad_for(extra, 0)


# Each change happens after step 2's grads are set, before its step.
CHANGES = {
    "param set_": lambda opt, params: params[0].data.set_(params[0].data.clone()),
    "param .data": lambda opt, params: setattr(params[1], "data", params[1].data.clone()),
    "param share_memory_": lambda opt, params: params[1].share_memory_(),
    "param as_strided_": lambda opt, params: params[0].data.as_strided_((5, 7), (1, 5)),
    "param resize_": lambda opt, params: params[1].data.resize_(299),
    "grad non-contiguous": _transposed_grad,
    "grad other dtype": _double_grad,
    "grad removed": lambda opt, params: setattr(params[2], "grad", None),
    "states set_": _moved_states(lambda t: t.set_(t.clone())),
    "states share_memory_": _moved_states(lambda t: t.share_memory_()),
    "states resize_": _moved_states(lambda t: t.resize_(t.numel() + 1)),
    "states replaced": _replaced_states,
    "states cleared": lambda opt, params: opt.state[params[1]].clear(),
    "load_state_dict": _reloaded,
    "add_param_group": _new_group,
    "group option state_bits": lambda opt, params: opt.param_groups[0].update(state_bits=16),
}


def trajectory(cls, engine, change, steps=4, at=2):
    """The params after ``steps`` steps with ``change`` made at step ``at``, or the error that step
    raised with whether the params were left as they were."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = cls(params, lr=1e-2, **ENGINES[engine])
    for step in range(steps):
        for param in params:
            param.grad = grad_for(param, step)
        if step == at:
            with torch.no_grad():
                change(opt, params)
        before = [p.detach().clone() for p in params]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fused=True falls back for a non-contiguous grad, with a warning
                opt.step()
        except (RuntimeError, ValueError) as error:
            unchanged = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, params))
            return type(error), unchanged
    return [p.detach().clone() for p in params]


def disagreements(name):
    """Every (engine, change) on which the fused engines do not do what the loop engine does, for
    the optimizer ``name``: a step equal to its (to float rounding), or the same error, with the
    params left as they were."""
    cls = next(info.cls for info in OPTIMIZERS if info.name == name)
    found = []
    for change in CHANGES:
        expected = trajectory(cls, "loop", CHANGES[change])
        for engine in ("fused-single", "fused-multi"):
            got = trajectory(cls, engine, CHANGES[change])
            if isinstance(expected, tuple):  # the loop engine refused it: so must the kernel, changing nothing
                agree = got == (expected[0], True)
            else:
                agree = not isinstance(got, tuple) and all(
                    torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, expected))
            if not agree:
                found.append(f"{engine}, {change}: {got if isinstance(got, tuple) else 'other values'}, "
                             f"loop: {expected if isinstance(expected, tuple) else 'values'}")
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_after_a_change_is_the_loop_engines_or_refused_with_nothing_changed(backend):
    """In a fresh interpreter, one per backend: a stale pointer would crash it, which fails this test,
    not the run. On Triton's backend for Adan's and AdamW's kernels only: its interpreter is slow."""
    names = [info.name for info in (OPTIMIZERS if backend == "cpu" else OPTIMIZERS[:2])]
    code = ("import json, tests.test_native_layer as t; "
            f"print(json.dumps({{name: t.disagreements(name) for name in {names!r}}}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent, env=os.environ | {"FASTOPTIM_FUSED_BACKEND": backend})
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    found = json.loads(result.stdout.splitlines()[-1])
    assert list(found) == names and not any(found.values()), found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_step_changes_no_bucket_even_when_the_others_are_fine(backend, monkeypatch):
    """Two buckets (fp32 and bf16) run in one native call, which checks both before either runs."""
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", backend)
    info = OPTIMIZERS[0]
    params = [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64).bfloat16())]
    opt = info.cls(params, lr=1e-2, fused=True)
    for step in range(3):
        for param in params:
            param.grad = grad_for(param, step)
        if step == 2:
            before = [p.detach().clone() for p in params]
            opt.state[params[1]][next(iter(opt.state[params[1]]))].resize_(7)
            with pytest.raises(RuntimeError, match="was the param"):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, params))
        else:
            opt.step()


@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
def test_a_state_stored_as_a_plain_dict_is_watched_like_the_others(engine):
    info = OPTIMIZERS[1]
    runs = []
    for replace in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = info.cls(params, lr=1e-2, **ENGINES[engine])
        for step in range(4):
            for param in params:
                param.grad = grad_for(param, step)
            if step == 2:
                state = dict(opt.state[params[0]])
                if replace:
                    state["exp_avg"] = torch.zeros_like(state["exp_avg"])
                opt.state[params[0]] = state
                assert type(opt.state[params[0]]) is ParamState
                if replace:  # a later change to the stored dict is seen too
                    opt.state[params[0]]["exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
            opt.step()
        runs.append(torch.cat([p.detach().reshape(-1) for p in params]))
    assert not torch.equal(runs[0], runs[1])
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = info.cls(params, lr=1e-2, foreach=False, fused=False)
    for step in range(4):
        for param in params:
            param.grad = grad_for(param, step)
        if step == 2:
            opt.state[params[0]]["exp_avg"].zero_()
            opt.state[params[0]]["exp_avg_sq"].zero_()
        opt.step()
    torch.testing.assert_close(runs[1], torch.cat([p.detach().reshape(-1) for p in params]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
def test_a_fused_step_bumps_the_params_version_counters(engine, backend, monkeypatch):
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", backend)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OPTIMIZERS[0].cls(params, lr=1e-2, **ENGINES[engine])
    for step in range(3):
        for param in params:
            param.grad = grad_for(param, step)
        versions = [p._version for p in params]
        opt.step()
        assert all(p._version > v for p, v in zip(params, versions))


@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan, fastoptim.Lion])
def test_a_bound_step_of_a_group_of_two_dtypes_is_the_checked_step(cls, engine, monkeypatch):
    """A group of fp32 and bf16 params (a bucket each) runs bound, each bucket's tables launched without
    a plan: bit for bit the steps of a twin that takes the checked way every step, with stochastic
    rounding (a seed per bucket, drawn in the same order) and, for AdamW, params at different counts
    (scalars with one value per param, cut to each bucket; the bf16 bucket's last two at one count,
    whose scalars the native rule computes once)."""
    shapes, dtypes = [(5, 7), (300,), (3,), (4, 4), (6,), (2, 3)], [torch.float32, torch.bfloat16] * 3
    batches, real = [], BoundStep.step
    monkeypatch.setattr(BoundStep, "step", lambda self, *args: batches.append(
        (len(self.call.per_tensor), real(self, *args))) or batches[-1][1])
    runs = []
    for checked in (False, True):
        batches.clear()
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(d))
                  for i, (s, d) in enumerate(zip(shapes, dtypes))]
        opt = cls(params, lr=1e-2, weight_decay=0.1, stochastic_rounding=True, **ENGINES[engine])
        for step in range(5):
            for param in params:
                param.grad = grad_for(param, step)
            if step == 2 and cls is fastoptim.AdamW:
                opt.state[params[1]]["step"].fill_(7.0)  # in place: the step stays bound
            if checked:
                opt._plans.bound = None
            torch.manual_seed(step)
            opt.step()
        # steps 2-5 ran bound, both buckets in one native call that took them
        assert batches == ([] if checked else [(2, True)] * 4)
        runs.append([p.detach().clone() for p in params])
    for bound, expected in zip(*runs):
        torch.testing.assert_close(bound, expected, rtol=0, atol=0)


def _bound_run(info, engine, params, change=None, steps=4, at=2):
    """``info``'s optimizer on ``engine`` over ``params`` for ``steps`` steps (bound from the second
    on, where the engine is fused), ``change(opt, params)`` made before step ``at``."""
    opt = info.cls(params, lr=1e-2, **ENGINES[engine])
    for step in range(steps):
        for param in params:
            param.grad = grad_for(param, step)
        if step == at and change is not None:
            with torch.no_grad():
                change(opt, params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fused=True leaves a transposed state to foreach, with a warning
            opt.step()
    return opt


def _square_states(opt):
    """The optimizer's states of one square param, with their keys."""
    return [(state, key) for state in opt.state.values() for key, value in state.items()
            if torch.is_tensor(value) and value.dim() == 2 and value.shape[0] == value.shape[1]]


def _transposed_in_place(opt, params):
    for state, key in _square_states(opt):
        state[key].t_()


def _transposed_view_stored(opt, params):
    for state, key in _square_states(opt):
        state[key] = state[key].t()


@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_a_square_state_transposed_in_place_is_followed_as_the_loop_engine_follows_it(info, engine):
    """``exp_avg.t_()`` between two bound steps keeps the state's pointer, dtype and sizes: its strides
    tell that its elements moved. The step is, bit for bit, the one that finds the transposed view
    stored in the state's place (a change the step sees in Python), and the loop engine's to the
    kernel's rounding (the steps before the change ran on the kernel)."""
    runs = []
    for name, change in ((engine, _transposed_in_place), (engine, _transposed_view_stored),
                         ("loop", _transposed_in_place)):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                  for i, s in enumerate([(6, 6), (300,), (5, 7)])]
        _bound_run(info, name, params, change)
        runs.append([p.detach() for p in params])
    in_place, stored, loop = runs
    for got, expected, by_loop in zip(in_place, stored, loop):
        assert torch.equal(got, expected)
        torch.testing.assert_close(got, by_loop, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_a_sparse_grad_after_bound_steps_is_refused_clearly_on_every_step(info, engine):
    """The first step's error: native code, which reads no sparse tensor's layout, leaves it to the
    checked step."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = _bound_run(info, engine, params, steps=3)
    params[0].grad = params[0].grad.to_sparse()
    before = [p.detach().clone() for p in params], [
        {key: value.clone() for key, value in opt.state[p].items()} for p in params]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="does not support sparse gradients"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before[0], params))
        for state, kept in zip((opt.state[p] for p in params), before[1]):
            assert all(torch.equal(state[key], value) for key, value in kept.items())


def test_the_step_op_updates_the_states_it_is_given_not_those_of_the_last_call():
    """Its tables are kept per call; other state tensors with the same params are new tables."""
    from fastoptim.optimizers.lion import SPEC
    op = torch.ops.fastoptim.lion_step
    param, grad = [torch.ones(8)], [torch.ones(8)]
    scalars = [torch.tensor(v) for v in (0.0, 0.0, 1.0, 0.9, 0.1, 0.99, 0.01, 0.1, 1.0)]
    assert len(scalars) == len(SPEC.all_scalars)
    first, second = [torch.zeros(8)], [torch.zeros(8)]
    for states in (first, second):
        op(param, grad, *engines.step_op.op_states({"param": param, "exp_avg": states}, {}, SPEC), scalars, 0, False)
    assert torch.equal(first[0], second[0]) and first[0].abs().sum() > 0


def test_a_bound_step_refuses_handles_and_counts_it_does_not_know():
    with pytest.raises(RuntimeError, match="no bound call"):
        torch.ops.fastoptim.bound_step(-5, [], [], [], [], [0], [], [], None)
    with pytest.raises(RuntimeError, match="no bound table"):
        torch.ops.fastoptim.bind_call([-5], [0], [0], False)
    with pytest.raises(RuntimeError, match="one per_tensor and ruled entry per table"):
        torch.ops.fastoptim.bind_call([-5], [], [], False)


def a_bound_call():
    """A one-param Adan's param, its bound table, and the native call its bound step ran last, with its
    arguments (the param as it left it)."""
    params = [torch.nn.Parameter(torch.randn(8))]
    params[0].grad = torch.ones(8)
    opt = OPTIMIZERS[0].cls(params, lr=1e-2, fused=True)
    opt.step()
    calls = []
    real = cpu_backend.StepCall.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_backend.StepCall, "run", lambda call, *args: calls.append((call, args)) or real(call, *args))
        opt.step()
    (call, args), = calls
    run_tables, _, _ = opt._plans.bound.groups[0].runs[0]
    return params[0], run_tables.tables[0][2], call, args


def test_a_bound_step_refuses_scalars_it_cannot_read_and_changes_nothing():
    param, _, call, args = a_bound_call()
    before = param.detach().clone()
    handle, grads, numbers, _, _, *rest = call.arguments(*args)
    for bad in (torch.ones(3), torch.ones((), dtype=torch.int64), torch.ones(8)[::2]):
        with pytest.raises(RuntimeError, match="must be a contiguous fp32 or float64 CPU tensor"):
            torch.ops.fastoptim.bound_step(handle, grads, numbers, [bad], [len(numbers) - 1], *rest)
    assert torch.equal(param, before)


def test_a_call_refuses_a_table_listed_twice():
    _, table, call, _ = a_bound_call()
    with pytest.raises(RuntimeError, match="listed twice"):
        cpu_backend.StepCall([table] * 2, call.per_tensor * 2, call.ruled * 2)


@pytest.mark.parametrize("order", [[1], [0, 0], [0, 2], [-1, 1], [1, 0, 2]],
                         ids=["short", "twice", "past the end", "negative", "long"])
def test_a_call_refuses_a_norm_order_that_is_not_its_tensors_once_each(order):
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(2)]
    opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
    for param in params:
        param.grad = torch.ones(8)
    opt.step()
    (tables, _, _), = opt._plans.bound.groups[0].runs
    (_, _, table, _), = tables.tables
    assert cpu_backend.StepCall([table], [False], [True], norm_order=[1, 0]).handle >= 0
    with pytest.raises(RuntimeError, match="norm_order must list each of the 2 tensors of its tables once"):
        cpu_backend.StepCall([table], [False], [True], norm_order=order)


def test_a_bound_step_refuses_flags_and_a_gradscaler_scale_it_cannot_read_and_changes_nothing():
    """Flags past int32 (cut to the kernel's int, they stepped as other flags) and a GradScaler scale
    that is not one fp32 or float64 CPU value are refused before anything runs."""
    param, _, call, args = a_bound_call()
    before = param.detach().clone()
    handle, grads, numbers, tensors, slots, flags, options, clip, _ = call.arguments(*args)
    with pytest.raises(RuntimeError, match="are not a kernel's flag bits"):
        torch.ops.fastoptim.bound_step(handle, grads, numbers, tensors, slots, [flags[0] | 1 << 40], options, clip,
                                       None)
    for bad in (torch.ones(2), torch.ones((), dtype=torch.int64), torch.ones((), dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="amp_scale must be one fp32 or float64 CPU value"):
            torch.ops.fastoptim.bound_step(handle, grads, numbers, tensors, slots, flags, options, clip, bad)
    assert torch.equal(param, before)


def clip_kernel_answers():
    """What the clip kernels answer for grads they take (of three dtypes, one empty) and for grads
    they cannot take (float64, strided, overlapping, two views of one memory), and whether a refused
    call left the grads as they were."""
    grads = [torch.ones(10), torch.ones(6)]
    mixed = [torch.ones(70_000, dtype=torch.bfloat16), torch.ones(0), torch.ones(5, dtype=torch.float16)]
    answers = [cpu_backend.grad_norm_total(grads, False)[0], cpu_backend.grad_norm_total(mixed, True)[0]]
    memory = torch.ones(12)
    for other in (torch.ones(6, dtype=torch.float64), torch.ones(12)[::2], torch.ones(1).expand(6)):
        answers += [cpu_backend.grad_norm_total([grads[0], other], False)[0],
                    cpu_backend.scale_grads([grads[0], other], torch.tensor(2.0))]
    answers.append(cpu_backend.scale_grads([memory[:8], memory[4:]], torch.tensor(2.0)))  # overlap: threads race
    unchanged = all(torch.equal(g, torch.ones_like(g)) for g in (*grads, memory))
    return answers, unchanged


def test_the_clip_kernels_answer_for_grads_they_cannot_take():
    """In a fresh interpreter: a grad the kernels took that they cannot walk would be read out of bounds."""
    code = "import json, tests.test_native_layer as t; print(json.dumps(t.clip_kernel_answers()))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    taken, refused = cpu_backend.TAKEN, cpu_backend.NOT_TAKEN
    assert json.loads(result.stdout.splitlines()[-1]) == [[taken, taken] + [refused] * 7, True]


def test_the_norm_is_summed_chunk_by_chunk_in_the_grads_order():
    """The one order fastoptim sums a norm in: each 32k-element chunk's sum of squares in float64, the
    chunks added in the grads' order, whatever their dtypes (a bound step's native call sums so too);
    the largest magnitude is the largest, a NaN kept. Each chunk's partial is the kernel's total of
    that chunk alone (its lanes' order is the kernel's, which a vectorized build and the sanitizers'
    plain one order alike only to the last bits: torch's sum is the reference to 1e-12)."""
    torch.manual_seed(0)
    grads = [torch.randn(70_000), torch.randn(5).bfloat16(), torch.randn(0), torch.randn(40_000).half(),
             torch.randn(3)]
    by_chunks = reference = 0.0
    for grad in grads:
        for chunk in grad.split(1 << 15):
            by_chunks += cpu_backend.grad_norm_total([chunk], False)[1].item()
            reference += float(chunk.double().square().sum())
    status, ours = cpu_backend.grad_norm_total(grads, False)
    assert status == cpu_backend.TAKEN and ours.item() == by_chunks
    torch.testing.assert_close(ours, torch.tensor(reference, dtype=torch.float64), rtol=1e-12, atol=0)
    largest = max(float(g.abs().max()) for g in grads if g.numel())
    assert cpu_backend.grad_norm_total(grads, True)[1].item() == largest
    grads[3][7] = float("nan")
    assert cpu_backend.grad_norm_total(grads, True)[1].isnan() and cpu_backend.grad_norm_total(grads, False)[1].isnan()


def test_bind_refuses_chunks_outside_their_tensors_and_tables_of_no_kernel():
    chunks = torch.tensor([[0, 5, 6, 0]])
    with pytest.raises(RuntimeError, match="reaches outside its tensor"):
        torch.ops.fastoptim.bind("adan", [torch.ones(10)] * 5, [0, 2, 3, 4, 5], 1, 11, 16, chunks, None, [], [], [],
                                 "", [])
    with pytest.raises(RuntimeError, match="adan kernel reads 11 rows of pointers, not 10"):  # its remainders' too
        torch.ops.fastoptim.bind("adan", [torch.ones(10)] * 5, [0, 2, 3, 4, 5], 1, 10, 16, chunks, None, [], [], [],
                                 "", [])
    for name in ("", "adamx"):  # every table is a kernel's: one that runs nothing is bound with runs=False
        with pytest.raises(RuntimeError, match=f"no fused kernel named '{name}'"):
            torch.ops.fastoptim.bind(name, [torch.ones(10)] * 5, [0, 2, 3, 4, 5], 1, 11, 16,
                                     torch.tensor([[0, 0, 10, 0]]), None, [], [], [], "", [])
    for owner in (torch.ones(2, 10), torch.ones(20)[::2], torch.ones(0)):  # a flat buffer is contiguous 1-d
        with pytest.raises(RuntimeError, match="an owner must be a non-empty contiguous 1-d tensor"):
            torch.ops.fastoptim.bind("adan", [torch.ones(10)] * 5, [0, 2, 3, 4, 5], 1, 11, 16,
                                     torch.tensor([[0, 0, 10, 0]]), None, [owner], [], [], "", [])


@pytest.mark.parametrize("remainder, message", [
    (torch.zeros(10, dtype=torch.int32), "int8 or int16"),
    (torch.zeros(20, dtype=torch.int8)[::2], "walked as its bf16 param"),
    (torch.zeros(5, dtype=torch.int8), "walked as its bf16 param")])
def test_bind_refuses_master_remainders_the_kernel_cannot_walk(remainder, message):
    param = torch.ones(10, dtype=torch.bfloat16)
    states = [torch.zeros(10)] * 4
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fastoptim.bind("adan", [param, *states, remainder], [0, 2, 3, 4, 5, 10], 1, 11, 16,
                                 torch.tensor([[0, 0, 10, 0]]), None, [], [], [], "", [])


def test_a_library_that_cannot_be_loaded_leaves_the_fused_engine_to_foreach_with_a_warning(tmp_path):
    broken = tmp_path / "_C.abi3.so"
    broken.write_bytes(b"not a shared library")
    code = ("import warnings, torch\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import fastoptim\n"
            "    from fastoptim.engines.backends import cpu as cpu_backend\n"
            "    p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
            "    fastoptim.Adan([p], lr=0.1, fused=True).step()\n"
            "print(cpu_backend.AVAILABLE, sum('cannot be loaded' in str(w.message) for w in caught),"
            " sum('those tensors take the foreach engine' in str(w.message) for w in caught))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent, env=dict(os.environ, FASTOPTIM_NATIVE_LIBRARY=str(broken)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "1", "1"]


def test_an_install_without_the_library_warns_once_whatever_engine_is_asked_for(tmp_path):
    """As pip's isolated build installs it (no torch to compile against, so no library): the default
    engine takes foreach with one warning, not in silence, and ``fastoptim info`` says so."""
    shutil.copytree(Path(fastoptim.__file__).parent, tmp_path / "fastoptim", ignore=shutil.ignore_patterns("_C*"))
    code = ("import warnings, torch\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import fastoptim\n"
            "    for flags in ({}, dict(fused=True), dict(foreach=True)):\n"
            "        p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
            "        opt = fastoptim.AdamW([p], lr=0.1, **flags); opt.step(); opt.step()\n"
            "missing = [w for w in caught if 'no native library' in str(w.message)]\n"
            "print(len(missing), fastoptim.engines.backends.cpu.AVAILABLE, 'pip install --no-build-isolation' in\n"
            "      str(missing[0].message))\n"
            "from fastoptim import cli; cli.main(['info'])\n")
    env = {key: value for key, value in os.environ.items() if key != "FASTOPTIM_NATIVE_LIBRARY"}  # the sanitizers'
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=env | dict(PYTHONPATH=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    first, *info = result.stdout.splitlines()
    assert first.split() == ["1", "False", "True"]
    assert any(line.startswith("native library not loaded") for line in info), info


def test_the_library_reads_each_specs_rows():
    """A library built from other specs would read rows that a table lacks: each kernel's row count is
    the spec's (the remainders' row last), and a library whose bind takes no flat state buffers (older
    than the remainders' row and the buffers) is not loaded at all (cpu_backend._load)."""
    for spec in declared_specs():
        assert torch.ops.fastoptim.kernel_rows(spec.name) == len(spec.rows) and spec.rows[-1] == master.KEY
    assert torch.ops.fastoptim.kernel_rows("no such kernel") == -1


def _refuse_checked_steps(*args, **kwargs):
    raise AssertionError("the step checked its groups in Python: it did not take the bound path")


LEAN_SHAPES = [(64, 80), (4096,), (33, 128)]  # 8-bit states need 4096+ elements; sn partitions matrices


def _lean_run(cls, options, checked, monkeypatch, steps=4, scaled=False, change=None):
    """``cls`` over fresh params for ``steps`` steps: with ``checked``, each step the checked one (its
    bound step dropped first), else bound from the second on, where the checked path raises.
    ``scaled``: GradScaler's scale (4) and found_inf handed to step(), the grads scaled by it;
    ``change(opt, params)``: made before step 2."""
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(LEAN_SHAPES)]
    opt = cls(params, lr=1e-2, weight_decay=0.1, **options)
    for step in range(steps):
        for param in params:
            param.grad = grad_for(param, step) * (4.0 if scaled else 1.0)
        if scaled:
            opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
        if step == 2 and change is not None:
            with torch.no_grad():
                change(opt, params)
        _bound_or_checked_step(opt, step, checked, monkeypatch, refuse=change is None)
    return [p.detach().clone() for p in params]


def _bound_or_checked_step(opt, step, checked, monkeypatch, refuse=True):
    """Step ``step`` of a run: with ``checked`` the checked one (its bound step dropped first), else
    the bound one, the checked path made to raise (with ``refuse``) from the second step on."""
    if checked:
        opt._plans.bound = None
    with monkeypatch.context() as patch:
        if not checked and step >= 1 and refuse:
            patch.setattr(fastoptim.optimizers.base.FastOptimizer, "_group_work", _refuse_checked_steps)
        opt.step()


def _muon_run(options, engine, checked, monkeypatch, steps=4):
    """Muon over two matrices (its group) and a vector (an AdamW companion group), as ``_lean_run``:
    with ``checked``, every step the checked one, else bound from the second on, the checked path
    made to raise."""
    shapes, dtype, group = [(64, 80), (32, 128), (4096,)], options.pop("dtype", torch.float32), options.pop("group", {})
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype))
              for i, s in enumerate(shapes)]
    opt = fastoptim.Muon([{"params": params[:2], **group}, {"params": params[2:], "use_muon": False}], lr=0.02,
                         **ENGINES[engine], **options)
    for step in range(steps):
        for param in params:
            param.grad = grad_for(param, step)
        _bound_or_checked_step(opt, step, checked, monkeypatch)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("options", [{}, dict(state_bits=8), dict(maximize=True, nesterov=False),
                                     dict(dtype=torch.bfloat16, master_bits=24), dict(group=dict(num_heads=4))], ids=str)
@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
def test_fused_muon_steps_run_bound_as_the_checked_step_runs_them(options, engine, monkeypatch):
    """A fused Muon step takes the bound path (the checked one is made to raise): its momentum kernel's
    tables run in the step's one native call with its AdamW companions', then its iterations and update
    (muon_parts.BoundMomentum). Bit for bit a twin whose every step is checked, 8-bit momentum and bf16 params
    with master remainders included."""
    bound = _muon_run(dict(options), engine, False, monkeypatch)
    checked = _muon_run(dict(options), engine, True, monkeypatch)
    for ours, expected in zip(bound, checked):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("options, scaled", [
    (dict(sn=True), False), (dict(state_bits=8), False), (dict(sn=True, state_bits=8), False),
    (dict(max_grad_norm=0.5), False), (dict(max_grad_norm=0.5, maximize=True), False),
    (dict(max_grad_norm=0.5, sn=True), True)], ids=str)
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_lean_and_clipped_steps_run_bound_as_the_checked_step_runs_them(cls, options, scaled, monkeypatch):
    """Subset-norm second moments, 8-bit states and clipping take the bound path (the checked one is
    made to raise): a clipped step's native call computes the clip coefficient itself, from the sum of
    squares of all its grads in the order every path sums a norm. Bit for bit a twin whose every step
    is checked, with GradScaler's 1/scale in the norm and maximize's sign in the scale too."""
    bound = _lean_run(cls, options, False, monkeypatch, scaled=scaled)
    checked = _lean_run(cls, options, True, monkeypatch, scaled=scaled)
    for ours, expected in zip(bound, checked):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, dict(sn=True), dict(state_bits=8)], ids=str)
def test_a_checked_step_leaves_the_layouts_to_native_code_that_holds_its_tables(options, monkeypatch):
    """A checked step (each released bucket's, every step of an optimizer that reduces over ranks) whose
    work runs on tables that native code holds compares no param's or state's layout in Python: one native
    check of every tensor the tables hold stands for those compares (which were most of such a step's
    time), and for the grads' checks where it finds every grad fit. Where that check finds a tensor moved
    (a state given new storage in place), the step compares them in Python and takes the state where it now
    lives: bit for bit its bound twin's step."""
    from fastoptim import step_cache
    from fastoptim.optimizers import checks

    runs = []
    for checked in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in LEAN_SHAPES]
        opt = fastoptim.AdamW(params, lr=1e-2, **options)
        for step in range(4):
            for param in params:
                param.grad = grad_for(param, step)
            if step == 3:
                state = opt.state[params[1]]["exp_avg"]
                state.set_(state.clone())  # new storage, in place
            if checked:
                opt._plans.bound = None
            compared = []
            with monkeypatch.context() as patch:
                if checked and step == 2:  # the work and its tables are made: native code vouches for them
                    patch.setattr(step_cache.Signature, "describes", _refuse_python_layouts)
                    patch.setattr(step_cache.GroupWork, "_local_states", _refuse_python_layouts)
                    if not options.get("sn"):  # and for the grads (a subset-norm table takes its view's too)
                        patch.setattr(checks, "check_grads", _refuse_python_layouts)
                elif checked and step == 3:
                    real = step_cache.GroupWork._local_states
                    patch.setattr(step_cache.GroupWork, "_local_states",
                                  lambda work: compared.append(work) or real(work))
                opt.step()
            assert bool(compared) == (checked and step == 3)
        runs.append([p.detach().clone() for p in params] + [value.clone() for p in params
                                                             for value in opt.state[p].values() if torch.is_tensor(value)])
    for ours, expected in zip(*runs):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("write", ["count set_", "state of another shape"])
def test_a_grad_the_kernel_cannot_walk_does_not_hide_a_later_table_s_moved_tensor(write):
    """A checked step's native check of a group of two tables (fp32 and bf16 params) stopped at the first
    table's transposed grad (which foreach steps) and never looked at the second table's tensors, so a
    count given new storage there was stepped stale, and a state of another shape raised from inside the
    engine after the first table stepped (helper-72). Every table's tensors are checked: the step is a
    fresh optimizer's bit for bit, or refuses the state by name with nothing changed."""
    runs = []
    for fresh in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4).bfloat16())]
        opt = fastoptim.AdamW(params, lr=1e-2)
        for step in range(3):
            for param in params:
                param.grad = torch.randn(4, 4, dtype=param.dtype)
            if step == 2:
                params[0].grad = params[0].grad.t()
                if write == "count set_":
                    opt.state[params[1]]["step"].set_(torch.tensor(7.0))
                else:
                    opt.state[params[1]]["exp_avg"].set_(torch.zeros(2))
                opt._plans.bound = None
                if fresh:
                    opt._plans = type(opt._plans)()
            if step == 2 and write != "count set_":
                before = [param.detach().clone() for param in params]
                with pytest.raises(RuntimeError, match=r"state 'exp_avg' is torch.float32 \(2,\)"):
                    opt.step()
                assert all(map(torch.equal, before, params))
                return
            opt.step()
        runs.append([param.detach().clone() for param in params])
    assert all(map(torch.equal, *runs))


def _refuse_python_layouts(*args, **kwargs):
    raise AssertionError("the checked step compared layouts in Python that native code checks")


def _subset_norm_changes():
    def param_data(opt, params):
        params[0].data = params[0].detach() * 0.5
    def param_set(opt, params):
        params[2].set_(params[2].detach().flip(0).clone())
    def second_moment_set(opt, params):
        state = opt.state[params[0]]["exp_avg_sq"]
        state.set_(state.clone() * 2)
    def first_moment_data(opt, params):
        state = opt.state[params[0]]["exp_avg"]
        state.data = state.detach() * 2
    def count_set(opt, params):
        count = opt.state[params[0]].get("step")
        if count is not None:
            count.set_(torch.tensor(9.0))
    return [param_data, param_set, second_moment_set, first_moment_data, count_set]


@pytest.mark.parametrize("change", _subset_norm_changes(), ids=lambda change: change.__name__)
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_bound_subset_norm_step_follows_the_tensors_its_views_are_of(cls, change, monkeypatch):
    """The engines of a subset-norm step take (a, b, c) views of the params and states, which keep
    their storage when the user's tensor gets new storage (``.data =``, ``set_``), and the params'
    counts are slots of one tensor: native code holds and checks the user's tensors in place of the
    views, and watches the counts, so the step after such a change is the checked step's with the same
    change, bit for bit."""
    runs = [_lean_run(cls, dict(sn=True), checked, monkeypatch, change=change) for checked in (False, True)]
    for ours, expected in zip(*runs):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "checked"])
def test_a_grad_set_to_the_subset_norm_view_s_shape_is_refused_bound_as_checked(bound):
    """A subset-norm param's engines walk it as an (a, b, c) view, and native code takes a checked step's
    grads in that layout too. A user's grad given that shape in place (``set_``: assignment checks the
    shape) was stepped by the bound step and refused by the checked one: both refuse it now, and
    change nothing."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 8))
    opt = fastoptim.AdamWSN([param], lr=1e-2, sn=True, fused=True)
    param.grad = torch.randn(8, 8)
    for _ in range(2 if bound else 0):
        opt.step()
    assert (opt._plans.bound is not None) == bound
    param.grad.set_(torch.randn(8, 8).view(8, 8, 1))
    before = param.detach().clone()
    with pytest.raises(RuntimeError, match="a gradient must match its parameter"):
        opt.step()
    assert torch.equal(param, before)


@pytest.mark.parametrize("options", [dict(), dict(maximize=True), dict(max_grad_norm=0.5)],
                         ids=["plain", "maximize", "clipped"])
def test_a_bound_step_under_gradscaler_runs_no_torch_op_but_its_native_call(options):
    """GradScaler's scale and found_inf reach the bound step as tensors: its 1/scale (a float64
    reciprocal rounded to fp32, as torch's unscale has it), maximize's sign of it and the counts'
    increment were 0-d tensor ops in Python, five or six a step; native code computes them now, so
    the step's only op is its native call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(4)]
    opt = fastoptim.AdamW(params, lr=1e-3, fused=True, **options)
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(16)
        opt.step()
    assert opt._plans.bound is not None
    with Ops() as ops:
        opt.step()
    assert ops.names == ["fastoptim.bound_step.default"]


def test_a_muon_matrix_whose_state_keeps_a_subset_norm_record_steps_as_without_it():
    """A state dict can give Muon's matrices a subset-norm record (``reduce_dim``), so that its group
    plans their (a, b, c) views; its momentum kernel takes direction buffers as its params. Native code
    holds the user's tensors in place of views of them only: held in place of the directions, the bound
    steps wrote the directions into the params."""
    def run(record):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                  for i, s in enumerate([(64, 80), (32, 128)])]
        opt = fastoptim.Muon(params, lr=0.02, fused=True)
        for step in range(4):
            for param in params:
                param.grad = grad_for(param, step)
            opt.step()
            if step == 0:
                state = opt.state_dict()
                for values in state["state"].values():
                    values.update(dict(reduce_dim=1) if record else {})
                opt = fastoptim.Muon(params, lr=0.02, fused=True)
                opt.load_state_dict(state)
        return params + [opt.state[param]["momentum_buffer"] for param in params]

    for ours, expected in zip(run(True), run(False)):
        assert torch.equal(ours, expected)


def test_fp32_and_bf16_params_with_remainders_and_subset_norm_in_one_group_run_bound_as_checked(monkeypatch):
    """The fp32 params' bucket of a group with ``master_bits`` keeps no remainders, and its table binds
    none: the group's tensors that native code holds in place of the views did put that row back, and
    binding raised."""
    def run(checked):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype))
                  for i, (s, dtype) in enumerate([((64, 80), torch.float32), ((33, 128), torch.bfloat16),
                                                  ((48, 40), torch.float32)])]
        opt = fastoptim.AdamW(params, lr=1e-2, weight_decay=0.1, sn=True, master_bits=24, fused=True)
        for step in range(4):
            for param in params:
                param.grad = grad_for(param, step)
            _bound_or_checked_step(opt, step, checked, monkeypatch)
        return params + [value for param in params for _, value in sorted(opt.state[param].items())
                          if isinstance(value, torch.Tensor)]

    for ours, expected in zip(run(False), run(True)):
        assert torch.equal(ours, expected)


RULED = [fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.Adan, fastoptim.Lion]


@pytest.mark.parametrize("cls", RULED, ids=lambda cls: cls.__name__)
def test_each_native_rule_computes_the_kernel_scalars_of_its_algorithms_python(cls):
    """A bound CPU step's scalars come from native code (``Algorithm.rule``, native.cpp's Rule), which
    restates the algorithm's ``arguments`` and ``kernel_scalars``: the same float64 numbers, for
    options and counts drawn at random (and the extremes: no decay, β at 0, correct_bias off)."""
    algorithm = cls.algorithm
    name, keys = algorithm.rule
    rng = torch.Generator().manual_seed(0)
    spec = algorithm.spec
    for case in range(300):
        u = torch.rand(8, generator=rng, dtype=torch.float64).tolist()
        betas = (0.0 if case % 7 == 0 else u[0], u[1], u[2])[:algorithm.n_betas]
        group = dict(lr=u[3] * 0.1, betas=betas, eps=u[4] * 1e-6, weight_decay=0.0 if case % 5 == 0 else u[5],
                     no_prox=case % 2 == 0, correct_bias=case % 3 != 0, amsgrad=False)
        count = float(1 + int(u[6] * 1000) if case % 4 else 1)
        inputs = StepInputs(group["lr"], None, count, torch.float32, None, None)
        expected = algorithm.kernel_scalars(algorithm.arguments(group, inputs)[0])
        native = torch.ops.fastoptim.rule_scalars(name, [float(x) for x in rule_numbers(group, keys)], count,
                                                  len(spec.all_scalars))
        for index, scalar in enumerate(spec.all_scalars[3:], start=3):
            assert native[index] == float(expected[scalar]), (case, scalar, native[index], expected[scalar])


# (counts as step_scalars takes them, owners): a group's count; the params' equal and differing counts
# (one 1-d tensor, or 0-d ones), of the group and of a bucket of it; a float64 count; those native code
# leaves to Python (an int count, one below 0 or NaN, which Python answers for); and none (Lion's)
STEP_SCALARS_COUNTS = {
    "group count": ([torch.tensor(6.0)], []),
    "equal per-param": ([torch.full((5,), 3.0)], []),
    "equal 0-d per-param, a bucket": ([torch.tensor(3.0)] * 5, [1, 3]),
    "differing per-param": ([torch.tensor([0.0, 4.0, 4.0, 9.0, 1.0])], []),
    "differing 0-d per-param, a bucket": ([torch.tensor(t) for t in (0.0, 4.0, 4.0, 9.0, 1.0)], [4, 0, 3]),
    "float64 counts": ([torch.tensor([2.0, 5.0, 5.0, 5.0, 7.0], dtype=torch.float64)], []),
    "int counts": ([torch.tensor([2, 5, 5, 5, 7])], []),
    "a count below 0": ([torch.tensor([2.0, -0.5, 5.0, 5.0, 7.0])], []),
    "a NaN count": ([torch.tensor([2.0, float("nan"), 5.0, 5.0, 7.0])], []),
    "an inf count": ([torch.tensor([2.0, float("inf"), 5.0, 5.0, 7.0])], []),
    "an inf group count": ([torch.tensor(float("inf"))], []),
    "an int group count": ([torch.tensor(6)], []),
    "a group count at -1": ([torch.tensor(-1.0)], []),
}
NATIVELY = {"group count", "equal per-param", "equal 0-d per-param, a bucket", "differing per-param",
            "differing 0-d per-param, a bucket", "float64 counts", "an inf count", "an inf group count"}


@pytest.mark.parametrize("cls", RULED, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("case", STEP_SCALARS_COUNTS)
def test_a_traced_steps_scalars_computed_by_its_native_rule_are_its_pythons(cls, case, monkeypatch):
    """``fastoptim::step_scalars`` (a compiled CPU step's) has the algorithm's native rule compute the
    scalars where all of it is on the host as numbers: each output equal to the Python math's, 0-d
    or one per param alike, with GradScaler's found_inf, a clip's scale, maximize's sign and the
    params' first reads of their optional states (Adan's); where native code leaves it to Python (a
    count or first reads it does not read, a count that reaches below 1), Python's answer, error or
    NaN, stands."""
    from fastoptim.optimizers import scalars
    algorithm = cls.algorithm
    counts, owners = STEP_SCALARS_COUNTS[case]
    if algorithm.counts is None:
        counts = []
    elif (algorithm.counts == "group") != (len(counts) == 1 and counts[0].dim() == 0):
        pytest.skip("counts of another algorithm's kind")
    taken = []
    ruled = scalars._ruled

    def spy(*args):
        taken.append(ruled(*args))
        return taken[-1]

    group = dict(lr=3e-3, betas=(0.9, 0.99, 0.95)[:algorithm.n_betas], eps=1e-8, weight_decay=0.02, no_prox=True,
                 correct_bias=False, amsgrad=False, maximize=False, foreach=None, fused=None)
    prepared = scalars.traced_scalars(algorithm, group, group)
    cases = ((None, None, None), (torch.tensor(0.0), torch.tensor(0.25), None), (None, -1.0, None),
             (None, None, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])), (None, None, torch.ones(5, dtype=torch.float64)))
    for found_inf, grad_scale, first_reads in cases:
        def call():
            return torch.ops.fastoptim.step_scalars(
                prepared.name, prepared.options, prepared.numbers(group), None,
                grad_scale if isinstance(grad_scale, torch.Tensor) else None, counts, None, first_reads, [], None,
                found_inf,
                group["lr"], grad_scale if isinstance(grad_scale, float) else None, torch.float32, False,
                torch.device("cpu"), 5, owners)

        monkeypatch.setattr(scalars, "_ruled", spy)
        try:
            ours = call()
        except ZeroDivisionError:
            ours = ZeroDivisionError
        monkeypatch.setattr(scalars, "_ruled", lambda *args: None)
        try:
            expected = call()
        except ZeroDivisionError:
            expected = ZeroDivisionError
        natively = (case in NATIVELY or algorithm.counts is None) and (
            first_reads is None or first_reads.dtype == torch.float32 or cls is not fastoptim.Adan)
        assert (taken[-1] is not None) == natively, (case, first_reads)
        if expected is ZeroDivisionError:
            assert ours is ZeroDivisionError
            continue
        assert len(ours) == len(expected) == len(algorithm.spec.all_scalars)
        for name, mine, theirs in zip(algorithm.spec.all_scalars, ours, expected):
            assert mine.dtype == theirs.dtype == torch.float64 and mine.shape == theirs.shape, name
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=name)


def test_a_native_rule_refuses_options_it_does_not_take():
    with pytest.raises(RuntimeError, match="no rule adamw of 4 options"):
        torch.ops.fastoptim.rule_scalars("adamw", [0.1, 0.9, 0.99, 1e-8], 1.0, 11)
    with pytest.raises(RuntimeError, match="no rule sgd"):
        torch.ops.fastoptim.rule_scalars("sgd", [], 1.0, 11)
