"""Fused GPU kernels in Triton: one launch updates every tensor of a bucket.

A launch reads two device tables, built once per bucket and cached (``fastoptim.multi_tensor``):
- ``pointers``: int64 data pointers, one row per role in the algorithm's ``KernelSpec.rows`` order
  (param, grad, each state, each state's block maxima, then the params' master remainders), one
  column per tensor. A program loads
  the addresses it needs from it, so the launch takes three pointers whatever the number of
  tensors: no 4 KB argument limit, and no copy of addresses per step.
- ``work``: one row per program, ``WORK_COLUMNS`` int64s: a tensor, its chunk (first element and
  element count, as ``multi_tensor.chunk_plan`` cuts it), its subset-norm layout (b, c) and
  whether the chunk's streams are 16-byte aligned, which lets full tiles use 128-bit accesses.

Scalars come as an fp32 device tensor, one row of ``KernelSpec.all_scalars`` per tensor (or one
shared row, ``scalar_stride`` 0): a tensor lr, the clip coefficient or GradScaler's found_inf are
read here, with no host sync.

There is one kernel, ``step_kernel``, and one walk over memory per layout: dense tiles (full
aligned tiles unmasked, then a masked rest), 8-bit blocks, and subset-norm chunks (their sums of
squares, then their elements). An algorithm enters it only through its per-element functions,
passed as ``tl.constexpr`` (see ``Algorithm``), and the spec it declares: the rows of its states,
the positions of its scalars and its feature flags are read from the ``KernelSpec`` at launch and
become constexpr arguments (``_variant``). The per-element math restates the reference ``update``
functions in ``fastoptim/optimizers``, as the C kernels (``fused_cpu.c``) do; the tests hold all of
them to the reference. The layout of a chunk follows the C kernels too: dense, or subset-norm (a,
b, c) with subsets of b elements, rows (c = 1, subset k at elements [k·b, (k+1)·b)) or columns (a =
1, subset k at elements k + r·c).

This module must not import ``fastoptim.optimizers`` (which imports it while it initialises): the
spec comes with each call.
"""
import functools
from collections import namedtuple

import torch
import triton
import triton.language as tl

from ..specs import ABSMAX, REMAINDER
from ..states import blockwise8

WORK_COLUMNS = tl.constexpr(6)
TENSOR, START, COUNT, SUBSET_ROWS, SUBSET_COLUMNS, ALIGNED = (tl.constexpr(i) for i in range(6))

BLOCK = tl.constexpr(1024)  # elements per tile of a dense chunk
NUM_WARPS = 8  # 4 fp32 per thread and stream: one 128-bit access each (Adan: 99 registers on sm_90, 222 with 4 warps)
SUBSET_TILE, MEMBER_TILE = tl.constexpr(16), tl.constexpr(32)  # subsets × members: 512 elements, 2 per thread
BLOCK8 = tl.constexpr(blockwise8.BLOCK)
# The code tables' numbers (fastoptim.specs.CODE_TABLES), and the largest magnitude of each (blockwise8's
# tables' top): codes are magnitudes / top
UNSIGNED, SIGNED, LINEAR = (tl.constexpr(blockwise8.TABLES[name].table) for name in ("unsigned", "signed", "linear"))
UNSIGNED_TOP, SIGNED_TOP, LINEAR_TOP = (tl.constexpr(blockwise8.TABLES[name].top)
                                        for name in ("unsigned", "signed", "linear"))
# The indices of non-finite values, which decode to themselves (see blockwise8's docstring)
NAN_INDEX, UNSIGNED_INF_INDEX = tl.constexpr(blockwise8.NAN_INDEX), tl.constexpr(blockwise8.UNSIGNED.inf_index)
INF_BITS = tl.constexpr(0x7F800000)  # +inf's bits: |x|'s bits are at least these where x is not finite
FLOAT32_MAX = tl.constexpr(torch.finfo(torch.float32).max)


# --- loads and stores -------------------------------------------------------------------------

@triton.jit
def _pointer(pointers, n_tensors, role, t, dtype: tl.constexpr):
    return tl.load(pointers + role * n_tensors + t).to(tl.pointer_type(dtype))


@triton.jit
def _stream(pointers, n_tensors, role, t, dtype: tl.constexpr):
    """A param-shaped tensor's data, declared 16-byte aligned. The hint holds wherever the pointer
    is used, but only full tiles of a chunk whose work row says ALIGNED have an index known to be
    aligned (a multiple of BLOCK): there it gives 128-bit accesses; elsewhere it changes nothing."""
    return tl.multiple_of(_pointer(pointers, n_tensors, role, t, dtype), 16)


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


# How a param holds its fp32 value (ROUNDING, as the C kernels' rounding): rounded to nearest (even),
# STOCHASTIC (bf16), or a bf16 param beside a master remainder of 8 or 16 bits (fastoptim/states/master.py).
NEAREST, STOCHASTIC, REMAINDER8, REMAINDER16 = (tl.constexpr(i) for i in (0, 1, 8, 16))
# The low bits of the 16-bit difference that an 8-bit remainder drops: their count, and 2 to its power
DROPPED_BITS, DROPPED_UNIT = tl.constexpr(8), tl.constexpr(256)


@triton.jit
def _param_stream(pointers, n_tensors, PARAM: tl.constexpr, REMAINDER_ROW: tl.constexpr, t, PARAM_TYPE: tl.constexpr,
                  ROUNDING: tl.constexpr):
    """The param's data and its master remainder's (0 where it keeps none), declared as _stream does."""
    remainder = 0
    if ROUNDING == REMAINDER16:
        remainder = _stream(pointers, n_tensors, REMAINDER_ROW, t, tl.int16)
    elif ROUNDING == REMAINDER8:
        remainder = _stream(pointers, n_tensors, REMAINDER_ROW, t, tl.int8)
    return _stream(pointers, n_tensors, PARAM, t, PARAM_TYPE), remainder


@triton.jit
def _load_param(param, index, mask, ROUNDING: tl.constexpr):
    """The param's fp32 value: its bits shifted up plus the remainder (shifted by the bits it drops);
    the param alone where the two make a NaN (as fastoptim.states.master.widen)."""
    if ROUNDING < REMAINDER8:
        value = _load(param[0], index, mask)
    else:
        low = tl.load(param[1] + index, mask=mask).to(tl.int32)
        if ROUNDING == REMAINDER8:
            low = low * DROPPED_UNIT
        high = tl.load(param[0] + index, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        value = (high + low.to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
        value = tl.where(value != value, high.to(tl.float32, bitcast=True), value)
    return value


@triton.jit
def _store_param(param, index, value, mask, seed, t, ROUNDING: tl.constexpr):
    """The param's fp32 result into its dtype: to nearest even, or for bf16 STOCHASTIC, up with
    probability equal to the dropped fraction, with the C kernels' random bits; or split into the
    param, the bits rounded to nearest with ties away from zero, and the remainder, their signed
    difference (for 8 bits its top 8, rounded, at most 127). A NaN goes to the param, with a zero remainder."""
    if ROUNDING < REMAINDER8:
        if ROUNDING == STOCHASTIC and param[0].dtype.element_ty == tl.bfloat16:
            value = _round_bf16(value, _random_bits(seed, t, index) >> 16)  # exact in bf16: _store keeps it
        _store(param[0], index, value, mask)
    else:
        bits = value.to(tl.uint32, bitcast=True)
        top = (bits + 0x8000) & 0xFFFF0000
        nan = value != value
        difference = tl.where(nan, 0, (bits - top).to(tl.int32, bitcast=True))
        high = tl.where(nan, (bits >> 16) | 0x40, top >> 16).to(tl.uint16)
        tl.store(param[0] + index, high.to(tl.bfloat16, bitcast=True), mask=mask)
        if ROUNDING == REMAINDER8:
            difference = tl.minimum((difference + DROPPED_UNIT // 2) >> DROPPED_BITS, 127)
        tl.store(param[1] + index, difference.to(param[1].dtype.element_ty), mask=mask)


@triton.jit
def _subset_tile(subsets, last, j, b, c):
    """Index and mask of members [j, j + MEMBER_TILE) of each of ``subsets`` (those below ``last``):
    b consecutive elements per subset (rows, c = 1), or one per row of c (columns)."""
    members = j + tl.arange(0, MEMBER_TILE)
    index = subsets[:, None] * tl.where(c == 1, b, 1) + members[None, :] * c
    return index, (subsets < last)[:, None] & (members < b)[None, :]


@triton.jit
def _subset_of(index, b, c):
    """The subset-norm entry of element ``index``: its row (c = 1) or its column."""
    return tl.where(c == 1, index // b, index % c)


# --- 8-bit blockwise states (fastoptim/states/blockwise8.py, as fused_cpu.c restates it) ----------
# A block of BLOCK8 elements is one tile: its codes are dequantized, updated and requantized in
# registers with its new absmax. TABLE is a state's code table (its number). Magnitude k of a
# float-like code is the fp16 number with bits k << 7 (SIGNED: up to 127, centred on index 127;
# UNSIGNED: up to 247); of a LINEAR one, k itself (up to 127, centred on index 127). Quantizing finds
# the magnitude nearest to t = |x|·top/absmax, a tie going up, as the C kernel's portable path does.
# (Triton's interpreter converts fp32 below fp16's range to fp16 wrongly, so the rounding is done on
# fp32 bits.) Non-finite values keep indices of their own, which decode to themselves: UNSIGNED's
# past its codes are fp16's +inf and NaNs already; the signed tables' NaN index is NaN.

@triton.jit
def _dequantize(codes, absmax, TABLE: tl.constexpr):
    k = codes.to(tl.int32) if TABLE == UNSIGNED else codes.to(tl.int32) - 127
    if TABLE == LINEAR:
        magnitude = tl.abs(k).to(tl.float32)
    else:
        magnitude = (tl.abs(k) * 128).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if TABLE != UNSIGNED:
        magnitude = tl.where(codes == NAN_INDEX, INF_BITS + 1, magnitude.to(tl.int32, bitcast=True)).to(
            tl.float32, bitcast=True)
    code = magnitude * (1 / LINEAR_TOP if TABLE == LINEAR else 1 / SIGNED_TOP if TABLE == SIGNED else 1 / UNSIGNED_TOP)
    value = tl.where(k < 0, -code, code) * absmax
    return tl.where(tl.abs(magnitude) < float("inf"), value, magnitude)


@triton.jit
def _round_half_up(t):
    """t (>= 0) rounded whole, a tie going up: the floor plus whether the fraction is at least 1/2
    (exact; t + 0.5 would round some t below a tie up first)."""
    whole = tl.floor(t)
    return whole.to(tl.int32) + (t - whole >= 0.5).to(tl.int32)


@triton.jit
def _quantize(t, TABLE: tl.constexpr):
    """The codes of t = x·top/absmax. LINEAR: |t| rounded whole. Float-like: from |t|'s fp32 bits,
    rounding away the 20 bits below fp16's 3 mantissa bits and rebasing the exponent; below fp16's
    normal range, rounding |t|·2^17 whole."""
    magnitude = tl.abs(t)
    if TABLE == LINEAR:
        k = _round_half_up(magnitude)
    else:
        normal = ((magnitude.to(tl.int32, bitcast=True) + (1 << 19)) >> 20) - ((127 - 15) << 3)
        subnormal = _round_half_up(tl.minimum(magnitude, 2.0**-14) * 2.0**17)
        k = tl.where(magnitude < 2.0**-14, subnormal, normal)
    k = tl.minimum(k, 247 if TABLE == UNSIGNED else 127)
    return (k if TABLE == UNSIGNED else tl.where(t < 0, 127 - k, 127 + k)).to(tl.uint8)


@triton.jit
def _load_q8(codes, absmax, block, index, mask, TABLE: tl.constexpr):
    return _dequantize(tl.load(codes + index, mask=mask), tl.load(absmax + block), TABLE)


@triton.jit
def _store_q8(codes, absmax, block, index, mask, values, TABLE: tl.constexpr):
    # the largest |x| of the finite elements, from their bits as integers
    magnitude_bits = values.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    finite = magnitude_bits < INF_BITS
    top = tl.max(tl.where(mask & finite, magnitude_bits, 0), axis=0).to(tl.float32, bitcast=True)
    scale = tl.div_rn(LINEAR_TOP if TABLE == LINEAR else SIGNED_TOP if TABLE == SIGNED else UNSIGNED_TOP,
                      tl.where(top > 0, top, 1.0))
    stored = (top > 0) & (scale <= FLOAT32_MAX)  # else the block is stored as zeros
    indices = _quantize(tl.where(finite, values, 0.0) * tl.where(stored, scale, 0.0), TABLE)
    if TABLE == UNSIGNED:
        indices = tl.where(finite, indices, tl.where(values == float("inf"), UNSIGNED_INF_INDEX, NAN_INDEX))
    else:
        indices = tl.where(finite, indices, NAN_INDEX)
    tl.store(codes + index, indices, mask=mask)
    tl.store(absmax + block, tl.where(stored, top, 0.0))


@triton.jit
def _blocks_kernel(values, codes, absmax, n, TABLE: tl.constexpr, QUANTIZE: tl.constexpr):
    """The quantizer (QUANTIZE) or the dequantizer alone, one block per program, for the tests."""
    block = tl.program_id(0)
    index = block * BLOCK8 + tl.arange(0, BLOCK8)
    if QUANTIZE:
        _store_q8(codes, absmax, block, index, index < n, tl.load(values + index, mask=index < n), TABLE)
    else:
        tl.store(values + index, _load_q8(codes, absmax, block, index, index < n, TABLE), mask=index < n)


# --- a tuple of states: their pointers, loads and stores ------------------------------------------
# ROLES is a constexpr ``Slots``: per field, a tuple with an entry per state role of one kind (the
# spec's order); a role the algorithm does not keep with these flags has the row None. The tuples of
# pointers and values have the same positions; a role not kept holds the placeholder 0, which is never
# loaded nor stored.

@triton.jit
def _state_pointers(pointers, n_tensors, ROLES: tl.constexpr, t, STATE_TYPE: tl.constexpr):
    """Each kept state's data as STATE_TYPE (a ``half`` state beside 8-bit codes: bf16), declared
    aligned as ``_stream`` does (the hint is the load's, so a subset-norm moment read as fp32 from
    the same row has it too: it changes nothing for its accesses)."""
    result = ()
    for i in tl.static_range(len(ROLES.row)):
        if ROLES.row[i] is None:
            result = result + (0,)
        elif STATE_TYPE == tl.uint8 and ROLES.half[i]:
            result = result + (_stream(pointers, n_tensors, ROLES.row[i], t, tl.bfloat16),)
        else:
            result = result + (_stream(pointers, n_tensors, ROLES.row[i], t, STATE_TYPE),)
    return result


@triton.jit
def _absmax_pointers(pointers, n_tensors, ROLES: tl.constexpr, t):
    """Each 8-bit state's block maxima (fp32), beside ``_state_pointers(..., tl.uint8)``."""
    result = ()
    for i in tl.static_range(len(ROLES.row)):
        if ROLES.row[i] is None:
            result = result + (0,)
        elif ROLES.half[i]:
            result = result + (0,)
        else:
            result = result + (_pointer(pointers, n_tensors, ROLES.absmax[i], t, tl.float32),)
    return result


@triton.jit
def _load_states(pointers, absmax, ROLES: tl.constexpr, index, mask, block):
    """The kept states' values at ``index`` as fp32. 8-bit codes are dequantized with the absmax of
    ``block`` (the tile's one block), or with ``block`` None, each element's own, gathered."""
    values = ()
    for i in tl.static_range(len(ROLES.row)):
        if ROLES.row[i] is None:
            values = values + (0,)
        elif pointers[i].dtype.element_ty == tl.uint8:
            if block is None:
                values = values + (_dequantize(tl.load(pointers[i] + index, mask=mask),
                                               tl.load(absmax[i] + index // BLOCK8, mask=mask), ROLES.table[i]),)
            else:
                values = values + (_load_q8(pointers[i], absmax[i], block, index, mask, ROLES.table[i]),)
        else:
            values = values + (_load(pointers[i], index, mask),)
    return values


@triton.jit
def _gather_states(pointers, ROLES: tl.constexpr, index, mask):
    """The kept states' fp32 values at ``index`` (a subset-norm moment's entry per element)."""
    values = ()
    for i in tl.static_range(len(ROLES.row)):
        if ROLES.row[i] is None:
            values = values + (0,)
        else:
            values = values + (tl.load(pointers[i] + index, mask=mask, other=0.0),)
    return values


@triton.jit
def _store_states(pointers, absmax, ROLES: tl.constexpr, index, mask, block, values):
    """The kept states' new fp32 values into their formats (8-bit: requantizing ``block``)."""
    for i in tl.static_range(len(ROLES.row)):
        if ROLES.row[i] is not None:
            if pointers[i].dtype.element_ty == tl.uint8:
                _store_q8(pointers[i], absmax[i], block, index, mask, values[i], ROLES.table[i])
            else:
                _store(pointers[i], index, values[i], mask)


# --- the walks over memory, written once ------------------------------------------------------
# Every walk takes the algorithm's functions (see ``Algorithm``) and three constexpr descriptions
# from its spec: K (the scalars' positions in a row, by name), F (the feature flags, by name),
# STATES and MOMENTS (``Slots``: the element-wise states, and the second moments, which
# subset-norm keeps per subset). ``states``/``moments`` are their pointers, ``reduced`` the
# moments' pointers as fp32 (one per subset under sn), ``*_absmax`` the 8-bit block maxima.

@triton.jit
def _moments_scale(moments, moments_absmax, index, mask, block, x, S, K: tl.constexpr, F: tl.constexpr,
                   MOMENTS: tl.constexpr, SECOND_MOMENTS: tl.constexpr, STEP_SCALE: tl.constexpr):
    """The elements' second moments, updated with ``x``, stored, and the step scale they give."""
    new_moments = SECOND_MOMENTS(_load_states(moments, moments_absmax, MOMENTS, index, mask, block), x, S, K, F,
                                 False)
    _store_states(moments, moments_absmax, MOMENTS, index, mask, block, new_moments)
    return STEP_SCALE(new_moments, S, K, F)


@triton.jit
def _tile(param, grad, states, states_absmax, moments, moments_absmax, reduced, index, mask, block, b, c, S, seed, t,
          K: tl.constexpr, F: tl.constexpr, STATES: tl.constexpr, MOMENTS: tl.constexpr, TERMS: tl.constexpr,
          SECOND_MOMENTS: tl.constexpr, STEP_SCALE: tl.constexpr, UPDATE: tl.constexpr, ROUNDING: tl.constexpr,
          REDUCED_MOMENTS: tl.constexpr):
    """The elements ``index`` (``mask`` None: all of them): a tile of a dense chunk, or 8-bit block
    number ``block`` (its states' block maxima in ``*_absmax``; None for a dense tile). With
    REDUCED_MOMENTS, a tensor with subsets (b > 1) reads its second moments from the subset-norm
    ``reduced`` ones (updated already) instead of updating them here."""
    values = _load_states(states, states_absmax, STATES, index, mask, block)
    terms = TERMS(_load(grad, index, mask), values, S, K, F)
    if len(MOMENTS.row) > 0:
        if REDUCED_MOMENTS:
            if b != 1:
                scale = STEP_SCALE(_gather_states(reduced, MOMENTS, _subset_of(index, b, c), mask), S, K, F)
            else:
                scale = _moments_scale(moments, moments_absmax, index, mask, block, terms[0], S, K, F, MOMENTS,
                                       SECOND_MOMENTS, STEP_SCALE)
        else:
            scale = _moments_scale(moments, moments_absmax, index, mask, block, terms[0], S, K, F, MOMENTS,
                                   SECOND_MOMENTS, STEP_SCALE)
    else:
        scale = 0
    p, values = UPDATE(_load_param(param, index, mask, ROUNDING), terms, values, scale, S, K, F)
    _store_states(states, states_absmax, STATES, index, mask, block, values)
    _store_param(param, index, p, mask, seed, t, ROUNDING)


@triton.jit
def _subset_sums(grad, states, states_absmax, reduced, start, count, b, c, S, K: tl.constexpr, F: tl.constexpr,
                 STATES: tl.constexpr, MOMENTS: tl.constexpr, TERMS: tl.constexpr, SECOND_MOMENTS: tl.constexpr):
    """The second moments of subsets [start/b, (start + count)/b), from their sums of squares."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        sums = tl.zeros((SUBSET_TILE,), tl.float32)
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            x = TERMS(_load(grad, index, mask), _load_states(states, states_absmax, STATES, index, mask, None), S, K,
                      F)[0]
            sums += tl.sum(tl.where(mask, x * x, 0.0), axis=1)
        in_range = subsets < last
        new_moments = SECOND_MOMENTS(_load_states(reduced, None, MOMENTS, subsets, in_range, None), sums, S, K, F,
                                     True)
        _store_states(reduced, None, MOMENTS, subsets, in_range, None, new_moments)


@triton.jit
def _subset_updates(param, grad, states, reduced, start, count, b, c, S, seed, t, K: tl.constexpr, F: tl.constexpr,
                    STATES: tl.constexpr, MOMENTS: tl.constexpr, TERMS: tl.constexpr, STEP_SCALE: tl.constexpr,
                    UPDATE: tl.constexpr, ROUNDING: tl.constexpr):
    """After ``_subset_sums``: the elements of the chunk's subsets (fp32 or bf16 states)."""
    last = (start + count) // b
    for first in range(start // b, last, SUBSET_TILE):
        subsets = first + tl.arange(0, SUBSET_TILE)
        scale = STEP_SCALE(_load_states(reduced, None, MOMENTS, subsets, subsets < last, None), S, K, F)[:, None]
        for j in range(0, b, MEMBER_TILE):
            index, mask = _subset_tile(subsets, last, j, b, c)
            values = _load_states(states, None, STATES, index, mask, None)
            p, values = UPDATE(_load_param(param, index, mask, ROUNDING), TERMS(_load(grad, index, mask), values, S,
                               K, F), values, scale, S, K, F)
            _store_states(states, None, STATES, index, mask, None, values)
            _store_param(param, index, p, mask, seed, t, ROUNDING)


@triton.jit
def step_kernel(pointers, n_tensors, work, scalars, scalar_stride, TERMS: tl.constexpr,
                SECOND_MOMENTS: tl.constexpr, STEP_SCALE: tl.constexpr, UPDATE: tl.constexpr, K: tl.constexpr,
                F: tl.constexpr, PARAM: tl.constexpr, GRAD: tl.constexpr, STATES: tl.constexpr,
                MOMENTS: tl.constexpr, REMAINDER_ROW: tl.constexpr, PARAM_TYPE: tl.constexpr,
                GRAD_TYPE: tl.constexpr, STATE_TYPE: tl.constexpr, ROUNDING: tl.constexpr, SUBSETS: tl.constexpr):
    """One chunk of an algorithm's step per program (see the module docstring and ``_variant``).
    SUBSETS: the bucket holds subset-norm tensors (compiles their path). STATE_TYPE uint8: 8-bit
    states, with the ``half`` ones in bf16. GRAD_TYPE: the params' type, or the spec's grad format."""
    row = work + tl.program_id(0) * WORK_COLUMNS
    t, start, count = tl.load(row + TENSOR), tl.load(row + START), tl.load(row + COUNT)
    b, c = tl.load(row + SUBSET_ROWS), tl.load(row + SUBSET_COLUMNS)
    S = scalars + t * scalar_stride * len(K)
    if tl.load(S + K.found_inf) == 0:  # else GradScaler found an inf: skip the step
        seed = tl.load(S + K.seed).to(tl.uint32)
        param = _param_stream(pointers, n_tensors, PARAM, REMAINDER_ROW, t, PARAM_TYPE, ROUNDING)  # and remainder
        grad = _stream(pointers, n_tensors, GRAD, t, GRAD_TYPE)
        states = _state_pointers(pointers, n_tensors, STATES, t, STATE_TYPE)
        moments = _state_pointers(pointers, n_tensors, MOMENTS, t, STATE_TYPE)
        reduced = _state_pointers(pointers, n_tensors, MOMENTS, t, tl.float32)  # one fp32 per subset under sn
        if STATE_TYPE == tl.uint8:
            states_absmax = _absmax_pointers(pointers, n_tensors, STATES, t)
            moments_absmax = _absmax_pointers(pointers, n_tensors, MOMENTS, t)
            if SUBSETS:
                if b != 1:
                    _subset_sums(grad, states, states_absmax, reduced, start, count, b, c, S, K, F, STATES, MOMENTS,
                                 TERMS, SECOND_MOMENTS)
            # The chunk plan cuts 8-bit chunks at blocks: a run of whole blocks, or a run of columns of a
            # tensor whose rows are whole blocks, walked as its rows' segments [r·c + j0, r·c + j1).
            segments = (c > 1) & (c % BLOCK8 == 0)
            length = tl.where(segments, count // b, count)
            for r in range(0, tl.where(segments, b, 1)):
                base = tl.where(segments, r * c + start // b, start)
                for offset in range(0, length, BLOCK8):
                    index = base + offset + tl.arange(0, BLOCK8)
                    _tile(param, grad, states, states_absmax, moments, moments_absmax, reduced, index,
                          offset + tl.arange(0, BLOCK8) < length, (base + offset) // BLOCK8, b, c, S, seed, t, K, F,
                          STATES, MOMENTS, TERMS, SECOND_MOMENTS, STEP_SCALE, UPDATE, ROUNDING, True)
        else:
            if SUBSETS:
                if b != 1:
                    _subset_sums(grad, states, None, reduced, start, count, b, c, S, K, F, STATES, MOMENTS, TERMS,
                                 SECOND_MOMENTS)
                    _subset_updates(param, grad, states, reduced, start, count, b, c, S, seed, t, K, F, STATES,
                                    MOMENTS, TERMS, STEP_SCALE, UPDATE, ROUNDING)
            # A dense chunk: full tiles of 16-byte aligned streams with no mask (128-bit accesses: the
            # pointers are declared aligned where they are loaded, see _stream), then the rest with a mask.
            dense = tl.where(b == 1, count, 0)
            full = tl.where(tl.load(row + ALIGNED) != 0, dense // BLOCK * BLOCK, 0)
            for offset in range(0, full, BLOCK):
                index = tl.multiple_of(start + offset, BLOCK) + tl.arange(0, BLOCK)
                _tile(param, grad, states, None, moments, None, reduced, index, None, None, b, c, S, seed, t, K, F,
                      STATES, MOMENTS, TERMS, SECOND_MOMENTS, STEP_SCALE, UPDATE, ROUNDING, False)
            for offset in range(full, dense, BLOCK):
                index = start + offset + tl.arange(0, BLOCK)
                _tile(param, grad, states, None, moments, None, reduced, index, index < start + dense, None, b, c, S,
                      seed, t, K, F, STATES, MOMENTS, TERMS, SECOND_MOMENTS, STEP_SCALE, UPDATE, ROUNDING, False)


# --- the math the algorithms share, with scalars named by their position in a row ------------

@triton.jit
def _moving_average(old, new, S, BETA: tl.constexpr, ONE_MINUS_BETA: tl.constexpr):
    return old * tl.load(S + BETA) + new * tl.load(S + ONE_MINUS_BETA)


@triton.jit
def _moving_average_of_squares(old, x, S, BETA: tl.constexpr, ONE_MINUS_BETA: tl.constexpr):
    """β·old + (1−β)·x·x in torch's addcmul order, as the C kernel: (1−β)·x first, so that a large x
    overflows no sooner than the loop engine's."""
    return old * tl.load(S + BETA) + tl.load(S + ONE_MINUS_BETA) * x * x


@triton.jit
def _second_moment(old, x, S, BETA: tl.constexpr, ONE_MINUS_BETA: tl.constexpr, SUMS: tl.constexpr):
    """β·old + (1−β)·x² of an element, or with SUMS, β·old + (1−β)·Σx² of a subset (x: the sum)."""
    if SUMS:
        new = _moving_average(old, x, S, BETA, ONE_MINUS_BETA)
    else:
        new = _moving_average_of_squares(old, x, S, BETA, ONE_MINUS_BETA)
    return new


@triton.jit
def _step_scale(second_moment, S, STEP_SIZE: tl.constexpr, BIAS_CORRECTION_SQRT: tl.constexpr, EPS: tl.constexpr):
    """step_size / (√second_moment / bias_correction_sqrt + eps): a reciprocal per tile, as the C
    kernels take one per tensor, and one IEEE division per element."""
    inverse = 1 / tl.load(S + BIAS_CORRECTION_SQRT)
    return tl.div_rn(tl.load(S + STEP_SIZE), tl.sqrt_rn(second_moment) * inverse + tl.load(S + EPS))


# --- the algorithms' per-element functions ------------------------------------------------------
# Each takes S (the tensor's scalar row), K and F (see the walks); ``states`` and ``moments`` are
# tuples of fp32 values in the spec's role order (its roles that are not ``reduced``, and those
# that are), 0 for a role not kept.

Algorithm = namedtuple("Algorithm", "terms update second_moments step_scale", defaults=(None, None))
Algorithm.__doc__ = """An algorithm's per-element functions (``triton.jit``), which the walks call:

``terms(grad, states, S, K, F)``: what the update takes of the (unscaled) grad and the loaded
    states, as a tuple whose first item is the quantity whose square enters the second moments.
``update(p, terms, states, scale, S, K, F)``: the new param and states, from the loaded param and
    states, the terms and the scale (0 without second moments).
``second_moments(moments, x, S, K, F, SUMS)``: the new second moments from their old values and
    an element's ``terms[0]``, or with SUMS, the sum of its squares over a subset.
``step_scale(moments, S, K, F)``: the update's scale from the new second moments (an element's or
    its subset's).

An algorithm without ``reduced`` roles (no second moment) needs only ``terms`` and ``update``."""


@triton.jit
def _scaled_grad(grad, states, S, K: tl.constexpr, F: tl.constexpr):
    """g = grad · grad_scale (the clip coefficient, GradScaler's 1/scale, −1 to maximize)."""
    return (grad * tl.load(S + K.grad_scale),)


# Adan (``fastoptim.optimizers.adan.adan_update``). States: exp_avg, exp_avg_diff, neg_pre_grad;
# moments: exp_avg_sq.


@triton.jit
def _adan_terms(grad, states, S, K: tl.constexpr, F: tl.constexpr):
    """u = g + β2·d (exp_avg_sq averages its square), −g and d = g − g_prev (0 at a first step)."""
    neg_g = grad * -tl.load(S + K.grad_scale)
    d = (states[2] - neg_g) * tl.load(S + K.pre_grad_weight)
    return d * tl.load(S + K.beta2) - neg_g, neg_g, d


@triton.jit
def _adan_update(p, terms, states, scale, S, K: tl.constexpr, F: tl.constexpr):
    """After exp_avg_sq: the new moments m, v, −g and param p."""
    u, neg_g, d = terms
    m = states[0] * tl.load(S + K.beta1) - neg_g * tl.load(S + K.one_minus_beta1)
    v = states[1] * tl.load(S + K.beta2) + d * tl.load(S + K.one_minus_beta2)
    p = p * tl.load(S + K.decay_mul) - m * scale - v * (scale * tl.load(S + K.diff_ratio))  # no_prox: 1 − lr·wd
    return p * (1 / tl.load(S + K.decay_div)), (m, v, neg_g)  # prox: 1 + lr·wd


@triton.jit
def _adan_second_moments(moments, u, S, K: tl.constexpr, F: tl.constexpr, SUMS: tl.constexpr):
    return (_second_moment(moments[0], u, S, K.beta3, K.one_minus_beta3, SUMS),)


@triton.jit
def _adan_step_scale(moments, S, K: tl.constexpr, F: tl.constexpr):
    """step_size / denom, from exp_avg_sq."""
    return _step_scale(moments[0], S, K.step_size, K.bias_correction3_sqrt, K.eps)


# AdamW, AdamWSN and RMSPropSN (``adamw_update``; RMSPropSN with flag first_moment off).
# States: exp_avg (first_moment); moments: exp_avg_sq, max_exp_avg_sq (amsgrad).


@triton.jit
def _lerp(start, end, w):
    """torch's lerp: start + w·(end − start) for |w| < 0.5, else end − (1 − w)·(end − start), each one
    FMA as torch's and the C kernel's (the interpreter too: a separate product rounds once more)."""
    difference = end - start
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, difference, start), tl.fma(w - 1.0, difference, end))


@triton.jit
def _adamw_update(p, terms, states, scale, S, K: tl.constexpr, F: tl.constexpr):
    """Weight decay multiplies before the update (AdamW) or after it (AdamWSN)."""
    g = terms[0]
    m = states[0]
    numerator = g
    if F.first_moment:
        m = _lerp(m, g, tl.load(S + K.one_minus_beta1))  # torch's lerp_, exact at β1 = 0 (helper-106)
        numerator = m
    return (p * tl.load(S + K.decay_mul) - numerator * scale) * tl.load(S + K.decay_after), (m,)


@triton.jit
def _adamw_second_moments(moments, g, S, K: tl.constexpr, F: tl.constexpr, SUMS: tl.constexpr):
    v = _second_moment(moments[0], g, S, K.beta2, K.one_minus_beta2, SUMS)
    v_max = moments[1]
    if F.amsgrad:
        v_max = tl.maximum(v_max, v, propagate_nan=tl.PropagateNan.ALL)  # torch.maximum: a NaN stays (helper-110)
    return v, v_max


@triton.jit
def _adamw_step_scale(moments, S, K: tl.constexpr, F: tl.constexpr):
    """step_size / denom, from the second moment (v̂ with amsgrad)."""
    if F.amsgrad:
        scale = _step_scale(moments[1], S, K.step_size, K.bias_correction2_sqrt, K.eps)
    else:
        scale = _step_scale(moments[0], S, K.step_size, K.bias_correction2_sqrt, K.eps)
    return scale


# Lion (``fastoptim.optimizers.lion.lion_update``). States: exp_avg; no second moment.


@triton.jit
def _sign(x):
    """1, −1, or 0 for ±0 and NaN, as torch.sign (so a NaN momentum leaves its param as it is)."""
    return (x > 0).to(tl.float32) - (x < 0).to(tl.float32)


@triton.jit
def _lion_update(p, terms, states, scale, S, K: tl.constexpr, F: tl.constexpr):
    """p·(1 − lr·wd) − lr·sign(β1·m + (1−β1)·g), then m = β2·m + (1−β2)·g."""
    g, m = terms[0], states[0]
    c = m * tl.load(S + K.beta1) + g * tl.load(S + K.one_minus_beta1)
    p = p * tl.load(S + K.decay_mul) - _sign(c) * tl.load(S + K.lr)
    return p, (m * tl.load(S + K.beta2) + g * tl.load(S + K.one_minus_beta2),)


# Muon's momentum (``fastoptim.optimizers.muon_parts.muon_momentum``). States: momentum_buffer; the param
# row holds the direction it writes (the Newton–Schulz iterations' input), not a param.


@triton.jit
def _muon_momentum_update(p, terms, states, scale, S, K: tl.constexpr, F: tl.constexpr):
    """B = μ·B + (1−μ)·g (lerp); the direction g + μ·(B − g) with nesterov, else B."""
    g = terms[0]
    m = _lerp(states[0], g, tl.load(S + K.one_minus_momentum))
    direction = m
    if F.nesterov:
        direction = _lerp(g, m, tl.load(S + K.momentum))
    return direction, (m,)


# Muon's update (``fastoptim.optimizers.muon_parts.muon_apply``): the grad row holds the orthogonalized
# direction (bf16), which no grad scale touches; no states.


@triton.jit
def _direction(grad, states, S, K: tl.constexpr, F: tl.constexpr):
    return (grad,)


@triton.jit
def _muon_apply_update(p, terms, states, scale, S, K: tl.constexpr, F: tl.constexpr):
    """p·(1 − lr·wd), rounded, then p − step_size·O in one FMA, as torch's addcmul_ computes it."""
    decayed = p * tl.load(S + K.decay_mul)
    return tl.fma(-terms[0], tl.load(S + K.step_size), decayed), states


ALGORITHMS = {  # by KernelSpec.name
    "adan": Algorithm(_adan_terms, _adan_update, _adan_second_moments, _adan_step_scale),
    "adamw": Algorithm(_scaled_grad, _adamw_update, _adamw_second_moments, _adamw_step_scale),
    "lion": Algorithm(_scaled_grad, _lion_update),
    "muon_momentum": Algorithm(_scaled_grad, _muon_momentum_update),
    "muon_apply": Algorithm(_direction, _muon_apply_update),
}


# --- launching --------------------------------------------------------------------------------

PARAM_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TYPES = PARAM_TYPES | {torch.uint8: tl.uint8}  # and 8-bit states' codes
GRAD_TYPES = {"bf16": tl.bfloat16}  # a spec's own grad format (KernelSpec.grad)
# State roles as the walks see them, a tuple per field with an entry per role: each kept role's row in
# the pointer table and its block maxima's row (KernelSpec.rows; None where not kept), its 8-bit code
# table's number (table) and whether it stays bf16 beside 8-bit codes (half). A tuple per field, not a tuple
# of records: Triton before 3.9 loses the field names of a record taken from a constexpr tuple.
Slots = namedtuple("Slots", "row absmax table half")


@functools.lru_cache(maxsize=None)
def _variant(spec, flags):
    """The constexpr arguments of ``step_kernel`` that ``spec`` and its feature ``flags`` (a tuple of
    (name, bool) in the spec's order) give: the algorithm's functions, its scalars' positions in a
    row (K) and its flags (F) by name, and the pointer-table rows of param, grad and each state."""
    algorithm = ALGORITHMS.get(spec.name)
    if algorithm is None:
        raise ValueError(f"no Triton kernel for {spec.name!r}")
    if spec.reduced and algorithm.second_moments is None:
        raise ValueError(f"the Triton functions of {spec.name!r} lack the second moments of {spec.reduced}")
    flags, rows = dict(flags), spec.rows
    kept = spec.kept(flags)

    def slots(roles):
        roles = [role if role.name in kept else None for role in roles]

        def field(value):
            return tuple(None if role is None else value(role) for role in roles)
        return Slots(field(lambda role: rows.index(role.name)), field(lambda role: rows.index(role.name + ABSMAX)),
                     field(lambda role: blockwise8.TABLES[role.codes].table), field(lambda role: role.half))

    scalars = namedtuple(f"{spec.name}_scalars", spec.all_scalars)
    feature_flags = namedtuple(f"{spec.name}_flags", spec.flags)
    return dict(TERMS=algorithm.terms, SECOND_MOMENTS=algorithm.second_moments, STEP_SCALE=algorithm.step_scale,
                UPDATE=algorithm.update, K=scalars(*range(len(spec.all_scalars))),
                F=feature_flags(*(flags[name] for name in spec.flags)), PARAM=rows.index("param"),
                GRAD=rows.index("grad"), REMAINDER_ROW=rows.index(REMAINDER),
                STATES=slots([role for role in spec.roles if not role.reduced]),
                MOMENTS=slots([role for role in spec.roles if role.reduced]))


def _options(spec, param_dtype, state_dtype, stochastic, subsets, flags, remainder_bits=0):
    """The compile-time arguments of a kernel variant (``flags``: name to bool, a missing one off;
    ``remainder_bits``: 8 or 16 for bf16 params beside master remainders, else 0)."""
    flags = flags or {}
    unknown = set(flags) - set(spec.flags)
    if unknown:
        raise ValueError(f"kernel spec {spec.name!r} has no flags {sorted(unknown)}")
    variant = _variant(spec, tuple((name, bool(flags.get(name, False))) for name in spec.flags))
    rounding = {8: REMAINDER8, 16: REMAINDER16}[remainder_bits] if remainder_bits else (
        STOCHASTIC if stochastic else NEAREST)
    return variant | dict(PARAM_TYPE=TYPES[param_dtype], GRAD_TYPE=GRAD_TYPES.get(spec.grad, TYPES[param_dtype]),
                          STATE_TYPE=TYPES[state_dtype], ROUNDING=rounding,
                          SUBSETS=bool(subsets) and bool(spec.reduced))


def launch(spec, pointers, n_tensors, work, scalars, param_dtype, state_dtype, *, stochastic=False, subsets=False,
           flags=None, remainder_bits=0):
    """Run ``spec``'s algorithm with one program per row of ``work`` (device tensors, see the module
    docstring); ``scalars`` holds one row per tensor, or one shared row. ``flags``: the spec's
    feature flags (name: bool; a missing one is off). ``remainder_bits``: 8 or 16 where the bf16
    params keep master remainders (their row: the table's last)."""
    options = _options(spec, param_dtype, state_dtype, stochastic, subsets, flags, remainder_bits)
    step_kernel[(len(work),)](pointers, n_tensors, work, scalars, int(scalars.shape[0] > 1), **options,
                              num_warps=NUM_WARPS)


def compile_for(capability, spec, param_dtype, state_dtype, *, stochastic=False, subsets=False, flags=None,
                remainder_bits=0):
    """Compile a kernel variant ahead of time for a CUDA GPU of compute ``capability`` (80: A100,
    90: H100), with no GPU present: its ``asm`` holds the PTX and the cubin."""
    from triton.backends.compiler import GPUTarget

    options = _options(spec, param_dtype, state_dtype, stochastic, subsets, flags, remainder_bits)
    signature = dict(pointers="*i64", n_tensors="i32", work="*i64", scalars="*fp32", scalar_stride="i32")
    source = triton.compiler.ASTSource(fn=step_kernel, signature=signature | dict.fromkeys(options, "constexpr"),
                                       constexprs=options)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=NUM_WARPS))


def quantize(values: torch.Tensor, table: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' quantizer on a contiguous fp32 tensor, in code table number ``table``
    (``blockwise8.Codes.table``): (uint8 codes, absmax), as ``blockwise8.quantize`` computes them."""
    codes = torch.empty(values.shape, dtype=torch.uint8, device=values.device)
    absmax = torch.empty(blockwise8.n_blocks(values.numel()), device=values.device)
    _blocks_kernel[(len(absmax),)](values, codes, absmax, values.numel(), TABLE=table, QUANTIZE=True)
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, table: int) -> torch.Tensor:
    """The kernels' dequantizer of code table number ``table``, as ``blockwise8.dequantize`` computes it."""
    values = torch.empty(codes.shape, device=codes.device)
    _blocks_kernel[(len(absmax),)](values, codes, absmax, codes.numel(), TABLE=table, QUANTIZE=False)
    return values
