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

from .fused_cpu import SCALARS

WORK_COLUMNS = tl.constexpr(6)
TENSOR, START, COUNT, SUBSET_ROWS, SUBSET_COLUMNS, ALIGNED = (tl.constexpr(i) for i in range(6))
PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, EXP_AVG_DIFF, NEG_PRE_GRAD = (tl.constexpr(i) for i in range(6))
MAX_EXP_AVG_SQ = EXP_AVG_DIFF  # AdamW's third state takes the row Adan's exp_avg_diff has

BLOCK = tl.constexpr(1024)  # elements per tile of a dense chunk
NUM_WARPS = 8  # 4 fp32 per thread and stream: one 128-bit access each (86 registers on sm_90, against 145 with 4 warps)
SUBSET_TILE, MEMBER_TILE = tl.constexpr(16), tl.constexpr(32)  # subsets × members: 512 elements, 2 per thread
N_ADAN, N_ADAMW = tl.constexpr(len(SCALARS["adan"])), tl.constexpr(len(SCALARS["adamw"]))


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


# --- Adan -------------------------------------------------------------------------------------

@triton.jit
def _adan_terms(grad, neg_pre_grad, index, mask, S):
    neg_g = _load(grad, index, mask) * -tl.load(S + ADAN_GRAD_SCALE)
    d = (_load(neg_pre_grad, index, mask) - neg_g) * tl.load(S + ADAN_PRE_GRAD_WEIGHT)  # g − g_prev
    return neg_g, d, d * tl.load(S + ADAN_BETA2) - neg_g  # u = g + β2·d


@triton.jit
def _adan_scale(n, S):
    """step_size / denom, from exp_avg_sq (the element's or its subset's)."""
    inv_bias_correction3_sqrt = 1 / tl.load(S + ADAN_BIAS_CORRECTION3_SQRT)
    return tl.div_rn(tl.load(S + ADAN_STEP_SIZE), tl.sqrt_rn(n) * inv_bias_correction3_sqrt + tl.load(S + ADAN_EPS))


@triton.jit
def _adan_apply(param, exp_avg, exp_avg_diff, neg_pre_grad, index, mask, neg_g, d, scale, S, seed, t,
                STOCHASTIC: tl.constexpr):
    """After exp_avg_sq: the moments, g_prev and the param."""
    m = _load(exp_avg, index, mask) * tl.load(S + ADAN_BETA1) - neg_g * tl.load(S + ADAN_ONE_MINUS_BETA1)
    v = _load(exp_avg_diff, index, mask) * tl.load(S + ADAN_BETA2) + d * tl.load(S + ADAN_ONE_MINUS_BETA2)
    p = (_load(param, index, mask) * tl.load(S + ADAN_DECAY_MUL) - m * scale
         - v * (scale * tl.load(S + ADAN_DIFF_RATIO)))
    p = p * (1 / tl.load(S + ADAN_DECAY_DIV))
    _store(exp_avg, index, m, mask)
    _store(exp_avg_diff, index, v, mask)
    _store(neg_pre_grad, index, neg_g, mask)
    _store_param(param, index, p, mask, seed, t, STOCHASTIC)


@triton.jit
def _adan_dense_tile(param, grad, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad, index, mask, S, seed, t,
                     STOCHASTIC: tl.constexpr):
    neg_g, d, u = _adan_terms(grad, neg_pre_grad, index, mask, S)
    n = _load(exp_avg_sq, index, mask) * tl.load(S + ADAN_BETA3) + u * u * tl.load(S + ADAN_ONE_MINUS_BETA3)
    _store(exp_avg_sq, index, n, mask)
    _adan_apply(param, exp_avg, exp_avg_diff, neg_pre_grad, index, mask, neg_g, d, _adan_scale(n, S), S, seed, t,
                STOCHASTIC)


@triton.jit
def _adan_subset_chunk(param, grad, exp_avg, reduced, exp_avg_diff, neg_pre_grad, start, count, b, c, S, seed, t,
                       STOCHASTIC: tl.constexpr):
    """Subsets [start/b, (start + count)/b): their sums of squares into ``reduced``, then their elements."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        sums = tl.zeros((SUBSET_TILE,), tl.float32)
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            neg_g, d, u = _adan_terms(grad, neg_pre_grad, index, mask, S)
            sums += tl.sum(tl.where(mask, u * u, 0.0), axis=1)
        n = _load(reduced, subsets, subsets < last) * tl.load(S + ADAN_BETA3) + sums * tl.load(S + ADAN_ONE_MINUS_BETA3)
        _store(reduced, subsets, n, subsets < last)
        scale = _adan_scale(n, S)[:, None]
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            neg_g, d, u = _adan_terms(grad, neg_pre_grad, index, mask, S)
            _adan_apply(param, exp_avg, exp_avg_diff, neg_pre_grad, index, mask, neg_g, d, scale, S, seed, t,
                        STOCHASTIC)


@triton.jit
def adan_kernel(pointers, n_tensors, work, scalars, scalar_stride, PARAM_TYPE: tl.constexpr,
                STATE_TYPE: tl.constexpr, STOCHASTIC: tl.constexpr, SUBSETS: tl.constexpr):
    """One chunk of Adan (``fastoptim.optimizers.adan.adan_update``) per program. SUBSETS: the
    bucket holds subset-norm tensors (compiles their path)."""
    row = work + tl.program_id(0) * WORK_COLUMNS
    t, start, count = tl.load(row + TENSOR), tl.load(row + START), tl.load(row + COUNT)
    b, c = tl.load(row + SUBSET_ROWS), tl.load(row + SUBSET_COLUMNS)
    S = scalars + t * scalar_stride * N_ADAN
    if tl.load(S + ADAN_FOUND_INF) == 0:  # else GradScaler found an inf: skip the step
        seed = tl.load(S + ADAN_SEED).to(tl.uint32)
        param = _pointer(pointers, n_tensors, PARAM, t, PARAM_TYPE)
        grad = _pointer(pointers, n_tensors, GRAD, t, PARAM_TYPE)
        exp_avg = _pointer(pointers, n_tensors, EXP_AVG, t, STATE_TYPE)
        exp_avg_diff = _pointer(pointers, n_tensors, EXP_AVG_DIFF, t, STATE_TYPE)
        neg_pre_grad = _pointer(pointers, n_tensors, NEG_PRE_GRAD, t, STATE_TYPE)
        exp_avg_sq = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, STATE_TYPE)
        if SUBSETS:
            if b != 1:
                reduced = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, tl.float32)  # one fp32 per subset
                _adan_subset_chunk(param, grad, exp_avg, reduced, exp_avg_diff, neg_pre_grad, start, count, b, c, S,
                                   seed, t, STOCHASTIC)
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


# --- AdamW, AdamWSN and RMSPropSN -------------------------------------------------------------

@triton.jit
def _adamw_grad(grad, index, mask, S):
    return _load(grad, index, mask) * tl.load(S + ADAMW_GRAD_SCALE)


@triton.jit
def _adamw_scale(v, S):
    """step_size / denom, from the second moment (the element's or its subset's; v̂ with amsgrad)."""
    inv_bias_correction2_sqrt = 1 / tl.load(S + ADAMW_BIAS_CORRECTION2_SQRT)
    return tl.div_rn(tl.load(S + ADAMW_STEP_SIZE), tl.sqrt_rn(v) * inv_bias_correction2_sqrt + tl.load(S + ADAMW_EPS))


@triton.jit
def _adamw_apply(param, exp_avg, index, mask, g, scale, S, seed, t, FIRST_MOMENT: tl.constexpr,
                 STOCHASTIC: tl.constexpr):
    """After the second moment: the first moment (g itself without one) and the param. Weight
    decay multiplies before the update (AdamW) or after it (AdamWSN)."""
    numerator = g
    if FIRST_MOMENT:
        m = _load(exp_avg, index, mask)
        m += (g - m) * tl.load(S + ADAMW_ONE_MINUS_BETA1)  # lerp
        _store(exp_avg, index, m, mask)
        numerator = m
    p = (_load(param, index, mask) * tl.load(S + ADAMW_DECAY_MUL) - numerator * scale) * tl.load(S + ADAMW_DECAY_AFTER)
    _store_param(param, index, p, mask, seed, t, STOCHASTIC)


@triton.jit
def _adamw_dense_tile(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, index, mask, S, seed, t,
                      AMSGRAD: tl.constexpr, FIRST_MOMENT: tl.constexpr, STOCHASTIC: tl.constexpr):
    g = _adamw_grad(grad, index, mask, S)
    v = _load(exp_avg_sq, index, mask) * tl.load(S + ADAMW_BETA2) + g * g * tl.load(S + ADAMW_ONE_MINUS_BETA2)
    _store(exp_avg_sq, index, v, mask)
    if AMSGRAD:
        v = tl.maximum(_load(max_exp_avg_sq, index, mask), v)
        _store(max_exp_avg_sq, index, v, mask)
    _adamw_apply(param, exp_avg, index, mask, g, _adamw_scale(v, S), S, seed, t, FIRST_MOMENT, STOCHASTIC)


@triton.jit
def _adamw_subset_chunk(param, grad, exp_avg, reduced, reduced_max, start, count, b, c, S, seed, t,
                        AMSGRAD: tl.constexpr, FIRST_MOMENT: tl.constexpr, STOCHASTIC: tl.constexpr):
    """As ``_adan_subset_chunk``."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        sums = tl.zeros((SUBSET_TILE,), tl.float32)
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            g = _adamw_grad(grad, index, mask, S)
            sums += tl.sum(tl.where(mask, g * g, 0.0), axis=1)
        v = (_load(reduced, subsets, subsets < last) * tl.load(S + ADAMW_BETA2)
             + sums * tl.load(S + ADAMW_ONE_MINUS_BETA2))
        _store(reduced, subsets, v, subsets < last)
        if AMSGRAD:
            v = tl.maximum(_load(reduced_max, subsets, subsets < last), v)
            _store(reduced_max, subsets, v, subsets < last)
        scale = _adamw_scale(v, S)[:, None]
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            g = _adamw_grad(grad, index, mask, S)
            _adamw_apply(param, exp_avg, index, mask, g, scale, S, seed, t, FIRST_MOMENT, STOCHASTIC)


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
        if SUBSETS:
            if b != 1:
                reduced = _pointer(pointers, n_tensors, EXP_AVG_SQ, t, tl.float32)
                reduced_max = _pointer(pointers, n_tensors, MAX_EXP_AVG_SQ, t, tl.float32)
                _adamw_subset_chunk(param, grad, exp_avg, reduced, reduced_max, start, count, b, c, S, seed, t,
                                    AMSGRAD, FIRST_MOMENT, STOCHASTIC)
        dense = tl.where(b == 1, count, 0)  # as adan_kernel's
        full = tl.where(tl.load(row + ALIGNED) != 0, dense // BLOCK * BLOCK, 0)
        for offset in range(0, full, BLOCK):
            index = tl.multiple_of(start + offset, BLOCK) + tl.arange(0, BLOCK)
            _adamw_dense_tile(tl.multiple_of(param, 16), tl.multiple_of(grad, 16), tl.multiple_of(exp_avg, 16),
                              tl.multiple_of(exp_avg_sq, 16), tl.multiple_of(max_exp_avg_sq, 16), index, None, S, seed,
                              t, AMSGRAD, FIRST_MOMENT, STOCHASTIC)
        for offset in range(full, dense, BLOCK):
            index = start + offset + tl.arange(0, BLOCK)
            _adamw_dense_tile(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, index, index < start + dense, S, seed,
                              t, AMSGRAD, FIRST_MOMENT, STOCHASTIC)

TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
KERNELS = {"adan": adan_kernel, "adamw": adamw_kernel}


def _options(kernel, param_dtype, state_dtype, stochastic, subsets, amsgrad, first_moment):
    """The compile-time arguments of a kernel variant."""
    options = dict(PARAM_TYPE=TYPES[param_dtype], STATE_TYPE=TYPES[state_dtype], STOCHASTIC=stochastic,
                   SUBSETS=subsets)
    return options | (dict(AMSGRAD=amsgrad, FIRST_MOMENT=first_moment) if kernel == "adamw" else {})


def launch(kernel, pointers, n_tensors, work, scalars, param_dtype, state_dtype, *, stochastic=False, subsets=False,
           amsgrad=False, first_moment=True):
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
