"""The fused CPU engine (``fused=True``), both tiers: single-tensor (``foreach=False``, one kernel call
per tensor) and multi-tensor (one call per bucket). Against the loop engine (hypothesis), timm's Adan,
torch's AdamW and the float64 oracle (bf16/fp16 too); under GradScaler; every fallback; state dicts
across engines; the pointer-table cache; stochastic rounding; and the zero peak memory of a step."""
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastoptim
from fastoptim.bench.memory import in_subprocess, measure_step
from fastoptim.bench.peers import timm_adan_class
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.multi_tensor import CHUNK_NUMEL

from . import oracle
from .registry import OPTIMIZERS as REGISTRY
from .registry import WITH_BETAS

OPTIMIZERS = [info.cls for info in REGISTRY]
LOOP = dict(foreach=False, fused=False)
FUSED = {"fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}
ENGINES = {"loop": LOOP, "foreach": dict(foreach=True, fused=False), **FUSED}
# A tensor that crosses the kernel's chunk size, with a tail that is not a multiple of 16.
LARGE = (CHUNK_NUMEL + 7233,)


def clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def fallback_warnings(record):
    return [w for w in record if "fused=True" in str(w.message)]


def assert_same_values(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=rtol, atol=atol)


def test_the_kernel_is_built():
    assert cpu_backend.AVAILABLE, "fastoptim/_C*.so is missing: run `make test` (needs gcc)"


# --- 1. both fused tiers against the loop engine, over drawn shapes, dtypes and options ----------

# The betas are exact in fp32, and so is 1 − β: then the kernel and the loop engine differ only in the
# order of fp32 operations. With betas that fp32 rounds (the defaults), the kernel's moments are off
# by up to |fl(β) − β| / (1 − β) relative: see test_fused_moments_weight_the_gradient_by_one_minus_beta.
EXACT_BETAS = {info.cls: list(info.exact_betas) for info in WITH_BETAS}

small_shapes = st.lists(st.integers(1, 6), max_size=3).map(tuple) | st.sampled_from([(0,), (0, 5), (1, 0), (1, 1)])
large_shapes = st.sampled_from([(17,), (CHUNK_NUMEL - 1,), (CHUNK_NUMEL,), (CHUNK_NUMEL + 1,), (3, 10923), (70001,)])
shape_lists = st.builds(lambda small, large, at: small[:at] + [large] + small[at:],
                        st.lists(small_shapes, max_size=4), large_shapes, st.integers(0, 4))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
common_options = dict(lr=st.sampled_from([1e-2, 0.3]), weight_decay=st.sampled_from([0.0, 0.05]),
                      max_grad_norm=st.sampled_from([0.0, 0.5]), maximize=st.booleans())
adan_options = st.fixed_dictionaries(common_options | dict(
    no_prox=st.booleans(), betas=st.sampled_from(EXACT_BETAS[fastoptim.Adan])))
adamw_options = st.fixed_dictionaries(common_options | dict(
    amsgrad=st.booleans(), betas=st.sampled_from(EXACT_BETAS[fastoptim.AdamW])))


def assert_params_match_loop(actual, expected, dtype):
    """fp32: within 1e-5 of each value and 1e-6 of the tensor's scale (a few fp32 ulps of p and of the
    update, which a cancellation p − update can leave in a result much smaller than either). bf16/fp16:
    that, plus one ulp of the param's dtype: the fp32 results of the kernel and the loop engine differ
    in their last bits, so rounding them to the dtype (to nearest even) may land on neighbouring values."""
    for a, e in zip(actual, expected):
        if e.numel() == 0:
            continue
        a, e = a.detach().double(), e.detach().double()
        tolerance = 1e-5 * e.abs() + 1e-6 * max(1.0, float(e.abs().max()))
        if dtype != torch.float32:
            tolerance += torch.finfo(dtype).eps * e.abs()
        excess = (a - e).abs() - tolerance
        worst = int(excess.argmax())
        assert excess.max() <= 0, (f"{dtype} param of shape {tuple(e.shape)}: element {worst} is "
                                   f"{a.flatten()[worst]}, the loop engine has {e.flatten()[worst]}")


def run_in_lockstep(cls, shapes, dtype, options, tensor_lr, steps=4):
    """The loop engine and both fused tiers on the same grads. After each step every fused param is
    compared with the loop engine's, then set to it, so that one-ulp differences cannot compound."""
    initial = oracle.make_params(shapes, dtype)
    runs = {name: clone(initial) for name in ("loop", *FUSED)}
    optimizers = {name: cls(params, **(options | {"lr": torch.tensor(options["lr"]) if tensor_lr else options["lr"]}),
                            **ENGINES[name]) for name, params in runs.items()}
    for grads in oracle.grad_sequence(shapes, steps):
        for params in runs.values():
            for param, grad in zip(params, grads):
                param.grad = grad.to(dtype)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for optimizer in optimizers.values():
                optimizer.step()
        assert not fallback_warnings(record), "contiguous fp32/bf16/fp16 params must run fused"
        single, multi = runs["fused-single"], runs["fused-multi"]
        assert all(torch.equal(a, b) for a, b in zip(single, multi)), "the two fused tiers differ"
        assert_params_match_loop(multi, runs["loop"], dtype)
        with torch.no_grad():
            for fused_param, param in zip(single + multi, runs["loop"] * 2):
                fused_param.copy_(param)
    # A state's absolute error is relative to its role's scale over all params: a moment that is a
    # sum of cancelling terms (v = β2·v + (1−β2)·d) carries the rounding of those terms, not its own.
    loop_state = optimizers["loop"].state_dict()["state"]
    scales = {}
    for state in loop_state.values():
        for role, value in state.items():
            scales[role] = max(scales.get(role, 0.0), float(value.abs().max()) if value.numel() else 0.0)
    for name in FUSED:
        state = optimizers[name].state_dict()["state"]
        assert state.keys() == loop_state.keys()
        for key in loop_state:
            for role, expected in loop_state[key].items():
                torch.testing.assert_close(state[key][role], expected, rtol=1e-5, atol=1e-6 * scales[role] + 1e-30)


@settings(max_examples=25, deadline=None)
@given(shapes=shape_lists, dtype=dtypes, options=adan_options, tensor_lr=st.booleans())
def test_adan_fused_matches_loop(shapes, dtype, options, tensor_lr):
    run_in_lockstep(fastoptim.Adan, shapes, dtype, options, tensor_lr)


@settings(max_examples=25, deadline=None)
@given(shapes=shape_lists, dtype=dtypes, options=adamw_options, tensor_lr=st.booleans())
def test_adamw_fused_matches_loop(shapes, dtype, options, tensor_lr):
    run_in_lockstep(fastoptim.AdamW, shapes, dtype, options, tensor_lr)


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("cls, betas", [(fastoptim.AdamW, (0.9, 0.999)), (fastoptim.Adan, (0.98, 0.92, 0.999))])
def test_fused_moments_weight_the_gradient_by_one_minus_beta(cls, betas, engine):
    """One step from zero states: the moments are (1 − β)·g and (1 − β)·g², to fp32 precision."""
    states = []
    for flags in (LOOP, FUSED[engine]):
        params = oracle.make_params(oracle.SHAPES)
        optimizer = cls(params, lr=0.01, betas=betas, **flags)
        oracle.run(optimizer, params, oracle.grad_sequence(oracle.SHAPES, 1))
        states.append(optimizer.state_dict()["state"])
    for key, state in states[0].items():
        for role, expected in state.items():
            torch.testing.assert_close(states[1][key][role], expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 1), (2, 0, 3)])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_an_empty_param_runs_fused_without_a_warning(cls, shape, engine):
    """A param with no elements has nothing for the kernel to do, whatever its grad's strides: the
    grads here are products (randn · scale), whose empty results may get strides of their own
    ((0, 1, 0) for shape (0, 0, 1)). No fallback, and the other params are updated as on the loop engine."""
    shapes = [(17,), shape]
    runs = []
    for flags in (FUSED[engine], LOOP):
        params = oracle.make_params(shapes)
        optimizer = cls(params, lr=0.01, weight_decay=0.1, **flags)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            oracle.run(optimizer, params, oracle.grad_sequence(shapes, 2))
        assert not fallback_warnings(record), str(record[0].message)
        runs.append(params)
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("engine, per_tensor", [("fused-single", True), ("fused-multi", False), ("auto", False)])
def test_native_calls_one_per_bucket_then_one_per_step(monkeypatch, engine, per_tensor):
    """Three fp32 params and two bf16 ones: two buckets. The first step makes one native call per
    bucket; the next ones, bound, one call for both. The single-tensor engine's call runs the kernel
    once per tensor. fused=None picks the multi-tensor tier."""
    calls, real_run = [], cpu_backend.StepCall.run

    def counting_run(call, *args):
        calls.append((len(args[0]), call.per_tensor))
        return real_run(call, *args)

    monkeypatch.setattr(cpu_backend.StepCall, "run", counting_run)
    shapes = [(7,), (5, 3), LARGE, (4,), (2, 2)]
    params = oracle.make_params(shapes[:3]) + oracle.make_params(shapes[3:], torch.bfloat16)
    flags = dict(foreach=None, fused=None) if engine == "auto" else FUSED[engine]
    oracle.run(fastoptim.AdamW(params, lr=0.01, **flags), params, oracle.grad_sequence(shapes, 3))
    assert calls == [(3, [per_tensor]), (2, [per_tensor])] + [(5, [per_tensor] * 2)] * 2


@pytest.mark.parametrize("engine", FUSED)
def test_fused_results_do_not_depend_on_the_thread_count(engine):
    """Each thread takes a share of the chunks; stochastic rounding's random bits are counter-based."""
    shapes = [(70001,), (5, 3), (CHUNK_NUMEL + 1,), (1,)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            torch.manual_seed(0)
            params = oracle.make_params(shapes, torch.bfloat16)
            optimizer = fastoptim.Adan(params, lr=0.01, weight_decay=0.02, stochastic_rounding=True, **FUSED[engine])
            oracle.run(optimizer, params, oracle.grad_sequence(shapes, 3))
            results.append(params)
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


# --- 2. against peers, fp32, 25 steps ------------------------------------------------------------

PEER_SHAPES = oracle.SHAPES + [LARGE]
PEER_STEPS = 25


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("no_prox", [False, True])
def test_adan_fused_matches_timm(engine, no_prox):
    params = oracle.make_params(PEER_SHAPES)
    peer_params = clone(params)
    grads = oracle.grad_sequence(PEER_SHAPES, PEER_STEPS)
    options = dict(lr=0.01, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02, no_prox=no_prox)
    oracle.run(fastoptim.Adan(params, **options, **FUSED[engine]), params, grads)
    oracle.run(timm_adan_class()(peer_params, **options), peer_params, grads)
    assert oracle.relative_error(params, peer_params) < 2e-5


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_fused_matches_torch(engine, amsgrad, maximize):
    params = oracle.make_params(PEER_SHAPES)
    peer_params = clone(params)
    grads = oracle.grad_sequence(PEER_SHAPES, PEER_STEPS)
    options = dict(lr=0.01, weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    oracle.run(fastoptim.AdamW(params, **options, **FUSED[engine]), params, grads)
    oracle.run(torch.optim.AdamW(peer_params, **options), peer_params, grads)
    assert oracle.relative_error(params, peer_params) < 2e-5


def adamw_first_moments_of_torch_and_fused(beta1, engine, shape=(4,), options=None):
    """torch.optim.AdamW's exp_avg and the fused engine's (with ``options``) after grads that cancel (a 1e8
    step, then 1.0 steps) and an inf element, and random ones, with ``beta1``: each is torch's lerp_ of the
    grad. ``shape``: the param's, its grads the same values repeated."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.tensor([1e8, 1e8, 1.0, 3.0]), torch.tensor([1.0, 2.0, 1.0, 3.0]),
             torch.tensor([1.0, float("inf"), -2.0, 3.0]), torch.tensor([0.5, 1.0, 1e-30, 3.0])]
    grads = [grad.repeat(math.prod(shape) // 4).reshape(shape) for grad in grads] + [
        torch.randn(shape, generator=generator) * 10 for _ in range(2)]
    moments = []
    for cls, flags in ((torch.optim.AdamW, {}), (fastoptim.AdamW, FUSED[engine] | (options or {}))):
        param = torch.nn.Parameter(torch.ones(shape))
        optimizer = cls([param], lr=0.01, betas=(beta1, 0.999), **flags)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
            moments.append(optimizer.state[param]["exp_avg"].clone())
    return moments[:len(grads)], moments[len(grads):]


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("layout", ["dense", "sn rows", "sn columns"])
def test_adamw_fused_first_moment_is_torchs_lerp_bit_for_bit(beta1, engine, layout):
    """The kernels wrote m + (g − m)·(1 − β1) for every β1: at β1 = 0 a 1e8 moment then a grad of 1.0 left
    0.0 (torch: 1.0), and an inf grad made inf (torch: NaN); at β1 <= 0.5, torch's lerp_ takes its other
    branch (helper-106), which a subset-norm param's column walk left unfused (helper-109)."""
    shape, options = {"dense": ((4,), None), "sn rows": ((16,), dict(sn=True, subset_size=4)),
                      "sn columns": ((8, 8), dict(sn=True))}[layout]
    expected, actual = adamw_first_moments_of_torch_and_fused(beta1, engine, shape, options)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num()), (step, a, e)


@pytest.mark.parametrize("engine", FUSED)
def test_adamw_fused_counts_steps_per_param_like_torch(engine):
    """A param without a grad keeps its own step count; the kernel reads one step size per tensor."""
    params = oracle.make_params(PEER_SHAPES)
    peer_params = clone(params)
    opt = fastoptim.AdamW(params, lr=0.01, **FUSED[engine])
    peer = torch.optim.AdamW(peer_params, lr=0.01)
    for step, grads in enumerate(oracle.grad_sequence(PEER_SHAPES, 10)):
        for i, (p, q, g) in enumerate(zip(params, peer_params, grads)):
            p.grad = q.grad = None if (i in (0, 5) and step % 3) else g.clone()
        opt.step()
        peer.step()
    assert oracle.relative_error(params, peer_params) < 2e-5


# --- 3. bf16 and fp16 params against the float64 oracle rounded to their dtype every step --------

DEFAULT_BETAS = {fastoptim.Adan: (0.98, 0.92, 0.99), fastoptim.AdamW: (0.9, 0.999)}


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls, betas", [
    (fastoptim.Adan, "default"), (fastoptim.Adan, "fp32-exact"),
    (fastoptim.AdamW, "default"), (fastoptim.AdamW, "fp32-exact")])
def test_low_precision_params_match_a_rounded_oracle(cls, betas, dtype, engine):
    """fp32 math and fp32 states; the param is rounded to its dtype after every step: within two ulps
    of the dtype, the bar the loop engine meets (tests/test_reference.py)."""
    betas = DEFAULT_BETAS[cls] if betas == "default" else EXACT_BETAS[cls][0]
    shapes = oracle.SHAPES + [LARGE]
    params = oracle.make_params(shapes, dtype=dtype)
    grads = oracle.grad_sequence(shapes, 20, scale=0.1)
    reference = oracle.adan if cls is fastoptim.Adan else oracle.adamw
    expected = reference(params, [[g.to(dtype) for g in gs] for gs in grads], lr=0.01, betas=betas, round_to=dtype)
    optimizer = cls(params, lr=0.01, betas=betas, **FUSED[engine])
    oracle.run(optimizer, params, grads)
    assert all(p.dtype == dtype for p in params)
    assert all(s.dtype == torch.float32 for state in optimizer.state.values() for s in state.values())
    ulp = torch.finfo(dtype).eps
    # A value that crossed zero keeps the absolute error of a one-ulp rounding flip from when it was
    # as large as the distance it travelled (at most lr·steps = 0.2): hence the atol.
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=2 * ulp, atol=2 * ulp * 0.2)


# --- 4. GradScaler ---------------------------------------------------------------------------------

def batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(count)]


def linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def step_counts(optimizer, model):
    if isinstance(optimizer, fastoptim.Adan):
        return [float(optimizer.param_groups[0].get("step", 0))]
    return [float(optimizer.state[p]["step"]) if "step" in optimizer.state[p] else 0.0 for p in model.parameters()]


def train_with_scaler(model, optimizer, data, inf_steps=(), unscale_first=False, set_to_none=True):
    """GradScaler("cpu") training; on ``inf_steps`` the loss is multiplied by inf. Returns the params
    and step counts before the first step and after each."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    history = [([p.detach().clone() for p in model.parameters()], step_counts(optimizer, model))]
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss * math.inf if i in inf_steps else loss).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        history.append(([p.detach().clone() for p in model.parameters()], step_counts(optimizer, model)))
    return history, scaler.get_scale()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_grad_scaler_matches_torch_fused_adamw(engine, unscale_first, set_to_none):
    """fastoptim.AdamW takes GradScaler's scale and found_inf (the fused kernel unscales in its pass
    and skips on inf; the other engines look at found_inf on the host), as torch's fused AdamW does."""
    data, inf_step = batches(6), 2
    runs = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
                 lambda ps: fastoptim.AdamW(ps, lr=0.01, **ENGINES[engine])):
        model = linear()
        runs.append(train_with_scaler(model, make(model.parameters()), data, {inf_step}, unscale_first, set_to_none))
    (torch_history, torch_scale), (history, scale) = runs
    assert scale == torch_scale == 2.0**9  # one backoff
    before, after = history[inf_step], history[inf_step + 1]
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), "the inf step changed params"
    assert after[1] == before[1] == [2.0, 2.0], "the inf step advanced the step count"
    assert [counts for _, counts in history] == [counts for _, counts in torch_history]
    assert_same_values(history[-1][0], torch_history[-1][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("inf_step", [0, 2])
def test_adan_skips_an_inf_step_as_if_it_never_happened(engine, inf_step):
    """Params and group['step'] stay; the previous gradient stays too, so after an inf first step the
    next step is a first step (no g − g_prev term): as an Adan that never saw the inf batch."""
    data = batches(5)
    model = linear()
    optimizer = fastoptim.Adan(model.parameters(), lr=0.01, weight_decay=0.02, **ENGINES[engine])
    history, _ = train_with_scaler(model, optimizer, data, {inf_step})
    before, after = history[inf_step], history[inf_step + 1]
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert after[1] == before[1] == [float(inf_step)]
    assert float(optimizer.param_groups[0]["step"]) == len(data) - 1

    reference = linear()
    reference_optimizer = fastoptim.Adan(reference.parameters(), lr=0.01, weight_decay=0.02, **ENGINES[engine])
    for i, (x, y) in enumerate(data):
        if i != inf_step:
            reference_optimizer.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
    assert_same_values(model.parameters(), reference.parameters(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_grad_scaler_with_clipping_and_maximize_equals_an_unscaled_run(cls, engine):
    """The clip coefficient is taken from the unscaled norm; the scale is a power of two, so the
    results are the same as without GradScaler."""
    data = batches(4)
    model, reference = linear(), linear()
    options = dict(lr=0.01, max_grad_norm=0.1, maximize=True, **FUSED[engine])
    train_with_scaler(model, cls(model.parameters(), **options), data)
    reference_optimizer = cls(reference.parameters(), **options)
    for x, y in data:
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
    assert_same_values(model.parameters(), reference.parameters(), rtol=1e-6, atol=1e-7)


# --- 5. fallbacks ----------------------------------------------------------------------------------

def odd_param(kind):
    """A param the kernel cannot take (with contiguous grads)."""
    generator = torch.Generator().manual_seed(3)
    if kind == "float64":
        param = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    elif kind == "channels_last":  # its grad will be contiguous
        param = torch.randn(2, 3, 4, 5, generator=generator).contiguous(memory_format=torch.channels_last)
    else:  # "strided view": not dense; Parameter(view) keeps the view's strides and storage
        param = torch.randn(4, 6, generator=generator)[:, ::2]
    return torch.nn.Parameter(param)


def run_with_layouts(optimizer, params, steps, memory_format=None, record=None):
    """Steps with contiguous random grads (4-D ones in ``memory_format``); with ``record``, collects
    the fallback warnings of each step."""
    for grads in oracle.grad_sequence([p.shape for p in params], steps, seed=4):
        for param, grad in zip(params, grads):
            grad = grad.to(param.dtype)
            param.grad = grad.contiguous(memory_format=memory_format) if memory_format and grad.dim() == 4 else grad
        if record is None:
            optimizer.step()
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            record.append(caught)


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("kind", ["float64", "channels_last", "strided view"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_fallback_warns_once_per_step_and_matches_loop(cls, kind, engine):
    params = oracle.make_params([(7,), LARGE]) + [odd_param(kind)]
    loop_params = oracle.make_params([(7,), LARGE]) + [odd_param(kind)]
    records = []
    run_with_layouts(cls(params, lr=0.01, weight_decay=0.02, **FUSED[engine]), params, 3, record=records)
    run_with_layouts(cls(loop_params, lr=0.01, weight_decay=0.02, **LOOP), loop_params, 3)
    for caught in records:  # Muon's too: its momentum kernel writes fresh directions, its update kernel the param
        fallbacks = fallback_warnings(caught)
        assert len(fallbacks) == 1 and all(issubclass(w.category, UserWarning) for w in fallbacks)
        assert all("foreach" in str(w.message) for w in fallbacks)
    assert_same_values(params, loop_params)


@pytest.mark.parametrize("engine", FUSED)
def test_fallback_warning_is_a_user_warning_that_names_foreach(engine):
    params = [odd_param("float64")]
    optimizer = fastoptim.Adan(params, lr=0.01, **FUSED[engine])
    params[0].grad = torch.ones_like(params[0])
    with pytest.warns(UserWarning, match="foreach"):
        optimizer.step()


@pytest.mark.parametrize("engine", FUSED)
def test_strided_view_param_leaves_the_rest_of_its_storage_alone(engine):
    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    untouched = base[:, 1::2].clone()
    param = torch.nn.Parameter(base[:, ::2])
    assert param.data_ptr() == base.data_ptr() and param.stride() == (6, 2)  # a view, not a copy
    initial = param.detach().clone()
    optimizer = fastoptim.AdamW([param], lr=0.1, **FUSED[engine])
    with pytest.warns(UserWarning, match="foreach"):
        run_with_layouts(optimizer, [param], 2)
    assert torch.equal(base[:, 1::2], untouched)
    assert param.data_ptr() == base.data_ptr() and not torch.equal(param.detach(), initial)


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_channels_last_param_with_channels_last_grad_runs_fused(cls, engine):
    params = oracle.make_params([(7,)]) + [odd_param("channels_last")]
    loop_params = clone(params)
    assert loop_params[1].is_contiguous(memory_format=torch.channels_last) and not loop_params[1].is_contiguous()
    records = []
    optimizer = cls(params, lr=0.01, weight_decay=0.02, **FUSED[engine])
    run_with_layouts(optimizer, params, 3, torch.channels_last, record=records)
    run_with_layouts(cls(loop_params, lr=0.01, weight_decay=0.02, **LOOP), loop_params, 3, torch.channels_last)
    assert not any(fallback_warnings(caught) for caught in records)
    state = next(value for value in optimizer.state[params[1]].values() if isinstance(value, torch.Tensor)
                 and value.shape == params[1].shape)  # a state of the param's shape (Muon's: its companions')
    assert state.is_contiguous(memory_format=torch.channels_last)
    assert_same_values(params, loop_params)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_auto_engine_falls_back_silently(cls, recwarn):
    """fused=None picks the fused engine when it can: a float64 param takes foreach without a word."""
    params = oracle.make_params([(7,), (5, 3)]) + [odd_param("float64")]
    loop_params = clone(params)
    run_with_layouts(cls(params, lr=0.01), params, 3)
    run_with_layouts(cls(loop_params, lr=0.01, **LOOP), loop_params, 3)
    assert not [w for w in recwarn if "fastoptim" in str(w.message)]
    assert_same_values(params, loop_params)


@pytest.mark.parametrize("engine", [*FUSED, "auto"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_missing_build_falls_back_to_foreach(monkeypatch, cls, engine):
    def no_kernel(*args):
        raise AssertionError("the kernel ran without a build")

    monkeypatch.setattr(cpu_backend, "AVAILABLE", False)
    monkeypatch.setattr(cpu_backend, "BoundTable", no_kernel)
    params = oracle.make_params([(7,), LARGE, (5, 3)])
    loop_params = clone(params)
    flags = dict(foreach=None, fused=None) if engine == "auto" else FUSED[engine]
    records = []
    optimizer = cls(params, lr=0.01, weight_decay=0.02, **flags)
    run_with_layouts(optimizer, params, 3, record=records)
    run_with_layouts(cls(loop_params, lr=0.01, weight_decay=0.02, **LOOP), loop_params, 3)
    expected = 0 if engine == "auto" else len(optimizer.param_groups)  # one per group that falls back
    for caught in records:
        fallbacks = fallback_warnings(caught)
        assert len(fallbacks) == expected and all("not built" in str(w.message) for w in fallbacks)
    assert_same_values(params, loop_params)


# --- 6. state dicts between fused and other engines ------------------------------------------------

PAIRS = [(source, target) for source in ENGINES for target in ENGINES
         if source != target and (source in FUSED or target in FUSED)]


@pytest.mark.parametrize("source, target", PAIRS)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_moves_between_fused_and_other_engines(cls, source, target):
    shapes = oracle.SHAPES + [LARGE]
    grads = oracle.grad_sequence(shapes, 6)
    options = dict(lr=0.01, weight_decay=0.02) | (dict(amsgrad=True) if cls is fastoptim.AdamW else {})
    uninterrupted = oracle.make_params(shapes)
    oracle.run(cls(uninterrupted, **options, **ENGINES[source]), uninterrupted, grads)
    first = oracle.make_params(shapes)
    first_optimizer = cls(first, **options, **ENGINES[source])
    oracle.run(first_optimizer, first, grads[:3])
    params = clone(first)
    optimizer = cls(params, **options, **ENGINES[target])
    optimizer.load_state_dict(first_optimizer.state_dict())
    group = optimizer.param_groups[0]
    assert (group["foreach"], group["fused"]) == (ENGINES[target]["foreach"], ENGINES[target]["fused"])
    oracle.run(optimizer, params, grads[3:])
    assert_same_values(params, uninterrupted)


# --- 7. the pointer-table cache --------------------------------------------------------------------

def feed(optimizer, params, grads_per_step, in_place_grads=False):
    """Steps on ``grads_per_step``: new grad tensors each step, or the same ones overwritten."""
    for grads in grads_per_step:
        for param, grad in zip(params, grads):
            if in_place_grads and param.grad is not None:
                param.grad.copy_(grad)
            else:
                param.grad = grad.clone()
        optimizer.step()


CACHE_SHAPES = [(7,), LARGE, (5, 3)]


@pytest.mark.parametrize("in_place_grads", [False, True])
@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_replaced_param_storage_is_written_and_the_old_one_left_alone(cls, engine, in_place_grads):
    grads = oracle.grad_sequence(CACHE_SHAPES, 5)
    runs = []
    for flags in (LOOP, FUSED[engine]):
        params = oracle.make_params(CACHE_SHAPES)
        optimizer = cls(params, lr=0.01, weight_decay=0.02, **flags)
        feed(optimizer, params, grads[:2], in_place_grads)
        old = params[1].data
        params[1].data = old.clone()
        snapshot = old.clone()
        feed(optimizer, params, grads[2:], in_place_grads)
        assert torch.equal(old, snapshot), "a step wrote into the param's old storage"
        assert not torch.equal(params[1].detach(), snapshot)
        runs.append(params)
    assert_same_values(*runs[::-1])


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_state_dict_mid_run_points_the_kernel_at_the_new_states(cls, engine):
    grads = oracle.grad_sequence(CACHE_SHAPES, 5)
    donor_params = oracle.make_params(CACHE_SHAPES, seed=7)
    donor = cls(donor_params, lr=0.01, weight_decay=0.02, **LOOP)
    oracle.run(donor, donor_params, oracle.grad_sequence(CACHE_SHAPES, 3, seed=8))
    saved = donor.state_dict()
    saved_copy = {key: {role: value.clone() for role, value in state.items()} for key, state in saved["state"].items()}
    runs = []
    for flags in (LOOP, FUSED[engine]):
        params = oracle.make_params(CACHE_SHAPES)
        optimizer = cls(params, lr=0.01, weight_decay=0.02, **flags)
        oracle.run(optimizer, params, grads[:2])
        old_states = [value for state in optimizer.state.values() for value in state.values()]
        snapshots = [value.clone() for value in old_states]
        optimizer.load_state_dict(saved)
        oracle.run(optimizer, params, grads[2:])
        assert all(torch.equal(a, b) for a, b in zip(old_states, snapshots)), "a step wrote into replaced states"
        runs.append((params, optimizer.state_dict()["state"]))
    for key, state in saved["state"].items():  # loaded as copies
        assert all(torch.equal(value, saved_copy[key][role]) for role, value in state.items())
    (loop_params, loop_state), (params, state) = runs
    assert_same_values(params, loop_params)
    for key in loop_state:
        assert_same_values([state[key][role] for role in loop_state[key]], loop_state[key].values())


@pytest.mark.parametrize("engine", FUSED)
def test_restart_opt_mid_run_points_the_kernel_at_the_new_states(engine):
    grads = oracle.grad_sequence(CACHE_SHAPES, 6)
    runs = []
    for flags in (LOOP, FUSED[engine]):
        params = oracle.make_params(CACHE_SHAPES)
        optimizer = fastoptim.Adan(params, lr=0.01, weight_decay=0.02, **flags)
        oracle.run(optimizer, params, grads[:3])
        old_states = [value for state in optimizer.state.values() for value in state.values()]
        snapshots = [value.clone() for value in old_states]
        optimizer.restart_opt()
        oracle.run(optimizer, params, grads[3:])
        assert all(torch.equal(a, b) for a, b in zip(old_states, snapshots)), "a step wrote into cleared states"
        assert float(optimizer.param_groups[0]["step"]) == 3
        runs.append(params)
    assert_same_values(*runs[::-1])


@pytest.mark.parametrize("engine", FUSED)
def test_a_param_transposed_in_place_is_not_walked_with_its_old_layout(engine):
    results = []
    for flags in (LOOP, FUSED[engine]):
        param = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        optimizer = fastoptim.AdamW([param], lr=0.1, **flags)
        grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        param.grad = grad.clone()
        optimizer.step()
        param.data = param.data.t()
        param.grad = grad.t().contiguous().t()  # the param's new strides
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.step()
        results.append(param.detach().clone())
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("engine", FUSED)
def test_a_grad_whose_storage_is_replaced_is_read_from_its_new_storage(engine):
    results = []
    for flags in (LOOP, FUSED[engine]):
        param = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
        optimizer = fastoptim.AdamW([param], lr=0.1, **flags)
        param.grad = torch.ones(1000)
        optimizer.step()
        old_grad = param.grad.data  # kept alive, so a stale read is a wrong value, not a freed one
        param.grad.data = -torch.ones(1000)
        optimizer.step()
        results.append(param.detach().clone())
        del old_grad
    torch.testing.assert_close(results[1], results[0])


PARTIAL_CONVERSION_SCRIPT = """
import torch, fastoptim
results = []
for flags in (dict(foreach=False, fused=False), dict(foreach=False, fused=True), dict(foreach=True, fused=True)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = fastoptim.AdamW(model.parameters(), lr=0.01, **flags)
    model(torch.ones(8, 64)).sum().backward()
    optimizer.step()
    model[1].to(torch.bfloat16)  # params and grads of one layer, through .data: the grads stay the same objects
    optimizer.step()
    results.append([p.detach().double() for p in model.parameters()])
print(max(float((a - b).abs().max()) for other in results[1:] for a, b in zip(results[0], other)))
"""


def test_converting_part_of_a_model_to_bf16_mid_run():
    out = subprocess.run([sys.executable, "-c", PARTIAL_CONVERSION_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-2


# --- 8. stochastic rounding ------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Lion])
@pytest.mark.parametrize("engine", ENGINES)
def test_stochastic_rounding_adds_up_updates_below_half_an_ulp(engine, cls):
    """bf16 params at 1.5 (ulp 2⁻⁷ in [1, 2)); AdamW's step on a constant gradient is lr (m̂/√v̂ = 1),
    and so is every Lion step, here 1e-4, far below half an ulp. To nearest, the params never move. Stochastically, each
    step moves an element one ulp with probability lr/ulp, so the mean moves by steps·lr: a rounding
    error of zero mean and variance at most ulp·lr per element and step."""
    n, steps, lr, ulp = 100_000, 10, 1e-4, 2.0**-7
    for stochastic in (False, True):
        torch.manual_seed(0)
        down, up = (torch.nn.Parameter(torch.full((n,), 1.5, dtype=torch.bfloat16)) for _ in range(2))
        optimizer = cls([down, up], lr=lr, weight_decay=0.0, stochastic_rounding=stochastic, **ENGINES[engine])
        for _ in range(steps):
            down.grad = torch.ones(n, dtype=torch.bfloat16)
            up.grad = -torch.ones(n, dtype=torch.bfloat16)
            optimizer.step()
        if not stochastic:
            assert (down == 1.5).all() and (up == 1.5).all()
            continue
        sigma = math.sqrt(steps * ulp * lr / n)  # of the mean
        assert abs(float(down.detach().double().mean()) - (1.5 - steps * lr)) < 5 * sigma
        assert abs(float(up.detach().double().mean()) - (1.5 + steps * lr)) < 5 * sigma
        assert float(down.detach().max()) <= 1.5 and float(up.detach().min()) >= 1.5


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_stochastic_rounding_changes_nothing_but_bf16(cls, dtype, engine):
    shapes = [(7,), LARGE, (5, 3)]
    results = []
    for stochastic in (False, True):
        params = oracle.make_params(shapes, dtype)
        optimizer = cls(params, lr=0.01, weight_decay=0.02, stochastic_rounding=stochastic, **ENGINES[engine])
        oracle.run(optimizer, params, oracle.grad_sequence(shapes, 3))
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results))


# --- 9. peak extra memory of a fused step ----------------------------------------------------------

def peaks_of_engines(engines):
    """In a measuring subprocess: the peak extra bytes of one step of each optimizer and engine."""
    peaks = {}
    for cls in (fastoptim.Adan, fastoptim.AdamW):
        for name, flags in engines.items():
            generator = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(n, generator=generator))
                      for n in (1 << 20, 1 << 20, (1 << 20) + 1)]
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer = cls(params, lr=1e-3, weight_decay=0.02, **flags)
            optimizer.step()  # creates the states
            peaks[f"{cls.__name__} {name}"] = measure_step(optimizer.step)
    return peaks


MEMORY_BOUND = 1 << 20  # a param-sized fp32 temporary here is 4 MiB


@pytest.fixture(scope="module")
def peak_extra_bytes():
    """Peak extra bytes of one step, measured as fastoptim bench does (see fastoptim.bench.memory)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self")
    return in_subprocess("tests.test_fused:peaks_of_engines", {name: ENGINES[name] for name in ("foreach", *FUSED)})


@pytest.mark.parametrize("engine", FUSED)
@pytest.mark.parametrize("cls", ["Adan", "AdamW"])
def test_fused_step_allocates_nothing(peak_extra_bytes, cls, engine):
    assert peak_extra_bytes[f"{cls} {engine}"] < MEMORY_BOUND


@pytest.mark.parametrize("cls", ["Adan", "AdamW"])
def test_the_measurement_sees_the_foreach_scratch(peak_extra_bytes, cls):
    """The foreach engine's scratch (one slice of the params, 12 MiB here) must show, or the test above
    could not fail."""
    assert peak_extra_bytes[f"{cls} foreach"] > MEMORY_BOUND


# --- 10. Threads and float64 ---------------------------------------------------------------------

def test_the_kernel_runs_on_torchs_openmp_runtime_and_no_second_one_is_loaded():
    torch.ones(1 << 16).sum()
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps
                    if os.path.basename(line.split()[-1]).startswith(("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1
    assert cpu_backend.openmp() in runtimes


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
@pytest.mark.parametrize("flags", [LOOP, dict(foreach=True, fused=False), *FUSED.values()], ids=str)
def test_float64_params_keep_float64_math_and_states(cls, flags):
    param = torch.nn.Parameter(torch.full((5,), 1 + 1e-12, dtype=torch.float64))
    param.grad = torch.ones(5, dtype=torch.float64)
    optimizer = cls([param], lr=0.0, weight_decay=0.0, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fused=True falls back for float64, with a warning
        optimizer.step()
    assert torch.equal(param.detach(), torch.full((5,), 1 + 1e-12, dtype=torch.float64))
    assert all(s.dtype == torch.float64 for s in optimizer.state[param].values() if s.dim())


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_pthreads_give_the_same_result_as_openmp_threads(cls):
    torch_openmp = cpu_backend.openmp()
    results = []
    try:
        for openmp in (torch_openmp, None):
            assert cpu_backend.use_threads(openmp) == openmp
            params = oracle.make_params([(70001,), (3, 5), (40000,)])
            oracle.run(cls(params, lr=0.01, fused=True), params, oracle.grad_sequence([(70001,), (3, 5), (40000,)], 3))
            results.append(params)
    finally:
        cpu_backend.use_threads(torch_openmp)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def steps_under_a_default_device(info, default_device):
    """Params after three fused multi-tensor steps of ``info``'s variant (8-bit states, clipping, maximize,
    sn) and fastoptim's clip_grad_norm_, with ``torch.set_default_device(default_device)`` around the steps:
    a kernel's host-side tensors (pointer arrays, partial sums) must not follow the user's default device."""
    params = oracle.make_params([(64, 80), (80,), (70, 70), (5000,)])
    optimizer = info.cls(params, lr=0.01, **FUSED["fused-multi"], **info.variant())
    sequence = list(oracle.grad_sequence([p.shape for p in params], 3))
    torch.set_default_device(default_device)
    try:
        for grads in sequence:
            for param, grad in zip(params, grads):
                param.grad = grad
            fastoptim.clip_grad_norm_(params, 1.0)
            optimizer.step()
    finally:
        torch.set_default_device(None)
    return params


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_default_device_set_by_the_user_changes_nothing(info):
    """torch.set_default_device("cuda") in a training script (found on a GPU: the Triton engine's pointer
    array went to the GPU); "meta" stands for it on any machine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Muon's 8-bit companions of small params fall back
        expected = steps_under_a_default_device(info, None)
        for actual, wanted in zip(steps_under_a_default_device(info, "meta"), expected):
            assert torch.equal(actual, wanted)
