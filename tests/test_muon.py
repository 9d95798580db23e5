"""fastoptim.Muon: the loop engine against torch.optim.Muon (every option), the AdamW companions
against fastoptim.AdamW, 3-D and flattened params against torch's Muon on their matrices, every
engine against the loop engine (hypothesis), low-bit momenta, master weights, GradScaler, state
dicts (torch's Muon checkpoints included), torch.compile, and bad input."""
import copy
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastoptim
from fastoptim import engines
from fastoptim.engines import foreach
from fastoptim.optimizers import muon, muon_parts
from fastoptim.states import blockwise8

from .test_fused import ENGINES, FUSED

STEPS = 4
# Two matrices of one shape (a batch on the batched engines), a tall, a wide and a square one.
SHAPES = [(24, 16), (24, 16), (40, 12), (12, 40), (20, 20)]
TORCH_OPTIONS = [dict(), dict(nesterov=False), dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.0),
                 dict(momentum=0.5, lr=0.02, weight_decay=0.3), dict(ns_steps=2, ns_coefficients=(2.0, -1.5, 0.5)),
                 dict(eps=10.0),  # eps above the norms: the floor is what each matrix is divided by
                 dict(lr=0.03), dict(lr=0.03, adjust_lr_fn="match_rms_adamw"),  # a tensor lr·factor rounds in fp32
                 dict(lr=0.03, adjust_lr_fn="spectral_unclamped")]  # torch 2.15's


def torch_takes(options):
    """Whether the installed torch.optim.Muon takes ``options`` (adjust_lr_fn="spectral_unclamped": torch 2.15 on)."""
    try:
        torch.optim.Muon(make_params(), **options)
    except ValueError:
        return False
    return True


def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def grads_of(params, steps=STEPS, seed=1, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=generator) * scale for p in params] for _ in range(steps)]


def run(optimizer, params, grads_per_step, view=None):
    """Steps ``optimizer`` with each step's grads (viewed by ``view``, param by param, if given)."""
    for grads in grads_per_step:
        for param, grad in zip(params, grads):
            param.grad = (grad if view is None else view(grad, param)).to(param.dtype)
        optimizer.step()
    return params


def stepped(cls, params, grads_per_step, view=None, **options):
    """Copies of ``params`` after ``cls(copies, **options)`` took the steps (warnings kept out)."""
    copies = clone(params)
    with warnings.catch_warnings(record=True):
        return run(cls(copies, **options), copies, grads_per_step, view)


def assert_equal(actual, expected):
    for a, e in zip(actual, expected):
        assert torch.equal(a.detach(), e.detach())


def test_defaults_are_torchs():
    import inspect
    ours, torchs = inspect.signature(fastoptim.Muon).parameters, inspect.signature(torch.optim.Muon).parameters
    for name in torchs:
        assert ours[name].default == torchs[name].default, name


# a half-precision tensor lr times a factor: torch computes in fp32 and rounds once (helper-104: the factor was
# rounded to the lr's dtype first, a second rounding)
@pytest.mark.parametrize("lr_dtype", [None, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", TORCH_OPTIONS, ids=str)
@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_steps_as_torch_muon(engine, options, lr_dtype):
    if not torch_takes(options):
        pytest.skip(f"torch {torch.__version__}'s Muon does not take {options}")
    params = make_params()
    grads = grads_of(params)
    lr = options.get("lr", 1e-3)
    options = options | (dict(lr=torch.tensor(lr, dtype=lr_dtype)) if lr_dtype else {})
    expected = stepped(torch.optim.Muon, params, grads, **options)
    assert_equal(stepped(fastoptim.Muon, params, grads, **options, **ENGINES[engine]), expected)


def test_maximize_is_torch_muon_on_the_negated_grads():
    params = make_params()
    grads = grads_of(params)
    expected = stepped(torch.optim.Muon, params, [[-g for g in step] for step in grads])
    assert_equal(stepped(fastoptim.Muon, params, grads, maximize=True), expected)


def test_clipping_is_torch_muon_after_clip_grad_norm():
    params = make_params()
    grads = grads_of(params, scale=3.0)
    reference = clone(params)
    torch_opt = torch.optim.Muon(reference)
    for step in grads:
        for param, grad in zip(reference, step):
            param.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(reference, 1.0)
        torch_opt.step()
    ours = clone(params)
    for a, e in zip(run(fastoptim.Muon(ours, max_grad_norm=1.0), ours, grads), reference):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_clipping_takes_torch_s_eps_whatever_the_groups_order(engine):
    """The clip added the last group's eps to the norm: a Muon group's Newton-Schulz floor, or a companion's
    AdamW eps, by the order the groups were listed in (helper-98). It takes clip_grad_norm_'s 1e-6."""
    runs = []
    for reverse in (False, True):
        generator = torch.Generator().manual_seed(0)
        matrix, bias = (torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((8, 8), (8,)))
        groups = [{"params": [matrix]}, {"params": [bias], "use_muon": False}]
        opt = fastoptim.Muon(groups[::-1] if reverse else groups, lr=0.02, max_grad_norm=1e-6, **ENGINES[engine])
        for step in range(2):
            for param in (matrix, bias):
                param.grad = torch.randn(param.shape, generator=generator) * 1e-5  # a norm near the eps
            opt.step()
        runs.append((matrix.detach(), bias.detach()))
    assert all(map(torch.equal, *runs))


def model_groups(params, companions):
    return [{"params": params}, {"params": companions, "use_muon": False, "lr": 3e-3, "betas": (0.8, 0.9),
                                 "adamw_eps": 1e-6, "weight_decay": 0.05}]


@pytest.mark.parametrize("engine", ENGINES)
def test_companion_groups_step_as_adamw_and_matrices_as_torch_muon(engine):
    matrices = make_params()
    companions = make_params([(30,), (50, 8), (5000,)], seed=2)  # a bias, an embedding, a large 1-D param
    grads = grads_of(matrices + companions)
    expected = stepped(torch.optim.Muon, matrices, [g[:len(matrices)] for g in grads], lr=0.02)
    adamw_params = clone(companions)
    adamw = fastoptim.AdamW(adamw_params, lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, **ENGINES[engine])
    run(adamw, adamw_params, [g[len(matrices):] for g in grads])
    ours = clone(matrices) + clone(companions)
    optimizer = fastoptim.Muon(model_groups(ours[:len(matrices)], ours[len(matrices):]), lr=0.02, **ENGINES[engine])
    with warnings.catch_warnings(record=True):
        run(optimizer, ours, grads)
    assert_equal(ours[:len(matrices)], expected)
    assert_equal(ours[len(matrices):], adamw_params)
    for param, peer in zip(ours[len(matrices):], adamw_params):
        assert optimizer.state[param].keys() == adamw.state[peer].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.equal(optimizer.state[param]["exp_avg_sq"], adamw.state[peer]["exp_avg_sq"])
    assert optimizer.state[ours[0]].keys() == {"momentum_buffer"}


def aux_adam_groups(hidden, gains_and_biases, embed_and_head, **eps):
    """Param groups as Keller Jordan's MuonWithAuxAdam examples write them: the hidden matrices with
    Muon, the gains, biases, embedding and head with Adam, whose eps is given as ``eps``."""
    return [dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.01),
            dict(params=gains_and_biases + embed_and_head, use_muon=False, lr=3e-4, betas=(0.9, 0.95),
                 weight_decay=0, **eps)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_muon_with_aux_adam_group_list_trains_as_the_same_groups_with_adamw_eps(engine):
    """A use_muon=False group's eps is AdamW's (adamw_eps is its alias). Small grads, so that eps=1e-10
    steps otherwise than the default 1e-8."""
    hidden, gains_and_biases = make_params([(24, 16), (16, 24)]), make_params([(24,), (16,)], seed=2)
    embed_and_head = make_params([(50, 16), (10, 16)], seed=3)
    params = hidden + gains_and_biases + embed_and_head
    grads = grads_of(params, scale=1e-6)
    runs = {}
    for name, eps in (("eps", dict(eps=1e-10)), ("adamw_eps", dict(adamw_eps=1e-10)), ("default", {})):
        copies = clone(params)
        optimizer = fastoptim.Muon(aux_adam_groups(copies[:2], copies[2:4], copies[4:], **eps), **ENGINES[engine])
        with warnings.catch_warnings(record=True):
            runs[name] = run(optimizer, copies, grads)
        assert optimizer.param_groups[1]["eps"] == optimizer.param_groups[1]["adamw_eps"] == (1e-10 if eps else 1e-8)
        assert optimizer.param_groups[0]["eps"] == 1e-7  # Muon's Newton–Schulz floor
    assert_equal(runs["eps"], runs["adamw_eps"])
    assert_equal(runs["eps"][:2], stepped(torch.optim.Muon, hidden, [g[:2] for g in grads], lr=0.02, weight_decay=0.01))
    adamw = stepped(fastoptim.AdamW, params[2:], [g[2:] for g in grads], lr=3e-4, betas=(0.9, 0.95), eps=1e-10,
                    weight_decay=0, **ENGINES[engine])
    assert_equal(runs["eps"][2:], adamw)
    assert not torch.equal(runs["default"][2], runs["eps"][2])


def test_a_use_muon_false_group_giving_eps_and_adamw_eps_apart_is_refused_and_nothing_changes():
    matrices, biases = make_params(), make_params([(3,)], seed=2)
    apart = dict(params=biases, use_muon=False, eps=1e-10, adamw_eps=1e-8)
    with pytest.raises(ValueError, match="eps: 1e-10 and adamw_eps 1e-08 in a use_muon=False group, where adamw_eps "
                                         "is an alias of eps"):
        fastoptim.Muon([{"params": matrices}, apart])
    optimizer = fastoptim.Muon(matrices)
    given = dict(apart)
    with pytest.raises(ValueError, match="alias of eps"):
        optimizer.add_param_group(apart)
    assert len(optimizer.param_groups) == 1 and apart == given
    optimizer.add_param_group(dict(params=biases, use_muon=False, eps=1e-10, adamw_eps=1e-10))  # both, alike
    assert optimizer.param_groups[1]["eps"] == 1e-10
    # set apart between steps: refused at the step, before anything changes
    for param in matrices + biases:
        param.grad = torch.randn_like(param)
    optimizer.step()
    optimizer.param_groups[1]["eps"] = 1e-6
    params_before, states_before = _snapshot(optimizer)
    with pytest.raises(ValueError, match="eps: 1e-06 and adamw_eps 1e-10 .* set both"):
        optimizer.step()
    params_after, states_after = _snapshot(optimizer)
    assert_equal(params_after, params_before)
    assert all(torch.equal(value, states_after[key][name]) for key, state in states_before.items()
               for name, value in state.items())


def test_a_use_muon_false_group_without_eps_gets_the_constructors_adamw_eps():
    optimizer = fastoptim.Muon([{"params": make_params()}, {"params": make_params([(3,)]), "use_muon": False}],
                               adamw_eps=1e-6)
    assert [group["eps"] for group in optimizer.param_groups] == [1e-7, 1e-6]
    optimizer.add_param_group({"params": make_params([(4,)]), "use_muon": False})
    optimizer.add_param_group({"params": make_params([(5,)]), "use_muon": False, "adamw_eps": 1e-5})
    assert [group["eps"] for group in optimizer.param_groups[2:]] == [1e-6, 1e-5]
    everything = fastoptim.Muon(make_params([(6,)]), use_muon=False, adamw_eps=1e-6)  # use_muon=False for all
    assert everything.param_groups[0]["eps"] == 1e-6


def test_a_companion_eps_resumes_from_a_state_dict_and_older_or_aux_adam_ones_load_it():
    """Before eps was AdamW's in a use_muon=False group, such a group saved the Newton–Schulz floor as
    eps and AdamW's as adamw_eps; MuonWithAuxAdam saves its options alone (eps, no adamw_eps) and int steps."""
    hidden, gains_and_biases = make_params([(24, 16), (16, 24)]), make_params([(24,), (16,)], seed=2)
    embed_and_head = make_params([(50, 16)], seed=3)
    params = hidden + gains_and_biases + embed_and_head
    grads = grads_of(params, steps=4, scale=1e-6)
    straight = clone(params)
    run(fastoptim.Muon(aux_adam_groups(straight[:2], straight[2:4], straight[4:], eps=1e-10)), straight, grads)
    first = clone(params)
    optimizer = fastoptim.Muon(aux_adam_groups(first[:2], first[2:4], first[4:], eps=1e-10))
    run(optimizer, first, grads[:2])
    saved = optimizer.state_dict()
    older = copy.deepcopy(saved)
    older["param_groups"][1] |= {"eps": 1e-7, "adamw_eps": 1e-10}
    aux_adam = copy.deepcopy(saved)
    aux_adam["param_groups"] = [{key: group[key] for key in keys} for group, keys in zip(saved["param_groups"], (
        ("params", "lr", "momentum", "weight_decay", "use_muon"),
        ("params", "lr", "betas", "eps", "weight_decay", "use_muon")))]
    for state in aux_adam["state"].values():
        if "step" in state:
            state["step"] = int(state["step"])
    for state_dict in (saved, older, aux_adam):
        resumed = clone(first)
        loaded = fastoptim.Muon(aux_adam_groups(resumed[:2], resumed[2:4], resumed[4:]))  # eps: 1e-8
        loaded.load_state_dict(state_dict)
        assert loaded.param_groups[1]["eps"] == loaded.param_groups[1]["adamw_eps"] == 1e-10
        run(loaded, resumed, grads[2:])
        assert_equal(resumed, straight)


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("engine", FUSED)
def test_the_fused_engines_run_the_momentum_on_the_kernel_as_foreach_computes_it(engine, state_bits, monkeypatch):
    matrices, companions = make_params([(128, 64), (64, 128), (128, 64)]), make_params([(5000,)], seed=2)
    grads = grads_of(matrices + companions)
    results = {}
    for name, flags in (("foreach", ENGINES["foreach"]), (engine, ENGINES[engine])):
        if name == engine:  # the kernel, and nothing else, computes the momentum now
            for module in (muon, muon_parts):  # the whole update's, and the fused run's
                monkeypatch.setattr(module, "muon_momentum", lambda ops, **kwargs: pytest.fail("muon_momentum ran on ops"))
        params = clone(matrices) + clone(companions)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            run(fastoptim.Muon(model_groups(params[:-1], params[-1:]), state_bits=state_bits, **flags), params, grads)
        results[name] = params
    assert_equal(results[engine][:-1], results["foreach"][:-1])
    torch.testing.assert_close(results[engine][-1], results["foreach"][-1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("form", ["fp32", "bf16", "master_bits=24", "master_bits=32", "weight_decay", "clipped"])
@pytest.mark.parametrize("engine", FUSED)
def test_the_fused_engines_run_the_update_on_the_kernel_as_foreach_computes_it(engine, form, monkeypatch):
    """The update half (``muon_apply``) runs on the kernel, which reads the bf16 directions beside fp32
    or bf16 params (a tall matrix's made contiguous first), with master remainders: bit for bit the
    foreach engine's, and so torch's Muon for fp32 params (test_every_engine_steps_as_torch_muon)."""
    dtype = torch.float32 if form in ("fp32", "weight_decay", "clipped") else torch.bfloat16
    options = dict(lr=0.02, weight_decay=0.1 if form == "weight_decay" else 0.0,
                   max_grad_norm=0.5 if form == "clipped" else 0.0)
    if form.startswith("master_bits"):
        options["master_bits"] = int(form.split("=")[1])
    params = make_params([(40, 24), (24, 40), (24, 40), (16, 16)], dtype)  # tall, wide (two: a batch), square
    grads = grads_of(params)
    foreach = stepped(fastoptim.Muon, params, grads, **options, **ENGINES["foreach"])
    monkeypatch.setattr(muon_parts, "muon_apply", lambda ops, **kwargs: pytest.fail("muon_apply ran on ops"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        fused = stepped(fastoptim.Muon, params, grads, **options, **ENGINES[engine])
    assert_equal(fused, foreach)


@pytest.mark.parametrize("options", [dict(), dict(weight_decay=0.1, nesterov=False), dict(max_grad_norm=0.5),
                                     dict(state_bits=8), dict(scaled=True)], ids=str)
@pytest.mark.parametrize("engine", FUSED)
def test_fp16_params_step_on_the_fused_engines_as_on_the_loop_engine(engine, options):
    """fp16 grads reach the momentum kernel in fp32, so each direction is rounded once, to the iterations'
    bf16, as the loop engine rounds it: written in fp16 first, a direction was rounded twice, and a step
    moved 31 of a 16x8 matrix's 128 elements apart from the loop engine's. One matrix a shape: batches of
    one, which the batched iterations round as the loop's do. Beside an fp32 group, the steps stay bound:
    the bound step converts the fp16 grads as the checked one does (it took the checked way every step,
    helper-80). ``scaled``: under GradScaler's scale (and an inf step skipped)."""
    params = make_params([(16, 8), (8, 8), (4, 12)], torch.float16) + make_params([(8, 4)], seed=3)
    grads = grads_of(params, steps=5, scale=1e-3)  # fp16 subnormals below 6e-5: bits a direction in fp16 drops
    scaled = options.pop("scaled", False)
    runs = []
    for flags in (ENGINES["loop"], ENGINES[engine]):
        copies = clone(params)
        optimizer = fastoptim.Muon([{"params": copies[:3]}, {"params": copies[3:]}], lr=0.02, **options, **flags)
        for index, step_grads in enumerate(grads):
            if scaled:  # as GradScaler hands its inverse scale and found_inf to the step
                optimizer.grad_scale = torch.tensor(1024.0)
                optimizer.found_inf = torch.tensor(float(index == 2))
            for param, grad in zip(copies, step_grads):
                param.grad = (grad * (1024 if scaled else 1)).to(param.dtype)
            optimizer.step()
        runs.append(copies)
    assert optimizer._plans.bound is not None and optimizer._plans.bound.groups[0].parts[0].widen
    assert not any(torch.equal(a, b) for a, b in zip(runs[0], params))
    assert_equal(runs[1], runs[0])


@pytest.mark.parametrize("write", ["bf16", "fp32", "strided", "expanded"])
def test_a_bound_fp16_step_takes_or_refuses_a_grad_as_the_loop_engine(write):
    """The bound step hands fp16 grads to the momentum tables as fp32 copies, which hid a grad of another
    dtype (stepped, where every other way refuses it) and a strided or expanded one (copied contiguous, so
    the native clip summed it apart from the checked step's norm: helper-81): such grads take the checked way,
    which refuses the first two as the loop engine does, with nothing changed, and steps the others as it."""
    params = make_params([(16, 8), (8, 8), (4, 12)], torch.float16) + make_params([(16, 8)], seed=3)
    grads = grads_of(params, steps=3, scale=0.1)
    runs = []
    for flags in (ENGINES["loop"], ENGINES["fused-multi"]):
        copies = clone(params)
        optimizer = fastoptim.Muon([{"params": copies[:3]}, {"params": copies[3:]}], lr=0.02, max_grad_norm=0.05,
                                   **flags)
        for index, step_grads in enumerate(grads):
            for param, grad in zip(copies, step_grads):
                param.grad = grad.to(param.dtype)
            if index == 2 and write in ("bf16", "fp32"):
                # as .data: torch refuses a grad of another dtype assigned as it is
                copies[0].grad.data = copies[0].grad.data.to({"bf16": torch.bfloat16, "fp32": torch.float32}[write])
                before = [p.detach().clone() for p in copies] + [optimizer.state[p]["momentum_buffer"].clone()
                                                                 for p in copies[:3]]
                with pytest.raises(RuntimeError, match="a gradient must match its parameter"):
                    optimizer.step()
                assert_equal([p.detach() for p in copies] + [optimizer.state[p]["momentum_buffer"] for p in copies[:3]],
                             before)
                continue
            if index == 2:
                wide = torch.zeros(16, 16, dtype=torch.float16)
                wide[:, ::2] = step_grads[0].to(torch.float16)
                copies[0].grad = wide[:, ::2] if write == "strided" else step_grads[0][:1].to(torch.float16).expand(16, 8)
            optimizer.step()
        runs.append(copies + [optimizer.state[p]["momentum_buffer"] for p in copies[:3]])
    assert_equal(runs[1], runs[0])


SHARDED_FP16 = """
import sys, torch, torch.distributed as dist, fastoptim
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
generator = torch.Generator().manual_seed(0)
start = torch.randn(64, 48, generator=generator)
grads = [torch.randn(64, 48, generator=generator) * 1e-5 for _ in range(3)]

def stepped(sharded, **flags):
    model = torch.nn.Linear(48, 64, bias=False).half()
    with torch.no_grad():
        model.weight.copy_(start)
    if sharded:
        fully_shard(model, mesh=mesh)
    optimizer = fastoptim.Muon(model.parameters(), lr=0.02, **flags)
    for grad in grads:
        weight = model.weight
        weight.grad = distribute_tensor(grad.half(), mesh, weight.placements) if sharded else grad.half()
        optimizer.step()
    return model.weight.full_tensor() if sharded else model.weight.detach()

loop = stepped(False, foreach=False, fused=False)
print([torch.equal(stepped(True, **flags), loop) for flags in (dict(foreach=True, fused=False), dict(fused=True))])
dist.destroy_process_group()
"""


def test_fp16_params_sharded_by_fsdp2_step_as_on_the_loop_engine(tmp_path):
    """The sharded path's momentum (a bucket of DTensor params, on foreach or the kernel) takes fp16 grads in fp32
    too: on foreach it wrote the directions in fp16, and 1252 of a 64x48 matrix's elements came apart from the
    loop engine's after 3 steps. One rank, in a process of its own (it makes a process group)."""
    run = subprocess.run([sys.executable, "-c", SHARDED_FP16, str(tmp_path / "rendezvous")], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert run.returncode == 0 and run.stdout.split()[-2:] == ["[True,", "True]"], run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("engine", FUSED)
def test_a_param_only_the_update_kernel_refuses_takes_foreach_with_one_warning_a_step(engine):
    """A param given a transposed layout after its first step, whose grads stay contiguous: the momentum
    kernel takes it (its rows are the directions and the grads), the update kernel does not (its
    direction is laid out as the grad), and says so once a step (helper-61 found it silent): such a
    bucket takes the checked way, not the bound step."""
    params = make_params([(40, 24), (24, 40)])
    grads = grads_of(params)
    runs = {}
    for name, flags in (("foreach", ENGINES["foreach"]), (engine, ENGINES[engine])):
        stepped_params = clone(params)
        optimizer = fastoptim.Muon(stepped_params, lr=0.02, **flags)
        caught = []
        for index, step_grads in enumerate(grads):
            if index == 1:
                stepped_params[0].data = stepped_params[0].data.t().contiguous().t()
            for param, grad in zip(stepped_params, step_grads):
                param.grad = grad.clone()
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always")
                optimizer.step()
            caught.append([str(w.message) for w in records if "foreach engine" in str(w.message)])
        runs[name] = stepped_params, caught
        assert optimizer._plans.bound is None
    assert_equal(runs[engine][0], runs["foreach"][0])
    assert [len(messages) for messages in runs[engine][1]] == [0] + [1] * (len(grads) - 1), runs[engine][1]
    assert "not dense with the same strides" in runs[engine][1][-1][0]


@pytest.mark.parametrize("engine", FUSED)
def test_the_update_kernel_rounds_bf16_params_stochastically_within_an_ulp_of_the_fp32_update(engine, monkeypatch):
    """With stochastic rounding, a step lands each param on one of the two bf16 values around the fp32
    result (the master a ``master_bits=32`` twin keeps of the same step), and not always the nearer one."""
    from fastoptim.states import master

    params = make_params([(64, 48)], torch.bfloat16)
    grads = grads_of(params, steps=1)
    twin = clone(params)
    optimizer = fastoptim.Muon(twin, lr=0.02, master_bits=32, **ENGINES[engine])
    run(optimizer, twin, grads)
    exact = master.widen(twin[0].detach(), optimizer.state[twin[0]][master.KEY])
    monkeypatch.setattr(muon_parts, "muon_apply", lambda ops, **kwargs: pytest.fail("muon_apply ran on ops"))
    rounded = stepped(fastoptim.Muon, params, grads, lr=0.02, stochastic_rounding=True, **ENGINES[engine])[0].float()
    spacing = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 8)  # of bf16 values around exact
    assert ((rounded - exact).abs() < spacing).all()  # one of the two bf16 values around it
    assert (rounded != exact.bfloat16().float()).any()  # not always the nearer one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("engine", FUSED)
def test_the_momentum_kernels_tables_are_bound_once_and_step_as_tables_made_anew(engine, dtype, monkeypatch):
    """The directions are views of one buffer the bucket keeps, so the momentum kernel's tables are made
    at the first step alone; steps with and without a GradScaler coefficient (which the CPU kernel takes
    with the grads as they are; a backend that scales them first writes fp32 directions, a buffer of
    another dtype whose making drops the tables) equal, bit for bit, a twin whose tables are made anew
    every step."""
    made = []
    real = engines.fused.KernelSplit
    monkeypatch.setattr(engines.fused, "KernelSplit", lambda *args: made.append(1) or real(*args))
    matrices = make_params([(64, 32), (32, 64), (48, 48)], dtype)
    grads = grads_of(matrices) * 3
    runs = []
    for fresh in (False, True):
        if fresh:  # fresh direction buffers every step, so tables made anew every step (as before they were kept)
            monkeypatch.setattr(muon_parts, "directions_of", lambda part, engine: muon_parts.Directions.of(
                part, muon_parts.direction_dtype(part, engine)))
        params = clone(matrices)
        optimizer = fastoptim.Muon(params, lr=0.02, **ENGINES[engine])
        made.clear()
        for index, step_grads in enumerate(grads):
            scaled = index in (3, 4)  # as GradScaler hands its inverse scale to the step
            optimizer.grad_scale = torch.tensor(0.5) if scaled else None
            optimizer.found_inf = torch.tensor(0.0) if scaled else None
            for param, grad in zip(params, step_grads):
                param.grad = grad.to(dtype)
            optimizer.step()
        runs.append((params, len(made)))
    (bound, made_bound), (anew, made_anew) = runs
    assert_equal(bound, anew)
    assert made_bound < made_anew
    assert made_bound <= 2 * len(FUSED)  # the first step's tables, and the fp32 ones of the scaled steps


@pytest.mark.parametrize("state_bits", [32, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_triton_kernel_runs_the_momentum_as_foreach_computes_it(dtype, state_bits, monkeypatch):
    """On Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py), which rounds no product into
    a sum as a GPU's FMA does: equal to a few ulps of the directions, so of the params."""
    pytest.importorskip("triton", reason="Triton is an optional extra: pip install fastoptim[triton]")
    params = make_params([(96, 64), (64, 96), (48, 48)], dtype)
    grads = grads_of(params)
    foreach = stepped(fastoptim.Muon, params, grads, lr=0.02, state_bits=state_bits, **ENGINES["foreach"])
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "triton")
    for module in (muon, muon_parts):  # the whole update's, and the fused run's: both halves on the kernel
        monkeypatch.setattr(module, "muon_momentum", lambda ops, **kwargs: pytest.fail("muon_momentum ran on ops"))
        monkeypatch.setattr(module, "muon_apply", lambda ops, **kwargs: pytest.fail("muon_apply ran on ops"))
    triton = stepped(fastoptim.Muon, params, grads, lr=0.02, state_bits=state_bits, fused=True)
    for a, b in zip(triton, foreach):
        torch.testing.assert_close(a.float(), b.float(), rtol={torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(
            dtype, 1e-5), atol=2e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_3d_param_is_a_batch_of_matrices_each_as_torch_muon_steps_it(engine):
    experts = make_params([(3, 24, 16), (2, 12, 40)])
    grads = grads_of(experts)
    slices = [torch.nn.Parameter(matrix.detach().clone()) for expert in experts for matrix in expert]
    run(torch.optim.Muon(slices), slices, [[m for g in step for m in g] for step in grads])
    ours = clone(experts)
    with warnings.catch_warnings(record=True):
        run(fastoptim.Muon(ours, **ENGINES[engine]), ours, grads)
    assert_equal([m for expert in ours for m in expert], slices)


ROW_BLOCKS = {  # params, the group's option, and each param's row blocks
    "split_sizes": ([(24, 16), (24, 16), (24, 30)], dict(split_sizes=(8, 4, 4, 8)), [(8, 4, 4, 8)] * 3),
    "num_heads": ([(24, 16), (12, 16)], dict(num_heads=4), [(6,) * 4, (3,) * 4]),
    "3-D num_heads": ([(2, 12, 16)], dict(num_heads=3), [(4,) * 3]),
    "tall heads": ([(48, 16), (60, 12)], dict(num_heads=2, adjust_lr_fn="spectral_unclamped"), [(24, 24), (30, 30)]),
}


@pytest.mark.parametrize("blocks", ROW_BLOCKS)
@pytest.mark.parametrize("engine", ENGINES)
def test_row_blocks_step_as_torch_muon_steps_each_block_as_a_matrix(engine, blocks):
    """Each block is orthogonalized, and steps by its lr factor, as a matrix of its own: bit for bit,
    though the blocks of one size go through the iterations as one batch."""
    shapes, options, sizes = ROW_BLOCKS[blocks]
    params = make_params(shapes)
    grads = grads_of(params)

    def cut(tensors):
        return [block for tensor, rows in zip(tensors, sizes) for matrix in tensor.reshape(-1, *tensor.shape[-2:])
                for block in matrix.split(rows)]
    blocks = [torch.nn.Parameter(block.detach().clone()) for block in cut(params)]
    torch_options = {"adjust_lr_fn": options["adjust_lr_fn"]} if "adjust_lr_fn" in options else {}
    if torch_takes(torch_options):
        run(torch.optim.Muon(blocks, **torch_options), blocks, [cut(step) for step in grads])
    else:  # torch before 2.15: fastoptim's Muon on the blocks as separate params
        blocks = stepped(fastoptim.Muon, blocks, [cut(step) for step in grads], **torch_options)
    ours = stepped(fastoptim.Muon, params, grads, **options, **ENGINES[engine])
    assert_equal(cut(ours), blocks)


def test_orthogonalize_blocks_is_orthogonalize_of_each_block():
    matrices = torch.randn(3, 24, 16, generator=torch.Generator().manual_seed(0))
    coefficients = muon.coefficients(dict(ns_coefficients=muon.DEFAULT_COEFFICIENTS, ns_steps=5))
    for options, sizes in ((dict(num_heads=4), (6,) * 4), (dict(split_sizes=(10, 4, 10)), (10, 4, 10))):
        result = muon_parts.orthogonalize_blocks(matrices, coefficients, 1e-7, **options)
        expected = torch.cat([muon_parts.orthogonalize(block, coefficients, 1e-7) for block in matrices.split(sizes, -2)], -2)
        assert torch.equal(result, expected)


@pytest.mark.parametrize("options, message", [
    (dict(split_sizes=(8, 8)), r"split_sizes: \(8, 8\) sum to 16, and a param of shape \(24, 16\)"),
    (dict(split_sizes=(20, 4)), "blocks whose adjust_lr_fn=None factors differ"),
    (dict(split_sizes=(24, 0)), "non-empty sequence of positive ints"),
    (dict(split_sizes=(30, -6)), "non-empty sequence of positive ints"),
    (dict(split_sizes=()), "non-empty sequence of positive ints"),
    (dict(split_sizes=(12.0, 12)), "non-empty sequence of positive ints"),
    (dict(split_sizes=24), "non-empty sequence of positive ints"),
    (dict(num_heads=5), r"num_heads: 5 does not divide the 24 rows"),
    (dict(num_heads=0), "must be None or a positive int"),
    (dict(num_heads=True), "must be None or a positive int"),
    (dict(num_heads=2, split_sizes=(12, 12)), "give one"),
    (dict(num_heads=2, use_muon=False), "a use_muon=False group"),
])
def test_bad_row_blocks_are_refused_at_construction_and_add_param_group_and_nothing_changes(options, message):
    with pytest.raises(ValueError, match=message):
        fastoptim.Muon(make_params([(24, 16)]), **options)
    optimizer = fastoptim.Muon(make_params([(12, 16)]))
    group = dict(optimizer.param_groups[0])
    with pytest.raises(ValueError, match=message):
        optimizer.add_param_group({"params": make_params([(24, 16)])} | options)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0].keys() == group.keys()
    assert all(optimizer.param_groups[0][key] is value for key, value in group.items())


@pytest.mark.parametrize("engine", ENGINES)
def test_num_heads_set_between_steps_is_followed_and_a_bad_one_refused(engine):
    """As an optimizer made with it that loaded the state of the steps before."""
    later = make_params([(24, 16)])
    grads = grads_of(later)
    optimizer = fastoptim.Muon(later, **ENGINES[engine])
    with warnings.catch_warnings(record=True):
        run(optimizer, later, grads[:2])
        optimizer.param_groups[0]["num_heads"] = 4
        run(optimizer, later, grads[2:])
    reference = make_params([(24, 16)])
    first = fastoptim.Muon(reference, **ENGINES[engine])
    with warnings.catch_warnings(record=True):
        run(first, reference, grads[:2])
        second = fastoptim.Muon(reference, num_heads=4, **ENGINES[engine])
        second.load_state_dict(first.state_dict() | {"param_groups": second.state_dict()["param_groups"]})
        run(second, reference, grads[2:])
    assert_equal(later, reference)
    optimizer.param_groups[0]["num_heads"] = 5
    with pytest.raises(ValueError, match="num_heads: 5 does not divide"):
        run(optimizer, later, grads[:1])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_flatten_takes_a_conv_weight_as_its_first_dim_by_the_rest(engine, channels_last):
    """Whatever its memory layout: a channels_last weight is the same matrix (the loop and foreach
    engines viewed it as one and raised, helper-61)."""
    conv = make_params([(8, 3, 3, 3), (6, 4, 5)])
    grads = grads_of(conv)
    matrices = [torch.nn.Parameter(p.detach().reshape(p.shape[0], -1).clone()) for p in conv]
    run(torch.optim.Muon(matrices), matrices, [[g.reshape(g.shape[0], -1) for g in step] for step in grads])
    ours = clone(conv)
    if channels_last:
        ours[0].data = ours[0].data.contiguous(memory_format=torch.channels_last)
        grads = [[step[0].contiguous(memory_format=torch.channels_last), *step[1:]] for step in grads]
    with warnings.catch_warnings(record=True):
        run(fastoptim.Muon(ours, flatten=True, **ENGINES[engine]), ours, grads)
    assert_equal([p.reshape(p.shape[0], -1) for p in ours], matrices)


@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_spectral_unclamped_steps_each_matrix_by_lr_times_the_root_of_rows_over_cols(engine, tensor_lr):
    """adjust_lr_fn="spectral_unclamped" (torch 2.15): lr·√(rows/cols), below lr for a wide matrix. The
    oracle, for a torch without it: torch's Muon with "original" (factor √(rows/cols) on a tall matrix,
    1 on a wide one) at lr·√(rows/cols), computed here as torch 2.15 computes it, for each wide matrix
    (no weight decay, which reads the group's lr)."""
    params = make_params()
    grads = grads_of(params)
    lr = torch.tensor(0.03) if tensor_lr else 0.03
    wide = [param.shape[0] < param.shape[1] for param in params]
    reference = clone(params)
    groups = [{"params": [p for p, w in zip(reference, wide) if not w]}] + [
        {"params": [p], "lr": lr * math.sqrt(p.shape[0] / p.shape[1])} for p, w in zip(reference, wide) if w]
    run(torch.optim.Muon(groups, lr=lr, weight_decay=0.0), reference, grads)
    ours = stepped(fastoptim.Muon, params, grads, lr=lr, weight_decay=0.0, adjust_lr_fn="spectral_unclamped",
                   **ENGINES[engine])
    assert_equal(ours, reference)
    assert not torch.equal(ours[3], stepped(fastoptim.Muon, params, grads, lr=lr, weight_decay=0.0)[3])  # unclamped


@pytest.mark.parametrize("engine", ENGINES)
def test_adjust_lr_fn_changed_between_steps_is_followed_as_torch_muon_follows_it(engine):
    params = make_params()
    grads = grads_of(params)
    runs = []
    for cls, flags in ((torch.optim.Muon, {}), (fastoptim.Muon, ENGINES[engine])):
        copies = clone(params)
        optimizer = cls(copies, lr=0.02)
        with warnings.catch_warnings(record=True):
            run(optimizer, copies, grads[:2])
            optimizer.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"
            run(optimizer, copies, grads[2:])
        runs.append(copies)
    assert_equal(runs[1], runs[0])


@pytest.mark.parametrize("engine", ENGINES)
def test_flatten_changed_between_steps_is_followed(engine):
    """A (2, 20, 4) param is two 20×4 matrices (lr factor √5), then, with flatten, one 2×80 (factor 1):
    torch's Muon on those matrices, its momentum buffers carried over, steps them alike."""
    param = make_params([(2, 20, 4)])[0]
    grads = grads_of([param])
    slices = [torch.nn.Parameter(matrix.detach().clone()) for matrix in param]
    first = torch.optim.Muon(slices, lr=0.02)
    run(first, slices, [list(step[0]) for step in grads[:2]])
    flat = torch.nn.Parameter(torch.stack([matrix.detach().flatten() for matrix in slices]))
    then = torch.optim.Muon([flat], lr=0.02)
    then.state[flat]["momentum_buffer"] = torch.stack([first.state[s]["momentum_buffer"].flatten() for s in slices])
    run(then, [flat], [[step[0].reshape(2, 80)] for step in grads[2:]])
    ours = clone([param])
    optimizer = fastoptim.Muon(ours, lr=0.02, **ENGINES[engine])
    with warnings.catch_warnings(record=True):
        run(optimizer, ours, grads[:2])
        optimizer.param_groups[0]["flatten"] = True
        run(optimizer, ours, grads[2:])
    assert torch.equal(ours[0].detach().reshape(2, 80), flat.detach())


def _snapshot(optimizer):
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return ([p.detach().clone() for p in params],
            {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params if p in optimizer.state})


@pytest.mark.parametrize("change", ["reshaped to 1-D", "reshaped before its first step", "1-D appended",
                                    "4-D appended", "flatten turned off"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_param_that_stops_being_a_matrix_is_refused_as_the_constructor_refuses_it(engine, change):
    """Refused before anything changes, in the first group or in a good group's company."""
    matrices, companions = make_params(), make_params([(30,)], seed=2)
    if change == "flatten turned off":
        matrices.append(torch.nn.Parameter(torch.randn(4, 3, 2, 2)))
    groups = [{"params": matrices[:2]}, {"params": matrices[2:], "flatten": True}, {"params": companions,
                                                                                     "use_muon": False}]
    optimizer = fastoptim.Muon(groups, **ENGINES[engine])
    everything = matrices + companions

    def step():
        for param in everything:
            param.grad = torch.randn_like(param)
        optimizer.step()

    if change != "reshaped before its first step":
        with warnings.catch_warnings(record=True):
            step()
    group = optimizer.param_groups[1]
    if change.startswith("reshaped"):
        matrices[2].data = matrices[2].data.reshape(-1)
    elif change == "1-D appended":
        group["params"].append(torch.nn.Parameter(torch.randn(6)))
    elif change == "4-D appended":
        group["flatten"] = False
        group["params"].append(torch.nn.Parameter(torch.randn(2, 3, 4, 5)))
    else:
        group["flatten"] = False
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    params_before, states_before = _snapshot(optimizer)
    for param in everything:
        param.grad = torch.randn_like(param)
    with pytest.raises(ValueError, match="Muon orthogonalizes matrices"):
        optimizer.step()
    params_after, states_after = _snapshot(optimizer)
    assert_equal(params_after, params_before)
    assert states_after.keys() == states_before.keys()
    for key, state in states_before.items():
        assert state.keys() == states_after[key].keys()
        assert all(torch.equal(value, states_after[key][name]) for name, value in state.items())


def newton_schulz_per_step(x, coefficients, eps):
    """The iterations with one (a, b, c) per step, one matrix at a time, as torch.optim.Muon writes
    them (torch.addmm in bf16)."""
    x = x.bfloat16()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def test_a_coefficient_schedule_takes_one_triple_per_step():
    schedule = [(8.2, -22.5, 15.9), (4.0, -2.8, 0.5), (3.4445, -4.775, 2.0315)]
    params = make_params()
    grad = grads_of(params, steps=1)[0]
    ours = clone(params)
    run(fastoptim.Muon(ours, lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=3,
                       ns_coefficients=schedule), ours, [grad])
    for param, before, g in zip(ours, params, grad):
        rows, cols = g.shape
        step = torch.tensor(0.1 * max(1, rows / cols) ** 0.5)
        update = newton_schulz_per_step(g, schedule, 1e-7)
        assert torch.equal(param.detach(), before.detach().addcmul(update, step, value=-1))
    fixed, repeated = clone(params), clone(params)
    run(fastoptim.Muon(fixed, ns_steps=3), fixed, [grad])
    run(fastoptim.Muon(repeated, ns_steps=3, ns_coefficients=[muon.DEFAULT_COEFFICIENTS] * 3), repeated, [grad])
    assert_equal(repeated, fixed)


def test_the_orthogonalized_update_has_singular_values_near_one():
    update = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(muon_parts.orthogonalize(update[None], [muon.DEFAULT_COEFFICIENTS] * 5, 1e-7)[0].float())
    assert singular.min() > 0.5 and singular.max() < 1.3


@settings(max_examples=20, deadline=None)
@given(shapes=st.lists(st.sampled_from([(24, 16), (16, 24), (8, 8), (2, 8, 12), (70, 70)]), min_size=1, max_size=5),
       nesterov=st.booleans(), weight_decay=st.sampled_from([0.0, 0.2]), maximize=st.booleans(),
       max_grad_norm=st.sampled_from([0.0, 0.5]), state_bits=st.sampled_from([32, 16, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), engine=st.sampled_from(["foreach", "fused-multi"]))
def test_every_engine_matches_the_loop_engine(shapes, nesterov, weight_decay, maximize, max_grad_norm, state_bits,
                                              dtype, engine):
    params = make_params(shapes, dtype)
    grads = grads_of(params, steps=3)
    options = dict(lr=0.02, nesterov=nesterov, weight_decay=weight_decay, maximize=maximize,
                   max_grad_norm=max_grad_norm, state_bits=state_bits)
    loop, other = clone(params), clone(params)
    run(fastoptim.Muon(loop, foreach=False, fused=False, **options), loop, grads)
    with warnings.catch_warnings(record=True):
        run(fastoptim.Muon(other, **ENGINES[engine], **options), other, grads)
    # A batch of matrices may round the bf16 iterations' products otherwise than the loop's one at a time
    # (the CPU's bf16 matmul picks its kernel by the batch): an ulp of a bf16 param at most; an fp32 param
    # by a bf16 rounding of a step's update (lr-sized), rarely for a 2-D one (with clipped grads and bf16
    # momenta, hypothesis found one of two (16, 24) matrices batched apart, an update 2^-7 of lr off).
    tolerance = dict(rtol=2**-7, atol=0) if dtype == torch.bfloat16 else dict(
        rtol=0, atol=len(grads) * options["lr"] * 2**-6)
    for a, b in zip(other, loop):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), **tolerance)


@pytest.mark.parametrize("state_bits", [16, 8])
def test_low_bit_momenta_stay_close_to_fp32_ones_at_their_bytes(state_bits):
    params = make_params([(128, 96), (64, 64)])
    grads = grads_of(params, steps=6)
    runs = {}
    for bits in (32, state_bits):
        ours = clone(params)
        optimizer = fastoptim.Muon(ours, lr=0.02, state_bits=bits)
        runs[bits] = run(optimizer, ours, grads), optimizer
    (fp32, fp32_opt), (low, low_opt) = runs[32], runs[state_bits]
    for a, b, start in zip(fp32, low, params):
        state, reference = low_opt.state[b], fp32_opt.state[a]["momentum_buffer"]
        if state_bits == 8:
            assert state["momentum_buffer"].dtype == torch.uint8
            momentum = blockwise8.dequantize(state["momentum_buffer"], state["momentum_buffer_absmax"],
                                             blockwise8.LINEAR)
            size = state["momentum_buffer"].nbytes + state["momentum_buffer_absmax"].nbytes
            assert size <= 0.26 * reference.nbytes
        else:
            assert state["momentum_buffer"].dtype == torch.bfloat16
            momentum = state["momentum_buffer"].float()
        relative = 1 / 16 if state_bits == 8 else 2.0**-8  # each step's rounding of the momentum, at most
        assert 0 < (momentum - reference).norm() <= relative * reference.norm()
        # the bf16 iterations may round a slightly different U otherwise, and amplify it a little
        assert 0 < (b - a).norm() <= 4 * relative * (a - start).norm()


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_a_non_finite_gradient_element_stays_in_its_8_bit_momentum_element_on_every_engine(bad, monkeypatch):
    """As in an fp32 momentum: that element turns NaN (linear codes keep ±inf as NaN), and its block's
    255 other elements, and every other, are what the loop engine stores, on every engine and the
    Triton kernel (interpreted). The step turns the whole matrix NaN, as the fp32 step does: its
    Newton–Schulz input is not finite."""
    params = make_params([(64, 128)])
    grads = grads_of(params, steps=2)
    grads[1][0][5, 7] = bad
    momenta = {}
    for name in [*ENGINES, "triton", "fp32"]:
        if name == "triton":
            pytest.importorskip("triton", reason="Triton is an optional extra: pip install fastoptim[triton]")
            monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "triton")
        if name in FUSED or name == "triton":  # the kernel, and nothing else, computes the momentum
            for module in (muon, muon_parts):  # the whole update's, and the fused run's
                monkeypatch.setattr(module, "muon_momentum", lambda ops, **kwargs: pytest.fail("muon_momentum ran on ops"))
        ours = clone(params)
        optimizer = fastoptim.Muon(ours, lr=0.02, state_bits=32 if name == "fp32" else 8,
                                   **ENGINES.get(name, ENGINES["fused-multi"]))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            run(optimizer, ours, grads)
        assert not [w for w in record if "fused=True" in str(w.message)], name  # in the kernel: no fallback
        assert ours[0].isnan().all(), name
        state = optimizer.state[ours[0]]
        if name != "fp32":
            momenta[name] = blockwise8.dequantize(state["momentum_buffer"], state["momentum_buffer_absmax"],
                                                  blockwise8.LINEAR)
    loop = momenta["loop"]
    assert loop[5, 7].isnan() and loop.isnan().sum() == 1
    for name, momentum in momenta.items():
        exact = dict(rtol=1e-5, atol=1e-6) if name == "triton" else dict(rtol=0, atol=0)
        torch.testing.assert_close(momentum, loop, equal_nan=True, **exact)


@pytest.mark.parametrize("engine", ENGINES)
def test_master_bits_32_keeps_the_fp32_trajectory_of_bf16_params(engine):
    params = make_params()
    grads = [[g.bfloat16().float() for g in step] for step in grads_of(params)]  # what bf16 grads hold
    bf16 = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    start = [torch.nn.Parameter(p.detach().bfloat16().float()) for p in params]  # the fp32 run starts alike
    run(fastoptim.Muon(start, lr=0.02, foreach=False, fused=False), start, grads)
    with warnings.catch_warnings(record=True):
        run(fastoptim.Muon(bf16, lr=0.02, master_bits=32, **ENGINES[engine]), bf16, grads)
    assert_equal(bf16, [p.detach().bfloat16() for p in start])


@pytest.mark.parametrize("engine", ENGINES)
def test_grad_scaler_skips_an_inf_step_and_unscales_the_others(engine):
    params = make_params()
    grads = grads_of(params)
    plain = stepped(fastoptim.Muon, params, grads, **ENGINES[engine])
    scaled = clone(params)
    optimizer = fastoptim.Muon(scaled, **ENGINES[engine])
    with warnings.catch_warnings(record=True):
        for t, step in enumerate(grads):
            for param, grad in zip(scaled, step):
                param.grad = grad * 8
            optimizer.grad_scale, optimizer.found_inf = torch.tensor(8.0), torch.tensor(0.0)
            optimizer.step()
            if t == 1:  # an inf step between two: no trace
                before = [p.detach().clone() for p in scaled], [optimizer.state[p]["momentum_buffer"].clone()
                                                                for p in scaled]
                optimizer.found_inf = torch.tensor(1.0)
                optimizer.step()
                assert_equal(scaled, before[0])
                assert_equal([optimizer.state[p]["momentum_buffer"] for p in scaled], before[1])
    assert_equal(scaled, plain)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_torch_muon_checkpoint_loads_and_resumes_on_the_same_trajectory(engine):
    params = make_params()
    grads = grads_of(params, steps=6)
    reference = clone(params)
    torch_opt = torch.optim.Muon(reference, lr=0.02)
    run(torch_opt, reference, grads[:3])
    saved = copy.deepcopy(torch_opt.state_dict())  # its tensors are the live states
    resumed = clone(reference)
    run(torch_opt, reference, grads[3:])
    ours = fastoptim.Muon(resumed, lr=1.0, **ENGINES[engine])
    ours.load_state_dict(saved)
    assert ours.param_groups[0]["lr"] == 0.02 and ours.param_groups[0]["use_muon"]
    with warnings.catch_warnings(record=True):
        run(ours, resumed, grads[3:])
    assert_equal(resumed, reference)


def test_a_state_dict_moves_between_engines_and_state_bits_with_its_companions():
    matrices, companions = make_params([(128, 64), (64, 64)]), make_params([(5000,), (7,)], seed=2)
    grads = grads_of(matrices + companions, steps=6)
    straight = clone(matrices) + clone(companions)
    run(fastoptim.Muon(model_groups(straight[:2], straight[2:]), state_bits=8), straight, grads)
    first = clone(matrices) + clone(companions)
    optimizer = fastoptim.Muon(model_groups(first[:2], first[2:]), state_bits=8)
    run(optimizer, first, grads[:3])
    saved = optimizer.state_dict()
    assert saved["state"][0]["momentum_buffer"].dtype == torch.uint8
    moved = clone(first)
    wide = fastoptim.Muon(model_groups(moved[:2], moved[2:]), foreach=False, fused=False)
    wide.load_state_dict(saved)
    assert wide.state[moved[0]]["momentum_buffer"].dtype == torch.float32
    assert wide.state[moved[2]]["step"] == 3
    back = fastoptim.Muon(model_groups(clone(moved[:2]), clone(moved[2:])), state_bits=8)
    back.load_state_dict(wide.state_dict())
    resumed = [p for group in back.param_groups for p in group["params"]]
    run(back, resumed, grads[3:])
    for a, b in zip(resumed, straight):  # dequantized and quantized again: the same codes
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


# --- bad input: a clear error, and nothing changed ---------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(ns_steps=0), "Invalid ns_steps"), (dict(ns_steps=100), "Invalid ns_steps"),
    (dict(ns_steps=2.0), "Invalid ns_steps"), (dict(ns_coefficients=(1.0, 2.0)), "Invalid ns_coefficients"),
    (dict(ns_coefficients=(1.0, float("nan"), 2.0)), "Invalid ns_coefficients"),
    (dict(ns_coefficients=[(1.0, 2.0, 3.0)] * 4), "Invalid ns_coefficients"),
    (dict(momentum=1.0), "Invalid momentum"), (dict(momentum=-0.1), "Invalid momentum"),
    (dict(adjust_lr_fn="bogus"),
     r"Invalid adjust_lr_fn: 'bogus' \(must be None, 'original', 'match_rms_adamw' or 'spectral_unclamped'\)"),
    (dict(use_muon="yes"), "Invalid use_muon"),
    (dict(nesterov=1), "Invalid nesterov"), (dict(flatten="yes"), "Invalid flatten"),
    (dict(adamw_eps=-1.0), "Invalid adamw_eps"), (dict(adamw_eps=float("inf")), "Invalid adamw_eps"),
    (dict(eps=-1.0), "Invalid eps"),
])
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        fastoptim.Muon(make_params(), **options)


@pytest.mark.parametrize("shape, message", [((7,), "use_muon=False"), (torch.Size([]), "use_muon=False"),
                                            ((2, 3, 4, 5), "flatten=True")])
def test_a_param_that_is_not_a_matrix_is_refused_with_what_to_do(shape, message):
    with pytest.raises(ValueError, match=message):
        fastoptim.Muon(make_params() + [torch.nn.Parameter(torch.zeros(shape))])
    optimizer = fastoptim.Muon(make_params())
    with pytest.raises(ValueError, match=message):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(shape))]})
    assert len(optimizer.param_groups) == 1
    fastoptim.Muon([{"params": make_params()}, {"params": [torch.nn.Parameter(torch.zeros(shape))],
                                                "use_muon": False}])


def test_complex_params_are_refused():
    with pytest.raises(ValueError, match="complex"):
        fastoptim.Muon([torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))])


def test_a_bf16_momentum_without_nesterov_is_not_rescaled_by_the_iterations():
    """torch.optim.Muon (2.13) divides a bf16 buffer by its norm in place when it orthogonalizes it
    directly (nesterov=False): fastoptim's buffer stays the momentum."""
    param = torch.nn.Parameter(torch.randn(8, 4).bfloat16())
    grad = torch.randn(8, 4).bfloat16()
    optimizer = fastoptim.Muon([param], nesterov=False, foreach=False, fused=False)
    param.grad = grad
    optimizer.step()
    buffer = optimizer.state[param]["momentum_buffer"].float()
    torch.testing.assert_close(buffer, 0.05 * grad.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("engine", ["foreach", *FUSED])
def test_the_matrices_of_one_shape_are_orthogonalized_as_one_batch(engine, monkeypatch):
    """Matrices of one shape are sliced together, and a slice makes one batch per shape: on a GPU, each batch's iterations
    cost a few launches whatever its size (4× faster than one matrix at a time on GPT-2 124M)."""
    monkeypatch.setattr(foreach, "MATRIX_SLICE_NUMEL", 2 * 32)  # two of these matrices per slice
    batches, real = [], muon_parts.orthogonalize

    def recording(matrices, coefficients, eps):
        batches.append(tuple(matrices.shape))
        return real(matrices, coefficients, eps)

    monkeypatch.setattr(muon_parts, "orthogonalize", recording)
    params = make_params([(8, 4), (4, 8), (8, 4), (4, 8), (8, 4)])
    for param in params:
        param.grad = torch.randn_like(param)
    fastoptim.Muon(params, lr=0.01, **ENGINES[engine]).step()
    assert sorted(batches) == [(1, 8, 4), (2, 4, 8), (2, 8, 4)]


@pytest.mark.parametrize("saved_bits, loaded_bits", [(32, 32), (8, 8), (32, 16), (8, 32), (16, 8)])
@pytest.mark.parametrize("switch", ["use_muon", "moved"])
def test_a_state_dict_saved_after_a_param_changed_algorithm_loads_and_steps_on_as_the_original(switch, saved_bits,
                                                                                               loaded_bits):
    """A Muon group's matrix stepped by the AdamW companions (its group's use_muon written False, or the param
    moved into a companions' group), whose state keeps the other algorithm's states as AdamW's keeps an
    unused maximum: its state dict saves (with 8-bit states it raised: helper-77) and loads into the same
    optimizer and into a fresh one, which then step as the original, back to Muon too (the load refused the
    other algorithm's keys: helper-50); into one of other ``state_bits``, the kept momentum too takes that
    optimizer's format (it kept the saved one, and every step back to Muon was refused: helper-77)."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(16))  # 8-bit from 4096
    grads = [(torch.randn_like(weight), torch.randn_like(bias)) for _ in range(6)]

    def build(w, b, bits=saved_bits):
        return fastoptim.Muon([dict(params=[w]), dict(params=[b], use_muon=False, eps=1e-8, adamw_eps=1e-8)],
                              lr=0.02, eps=1e-8, state_bits=bits)

    def step(opt, w, b, i):
        w.grad, b.grad = grads[i][0].clone(), grads[i][1].clone()
        opt.step()

    opt = build(weight, bias)
    for i in range(3):
        if i == 1 and switch == "use_muon":
            opt.param_groups[0].update(use_muon=False, adamw_eps=1e-8)
        elif i == 1:
            opt.param_groups[1]["params"].append(opt.param_groups[0]["params"].pop())
        step(opt, weight, bias, i)
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= set(opt.state[weight])
    twin_weight, twin_bias = (torch.nn.Parameter(p.detach().clone()) for p in (weight, bias))
    twin = build(twin_weight, twin_bias, loaded_bits)
    if switch == "use_muon":
        twin.param_groups[0].update(use_muon=False, adamw_eps=1e-8)
    else:
        twin.param_groups[1]["params"].append(twin.param_groups[0]["params"].pop())
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.load_state_dict(opt.state_dict())
    loaded = twin.state[twin_weight]  # each state in the loading optimizer's format, kept ones too
    assert {key: loaded[key].dtype for key in ("momentum_buffer", "exp_avg")} == dict.fromkeys(
        ("momentum_buffer", "exp_avg"), {32: torch.float32, 16: torch.bfloat16, 8: torch.uint8}[loaded_bits])
    for i in range(3, 6):
        for optimizer, w, b in ((opt, weight, bias), (twin, twin_weight, twin_bias)):
            if i == 4 and switch == "use_muon":
                optimizer.param_groups[0]["use_muon"] = True
            step(optimizer, w, b, i)
    if saved_bits == loaded_bits:
        assert torch.equal(weight, twin_weight) and torch.equal(bias, twin_bias)
    else:  # the states rounded into another format: a step's rounding apart
        torch.testing.assert_close(twin_weight, weight, rtol=0, atol=0.02 * 3 * 2**-4)


def test_a_0d_tensor_momentum_given_to_the_constructor_steps_as_torch_s_muon():
    """torch.optim.Muon takes a tensor momentum; so does the constructor now (it refused one: helper-50)."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = fastoptim.Muon(ours, lr=0.01, momentum=torch.tensor(0.9), weight_decay=0.1, foreach=False, fused=False)
    reference = torch.optim.Muon(theirs, lr=0.01, momentum=torch.tensor(0.9), weight_decay=0.1)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        reference.step()
    assert all(map(torch.equal, ours, theirs))


@pytest.mark.parametrize("way", ["constructor", "written between steps"])
def test_ns_steps_given_as_a_numpy_int_steps_as_its_value(way):
    """``ns_steps=np.int64(4)`` was refused ("must be an int from 1 to 99"), in the constructor and between
    steps, where fastoptim takes numpy numbers for its other options as torch.optim does (helper-58). It
    steps as the Python int does, bound and checked."""
    import numpy as np

    def run(ns_steps, checked):
        params = [torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(i))) for i in range(3)]
        opt = fastoptim.Muon(params, lr=0.02, ns_steps=ns_steps if way == "constructor" else 5)
        for step in range(4):
            for param in params:
                param.grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 + step))
            if way != "constructor" and step == 2:
                opt.param_groups[0]["ns_steps"] = ns_steps
            if checked:
                opt._plans.bound = None
            opt.step()
        return torch.cat([param.detach().flatten() for param in params])

    for checked in (False, True):
        assert torch.equal(run(np.int64(4), checked), run(4, checked))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("companion", [False, True], ids=["alone", "with AdamW companions"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_master_remainder_given_storage_of_another_dtype_is_refused_with_nothing_changed(engine, companion, dtype):
    """``state["master_remainder"].data = ...`` of another dtype: the bound fused step ran the momentum kernel
    (and the companions) before the update kernel's tables met it, and then raised native bind's error
    (fp32) or stepped on it read as another format (int8 under master_bits=32) (helper-89). Native code
    watches the remainders with the params: the step is refused by name, as on the other engines."""
    matrix = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).bfloat16())
    vector = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(1)))
    groups = [{"params": [matrix]}] + ([{"params": [vector], "use_muon": False}] if companion else [])
    optimizer = fastoptim.Muon(groups, lr=1e-2, master_bits=32, **ENGINES[engine])
    for step in range(2):
        for param in (matrix, vector):
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 + step)).to(param.dtype)
        optimizer.step()
    remainder = optimizer.state[matrix]["master_remainder"]
    remainder.data = remainder.detach().to(dtype)
    params, states = _snapshot(optimizer)
    with pytest.raises(RuntimeError, match=r"Muon: state 'master_remainder' is torch\.(float32|int8)"):
        optimizer.step()
    after_params, after_states = _snapshot(optimizer)
    assert all(map(torch.equal, params, after_params))
    assert all(torch.equal(value, after_states[key][name]) for key, state in states.items()
               for name, value in state.items())


def test_a_stochastically_rounded_update_the_kernel_leaves_to_foreach_is_foreach_s():
    """The fused update drew its kernel's seed before the kernel took nothing (a transposed bf16 param), which
    moved the generator of the foreach fallback's rounding, and of everything after (helper-102)."""
    runs = []
    for flags in (ENGINES["fused-multi"], ENGINES["foreach"]):
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(30, 40, generator=generator).bfloat16().t())  # no kernel takes it
        opt = fastoptim.Muon([param], lr=1e-2, stochastic_rounding=True, **flags)
        for step in range(2):
            param.grad = torch.randn(40, 30, generator=generator).bfloat16()
            torch.manual_seed(step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback's
                opt.step()
        runs.append((param.detach().clone(), torch.rand(1)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
