"""fastoptim.Lion: the loop engine against the float64 restatement (tests/oracle.py) and against timm's
and pytorch_optimizer's Lion; every engine against the loop engine (hypothesis) and at every
``state_bits``; GradScaler; stochastic rounding of bf16 params; bad input and non-finite grads.

A Lion step moves every element by exactly ``lr`` (after weight decay), against the sign of
c = β1·m + (1−β1)·g. Where c is within rounding of 0, two correct fp32 computations of it may take
opposite signs and put the element 2·lr apart. So the tests either run on data whose |c| stays far
from 0, and check that it does (``MARGIN``), or let an element differ only where c is ambiguous,
and then by a flipped sign at most.
"""
import importlib
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastoptim
from fastoptim.bench.peers import timm_adan_class
from fastoptim.multi_tensor import CHUNK_NUMEL
from fastoptim.states import blockwise8

from . import oracle
from .test_fused import ENGINES, FUSED, fallback_warnings

LR = 0.01
STEPS = 20
# |c| is at least this fraction of β1·|m| + (1−β1)·|g| everywhere in the runs that assert exact
# signs: fp32 rounding (about 1e-7 of it) cannot flip one there.
MARGIN = 1e-4


def timm_lion_class():
    """timm's Lion, loaded by file path as fastoptim.bench.peers loads its Adan: importing the timm
    package imports torchvision, which is not installed."""
    timm_adan_class()  # makes timm/optim the package _timm_optim
    return importlib.import_module("_timm_optim.lion").Lion


def rounded_like(value, stored):
    """What a momentum of fp32 ``value`` is after being stored like ``stored`` (a low-bit state)."""
    if stored.dtype == torch.uint8:
        return blockwise8.dequantize(*blockwise8.quantize(value, blockwise8.SIGNED), blockwise8.SIGNED)
    return value.to(stored.dtype).float() if stored.dtype == torch.bfloat16 else value


def dense_exp_avg(optimizer, param):
    """The param's momentum as fp32 values, 8-bit codes dequantized."""
    state = optimizer.state[param]
    if state["exp_avg"].dtype == torch.uint8:
        return blockwise8.dequantize(state["exp_avg"], state["exp_avg_absmax"], blockwise8.SIGNED)
    return state["exp_avg"].float()


def pytorch_optimizer_lion_class():
    import pytorch_optimizer
    return pytorch_optimizer.Lion


PEERS = {"timm": timm_lion_class, "pytorch_optimizer": pytorch_optimizer_lion_class}


def clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def varying_grads(shapes, steps, seed=1):
    """Gradients whose scale changes up to 4× from one step to the next. Lion ignores a scale common
    to every step, so clipping (a factor per step) changes its trajectory only with such grads."""
    return [[g * (1 + 3 * (t % 3)) for g in grads] for t, grads in enumerate(oracle.grad_sequence(shapes, steps, seed))]


def smallest_margin(interpolations):
    """The smallest |c| / (β1·|m| + (1−β1)·|g|) over the steps oracle.lion recorded."""
    return min(float((c.abs() / scale).min()) for step in interpolations for c, scale in step if c.numel())


# --- 1. the loop engine against the float64 equations ------------------------------------------

def test_defaults_are_the_papers_and_timms():
    optimizer = fastoptim.Lion(oracle.make_params())
    peer = timm_lion_class()(oracle.make_params())
    for key, value in dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False).items():
        assert optimizer.defaults[key] == peer.defaults[key] == value, key
    assert optimizer.defaults["state_bits"] == 32 and optimizer.defaults["max_grad_norm"] == 0.0


@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_loop_engine_matches_float64_equations(weight_decay, maximize, max_grad_norm, tensor_lr):
    params = oracle.make_params()
    grads = varying_grads(oracle.SHAPES, STEPS)
    options = dict(betas=(0.9, 0.99), weight_decay=weight_decay, maximize=maximize, max_grad_norm=max_grad_norm)
    interpolations = []
    expected = oracle.lion(params, grads, lr=LR, interpolations=interpolations, **options)
    assert smallest_margin(interpolations) > MARGIN  # no sign here is within rounding of 0
    if max_grad_norm:  # the clip factor changes from step to step, and so does the trajectory
        unclipped = oracle.lion(params, grads, lr=LR, **(options | dict(max_grad_norm=0.0)))
        assert max(float((a - b).abs().max()) for a, b in zip(expected, unclipped)) > LR
    optimizer = fastoptim.Lion(params, lr=torch.tensor(LR) if tensor_lr else LR, foreach=False, **options)
    oracle.run(optimizer, params, grads)
    # 20 steps of fp32 rounding of p (|p| < 3): a few 1e-7; a sign or a weight decay gone wrong is 1e-4 or more
    for param, value in zip(params, expected):
        torch.testing.assert_close(param.detach().double(), value, rtol=1e-6, atol=1e-6)
        assert set(optimizer.state[param]) == {"exp_avg"}
        assert optimizer.state[param]["exp_avg"].dtype == torch.float32


def test_a_step_moves_every_element_by_lr_against_the_sign_of_the_interpolation():
    """One step from zero states: c = (1−β1)·g, so p ← p·(1 − lr·wd) − lr·sign(g), and m = (1−β2)·g."""
    params = oracle.make_params()
    initial = clone(params)
    grads = oracle.grad_sequence(oracle.SHAPES, 1)[0]
    grads[0][3] = 0.0  # sign(0) = 0: this element only decays
    optimizer = fastoptim.Lion(params, lr=LR, betas=(0.5, 0.75), weight_decay=0.5, foreach=False)
    oracle.run(optimizer, params, [grads])
    for param, start, grad in zip(params, initial, grads):
        expected = start.detach() * (1 - LR * 0.5) - LR * grad.sign()
        torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], 0.25 * grad, rtol=1e-6, atol=0)
    assert params[0][3] == initial[0][3] * (1 - LR * 0.5)


# --- 2. against timm's and pytorch_optimizer's Lion ------------------------------------------------

PEER_OPTIONS = {"weight decay": dict(weight_decay=0.5), "maximize": dict(maximize=True),
                "other betas": dict(betas=(0.95, 0.98), weight_decay=0.1)}


@pytest.mark.parametrize("options", PEER_OPTIONS)
@pytest.mark.parametrize("peer_foreach", [False, True])
@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.parametrize("engine", ["loop", "foreach"])
def test_same_trajectory_as_peers(engine, peer, peer_foreach, options):
    """The peers take p·(1 − lr·wd), then p − lr·sign(lerp(m, g, 1 − β1)), as fastoptim does but for
    the lerp: with signs that agree, the params are the same fp32 numbers, bit for bit. The momenta
    (lerp against multiply-and-add) agree to fp32 rounding."""
    options = PEER_OPTIONS[options]
    params = oracle.make_params()
    peer_params = clone(params)
    grads = varying_grads(oracle.SHAPES, STEPS)
    interpolations = []
    oracle.lion(params, grads, lr=LR, interpolations=interpolations, **options)
    assert smallest_margin(interpolations) > MARGIN
    optimizer = fastoptim.Lion(params, lr=LR, **ENGINES[engine], **options)
    reference = PEERS[peer]()(peer_params, lr=LR, foreach=peer_foreach, **options)
    oracle.run(optimizer, params, grads)
    oracle.run(reference, peer_params, grads)
    for param, peer_param in zip(params, peer_params):
        assert torch.equal(param, peer_param)
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], reference.state[peer_param]["exp_avg"],
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_timm_checkpoint_loads_and_resumes_on_the_same_trajectory(engine):
    params = oracle.make_params()
    peer_params = clone(params)
    grads = varying_grads(oracle.SHAPES, STEPS)
    options = dict(lr=LR, betas=(0.95, 0.98), weight_decay=0.1)
    interpolations = []
    oracle.lion(params, grads, interpolations=interpolations, **options)
    assert smallest_margin(interpolations) > MARGIN
    peer = timm_lion_class()(peer_params, **options)
    oracle.run(peer, peer_params, grads[:10])
    with torch.no_grad():
        for p, q in zip(params, peer_params):
            p.copy_(q)
    optimizer = fastoptim.Lion(params, lr=1.0, betas=(0.5, 0.5), **ENGINES[engine])  # the saved ones replace these
    optimizer.load_state_dict(peer.state_dict())
    group = optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (LR, (0.95, 0.98), 0.1)
    for p, q in zip(params, peer_params):
        assert torch.equal(optimizer.state[p]["exp_avg"], peer.state[q]["exp_avg"])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        oracle.run(peer, peer_params, grads[10:])
        oracle.run(optimizer, params, grads[10:])
    assert not fallback_warnings(record)
    for p, q in zip(params, peer_params):
        if engine in FUSED:  # the kernel may fuse p·(1 − lr·wd) − lr·sign(c) into one rounding
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(p, q)


def test_a_timm_checkpoint_loads_into_8_bit_states_as_its_quantized_momentum():
    shapes = [(64, 80), (7,)]  # the first is 8-bit under state_bits=8, the second too small
    params = oracle.make_params(shapes)
    peer = timm_lion_class()(clone(params), lr=LR)
    oracle.run(peer, list(peer.param_groups[0]["params"]), oracle.grad_sequence(shapes, 3))
    optimizer = fastoptim.Lion(params, lr=LR, state_bits=8)
    optimizer.load_state_dict(peer.state_dict())
    for param, peer_param in zip(params, peer.param_groups[0]["params"]):
        stored, saved = optimizer.state[param]["exp_avg"], peer.state[peer_param]["exp_avg"]
        assert stored.dtype == (torch.uint8 if param.numel() >= blockwise8.MIN_NUMEL else torch.float32)
        torch.testing.assert_close(dense_exp_avg(optimizer, param), rounded_like(saved, stored), rtol=0, atol=0)


# --- 3. every engine against the loop engine -------------------------------------------------------

def step_multipliers(grads, max_grad_norm, maximize):
    """What the step multiplies every grad by: the clip factor (eps 1e-6, as clip_grad_norm_), −1 to maximize."""
    return oracle.clip_factor([g.double() for g in grads], max_grad_norm, 1e-6) * (-1 if maximize else 1)


def ambiguous_signs(exp_avgs, grads, beta1, multiplier, margin=MARGIN):
    """Per tensor, where |c| = |β1·m + (1−β1)·g| is within ``margin`` of its terms' scale: an engine
    that computes c with other fp32 roundings (fused multiply-adds, a lerp) may take the other sign."""
    result = []
    for m, g in zip(exp_avgs, grads):
        m, g = m.double(), g.double() * multiplier
        result.append((beta1 * m + (1 - beta1) * g).abs() <= margin * (beta1 * m.abs() + (1 - beta1) * g.abs()))
    return result


def assert_params_match_loop(actual, expected, ambiguous, dtype, lr):
    """As tests/test_fused.py's: within a few fp32 ulps of the loop engine (plus one ulp of a bf16 or fp16
    param's dtype, where the fp32 results round to neighbours); where the sign is ambiguous, up to
    a flipped sign (2·lr) more."""
    for a, e, flip in zip(actual, expected, ambiguous):
        if e.numel() == 0:
            continue
        a, e = a.detach().double(), e.detach().double()
        tolerance = 1e-5 * e.abs() + 1e-6 * max(1.0, float(e.abs().max()))
        if dtype != torch.float32:
            tolerance = tolerance + torch.finfo(dtype).eps * e.abs()
        tolerance = torch.where(flip, tolerance + 2 * lr * (1 + 1e-5), tolerance)
        excess = (a - e).abs() - tolerance
        worst = int(excess.argmax())
        assert excess.max() <= 0, (f"{dtype} param of shape {tuple(e.shape)}: element {worst} is "
                                   f"{a.flatten()[worst]}, the loop engine has {e.flatten()[worst]}")


def run_in_lockstep(engine, shapes, dtype, options, tensor_lr, steps=4):
    """The loop engine and ``engine`` on the same grads. After each step the params are compared, and
    the engine's set to the loop engine's, so that a flipped sign or an ulp cannot compound."""
    initial = oracle.make_params(shapes, dtype)
    runs = {name: clone(initial) for name in ("loop", engine)}
    lr = torch.tensor(options["lr"]) if tensor_lr else options["lr"]
    optimizers = {name: fastoptim.Lion(params, **(options | dict(lr=lr)), **ENGINES[name])
                  for name, params in runs.items()}
    for grads in oracle.grad_sequence(shapes, steps):
        grads = [g.to(dtype) for g in grads]
        loop_params = runs["loop"]
        exp_avgs = [optimizers["loop"].state[p]["exp_avg"] if p in optimizers["loop"].state else torch.zeros_like(p)
                    for p in loop_params]
        ambiguous = ambiguous_signs(exp_avgs, grads, options["betas"][0],
                                    step_multipliers(grads, options["max_grad_norm"], options["maximize"]))
        for params in runs.values():
            for param, grad in zip(params, grads):  # in the param's strides, even where it has no elements
                param.grad = torch.empty_like(param).copy_(grad)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for optimizer in optimizers.values():
                optimizer.step()
        assert not fallback_warnings(record), "contiguous fp32/bf16/fp16 params must run fused"
        if engine == "foreach":  # the same torch ops on the same numbers
            assert all(torch.equal(a, b) for a, b in zip(runs[engine], loop_params))
        assert_params_match_loop(runs[engine], loop_params, ambiguous, dtype, options["lr"])
        with torch.no_grad():
            for param, loop_param in zip(runs[engine], loop_params):
                param.copy_(loop_param)
    loop_state = optimizers["loop"].state_dict()["state"]
    state = optimizers[engine].state_dict()["state"]
    assert state.keys() == loop_state.keys()
    scale = max([float(s["exp_avg"].abs().max()) for s in loop_state.values() if s["exp_avg"].numel()], default=0.0)
    for key, value in loop_state.items():
        assert set(state[key]) == {"exp_avg"}
        torch.testing.assert_close(state[key]["exp_avg"], value["exp_avg"], rtol=1e-5, atol=1e-6 * scale + 1e-30)


small_shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)
# one tensor across the fused kernels' chunks, with a tail that is not a multiple of 16
large_shapes = st.sampled_from([(17,), (CHUNK_NUMEL + 1,), (3, 10923)])
shape_lists = st.builds(lambda small, large, at: small[:at] + [large] + small[at:],
                        st.lists(small_shapes, max_size=4), large_shapes, st.integers(0, 4))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
lion_options = st.fixed_dictionaries(dict(
    lr=st.sampled_from([1e-2, 0.3]), weight_decay=st.sampled_from([0.0, 0.05]),
    max_grad_norm=st.sampled_from([0.0, 0.5]), maximize=st.booleans(),
    betas=st.sampled_from([(0.9, 0.99), (0.875, 1 - 2**-7), (0.0, 0.5)])))


@pytest.mark.parametrize("engine", ["foreach", *FUSED])
@settings(max_examples=10, deadline=None)
@given(shapes=shape_lists, dtype=dtypes, options=lion_options, tensor_lr=st.booleans())
def test_every_engine_matches_the_loop_engine(engine, shapes, dtype, options, tensor_lr):
    run_in_lockstep(engine, shapes, dtype, options, tensor_lr)


def test_the_two_fused_tiers_agree_bit_for_bit():
    shapes = [(7,), (2 * CHUNK_NUMEL + 7233,), (5, 3)]
    results = []
    for engine in FUSED:
        params = oracle.make_params(shapes, torch.bfloat16)
        optimizer = fastoptim.Lion(params, lr=LR, weight_decay=0.1, max_grad_norm=1.0, **ENGINES[engine])
        oracle.run(optimizer, params, oracle.grad_sequence(shapes, 3))
        results.append((params, optimizer.state_dict()["state"]))
    (single, single_state), (multi, multi_state) = results
    assert all(torch.equal(a, b) for a, b in zip(single, multi))
    assert all(torch.equal(single_state[k]["exp_avg"], multi_state[k]["exp_avg"]) for k in single_state)


def test_the_default_engine_steps_as_the_loop_engine():
    """foreach=None, fused=None: the fastest engine there is (the fused kernel, where it is built)."""
    shapes = [(7,), (CHUNK_NUMEL + 1,), (5, 3)]
    runs = []
    for flags in ({}, ENGINES["loop"]):
        params = oracle.make_params(shapes)
        optimizer = fastoptim.Lion(params, lr=LR, weight_decay=0.1, **flags)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            oracle.run(optimizer, params, oracle.grad_sequence(shapes, 3))
        assert not fallback_warnings(record)
        runs.append(params)
    for a, b in zip(*runs):
        differ = ~torch.isclose(a, b, rtol=1e-6, atol=1e-6)
        assert differ.float().mean() <= 1e-3  # a sign within rounding of 0, at most


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tensor_lr_changed_in_place_is_read_at_every_step(engine):
    """A scheduler sets a tensor lr in place: every step (and its weight decay, 1 − lr·wd) reads the
    new value, as a float lr set in the group would be."""
    shapes = [(7,), (CHUNK_NUMEL + 1,), (5, 3)]
    grads = oracle.grad_sequence(shapes, 4)
    runs = []
    for tensor_lr in (False, True):
        params = oracle.make_params(shapes)
        lr = torch.tensor(LR) if tensor_lr else LR
        optimizer = fastoptim.Lion(params, lr=lr, weight_decay=0.5, **ENGINES[engine])
        for step, step_grads in enumerate(grads):
            oracle.run(optimizer, params, [step_grads])
            new_lr = LR * 0.5 ** (step + 1)
            if tensor_lr:
                lr.fill_(new_lr)
            else:
                optimizer.param_groups[0]["lr"] = new_lr
        runs.append(params)
    for a, b in zip(*runs):  # the same signs (the momenta do not depend on lr); 1 − lr·wd may round apart
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# --- 4. state_bits on every engine -----------------------------------------------------------------

BITS_SHAPES = [(96, 80), (50,), (4096,), (3, 2000)]  # (50,) stays fp32 under 8 bits: below MIN_NUMEL


def make(state_bits, engine="loop", shapes=BITS_SHAPES, **options):
    params = oracle.make_params(shapes)
    return params, fastoptim.Lion(params, lr=LR, weight_decay=0.1, state_bits=state_bits, **ENGINES[engine], **options)


def set_grads(params, step):
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def stored_dtypes(optimizer):
    return {state["exp_avg"].dtype for state in optimizer.state.values()}


def neighbours(a, b, dtype):
    """Where the stored values ``a`` and ``b`` are equal or next to each other: 8-bit codes whose indices
    differ by one, bf16 numbers one ulp apart (their bits, as integers, differ by one), or fp32
    numbers a few ulps apart."""
    if dtype == torch.uint8:
        return (a.int() - b.int()).abs() <= 1
    if dtype == torch.bfloat16:
        return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs() <= 1
    return torch.isclose(a, b, rtol=1e-5, atol=1e-6 * max(1e-30, float(b.abs().max())))


@pytest.mark.parametrize("state_bits", [32, 16, 8])
@pytest.mark.parametrize("engine", ["foreach", *FUSED])
def test_every_engine_matches_the_loop_engine_at_every_state_bits(engine, state_bits, steps=4):
    """foreach runs the loop engine's torch ops: the same params and the same stored bytes. A kernel
    computes in other fp32 roundings, which may tip a stored value into its neighbour (the next code,
    the next bf16 number) and, rarely, a sign: each step, at most 0.1% of the elements may differ,
    each by a flipped sign (2·lr), and at most 0.1% of the stored values, each into a neighbour."""
    shapes = BITS_SHAPES + ([(2 * CHUNK_NUMEL + 7233,)] if engine == "fused-multi" else [])
    params, optimizer = make(state_bits, engine, shapes)
    loop_params, loop = make(state_bits, "loop", shapes)
    for step in range(steps):
        set_grads(params, step)
        set_grads(loop_params, step)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            optimizer.step()
        assert not fallback_warnings(record), "the kernels take every state_bits"
        loop.step()
        for param, loop_param in zip(params, loop_params):
            state, loop_state = optimizer.state[param], loop.state[loop_param]
            if engine == "foreach":
                assert torch.equal(param, loop_param)
                assert all(torch.equal(state[key], loop_state[key]) for key in loop_state)
                continue
            differ = ~torch.isclose(param, loop_param, rtol=1e-6, atol=1e-6)
            assert differ.float().mean() <= 1e-3, f"{int(differ.sum())} of {param.numel()} elements differ"
            torch.testing.assert_close((param - loop_param)[differ].abs(), torch.full_like(param[differ], 2 * LR),
                                       rtol=1e-3, atol=1e-6)
            stored, loop_stored = state["exp_avg"], loop_state["exp_avg"]
            assert stored.dtype == loop_stored.dtype
            if stored.dtype in (torch.uint8, torch.bfloat16):
                assert (stored == loop_stored).float().mean() >= 1 - 1e-3
            assert neighbours(stored, loop_stored, stored.dtype).all()
            if "exp_avg_absmax" in loop_state:
                torch.testing.assert_close(state["exp_avg_absmax"], loop_state["exp_avg_absmax"], rtol=1e-6, atol=0)
            with torch.no_grad():
                param.copy_(loop_param)
    assert stored_dtypes(optimizer) == stored_dtypes(loop)


@pytest.mark.parametrize("state_bits", [16, 8])
@pytest.mark.parametrize("engine", ENGINES)
def test_low_bit_momenta_stay_close_to_fp32_ones(engine, state_bits, steps=6):
    """Against fp32 Lion on the same engine: each step rounds the momentum (by at most 1/16 of it for
    8 bits, 2⁻⁹ for bf16), so the momenta stay within about that of each other, and only a few signs,
    hence a few params, differ (about 1% for 8 bits, 0.1% for bf16, here); but some do."""
    params, optimizer = make(state_bits, engine)
    full_params, full = make(32, engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            for ps, opt in ((params, optimizer), (full_params, full)):
                set_grads(ps, step)
                opt.step()
    relative = 1 / 16 if state_bits == 8 else 2.0**-8
    differ = 0
    for param, full_param in zip(params, full_params):
        low, high = dense_exp_avg(optimizer, param), full.state[full_param]["exp_avg"]
        agree = torch.isclose(param, full_param, rtol=1e-6, atol=1e-6)
        if optimizer.state[param]["exp_avg"].dtype == torch.float32:  # below MIN_NUMEL under 8 bits
            assert torch.equal(low, high) and agree.all()
            continue
        assert (low - high).norm() <= relative * high.norm()
        assert (low - high).abs().max() <= 2 * relative * high.abs().max()
        assert agree.float().mean() > 0.98
        differ += int((~agree).sum())
    assert differ > 0  # the low-bit states do change something


@pytest.mark.parametrize("engine", ["foreach", *FUSED])
def test_an_8_bit_state_dict_moves_between_engines_and_resumes(engine):
    params, optimizer = make(8)
    for step in range(3):
        set_grads(params, step)
        optimizer.step()
    saved = optimizer.state_dict()
    resumed_params, resumed = make(8, engine)
    with torch.no_grad():
        for p, q in zip(resumed_params, params):
            p.copy_(q)
    resumed.load_state_dict(saved)
    for p, q in zip(resumed_params, params):
        assert all(torch.equal(resumed.state[p][key], optimizer.state[q][key]) for key in optimizer.state[q])
    for ps, opt in ((params, optimizer), (resumed_params, resumed)):
        set_grads(ps, 3)
        opt.step()
    for p, q in zip(resumed_params, params):
        differ = ~torch.isclose(p, q, rtol=1e-6, atol=1e-6)
        assert differ.float().mean() <= 1e-3


# --- 5. GradScaler ---------------------------------------------------------------------------------

def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 80)  # 5120 weights: 8-bit under state_bits=8; 80 biases stay fp32


def scaler_batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=generator), torch.randn(8, 80, generator=generator)) for _ in range(count)]


def snapshot(module, optimizer):
    states = {p: {key: value.clone() for key, value in optimizer.state[p].items()}
              for p in module.parameters() if p in optimizer.state}
    return [p.detach().clone() for p in module.parameters()], states


CLIP_MAXIMIZE = dict(max_grad_norm=0.1, maximize=True)
SCALER_CASES = {"plain": (False, {}, 32), "8-bit": (False, {}, 8), "clip-maximize": (False, CLIP_MAXIMIZE, 32),
                "clip-maximize-8-bit": (False, CLIP_MAXIMIZE, 8), "unscaled-first": (True, {}, 32)}


@pytest.mark.parametrize("case", SCALER_CASES)
@pytest.mark.parametrize("inf_step", [0, 2])
@pytest.mark.parametrize("engine", ENGINES)
def test_grad_scaler_skips_an_inf_step_as_if_it_never_happened(engine, inf_step, case):
    """The skipped step leaves params and states as they were (no state is created by a skipped first
    step), and the run ends where one that never saw the inf batch does. The scale halves after the
    inf step: a Lion that did not unscale would then mix momenta of one scale with grads of another."""
    unscale_first, options, state_bits = SCALER_CASES[case]  # unscale_(): GradScaler unscales, the step skips
    data = scaler_batches(5)
    options = dict(lr=LR, weight_decay=0.1, state_bits=state_bits, **options, **ENGINES[engine])
    net = model()
    optimizer = fastoptim.Lion(net.parameters(), **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            scaler.scale(loss * math.inf if i == inf_step else loss).backward()
            if unscale_first:
                scaler.unscale_(optimizer)
            before = snapshot(net, optimizer)
            scaler.step(optimizer)
            scaler.update()
            if i == inf_step:
                after = snapshot(net, optimizer)
                assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), "the inf step changed params"
                assert before[1].keys() == after[1].keys(), "the inf step created states"
                assert all(torch.equal(before[1][p][k], after[1][p][k]) for p in before[1] for k in before[1][p])
    assert not fallback_warnings(record)
    assert scaler.get_scale() == 2.0**9  # one backoff
    if state_bits == 8:
        assert optimizer.state[net.weight]["exp_avg"].dtype == torch.uint8

    reference = model()
    reference_optimizer = fastoptim.Lion(reference.parameters(), **options)
    for i, (x, y) in enumerate(data):
        if i != inf_step:
            reference_optimizer.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(net.parameters(), reference.parameters()):
        for key, value in reference_optimizer.state[b].items():
            torch.testing.assert_close(optimizer.state[a][key], value, rtol=1e-6, atol=1e-7)


# --- 6. stochastic rounding of bf16 params ---------------------------------------------------------

def bf16_neighbours(x):
    """The bf16 numbers on either side of the fp32 ``x`` (both ``x`` where it is one): toward zero,
    and one ulp further from it."""
    toward_zero = (x.view(torch.int32) & -(1 << 16)).view(torch.float32)
    away = torch.where(toward_zero == x, x, (toward_zero.view(torch.int32) + (1 << 16)).view(torch.float32))
    return toward_zero, away


def bf16_ulp(x):
    """The distance from the bf16 |x| to the next bf16 number away from zero."""
    magnitude = x.abs().to(torch.bfloat16)
    return (magnitude.view(torch.int16) + 1).view(torch.bfloat16).float() - magnitude.float()


@pytest.mark.parametrize("engine", ENGINES)
def test_stochastic_rounding_picks_one_of_the_two_bf16_neighbours_of_the_fp32_result(engine):
    """Each step from the same bf16 params, with the same grads: the stochastic result is within one
    bf16 ulp of the engine's own round-to-nearest result, and is one of the two bf16 numbers around
    the fp32 result (an fp32 Lion's, started from the same values), rounded away from zero about as
    often as the fp32 result's place between them says (unbiased). The momenta do not depend on the
    params, so the three runs keep the same ones."""
    shapes = [(2000,), (7, 9), (33,)]
    options = dict(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0)
    torch.manual_seed(0)
    params = oracle.make_params(shapes, torch.bfloat16)
    nearest_params = clone(params)
    shadow = [torch.nn.Parameter(p.detach().float()) for p in params]
    stochastic = fastoptim.Lion(params, stochastic_rounding=True, **options, **ENGINES[engine])
    nearest = fastoptim.Lion(nearest_params, **options, **ENGINES[engine])
    reference = fastoptim.Lion(shadow, **options, foreach=False)
    rounded_up = expected_up = rounded = 0.0
    for grads in oracle.grad_sequence(shapes, 4):
        grads = [g.to(torch.bfloat16) for g in grads]
        with torch.no_grad():
            for p, q, s in zip(params, nearest_params, shadow):
                q.copy_(p)
                s.copy_(p)
        oracle.run(stochastic, params, [grads])
        oracle.run(nearest, nearest_params, [grads])
        oracle.run(reference, shadow, [[g.float() for g in grads]])
        for p, q, s in zip(params, nearest_params, shadow):
            result, to_nearest, x = p.detach().float(), q.detach().float(), s.detach()
            assert ((result - to_nearest).abs() <= torch.maximum(bf16_ulp(result), bf16_ulp(to_nearest))).all()
            lower, upper = bf16_neighbours(x)
            on_grid = (result == lower) | (result == upper)
            if engine in FUSED:  # the kernel's fp32 result may be an ulp (rarely a sign) from the loop engine's
                assert on_grid.float().mean() > 0.999
            else:
                assert on_grid.all() and torch.equal(q.detach(), x.to(torch.bfloat16))
                assert torch.equal(stochastic.state[p]["exp_avg"], reference.state[s]["exp_avg"])
            between = on_grid & (lower != upper)
            rounded += float(between.sum())
            rounded_up += float((result == upper)[between].sum())
            expected_up += float(((x - lower) / (upper - lower))[between].sum())
    assert rounded > 5000  # the updates are not on the bf16 grid: almost every element rounds
    # the count rounded away from zero is its expectation, within 5 standard deviations (at most √E)
    assert abs(rounded_up - expected_up) < 5 * math.sqrt(expected_up) + 1
    assert 0.2 * rounded < rounded_up < 0.8 * rounded  # neither always down nor always up


# Bad input (hyperparameters, betas, state_bits, sn, other optimizers' state dicts) is refused by the
# generic tests of tests/test_bad_input.py, and a non-finite gradient element is contained by those of
# tests/test_adversarial.py, which read tests/registry.py.
