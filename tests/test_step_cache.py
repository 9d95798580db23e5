"""A step reuses what it learnt of the params, states and grads at the previous one (see
``GroupWork``). Whatever a user changes between steps must be seen: a param's storage, shape or
dtype, a state cleared or replaced, new grads. A change that cannot go on gets a clear error before
anything is touched, and a step never keeps the grads alive past itself."""
import contextlib
import copy
import gc
import pickle
import subprocess
import sys
import weakref
from unittest import mock

import pytest
import torch

import fastoptim
from fastoptim.bench.peers import timm_adan_class
from fastoptim.multi_tensor import FlatStates
from fastoptim.specs import CODE_TABLES, Role
from fastoptim.states import formats, subset_norm

from . import oracle, registry
from .test_bad_input import assert_unchanged, snapshot

OPTIMIZERS = [fastoptim.Adan, fastoptim.AdamW]
ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}
SHAPES = [(7,), (40000,), (5, 3)]  # one tensor crosses the kernel's chunk size


def stepped(cls, flags, steps=2, **options):
    params = oracle.make_params(SHAPES)
    optimizer = cls(params, lr=0.01, weight_decay=0.02, **flags, **options)
    oracle.run(optimizer, params, oracle.grad_sequence(SHAPES, steps))
    return params, optimizer


@pytest.mark.filterwarnings("ignore:fastoptim. fused=True, but no fused kernel for torch.float64")
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("change", ["larger", "reshaped", "float64"])
def test_a_param_changed_under_its_state_is_refused_before_anything_is_touched(cls, engine, change):
    """``p.data = ...`` with another shape or dtype: the states no longer fit. Reading them with the
    new param's size would write out of bounds in the kernel."""
    params, optimizer = stepped(cls, ENGINES[engine])
    new = {"larger": torch.zeros(80000), "reshaped": params[1].data.view(200, 200),
           "float64": params[1].data.double()}[change]
    params[1].data, value = new, new.clone()
    for param in params:
        param.grad = torch.ones_like(param)
    before = snapshot(params, optimizer)
    with pytest.raises(RuntimeError,
                       match=r"was the param (\(or state_bits, master_bits\) )?changed after its state was created"):
        optimizer.step()
    assert_unchanged(params, optimizer, before)
    optimizer.state[params[1]].clear()  # the remedy the message names: the param starts afresh
    optimizer.step()
    assert not torch.equal(params[1].detach(), value)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_param_made_float64_beside_its_unchanged_grad_is_refused(cls, engine):
    """The grad is the same object as at the last step, but no longer matches its param."""
    params, optimizer = stepped(cls, ENGINES[engine])
    params[0].data = params[0].data.double()
    before = snapshot(params, optimizer)
    with pytest.raises(RuntimeError, match="a gradient must match its parameter"):
        optimizer.step()
    assert_unchanged(params, optimizer, before)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_grad_whose_storage_is_swapped_for_a_smaller_one_is_refused(engine):
    params, optimizer = stepped(fastoptim.AdamW, ENGINES[engine])
    params[1].grad.data = torch.ones(10)
    before = snapshot(params, optimizer)
    with pytest.raises(RuntimeError, match="a gradient must match its parameter"):
        optimizer.step()
    assert_unchanged(params, optimizer, before)


def clear_then_replace(optimizer, params, step):
    """Between steps 3 and 4: clear one param's state; between 5 and 6: replace a moment."""
    if step == 3:
        optimizer.state[params[0]].clear()
    if step == 5:
        optimizer.state[params[2]]["exp_avg"] = torch.full_like(params[2], 0.5)


def run_with_edits(optimizer, params, grads):
    for step, step_grads in enumerate(grads):
        clear_then_replace(optimizer, params, step)
        oracle.run(optimizer, params, [step_grads])


@pytest.mark.parametrize("engine", ENGINES)
def test_states_cleared_or_replaced_between_steps_are_used_as_timm_uses_them(engine):
    params = oracle.make_params(SHAPES)
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(SHAPES, 8)
    run_with_edits(fastoptim.Adan(params, lr=0.01, weight_decay=0.02, **ENGINES[engine]), params, grads)
    run_with_edits(timm_adan_class()(peer_params, lr=0.01, weight_decay=0.02), peer_params, grads)
    assert oracle.relative_error(params, peer_params) < 1e-5


@pytest.mark.parametrize("engine", ENGINES)
def test_states_cleared_or_replaced_between_steps_are_used_as_torch_uses_them(engine):
    params = oracle.make_params(SHAPES)
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(SHAPES, 8)
    run_with_edits(fastoptim.AdamW(params, lr=0.01, **ENGINES[engine]), params, grads)
    run_with_edits(torch.optim.AdamW(peer_params, lr=0.01), peer_params, grads)
    assert oracle.relative_error(params, peer_params) < 1e-5


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_step_keeps_no_grad_alive(cls, engine):
    """After ``zero_grad()`` (set_to_none) the grads of the last step are freed: nothing in the
    optimizer holds them, so memory for one more set of grads is never needed."""
    params, optimizer = stepped(cls, ENGINES[engine])
    grads = [weakref.ref(p.grad) for p in params]
    optimizer.zero_grad()
    gc.collect()
    assert all(grad() is None for grad in grads)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_an_optimizer_dropped_frees_its_states_at_once(cls, engine):
    """No reference cycle holds an optimizer's states (a state dict's link to its optimizer's is
    weak): dropping the optimizer frees them without waiting for the garbage collector, whose
    pauses would hold gigabytes a while, and show in a step's peak memory."""
    params, optimizer = stepped(cls, ENGINES[engine])
    states = [weakref.ref(t) for state in optimizer.state.values() for t in state.values()
              if isinstance(t, torch.Tensor)]
    assert states
    gc.disable()
    try:
        del optimizer
        assert all(state() is None for state in states)
    finally:
        gc.enable()


@pytest.mark.parametrize("engine", ENGINES)
def test_adan_starts_a_late_param_with_no_gradient_difference_as_timm_does(engine):
    """Official Adan and timm set g_prev = g for a param's first step, whenever it comes (here, at
    the group's third step), and count the steps of a group whose params have no grads."""
    shapes = SHAPES + [(4,)]
    params = oracle.make_params(shapes)
    peer_params = [p.detach().clone().requires_grad_() for p in params]
    options = dict(lr=0.01, weight_decay=0.02)
    optimizers = []
    for cls, flags, ps in ((fastoptim.Adan, ENGINES[engine], params), (timm_adan_class(), {}, peer_params)):
        optimizers.append(cls([{"params": ps[:3]}, {"params": ps[3:]}], **options, **flags))
    for step, grads in enumerate(oracle.grad_sequence(shapes, 6)):
        for optimizer, ps in zip(optimizers, (params, peer_params)):
            for i, (param, grad) in enumerate(zip(ps, grads)):
                late = (i == 1 and step < 2) or (i == 3 and step < 4)  # group 2 has no grads for 4 steps
                param.grad = None if late else grad.clone()
            optimizer.step()
    assert [float(g["step"]) for g in optimizers[0].param_groups] == [6, 6]
    assert oracle.relative_error(params, peer_params) < 1e-5


@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_skipped_step_that_would_create_states_leaves_no_trace(cls, engine):
    """A GradScaler-skipped step on which a param gets its first grad creates no state for it, so
    the run equals one where that step never happened. found_inf is a sum over devices: 2 is a skip."""
    runs = []
    for skip in (True, False):
        params = oracle.make_params(SHAPES)
        optimizer = cls(params, lr=0.01, weight_decay=0.02, **ENGINES[engine])
        for step, grads in enumerate(oracle.grad_sequence(SHAPES, 5)):
            if step == 2 and not skip:
                continue
            for i, (param, grad) in enumerate(zip(params, grads)):
                param.grad = None if i == 1 and step < 2 else grad.clone()
            optimizer.grad_scale, optimizer.found_inf = torch.ones(()), torch.tensor(2.0 if step == 2 else 0.0)
            optimizer.step()
            if step == 2:
                assert not optimizer.state.get(params[1])
        runs.append(params)
    assert oracle.relative_error(*runs) == 0


@pytest.mark.filterwarnings("ignore:fastoptim. fused=True, but no fused kernel for torch.float64")
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_float64_params_clip_by_their_float64_norm(cls, engine):
    params = oracle.make_params(dtype=torch.float64)
    grads = oracle.grad_sequence(oracle.SHAPES, 5, scale=3.0)
    reference = {fastoptim.Adan: oracle.adan, fastoptim.AdamW: oracle.adamw}[cls]
    expected = reference(params, grads, lr=0.01, max_grad_norm=1.0)
    optimizer = cls(params, lr=0.01, max_grad_norm=1.0, **ENGINES[engine])
    oracle.run(optimizer, params, grads)
    assert oracle.relative_error(params, expected) < 1e-6


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("lr", [torch.tensor([0.01, 0.02]), torch.tensor(0.01, device="meta"), torch.tensor(1)])
def test_a_bad_tensor_lr_set_after_construction_is_refused_by_step(cls, lr):
    params, optimizer = stepped(cls, {})
    for param in params:
        param.grad = torch.ones_like(param)
    before = snapshot(params, optimizer)
    optimizer.param_groups[0]["lr"] = lr
    with pytest.raises(ValueError, match="Invalid lr: a Tensor lr must be"):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.01
    assert_unchanged(params, optimizer, before)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_state_dict_takes_the_saved_max_grad_norm(cls):
    params, saved = stepped(cls, {}, max_grad_norm=0.5)
    optimizer = cls(params, lr=0.01)
    optimizer.load_state_dict(saved.state_dict())
    assert optimizer.defaults["max_grad_norm"] == 0.5 == optimizer.param_groups[0]["max_grad_norm"]
    state = saved.state_dict()
    state["param_groups"].append(dict(state["param_groups"][0], max_grad_norm=1.0, params=[]))
    other = cls([{"params": params}, {"params": []}], lr=0.01)
    with pytest.raises(ValueError, match="disagree on max_grad_norm"):
        other.load_state_dict(state)


# --- flat state buffers -------------------------------------------------------------------------

def buffers_by_key(optimizer, params=None):
    """Each state key's tensors' buffers (of ``params``, default all): key to {dtype: set of buffer
    ids} (None: a loose tensor)."""
    found = {}
    for state in (optimizer.state.values() if params is None else [optimizer.state[p] for p in params]):
        for key, value in state.items():
            if torch.is_tensor(value):
                base = value._base
                found.setdefault(key, {}).setdefault(value.dtype, set()).add(None if base is None else id(base))
    return found


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("info", registry.OPTIMIZERS, ids=repr)
def test_the_states_of_a_group_live_in_one_flat_buffer_per_key_and_dtype(info, engine):
    """Every state (counts, 8-bit codes and maxima, remainders) is a view of one buffer per key and
    dtype, with its param's shape and strides (channels_last too), and the steps are those with
    loose states (per-param counts were always gathered): the buffers change where the states
    live, not what they hold."""
    shapes = [(64, 80), (3, 8, 5, 5), (70, 90), (9,)]

    def apart(flat, index, key, tensor):  # a new state (a "meta" tensor: its layout) as zeros of its own
        return torch.zeros_like(tensor, device=flat.device) if tensor.is_meta else tensor

    def run(gathered):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16)) for shape in shapes]
        params[1].data = params[1].data.to(memory_format=torch.channels_last)
        options = dict(state_bits=8, master_bits=24) | (dict(sn=True) if info.second_moment else {})
        optimizer = info.cls(params, lr=1e-2, **ENGINES[engine], **options, **info.own_options)
        with contextlib.nullcontext() if gathered else mock.patch.object(FlatStates, "take", apart):
            for grads in oracle.grad_sequence(shapes, 3):
                for param, grad in zip(params, grads):
                    param.grad = torch.empty_like(param).copy_(grad)  # laid out as its param
                optimizer.step()
        return params, optimizer

    params, optimizer = run(gathered=True)
    for group in optimizer.param_groups:  # Muon's matrices and their AdamW companions: two groups
        for key, by_dtype in buffers_by_key(optimizer, group["params"]).items():
            assert all(len(ids) == 1 and None not in ids for ids in by_dtype.values()), key
    for param in params:
        for key, value in optimizer.state[param].items():
            if torch.is_tensor(value) and value.shape == param.shape:
                assert value.stride() == param.stride(), key
    loose_params, loose = run(gathered=False)
    assert all(None in ids for key, by_dtype in buffers_by_key(loose).items() if key != "step"  # always gathered
               for ids in by_dtype.values())
    assert all(torch.equal(a, b) for a, b in zip(params, loose_params))
    for param, loose_param in zip(params, loose_params):
        state, loose_state = optimizer.state[param], loose.state[loose_param]
        assert state.keys() == loose_state.keys()
        assert all(torch.equal(state[key], loose_state[key]) for key in state if torch.is_tensor(state[key]))


@pytest.mark.parametrize("engine", ["fused-multi", "foreach"])
def test_loaded_states_go_into_flat_buffers_and_resume_exactly(engine):
    params, optimizer = stepped(fastoptim.AdamW, ENGINES[engine], steps=2)
    saved = copy.deepcopy(optimizer.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = fastoptim.AdamW(resumed_params, lr=0.01, weight_decay=0.02, **ENGINES[engine])
    resumed.load_state_dict(saved)
    assert all(len(ids) == 1 and None not in ids for by_dtype in buffers_by_key(resumed).values()
               for ids in by_dtype.values())
    grads = oracle.grad_sequence(SHAPES, 3, seed=5)
    oracle.run(optimizer, params, grads)
    oracle.run(resumed, resumed_params, grads)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed_params))


@pytest.mark.parametrize("engine", ["fused-multi", "loop"])
def test_a_state_the_user_assigned_stays_the_tensor_the_step_updates(engine):
    """A state assigned by hand (here in shared memory, as Hogwild's workers share it) is never moved
    into a buffer: the user's tensor is the one each step updates, and it stays shared."""
    params = oracle.make_params(SHAPES)
    optimizer = fastoptim.AdamW(params, lr=0.01, **ENGINES[engine])
    mine = [torch.zeros_like(param).share_memory_() for param in params]
    for param, exp_avg in zip(params, mine):
        optimizer.state[param]["exp_avg"] = exp_avg
    oracle.run(optimizer, params, oracle.grad_sequence(SHAPES, 2))
    for param, exp_avg in zip(params, mine):
        assert optimizer.state[param]["exp_avg"] is exp_avg and exp_avg.is_shared() and exp_avg.abs().sum() > 0


def test_a_buffers_padding_is_zeros_so_saved_states_do_not_depend_on_the_heap():
    """``torch.save`` writes a view's whole buffer: the bytes between states are zeros, not whatever
    the allocator left there."""
    junk = [torch.full((n,), float("nan")) for n in (9, 41, 300)]
    del junk  # freed memory that a buffer made by torch.empty could reuse
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 37, 3)]
    optimizer = fastoptim.AdamW(params, lr=0.1)
    oracle.run(optimizer, params, [[torch.randn(5), torch.randn(37), torch.randn(3)]])
    buffer = optimizer.state[params[0]]["exp_avg"]._base
    covered = torch.zeros(buffer.numel(), dtype=torch.bool)
    for param in params:
        view = optimizer.state[param]["exp_avg"]
        covered[view.storage_offset() - buffer.storage_offset():][:view.numel()] = True
    assert buffer.numel() > len(params) * 16 - 16 and torch.equal(buffer[~covered], torch.zeros(int((~covered).sum())))


@pytest.mark.parametrize("engine", ["fused-multi", "fused-single"])
def test_steps_over_alternating_grads_gather_each_state_once(engine):
    """A model whose frozen parts alternate: each pattern's new states are gathered once, and states
    already in a buffer stay where they are (no copy per step), so the steps match the loop engine's."""
    runs = []
    for flags in (ENGINES[engine], ENGINES["loop"]):
        params = oracle.make_params(SHAPES)
        optimizer = fastoptim.Adan(params, lr=0.01, **flags)
        grads = oracle.grad_sequence(SHAPES, 8)
        pointers = []
        for step, step_grads in enumerate(grads):
            for i, (param, grad) in enumerate(zip(params, step_grads)):
                param.grad = grad.clone() if (i + step) % 2 or i == 1 else None
            optimizer.step()
            pointers.append({key: value.data_ptr() for param in params for key, value in optimizer.state[param].items()
                             if torch.is_tensor(value)})
        assert all(a == b for a, b in zip(pointers[1:], pointers[2:]))
        runs.append(params)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*runs))


def test_gathered_states_start_on_cache_lines_and_counts_stay_one_tensor():
    """Each gathered state begins where torch's allocator would put a tensor of its own (64 bytes):
    vector loads and stores across cache lines would slow the kernels. Per-param counts stay packed,
    and a 0-d param among them changes neither."""
    params = [torch.nn.Parameter(torch.randn(n).squeeze() if n == 1 else torch.randn(n)) for n in (1, 5, 37, 64, 3)]
    optimizer = fastoptim.AdamW(params, lr=0.1, state_bits=16)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(optimizer.state[p][key].data_ptr() % 64 == 0 for p in params)
    steps = [optimizer.state[p]["step"] for p in params]
    assert [step.storage_offset() for step in steps] == [0, 1, 2, 3, 4] and steps[0]._base.shape == (5,)


@pytest.mark.parametrize("options", [{}, dict(state_bits=8)], ids=["fp32", "8-bit"])
def test_the_first_step_allocates_the_states_once(options):
    """New states are made in their slots of the flat buffers, not as zeros copied in: the first step
    allocates the states' bytes and nothing more (it allocated twice that, a second at GPT-2's size)."""
    params = [torch.nn.Parameter(torch.randn(300, 500, device="cpu")) for _ in range(2)]  # CPU memory is counted
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = fastoptim.Adan(params, lr=1e-3, **options)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        optimizer.step()
    allocated = sum(event.self_cpu_memory_usage for event in profiler.events() if event.self_cpu_memory_usage > 0)
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    assert allocated < 1.01 * sum(value.numel() * value.element_size() for value in states)


@pytest.mark.parametrize("state_format", [*formats.FORMATS.values(), formats.REDUCED, formats.REDUCED64], ids=repr)
@pytest.mark.parametrize("codes", CODE_TABLES)
def test_a_formats_fill_is_what_its_zeros_hold(state_format, codes):
    """A new state in a flat buffer starts at its format's ``fill`` (its slot, zero, filled); one of
    its own at ``zeros``: the two must agree, key by key, in every 8-bit code table."""
    role = Role("exp_avg", codes=codes)
    param = torch.zeros(300, 40, dtype=torch.complex64 if state_format.dtype.is_complex else torch.float32)
    partition = subset_norm.from_options(param.shape, None) if isinstance(state_format, formats.SubsetNorm) else None
    for key, tensor in state_format.zeros(param, role, partition).items():
        assert torch.equal(tensor, torch.full_like(tensor, state_format.fill(role, key))), key


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, lambda state: pickle.loads(pickle.dumps(state))],
                         ids=["copy", "deepcopy", "pickle"])
def test_an_optimizers_state_copies_as_torchs_does(duplicate):
    """``opt.state`` copies as torch.optim's ``defaultdict(dict)`` does: a shallow copy shares each
    param's state dict, a deep copy or a pickle round trip copies them; each copy is a state that counts
    its changes, and a state dict it shares counts for both."""
    param = torch.nn.Parameter(torch.randn(8))
    param.grad = torch.randn(8)
    optimizer = fastoptim.Adan([param], lr=1e-3)
    optimizer.step()
    duplicate_state = duplicate(optimizer.state)
    assert type(duplicate_state) is type(optimizer.state) and len(duplicate_state) == 1
    (state,) = duplicate_state.values()
    assert (state is optimizer.state[param]) == (duplicate is copy.copy)
    assert all(torch.equal(state[key], optimizer.state[param][key]) for key in state if torch.is_tensor(state[key]))
    before = (duplicate_state.changes, optimizer.state.changes)
    state["exp_avg"] = torch.zeros(8)
    assert duplicate_state.changes == before[0] + 1
    assert optimizer.state.changes == before[1] + (duplicate is copy.copy)


WRITES = {"fill_": lambda count: count.fill_(40.0),  # bumps the version counter
          "through .data": lambda count: count.data.fill_(40.0),  # does not
          "through numpy": lambda count: count.numpy().fill(40.0)}  # does not either


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("which", ["all", "one"])
@pytest.mark.parametrize("write", WRITES)
def test_a_count_written_in_place_between_steps_is_the_count_the_next_step_reads(cls, engine, which, write):
    """A count the user writes in place, in any way, is the count the next step reads, also when only
    one param's differs (a bound step's native call reads the counts it holds, and refuses ones moved)."""
    params, optimizer = stepped(cls, ENGINES[engine], steps=3)
    counts = ([optimizer.param_groups[0]["step"]] if cls is fastoptim.Adan
              else [optimizer.state[param]["step"] for param in params])
    for count in counts if which == "all" else counts[:1]:
        WRITES[write](count)
    twin_params = [param.detach().clone().requires_grad_() for param in params]
    twin = cls(twin_params, lr=0.01, weight_decay=0.02, **ENGINES[engine])
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # new count tensors, read afresh
    grads = oracle.grad_sequence(SHAPES, 1)
    oracle.run(optimizer, params, grads)
    oracle.run(twin, twin_params, grads)
    for param, expected in zip(params, twin_params):
        torch.testing.assert_close(param, expected, rtol=0, atol=0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_steps_under_inference_mode_are_the_steps_outside_it(cls, engine):
    """States made under ``torch.inference_mode()`` are inference tensors, which keep no version
    counter: a step must not need one."""
    expected_params, _ = stepped(cls, ENGINES[engine], steps=3)
    with torch.inference_mode():
        params, _ = stepped(cls, ENGINES[engine], steps=3)
    for param, expected in zip(params, expected_params):
        torch.testing.assert_close(param, expected, rtol=0, atol=0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_step_advances_its_counts_and_their_version_counters_as_add_does(cls, engine):
    """A step adds one to every count and bumps each count tensor's version counter once, as
    ``count.add_(1)`` does, also where native code adds (a bound step)."""
    params, optimizer = stepped(cls, ENGINES[engine], steps=3)
    counts = ([optimizer.param_groups[0]["step"]] if cls is fastoptim.Adan
              else [optimizer.state[param]["step"] for param in params])
    for steps in (4, 5):
        versions = [count._version for count in counts]
        oracle.run(optimizer, params, oracle.grad_sequence(SHAPES, 1))
        assert [count._version for count in counts] == [version + 1 for version in versions]
        assert all(torch.equal(count, torch.full_like(count, steps)) for count in counts)


@pytest.mark.parametrize("engine", ENGINES)
def test_counts_moved_to_shared_memory_between_steps_keep_counting(engine):
    """A params' counts tensor moved to shared memory (new storage, the same version counter) before
    a step that does not read the counts as a number (a tensor lr) is still advanced where it now
    lives. In a subprocess: advancing the freed memory instead crashes."""
    script = f"""
import torch, fastoptim
params = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 4), (5,)]]
optimizer = fastoptim.AdamW(params, lr=0.01, **{ENGINES[engine]!r})
for steps in (1, 2, 3):
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    if steps == 1:  # after a step that read the counts as a number
        optimizer.state[params[0]]["step"]._base.share_memory_()  # the params' counts, one tensor
        optimizer.param_groups[0]["lr"] = torch.tensor(0.01)
    assert all(optimizer.state[p]["step"].item() == steps for p in params), steps
print("counted")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "counted", result.stderr[-3000:]


@pytest.mark.parametrize("engine", ["loop", "foreach", "fused-multi"])
def test_a_complex_param_appended_to_a_group_of_real_ones_steps_as_torch_steps_it(engine):
    """Whether the engines take a param's real view was decided when the params were added: a complex param
    appended to a group between steps raised torch's dtype error from lerp_ midway, the real params already
    stepped (helper-109). It now steps as torch.optim.AdamW steps it (its real view)."""
    flags = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
             "fused-multi": dict(foreach=True, fused=True)}[engine]
    results = []
    for cls, options in ((torch.optim.AdamW, dict(foreach=False)), (fastoptim.AdamW, flags)):
        torch.manual_seed(0)
        real = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
        appended = torch.nn.Parameter(torch.randn(4, 2, dtype=torch.complex64))
        optimizer = cls(real, lr=0.01, **options)
        for param in real:
            param.grad = torch.randn_like(param)
        optimizer.step()
        optimizer.param_groups[0]["params"].append(appended)
        for _ in range(2):
            for param in (*real, appended):
                param.grad = torch.randn_like(param)
            optimizer.step()
        results.append([param.detach().clone() for param in (*real, appended)])
    for ours, torchs in zip(*reversed(results)):
        assert torch.equal(ours, torchs) if engine == "loop" else torch.allclose(ours, torchs, rtol=1e-6, atol=1e-7)
