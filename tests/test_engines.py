"""Every engine against the loop engine, over drawn shapes, dtypes and options."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastoptim
import fastoptim.engines
from fastoptim.engines import foreach

from . import oracle
from .registry import OPTIMIZERS

shapes = st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def drawn_options(info):
    """The options drawn for an optimizer of the registry: lr, weight decay, clipping, maximize, and
    each of its own options at its default or changed."""
    return st.fixed_dictionaries({
        "lr": st.sampled_from([1e-2, 0.3]),
        "weight_decay": st.sampled_from([0.0, 0.05]),
        "max_grad_norm": st.sampled_from([0.0, 0.5]),
        "maximize": st.booleans(),
    } | info.drawn_own_options())


def run_engines(cls, shapes, dtype, options, tensor_lr, steps=4):
    results = []
    for engine in (dict(foreach=False), dict(foreach=True)):
        params = oracle.make_params(shapes, dtype)
        lr = torch.tensor(options["lr"]) if tensor_lr else options["lr"]
        opt = cls(params, **(options | {"lr": lr}), **engine)
        oracle.run(opt, params, oracle.grad_sequence(shapes, steps))
        results.append((params, opt.state_dict()))
    return results


def assert_same(results, dtype):
    (loop_params, loop_state), (params, state) = results
    tolerance = 0 if dtype == torch.float32 else torch.finfo(dtype).eps
    for a, b in zip(params, loop_params):
        torch.testing.assert_close(a, b, rtol=max(tolerance, 1e-6), atol=1e-6)
    for key in state["state"]:
        for name, value in state["state"][key].items():
            torch.testing.assert_close(value, loop_state["state"][key][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("info", OPTIMIZERS)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), shapes=shapes, dtype=dtypes, tensor_lr=st.booleans())
def test_foreach_matches_loop(info, data, shapes, dtype, tensor_lr):
    options = data.draw(drawn_options(info))
    assert_same(run_engines(info.cls, shapes, dtype, options, tensor_lr), dtype)


def test_foreach_slices_bound_the_scratch_and_cover_every_tensor():
    tensors = [torch.empty(n) for n in (5, 5, 20, 1, 1, 9)]
    parts = list(foreach.slices(tensors, limit=10))
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert all(sum(t.numel() for t in tensors[p]) <= 10 or p.stop - p.start == 1 for p in parts)


@pytest.mark.parametrize("cls", [info.cls for info in OPTIMIZERS], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_matches_loop_across_slices_and_pieces_of_large_tensors(monkeypatch, cls, dtype):
    monkeypatch.setattr(foreach, "SLICE_NUMEL", 16)
    shapes = [(7,), (5, 3), (40,), (2, 2), (3,), (6, 7)]  # (40,) and (6, 7) are cut into flat views
    params = oracle.make_params(shapes, dtype)
    plan = fastoptim.engines.Plan({"param": params, "grad": params}, update=None, spec=cls.algorithm.spec,
                                  args={"x": torch.arange(6.0)}, per_tensor=frozenset({"x"}))
    cut = foreach.pieces(plan, 16)
    if cls.algorithm.spec.elementwise:
        assert [t.numel() for t in cut.tensors["param"]] == [7, 15, 16, 16, 8, 4, 3, 16, 16, 10]
        assert cut.args["x"].tolist() == [0, 1, 2, 2, 2, 3, 4, 5, 5, 5]
    else:  # its math needs each tensor whole (Muon's matrices)
        assert [t.numel() for t in cut.tensors["param"]] == [7, 15, 40, 4, 3, 42]
    results = run_engines(cls, shapes, dtype, dict(lr=0.01, weight_decay=0.02), False)
    assert_same(results, dtype)


def test_mixed_dtypes_in_one_group_are_bucketed():
    shapes = [(4,), (3, 2), (5,)]
    params = oracle.make_params(shapes[:2]) + oracle.make_params(shapes[2:], torch.bfloat16)
    alone = [p.detach().clone().requires_grad_() for p in params]
    grads = oracle.grad_sequence(shapes, 3)
    oracle.run(fastoptim.AdamW(params, lr=0.01, foreach=True), params, grads)
    for i, p in enumerate(alone):
        oracle.run(fastoptim.AdamW([p], lr=0.01, foreach=False), [p], [[g[i]] for g in grads])
    for a, b in zip(params, alone):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
