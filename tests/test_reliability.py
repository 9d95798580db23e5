"""The second adversarial review's findings, each a test that failed before its fix: the torch ops
check every argument before they change anything, an edited 8-bit state is refused, peers'
variants of an algorithm are refused at load, Lion clips with torch's eps, complex params are
optimized as torch.optim optimizes them, and a compiled step reuses the graph of a grads pattern
it has seen. The cases that used to crash the process run in a subprocess."""
import copy
import functools
import math
import inspect
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import fastoptim
from fastoptim.bench.peers import timm_adan_class

from .test_adversarial import ENGINES, make, python, run
from .test_bad_input import assert_unchanged, snapshot
from .registry import OPTIMIZERS, step_op
from .test_lion import timm_lion_class

ALL = [info.cls for info in OPTIMIZERS]


@pytest.fixture(autouse=True)
def no_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastoptim: fused=True")
        yield


# --- 1. the step ops check what they are given ----------------------------------------------------

def test_the_step_ops_refuse_bad_arguments_by_name_and_change_nothing():
    """Each call once crashed the process, overflowed the heap or stepped on garbage."""
    out = python("""
        import torch, fastoptim
        from tests.registry import step_op
        lion = lambda p, g, m, a, *rest: step_op(fastoptim.Lion, p, g, [m], [a], *rest)
        n_scalars = len(fastoptim.Lion.algorithm.spec.all_scalars)
        scalars = [torch.tensor(0.1)] * n_scalars
        p, codes = torch.zeros(8192), torch.full((8192,), 127, dtype=torch.uint8)
        shared = torch.zeros(8)
        CASES = {
            "grad\\\\[0\\\\]": lambda: lion([torch.zeros(1 << 24)], [torch.ones(16)], [torch.zeros(1 << 24)], [],
                                             scalars, 0, False),
            "grad\\\\[0\\\\] .*bfloat16": lambda: lion([torch.zeros(8)], [torch.ones(8, dtype=torch.bfloat16)],
                                                      [torch.zeros(8)], [], scalars, 0, False),
            "exp_avg\\\\[0\\\\] is \\\\(16,\\\\)": lambda: lion([p], [torch.ones(8192)], [torch.zeros(16)], [],
                                                           scalars, 0, False),
            "exp_avg_absmax\\\\[0\\\\] must be .* 32 blocks": lambda: lion([p], [torch.ones(8192)], [codes],
                                                                         [torch.zeros(1)], scalars, 0, False),
            "exp_avg_absmax\\\\[0\\\\] must be .*got none": lambda: lion([p], [torch.ones(8192)], [codes], [],
                                                                       scalars, 0, False),
            "exp_avg_absmax\\\\[0\\\\] must be empty": lambda: lion([p], [torch.ones(8192)], [torch.zeros(8192)],
                                                                   [torch.zeros(32)], scalars, 0, False),
            "share memory": lambda: lion([shared, shared], [torch.ones(8)] * 2, [torch.zeros(8), torch.zeros(8)],
                                         [], scalars, 0, False),
            "share memory ": lambda: lion([shared], [torch.ones(8)], [shared], [], scalars, 0, False),
            "scalars must hold": lambda: lion([p], [torch.ones(8192)], [torch.zeros(8192)], [], scalars[1:], 0,
                                              False),
            "scalar 'lr'": lambda: lion([p], [torch.ones(8192)], [torch.zeros(8192)], [],
                                        scalars[:7] + [torch.ones(3)] + scalars[8:], 0, False),
            "scalar 'seed'": lambda: lion([p], [torch.ones(8192)], [torch.zeros(8192)], [],
                                          scalars[:1] + [torch.tensor(True)] + scalars[2:], 0, False),
            "flags": lambda: lion([p], [torch.ones(8192)], [torch.zeros(8192)], [], scalars, 1 << 5, False),
            "max_exp_avg_sq must hold": lambda: step_op(fastoptim.AdamW,
                [p], [torch.ones(8192)], [[torch.zeros(8192)], [torch.zeros(8192)], []], [[], [], []],
                [torch.tensor(0.1)] * len(fastoptim.AdamW.algorithm.spec.all_scalars), 0b110, False),
        }
        for pattern, call in CASES.items():
            before = [t.clone() for t in (p, codes, shared)]
            try:
                call()
            except ValueError as error:
                import re
                assert re.search(pattern.strip(), str(error)), (pattern, str(error))
            else:
                raise AssertionError(f"no error for {pattern}")
            assert all(torch.equal(a, b) for a, b in zip(before, (p, codes, shared))), pattern
        print("refused", len(CASES))
    """)
    assert out.strip() == "refused 13"


def test_the_step_op_checks_again_when_the_same_tensors_come_with_other_flags():
    """Its tables are kept between calls: flags that keep another state (amsgrad's) must not find
    them and run a kernel that reads a role it was not given."""
    out = python("""
        import torch, fastoptim
        spec = fastoptim.AdamW.algorithm.spec  # importing fastoptim.AdamW defines its op
        adamw = torch.ops.fastoptim.adamw_step
        scalars = [torch.tensor(0.1)] * len(spec.all_scalars)
        p, g, m, v = torch.zeros(64), torch.ones(64), torch.zeros(64), torch.zeros(64)
        first_moment = 1 << (1 + spec.flags.index("first_moment"))
        amsgrad = 1 << (1 + spec.flags.index("amsgrad"))
        states = fastoptim.engines.step_op.op_states({"param": [p], "exp_avg": [m], "exp_avg_sq": [v]}, {}, spec)
        adamw([p], [g], *states, scalars, first_moment, False)
        before = p.clone()
        try:
            adamw([p], [g], *states, scalars, first_moment | amsgrad, False)
        except ValueError as error:
            assert "max_exp_avg_sq must hold one tensor per param" in str(error), error
            assert torch.equal(p, before)
            print("refused")
    """)
    assert out.strip() == "refused"


def test_the_step_op_still_steps_what_it_is_given_right():
    p, exp_avg = torch.zeros(8), torch.zeros(8)
    scalars = [torch.tensor(v) for v in (0.0, 0.0, 1.0, 0.9, 0.1, 0.99, 0.01, 0.01, 1.0)]  # the spec's order
    step_op(fastoptim.Lion, [p], [torch.ones(8)], [[exp_avg]], [[]], scalars, 0)
    assert torch.equal(p, torch.full((8,), -0.01)) and torch.allclose(exp_avg, torch.full((8,), 0.01))


def test_a_step_op_s_call_is_found_by_its_very_layout_and_its_spec_and_goes_with_the_layout():
    """A call the op made is held by its layout tensor: found again for that tensor by the same spec's op
    (its tables reused), never by another spec's op handed that layout nor for another tensor of the same
    values, nor by a pickled or deep-copied layout, and freed with the layout (the op called on ever new
    layouts keeps none of them)."""
    import copy
    import gc
    import pickle
    import weakref

    from fastoptim.engines import step_op as ops
    lion = fastoptim.Lion.algorithm.spec
    p, exp_avg = torch.zeros(8), torch.zeros(8)
    holders, layout = ops.op_states({"param": [p], "exp_avg": [exp_avg]}, {}, lion)
    scalars = [torch.tensor(v) for v in (0.0, 0.0, 1.0, 0.9, 0.1, 0.99, 0.01, 0.01, 1.0)]
    torch.ops.fastoptim.lion_step([p], [torch.ones(8)], holders, layout, scalars, 0, False)
    call = ops._held_call(lion.name, layout)
    assert call is not None and call.tables is not None
    torch.ops.fastoptim.lion_step([p], [torch.ones(8)], holders, layout, scalars, 0, False)
    assert ops._held_call(lion.name, layout) is call  # kept, its tables reused
    assert ops._held_call(fastoptim.AdamW.algorithm.spec.name, layout) is None
    assert ops._held_call(lion.name, layout.clone()) is None  # another tensor, whatever its values
    copied = pickle.loads(pickle.dumps(layout))  # a layout travels without its call (its tables are native)
    assert torch.equal(copied, layout) and ops._held_call(lion.name, copied) is None
    assert ops._held_call(lion.name, copy.deepcopy(layout)) is None
    gone = weakref.ref(call)
    del call, layout
    gc.collect()
    assert gone() is None


# --- 2. the clip ops stay inside their tensors ----------------------------------------------------

def test_the_clip_ops_take_strided_and_expanded_grads_as_torch_does():
    x = torch.arange(1.0, 41.0).reshape(4, 10)
    expected = x.clone()
    expected[:, ::2] *= 0.5
    torch.ops.fastoptim.scale_grads([x[:, ::2]], torch.tensor(0.5))
    assert torch.equal(x, expected)  # the columns outside the view are as they were
    view = torch.arange(1.0, 41.0).reshape(4, 10)[:, ::2]
    assert torch.ops.fastoptim.grad_norm_total([view], False).item() == pytest.approx(10660.0, rel=1e-6)
    expanded = torch.full((1,), 2.0).expand(1000)
    assert torch.ops.fastoptim.grad_norm_total([expanded], True).item() == 2.0
    assert torch.ops.fastoptim.grad_norm_total([expanded], False).item() == pytest.approx(4000.0, rel=1e-6)
    g = torch.ones(8)
    torch.ops.fastoptim.scale_grads([g, g], torch.tensor(2.0))  # listed twice: scaled twice, as torch's foreach
    assert torch.equal(g, torch.full((8,), 4.0))
    assert torch.ops.fastoptim.grad_norm_total([], False).item() == 0.0


@pytest.mark.parametrize("factor, message", [(torch.tensor(2), "factor must be a one-element floating-point"),
                                             (torch.ones(2), "factor must be a one-element floating-point")])
def test_the_clip_ops_refuse_a_factor_they_cannot_read(factor, message):
    g = torch.ones(8)
    with pytest.raises(ValueError, match=message):
        torch.ops.fastoptim.scale_grads([g], factor)
    assert torch.equal(g, torch.ones(8))
    with pytest.raises(ValueError, match=r"grads\[1\] must be a strided"):
        torch.ops.fastoptim.grad_norm_total([g, torch.ones(3, dtype=torch.int64)], False)


def test_the_host_sqrt_op_is_torchs_sqrt_and_refuses_dtypes_numpy_would_round_otherwise():
    """``engines.ops.sqrt`` of a CPU tensor of several elements (per-param bias corrections) goes through
    ``fastoptim::host_sqrt``: correctly rounded, as ``math.sqrt`` (and the native rules' C sqrt) rounds
    it, which torch's CPU sqrt of a tensor is not everywhere (MKL's vector sqrt), also of a strided
    view; an integer tensor (numpy's sqrt would make float64 of it), bf16 (numpy has none) or a tensor
    that requires grad is refused by name, its input left as it was."""
    from fastoptim.engines import ops
    for x in (torch.rand(5000, dtype=torch.float64) * 10, (torch.rand(3000) * 10)[::3], torch.rand(900).half()):
        rounded = torch.tensor([math.sqrt(v) for v in x.tolist()], dtype=torch.float64).to(x.dtype)
        assert torch.equal(ops.sqrt(x), rounded) and ops.sqrt(x).dtype == x.dtype
    for bad in (torch.arange(4), torch.ones(3, dtype=torch.bfloat16), torch.ones(3, requires_grad=True)):
        before = bad.detach().clone()
        with pytest.raises(ValueError, match="fastoptim::host_sqrt: x must be an fp16, fp32 or float64"):
            torch.ops.fastoptim.host_sqrt(bad)
        assert torch.equal(bad.detach(), before)


# --- 3. an 8-bit state without its block maxima ---------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", ALL)
def test_a_deleted_block_maxima_state_is_refused_before_anything_changes(cls, engine):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8192)), torch.nn.Parameter(torch.randn(64, 80))]
    opt = cls(params, lr=1e-2, state_bits=8, **ENGINES[engine])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    key = next(key for key in opt.state[params[1]] if key.endswith("_absmax"))
    absmax = opt.state[params[1]].pop(key)
    before = [p.detach().clone() for p in params], [copy.deepcopy(opt.state[p]) for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    role = key.removesuffix("_absmax")
    with pytest.raises(RuntimeError, match=f"'{role}' holds 8-bit codes without its block maxima '{key}'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before[0], params))
    for param, state in zip(params, before[1]):
        assert state.keys() == opt.state[param].keys()
        assert all(torch.equal(value, opt.state[param][key]) for key, value in state.items() if torch.is_tensor(value))
    opt.state[params[1]][key] = absmax  # restored, it steps
    opt.step()
    assert not torch.equal(before[0][1], params[1])


# --- 5. peers' variants are refused, not continued as the plain algorithm --------------------------

@pytest.mark.parametrize("peer, ours, option", [
    (timm_lion_class, fastoptim.Lion, "caution"), (timm_adan_class, fastoptim.Adan, "caution"),
    (timm_lion_class, fastoptim.Lion, "corrected_weight_decay")])
def test_timms_variant_checkpoints_are_refused_and_the_plain_ones_load(peer, ours, option):
    def checkpoint(value):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(20, 30))]
        theirs = peer()(params, lr=1e-3, **{option: value})
        params[0].grad = torch.randn(20, 30)
        theirs.step()
        return theirs.state_dict()

    params = [torch.nn.Parameter(torch.randn(20, 30))]
    opt = ours(params, lr=1e-3)
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match=f"loaded param group 0 sets {option}=True: timm's"):
        opt.load_state_dict(checkpoint(True))
    assert_unchanged(params, opt, before)
    opt.load_state_dict(checkpoint(False))
    assert opt.state[params[0]]["exp_avg"].abs().sum() > 0


# --- 6. Lion's clip uses torch's eps ------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_lion_clips_with_torchs_eps_whatever_keys_its_groups_carry(engine):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(30, 40)) for _ in range(2)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = fastoptim.Lion([{"params": params, "eps": 0.5}], lr=1e-2, max_grad_norm=1.0, **ENGINES[engine])
    theirs = timm_lion_class()(reference, lr=1e-2)
    for _ in range(3):
        grads = [torch.randn(30, 40) * 0.02 for _ in params]  # a norm near 1, where eps shows
        for p, r, g in zip(params, reference, grads):
            p.grad, r.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(reference, 1.0)
        opt.step()
        theirs.step()
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-6)


# --- complex params, as torch.optim takes them ------------------------------------------------

def complex_pair(cls, engine, dtype=torch.complex64, **options):
    """A complex param and a real one holding its real view, each with an optimizer."""
    torch.manual_seed(0)
    complex_params = [torch.nn.Parameter(torch.randn(70, 80, dtype=dtype)),
                      torch.nn.Parameter(torch.randn(7, dtype=dtype))]
    real_params = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone()) for p in complex_params]
    # Muon orthogonalizes real matrices only: complex params (and their real views) go to its AdamW companions
    group = {"use_muon": False} if "use_muon" in inspect.signature(cls).parameters else {}
    return [(params, cls([{"params": params} | group], lr=1e-2, max_grad_norm=1.0, **ENGINES[engine], **options))
            for params in (complex_params, real_params)]


def step_both(pairs, steps=4):
    (complex_params, complex_opt), (real_params, real_opt) = pairs
    for _ in range(steps):
        for p, r in zip(complex_params, real_params):
            p.grad = torch.randn_like(p)
            r.grad = torch.view_as_real(p.grad).clone()
        complex_opt.step()
        real_opt.step()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", ALL)
def test_a_complex_param_steps_as_its_real_view_on_every_engine(cls, engine, dtype):
    """torch.optim's definition (its test_complex): a complex param goes as two real numbers per
    element. Its states are complex, of its dtype, as torch's are."""
    pairs = complex_pair(cls, engine, dtype)
    step_both(pairs)
    (complex_params, complex_opt), (real_params, real_opt) = pairs
    for p, r in zip(complex_params, real_params):
        assert torch.equal(torch.view_as_real(p.detach()), r.detach())
        for key, value in complex_opt.state[p].items():
            if key != "step":
                assert value.dtype == dtype and torch.equal(torch.view_as_real(value), real_opt.state[r][key])


@pytest.mark.parametrize("options", [dict(state_bits=8), dict(state_bits=16), dict(sn=True)])
def test_complex_params_keep_full_precision_dense_states_under_lean_options(options):
    """As params under 4096 elements keep fp32 states under state_bits=8: the options apply to the
    real params beside them."""
    torch.manual_seed(0)
    complex_param = torch.nn.Parameter(torch.randn(70, 80, dtype=torch.complex64))
    real_param = torch.nn.Parameter(torch.randn(70, 80))
    opt = fastoptim.AdamW([complex_param, real_param], lr=1e-2, **options)
    for p in (complex_param, real_param):
        p.grad = torch.randn_like(p)
    opt.step()
    assert {v.dtype for k, v in opt.state[complex_param].items() if k != "step"} == {torch.complex64}
    assert opt.state[complex_param]["exp_avg_sq"].shape == complex_param.shape
    assert any(v.dtype != torch.float32 or v.shape != real_param.shape  # beside a subset-norm record
               for k, v in opt.state[real_param].items() if k != "step" and torch.is_tensor(v))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_complex_adamw_is_torchs_and_loads_its_checkpoint(engine, amsgrad):
    torch.manual_seed(0)
    ours_params = [torch.nn.Parameter(torch.randn(40, 30, dtype=torch.complex64))]
    torch_params = [torch.nn.Parameter(ours_params[0].detach().clone())]
    ours = fastoptim.AdamW(ours_params, lr=1e-2, amsgrad=amsgrad, **ENGINES[engine])
    theirs = torch.optim.AdamW(torch_params, lr=1e-2, amsgrad=amsgrad, foreach=False)
    for step in range(6):
        grad = torch.randn(40, 30, dtype=torch.complex64)
        ours_params[0].grad, torch_params[0].grad = grad.clone(), grad.clone()
        theirs.step()
        if step == 2:  # resume from torch's checkpoint
            ours.load_state_dict(theirs.state_dict())
            ours_params[0].data.copy_(torch_params[0].detach())
            continue
        ours.step()
    torch.testing.assert_close(ours_params[0].detach(), torch_params[0].detach(), rtol=1e-5, atol=1e-6)
    for key, value in theirs.state[torch_params[0]].items():
        torch.testing.assert_close(ours.state[ours_params[0]][key], value, rtol=1e-5, atol=1e-6)


# --- a compiled step comes back to the graph of a grads pattern it has seen ------------------------

@pytest.mark.parametrize("cls, options", [(fastoptim.Adan, dict(max_grad_norm=1.0)), (fastoptim.AdamW, {}),
                                          (fastoptim.Lion, dict(state_bits=8)),
                                          (fastoptim.Adan, dict(foreach=True, fused=False))])
def test_alternating_frozen_parts_compile_to_one_graph_per_pattern(cls, options):
    """A GAN's step: the generator's and the discriminator's params take turns having grads, after
    a first step with all of them (which creates every state: a step that creates states traces
    anew). Each pattern is traced once, and the compiled steps are the eager ones."""
    from .test_compile import assert_same, model_params

    pairs = [(params, cls(params, lr=torch.tensor(0.01), **options)) for params in (model_params(), model_params())]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(pairs[1][1].step, backend="aot_eager", fullgraph=True)
    for step in range(8):
        torch.manual_seed(step)
        grads = [torch.randn_like(p) for p in pairs[0][0]]
        for params, _ in pairs:
            for i, (param, grad) in enumerate(zip(params, grads)):
                param.grad = grad.clone() if step == 0 or (i < 2) == (step % 2 == 0) else None
        pairs[0][1].step()
        compiled()
    assert_same(*pairs)
    assert counters["stats"]["unique_graphs"] == 3


# --- step counts written by hand -----------------------------------------------------------------
# torch.optim reads a param's count where its state holds it (``state["step"]``), official Adan its
# group's (``group["step"]``); a user may write either between steps, in place or by assignment.

GOOD_COUNTS = {"int": 1, "float": 1.0, "int64 tensor": torch.tensor(1), "float64 tensor": torch.tensor(1.0).double()}
BAD_COUNTS = {"1-d": torch.zeros(3), "one-element 1-d": torch.tensor([2.0]), "negative": -1, "fraction": 1.5,
              "nan": float("nan"), "text": "2", "bool": True}
COUNTING = [cls for cls in ALL if cls is not fastoptim.Lion]  # Lion counts no steps
NEW_STORAGE = {"set_": lambda count, value: count.set_(value),
               ".data =": lambda count, value: setattr(count, "data", value)}


def count_holders(optimizer):
    """The dicts that hold ``optimizer``'s step counts under ``step``: its params' states (torch's
    counts) or, where those hold none, its groups (official Adan's)."""
    return ([state for state in optimizer.state.values() if "step" in state]
            or [group for group in optimizer.param_groups if "step" in group])


def assert_steps_as_after_a_load(cls, engine, optimizer, params):
    """The next step of ``optimizer`` and that of a twin that loaded its state dict (copies of
    ``params``) agree bit for bit, and so do the counts that they leave and save. The twin is made
    after the step: a state dict made meanwhile would make the step check every tensor again."""
    twin_params = [param.detach().clone().requires_grad_() for param in params]
    saved = copy.deepcopy(optimizer.state_dict())
    run(optimizer, params, steps=1, seed=5)
    twin = cls(twin_params, lr=1e-2, **ENGINES[engine])
    twin.load_state_dict(saved)
    run(twin, twin_params, steps=1, seed=5)
    for param, twin_param in zip(params, twin_params):
        assert torch.equal(param, twin_param)
    saved = [holder["step"] for holder in count_holders(optimizer)]
    assert all(torch.equal(a, b) for a, b in zip(saved, [holder["step"] for holder in count_holders(twin)]))
    saved_counts = [state["step"] for state in optimizer.state_dict()["state"].values() if "step" in state]
    twin_counts = [state["step"] for state in twin.state_dict()["state"].values() if "step" in state]
    assert all(torch.equal(a, b) for a, b in zip(saved_counts, twin_counts))


@pytest.mark.parametrize("write", NEW_STORAGE)
@pytest.mark.parametrize("which", ["first", "last", "all"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", COUNTING)
def test_a_count_given_new_storage_between_steps_is_the_one_the_step_reads_advances_and_saves(
        cls, engine, which, write):
    """``state["step"].set_(torch.tensor(1.))`` or ``.data = ...``: the count's tensor has storage of
    its own, where the user and ``state_dict()`` read it. The next step reads, advances and saves
    that count, as it would after loading it, whichever params' counts moved."""
    params, optimizer = make(cls, engine)
    run(optimizer, params)
    holders = count_holders(optimizer)
    for holder in {"first": holders[:1], "last": holders[-1:], "all": holders}[which]:
        NEW_STORAGE[write](holder["step"], torch.tensor(1.0))
    assert_steps_as_after_a_load(cls, engine, optimizer, params)


@pytest.mark.parametrize("value", GOOD_COUNTS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", COUNTING)
def test_a_count_set_to_a_number_is_taken_as_torch_takes_it(cls, engine, value):
    """``state["step"] = 1`` (torch.optim turns a number count into a tensor when it loads one) or
    official Adan's ``group["step"] = 1``: the step takes it as the fp32 tensor count it keeps, as a
    step after loading it would."""
    params, optimizer = make(cls, engine)
    run(optimizer, params)
    holders = count_holders(optimizer)
    holders[0]["step"] = GOOD_COUNTS[value]
    assert_steps_as_after_a_load(cls, engine, optimizer, params)
    count = holders[0]["step"]
    assert count.dtype == torch.float32 and count.shape == () and count == 2


@pytest.mark.parametrize("flags", [dict(foreach=True), {}], ids=["foreach", "fused"])
def test_adans_group_count_set_to_a_number_between_compiled_steps_is_taken(flags):
    """Official Adan's ``group["step"] = 1`` between compiled steps: the step is traced again and
    counts on from 1, as the eager step does. (A param's count set to a number cannot be compiled:
    torch.compile reads ``state["step"].is_cpu`` of every state before the optimizer runs, for
    torch.optim's optimizers too.)"""
    params, _ = make(fastoptim.Adan)
    optimizer = fastoptim.Adan(params, lr=1e-2, **flags)
    torch._dynamo.reset()
    compiled_step = torch.compile(optimizer.step, backend="aot_eager", fullgraph=True)
    twin = None
    for step in range(5):
        if step == 2:
            optimizer.param_groups[0]["step"] = 1
            twin_params = [param.detach().clone().requires_grad_() for param in params]
            twin = fastoptim.Adan(twin_params, lr=1e-2, **flags)
            twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        for param in params:
            param.grad = torch.full_like(param, step + 1.0)
        compiled_step()
        if twin is not None:
            for param in twin_params:
                param.grad = torch.full_like(param, step + 1.0)
            twin.step()
    assert optimizer.param_groups[0]["step"] == 4 == twin.param_groups[0]["step"]
    for param, twin_param in zip(params, twin_params):
        torch.testing.assert_close(param, twin_param, rtol=1e-6, atol=1e-7)


def assert_unchanged_but_the_count(params, optimizer, before):
    """The params and every state and group are as ``before`` (params and a state dict), the
    count that was set to no count aside."""
    values, state_dict = before
    assert all(torch.equal(a, b) for a, b in zip(values, params))
    for saved, now in zip(state_dict["state"].values(), optimizer.state_dict()["state"].values()):
        assert saved.keys() == now.keys()
        assert all(now[key].shape == value.shape and torch.allclose(now[key], value, rtol=0, atol=0, equal_nan=True)
                   for key, value in saved.items() if torch.is_tensor(value))  # a NaN count is kept as a tensor


@pytest.mark.parametrize("value", BAD_COUNTS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", COUNTING)
def test_a_count_set_to_no_count_is_refused_as_written_or_by_the_step_which_changes_nothing(cls, engine, value):
    """A param's state refuses a count of no number (text, a bool) as it is written (see
    test_review_traced); a group's count (official Adan's), and a number that is no count, the step
    refuses."""
    params, optimizer = make(cls, engine)
    run(optimizer, params)
    before = snapshot(params, optimizer)
    with pytest.raises(ValueError, match="Invalid step"):
        count_holders(optimizer)[0]["step"] = BAD_COUNTS[value]
        before = snapshot(params, optimizer)  # with the count as written
        run(optimizer, params, steps=1)
    assert_unchanged_but_the_count(params, optimizer, before)


@pytest.mark.parametrize("value", BAD_COUNTS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", COUNTING)
def test_a_saved_count_that_is_no_count_is_refused_at_load_which_changes_nothing(cls, engine, value):
    """As official Adan's group count is (test_adversarial): a negative count would divide by zero
    in the bias corrections of the next step."""
    params, optimizer = make(cls, engine)
    run(optimizer, params)
    saved = copy.deepcopy(optimizer.state_dict())
    holders = [state for state in saved["state"].values() if "step" in state] or saved["param_groups"]
    holders[-1]["step"] = BAD_COUNTS[value]
    before = snapshot(params, optimizer)
    with pytest.raises(ValueError, match="Invalid step"):
        optimizer.load_state_dict(saved)
    assert_unchanged(params, optimizer, before)


# --- inference mode and stochastic rounding's seeds (helper-97) --------------------------------------------

@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("how", ["step", "load_state_dict"])
@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_states_made_under_inference_mode_step_as_any_others(info, how, engine):
    """A step (an evaluation helper's) or a load under torch.inference_mode() made inference-tensor states,
    which the loop and foreach engines' next step refused midway, params or states written, while the fused
    kernels stepped them. They are made outside inference mode: the run is the one without it."""
    runs = []
    for inference in (False, True):
        params = [torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
                  for i, shape in enumerate([(4, 3), (5, 2)])]
        opt = info.cls(params, lr=1e-2, **ENGINES[engine])
        for step in range(3):
            for param in params:
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 + step))
            with torch.inference_mode(inference and step == 0 and how == "step"):
                opt.step()
            if step == 0 and how == "load_state_dict":
                with torch.inference_mode(inference):
                    opt.load_state_dict(opt.state_dict())
        assert not any(value.is_inference() for state in opt.state.values() for value in state.values()
                       if isinstance(value, torch.Tensor))
        runs.append(params)
    assert all(map(torch.equal, *runs))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_state_given_as_an_inference_tensor_is_refused_by_name_with_nothing_changed(engine):
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 2))]
    opt = fastoptim.AdamW(params, lr=1e-2, **ENGINES[engine])
    for param in params:
        param.grad = torch.randn_like(param)
    opt.step()
    with torch.inference_mode():
        made = opt.state[params[1]]["exp_avg"].clone()
    opt.state[params[1]]["exp_avg"] = made
    before = snapshot(params, opt)
    with pytest.raises(RuntimeError, match="state 'exp_avg' of a param of shape \\(5, 2\\) is an inference tensor"):
        opt.step()
    assert_unchanged(params, opt, before)


def _bf16_run(engine, grads, steps, resume_at=None, scaler=False):
    """bf16 AdamW with stochastic rounding over 2 params, stepped on ``grads(step)``; with ``resume_at``, saved
    after that many steps (the optimizer's, GradScaler's and torch's generator's states) and resumed in a new
    optimizer, as docs/contract.md says a resumed run is the uninterrupted one."""
    def make():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in ((80, 64), (33, 7))]
        return params, fastoptim.AdamW(params, lr=1e-2, stochastic_rounding=True, **ENGINES[engine]), (
            torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None)

    params, opt, amp = make()
    for step in range(steps):
        if step == resume_at:
            saved = opt.state_dict(), amp and amp.state_dict(), torch.get_rng_state(), [p.detach().clone() for p in params]
            params, opt, amp = make()
            with torch.no_grad():
                for param, value in zip(params, saved[3]):
                    param.copy_(value)
            opt.load_state_dict(saved[0])
            if amp:
                amp.load_state_dict(saved[1])
            torch.set_rng_state(saved[2])
        if amp:
            amp.scale(torch.ones(()))  # as scaling a loss would, before backward
        for param, grad in zip(params, grads(step)):
            param.grad = grad
        if amp:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
    return params


def _seeded_bf16_grads(step, transposed_from=None, inf_at=None):
    generator = torch.Generator().manual_seed(step)
    grads = [torch.randn(shape, generator=generator).bfloat16() for shape in ((80, 64), (33, 7))]
    if transposed_from is not None and step >= transposed_from:  # laid out as its transpose: left to foreach
        grads[0] = grads[0].t().contiguous().t()
    if step == inf_at:
        grads[1][0, 0] = float("inf")  # an overflow: GradScaler skips the step
    return grads


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_refused_launch_gives_back_its_stochastic_rounding_seed(engine):
    """A fused launch that its tables refused (a grad come transposed) drew a seed, and the launch of the split
    made again drew another: the step and the generator hung on whether the tables were kept, so a resumed run
    parted from the uninterrupted one."""
    grads = functools.partial(_seeded_bf16_grads, transposed_from=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the transposed grad's fallback to foreach
        assert all(map(torch.equal, _bf16_run(engine, grads, 5), _bf16_run(engine, grads, 5, resume_at=3)))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_step_gradscaler_skips_draws_the_same_seeds_after_a_resume(engine):
    """A skipped step drew its seeds on the bound step (the kernels skip on the device), and none on the checked
    step of a new work over existing states, which took it for a step that creates states."""
    grads = functools.partial(_seeded_bf16_grads, inf_at=3)
    assert all(map(torch.equal, _bf16_run(engine, grads, 6, scaler=True), _bf16_run(engine, grads, 6, 3, scaler=True)))


def test_gradient_release_under_inference_mode_makes_states_as_any_others():
    """Release steps in backward, and step() steps what backward left: under torch.inference_mode() they made
    inference-tensor states, which the next step refused midway (helper-99)."""
    runs = []
    for inference in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        opt = fastoptim.AdamW(model.parameters(), lr=1e-2, foreach=False, fused=False)
        opt.enable_gradient_release()
        for step in range(3):
            loss = model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).square().sum()
            with torch.inference_mode(inference and step == 0):
                loss.backward()
                opt.step()
            opt.zero_grad()
        assert not any(value.is_inference() for state in opt.state.values() for value in state.values())
        runs.append([param.detach().clone() for param in model.parameters()])
    assert all(map(torch.equal, *runs))


def test_an_adan_group_count_given_as_an_inference_tensor_is_refused_by_name_with_nothing_changed():
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    opt = fastoptim.Adan(params, lr=1e-2)
    params[0].grad = torch.randn(4, 3)
    opt.step()
    with torch.inference_mode():
        count = torch.tensor(5.0)
    opt.param_groups[0]["step"] = count
    before = snapshot(params, opt)
    with pytest.raises(ValueError, match="Invalid step: the group's count is an inference tensor"):
        opt.step()
    opt.param_groups[0]["step"] = before[1]["param_groups"][0]["step"]
    assert_unchanged(params, opt, before)
