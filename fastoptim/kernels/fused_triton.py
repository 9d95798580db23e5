"""Fused GPU kernels in Triton: one launch updates every tensor of a bucket.

A launch reads two device tables, built once per bucket and cached (``fastoptim.multi_tensor``):
- ``pointers``: int64 data pointers, one row per role in ``fused_cpu.ROLES`` order (param, grad,
  the states), one column per tensor. A program loads the addresses it needs from it, so the
  launch takes three pointers whatever the number of tensors: no 4 KB argument limit, and no copy
  of addresses per step.
- ``work``: one row per program, ``WORK_COLUMNS`` int64s: a tensor, its chunk (first element and
  element count, as ``multi_tensor.chunk_plan`` cuts it), its subset-norm layout (b, c) and
  whether the chunk's streams are 16-byte aligned, which lets full tiles use 128-bit accesses.

Scalars come as an fp32 device tensor, one row of ``fused_cpu.SCALARS[kernel]`` per tensor (or one
shared row, ``scalar_stride`` 0): a tensor lr, the clip coefficient or GradScaler's found_inf are
read here, with no host sync.

The per-element math restates the C kernels' (``fused_cpu.c``), which restate the reference
``update`` functions in ``fastoptim/optimizers``; the tests hold all of them to the reference. The
layout of a chunk follows the C kernels too: dense, or subset-norm (a, b, c) with subsets of b
elements, rows (c = 1, subset k at elements [k·b, (k+1)·b)) or columns (a = 1, subset k at
elements k + r·c). A subset chunk first sums its subsets' squares, then updates its elements.
"""
import torch
import triton
import triton.language as tl

from ..states import blockwise8
SCALARS = {  # TEMPORARY, until the kernels read their specs
    "adan": ("found_inf", "seed", "grad_scale", "beta1", "beta2", "beta3", "one_minus_beta1", "one_minus_beta2",
             "one_minus_beta3", "eps", "pre_grad_weight", "bias_correction3_sqrt", "step_size", "diff_ratio",
             "decay_mul", "decay_div"),
    "adamw": ("found_inf", "seed", "grad_scale", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay_mul",
              "decay_after", "step_size", "bias_correction2_sqrt"),
}

WORK_COLUMNS = tl.constexpr(6)
TENSOR, START, COUNT, SUBSET_ROWS, SUBSET_COLUMNS, ALIGNED = (tl.constexpr(i) for i in range(6))
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, EXP_AVG_DIFF, NEG_PRE_GRAD = (tl.constexpr(i) for i in range(6))
MAX_EXP_AVG_SQ = EXP_AVG_DIFF  # AdamW's third state takes the row Adan's exp_avg_diff has

BLOCK = tl.constexpr(1024)  # elements per tile of a dense chunk
NUM_WARPS = 8  # 4 fp32 per thread and stream: one 128-bit access each (86 registers on sm_90, against 145 with 4 warps)
SUBSET_TILE, MEMBER_TILE = tl.constexpr(16), tl.constexpr(32)  # subsets × members: 512 elements, 2 per thread
N_ADAN, N_ADAMW = tl.constexpr(len(SCALARS["adan"])), tl.constexpr(len(SCALARS["adamw"]))
# The first row of the states' block maxima: after param, grad and the states (fused_cpu.ROLES)
ADAN_ABSMAX, ADAMW_ABSMAX = tl.constexpr(6), tl.constexpr(5)
BLOCK8 = tl.constexpr(blockwise8.BLOCK)
# The largest magnitude of each code table (blockwise8.SIGNED.top, UNSIGNED.top): codes are magnitudes / top
SIGNED_TOP, UNSIGNED_TOP = tl.constexpr(blockwise8.SIGNED.top), tl.constexpr(blockwise8.UNSIGNED.top)
# The indices of non-finite values, which decode to themselves (see blockwise8's docstring)
NAN_INDEX, UNSIGNED_INF_INDEX = tl.constexpr(blockwise8.NAN_INDEX), tl.constexpr(blockwise8.UNSIGNED.inf_index)
INF_BITS = tl.constexpr(0x7F800000)  # +inf's bits: |x|'s bits are at least these where x is not finite
FLOAT32_MAX = tl.constexpr(torch.finfo(torch.float32).max)


def _scalar_indices(kernel, *names):
    """Where each named scalar sits in a row of ``kernel``'s scalars (a ValueError if it does not)."""
    return [tl.constexpr(SCALARS[kernel].index(name)) for name in names]


(ADAN_FOUND_INF, ADAN_SEED, ADAN_GRAD_SCALE, ADAN_BETA1, ADAN_BETA2, ADAN_BETA3, ADAN_ONE_MINUS_BETA1,
 ADAN_ONE_MINUS_BETA2, ADAN_ONE_MINUS_BETA3, ADAN_EPS, ADAN_PRE_GRAD_WEIGHT, ADAN_BIAS_CORRECTION3_SQRT,
 ADAN_STEP_SIZE, ADAN_DIFF_RATIO, ADAN_DECAY_MUL, ADAN_DECAY_DIV) = _scalar_indices(
    "adan", "found_inf", "seed", "grad_scale", "beta1", "beta2", "beta3", "one_minus_beta1", "one_minus_beta2",
    "one_minus_beta3", "eps", "pre_grad_weight", "bias_correction3_sqrt", "step_size", "diff_ratio", "decay_mul",
    "decay_div")
(ADAMW_FOUND_INF, ADAMW_SEED, ADAMW_GRAD_SCALE, ADAMW_ONE_MINUS_BETA1, ADAMW_BETA2, ADAMW_ONE_MINUS_BETA2,
 ADAMW_EPS, ADAMW_DECAY_MUL, ADAMW_DECAY_AFTER, ADAMW_STEP_SIZE, ADAMW_BIAS_CORRECTION2_SQRT) = _scalar_indices(
    "adamw", "found_inf", "seed", "grad_scale", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay_mul",
    "decay_after", "step_size", "bias_correction2_sqrt")


# --- loads and stores -------------------------------------------------------------------------

@triton.jit
def _pointer(pointers, n_tensors, role, t, dtype: tl.constexpr):
    return tl.load(pointers + role * n_tensors + t).to(tl.pointer_type(dtype))


@triton.jit
def _load(pointer, index, mask):
    return tl.load(pointer + index, mask=mask).to(tl.float32)


@triton.jit
def _round_bf16(value, add):
    """``value`` rounded to bf16 by adding ``add`` to its low 16 bits and dropping them (NaN kept)."""
    rounded = ((value.to(tl.uint32, bitcast=True) + add) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(value != value, value, rounded)


@triton.jit
def _store(pointer, index, value, mask):
    """fp32 into the pointer's dtype, to nearest even (by hand for bf16: Triton's interpreter truncates)."""
    if pointer.dtype.element_ty == tl.bfloat16:
        value = _round_bf16(value, 0x7FFF + ((value.to(tl.uint32, bitcast=True) >> 16) & 1))
    tl.store(pointer + index, value.to(pointer.dtype.element_ty), mask=mask)


@triton.jit
def _random_bits(seed, t, index):
    """The C kernels' counter-based hash (murmur3's finaliser) of (seed, tensor, element)."""
    h = seed ^ (t.to(tl.uint32) * 0x9E3779B9) ^ (index.to(tl.uint32) * 0x85EBCA6B)
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _store_param(pointer, index, value, mask, seed, t, STOCHASTIC: tl.constexpr):
    """The param's fp32 result into its dtype: to nearest even, or for bf16 with STOCHASTIC, up with
    probability equal to the dropped fraction, with the C kernels' random bits."""
    if STOCHASTIC and pointer.dtype.element_ty == tl.bfloat16:
        value = _round_bf16(value, _random_bits(seed, t, index) >> 16)  # exact in bf16: _store keeps it
    _store(pointer, index, value, mask)


@triton.jit
def _subset_tile(subsets, last, j, b, c):
    """Index and mask of members [j, j + MEMBER_TILE) of each of ``subsets`` (those below ``last``):
    b consecutive elements per subset (rows, c = 1), or one per row of c (columns)."""
    members = j + tl.arange(0, MEMBER_TILE)
    index = subsets[:, None] * tl.where(c == 1, b, 1) + members[None, :] * c
    return index, (subsets < last)[:, None] & (members < b)[None, :]


# --- 8-bit blockwise states (fastoptim/states/blockwise8.py, as fused_cpu.c restates it) ----------
# A block of BLOCK8 elements is one tile: its codes are dequantized, updated and requantized in
# registers with its new absmax. Magnitude k of a code is the fp16 number with bits k << 7 (SIGNED:
# up to 127, centred on index 127; UNSIGNED: up to 247), and quantizing finds the magnitude nearest
# to t = |x|·top/absmax, a tie going up, as the C kernel's portable path does. (Triton's interpreter
# converts fp32 below fp16's range to fp16 wrongly, so the rounding is done on fp32 bits.) Non-finite
# values keep indices of their own, which decode to themselves: UNSIGNED's past its codes are fp16's
# +inf and NaNs already.

@triton.jit
def _dequantize(codes, absmax, SIGNED: tl.constexpr):
    k = codes.to(tl.int32) - 127 if SIGNED else codes.to(tl.int32)
    magnitude = (tl.abs(k) * 128).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if SIGNED:
        magnitude = tl.where(codes == NAN_INDEX, INF_BITS + 1, magnitude.to(tl.int32, bitcast=True)).to(
            tl.float32, bitcast=True)
    code = magnitude * (1 / SIGNED_TOP if SIGNED else 1 / UNSIGNED_TOP)
    value = tl.where(k < 0, -code, code) * absmax
    return tl.where(tl.abs(magnitude) < float("inf"), value, magnitude)


@triton.jit
def _quantize(t, SIGNED: tl.constexpr):
    """The codes of t = x·top/absmax, from |t|'s fp32 bits: rounding away the 20 bits below fp16's 3
    mantissa bits and rebasing the exponent; below fp16's normal range, rounding |t|·2^17 whole."""
    magnitude = tl.abs(t)
    normal = ((magnitude.to(tl.int32, bitcast=True) + (1 << 19)) >> 20) - ((127 - 15) << 3)
    steps = tl.minimum(magnitude, 2.0**-14) * 2.0**17
    whole = tl.floor(steps)
    subnormal = whole.to(tl.int32) + (steps - whole >= 0.5).to(tl.int32)
    k = tl.minimum(tl.where(magnitude < 2.0**-14, subnormal, normal), 127 if SIGNED else 247)
    return (tl.where(t < 0, 127 - k, 127 + k) if SIGNED else k).to(tl.uint8)


@triton.jit
def _load_q8(codes, absmax, block, index, mask, SIGNED: tl.constexpr):
    return _dequantize(tl.load(codes + index, mask=mask), tl.load(absmax + block), SIGNED)


@triton.jit
def _store_q8(codes, absmax, block, index, mask, values, SIGNED: tl.constexpr):
    # the largest |x| of the finite elements, from their bits as integers
    magnitude_bits = values.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    finite = magnitude_bits < INF_BITS
    top = tl.max(tl.where(mask & finite, magnitude_bits, 0), axis=0).to(tl.float32, bitcast=True)
    scale = tl.div_rn(SIGNED_TOP if SIGNED else UNSIGNED_TOP, tl.where(top > 0, top, 1.0))
    stored = (top > 0) & (scale <= FLOAT32_MAX)  # else the block is stored as zeros
    indices = _quantize(tl.where(finite, values, 0.0) * tl.where(stored, scale, 0.0), SIGNED)
    if SIGNED:
        indices = tl.where(finite, indices, NAN_INDEX)
    else:
        indices = tl.where(finite, indices, tl.where(values == float("inf"), UNSIGNED_INF_INDEX, NAN_INDEX))
    tl.store(codes + index, indices, mask=mask)
    tl.store(absmax + block, tl.where(stored, top, 0.0))


@triton.jit
def _blocks_kernel(values, codes, absmax, n, SIGNED: tl.constexpr, QUANTIZE: tl.constexpr):
    """The quantizer (QUANTIZE) or the dequantizer alone, one block per program, for the tests."""
    block = tl.program_id(0)
    index = block * BLOCK8 + tl.arange(0, BLOCK8)
    if QUANTIZE:
        _store_q8(codes, absmax, block, index, index < n, tl.load(values + index, mask=index < n), SIGNED)
    else:
        tl.store(values + index, _load_q8(codes, absmax, block, index, index < n, SIGNED), mask=index < n)


@triton.jit
def _subset_of(index, b, c):
    """The subset-norm entry of element ``index``: its row (c = 1) or its column."""
    return tl.where(c == 1, index // b, index % c)


# --- the math both families share, with scalars named by their index in a row -----------------

@triton.jit
def _moving_average(old, new, S, BETA: tl.constexpr, ONE_MINUS_BETA: tl.constexpr):
    return old * tl.load(S + BETA) + new * tl.load(S + ONE_MINUS_BETA)


@triton.jit
def _moving_average_of_squares(old, x, S, BETA: tl.constexpr, ONE_MINUS_BETA: tl.constexpr):
    """β·old + (1−β)·x·x in torch's addcmul order, as the C kernel: (1−β)·x first, so that a large x
    overflows no sooner than the loop engine's."""
    return old * tl.load(S + BETA) + tl.load(S + ONE_MINUS_BETA) * x * x


@triton.jit
def _step_scale(second_moment, S, STEP_SIZE: tl.constexpr, BIAS_CORRECTION_SQRT: tl.constexpr, EPS: tl.constexpr):
    """step_size / (√second_moment / bias_correction_sqrt + eps): a reciprocal per tile, as the C
    kernels take one per tensor, and one IEEE division per element."""
    inverse = 1 / tl.load(S + BIAS_CORRECTION_SQRT)
    return tl.div_rn(tl.load(S + STEP_SIZE), tl.sqrt_rn(second_moment) * inverse + tl.load(S + EPS))


# --- Adan: the math on values, then its walks over memory ------------------------------------

@triton.jit
def _adan_terms(grad, neg_pre_grad, S):
    neg_g = grad * -tl.load(S + ADAN_GRAD_SCALE)
    d = (neg_pre_grad - neg_g) * tl.load(S + ADAN_PRE_GRAD_WEIGHT)  # g − g_prev (0 at a first step)
    return neg_g, d, d * tl.load(S + ADAN_BETA2) - neg_g  # u = g + β2·d


@triton.jit
def _adan_second_moment(n, u_squared, S):
    return _moving_average(n, u_squared, S, ADAN_BETA3, ADAN_ONE_MINUS_BETA3)


@triton.jit
def _adan_scale(n, S):
    """step_size / denom, from exp_avg_sq (the element's or its subset's)."""
    return _step_scale(n, S, ADAN_STEP_SIZE, ADAN_BIAS_CORRECTION3_SQRT, ADAN_EPS)


@triton.jit
def _adan_apply(p, m, v, neg_g, d, scale, S):
    """After exp_avg_sq: the new moments m, v and param p."""
    m = m * tl.load(S + ADAN_BETA1) - neg_g * tl.load(S + ADAN_ONE_MINUS_BETA1)
    v = v * tl.load(S + ADAN_BETA2) + d * tl.load(S + ADAN_ONE_MINUS_BETA2)
    p = p * tl.load(S + ADAN_DECAY_MUL) - m * scale - v * (scale * tl.load(S + ADAN_DIFF_RATIO))  # no_prox: 1 − lr·wd
    return m, v, p * (1 / tl.load(S + ADAN_DECAY_DIV))  # prox: 1 + lr·wd


@triton.jit
def _adan_dense_tile(param, grad, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad, index, mask, S, seed, t,
                     STOCHASTIC: tl.constexpr):
    neg_g, d, u = _adan_terms(_load(grad, index, mask), _load(neg_pre_grad, index, mask), S)
    n = _moving_average_of_squares(_load(exp_avg_sq, index, mask), u, S, ADAN_BETA3, ADAN_ONE_MINUS_BETA3)
    m, v, p = _adan_apply(_load(param, index, mask), _load(exp_avg, index, mask), _load(exp_avg_diff, index, mask),
                          neg_g, d, _adan_scale(n, S), S)
    _store(exp_avg_sq, index, n, mask)
    _store(exp_avg, index, m, mask)
    _store(exp_avg_diff, index, v, mask)
    _store(neg_pre_grad, index, neg_g, mask)
    _store_param(param, index, p, mask, seed, t, STOCHASTIC)


@triton.jit
def _adan_q8_block(param, grad, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad, absmax_m, absmax_n, absmax_v, first,
                   end, reduced, b, c, S, seed, t, STOCHASTIC: tl.constexpr):
    """One block [first, first + BLOCK8) ∩ [.., end) with 8-bit moments. Its second moment is the
    subset-norm ``reduced`` (updated already) when the tensor has subsets (b > 1), else the 8-bit
    ``exp_avg_sq``."""
    index = first + tl.arange(0, BLOCK8)
    mask, block = index < end, first // BLOCK8
    neg_g, d, u = _adan_terms(_load(grad, index, mask), _load(neg_pre_grad, index, mask), S)
    if b != 1:
        scale = _adan_scale(tl.load(reduced + _subset_of(index, b, c), mask=mask, other=0.0), S)
    else:
        n = _moving_average_of_squares(_load_q8(exp_avg_sq, absmax_n, block, index, mask, False), u, S, ADAN_BETA3,
                                       ADAN_ONE_MINUS_BETA3)
        _store_q8(exp_avg_sq, absmax_n, block, index, mask, n, False)
        scale = _adan_scale(n, S)
    m, v, p = _adan_apply(_load(param, index, mask), _load_q8(exp_avg, absmax_m, block, index, mask, True),
                          _load_q8(exp_avg_diff, absmax_v, block, index, mask, True), neg_g, d, scale, S)
    _store_q8(exp_avg, absmax_m, block, index, mask, m, True)
    _store_q8(exp_avg_diff, absmax_v, block, index, mask, v, True)
    _store(neg_pre_grad, index, neg_g, mask)
    _store_param(param, index, p, mask, seed, t, STOCHASTIC)


@triton.jit
def _adan_subset_sums(grad, neg_pre_grad, reduced, start, count, b, c, S):
    """The second moments of subsets [start/b, (start + count)/b), from their sums of squares."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        sums = tl.zeros((SUBSET_TILE,), tl.float32)
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            neg_g, d, u = _adan_terms(_load(grad, index, mask), _load(neg_pre_grad, index, mask), S)
            sums += tl.sum(tl.where(mask, u * u, 0.0), axis=1)
        _store(reduced, subsets, _adan_second_moment(_load(reduced, subsets, subsets < last), sums, S), subsets < last)


@triton.jit
def _adan_subset_updates(param, grad, exp_avg, reduced, exp_avg_diff, neg_pre_grad, start, count, b, c, S, seed, t,
                         STOCHASTIC: tl.constexpr):
    """After ``_adan_subset_sums``: the elements of the chunk's subsets."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        scale = _adan_scale(_load(reduced, subsets, subsets < last), S)[:, None]
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            neg_g, d, u = _adan_terms(_load(grad, index, mask), _load(neg_pre_grad, index, mask), S)
            m, v, p = _adan_apply(_load(param, index, mask), _load(exp_avg, index, mask),
                                  _load(exp_avg_diff, index, mask), neg_g, d, scale, S)
            _store(exp_avg, index, m, mask)
            _store(exp_avg_diff, index, v, mask)
            _store(neg_pre_grad, index, neg_g, mask)
            _store_param(param, index, p, mask, seed, t, STOCHASTIC)


@triton.jit
def adan_kernel(pointers, n_tensors, work, scalars, scalar_stride, PARAM_TYPE: tl.constexpr,
                STATE_TYPE: tl.constexpr, STOCHASTIC: tl.constexpr, SUBSETS: tl.constexpr):
    """One chunk of Adan (``fastoptim.optimizers.adan.adan_update``) per program. SUBSETS: the
    bucket holds subset-norm tensors (compiles their path). STATE_TYPE uint8: 8-bit moments, with
    g_prev in bf16."""
    row = work + tl.program_id(0) * WORK_COLUMNS
    t, start, count = tl.load(row + TENSOR), tl.load(row + START), tl.load(row + COUNT)
    b, c = tl.load(row + SUBSET_ROWS), tl.load(row + SUBSET_COLUMNS)
    S = scalars + t * scalar_stride * N_ADAN
    if tl.load(S + ADAN_FOUND_INF) == 0:  # else GradScaler found an inf: skip the step
        seed = tl.load(S + ADAN_SEED).to(tl.uint32)
        param = _pointer(pointers, n_tensors, PARAM, t, PARAM_TYPE)
        grad = _pointer(pointers, n_tensors, GRAD, t, PARAM_TYPE)
        exp_avg = _pointer(pointers, n_tensors, EXP_AVG, t, STATE_TYPE)
        exp_avg_sq = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, STATE_TYPE)
        exp_avg_diff = _pointer(pointers, n_tensors, EXP_AVG_DIFF, t, STATE_TYPE)
        reduced = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, tl.float32)  # one fp32 per subset under sn
        if STATE_TYPE == tl.uint8:
            neg_pre_grad = _pointer(pointers, n_tensors, NEG_PRE_GRAD, t, tl.bfloat16)
            absmax_m = _pointer(pointers, n_tensors, ADAN_ABSMAX + 0, t, tl.float32)
            absmax_n = _pointer(pointers, n_tensors, ADAN_ABSMAX + 1, t, tl.float32)
            absmax_v = _pointer(pointers, n_tensors, ADAN_ABSMAX + 2, t, tl.float32)
            if SUBSETS:
                if b != 1:
                    _adan_subset_sums(grad, neg_pre_grad, reduced, start, count, b, c, S)
            for first in range(start, start + count, BLOCK8):  # the chunk plan cuts 8-bit chunks at blocks
                _adan_q8_block(param, grad, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad, absmax_m, absmax_n,
                               absmax_v, first, start + count, reduced, b, c, S, seed, t, STOCHASTIC)
        else:
            neg_pre_grad = _pointer(pointers, n_tensors, NEG_PRE_GRAD, t, STATE_TYPE)
            if SUBSETS:
                if b != 1:
                    _adan_subset_sums(grad, neg_pre_grad, reduced, start, count, b, c, S)
                    _adan_subset_updates(param, grad, exp_avg, reduced, exp_avg_diff, neg_pre_grad, start, count, b,
                                         c, S, seed, t, STOCHASTIC)
            # A dense chunk: full tiles of 16-byte aligned streams with no mask (128-bit accesses; the
            # hints must be given here, where the pointers are loaded), then the rest with a mask.
            dense = tl.where(b == 1, count, 0)
            full = tl.where(tl.load(row + ALIGNED) != 0, dense // BLOCK * BLOCK, 0)
            for offset in range(0, full, BLOCK):
                index = tl.multiple_of(start + offset, BLOCK) + tl.arange(0, BLOCK)
                _adan_dense_tile(tl.multiple_of(param, 16), tl.multiple_of(grad, 16), tl.multiple_of(exp_avg, 16),
                                 tl.multiple_of(exp_avg_sq, 16), tl.multiple_of(exp_avg_diff, 16),
                                 tl.multiple_of(neg_pre_grad, 16), index, None, S, seed, t, STOCHASTIC)
            for offset in range(full, dense, BLOCK):
                index = start + offset + tl.arange(0, BLOCK)
                _adan_dense_tile(param, grad, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad, index,
                                 index < start + dense, S, seed, t, STOCHASTIC)


# --- AdamW, AdamWSN and RMSPropSN --------------------------------------------------------------

@triton.jit
def _adamw_grad(grad, index, mask, S):
    return _load(grad, index, mask) * tl.load(S + ADAMW_GRAD_SCALE)


@triton.jit
def _adamw_second_moment(v, g_squared, S):
    return _moving_average(v, g_squared, S, ADAMW_BETA2, ADAMW_ONE_MINUS_BETA2)


@triton.jit
def _adamw_scale(v, S):
    """step_size / denom, from the second moment (the element's or its subset's; v̂ with amsgrad)."""
    return _step_scale(v, S, ADAMW_STEP_SIZE, ADAMW_BIAS_CORRECTION2_SQRT, ADAMW_EPS)


@triton.jit
def _adamw_first_moment(m, g, S):
    return m + (g - m) * tl.load(S + ADAMW_ONE_MINUS_BETA1)  # lerp


@triton.jit
def _adamw_param(p, numerator, scale, S):
    """Weight decay multiplies before the update (AdamW) or after it (AdamWSN)."""
    return (p * tl.load(S + ADAMW_DECAY_MUL) - numerator * scale) * tl.load(S + ADAMW_DECAY_AFTER)


@triton.jit
def _adamw_dense_tile(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, index, mask, S, seed, t,
                      AMSGRAD: tl.constexpr, FIRST_MOMENT: tl.constexpr, STOCHASTIC: tl.constexpr):
    g = _adamw_grad(grad, index, mask, S)
    v = _moving_average_of_squares(_load(exp_avg_sq, index, mask), g, S, ADAMW_BETA2, ADAMW_ONE_MINUS_BETA2)
    _store(exp_avg_sq, index, v, mask)
    if AMSGRAD:
        v = tl.maximum(_load(max_exp_avg_sq, index, mask), v)
        _store(max_exp_avg_sq, index, v, mask)
    numerator = g
    if FIRST_MOMENT:
        numerator = _adamw_first_moment(_load(exp_avg, index, mask), g, S)
        _store(exp_avg, index, numerator, mask)
    _store_param(param, index, _adamw_param(_load(param, index, mask), numerator, _adamw_scale(v, S), S), mask, seed,
                 t, STOCHASTIC)


@triton.jit
def _adamw_q8_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, absmax_m, absmax_v, absmax_v_max, first, end,
                    reduced_max, b, c, S, seed, t, AMSGRAD: tl.constexpr, FIRST_MOMENT: tl.constexpr,
                    STOCHASTIC: tl.constexpr):
    """As ``_adan_q8_block``; with subsets it reads the (updated) subset-norm ``reduced_max``."""
    index = first + tl.arange(0, BLOCK8)
    mask, block = index < end, first // BLOCK8
    g = _adamw_grad(grad, index, mask, S)
    if b != 1:
        v = tl.load(reduced_max + _subset_of(index, b, c), mask=mask, other=0.0)
    else:
        v = _moving_average_of_squares(_load_q8(exp_avg_sq, absmax_v, block, index, mask, False), g, S, ADAMW_BETA2,
                                       ADAMW_ONE_MINUS_BETA2)
        _store_q8(exp_avg_sq, absmax_v, block, index, mask, v, False)
        if AMSGRAD:
            v = tl.maximum(_load_q8(max_exp_avg_sq, absmax_v_max, block, index, mask, False), v)
            _store_q8(max_exp_avg_sq, absmax_v_max, block, index, mask, v, False)
    numerator = g
    if FIRST_MOMENT:
        numerator = _adamw_first_moment(_load_q8(exp_avg, absmax_m, block, index, mask, True), g, S)
        _store_q8(exp_avg, absmax_m, block, index, mask, numerator, True)
    _store_param(param, index, _adamw_param(_load(param, index, mask), numerator, _adamw_scale(v, S), S), mask, seed,
                 t, STOCHASTIC)


@triton.jit
def _adamw_subset_sums(grad, reduced, reduced_max, start, count, b, c, S, AMSGRAD: tl.constexpr):
    """As ``_adan_subset_sums``, with amsgrad's maximum."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        sums = tl.zeros((SUBSET_TILE,), tl.float32)
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            g = _adamw_grad(grad, index, mask, S)
            sums += tl.sum(tl.where(mask, g * g, 0.0), axis=1)
        v = _adamw_second_moment(_load(reduced, subsets, subsets < last), sums, S)
        _store(reduced, subsets, v, subsets < last)
        if AMSGRAD:
            _store(reduced_max, subsets, tl.maximum(_load(reduced_max, subsets, subsets < last), v), subsets < last)


@triton.jit
def _adamw_subset_updates(param, grad, exp_avg, reduced_max, start, count, b, c, S, seed, t,
                          FIRST_MOMENT: tl.constexpr, STOCHASTIC: tl.constexpr):
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        scale = _adamw_scale(_load(reduced_max, subsets, subsets < last), S)[:, None]
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            g = _adamw_grad(grad, index, mask, S)
            numerator = g
            if FIRST_MOMENT:
                numerator = _adamw_first_moment(_load(exp_avg, index, mask), g, S)
                _store(exp_avg, index, numerator, mask)
            _store_param(param, index, _adamw_param(_load(param, index, mask), numerator, scale, S), mask, seed, t,
                         STOCHASTIC)


@triton.jit
def adamw_kernel(pointers, n_tensors, work, scalars, scalar_stride, PARAM_TYPE: tl.constexpr,
                 STATE_TYPE: tl.constexpr, STOCHASTIC: tl.constexpr, SUBSETS: tl.constexpr,
                 AMSGRAD: tl.constexpr, FIRST_MOMENT: tl.constexpr):
    """One chunk of AdamW (``adamw_update``), AdamWSN or RMSPropSN (``adamw_sn_update``: FIRST_MOMENT
    false for RMSPropSN) per program, as ``adan_kernel``."""
    row = work + tl.program_id(0) * WORK_COLUMNS
    t, start, count = tl.load(row + TENSOR), tl.load(row + START), tl.load(row + COUNT)
    b, c = tl.load(row + SUBSET_ROWS), tl.load(row + SUBSET_COLUMNS)
    S = scalars + t * scalar_stride * N_ADAMW
    if tl.load(S + ADAMW_FOUND_INF) == 0:
        seed = tl.load(S + ADAMW_SEED).to(tl.uint32)
        param = _pointer(pointers, n_tensors, PARAM, t, PARAM_TYPE)
        grad = _pointer(pointers, n_tensors, GRAD, t, PARAM_TYPE)
        exp_avg = _pointer(pointers, n_tensors, EXP_AVG, t, STATE_TYPE)
        exp_avg_sq = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, STATE_TYPE)
        max_exp_avg_sq = _pointer(pointers, n_tensors, MAX_EXP_AVG_SQ, t, STATE_TYPE)
        reduced = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, tl.float32)
        reduced_max = _pointer(pointers, n_tensors, MAX_EXP_AVG_SQ if AMSGRAD else EXP_AVG_SQ, t, tl.float32)
        if SUBSETS:
            if b != 1:
                _adamw_subset_sums(grad, reduced, reduced_max, start, count, b, c, S, AMSGRAD)
        if STATE_TYPE == tl.uint8:
            absmax_m = _pointer(pointers, n_tensors, ADAMW_ABSMAX + 0, t, tl.float32)
            absmax_v = _pointer(pointers, n_tensors, ADAMW_ABSMAX + 1, t, tl.float32)
            absmax_v_max = _pointer(pointers, n_tensors, ADAMW_ABSMAX + 2, t, tl.float32)
            for first in range(start, start + count, BLOCK8):
                _adamw_q8_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, absmax_m, absmax_v, absmax_v_max,
                                first, start + count, reduced_max, b, c, S, seed, t, AMSGRAD, FIRST_MOMENT,
                                STOCHASTIC)
        else:
            if SUBSETS:
                if b != 1:
                    _adamw_subset_updates(param, grad, exp_avg, reduced_max, start, count, b, c, S, seed, t,
                                          FIRST_MOMENT, STOCHASTIC)
            dense = tl.where(b == 1, count, 0)  # as adan_kernel's
            full = tl.where(tl.load(row + ALIGNED) != 0, dense // BLOCK * BLOCK, 0)
            for offset in range(0, full, BLOCK):
                index = tl.multiple_of(start + offset, BLOCK) + tl.arange(0, BLOCK)
                _adamw_dense_tile(tl.multiple_of(param, 16), tl.multiple_of(grad, 16), tl.multiple_of(exp_avg, 16),
                                  tl.multiple_of(exp_avg_sq, 16), tl.multiple_of(max_exp_avg_sq, 16), index, None, S,
                                  seed, t, AMSGRAD, FIRST_MOMENT, STOCHASTIC)
            for offset in range(full, dense, BLOCK):
                index = start + offset + tl.arange(0, BLOCK)
                _adamw_dense_tile(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, index, index < start + dense, S,
                                  seed, t, AMSGRAD, FIRST_MOMENT, STOCHASTIC)


TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.uint8: tl.uint8}
KERNELS = {"adan": adan_kernel, "adamw": adamw_kernel}


def _options(kernel, param_dtype, state_dtype, stochastic, subsets, amsgrad, first_moment):
    """The compile-time arguments of a kernel variant."""
    options = dict(PARAM_TYPE=TYPES[param_dtype], STATE_TYPE=TYPES[state_dtype], STOCHASTIC=stochastic,
                   SUBSETS=subsets)
    return options | (dict(AMSGRAD=amsgrad, FIRST_MOMENT=first_moment) if kernel == "adamw" else {})


def launch(spec, pointers, n_tensors, work, scalars, param_dtype, state_dtype, *, stochastic=False, subsets=False,
           flags):
    kernel, amsgrad, first_moment = spec.name, flags.get("amsgrad", False), flags.get("first_moment", True)
    """Run ``kernel`` ('adan' or 'adamw') with one program per row of ``work`` (device tensors, see
    the module docstring); ``scalars`` holds one row per tensor, or one shared row."""
    options = _options(kernel, param_dtype, state_dtype, stochastic, subsets, amsgrad, first_moment)
    KERNELS[kernel][(len(work),)](pointers, n_tensors, work, scalars, int(scalars.shape[0] > 1), **options,
                                  num_warps=NUM_WARPS)


def compile_for(capability, kernel, param_dtype, state_dtype, *, stochastic=False, subsets=False, amsgrad=False,
                first_moment=True):
    """Compile a kernel variant ahead of time for a CUDA GPU of compute ``capability`` (80: A100,
    90: H100), with no GPU present: its ``asm`` holds the PTX and the cubin."""
    from triton.backends.compiler import GPUTarget

    options = _options(kernel, param_dtype, state_dtype, stochastic, subsets, amsgrad, first_moment)
    signature = dict(pointers="*i64", n_tensors="i32", work="*i64", scalars="*fp32", scalar_stride="i32")
    source = triton.compiler.ASTSource(fn=KERNELS[kernel], signature=signature | dict.fromkeys(options, "constexpr"),
                                       constexprs=options)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=NUM_WARPS))


def quantize(values, signed):
    """The kernels' quantizer on a contiguous fp32 tensor: (uint8 codes, absmax), as
    ``blockwise8.quantize`` computes them."""
    codes = torch.empty(values.shape, dtype=torch.uint8, device=values.device)
    absmax = torch.empty(blockwise8.n_blocks(values.numel()), device=values.device)
    _blocks_kernel[(len(absmax),)](values, codes, absmax, values.numel(), SIGNED=signed, QUANTIZE=True)
    return codes, absmax


def dequantize(codes, absmax, signed):
    """The kernels' dequantizer, as ``blockwise8.dequantize`` computes it."""
    values = torch.empty(codes.shape, device=codes.device)
    _blocks_kernel[(len(absmax),)](values, codes, absmax, codes.numel(), SIGNED=signed, QUANTIZE=False)
    return values
