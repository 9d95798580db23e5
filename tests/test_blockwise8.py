"""The 8-bit blockwise quantizer (fastoptim.states.blockwise8) against its documented error."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.states.blockwise8 import BLOCK, LINEAR, SIGNED, TABLES, UNSIGNED, dequantize, n_blocks, quantize

# The documented bound: float-like tables, |x| / 16 in the normal range, else half the smallest step
# times the absmax; the linear one, half its step times the absmax.
SMALLEST_HALF_STEP = {"signed": 2.0**-18, "unsigned": 2.0**-33, "linear": 1 / 254}
RELATIVE = {"signed": 1 / 16, "unsigned": 1 / 16, "linear": 0.0}
KINDS = st.sampled_from(sorted(TABLES))

finite = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
magnitudes = st.sampled_from([0.0, 1.4e-45, 1e-40, 1e-30, 1e-8, 1e-3, 1.0, 1e3, 1e20, 3.4e38])
values = st.one_of(finite, magnitudes, magnitudes.map(lambda x: -x))


def check_round_trip(x, kind):
    indices, absmax = quantize(x, TABLES[kind])
    assert indices.dtype == torch.uint8 and indices.shape == x.shape
    assert absmax.dtype == torch.float32 and absmax.shape == (n_blocks(x.numel()),)
    back = dequantize(indices, absmax, TABLES[kind])
    assert back.dtype == torch.float32 and back.shape == x.shape
    block_absmax = absmax.repeat_interleave(BLOCK)[:x.numel()].view(x.shape).double()
    x64, error = x.double(), (back.double() - x.double()).abs()
    bound = torch.maximum(x64.abs() * RELATIVE[kind], block_absmax * SMALLEST_HALF_STEP[kind]) + 1e-6 * x64.abs()
    # blocks stored as zeros are those whose scale, top / absmax, overflows fp32
    flushed = (block_absmax == 0) & (x != 0)
    assert torch.isinf(TABLES[kind].top / x[flushed].abs()).all() and (back[flushed] == 0).all()
    assert (error[~flushed] <= bound[~flushed]).all(), (x64[error > bound], back[error > bound])
    return indices, absmax, back


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=1, max_size=3 * BLOCK + 7), KINDS)
def test_round_trips_stay_within_the_documented_error(elements, kind):
    x = torch.tensor(elements, dtype=torch.float32)
    if kind == "unsigned":
        x = x.abs()
    check_round_trip(x, kind)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5000), st.floats(1e-12, 1e12), st.integers(0, 2**31))
def test_gaussian_states_of_any_shape_round_trip_and_requantize_to_the_same_indices(numel, scale, seed):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    for kind, tensor in (("signed", x.view(1, -1)), ("unsigned", x.square().view(-1, 1)), ("linear", x.view(-1, 1))):
        indices, absmax, back = check_round_trip(tensor, kind)
        again, again_absmax = quantize(back, TABLES[kind])  # a state moved or resumed stays bit-exact
        assert torch.equal(again, indices) and torch.equal(again_absmax, absmax)


@pytest.mark.parametrize("kind", sorted(TABLES))
def test_each_blocks_largest_element_and_zeros_come_back_exact(kind):
    x = torch.randn(5 * BLOCK + 3, generator=torch.Generator().manual_seed(0)) * 10
    x = x.abs() if kind == "unsigned" else x
    x[::7] = 0
    *_, back = check_round_trip(x, kind)
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    largest = blocks.abs().argmax(dim=1) + torch.arange(len(blocks)) * BLOCK
    assert torch.equal(back[largest], x[largest])
    assert (back[::7] == 0).all()
    assert torch.equal(quantize(torch.zeros(300), TABLES[kind])[1], torch.zeros(2))


def test_the_code_tables():
    for codes, size, low in ((SIGNED, 255, -1.0), (UNSIGNED, 248, 0.0), (LINEAR, 255, -1.0)):
        table = codes.values
        assert table.dtype == torch.float32 and table.numel() == size
        assert (table[1:] > table[:-1]).all()
        assert table[0] == low and table[-1] == 1.0 and (table == 0).sum() == 1 and table[codes.zero] == 0
    for codes in (SIGNED, LINEAR):  # symmetric
        assert codes.zero == 127 and torch.equal(codes.values[:127], -codes.values[128:].flip(0))
    # fp16 numbers with 3 mantissa bits: index k is the fp16 number with bits k << 7
    for codes in (SIGNED, UNSIGNED):
        magnitudes = (codes.values[codes.zero:] * codes.top).half()  # within an fp32 rounding of fp16 numbers
        assert torch.equal(magnitudes.view(torch.int16), torch.arange(len(magnitudes), dtype=torch.int16) << 7)
        magnitudes = magnitudes.float()
        # 1/8 between neighbours across fp16's normal range, so rounding errs by at most 1/16
        normal = magnitudes[magnitudes >= 2.0**-14]
        assert ((normal[1:] - normal[:-1]) / normal[:-1]).max() <= 1 / 8 + 1e-6
    # linear: k / 127, each the fp32 product k · (1/127), as the kernels decode it
    k = torch.arange(-127, 128, dtype=torch.float32)
    assert LINEAR.top == 127 and torch.equal(LINEAR.values, k * (1 / torch.tensor(127.0)))
    torch.testing.assert_close(LINEAR.values.double(), k.double() / 127, rtol=2**-24, atol=0)


def test_a_tie_goes_to_the_larger_magnitude():
    for codes in TABLES.values():
        for sign in (1, -1) if codes.signed else (1,):
            between = torch.arange(len(codes.midpoints))  # midpoint j lies between magnitudes j and j + 1
            near = codes.midpoints / codes.top
            for x in (torch.nextafter(near, torch.tensor(0.0)), near, torch.nextafter(near, torch.tensor(2.0))):
                t = x * codes.top  # what the quantizer compares with the midpoints
                magnitude = (quantize(torch.cat([torch.ones(1), sign * x]), codes)[0][1:].long() - codes.zero).abs()
                assert torch.equal(magnitude, torch.where(t >= codes.midpoints, between + 1, between))
            assert (near * codes.top == codes.midpoints).float().mean() > 0.5  # most are ties


def portable(function):
    """``function`` on the C kernel's portable path, as CPUs without AVX2 and F16C run it."""
    def call(*args):
        cpu_backend.use_f16c(False)
        try:
            return function(*args)
        finally:
            cpu_backend.use_f16c(True)
    return call


def kernel_functions(kernel):
    """The (quantize, dequantize) of the C kernel (with F16C where the CPU has it, or portable) or
    the Triton kernels (in Triton's interpreter without a GPU)."""
    if kernel.startswith("c"):
        if not cpu_backend.AVAILABLE:
            pytest.skip("the fused CPU kernel is not built")
        if kernel == "c-portable":
            return portable(cpu_backend.quantize), portable(cpu_backend.dequantize)
        return cpu_backend.quantize, cpu_backend.dequantize
    fused_triton = pytest.importorskip("fastoptim.kernels.fused_triton")
    return (lambda x, codes: fused_triton.quantize(x, codes.table),
            lambda indices, absmax, codes: fused_triton.dequantize(indices, absmax, codes.table))


@pytest.mark.parametrize("kernel", ["c", "c-portable", "triton"])
@settings(max_examples=100, deadline=None)
@given(st.lists(values, min_size=1, max_size=3 * BLOCK + 7), KINDS)
def test_the_kernels_quantizer_is_the_reference_bit_for_bit(kernel, elements, kind):
    kernel_quantize, kernel_dequantize = kernel_functions(kernel)
    codes = TABLES[kind]
    x = torch.tensor(elements, dtype=torch.float32)
    x = x.abs() if kind == "unsigned" else x
    indices, absmax = quantize(x, codes)
    kernel_indices, kernel_absmax = kernel_quantize(x, codes)
    assert torch.equal(kernel_indices, indices) and torch.equal(kernel_absmax, absmax)
    assert torch.equal(kernel_dequantize(indices, absmax, codes), dequantize(indices, absmax, codes))


def test_non_finite_elements_keep_codes_of_their_own_and_leave_their_blocks_finite_values_alone():
    """One inf or NaN costs its own element only: the block's absmax and codes are its finite
    elements', as if the bad element were 0, and the bad element decodes to itself (a signed
    state's ±inf to NaN: see fastoptim.states.blockwise8)."""
    x = torch.randn(3 * BLOCK + 5, generator=torch.Generator().manual_seed(1))
    bad = torch.tensor([3, BLOCK + 40, BLOCK + 41, 3 * BLOCK - 1, 3 * BLOCK + 2])
    signed_values = [float("nan"), float("inf"), -float("inf"), 1e30, -3.4e38]
    for kind, bad_values in (("signed", signed_values), ("linear", signed_values),
                             ("unsigned", [float("nan"), float("inf"), float("inf"), 1e30, float("nan")])):
        codes, y = TABLES[kind], x.abs() if kind == "unsigned" else x.clone()
        y[bad[:3]] = torch.tensor(bad_values[:3])  # three non-finite elements among finite ones
        y[2 * BLOCK:3 * BLOCK] = float("nan")  # a block with nothing finite
        y[3 * BLOCK:] = 0
        y[3 * BLOCK + 2] = float("inf")  # a block of zeros and an inf
        finite = y.isfinite()
        indices, absmax = quantize(y, codes)
        alone = quantize(torch.where(finite, y, 0), codes)
        assert torch.equal(absmax, alone[1]) and torch.equal(indices[finite], alone[0][finite])
        back = dequantize(indices, absmax, codes)
        expected = y if kind == "unsigned" else torch.where(finite, y, float("nan"))
        torch.testing.assert_close(back[~finite], expected[~finite], rtol=0, atol=0, equal_nan=True)
        assert back[finite].isfinite().all()
        assert absmax[2] == 0 and absmax[3] == 0  # nothing finite but zeros


non_finite = st.sampled_from([float("nan"), float("inf"), -float("inf")])


@pytest.mark.parametrize("kernel", ["c", "c-portable", "triton"])
@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(values, non_finite), min_size=1, max_size=2 * BLOCK + 7), KINDS)
def test_the_kernels_store_non_finite_elements_as_the_reference_does(kernel, elements, kind):
    kernel_quantize, kernel_dequantize = kernel_functions(kernel)
    codes = TABLES[kind]
    x = torch.tensor(elements, dtype=torch.float32)
    x = x.abs() if kind == "unsigned" else x
    indices, absmax = quantize(x, codes)
    kernel_indices, kernel_absmax = kernel_quantize(x, codes)
    assert torch.equal(kernel_indices, indices) and torch.equal(kernel_absmax, absmax)
    torch.testing.assert_close(kernel_dequantize(indices, absmax, codes), dequantize(indices, absmax, codes),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernel", ["c", "c-portable", "triton"])
def test_every_index_decodes_as_the_reference_decodes_it(kernel):
    """The 256 indices, codes and not, in blocks of absmax 0 and 3: a non-finite value ignores it."""
    _, kernel_dequantize = kernel_functions(kernel)
    every_index = torch.arange(256, dtype=torch.uint8).repeat(2)
    absmax = torch.tensor([0.0, 3.0])
    for codes in TABLES.values():
        expected = dequantize(every_index, absmax, codes)
        torch.testing.assert_close(kernel_dequantize(every_index, absmax, codes), expected, rtol=0, atol=0,
                                   equal_nan=True)
        assert expected[codes.inf_index].isnan() if codes.signed else expected[codes.inf_index] == float("inf")


@pytest.mark.parametrize("kernel", ["c", "c-portable", "triton"])
def test_the_kernels_codes_and_ties_are_the_reference_s(kernel):
    kernel_quantize, kernel_dequantize = kernel_functions(kernel)
    for codes in TABLES.values():
        every_code = torch.arange(len(codes.values), dtype=torch.uint8)
        assert torch.equal(kernel_dequantize(every_code, torch.ones(1), codes), codes.values)
        near = codes.midpoints / codes.top  # ties, and their neighbours, in blocks of absmax 1
        x = torch.cat([near, torch.nextafter(near, torch.tensor(0.0)), torch.nextafter(near, torch.tensor(2.0))])
        rows = torch.nn.functional.pad(x, (0, -len(x) % (BLOCK - 1))).view(-1, BLOCK - 1)
        x = torch.cat([torch.ones(len(rows), 1), rows], 1)
        for signed_x in (x.reshape(-1), -x.reshape(-1)) if codes.signed else (x.reshape(-1),):
            assert torch.equal(kernel_quantize(signed_x, codes)[0], quantize(signed_x, codes)[0])


@pytest.mark.parametrize("kernel", ["c", "c-portable", "triton"])
def test_the_scale_is_a_correctly_rounded_division_in_the_kernels_as_in_the_reference(kernel):
    """top / 1.2 rounds below 1.5625, a tie of the signed magnitudes; reciprocal · top, which torch
    computes for a number divided by a tensor, rounds onto it and once picked the other code."""
    kernel_quantize, _ = kernel_functions(kernel)
    x = torch.tensor([1.2, 1.0])
    assert torch.equal(quantize(x, SIGNED)[0], kernel_quantize(x, SIGNED)[0])
    assert quantize(x, SIGNED)[0][1] == SIGNED.zero + 124  # magnitude 1.5, index 251
