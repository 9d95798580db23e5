"""The fused Triton engine, against the loop engine. Without a GPU its kernels run on CPU tensors in
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py), with ``FASTOPTIM_FUSED_BACKEND=triton``;
with one they also run on CUDA tensors. Sizes stay small: the interpreter runs each program in numpy.
Tiles are 1024 elements, so sizes like 2500 have full tiles and a masked tail."""
import copy
import json
import math
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastoptim
from fastoptim import cli
from fastoptim.bench import command as bench_command
from fastoptim.engines.backends.triton import fused_triton

from . import oracle
from . import test_state_bits as state_bits
from .registry import OPTIMIZERS
from . import test_compile, test_fused, test_master_bits
from .test_fused import FUSED, LOOP, assert_params_match_loop, clone, fallback_warnings

triton = pytest.importorskip("triton", reason="Triton is an optional extra: pip install fastoptim[triton]")
# CPU tensors run Triton's kernels in its interpreter alone, which conftest.py turns on where there is no GPU
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = (["cpu"] if INTERPRETED else []) + (["cuda"] if torch.cuda.is_available() else [])
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors in Triton's kernels need its interpreter "
                                                               "(TRITON_INTERPRET=1); with a GPU, the cuda cases run")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "triton")


@pytest.fixture
def launches(monkeypatch):
    """The kernel launches of the test, as (kernel, number of tensors, programs)."""
    calls, real = [], fused_triton.launch

    def counting(kernel, pointers, n_tensors, work, *args, **kwargs):
        calls.append((kernel, n_tensors, len(work)))
        real(kernel, pointers, n_tensors, work, *args, **kwargs)

    monkeypatch.setattr(fused_triton, "launch", counting)
    return calls


def steps_in_lockstep(make, shapes, dtype, device, engines, steps=2, grads=None):
    """Params and optimizers (``make(params, engine)``) per engine, stepped on the same grads; after
    each step the params of every engine are compared with the loop engine's, then set to them. Two
    steps by default: the second reads every state the first wrote (Adan's previous grad among them),
    and each costs the interpreter seconds."""
    initial = [p.to(device) for p in oracle.make_params(shapes, dtype)]
    runs = {name: clone(initial) for name in ("loop", *engines)}
    optimizers = {name: make(params, name) for name, params in runs.items()}
    for step_grads in grads or oracle.grad_sequence(shapes, steps):
        for params in runs.values():
            for param, grad in zip(params, step_grads):
                param.grad = grad.to(device, dtype)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for optimizer in optimizers.values():
                optimizer.step()
        assert not fallback_warnings(record), [str(w.message) for w in record]
        for name in engines:
            assert_params_match_loop([p.cpu() for p in runs[name]], [p.cpu() for p in runs["loop"]], dtype)
            with torch.no_grad():
                for param, expected in zip(runs[name], runs["loop"]):
                    param.copy_(expected)
    return runs, optimizers


def assert_states_match(optimizers, engines):
    expected = optimizers["loop"].state_dict()["state"]
    for name in engines:
        state = optimizers[name].state_dict()["state"]
        for key, roles in expected.items():
            for role, value in roles.items():
                if torch.is_tensor(value):
                    scale = float(value.abs().max()) if value.numel() else 0.0
                    torch.testing.assert_close(state[key][role].cpu().float(), value.cpu().float(),
                                               rtol=1e-2 if value.dtype == torch.bfloat16 else 1e-5,
                                               atol=1e-6 * scale + 1e-30)


# --- against the loop engine, over drawn shapes, dtypes and options ----------------------------



def drawn_options(info):
    """The options drawn for an optimizer of the registry: betas that fp32 holds exactly, weight
    decay, clipping, maximize, bf16 states, each of its own options at its default or changed, and
    where it keeps a second moment, subset-norm partitions (rows and columns, or a subset size)."""
    drawn = dict(weight_decay=st.sampled_from([0.0, 0.05]), max_grad_norm=st.sampled_from([0.0, 0.5]),
                 maximize=st.booleans(), state_bits=st.sampled_from([32, 16]))
    drawn |= info.drawn_own_options()
    if info.exact_betas:
        drawn["betas"] = st.sampled_from(info.exact_betas)
    else:  # RMSPropSN takes beta2 alone
        drawn["beta2"] = st.sampled_from([0.75, 1 - 2**-7])
    if info.second_moment:
        drawn |= dict(sn=st.booleans(), subset_size=st.sampled_from([None, 64, -1]))
    return st.fixed_dictionaries(drawn)


# Those whose update is not a sign: another fp32 rounding flips a sign of Lion's now and then, by 2·lr;
# test_lion_matches_the_loop_engine below holds Lion's kernel to the loop engine with that allowance.
CONFIGS = {info.name: info for info in OPTIMIZERS if not info.sign_update}
# Rows and columns of subset-norm partitions, tensors of one tile, of full tiles and a masked tail, empty ones.
shapes = st.lists(st.sampled_from([(7,), (5, 3), (40, 70), (70, 40), (3, 900), (2500,), (1024,), (0, 4), (33, 33)]),
                  min_size=1, max_size=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS)
@settings(max_examples=6, deadline=None)
@given(data=st.data(), shapes=shapes, tensor_lr=st.booleans())
def test_every_optimizer_and_option_matches_the_loop_engine(config, device, data, shapes, tensor_lr):
    info = CONFIGS[config]
    if info.batches_matrices and device == "cuda":  # one matrix of each shape: the loop engine's products
        shapes = list(dict.fromkeys(shapes))
    cls, options, dtype = info.cls, data.draw(drawn_options(info)), data.draw(st.sampled_from(info.param_dtypes))
    lr = torch.tensor(0.01, device=device) if tensor_lr else 0.01
    engines = FUSED | {"loop": LOOP}
    _, optimizers = steps_in_lockstep(lambda params, engine: cls(params, lr=lr, **options, **engines[engine]),
                                      shapes, dtype, device, FUSED)
    assert_states_match(optimizers, FUSED)


# --- launches, buckets and the cached tables ----------------------------------------------------

@needs_interpreter
def test_one_launch_per_bucket_whatever_the_tensor_count(launches):
    """150 tensors (torch's multi_tensor_apply would launch twice or more for them, over its 4 KB
    of arguments) in two dtypes: one launch per bucket per step multi-tensor, one per tensor single."""
    shapes = [(3 + i % 5, 7) for i in range(150)]
    make = FUSED | {"loop": LOOP}
    for engine in ("fused-multi", "fused-single"):
        launches.clear()
        initial = oracle.make_params(shapes[:100]) + oracle.make_params(shapes[100:], torch.bfloat16)
        runs = {name: clone(initial) for name in ("loop", engine)}
        optimizers = {name: fastoptim.Adan(params, lr=0.01, **make[name]) for name, params in runs.items()}
        oracle.run(optimizers["loop"], runs["loop"], oracle.grad_sequence(shapes, 1))
        oracle.run(optimizers[engine], runs[engine], oracle.grad_sequence(shapes, 1))
        tensors = [n for _, n, _ in launches]
        assert tensors == ([100, 50] if engine == "fused-multi" else [100] * 100 + [50] * 50)
        for actual, expected in zip(runs[engine], runs["loop"]):
            assert_params_match_loop([actual], [expected], actual.dtype)

@needs_interpreter
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_backend_forced_between_steps_runs_the_next_step(cls, monkeypatch, launches):
    """``FASTOPTIM_FUSED_BACKEND`` changed between steps of one optimizer: each step runs on the backend
    forced then (the plan store drops the plans made under the other, whose tables are its own), and
    the params stay the loop engine's. Adan keeps a count per group, which both backends' tables read."""
    shapes = [(2500,), (40, 70)]
    initial = oracle.make_params(shapes)
    ours, reference = clone(initial), clone(initial)
    optimizer, loop = cls(ours, lr=0.01, **FUSED["fused-multi"]), cls(reference, lr=0.01, **LOOP)
    for step, (backend, grads) in enumerate(zip(("cpu", "triton", "cpu", "triton", "triton"),
                                                oracle.grad_sequence(shapes, 5))):
        monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", backend)
        launched = len(launches)
        oracle.run(optimizer, ours, [grads])
        oracle.run(loop, reference, [grads])
        assert len(launches) == launched + (backend == "triton"), (step, backend)
        assert_params_match_loop(ours, reference, torch.float32)



@needs_interpreter
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("cls", [fastoptim.AdamW, fastoptim.Adan])
def test_a_compiled_step_of_two_buckets_is_the_eager_step(cls, backend):
    """A compiled step of one group of two buckets (fp32 and bf16 params): each bucket's op checks the
    other's tables before it runs, through the backend's ``holds``, which once read Triton's tables as
    the CPU's and raised AttributeError at the first call. Its params and states are the eager step's."""
    eager, traced = test_compile.pair(cls, {}, test_compile.mixed_params)
    torch._dynamo.reset()
    compiled = torch.compile(traced[1].step, backend=backend, fullgraph=True)
    for step in range(3):
        for (params, _), run in ((eager, eager[1].step), (traced, compiled)):
            test_compile.set_grads(params, step)
            run()
    test_compile.assert_same(eager, traced)


@needs_interpreter
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_a_sparse_grad_is_refused_by_name_with_nothing_changed(max_grad_norm):
    """A sparse grad on a bound Triton step, clipped or not: the step names it, as the checked step and
    the CPU's do, and changes nothing. Clipped, it once raised torch's own error from the norm, which
    Python computes for Triton's tables before they check the grads (helper-69)."""
    params = oracle.make_params([(2500,), (40, 70)])
    optimizer = fastoptim.Adan(params, lr=0.01, max_grad_norm=max_grad_norm, **FUSED["fused-multi"])
    oracle.run(optimizer, params, oracle.grad_sequence([(2500,), (40, 70)], 2))
    assert optimizer._plans.bound is not None
    params[-1].grad = params[-1].grad.to_sparse()
    before = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()
    assert all(map(torch.equal, before[0], params))
    assert all(torch.equal(value, optimizer.state_dict()["state"][k][name]) if torch.is_tensor(value)
               else value == optimizer.state_dict()["state"][k][name]
               for k, state in before[1]["state"].items() for name, value in state.items())


@needs_interpreter
def test_the_tables_are_sent_once_and_again_only_when_a_grad_moves():
    params = oracle.make_params([(2500,), (40, 70)])
    optimizer = fastoptim.AdamW(params, lr=0.01, **FUSED["fused-multi"])
    grads = [torch.randn_like(p) for p in params]
    for step in range(3):  # the same grad tensors every step: nothing to send after the first
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        table = next(iter(optimizer._plans.current[0].buckets[0].kernel_split.tables.tables))[2].pointers
        if step == 0:
            first_tables = table.on_device[2:]
    assert table.on_device[2] is first_tables[0] and table.on_device[3] is first_tables[1]
    pointers_before = table.on_device[2].clone()
    params[1].grad = torch.randn_like(params[1])  # a new grad: its pointer is sent, in place
    optimizer.step()
    assert table.on_device[2] is first_tables[0]
    assert not torch.equal(table.on_device[2], pointers_before)
    assert int(table.on_device[2][1, 1]) == params[1].grad.data_ptr()


@needs_interpreter
@pytest.mark.parametrize("change", ["grads re-allocated", "param storage replaced", "state dict loaded",
                                    "unaligned grad"])
def test_the_cache_follows_every_change(change):
    """After each change the engine still matches the loop engine: new grads every step, a param
    whose storage was replaced, states replaced by load_state_dict, and a grad that is a view at
    an odd offset (its chunks take the masked path)."""
    shapes = [(2500,), (40, 70), (7,)]
    grads = oracle.grad_sequence(shapes, 4)
    initial = oracle.make_params(shapes)
    runs = {name: clone(initial) for name in ("loop", "fused-multi")}
    optimizers = {name: fastoptim.Adan(params, lr=0.01, weight_decay=0.02, **(FUSED | {"loop": LOOP})[name])
                  for name, params in runs.items()}
    saved = None
    for step, step_grads in enumerate(grads):
        for name, params in runs.items():
            if step == 2 and change == "param storage replaced":
                params[0].data = params[0].data.clone()
            if step == 2 and change == "state dict loaded":
                optimizers[name].load_state_dict(saved)
            for param, grad in zip(params, step_grads):
                if change == "unaligned grad":
                    buffer = torch.empty(grad.numel() + 1)
                    param.grad = buffer[1:].view(grad.shape).copy_(grad)
                else:
                    param.grad = grad.clone()
            optimizers[name].step()
        if step == 0:
            saved = optimizers["loop"].state_dict()
        assert_params_match_loop(runs["fused-multi"], runs["loop"], torch.float32)


@needs_interpreter
def test_unaligned_streams_take_the_masked_path():
    """A param at an odd offset in its storage is dense but not 16-byte aligned: its work rows say so."""
    storage = torch.zeros(2501)
    param = torch.nn.Parameter(storage[1:])
    with torch.no_grad():
        param.copy_(torch.randn(2500))
    reference = param.detach().clone().requires_grad_()
    optimizer = fastoptim.AdamW([param], lr=0.01, **FUSED["fused-multi"])
    loop = fastoptim.AdamW([reference], lr=0.01, **LOOP)
    grad = torch.randn(2500)
    param.grad, reference.grad = grad.clone(), grad.clone()
    optimizer.step()
    loop.step()
    table = optimizer._plans.current[0].buckets[0].kernel_split.tables.tables[0][2].pointers
    assert not table.on_device[1][:, 5].any()
    assert_params_match_loop([param], [reference], torch.float32)
    assert storage[0] == 0


# --- GradScaler, stochastic rounding, fallbacks and errors -----------------------------------

@needs_interpreter
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_grad_scale_and_found_inf_are_read_in_the_kernel(cls, launches):
    """GradScaler's attributes: the scale divides the grads inside the kernel, and a found inf
    skips the step on the device (the kernel still launches: no host sync decides it)."""
    shapes = [(2500,), (40, 70)]
    params, reference = oracle.make_params(shapes), oracle.make_params(shapes)
    optimizer = cls(params, lr=0.01, max_grad_norm=0.5, **FUSED["fused-multi"])
    unscaled = cls(reference, lr=0.01, max_grad_norm=0.5, **LOOP)
    for step, grads in enumerate(oracle.grad_sequence(shapes, 3)):
        inf = step == 1
        optimizer.grad_scale = torch.tensor(1024.0)
        optimizer.found_inf = torch.tensor(float(inf))
        for param, ref, grad in zip(params, reference, grads):
            param.grad, ref.grad = grad * 1024, grad.clone()
        optimizer.step()
        if not inf:
            unscaled.step()
        assert_params_match_loop(params, reference, torch.float32)
    assert len(launches) == 3


@needs_interpreter
def test_stochastic_rounding_draws_the_c_kernels_random_bits():
    """bf16 params, stochastic rounding: the Triton kernel rounds with the same counter-based random
    bits as the C kernel, so the two agree wherever their fp32 results do (they may differ in the
    last bit, by the C kernel's fused multiply-adds)."""
    shapes = [(2500,), (40, 70)]
    results = {}
    for backend in ("cpu", "triton"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("FASTOPTIM_FUSED_BACKEND", backend)
            torch.manual_seed(0)
            params = oracle.make_params(shapes, torch.bfloat16)
            optimizer = fastoptim.AdamW(params, lr=1e-3, stochastic_rounding=True, **FUSED["fused-multi"])
            oracle.run(optimizer, params, oracle.grad_sequence(shapes, 3))
            results[backend] = torch.cat([p.detach().flatten() for p in params])
    nearest = oracle.make_params(shapes, torch.bfloat16)
    oracle.run(fastoptim.AdamW(nearest, lr=1e-3, **FUSED["fused-multi"]), nearest, oracle.grad_sequence(shapes, 3))
    nearest = torch.cat([p.detach().flatten() for p in nearest])
    same = (results["cpu"] == results["triton"]).float().mean()
    assert same > 0.99, f"only {same:.3f} of the elements agree"
    assert (results["triton"] != nearest).float().mean() > 0.05  # it does round stochastically


@needs_interpreter
@pytest.mark.parametrize("cls, options, engine", [(cls, {}, "fused-multi") for cls in state_bits.ROUNDED_ALIKE]
                         + [(fastoptim.AdamW, {"amsgrad": True}, "fused-multi"),
                            (state_bits.ROUNDED_ALIKE[0], {}, "fused-single")])
def test_8_bit_states_match_the_loop_engine(cls, options, engine):
    """8-bit moments dequantized, updated and requantized per 256-element block inside the kernel:
    dense params, subset-norm rows (96, 80) and columns (3, 2000) with their fp32 second moments,
    and a small param whose states stay fp32, all in one launch (and, for one optimizer, a launch per
    tensor: the same kernels, each case seconds in the interpreter). Two steps: the second dequantizes
    the codes the first wrote."""
    params, optimizer = state_bits.make(cls, 8, engine, **options)
    loop_params, loop = state_bits.make(cls, 8, "loop", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to foreach would warn
        state_bits.run(params, optimizer, 2)
    state_bits.run(loop_params, loop, 2)
    for param, loop_param in zip(params, loop_params):
        torch.testing.assert_close(param, loop_param, rtol=1e-5, atol=1e-6)
        states, loop_states = state_bits.dense_states(optimizer, param), state_bits.dense_states(loop, loop_param)
        for key, value in states.items():
            assert optimizer.state[param][key].dtype == loop.state[loop_param][key].dtype
            torch.testing.assert_close(value, loop_states[key], rtol=1e-5, atol=1e-6 * float(value.abs().max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{}, dict(maximize=True, max_grad_norm=0.5)], ids=["plain", "maximize-clip"])
@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lion_matches_the_loop_engine(dtype, bits, options, device, launches):
    """Lion's per-element function in the shared walks: full and masked dense tiles, 8-bit blocks
    ((5000,) keeps 8-bit codes under state_bits=8; the smaller params keep fp32 states, in a launch of
    their own), weight decay, and maximize and the clip coefficient in grad_scale, step by step against
    the loop engine; the momentum too."""
    shapes = [(5000,), (40, 70), (7,)]
    engines = FUSED | {"loop": LOOP}
    runs, optimizers = steps_in_lockstep(
        lambda params, engine: fastoptim.Lion(params, lr=0.01, betas=(0.875, 1 - 2**-7), weight_decay=0.1,
                                              state_bits=bits, **options, **engines[engine]),
        shapes, dtype, device, FUSED)
    assert launches and {spec.name for spec, _, _ in launches} == {"lion"}
    expected_dtype = {32: torch.float32, 16: torch.bfloat16, 8: torch.uint8}[bits]
    for name in FUSED:
        for param, loop_param in zip(runs[name], runs["loop"]):
            state = optimizers[name].state[param]
            assert state["exp_avg"].dtype == (expected_dtype if param.numel() >= 4096 or bits == 16
                                              else torch.float32)
            assert state["exp_avg"].dtype == optimizers["loop"].state[loop_param]["exp_avg"].dtype
            value = state_bits.dense_states(optimizers[name], param)["exp_avg"].cpu()
            expected = state_bits.dense_states(optimizers["loop"], loop_param)["exp_avg"].cpu()
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    params = oracle.make_params([(50,)])
    optimizer = fastoptim.AdamW(params, lr=0.01, **FUSED["fused-multi"])
    params[0].grad = torch.randn(50)
    with pytest.warns(UserWarning, match="only in its interpreter"):
        optimizer.step()


def test_an_unknown_backend_is_refused_before_anything_changes(monkeypatch):
    params = oracle.make_params([(50,)])
    before = params[0].detach().clone()
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FASTOPTIM_FUSED_BACKEND='cuda': expected one of"):
        fastoptim.Adan(params, lr=0.01, fused=True)
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "triton")
    optimizer = fastoptim.Adan([{"params": params}], lr=0.01, fused=True)
    params[0].grad = torch.randn(50)
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "gpu")
    with pytest.raises(ValueError, match="FASTOPTIM_FUSED_BACKEND='gpu'"):
        optimizer.step()
    assert torch.equal(params[0].detach(), before) and not optimizer.state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_step_picks_triton_by_itself(monkeypatch, launches):
    monkeypatch.delenv("FASTOPTIM_FUSED_BACKEND")
    params = [p.cuda() for p in oracle.make_params([(2500,)])]
    params = [torch.nn.Parameter(p) for p in params]
    optimizer = fastoptim.Adan(params, lr=0.01)
    params[0].grad = torch.randn_like(params[0])
    optimizer.step()
    assert launches and not math.isnan(float(params[0].sum()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, benchmarks/gpu.sh runs the benchmark itself")
def test_the_gpu_benchmark_runs_its_fused_engines_in_the_interpreter(tmp_path, launches):
    """The code path of ``fastoptim bench --device cuda`` for fastoptim's engines, on a tiny model's CPU
    tensors in the interpreter: what only a GPU adds is CUDA's clock and memory counters. One of its
    rows, the cheapest in the interpreter (10 s; an 8-bit one 30: the kernels' paths are the other
    tests'), and every row's name known to the bench."""
    from fastoptim.bench import run as harness
    assert set(bench_command.GPU_OURS) <= set(harness.optimizers())
    chosen = ["adamw-fused-multi"]
    assert set(chosen) <= set(bench_command.GPU_OURS)
    cli.main(["bench", "--models", "gpt2-tiny", "--optimizers", *chosen, "--steps", "1",
              "--repeats", "1", "--no-memory", "--random-grads", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["models"][0]["optimizers"]
    assert [row["optimizer"] for row in rows] == chosen
    assert all(row["status"] == "ok" for row in rows), rows
    assert {spec.name for spec, _, _ in launches} == {"adamw"}


@needs_interpreter
def test_a_step_sends_nothing_to_the_device_once_warmed_up(monkeypatch):
    """What lets a step be captured in a CUDA graph: after the first step, the same grads and
    scalars send nothing (no pointer table, no numbers); tensor values stay tensors."""
    params = oracle.make_params([(2500,), (40, 70)])
    optimizer = fastoptim.Adan(params, lr=torch.tensor(0.01), max_grad_norm=0.5, **FUSED["fused-multi"])
    grads = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer.step()
    sent, real_tensor = [], torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: sent.append(a) or real_tensor(*a, **k))
    for _ in range(2):
        optimizer.step()
    assert not sent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_a_cuda_graph_replays_the_step(cls):
    """Warm up on a side stream, capture one step, replay it on new grads: the eager run's result."""
    shapes = [(2500,), (40, 70)]
    params = [torch.nn.Parameter(p.cuda()) for p in oracle.make_params(shapes)]
    eager = [torch.nn.Parameter(p.cuda()) for p in oracle.make_params(shapes)]
    options = dict(lr=torch.tensor(0.01, device="cuda"), max_grad_norm=0.5)
    optimizer, reference = cls(params, **options, **FUSED["fused-multi"]), cls(eager, **options, **LOOP)
    grads = oracle.grad_sequence(shapes, 6)
    static = [g.cuda() for g in grads[0]]
    for param, grad in zip(params, static):
        param.grad = grad
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step_grads in grads[:3]:
            for grad, new in zip(static, step_grads):
                grad.copy_(new)
            optimizer.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    for step_grads in grads[3:]:
        for grad, new in zip(static, step_grads):
            grad.copy_(new)
        graph.replay()
    oracle.run(reference, eager, [[g.cuda() for g in step] for step in grads])
    assert_params_match_loop([p.cpu() for p in params], [p.cpu() for p in eager], torch.float32)



@needs_interpreter
@pytest.mark.parametrize("info", [info for info in OPTIMIZERS if str(info) in ("Adan", "AdamWSN", "MuonWithCompanions")],
                         ids=str)
def test_a_default_device_set_by_the_user_changes_nothing_in_triton(info):
    """Three of the optimizers, between them every kind of state the kernels make (a per-group count,
    subset norms, Muon's direction buffers): each costs the interpreter seconds."""
    test_fused.test_a_default_device_set_by_the_user_changes_nothing(info)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info, engine", [(info, "fused-multi") for info in OPTIMIZERS] + [(OPTIMIZERS[0], "fused-single")],
                         ids=str)
def test_master_bits_32_is_the_fp32_run_bit_for_bit_in_triton(info, engine, device):
    """bf16 params with 16-bit remainders on the Triton kernel, with 8-bit states, clipping, maximize
    and sn: the kernel's own fp32 run, bit for bit (tests/test_master_bits.py: the 8-bit remainder).
    Every optimizer in one launch per bucket, and Adan in one per tensor (the same kernels). Two steps:
    the second starts from the remainders the first wrote (each step costs the interpreter seconds)."""
    test_master_bits.assert_master_is_the_fp32_run(info.cls, [(64, 80), (5000,), (7,)], 2, device, lr=1e-2,
                                                   **FUSED[engine], **info.variant())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA test")
@pytest.mark.parametrize("info", OPTIMIZERS, ids=str)
def test_a_cuda_step_never_waits_for_the_gpu(info):
    """With an lr that changes every step and grads made afresh (new scalars, maybe new pointers), a
    step sends its scalars and tables from pinned memory: nothing in it waits for the GPU's queued
    work (a copy from pageable memory did, at each step of a learning-rate schedule)."""
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda")) for shape in [(64, 80), (5000,), (7,)]]
    optimizer = info.cls(params, lr=1e-3, fused=True)
    for step in range(4):
        for param in params:
            param.grad = torch.randn_like(param)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * (step + 1)
        if step > 0:  # the first step makes the states and compiles the kernels
            torch.cuda.set_sync_debug_mode("error")
        try:
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [fastoptim.Adan])  # the walk is the algorithms' (seconds a case in the interpreter)
def test_8_bit_column_subsets_in_runs_of_whole_blocks_match_the_loop_engine(cls, device, launches, monkeypatch):
    """A column-subset param whose rows are whole 256-element blocks (24 × 768) with 8-bit states: the
    kernel takes it in three runs of 256 columns, each program walking its rows' segments (on an H200,
    one program per such tensor made GPT-2 124M's step 12× slower); the loop engine's results."""
    monkeypatch.setattr("fastoptim.engines.backends.triton.COLUMN_NUMEL", 24 * 256)  # a chunk of 256 of its 24-row columns
    engines = FUSED | {"loop": LOOP}
    runs, optimizers = steps_in_lockstep(
        lambda params, engine: cls([{"params": params[:1], "sn": True}, {"params": params[1:]}], lr=0.01,
                                   state_bits=8, **engines[engine]), [(24, 768), (5000,)], torch.float32, device,
        FUSED)
    state = optimizers["fused-multi"].state[runs["fused-multi"][0]]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_sq"].shape == (1, 768)  # 8-bit, per column
    assert max(programs for _, _, programs in launches) == 3


def test_the_interpreter_turned_on_after_import_is_refused_as_off(monkeypatch):
    """The kernels are made for the interpreter where it is on at import: turned on later, CPU tensors reached
    compiled kernels, which raised Triton's "0 active drivers" (helper-102). They take foreach, with the reason."""
    monkeypatch.setattr(fastoptim.engines.backends.triton, "INTERPRETED", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    params = oracle.make_params([(50,)])
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    optimizer = fastoptim.AdamW(params, lr=0.01, **FUSED["fused-multi"])
    reference = fastoptim.AdamW(twin, lr=0.01, foreach=True, fused=False)
    params[0].grad = torch.randn(50)
    twin[0].grad = params[0].grad.clone()
    with pytest.warns(UserWarning, match="set before fastoptim is imported"):
        optimizer.step()
    reference.step()
    assert torch.equal(params[0], twin[0])


@needs_interpreter
@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.9])
def test_adamw_first_moment_is_torchs_lerp_bit_for_bit(beta1):
    """As the C kernel's (test_fused): torch's lerp_, whose two branches are each one FMA."""
    for layout in ("dense", "sn columns"):
        test_fused.test_adamw_fused_first_moment_is_torchs_lerp_bit_for_bit(beta1, "fused-multi", layout)


@needs_interpreter
@pytest.mark.parametrize("sn", [False, True])
def test_amsgrad_keeps_a_nan_second_moment_as_torch_maximum_does(sn):
    """tl.maximum drops a NaN (fmax): amsgrad's maximum kept its old value where the grad was NaN, and under sn
    the subset's finite params then stepped by m / eps (1e6) where the loop engine and the C kernel make them
    NaN (helper-110)."""
    results = []
    for flags in (LOOP, FUSED["fused-multi"]):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 128).reshape(8, 16))
        optimizer = fastoptim.AdamW([param], lr=1e-2, amsgrad=True, sn=sn, **flags)
        param.grad = torch.linspace(-2, 2, 128).reshape(8, 16)
        param.grad[0, 0] = float("nan")
        optimizer.step()
        results.append((param.detach().clone(), optimizer.state[param]["max_exp_avg_sq"].clone()))
    for loop, triton in zip(*results):
        assert torch.equal(loop.isnan(), triton.isnan()) and torch.allclose(loop.nan_to_num(), triton.nan_to_num())
