"""The library as a demanding user tries it: odd params, grads, state dicts, hooks, copies, threads
and numbers at the edge of the dtype's range, on every engine and ``state_bits``, with torch's AdamW
and the float64 oracle as references. Each defect an adversarial review found has its test here;
the cases that used to crash the process run in a subprocess."""
import copy
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

import fastoptim

from . import oracle, registry
from .test_bad_input import assert_unchanged, snapshot

OPTIMIZERS = [info.cls for info in registry.WITH_BETAS]  # its cases set betas
ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}
STATE_BITS = [32, 16, 8]
# Large enough for 8-bit states (4096+ elements), with a tail that is no whole block.
SHAPES = [(64, 80), (5000,), (3, 4)]


@pytest.fixture(autouse=True)
def no_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastoptim: fused=True")
        yield


def make(cls, engine="loop", state_bits=32, shapes=SHAPES, **options):
    params = oracle.make_params(shapes)
    return params, cls(params, lr=1e-2, state_bits=state_bits, **ENGINES[engine], **options)


def run(optimizer, params, steps=3, seed=1):
    oracle.run(optimizer, params, oracle.grad_sequence([p.shape for p in params], steps, seed))


def assert_same(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=1e-5, atol=1e-6)


def python(code):
    """Run ``code`` in a fresh interpreter (a crash fails the test, not the run): its output."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).parent.parent)  # the registry's test classes import
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


# --- 1. a state tensor that gets new storage in place -------------------------------------------

@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_states_moved_to_new_storage_in_place_are_seen_by_the_step_cache(cls):
    """``share_memory_()`` on optimizer state is the Hogwild recipe. The fused engines' cached
    pointer tables must follow a state to its new storage: they once wrote into the freed buffer
    (heap corruption, or NaN params)."""
    out = python(f"""
        import importlib, warnings, torch
        warnings.simplefilter("ignore")
        cls = getattr(importlib.import_module({cls.__module__!r}), {cls.__qualname__!r})
        MOVES = {{"share_memory_": lambda t: t.share_memory_(), "set_": lambda t: t.set_(t.clone()),
                  "data": lambda t: setattr(t, "data", t.data.clone()), None: None}}
        def run(bits, flags, move):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s)) for s in {SHAPES}]
            opt = cls(params, lr=1e-2, state_bits=bits, **flags)
            for step in range(4):
                if step == 2 and move:
                    for value in [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]:
                        MOVES[move](value)
                    torch.randn(1 << 20)  # reuse the freed memory, if anything still points there
                for p in params:
                    p.grad = torch.full_like(p, 0.01 * (step + 1)).sin_()
                opt.step()
            return torch.cat([p.detach().reshape(-1) for p in params])
        for bits in (32, 8):
            expected = run(bits, dict(foreach=False, fused=False), None)
            for flags in (dict(foreach=False, fused=True), dict(foreach=True, fused=True)):
                for move in ("share_memory_", "set_", "data"):
                    assert torch.allclose(run(bits, flags, move), expected, rtol=1e-4, atol=1e-5), (bits, flags, move)
        print("ok")
    """)
    assert out.strip() == "ok"


# --- 2. empty param groups ----------------------------------------------------------------------

@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("state_bits", [32, 8])
def test_an_empty_group_loads_its_own_checkpoint(cls, engine, state_bits):
    params, optimizer = make(cls, engine, state_bits)
    optimizer.add_param_group({"params": [], "weight_decay": 0.0})
    reference_params, reference = make(cls, engine, state_bits)
    run(optimizer, params)
    run(reference, reference_params)
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    run(optimizer, params, seed=2)
    run(reference, reference_params, seed=2)
    assert_same(params, reference_params)


@pytest.mark.parametrize("engine", ENGINES)
def test_adan_restarts_with_an_empty_group(engine):
    params, optimizer = make(fastoptim.Adan, engine)
    optimizer.add_param_group({"params": []})
    run(optimizer, params)
    optimizer.restart_opt()
    assert all(group["step"] == 0 for group in optimizer.param_groups) and not any(optimizer.state.values())
    fresh_params, fresh = make(fastoptim.Adan, engine)
    for param, fresh_param in zip(params, fresh_params):
        fresh_param.data.copy_(param)
    run(optimizer, params, seed=2)
    run(fresh, fresh_params, seed=2)
    assert_same(params, fresh_params)


# --- 3. one huge or non-finite gradient element under 8-bit states ------------------------------

@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("bad", [1e20, 1e30, 3.4e38, float("inf"), -float("inf"), float("nan")])
def test_one_bad_gradient_element_harms_no_other_param_at_any_state_bits(cls, bad):
    """The damage of one element stays in that element wherever the fp32 optimizer keeps it there:
    an 8-bit block once turned its 255 neighbours NaN (0 · inf in dequantizing)."""
    results = {}
    for state_bits in STATE_BITS:
        for engine in ENGINES:
            params, optimizer = make(cls, engine, state_bits, shapes=[(8192,)])
            grads = oracle.grad_sequence([(8192,)], 4)
            grads[1][0][300] = bad
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                oracle.run(optimizer, params, grads)
            assert not [w for w in record if "fused=True" in str(w.message)], (state_bits, engine)  # in the kernel
            results[state_bits, engine] = params[0].detach()
    for (state_bits, engine), value in results.items():
        assert value[torch.arange(8192) != 300].isfinite().all(), (state_bits, engine, int(value.isnan().sum()))
        # the bad element itself is what the loop engine makes of it at the same state_bits (a bf16
        # g_prev rounds 3.4e38 up to inf, so that element may be NaN where the fp32 one is not)
        torch.testing.assert_close(value[300], results[state_bits, "loop"][300], equal_nan=True)
    assert results[8, "loop"][300].isnan() == results[16, "loop"][300].isnan()


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
@pytest.mark.parametrize("bad", [1e20, float("inf")])
def test_the_triton_kernels_keep_a_bad_gradient_element_as_the_loop_engine_does(cls, bad, monkeypatch):
    pytest.importorskip("fastoptim.kernels.fused_triton")
    monkeypatch.setenv("FASTOPTIM_FUSED_BACKEND", "triton")  # on CPU tensors in Triton's interpreter
    grads = oracle.grad_sequence([(4096,)], 3)
    grads[1][0][300] = bad
    for state_bits in (32, 8):
        results = []
        for engine in ("loop", "fused-multi"):
            params, optimizer = make(cls, engine, state_bits, shapes=[(4096,)])
            oracle.run(optimizer, params, grads)
            results.append(params[0].detach())
        assert results[1][torch.arange(4096) != 300].isfinite().all()
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6, equal_nan=True)


# --- 4. float64 params ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_float64_adamw_is_torchs_float64_adamw(engine, amsgrad):
    params = oracle.make_params(dtype=torch.float64)
    torch_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(oracle.SHAPES, 10)
    oracle.run(fastoptim.AdamW(params, lr=1e-2, amsgrad=amsgrad, **ENGINES[engine]), params, grads)
    oracle.run(torch.optim.AdamW(torch_params, lr=1e-2, amsgrad=amsgrad, foreach=False), torch_params, grads)
    assert oracle.relative_error(params, torch_params) < 1e-14


@pytest.mark.parametrize("engine", ENGINES)
def test_float64_adan_with_clipping_is_the_float64_oracle(engine):
    params = oracle.make_params(dtype=torch.float64)
    grads = oracle.grad_sequence(oracle.SHAPES, 10)
    expected = oracle.adan(params, grads, lr=1e-2, weight_decay=0.02, max_grad_norm=1.0)
    oracle.run(fastoptim.Adan(params, lr=1e-2, weight_decay=0.02, max_grad_norm=1.0, **ENGINES[engine]), params, grads)
    assert oracle.relative_error(params, expected) < 1e-13


@pytest.mark.parametrize("dtypes", [(torch.float64,), (torch.float32, torch.float64), (torch.float32,)])
def test_clip_grad_norm_returns_torchs_norm_in_torchs_dtype(dtypes):
    params = [torch.nn.Parameter(torch.randn(100, dtype=dtype)) for dtype in dtypes]
    torch_params = [p.detach().clone().requires_grad_() for p in params]
    for p, q in zip(params, torch_params):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    norm = fastoptim.clip_grad_norm_(params, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(torch_params, 1.0)
    assert norm.dtype == expected.dtype
    # torch sums an fp32 grad's norm in fp32, fastoptim in float64 beside a float64 grad
    torch.testing.assert_close(norm, expected, rtol=1e-15 if set(dtypes) == {torch.float64} else 1e-6, atol=0)


# --- 5. Adan's group step in a loaded state dict -------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("step", [torch.zeros(3), torch.tensor([2.0]), -1, 1.5, float("nan"), "2", True])
def test_a_bad_adan_group_step_is_refused_at_load(engine, step):
    params, optimizer = make(fastoptim.Adan, engine)
    run(optimizer, params)
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][0]["step"] = step
    before = snapshot(params, optimizer)
    with pytest.raises(ValueError, match="Invalid step"):
        optimizer.load_state_dict(saved)
    assert_unchanged(params, optimizer, before)


@pytest.mark.parametrize("step", [3, 3.0, torch.tensor(3), torch.tensor(3.0, dtype=torch.float64)])
def test_good_adan_group_steps_load_as_a_0d_fp32_tensor(step):
    params, optimizer = make(fastoptim.Adan)
    saved = optimizer.state_dict()
    saved["param_groups"][0]["step"] = step
    optimizer.load_state_dict(saved)
    loaded = optimizer.param_groups[0]["step"]
    assert loaded.dtype == torch.float32 and loaded.shape == () and loaded == 3


# --- 6. load_state_dict hooks --------------------------------------------------------------------

@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_hooks_follow_torchs_contract(cls):
    """A pre-hook sees the raw dict before any check (here it upgrades a renamed key) and may
    return a new one; a post-hook runs last, and what it sets stays."""
    params, optimizer = make(cls)
    run(optimizer, params)
    old = copy.deepcopy(optimizer.state_dict())
    key = next(key for key in old["state"][0] if key != "step")  # a state of the first param
    old["state"][0]["old_" + key] = old["state"][0].pop(key)
    seen = []

    def upgrade(opt, state_dict):
        seen.append("pre")
        upgraded = copy.deepcopy(state_dict)
        upgraded["state"][0][key] = upgraded["state"][0].pop("old_" + key)
        return upgraded

    def mark(opt):
        seen.append("post")
        opt.state[params[0]]["note"] = "set by the post-hook"

    optimizer.register_load_state_dict_pre_hook(upgrade)
    optimizer.register_load_state_dict_post_hook(mark)
    optimizer.load_state_dict(old)
    assert seen == ["pre", "post"] and optimizer.state[params[0]]["note"] == "set by the post-hook"


# --- 7 and 9. a param listed twice, or one that overlaps itself ---------------------------------

@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_param_listed_twice_is_refused(cls):
    p, q = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match="appears twice"):
        cls([p, q, p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        cls([{"params": [p]}, {"params": [q, p]}])
    optimizer = cls([p])
    with pytest.raises(ValueError, match="appears twice"):
        optimizer.add_param_group({"params": [q, q]})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_param_that_overlaps_itself_is_refused_before_anything_changes(cls, engine):
    expanded = torch.nn.Parameter(torch.randn(1, 5).expand(4, 5))
    with pytest.raises(ValueError, match="overlaps itself"):
        cls([expanded])
    params, optimizer = make(cls, engine)
    run(optimizer, params)
    params[2].data = params[2].data[:1].expand(3, 4)  # after construction: the step refuses it
    for p in params:
        p.grad = torch.ones_like(p)
    before = snapshot(params, optimizer)
    with pytest.raises(ValueError, match="overlaps itself"):
        optimizer.step()
    assert_unchanged(params, optimizer, before)


def test_views_that_do_not_overlap_are_taken():
    base = torch.randn(6, 8)
    views = [base.t(), base[:, ::2], base[::3], torch.randn(4, 1, 3).expand(4, 1, 3)]
    for view in views:
        fastoptim.AdamW([torch.nn.Parameter(view)])


# --- 8. a state the options no longer use --------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("state_bits", [32, 8])
def test_a_checkpoint_loads_after_amsgrad_was_turned_off_as_torchs_does(engine, state_bits):
    """Against torch's AdamW in fp32; with 8-bit states, against the same run without the reload."""
    params, optimizer = make(fastoptim.AdamW, engine, state_bits, amsgrad=True)
    if state_bits == 32:
        reference_params = [p.detach().clone().requires_grad_() for p in params]
        reference = torch.optim.AdamW(reference_params, lr=1e-2, amsgrad=True)
    else:
        reference_params, reference = make(fastoptim.AdamW, engine, state_bits, amsgrad=True)
    for opt, ps in ((optimizer, params), (reference, reference_params)):
        run(opt, ps)
        opt.param_groups[0]["amsgrad"] = False
        run(opt, ps, seed=2)
        if opt is optimizer or state_bits == 32:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the leftover max_exp_avg_sq stays
            assert "max_exp_avg_sq" in opt.state[ps[0]]
        run(opt, ps, seed=3)
    assert_same(params, reference_params)
    if state_bits == 32:
        fresh = fastoptim.AdamW(params, lr=1e-2, **ENGINES[engine])
        fresh.load_state_dict(reference.state_dict())  # torch's checkpoint with its leftover, too
        saved = reference.state_dict()
        saved["state"][0]["exp_avg_diff"] = saved["state"][0]["exp_avg"]
        with pytest.raises(ValueError, match="another optimizer"):  # an unknown key is still refused
            fresh.load_state_dict(saved)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("saved", ["after a step without one param's grad", "before a step since"])
@pytest.mark.parametrize("cls, turned_on, state_bits", [
    (fastoptim.AdamW, dict(amsgrad=True), 32), (fastoptim.AdamW, dict(amsgrad=True), 8),
    (fastoptim.AdamWSN, dict(betas=(0.9, 0.999)), 32)])
def test_a_checkpoint_loads_after_a_flag_added_a_state_that_a_param_lacks(cls, turned_on, state_bits, saved, engine):
    """A flag that an option turns on between steps (amsgrad; AdamWSN's β1 from 0) adds a state to the params a
    step then takes: one without a grad that step, or every param where the save comes before any step
    since, keeps its state without it. Its own state dict loads (helper-64, helper-66: it was refused as
    another optimizer's), and the steps after the reload are those of the run without it, where the step
    creates the missing state for each param as it found it."""
    runs = []
    for reload in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(5000))]  # 8-bit: 4096+
        options = dict(betas=(0.0, 0.999)) if cls is fastoptim.AdamWSN else {}
        opt = cls(params, lr=1e-2, state_bits=state_bits, **options, **ENGINES[engine])
        for step in range(4):
            if step == 1:
                opt.param_groups[0].update(turned_on)
                if reload and saved == "before a step since":
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            for index, param in enumerate(params):  # the second param has no grad at the step that turns it on
                param.grad = None if step == 1 and index == 1 else torch.randn_like(param)
            opt.step()
            if step == 1 and reload and saved != "before a step since":
                state_dict = copy.deepcopy(opt.state_dict())
                assert len(state_dict["state"][1]) < len(state_dict["state"][0])
                opt.load_state_dict(state_dict)
        runs.append(params)
        if state_bits == 8:
            assert opt.state[params[1]]["exp_avg"].dtype == torch.uint8
    assert all(map(torch.equal, *runs))


def test_a_state_that_an_algorithm_always_keeps_is_not_taken_as_missing_on_load():
    """AdamW keeps a first moment whatever its options (its flag is fixed): a state dict with a param's
    ``exp_avg`` missing is another optimizer's, as torch's step would fail on it (helper-66)."""
    params, optimizer = make(fastoptim.AdamW)
    run(optimizer, params)
    saved = copy.deepcopy(optimizer.state_dict())
    del saved["state"][1]["exp_avg"]
    with pytest.raises(ValueError, match="another optimizer"):
        fastoptim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2).load_state_dict(saved)


# --- 10. torch's keywords, tensor lr and betas, and stable state dicts ---------------------------

def test_adamw_takes_torchs_keywords_with_the_values_that_mean_what_it_does():
    params = oracle.make_params()
    torch_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(oracle.SHAPES, 3)
    oracle.run(fastoptim.AdamW(params, lr=1e-2, capturable=True, differentiable=False), params, grads)
    oracle.run(torch.optim.AdamW(torch_params, lr=1e-2, capturable=False, differentiable=False), torch_params, grads)
    assert oracle.relative_error(params, torch_params) < 1e-6
    with pytest.raises(ValueError, match="Invalid differentiable.*pass differentiable=False"):
        fastoptim.AdamW(params, differentiable=True)
    with pytest.raises(ValueError, match="Invalid capturable"):
        fastoptim.AdamW(params, capturable="yes")


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_hyperparameters_are_checked_before_the_params(cls):
    with pytest.raises(ValueError, match="Invalid lr"):
        cls(None, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid betas"):
        cls(None, betas=(1.5,) * cls.algorithm.n_betas)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lr_shape", [(), (1,), (1, 1)])
def test_one_element_tensor_lr_and_tensor_betas_act_as_their_numbers(cls, engine, lr_shape):
    betas = {fastoptim.Adan: (0.98, 0.92, 0.99)}.get(cls, (0.9, 0.99))
    params, optimizer = make(cls, engine, betas=betas)
    tensor_params = [p.detach().clone().requires_grad_() for p in params]
    tensor_optimizer = cls(tensor_params, lr=torch.full(lr_shape, 1e-2), betas=tuple(map(torch.tensor, betas)),
                           **ENGINES[engine])
    scheduler = torch.optim.lr_scheduler.StepLR(tensor_optimizer, 1, gamma=0.5)
    for opt, ps, sched in ((optimizer, params, None), (tensor_optimizer, tensor_params, scheduler)):
        for step in range(3):
            run(opt, ps, steps=1, seed=step)
            if sched is None:
                for group in opt.param_groups:
                    group["lr"] *= 0.5
            else:
                sched.step()
    assert tensor_optimizer.param_groups[0]["lr"].shape == lr_shape
    assert_same(tensor_params, params)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("state_bits", [32, 8])
def test_state_dicts_are_the_same_after_load_deepcopy_and_pickle(cls, state_bits):
    """No key appears or changes: torch's ``__setstate__`` adds ``differentiable`` to the defaults,
    which once spread into every group."""
    params, optimizer = make(cls, state_bits=state_bits)
    run(optimizer, params)

    def groups(opt):
        return [{k: v for k, v in g.items()} for g in opt.state_dict()["param_groups"]]

    expected = groups(optimizer)
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    copies = [optimizer, copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))]
    for opt in copies:
        assert str(groups(opt)) == str(expected)
        assert set(opt.defaults) == set(expected[0]) - {"params", "step"}


# --- more in the same spirit ----------------------------------------------------------------------

@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("state_bits", [32, 8])
def test_a_deep_copy_or_pickle_steps_on_its_own_states(cls, engine, state_bits):
    """A copy holds the same cache objects as its original, rebuilt around new tensors: it must
    update its own tensors, and the original its own."""
    _, optimizer = make(cls, engine, state_bits)
    params = [p for group in optimizer.param_groups for p in group["params"]]  # in the twins' order
    run(optimizer, params)
    for make_copy in (copy.deepcopy, lambda opt: pickle.loads(pickle.dumps(opt))):
        twin = make_copy(optimizer)
        twin_params = [p for group in twin.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        run(twin, twin_params, seed=5)
        assert all(torch.equal(a, b) for a, b in zip(params, before))  # the original was not touched
        run(optimizer, params, seed=5)
        assert_same(twin_params, params)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ["foreach", "fused-multi"])
def test_optimizers_stepping_in_two_threads_get_the_results_of_one(cls, engine):
    """The fused kernels release the GIL: two optimizers may step at once."""
    pairs = [make(cls, engine, shapes=[(300, 300), (7,)]) for _ in range(2)]
    threads = [threading.Thread(target=run, args=(opt, ps, 5)) for ps, opt in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    alone_params, alone = make(cls, engine, shapes=[(300, 300), (7,)])
    run(alone, alone_params, 5)
    for params, _ in pairs:
        assert all(torch.equal(a, b) for a, b in zip(params, alone_params))


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
def test_params_whose_grads_come_and_go_and_empty_params(cls, engine):
    shapes = [(0,), (5, 3), (0, 4), (4096 + 3,)]
    params, optimizer = make(cls, engine, state_bits=8, shapes=shapes)
    reference_params, reference = make(cls, "loop", state_bits=8, shapes=shapes)
    grads = oracle.grad_sequence(shapes, 6)
    for step, step_grads in enumerate(grads):
        for ps, opt in ((params, optimizer), (reference_params, reference)):
            for i, (p, g) in enumerate(zip(ps, step_grads)):
                p.grad = None if (i + step) % 3 == 0 else g.clone()
            opt.step()
    assert_same(params, reference_params)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extreme_gradients_in_half_precision_go_as_in_fp32(cls, engine, dtype):
    """Gradients at the dtype's largest and smallest magnitudes: the math is fp32, so the params
    turn NaN exactly where fp32 params do (bf16's largest overflows the lerp of a first moment)."""
    info, results = torch.finfo(dtype), {}
    for param_dtype in (dtype, torch.float32):
        param = torch.nn.Parameter(torch.randn(4096).to(dtype).to(param_dtype))
        optimizer = cls([param], lr=1e-3, **ENGINES[engine if param_dtype == dtype else "loop"])
        for value in (info.max, info.tiny, -info.max, 0.0):
            param.grad = torch.full_like(param, value)
            optimizer.step()
        results[param_dtype] = param.detach()
    assert torch.equal(results[dtype].isnan(), results[torch.float32].isnan())
    assert not results[dtype].isinf().any()


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_state_dict_with_states_on_another_dtype_or_a_saved_tensor_lr_loads(cls):
    params, optimizer = make(cls)
    run(optimizer, params)
    saved = copy.deepcopy(optimizer.state_dict())
    for state in saved["state"].values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and value.dim():
                state[key] = value.double()
    saved["param_groups"][0]["lr"] = torch.tensor(1e-2)
    fresh_params = [p.detach().clone().requires_grad_() for p in params]
    fresh = cls(fresh_params, lr=1e-2)
    fresh.load_state_dict(saved)
    assert all(v.dtype != torch.float64 for s in fresh.state.values() for v in s.values() if torch.is_tensor(v))
    run(optimizer, params, seed=4)
    run(fresh, fresh_params, seed=4)
    assert_same(fresh_params, params)
