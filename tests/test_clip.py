"""fastoptim.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastoptim
from fastoptim import clip
from fastoptim.engines.backends import cpu as cpu_backend

shapes = st.lists(st.lists(st.integers(0, 70), min_size=0, max_size=3).map(tuple), min_size=1, max_size=12)


def twins(shapes, dtype, seed, none_every=0, special=None):
    """Two lists of params with equal grads (every ``none_every``-th grad None; ``special`` written
    into the first element of the first non-empty grad)."""
    generator = torch.Generator().manual_seed(seed)
    ours, theirs = [], []
    for i, shape in enumerate(shapes):
        param = torch.zeros(shape, dtype=dtype)
        grad = None if none_every and i % none_every == 0 else (torch.randn(shape, generator=generator) * 3).to(dtype)
        for params in (ours, theirs):
            params.append(torch.nn.Parameter(param.clone()))
            params[-1].grad = None if grad is None else grad.clone()
    if special is not None:
        grad = next(p.grad for p in ours if p.grad is not None and p.grad.numel())
        grad.view(-1)[0] = special
        next(p.grad for p in theirs if p.grad is not None and p.grad.numel()).view(-1)[0] = special
    return ours, theirs


def assert_same(ours, theirs, our_norm, their_norm, rtol):
    torch.testing.assert_close(our_norm, their_norm.float(), rtol=rtol, atol=0, equal_nan=True)
    for a, b in zip(ours, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=1e-30, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([2.0, math.inf, "inf"]),
       st.floats(0.0, 50.0), st.sampled_from([0, 2, 3]), st.integers(0, 2**31))
def test_the_norm_and_the_clipped_grads_are_torchs(shapes, dtype, norm_type, max_norm, none_every, seed):
    ours, theirs = twins(shapes, dtype, seed, none_every)
    if not any(p.grad is not None and p.grad.numel() for p in theirs):
        return
    our_norm = fastoptim.clip_grad_norm_(ours, max_norm, norm_type)
    assert our_norm.dtype == torch.float32 and our_norm.dim() == 0
    if dtype == torch.float32:
        # torch's inf norm refuses empty grads (no identity); ours counts them as 0, which changes nothing
        their_norm = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.numel()], max_norm, norm_type)
        assert_same(ours, theirs, our_norm, their_norm, rtol=1e-5)
    else:  # torch reduces bf16 grads in bf16; ours in fp32 and double: held to a float64 oracle instead
        grads = [p.grad.double() for p in theirs if p.grad is not None]
        norm = max(g.abs().max() for g in grads if g.numel()) if norm_type in (math.inf, "inf") else torch.sqrt(
            sum(g.square().sum() for g in grads))
        factor = min(1.0, max_norm / (norm.item() + 1e-6))
        for p in theirs:
            if p.grad is not None:
                p.grad = (p.grad.double() * factor).to(dtype)
        assert_same(ours, theirs, our_norm, norm, rtol=2**-7)


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_non_finite_grads(special, norm_type):
    ours, theirs = twins([(40, 3), (7,)], torch.float32, 0, special=special)
    our_norm = fastoptim.clip_grad_norm_(ours, 1.0, norm_type)
    their_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert_same(ours, theirs, our_norm, their_norm, rtol=1e-6)
    ours, _ = twins([(40, 3), (7,)], torch.float32, 0, special=special)
    before = [p.grad.clone() for p in ours]
    with pytest.raises(RuntimeError, match="non-finite|cannot be clipped"):
        fastoptim.clip_grad_norm_(ours, 1.0, norm_type, error_if_nonfinite=True)
    assert all(torch.equal(p.grad, b) or torch.isnan(b).any() for p, b in zip(ours, before))  # nothing scaled


def test_zero_grads_stay_zero_and_a_single_tensor_is_accepted():
    param = torch.nn.Parameter(torch.ones(10))
    param.grad = torch.zeros(10)
    assert fastoptim.clip_grad_norm_(param, 1.0).item() == 0 and (param.grad == 0).all()
    assert fastoptim.clip_grad_norm_([torch.nn.Parameter(torch.ones(3))], 1.0).item() == 0  # no grads


def test_2000_small_tensors_and_other_paths_match_torch():
    shapes = [(i % 97 + 1,) for i in range(2000)]
    for options in ({}, {"foreach": False}, {"norm_type": 1.0}, {"norm_type": 3.0}):
        ours, theirs = twins(shapes, torch.float32, 1)
        our_norm = fastoptim.clip_grad_norm_(ours, 5.0, **options)
        their_norm = torch.nn.utils.clip_grad_norm_(theirs, 5.0, **options)
        assert_same(ours, theirs, our_norm, their_norm, rtol=1e-5)


@pytest.mark.parametrize("max_norm", [-1.0, math.nan])
def test_a_negative_or_nan_max_norm_is_refused_before_anything_changes(max_norm):
    ours, _ = twins([(5, 5)], torch.float32, 0)
    before = ours[0].grad.clone()
    with pytest.raises(ValueError, match="max_norm"):
        fastoptim.clip_grad_norm_(ours, max_norm)
    assert torch.equal(ours[0].grad, before)


@pytest.mark.skipif(not cpu_backend.AVAILABLE, reason="the fused CPU kernel is not built")
def test_the_norm_does_not_depend_on_the_thread_count():
    ours, _ = twins([(300_000,), (1000, 70)], torch.float32, 2)
    grads = [p.grad for p in ours]
    threads = torch.get_num_threads()
    try:
        norms = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            norms.append(fastoptim.clip.grad_norm(grads))
    finally:
        torch.set_num_threads(threads)
    assert norms[0] == norms[1] == norms[2]


@pytest.mark.parametrize("change", ["resized", "dtype", "same"])
def test_calls_over_the_same_params_with_other_grads_match_torch(change):
    """An eager call keeps its tables for the next over the same parameters (``clip._eager_tables``):
    params and grads resized, or of another dtype (float64, which the kernel leaves to foreach), since
    the last call must be clipped as torch clips them; the same grads again too."""
    ours, theirs = twins([(3, 5), (40,), (7,)], torch.float32, seed=0)
    for call in range(3):
        if call == 1 and change != "same":
            for params in (ours, theirs):
                for i, param in enumerate(params):
                    size, dtype = (13 * (i + 1),) if change == "resized" else param.shape, \
                        torch.float64 if change == "dtype" and i == 1 else param.dtype
                    param.data = torch.zeros(size, dtype=dtype)
                    param.grad = (torch.arange(param.numel(), dtype=torch.float32).reshape(size) - 3).to(dtype)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        norm = fastoptim.clip_grad_norm_(ours, 1.0)
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        for mine, torchs in zip(ours, theirs):
            torch.testing.assert_close(mine.grad, torchs.grad, rtol=1e-6, atol=1e-7)


def _set(param, size, dtype, dense=True):
    """``param`` given new data of ``size`` and ``dtype``, and a grad of the same values in every call
    (one with gaps between its elements where not ``dense``)."""
    param.data = torch.zeros(size, dtype=dtype)
    values = (torch.arange(2 * size, dtype=torch.float32) / size - 1).to(dtype)
    param.grad = values[:size] if dense else values[::2]
    return param


MIXED = [(10, torch.float32), (20, torch.bfloat16), (30, torch.float32)]  # two buckets for the kernel
SECOND_CALLS = {  # over the first call's params (fp32, bf16, fp32): the params of the second call
    "another order": lambda params: [params[0], params[2], params[1]],
    "a float64 grad, another resized": lambda params: [_set(params[0], 10, torch.float64), _set(params[1], 25,
                                                                                                 torch.bfloat16),
                                                       params[2]],
    "a grad with gaps, another resized": lambda params: [_set(params[0], 10, torch.float32, dense=False),
                                                         _set(params[1], 25, torch.bfloat16), params[2]],
}


@pytest.mark.parametrize("second", SECOND_CALLS)
def test_calls_over_params_of_mixed_dtypes_in_another_order_or_other_grads_match_torch(second):
    """The tables an eager call keeps (by the params' count and first one) are not the plan of these
    grads: the kernel's answers make them again before any grad is scaled."""
    ours, theirs = ([_set(torch.nn.Parameter(torch.empty(0)), size, dtype) for size, dtype in MIXED] for _ in "ab")
    mine, torchs = ours, theirs
    for call in range(3):
        if call == 1:  # then the same again
            mine, torchs = SECOND_CALLS[second](ours), SECOND_CALLS[second](theirs)
        expected = torch.nn.utils.clip_grad_norm_(torchs, 1.0)
        norm = fastoptim.clip_grad_norm_(mine, 1.0)
        # torch reduces the bf16 grads in bf16, the kernel in float64
        torch.testing.assert_close(norm, expected, rtol=2**-8, atol=0)
        for a, b in zip(mine, torchs):
            torch.testing.assert_close(a.grad, b.grad, rtol=2**-7, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtypes", [(torch.complex64,), (torch.complex64, torch.float32), (torch.complex128,)],
                         ids=["complex64", "complex64 and float32", "complex128"])
def test_complex_grads_are_clipped_as_torch_clips_them(norm_type, dtypes):
    """A complex grad's norm is of its magnitudes, as torch's (it raised: foreach_norm was asked for a real
    dtype: helper-51)."""
    generator = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, dtype=dtype, generator=generator)) for dtype in dtypes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, dtype=a.dtype, generator=generator) * 3
        b.grad = a.grad.clone()
    norm = fastoptim.clip_grad_norm_(ours, 1.0, norm_type)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_meta_grads_give_a_meta_norm_as_torch_s(norm_type):
    """On the meta device (a model being traced for its shapes), as torch: a 0-d meta norm (it raised: the
    factor was copied to the host for the kernel, which takes no meta tensors: helper-51)."""
    param = torch.nn.Parameter(torch.zeros(4, device="meta"))
    param.grad = torch.empty(4, device="meta")
    norm = fastoptim.clip_grad_norm_([param], 1.0, norm_type)
    assert norm.device.type == "meta" and norm.shape == () and norm.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kernel", [True, False])
def test_an_empty_grad_counts_as_0_in_the_inf_norm_on_every_path(dtype, kernel, monkeypatch):
    """The native kernel's maximum skipped an empty grad, while the foreach path (float64 grads, or no native
    build) handed it to torch's inf norm, which refuses it (helper-102). Both skip it, all empty or not."""
    if not kernel:
        monkeypatch.setattr(clip, "clip_backend", lambda grads: None)
    for shapes in ([(0,), (3,), (2, 0)], [(0,), (2, 0)]):
        params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
        for param in params:
            param.grad = torch.full_like(param, -5.0)
        norm = fastoptim.clip_grad_norm_(params, 1.0, math.inf)
        assert norm.item() == (5.0 if any(map(torch.Tensor.numel, params)) else 0.0)
