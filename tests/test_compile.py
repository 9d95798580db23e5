"""torch.compile keeps the fused kernels: a traced step calls each kernel as a custom op
(``torch.ops.fastoptim.<spec>_step``, ``grad_norm_total``, ``scale_grads``), with no graph break,
and gives the eager step's params and states bit for bit. Most cases compile with the
``aot_eager`` backend, which functionalizes the graph as inductor does (so the ops' declared
mutations are exercised) at a fraction of the compile time; a few compile with inductor."""
import gc
import math
import re
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fastoptim
from fastoptim import engines
from fastoptim.clip import clip_backend
from fastoptim.optimizers import scalars
from fastoptim.step_cache import GRADS_PATTERNS_KEPT

from .registry import ADAMW, ADAN, OPTIMIZERS

pytestmark = pytest.mark.filterwarnings("ignore:.*script_method:DeprecationWarning")

# Every optimizer plain, and with its own options, 8-bit states, clipping, maximize and sn; then the
# single-tensor tier with bf16 states, and the foreach engine, traced as it is.
CASES = [case for info in OPTIMIZERS for case in ((info.cls, {}), (info.cls, info.variant()))] + [
    (fastoptim.Adan, dict(state_bits=16, foreach=False, fused=True)),
    (fastoptim.Adan, dict(foreach=True, fused=False)),
    # subset norms beside dense moments in one foreach op's lists (helper-79: they rounded apart traced)
    (fastoptim.AdamWSN, dict(sn=True, foreach=True, fused=False)),
]
INDUCTOR_CASES = [(ADAN.cls, ADAN.variant()), (ADAMW.cls, ADAMW.variant())]


def model_params(seed=0):
    torch.manual_seed(seed)
    shapes = [(3, 300), (40, 70), (70, 40), (5000,), (17,)]  # 8-bit states for the large ones only
    return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]


def set_grads(params, step):
    torch.manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn_like(param)


def with_a_float64_param(seed=0):
    """``model_params`` with the last one float64, which the fused kernels leave to foreach."""
    params = model_params(seed)
    return params[:-1] + [torch.nn.Parameter(params[-1].detach().double())]


def pair(cls, options, make_params=model_params):
    """Two optimizers over equal params, a tensor lr each (unless ``options`` give an lr)."""
    eager_params, traced_params = make_params(), make_params()
    return ((eager_params, cls(eager_params, **{"lr": torch.tensor(0.01)} | options)),
            (traced_params, cls(traced_params, **{"lr": torch.tensor(0.01)} | options)))


def assert_same(eager, traced, exact=True):
    """Params and states equal bit for bit, or (not ``exact``) to a few ulps."""
    def same(a, b):
        if exact:
            return torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        return True

    (eager_params, eager_opt), (traced_params, traced_opt) = eager, traced
    for a, b in zip(eager_params, traced_params):
        assert same(a, b)
    for a, b in zip(eager_params, traced_params):
        for key, value in eager_opt.state[a].items():
            other = traced_opt.state[b][key]  # a subset-norm record holds numbers beside the tensors
            assert same(value, other) if isinstance(value, torch.Tensor) else value == other, key


def run_pair(cls, options, backend="aot_eager", fullgraph=True, steps=4, make_params=model_params, before_step=None,
             closure=None):
    """The eager twin and the compiled one over ``steps`` steps, ``before_step(params, opt, step)`` run on
    each before each step, ``closure(twin, step)`` (None: none) handed to each step; returns both and the
    graphs made."""
    eager, traced = pair(cls, options, make_params)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(traced[1].step, backend=backend, fullgraph=fullgraph)
    for step in range(steps):
        for params, opt in (eager, traced):
            set_grads(params, step)
            if before_step:
                before_step(params, opt, step)
        if closure is None:
            eager[1].step()
            compiled()
        else:
            eager[1].step(closure(eager, step))
            compiled(closure(traced, step))
    return eager, traced, counters["stats"]["unique_graphs"]


def run_both(cls, options, backend, steps=5, before_step=None, fullgraph=True, make_params=model_params,
             exact=True):
    """:func:`run_pair` (``before_step(opt, step)``), the twins asserted the same; returns the graphs made."""
    eager, traced, graphs = run_pair(cls, options, backend, fullgraph, steps, make_params,
                                     before_step and (lambda params, opt, step: before_step(opt, step)))
    assert_same(eager, traced, exact)
    return graphs


@pytest.mark.parametrize("cls, options", CASES, ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_a_compiled_step_is_the_eager_step(cls, options):
    assert run_both(cls, options, "aot_eager") == 1  # one graph: nothing the step changes is guarded


@pytest.mark.parametrize("cls, options", INDUCTOR_CASES, ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_a_step_compiled_by_inductor_is_the_eager_step(cls, options):
    run_both(cls, options, "inductor")


def mixed_params(seed=0):
    """``model_params``, the first fp32 and the others bf16: one group of two buckets."""
    params = model_params(seed)
    return params[:1] + [torch.nn.Parameter(p.detach().bfloat16()) for p in params[1:]]


def test_stochastic_rounding_compiled_by_inductor_draws_the_eager_seeds():
    """Each bucket's rounding seed is drawn from torch's generator where the eager step draws it, by
    the scalars' op (inductor's own random numbers would round otherwise): a group of two buckets."""
    eager, traced = pair(fastoptim.Adan, dict(stochastic_rounding=True), mixed_params)
    torch._dynamo.reset()
    compiled = torch.compile(traced[1].step, backend="inductor", fullgraph=True)
    for step in range(3):
        for (params, _), run in ((eager, eager[1].step), (traced, compiled)):
            set_grads(params, step)
            torch.manual_seed(1000 + step)
            run()
    assert_same(eager, traced)


@pytest.mark.parametrize("cls, key, value", [(fastoptim.AdamW, "weight_decay", lambda step: 0.1 * step),
                                             (fastoptim.Adan, "eps", lambda step: 1e-8 * step),
                                             (fastoptim.AdamW, "betas", lambda step: (0.9 - 0.01 * step, 0.99))])
def test_an_option_that_changes_every_step_compiles_as_eager(cls, key, value):
    """A schedule of a float option: after its second change dynamo makes it an input of the graph,
    which the scalars' op must read on every call, not the value it was traced with."""
    def schedule(opt, step):
        if step >= 2:
            opt.param_groups[0][key] = value(step)

    run_both(cls, {}, "aot_eager", steps=6, before_step=schedule)


PYTHON_ENGINES = {"foreach": (dict(foreach=True, fused=False), model_params),
                  "loop": (dict(foreach=False, fused=False), model_params),
                  "fused beside a float64 param": ({}, with_a_float64_param)}  # which the kernels leave to foreach


@pytest.mark.parametrize("engine", PYTHON_ENGINES)
@pytest.mark.parametrize("cls, written", [
    (fastoptim.AdamW, dict(weight_decay=torch.tensor(0.1))), (fastoptim.Adan, dict(weight_decay=torch.tensor(0.02))),
    (fastoptim.Adan, dict(weight_decay=torch.tensor(0.02), no_prox=True)), (fastoptim.Lion, dict(weight_decay=torch.tensor(0.1))),
    (fastoptim.Adan, dict(betas=(torch.tensor(0.02), torch.tensor(0.08), torch.tensor(0.01))))],
    ids=["AdamW wd", "Adan wd", "Adan wd no_prox", "Lion wd", "Adan betas"])
def test_options_written_as_0d_tensors_compile_on_the_python_engines_as_eager(cls, written, engine):
    """Options that contract.md takes as 0-d tensors, written between steps, on the engines whose math runs in
    Python: the compiled step is the eager one, bit for bit. A tensor weight decay's truth test was a
    data-dependent branch (dynamo refused to trace), and Adan's ``sub_`` with a tensor β's alpha failed in
    its decomposition, which compares the alpha with 1 (helper-79). The loop engine's traced Tensor methods
    round apart from its eager ones by an ulp (docs/compile.md promises the foreach engine's and the fused
    ones' steps bit for bit), with options written as numbers too."""
    options, make_params = PYTHON_ENGINES[engine]

    def write(opt, step):
        if step == 1:
            opt.param_groups[0].update({key: value.clone() if isinstance(value, torch.Tensor) else
                                        tuple(map(torch.clone, value)) if isinstance(value, tuple) else value
                                        for key, value in written.items()})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float64 param's fallback
        run_both(cls, options, "aot_eager", before_step=write, make_params=make_params, exact=engine != "loop")


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_subset_norms_with_a_tensor_beta_compile_on_foreach_as_eager(cls):
    """A subset-norm second moment adds its squares with a tensor β's factor, which a traced add's alpha
    multiplied apart from the eager kernel's fused add (helper-81): it is multiplied apart in both now."""
    def write(opt, step):
        betas = opt.param_groups[0]["betas"]
        opt.param_groups[0]["betas"] = (*betas[:-1], torch.tensor(0.999 - 0.001 * step if len(betas) == 2 else
                                                                  0.01 * (step + 1)))

    run_both(cls, dict(sn=True, foreach=True, fused=False), "aot_eager", before_step=write)


def test_a_muon_weight_decay_written_as_a_0d_tensor_compiles_as_eager():
    """Muon's update too (its truth test of the weight decay: helper-79), on its default engine, which a
    traced step runs on foreach."""
    def matrices():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(shape)) for shape in ((24, 16), (16, 24), (20, 20))]

    run_both(fastoptim.Muon, {}, "aot_eager", make_params=matrices,
             before_step=lambda opt, step: step == 1 and opt.param_groups[0].update(weight_decay=torch.tensor(0.1)))


@pytest.mark.parametrize("where, value", [("groups", 1e-3), ("defaults", 1e-3), ("groups", np.float64(1e-3))],
                         ids=["groups", "defaults", "groups, numpy"])
def test_max_grad_norm_written_between_compiled_steps_clips_as_eagerly(where, value):
    """max_grad_norm written between steps into every group or into ``defaults``: the compiled step clips
    by it as the eager one does (it read the defaults alone, so a write into the groups was ignored; a
    numpy one the graph read from the defaults as a tensor, and branched on it: helper-49)."""
    def write(opt, step):
        if step == 2:
            for options in opt.param_groups if where == "groups" else [opt.defaults]:
                options["max_grad_norm"] = value

    run_both(fastoptim.AdamW, {"max_grad_norm": 1.0}, "aot_eager", steps=4, before_step=write)
    unwritten, _, _ = run_pair(fastoptim.AdamW, {"max_grad_norm": 1.0}, steps=4)
    written, _, _ = run_pair(fastoptim.AdamW, {"max_grad_norm": 1.0}, steps=4,
                             before_step=lambda params, opt, step: write(opt, step))
    assert not all(map(torch.equal, unwritten[0], written[0]))


GRAD_SCALER_ENGINES = {"fused": ({}, model_params),
                       "fused with a fallback": (dict(fused=True), with_a_float64_param),
                       "foreach": (dict(foreach=True, fused=False), model_params),
                       "loop": (dict(foreach=False, fused=False), model_params)}


@pytest.mark.parametrize("cls, engine", [(info.cls, engine) for info in OPTIMIZERS for engine in GRAD_SCALER_ENGINES
                                         if engine.startswith("fused") or info is ADAN])
def test_grad_scaler_steps_compile_and_a_skipped_step_leaves_no_trace(cls, engine):
    """As GradScaler hands them to step(): the scale and found_inf, inf on the first and the third
    step. The compiled step skips them on the device, with no host read, so the graph holds, on every
    engine (the fused kernels in the kernel, the others and the kernels' fallback in the graph); the
    skipped first step leaves zero states where eager leaves none, and the same trajectory, through a
    skipped step once states exist. Every optimizer on the fused engine and its fallback (foreach's
    traced skip, over each algorithm's math); the foreach and loop engines, which skip alike for every
    algorithm, with Adan."""
    options, make_params = GRAD_SCALER_ENGINES[engine]
    def scaler(opt, step):
        opt.grad_scale = torch.tensor(256.0)
        opt.found_inf = torch.tensor(float(step in (0, 2)))
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad.mul_(256.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastoptim: fused=True")
        # the loop engine, traced, rounds an ulp or two apart from eager (see docs/compile.md)
        assert run_both(cls, dict(max_grad_norm=1.0, **options), "aot_eager", before_step=scaler,
                        make_params=make_params, exact=engine != "loop") == 1


def graph_targets(cls, options, step):
    """The op targets of the graphs that ``step(opt)`` compiles to, in two calls."""
    targets = []

    def record(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    params = model_params()
    opt = cls(params, lr=torch.tensor(0.01), **options)
    torch._dynamo.reset()
    compiled = torch.compile(lambda: step(opt, params), backend=record, fullgraph=True)
    for i in range(2):
        set_grads(params, i)
        compiled()
    return [getattr(t, "__name__", str(t)) for t in targets]


# An algorithm without a kernel of its own traces on foreach (Muon's groups; tests/test_muon.py compiles them)
@pytest.mark.parametrize("cls, op", [(info.cls, f"{info.cls.algorithm.spec.name}_step") for info in OPTIMIZERS
                                     if info.cls.algorithm.kernel_scalars is not None])
def test_the_compiled_graph_calls_the_kernel_op_and_no_foreach_op(cls, op):
    targets = graph_targets(cls, dict(state_bits=8, max_grad_norm=1.0), lambda opt, params: opt.step())
    assert op in str(targets), targets
    # per-param step counts are views of one tensor (multi_tensor.FlatStates), advanced by one add_
    assert_clip_ops(targets, {"grad_norm_total"})


def functional_targets(opt, params, steps=2, step=None):
    """The op names of the graphs, functionalized as inductor receives them, that ``opt.step`` (or
    ``step``) compiles to in ``steps`` calls (a mutating op by its own name, not its functional
    wrapper's)."""
    targets = []

    def record(graph_module, example_inputs):
        targets.extend(str(node.args[0] if "auto_functionalized" in str(node.target) else node.target)
                       for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(step or opt.step, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    for i in range(steps):
        set_grads(params, i)
        compiled()
    return targets


def assert_no_arithmetic(targets, op, also=()):
    """``targets`` call the kernel ``op`` and the scalars op (and the ops ``also``), and nothing else
    but fastoptim's other scalar ops, views and getitem."""
    allowed = {op, "fastoptim.step_scalars.default", "fastoptim.count_up.default", "fastoptim.mark_read.default",
               "<built-in function getitem>", "aten.view.default", *also}
    assert all(name in targets for name in (op, "fastoptim.step_scalars.default", *also)), targets
    assert set(targets) <= allowed, set(targets) - allowed


# Inductor would write any arithmetic left in the graph as a C++ kernel and compile it: seconds
@pytest.mark.parametrize("cls, options", [(info.cls, options) for info in OPTIMIZERS
                                          if info.cls.algorithm.kernel_scalars is not None
                                          for options in ({}, dict(maximize=True, weight_decay=0.1),
                                                          dict(state_bits=8, stochastic_rounding=True))])
def test_a_fused_cpu_step_compiles_to_ops_and_no_arithmetic(cls, options):
    params = model_params()
    targets = functional_targets(cls(params, lr=torch.tensor(0.01), **options), params)
    assert_no_arithmetic(targets, f"fastoptim.{cls.algorithm.spec.name}_step.default")


@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan], ids=lambda cls: cls.__name__)
def test_a_fused_cpu_step_under_an_lr_scheduler_compiles_to_ops_and_no_arithmetic(cls):
    """A scheduler's ``initial_lr``, a tensor beside a tensor lr, is none of the algorithm's options: the
    scalars still come from the op (a tensor in any option sent them to tensor arithmetic: helper-41)."""
    params = model_params()
    opt = cls(params, lr=torch.tensor(0.01))
    step = opt.step  # compiled as it was before the scheduler wrapped it (docs/compile.md)
    torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    assert isinstance(opt.param_groups[0]["initial_lr"], torch.Tensor)
    assert_no_arithmetic(functional_targets(opt, params, step=step), f"fastoptim.{cls.algorithm.spec.name}_step.default")


# both, with every optimizer; each alone (the factors' other branches), with AdamW
@pytest.mark.parametrize("cls, clip, amp", [(info.cls, True, True) for info in OPTIMIZERS
                                            if info.cls.algorithm.kernel_scalars is not None]
                         + [(fastoptim.AdamW, True, False), (fastoptim.AdamW, False, True)])
def test_a_clipped_or_scaled_fused_cpu_step_compiles_to_ops_and_no_arithmetic(cls, clip, amp):
    """The clip coefficient and GradScaler's factors (1/scale, the skip's count increment, −1 to
    maximize) come from fastoptim::step_factors, not from arithmetic in the graph."""
    params = model_params()
    opt = cls([{"params": params[:2], "maximize": True}, {"params": params[2:]}], lr=torch.tensor(0.01),
              max_grad_norm=1.0 if clip else 0.0)
    if amp:
        opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor(0.0)
    also = {"fastoptim.step_factors.default"} | ({"fastoptim.grad_norm_total.default"} if clip else set())
    assert_no_arithmetic(functional_targets(opt, params), f"fastoptim.{cls.algorithm.spec.name}_step.default", also)


def test_groups_of_two_buckets_without_grads_or_with_loaded_counts_compile_to_ops_and_no_arithmetic():
    """Per-param scalars made per bucket; a count advanced without grads; per-param counts that a
    state dict loaded as tensors of their own, which the step does not pack while it is traced."""
    params = mixed_params()
    assert_no_arithmetic(functional_targets(fastoptim.AdamW(params, lr=torch.tensor(0.01)), params),
                         "fastoptim.adamw_step.default")
    params, frozen = model_params(), [torch.nn.Parameter(torch.randn(3))]
    opt = fastoptim.Adan([{"params": params}, {"params": frozen}], lr=torch.tensor(0.01))
    assert_no_arithmetic(functional_targets(opt, params), "fastoptim.adan_step.default")
    params = model_params()
    opt = fastoptim.AdamW(params, lr=torch.tensor(0.01))
    set_grads(params, 0)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert_no_arithmetic(functional_targets(opt, params), "fastoptim.adamw_step.default")


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_and_a_step_compile_to_ops_and_no_arithmetic(norm_type):
    """The norm and the factor from the clip kernel's total come from fastoptim::clip_factor."""
    params = model_params()
    opt = fastoptim.Adan(params, lr=torch.tensor(0.01))

    def step():
        fastoptim.clip_grad_norm_(params, 0.5, norm_type)
        opt.step()
    targets = functional_targets(opt, params, step=step)
    assert_no_arithmetic(targets, "fastoptim.adan_step.default", {
        "fastoptim.grad_norm_total.default", "fastoptim.clip_factor.default", "fastoptim.scale_grads.default"})


def test_clip_grad_norm_compiles_to_its_ops():
    def step(opt, params):
        fastoptim.clip_grad_norm_(params, 0.5)
        opt.step()
    assert_clip_ops(graph_targets(fastoptim.Adan, {}, step), {"grad_norm_total", "scale_grads"})


def assert_clip_ops(targets, ops):
    """The clip's ``ops`` are in ``targets`` and no foreach op, where the device has a clip kernel
    (the CPU); elsewhere (CUDA: no Triton clip kernel) none of ``ops``, and no foreach op but the
    clip's own (torch's norm and scaling)."""
    names = [str(target) for target in targets]
    foreach = {name for name in names if "_foreach_" in name}
    if clip_backend([p.detach() for p in model_params()]):
        assert all(any(op in name for name in names) for op in ops) and not foreach, targets
    else:
        assert not any(op in name for op in ops for name in names), targets
        assert foreach <= {"_foreach_norm", "_foreach_mul_"}, targets


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_compiled_is_eager(norm_type):
    results = []
    for clip in (fastoptim.clip_grad_norm_, torch.compile(fastoptim.clip_grad_norm_, backend="aot_eager",
                                                          fullgraph=True)):
        params = model_params()
        set_grads(params, 0)
        results.append((clip(params, 0.5, norm_type), [p.grad for p in params]))
    (eager_norm, eager_grads), (norm, grads) = results
    assert torch.equal(norm, eager_norm) and all(map(torch.equal, grads, eager_grads))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the wrapper it counts with
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_no_recompile_after_the_step_that_creates_the_states_nor_on_scheduler_lr_changes(cls):
    """The first call traces the step (its states are created at tracing, by ``_init_group``); a
    tensor lr that a scheduler changes in place, and new grads, recompile nothing."""
    params = model_params()
    opt = cls(params, lr=torch.tensor(0.01), state_bits=8)
    torch._dynamo.reset()
    counters.clear()
    # compiled before the scheduler wraps opt.step in a counter that dynamo does not trace
    compiled = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    for step in range(6):
        set_grads(params, step)
        with torch._dynamo.config.patch(error_on_recompile=step >= 1):
            compiled()
        scheduler.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.01 * 0.9**6)


def test_param_groups_of_their_own_options_and_one_without_grads_compile_as_eager():
    """Three groups (sn, 8-bit, fp32), the last without grads from the fourth step: one compiled
    step prepares them all (dynamo reads the state dict once, after _init_group)."""
    def make(params):
        return fastoptim.Adan([{"params": params[:2], "sn": True}, {"params": params[2:4], "state_bits": 8},
                               {"params": params[4:]}], lr=torch.tensor(0.01), max_grad_norm=1.0)
    (eager_params, traced_params) = model_params(), model_params()
    eager, traced = (eager_params, make(eager_params)), (traced_params, make(traced_params))
    torch._dynamo.reset()
    compiled = torch.compile(traced[1].step, backend="aot_eager", fullgraph=True)
    for step in range(5):
        for params in (eager_params, traced_params):
            set_grads(params, step)
            if step >= 3:
                params[4].grad = None
        eager[1].step()
        compiled()
    assert_same(eager, traced)
    assert [float(group["step"]) for group in traced[1].param_groups] == [5.0] * 3


def test_a_sparse_grad_in_a_compiled_step_raises_the_eager_error_and_changes_nothing():
    """The checks run in _init_group, eagerly at tracing: a sparse grad is refused with the eager
    step's message (inside dynamo's error), before any param or state changes."""
    params = model_params()
    opt = fastoptim.Adan(params, lr=torch.tensor(0.01))
    set_grads(params, 0)
    params[1].grad = params[1].grad.to_sparse()
    before = [p.detach().clone() for p in params]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="does not support sparse gradients"):
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert all(torch.equal(a, b) for a, b in zip(params, before)) and not any(opt.state.values())


def test_a_grad_that_is_its_param_s_memory_in_a_compiled_fused_step_is_refused_by_the_op_with_nothing_changed():
    """The compiled graph's op checks its grads as the eager step does (helper-65: its fused kernel refused
    the tables without saying why). (A compiled foreach step's ops are torch's: they take it.)"""
    params = model_params()
    opt = fastoptim.AdamW(params, lr=1e-2, fused=True)
    torch._dynamo.reset()
    compiled = torch.compile(opt.step)  # inductor hands the op the grads themselves (aot_eager, copies)
    for step in range(2):
        set_grads(params, step)
        compiled()
    params[1].grad = params[1].detach()
    before = [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(ValueError, match=r"grad\[\d+\] is its param's own memory"):
        compiled()
    assert all(map(torch.equal, params, before[0]))
    assert all(torch.equal(opt.state[p][k], v) for p, state in zip(params, before[1]) for k, v in state.items())


def test_adan_loaded_without_a_step_count_compiles_to_one_graph():
    """Official Adan saves no 'step' before its first step: the load makes it, so that the
    compiled step finds it rather than creating it (which would trace a second graph)."""
    params = model_params()
    opt = fastoptim.Adan(params, lr=torch.tensor(0.01))
    saved = opt.state_dict()
    del saved["param_groups"][0]["step"]
    opt.load_state_dict(saved)
    assert float(opt.param_groups[0]["step"]) == 0
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    for step in range(3):
        set_grads(params, step)
        compiled()
    assert counters["stats"]["unique_graphs"] == 1 and float(opt.param_groups[0]["step"]) == 3


@pytest.mark.parametrize("compiled_autograd", [False, True])
def test_a_compiled_training_step_keeps_the_kernel_and_fastoptim_adds_no_graph_break(compiled_autograd):
    """Forward, backward, clip_grad_norm_ and the step in one compiled function, with or without
    compiled autograd (the backward and torch's zero_grad break the graph: those breaks are torch's,
    not ours), against the same steps in eager."""
    models = [torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.GELU(), torch.nn.Linear(64, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [fastoptim.Adan(m.parameters(), lr=torch.tensor(0.01), weight_decay=0.02) for m in models]
    calls = []
    op = torch.ops.fastoptim.adan_step.default

    def train_step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        fastoptim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    def record(graph_module, example_inputs):
        calls.extend(node.target for node in graph_module.graph.nodes if node.target is op)
        return graph_module.forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(train_step, backend=record)
    with torch._dynamo.config.patch(compiled_autograd=compiled_autograd):
        for step in range(3):
            torch.manual_seed(step)  # the default generator: tests may run on a default device (conftest)
            x = torch.randn(8, 20)
            assert torch.equal(train_step(models[0], opts[0], x), compiled(models[1], opts[1], x))
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert calls
    ours = [reason for reason in counters["graph_break"] if "fastoptim" in reason]
    assert not ours, ours


def matrix_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in ((40, 70), (64, 32))]


def compiled_twins(options, make_params, backend):
    """AdamW twins over ``make_params()`` (see :func:`pair`), the state that a test writes (the second
    moment under ``sn``, which the op takes a view of, else the first), and the second's step compiled."""
    eager, traced = pair(fastoptim.AdamW, options, make_params)
    torch._dynamo.reset()
    return (eager, traced, "exp_avg_sq" if options.get("sn") else "exp_avg",
            torch.compile(traced[1].step, backend=backend, fullgraph=True))


@pytest.mark.parametrize("backend, options, index", [("inductor", {}, 1), ("inductor", dict(sn=True), 1),
                                                     ("aot_eager", {}, 0), ("aot_eager", dict(sn=True), 1)])
def test_a_state_moved_to_new_storage_is_seen_by_the_compiled_step_or_refused(backend, options, index):
    """A state given new storage in place (as share_memory_() does) is written where it now lives by
    inductor's graph, which hands the op the tensors themselves, also where the op takes a view of
    it (a subset-norm second moment); a backend that hands the op copies (aot_eager) refuses the
    step. The first state of a buffer (``index`` 0) moves to a new storage at the same offset."""
    eager, traced, key, compiled = compiled_twins(options, matrix_params, backend)
    for step in range(4):
        for params, opt in (eager, traced):
            set_grads(params, step)
            if step == 2:
                state = opt.state[params[index]][key]
                state.set_(state.clone())
        eager[1].step()
        if step == 2 and backend == "aot_eager":
            with pytest.raises(RuntimeError, match="given new storage or a new layout in place"):
                compiled()
            return
        compiled()
    assert_same(eager, traced)


def square_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 4))]


LAYOUT_WRITES = {  # a state's layout changed in place, its storage kept
    "t_": lambda state: state.t_(),
    "as_strided_": lambda state: state.as_strided_(state.shape[::-1], state.stride()[::-1]),
    "unsqueeze_": lambda state: state.unsqueeze_(0),
    "resize_": lambda state: state.resize_(2, state.shape[-1]),
}


def snapshot(params, opt):
    """Copies of ``params`` and of their state tensors."""
    return ([p.clone() for p in params],
            [{key: value.clone() for key, value in opt.state[p].items() if torch.is_tensor(value)} for p in params])


@pytest.mark.parametrize("backend, options, write", [
    ("aot_eager", {}, "t_"), ("aot_eager", {}, "as_strided_"), ("aot_eager", {}, "unsqueeze_"),
    ("aot_eager", dict(sn=True), "t_"), ("aot_eager", dict(sn=True), "resize_"),
    ("inductor", {}, "t_"), ("inductor", dict(sn=True), "t_"), ("inductor", dict(sn=True), "resize_")])
def test_a_state_given_a_new_layout_in_place_is_followed_or_refused_by_the_compiled_step(backend, options, write):
    """A state whose sizes or strides change in place between compiled steps (its storage kept: t_,
    as_strided_, unsqueeze_, resize_) is not walked as the layout the step was compiled with: the
    compiled step steps as the eager one does (traced again), or refuses and changes nothing, whether
    the graph hands the op the state or a copy, and where the op takes a view of it (a subset-norm
    second moment). It once went on writing the old layout (t_, as_strided_) or took a state of
    another shape."""
    eager, traced, key, compiled = compiled_twins(options, square_params, backend)
    for step in range(3):
        for params, opt in (eager, traced):
            set_grads(params, step)
            if step == 2:
                LAYOUT_WRITES[write](opt.state[params[0]][key])
        if step < 2:
            eager[1].step()
            compiled()
    before = snapshot(*traced)
    try:
        compiled()
    except (RuntimeError, ValueError) as error:
        assert re.search("new layout|state '.*' is|cannot take", str(error)), error
        for param, param_before, states_before in zip(traced[0], *before):
            assert torch.equal(param, param_before)
            for name, value in states_before.items():
                assert torch.equal(traced[1].state[param][name], value), name
    else:
        eager[1].step()
        assert_same(eager, traced)


def assert_unchanged(params, opt, before):
    """``params`` and their states as :func:`snapshot` took them."""
    for param, param_before, states_before in zip(params, *before):
        assert torch.equal(param, param_before)
        for name, value in states_before.items():
            assert torch.equal(opt.state[param][name], value), name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_later_buckets_state_given_a_new_layout_is_refused_before_any_op_runs(backend):
    """A state of a later bucket's param (bf16 beside fp32) given a new layout in place is refused by
    the step's first op, which checks the other ops' tables before it runs (or, where the change
    makes dynamo trace again, by the checks of the states): nothing changed, counts included. The
    first bucket's op once ran before the second refused."""
    _, traced, key, compiled = compiled_twins({}, mixed_params, backend)
    for step in range(2):
        set_grads(traced[0], step)
        compiled()
    traced[1].state[traced[0][1]][key].t_()
    set_grads(traced[0], 2)
    before = snapshot(*traced)
    with pytest.raises(RuntimeError, match="new layout in place|state 'exp_avg' is"):
        compiled()
    assert_unchanged(*traced, before)


COUNT_WRITES = {".data =": lambda count, new: setattr(count, "data", new),
                "set_": lambda count, new: count.set_(new)}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("write, make_params", [(".data =", model_params), ("set_", mixed_params)],
                         ids=[".data =, one bucket", "set_, its second bucket"])
def test_a_count_given_new_storage_in_place_is_refused_by_the_compiled_step_then_assigned_steps(
        backend, write, make_params):
    """A per-param count given storage of its own in place (``.data =``, ``set_``) between compiled
    steps, which the graph would go on reading and advancing where it was (the count the user sees
    then stood still), is refused, changing nothing, also where it is a later bucket's (the first
    bucket's op checks the others' tables before it runs); assigned in the state dict instead, it is
    the count the step reads (traced again), as eagerly."""
    eager, traced, _, compiled = compiled_twins(dict(lr=0.01), make_params, backend)
    for step in range(4):
        for params, opt in (eager, traced):
            set_grads(params, step)
        if step == 2:
            COUNT_WRITES[write](traced[1].state[traced[0][1]]["step"], torch.tensor(40.0))
            before = snapshot(*traced)
            with pytest.raises(RuntimeError, match="a step count was given new storage in place"):
                compiled()
            assert_unchanged(*traced, before)
            for params, opt in (eager, traced):
                opt.state[params[1]]["step"] = torch.tensor(40.0)
        eager[1].step()
        compiled()
    assert_same(eager, traced)


@pytest.mark.parametrize("cls", [info.cls for info in OPTIMIZERS if info.cls.algorithm.kernel_scalars is not None])
def test_a_param_whose_grad_comes_and_goes_compiles_two_graphs(cls):
    """Each grads pattern is traced once: tracing one must not change the state dicts that the
    other's graph guards (per-param step counts are left as they are, not packed again)."""
    eager, traced = pair(cls, {})
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(traced[1].step, backend="aot_eager", fullgraph=True)
    for step in range(8):
        for params, _ in (eager, traced):
            set_grads(params, step)
            if step % 2:
                params[4].grad = None
        eager[1].step()
        compiled()
    assert_same(eager, traced)
    assert counters["stats"]["unique_graphs"] == 2


def test_more_param_groups_than_the_grads_patterns_kept_compile_as_eager():
    """The step cache keeps up to GRADS_PATTERNS_KEPT patterns per group, not in all: a step of more
    groups than that once emptied it while its own groups were being prepared."""
    def groups(params):
        return [{"params": params[i:i + 1]} for i in range(len(params))]
    eager_params, traced_params = [[torch.nn.Parameter(torch.randn(8)) for _ in range(GRADS_PATTERNS_KEPT + 1)]
                                   for _ in range(2)]
    for a, b in zip(eager_params, traced_params):
        b.data.copy_(a)
    eager = eager_params, fastoptim.AdamW(groups(eager_params), lr=torch.tensor(0.01))
    traced = traced_params, fastoptim.AdamW(groups(traced_params), lr=torch.tensor(0.01))
    torch._dynamo.reset()
    run = torch.compile(traced[1].step, backend="aot_eager", fullgraph=True)
    for step in range(3):
        set_grads(eager_params, step)
        set_grads(traced_params, step)
        eager[1].step()
        run()
    assert_same(eager, traced)


def test_a_state_dict_two_optimizers_hold_is_watched_for_both():
    """A param's state dict stored in a second optimizer's ``state`` (the same dict, as torch keeps
    it): a state assigned in it after that still retraces the first optimizer's compiled step."""
    eager, traced = pair(fastoptim.AdamW, {})
    torch._dynamo.reset()
    compiled = torch.compile(traced[1].step, backend="aot_eager", fullgraph=True)
    other = fastoptim.AdamW(traced[0], lr=0.01)
    for step in range(4):
        for params, opt in (eager, traced):
            set_grads(params, step)
            if step == 2:
                if opt is traced[1]:
                    other.state[params[1]] = opt.state[params[1]]
                opt.state[params[1]]["exp_avg"] = torch.full_like(opt.state[params[1]]["exp_avg"], 0.5)
        eager[1].step()
        compiled()
    assert_same(eager, traced)


def test_a_compiled_optimizer_frees_the_states_it_replaced_and_its_own_when_dropped():
    """The op's prepared calls go with the optimizer's step cache: a state dict loaded after
    compiling frees the states it replaced, and a dropped optimizer frees its states."""
    params = [torch.nn.Parameter(torch.randn(100, 10))]
    opt = fastoptim.AdamW(params, lr=torch.tensor(0.01))
    torch._dynamo.reset()
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    params[0].grad = torch.randn_like(params[0])
    step()
    replaced = weakref.ref(opt.state[params[0]]["exp_avg"])
    opt.load_state_dict(opt.state_dict())
    step()
    step()
    gc.collect()
    assert replaced() is None
    kept = weakref.ref(opt.state[params[0]]["exp_avg"])
    del opt, step
    torch._dynamo.reset()
    gc.collect()
    assert kept() is None


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_the_compiled_step_reads_states_and_grads_where_the_user_sees_them(cls):
    """A state replaced in the state dict, and a param whose grad goes and comes back, are what the
    compiled step uses (dynamo retraces where its guards say), as the eager step does."""
    def edit(opt, step):
        params = opt.param_groups[0]["params"]
        if step == 1:
            params[4].grad = None
        if step == 3:  # no grad changes here, which would retrace anyway
            opt.state[params[1]]["exp_avg"] = opt.state[params[1]]["exp_avg"].clone()
    run_both(cls, {}, "aot_eager", before_step=edit)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.Adan, fastoptim.Lion],
                         ids=lambda cls: cls.__name__)
def test_a_number_lr_compiled_step_is_the_eager_step_with_counts_set_by_hand(cls, backend, monkeypatch):
    """With a number lr, a compiled CPU step's scalars come from the algorithm's native rule (asserted
    taken), bit for bit the eager step's, counts included, after the user's writes: one count tensor
    set for every param (which each param then counts on its own, as eagerly: advanced once per param,
    it counted their steps together), a count written in place, a param whose grad goes and comes
    back (its count then behind the others'), weight decay and β changed."""
    if backend == "inductor" and cls not in (fastoptim.AdamW, fastoptim.Adan):
        pytest.skip("inductor for one count of each kind")
    ruled, taken = scalars._ruled, []
    monkeypatch.setattr(scalars, "_ruled", lambda *args: taken.append(ruled(*args)) or taken[-1])

    def edit(opt, step):
        group = opt.param_groups[0]
        params, counts = group["params"], [opt.state[param].get("step") for param in group["params"]]
        if step == 1 and "step" in group:
            group["step"].fill_(7.0)
        elif step == 1 and counts[0] is not None:
            shared = torch.tensor(10.0)
            for param in params:
                opt.state[param]["step"] = shared
        if step == 2:
            params[2].grad = None
        if step == 3:
            (group["step"] if "step" in group else counts[0] if counts[0] is not None else torch.zeros(())).fill_(30.0)
            group["weight_decay"] = 0.05
            group["betas"] = (0.8, *group["betas"][1:])

    options = dict(lr=0.01, weight_decay=0.02) | (dict(correct_bias=False) if cls is fastoptim.AdamWSN else {})
    eager, traced, _ = run_pair(cls, options, backend, steps=6, make_params=mixed_params,
                                before_step=lambda params, opt, step: edit(opt, step))
    assert_same(eager, traced)
    assert taken and all(values is not None for values in taken)


def test_numpy_options_compile_as_eager():
    """Options set to numpy scalars (a bool, numbers of numpy's own types, betas of them) between
    compiled steps step as their Python values: dynamo would hand the scalars' op numpy numbers,
    which it cannot take."""
    def edit(opt, step):
        group = opt.param_groups[0]
        if step == 1:
            group.update(no_prox=np.True_, weight_decay=np.float32(0.05), betas=(np.float32(0.9), *group["betas"][1:]))
        if step == 3:
            group.update(weight_decay=np.int64(0), eps=np.float64(1e-6), betas=np.array([0.9, 0.92, 0.99]))
    run_both(fastoptim.Adan, dict(lr=0.01, weight_decay=0.02), "aot_eager", steps=5, before_step=edit)
    params = model_params()
    opt = fastoptim.AdamW(params, lr=0.01)
    betas = opt.param_groups[0]["betas"] = [np.float32(0.9), np.float32(0.999)]  # a list the user edits: kept
    set_grads(params, 0)
    torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert opt.param_groups[0]["betas"] is betas and betas == [float(np.float32(0.9)), float(np.float32(0.999))]


def test_a_count_shared_across_groups_compiles_as_eager():
    """One count tensor set for params of two groups is each param's own in a compiled step, as in an
    eager one (advanced once per group, it counted their steps together)."""
    def make():
        params = model_params()
        return params, fastoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.01)

    eager, traced = make(), make()
    torch._dynamo.reset()
    compiled = torch.compile(traced[1].step, backend="aot_eager", fullgraph=True)
    for step in range(4):
        for params, opt in (eager, traced):
            set_grads(params, step)
            if step == 1:
                shared = torch.tensor(5.0)
                for param in params:
                    opt.state[param]["step"] = shared
        eager[1].step()
        compiled()
    assert_same(eager, traced)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("schedule", [[((0, 1), True), ((0,), False), ((0, 1), False)],
                                      [((0,), True), ((0, 1), False), ((0,), False), ((0, 1), False)]],
                         ids=["both skipped, then one", "one skipped, then both"])
def test_adans_first_reads_are_one_per_param_across_the_graphs_of_its_grads_patterns(backend, schedule):
    """Adan's g - g_prev weighs 0 at a param's first counted step: a compiled step whose first call
    GradScaler skipped made the states, and a graph of another pattern of grads (a param without a
    grad) counted some params' first step; every graph reads and marks one tensor of the group's
    first-read marks. The first graph once kept its own marks at 0, weighing g - g_prev 0 again."""
    def run(compiled):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))]
        opt = fastoptim.Adan(params, lr=1e-2)
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend=backend, fullgraph=True) if compiled else opt.step
        for index, (with_grad, skipped) in enumerate(schedule):
            torch.manual_seed(100 + index)
            for i, param in enumerate(params):
                param.grad = torch.randn(4) * 256 if i in with_grad else None
            opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor(float(skipped))
            step()
        return params + [opt.state[param][key] for param in params for key in ("exp_avg_sq", "neg_pre_grad")]

    for ours, expected in zip(run(True), run(False)):
        assert torch.equal(ours, expected)


# Schedules of Adan steps: (compiled, skipped by GradScaler, the params with grads, a change made before it)
FIRST_READ_SCHEDULES = {
    "compiled, eager, compiled": [(True, True, (0, 1), None), (False, False, (0, 1), None),
                                  (True, False, (0, 1), None), (True, False, (0, 1), None)],
    "compiled, eager skipped, eager bound, compiled": [
        (True, True, (0, 1), None), (False, True, (0, 1), None), (False, False, (0, 1), None),
        (False, False, (0, 1), None), (True, False, (0, 1), None)],
    "eager of another pattern of grads": [
        (False, False, (0,), None), (True, True, (0, 1), None), (False, False, (1,), None),
        (True, False, (0, 1), None), (False, False, (0, 1), None)],
    "eager after a state is cleared": [
        (False, False, (0,), None), (True, True, (0, 1), None), (False, False, (0, 1), "clear"),
        (True, False, (0, 1), None), (False, False, (0, 1), None)],
}


@pytest.mark.parametrize("engine", [dict(), dict(fused=False)], ids=["fused", "foreach"])
@pytest.mark.parametrize("schedule", FIRST_READ_SCHEDULES)
def test_an_eager_step_between_compiled_ones_reads_adans_first_read_marks(engine, schedule):
    """A compiled Adan step that GradScaler skipped made the states (marks 0: not read yet), then eager
    steps count the params' first steps: whatever their pattern of grads, and where they made states
    anew themselves, they read the group's marks as every graph does, and mark them, so each step weighs
    g - g_prev as the eager run does (an eager step took the params as read, and left their marks at 0
    for the next graph, which weighed it 0 again); no eager step is bound (its native rule reads no
    marks) while a mark is 0."""
    def run(compiling):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))]
        opt = fastoptim.Adan(params, lr=1e-2, **engine)
        torch._dynamo.reset()
        compiled = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
        for index, (traced, skipped, with_grad, change) in enumerate(FIRST_READ_SCHEDULES[schedule]):
            torch.manual_seed(100 + index)
            for i, param in enumerate(params):
                param.grad = torch.randn(4) * 256 if i in with_grad else None
            if change == "clear":
                opt.state[params[0]].clear()
            opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor(float(skipped))
            (compiled if traced and compiling else opt.step)()
        return params + [opt.state[param][key] for param in params for key in ("exp_avg_sq", "neg_pre_grad")]

    for ours, expected in zip(run(compiling=True), run(compiling=False)):
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("reload", ["into itself", "into a new optimizer"])
def test_a_state_dict_keeps_adans_first_reads_that_a_skipped_compiled_step_left(reload):
    """A compiled step that GradScaler skipped made a param's states (zeros) before its first counted
    step (the group's count past 1: its other param stepped before): a load of the state dict took them
    as read, and the next step weighed g - 0 where the eager run weighs g - g_prev 0."""
    def run(compiling):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))]
        opt = fastoptim.Adan(params, lr=1e-2)
        torch._dynamo.reset()
        compiled = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
        for index, (skipped, with_grad, traced) in enumerate([(False, (0,), False), (True, (0, 1), True),
                                                             (False, (0, 1), False), (False, (0, 1), True)]):
            torch.manual_seed(100 + index)
            for i, param in enumerate(params):
                param.grad = torch.randn(4) * 256 if i in with_grad else None
            opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor(float(skipped))
            (compiled if traced and compiling else opt.step)()
            if index == 1:
                saved = opt.state_dict()
                if reload == "into a new optimizer":
                    opt = fastoptim.Adan(params, lr=1e-2)
                    compiled = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
                opt.load_state_dict(saved)
        return params + [opt.state[param][key] for param in params for key in ("exp_avg_diff", "neg_pre_grad")]

    for ours, expected in zip(run(compiling=True), run(compiling=False)):
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("engine", [dict(), dict(fused=False), dict(master_bits=24)],
                         ids=["fused", "foreach", "master_bits=24 over fp32 params"])
@pytest.mark.parametrize("optimizer", [fastoptim.AdamW, fastoptim.Adan, fastoptim.Lion])
def test_eager_steps_between_compiled_ones_trace_nothing_again(optimizer, engine):
    """An eager step between compiled ones left what every graph reads changed: the notes of the params'
    version counters (made where no param keeps a remainder: fp32 ones under master_bits neither) and,
    for Adan, its first-read marks (dropped once read), each a guard that failed, so the next compiled
    step traced again. The steps are the eager run's."""
    def run(schedule):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3, 2))]
        opt = optimizer(params, lr=1e-2, **engine)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(opt.step, backend=counter, fullgraph=True)
        for index, kind in enumerate(schedule):
            set_grads(params, index)
            (compiled if kind == "C" else opt.step)()
        return params, counter.frame_count

    (ours, traces), (expected, _) = run("CCECECEECC"), run("E" * 10)
    assert traces == 1
    assert all(map(torch.equal, ours, expected))


def test_a_fallback_in_a_compiled_step_warns_once_at_tracing():
    params = [torch.nn.Parameter(torch.randn(10, dtype=torch.float64)), torch.nn.Parameter(torch.randn(10))]
    opt = fastoptim.Adan(params, lr=torch.tensor(0.01), fused=True)
    torch._dynamo.reset()
    compiled = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    for step in range(3):
        set_grads(params, step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled()
        ours = [str(w.message) for w in caught if "fastoptim" in str(w.message)]
        # traced once, then nothing to say
        assert ours == ([] if step else [
            "fastoptim: fused=True, but no fused kernel for torch.float64; those tensors take the foreach engine"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_complex_param_compiles_on_foreach_beside_the_kernels(backend):
    """A complex param (stepped as its real view) takes the foreach engine in a compiled step, with
    fused=True's one warning: a graph cannot hand an op that mutates it a view of a tensor of another
    dtype (aot_eager failed in setStorage, inductor in auto_functionalized). A real param of its
    bucket stays on the kernel, bit for bit the eager step."""
    def make():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(4, 7, dtype=torch.complex64)), torch.nn.Parameter(torch.randn(30))]

    eager_params, traced_params = make(), make()
    eager, traced = fastoptim.AdamW(eager_params, lr=0.01, fused=True), fastoptim.AdamW(traced_params, lr=0.01, fused=True)
    torch._dynamo.reset()
    compiled = torch.compile(traced.step, backend=backend, fullgraph=True)
    for step in range(3):
        set_grads(eager_params, step)
        set_grads(traced_params, step)
        eager.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled()
        assert [str(w.message) for w in caught if "fastoptim" in str(w.message)] == ([] if step else [
            "fastoptim: fused=True, but a compiled step's kernels take no complex params (their real views); "
            "those tensors take the foreach engine"])
    torch.testing.assert_close(traced_params[0], eager_params[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(traced_params[1], eager_params[1])


def call_lion_op(params, grads, exp_avgs, layout=None):
    spec = fastoptim.Lion.algorithm.spec
    holders, made = engines.step_op.op_states({"param": params, "exp_avg": exp_avgs}, {}, spec)
    scalars = [torch.tensor(0.0)] * len(spec.all_scalars)
    torch.ops.fastoptim.lion_step(params, grads, holders, made if layout is None else layout, scalars, 0, False)


def test_the_op_refuses_what_its_kernel_cannot_take_and_lists_of_other_lengths():
    params = [torch.zeros(4, dtype=torch.float64)]
    with pytest.raises(RuntimeError, match="kernel cannot take a tensor: no fused kernel for torch.float64"):
        call_lion_op(params, [torch.ones_like(params[0])], [torch.zeros_like(params[0])])
    assert not params[0].any()
    params = [torch.zeros(4), torch.zeros(4)]
    with pytest.raises(ValueError, match="grad must hold one tensor per param"):
        call_lion_op(params, [torch.ones(4)], [torch.zeros(4)] * 2)
    with pytest.raises(ValueError, match="one tensor per param"):
        call_lion_op(params, [torch.ones(4)] * 2, [torch.zeros(4), None])


@pytest.mark.parametrize("layout", [[0], [0, 0, 1, 4], [0, 0, 1, 4, 1, 0, 0, 1, 4, 1, 7], [3, 0, 1, 4, 1, 0, 0, 1, 4, 1],
                                    [0, 2, 1, 4, 1, 0, 6, 1, 4, 1]])
def test_the_op_refuses_a_layout_it_did_not_make_and_changes_nothing(layout):
    """Records cut short, one too many, a holder that is not there, a view past its holder's end."""
    params, exp_avgs = [torch.zeros(4), torch.zeros(4)], [torch.zeros(4), torch.zeros(4)]
    layout = torch.tensor(layout + [-1, -1] * 2, dtype=torch.int64)  # and no remainders, no block maxima
    with pytest.raises(ValueError, match="states and layout must be what fastoptim.engines.step_op.op_states makes"):
        call_lion_op(params, [torch.ones(4)] * 2, exp_avgs, layout)
    assert not any(t.any() for t in params + exp_avgs)


def test_the_op_takes_whole_records_and_refuses_one_more():
    """The layout op_states makes (per role: exp_avg, the remainders, the block maxima), which the op takes,
    and the same with one record too many, refused."""
    params, grads, exp_avgs = [torch.zeros(4), torch.zeros(4)], [torch.ones(4)] * 2, [torch.zeros(4), torch.zeros(4)]
    holders, layout = engines.step_op.op_states({"param": params, "exp_avg": exp_avgs}, {}, fastoptim.Lion.algorithm.spec)
    assert layout.tolist() == [0, 0, 1, 4, 1, 1, 0, 1, 4, 1] + [-1, -1] * 2
    with pytest.raises(ValueError, match="states and layout must be what fastoptim.engines.step_op.op_states makes"):
        call_lion_op(params, grads, exp_avgs, torch.cat([layout, torch.tensor([-1])]))
    assert not any(t.any() for t in params + exp_avgs)
    call_lion_op(params, grads, exp_avgs, layout)  # taken (its scalars, all 0, change nothing)


def test_the_op_refuses_a_remainder_that_is_not_its_bf16_params_and_changes_nothing():
    spec = fastoptim.AdamW.algorithm.spec
    for params, remainder, why in [([torch.zeros(4)], torch.zeros(4, dtype=torch.int16), "float32"),
                                   ([torch.zeros(4, dtype=torch.bfloat16)], torch.zeros(4, dtype=torch.int32), "int32"),
                                   ([torch.zeros(4, dtype=torch.bfloat16)], torch.zeros(5, dtype=torch.int8), "(5,)")]:
        states = [torch.zeros(4), torch.zeros(4)]
        tensors = {"param": params, "exp_avg": states[:1], "exp_avg_sq": states[1:], "master_remainder": [remainder]}
        holders, layout = engines.step_op.op_states(tensors, {}, spec)
        scalars = [torch.tensor(0.5)] * len(spec.all_scalars)
        with pytest.raises(ValueError, match=f"master_remainder\\[0\\] must be the int16 or int8 remainder of a bf16 "
                                             f"param.*{re.escape(why)}"):
            torch.ops.fastoptim.adamw_step(params, [torch.ones_like(params[0])], holders, layout, scalars,
                                           spec.flag_bits(dict(amsgrad=False, first_moment=True)), False)
        assert not any(t.any() for t in (*params, *states, remainder))


def test_the_op_refuses_a_state_past_its_holders_end_in_a_larger_storage():
    """A holder that is a slice of a larger tensor: the op mutates only memory it was handed."""
    big = torch.zeros(16)
    layout = torch.tensor([0, 8, 1, 4, 1, -1], dtype=torch.int64)  # exp_avg at offset 8 of a 4-element holder
    scalars = [torch.tensor(0.0)] * len(fastoptim.Lion.algorithm.spec.all_scalars)
    with pytest.raises(ValueError, match="a state lies outside its holder"):
        torch.ops.fastoptim.lion_step([torch.zeros(4)], [torch.ones(4)], [big[:4]], layout, scalars, 0, False)
    assert not big.any()


def test_the_op_runs_on_states_in_one_buffer_as_on_separate_ones():
    """op_states over views of one buffer hands the op that buffer, once, and the layout finds each
    view in it; the results are those of separate tensors."""
    torch.manual_seed(0)
    params = [torch.randn(5), torch.randn(2, 3)]
    grads = [torch.randn_like(p) for p in params]
    buffer = torch.randn(16)
    views = [buffer[:5], buffer[8:14].view(2, 3)]
    gap, original = buffer[5:8].clone(), params[0].clone()
    separate_params, separate_states = [p.clone() for p in params], [v.clone() for v in views]
    spec = fastoptim.Lion.algorithm.spec
    values = dict(found_inf=0.0, seed=0.0, grad_scale=1.0, beta1=0.9, one_minus_beta1=0.1, beta2=0.99,
                  one_minus_beta2=0.01, lr=0.1, decay_mul=0.99)
    scalars = [torch.tensor(values[name]) for name in spec.all_scalars]
    for ps, states, holders_expected in ((params, views, [buffer]), (separate_params, separate_states, None)):
        holders, layout = engines.step_op.op_states({"param": ps, "exp_avg": states}, {}, spec)
        assert holders == holders_expected if holders_expected else len(holders) == 2
        torch.ops.fastoptim.lion_step(ps, grads, holders, layout, scalars, 0, False)
    assert all(map(torch.equal, params, separate_params)) and all(map(torch.equal, views, separate_states))
    assert torch.equal(buffer[5:8], gap) and not torch.equal(params[0], original)  # only the views, and they moved


def test_a_traced_step_makes_the_index_of_a_cut_in_its_graph(monkeypatch):
    """A traced step makes its tensors in the graph: pinning them for an asynchronous copy (as an eager
    step does for a GPU) fails there (fake tensors have no memory), and so did every step on CUDA that
    cut a plan with per-tensor arguments (the foreach engine, a fused engine's fallback); numpy there
    needs dynamo's ``trace_numpy``. A traced plan's cut makes its per-tensor arguments' index as a
    graph constant; an eager one sends it from staged (pinned, on a GPU) memory."""
    sent = []
    monkeypatch.setattr(engines, "sent_to", lambda values, device: sent.append(values.tolist()) or
                        torch.as_tensor(values))
    params = [torch.zeros(2) for _ in range(3)]
    for traced in (True, False):
        plan = engines.Plan({"param": params}, None, ADAMW.cls.algorithm.spec, args={"lr": torch.arange(3.0)},
                            per_tensor=frozenset({"lr"}), traced=traced)
        assert plan.cut([0, 2]).args["lr"].tolist() == [0.0, 2.0] and plan.cut([1]).traced is traced
    assert sent == [[0, 2], [1]]  # the eager cuts'


def test_algorithms_that_share_their_scalar_math_compile_in_one_process():
    """Muon's AdamW companions are AdamW's scalar math with other flags: a traced step of each, in either
    order, finds the math its name registers (the second was refused as another algorithm's)."""
    for first in (fastoptim.Muon, fastoptim.AdamW):
        torch._dynamo.reset()
        for cls in (first, fastoptim.AdamW if first is fastoptim.Muon else fastoptim.Muon):
            params = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))]
            groups = ([dict(params=params[:1]), dict(params=params[1:], use_muon=False)] if cls is fastoptim.Muon
                      else params)
            optimizer = cls(groups, lr=torch.tensor(0.01))
            for param in params:
                param.grad = torch.ones_like(param)
            torch.compile(optimizer.step, backend="aot_eager", fullgraph=True)()


def test_a_compiled_fused_muon_step_runs_foreach_without_a_fallback_warning():
    """A traced Muon step runs muon_update on foreach, as the docs say, with no warning that the fused
    engine fell back (eager fused Muon runs its momentum on the kernel and warns nothing either)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(6, 8))]
        optimizer = fastoptim.Muon(params, lr=torch.tensor(0.02), **(dict(fused=True) if compiled else
                                                                   dict(foreach=True, fused=False)))
        step = torch.compile(optimizer.step, backend="aot_eager", fullgraph=True) if compiled else optimizer.step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seed in range(3):
                for param in params:
                    param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
                step()
        assert not [w for w in caught if "fastoptim" in str(w.message)], [str(w.message) for w in caught]
        runs.append(params)
    for eager, traced in zip(*runs):
        torch.testing.assert_close(eager, traced, rtol=1e-5, atol=1e-6)  # foreach eager; compiled NS may round apart
