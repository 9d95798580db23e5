"""8-bit blockwise states: the readable reference for quantizing an optimizer state to one byte per
element.

A state tensor is cut, in its row-major order, into blocks of ``BLOCK`` elements. Each block keeps
its absolute maximum A as one fp32 number, and each element keeps the index (uint8) of the code
nearest to ``element / A`` in a fixed table of non-linear codes. The index stands for ``code * A``.

The codes are the fp16 numbers with 3 mantissa bits (the low 7 of fp16's 10 are zero), divided by
the largest of their table (``top``). So their relative precision is the same across their range, and
magnitude k is the fp16 number whose bits are ``k << 7``: the kernels convert with fp16 instructions.
- ``SIGNED`` (momenta, differences): magnitudes k = 0..127, fp16's exponents up to 2^0 (top 1.875),
  with a sign, centred on index 127. That is 255 values in [-1, 1]: 0, and magnitudes from about
  2^-18 to 1.
- ``UNSIGNED`` (second moments, which square the gradient's range): all 248 finite ones, k = 0..247
  (top 61440). That is 248 values in [0, 1]: 0, and about 2^-33 to 1. Indices 248..255 are unused.

Quantizing multiplies by the block's ``scale = top / A`` (fp32), and rounds ``t = |x| * scale`` to the
nearest magnitude; a tie goes to the larger. Its error on an element x is at most the larger of:
- |x| / 16, in the codes' normal range;
- half the table's smallest step times A, below it: A * 2^-18 for signed, A * 2^-33 for unsigned.

Round-to-nearest is biased where a state moves by less than half a code step a step: an average
such as Muon's momentum, B ← B + (1−μ)·(g − B) with μ = 0.95, then never leaves its code. A role
marked ``stochastic`` (fastoptim.specs.Role) rounds its codes stochastically instead: t goes to the
magnitude above it with probability (t − lo) / (hi − lo), lo and hi the magnitudes around it, so
the stored value is the true one on average (unbiased). The random bits are a counter-based hash
(:func:`random_bits`, the kernels' own) of data that every layout of the state agrees on, and of no
seed: the role's salt (:func:`code_salt`), the block's new absmax's fp32 bits and the element's
position in its block. So every engine draws the same bits however it groups the tensors, and so
does every rank of a sharded run whose shards cut the state at block boundaries (a dim-0 shard of
a whole number of blocks, as FSDP2 and HSDP cut them): a sharded run is one process's, and replicas
stay equal, with no RNG to seed alike. The absmax is a continuous function of the step's values that
changes every step (the momentum's largest element moves by (1−μ)·(g − B)), and the hash maps a
change of one ulp in it to unrelated bits: over steps, an element's bits are as if drawn afresh and
independent of the fraction they round (which moves by far more than the absmax's ulp). They repeat
only where a block's absmax comes back with the very same bits, as at an exact fp32 fixed point of
B ← μB + (1−μ)g, which needs the gradient's largest element bit-identical step after step. A
stochastic code's error is below one code step (|x| / 8 in the normal range), twice round-to-nearest's
bound, but with no bias; zeros stay exact, and a block's largest element comes back exact unless it
rounds down (with probability at most 2^-20, where ``|x| · scale`` falls an ulp below ``top``).

A block whose scale is not finite (A is 0, or below top / 3.4e38: 5.5e-39 signed, 1.8e-34 unsigned)
is stored as zeros, with absmax 0. A block's largest element comes back exact, and so do zeros.

Non-finite values stay inside their element, as they do in an fp32 state. A block's absmax is that of
its finite elements, which are stored as above, and a non-finite element gets an index of its own that
is not a code and decodes to itself, with no absmax: ``UNSIGNED`` keeps +inf at index 248 (fp16's
+inf, 248 << 7) and NaN at 255; ``SIGNED`` keeps NaN at 255, which ±inf is stored as too. A second
moment reaches +inf from a finite gradient (g² overflows), where the fp32 step then freezes the
element (m / √inf = 0), and so does the 8-bit step. A momentum or a difference overflows only where
the second moment does too, and the fp32 step makes the param NaN (inf / inf): so does NaN.
"""
from dataclasses import dataclass

import torch

BLOCK = 256
MIN_NUMEL = 4096  # smaller tensors keep 32-bit states: their absmax and bookkeeping would outweigh them


def fp16_codes(count):
    """The first ``count`` non-negative fp16 numbers with 3 mantissa bits, ascending, as fp32 (exact)."""
    return (torch.arange(count, dtype=torch.int16, device="cpu") << 7).view(torch.float16).float()


NAN_INDEX = 255  # the index of NaN in both tables (and of ±inf in the signed one)


MASK32 = 0xFFFFFFFF
CODE_SALT = 0x5BD1E995  # the codes of state row r hash with CODE_SALT · r: not the param's bits
RANDOM_BITS = 20  # of the hash's 32 (its top ones) that a stochastic code compares with its fraction


def random_bits(seed, tensor, index):
    """The kernels' counter-based hash (murmur3's finaliser) of (seed, tensor, element): 32 random
    bits per element of ``index`` (an int64 tensor), as int64. ``seed``: a number or a 0-d integer
    tensor (stochastic codes: their role's salt, :func:`code_salt`); ``tensor``: a number, or a
    tensor that broadcasts with ``index`` (stochastic codes: their block's absmax bits, and ``index``
    the element's position in its block). The arithmetic is modulo 2^32, as the kernels' uint32."""
    seed = torch.as_tensor(seed).to(device=index.device, dtype=torch.int64) & MASK32
    h = seed ^ ((tensor * 0x9E3779B9) & MASK32) ^ ((index * 0x85EBCA6B) & MASK32)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def code_salt(row):
    """The salt of the stochastic codes of the state in pointer-table row ``row`` (the hash's seed)."""
    return (CODE_SALT * row) & MASK32


@dataclass(frozen=True)
class Codes:
    """A code table. Index i stands for ``values[i] * absmax``; ``values`` are the magnitudes divided by
    their largest (``top``), so they end at 1, and mirrored around index ``zero`` when ``signed``.
    ``midpoints`` lie between consecutive magnitudes (exact in fp32). ``decoded`` maps every index to
    its value before the absmax: ``values``, then the non-finite ones (NaN but at ``inf_index``)."""
    values: torch.Tensor
    midpoints: torch.Tensor
    top: float
    zero: int
    signed: bool
    inf_index: int
    decoded: torch.Tensor
    magnitudes: torch.Tensor  # the magnitudes as t measures them (fp16 numbers up to ``top``), ascending


def code_table(count, signed):
    magnitudes = fp16_codes(count)
    top = magnitudes[-1]
    values = magnitudes * (1 / top)  # by a reciprocal, as the kernels dequantize: it ends at 1 exactly
    if signed:
        values = torch.cat([-values[1:].flip(0), values])
    inf_index = NAN_INDEX if signed else count
    decoded = torch.cat([values, torch.full((256 - len(values),), float("nan"), device="cpu")])
    if not signed:
        decoded[inf_index] = float("inf")
    return Codes(values, (magnitudes[1:] + magnitudes[:-1]) / 2, top.item(), count - 1 if signed else 0, signed,
                 inf_index, decoded, magnitudes)


SIGNED = code_table(128, signed=True)
UNSIGNED = code_table(248, signed=False)


def blocks_of(tensor, block=BLOCK):
    """The tensor's elements in row-major order as (blocks, block), the last block padded with zeros."""
    flat = tensor.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)


def n_blocks(numel):
    return -(-numel // BLOCK)


def quantize(tensor, codes, block=BLOCK, salt=None):
    """(indices, absmax): uint8 indices of the nearest codes in ``tensor``'s shape, and the fp32
    absolute maximum of each block's finite elements. The nearest magnitude is found for
    ``t = |x| * (top / absmax)``, against midpoints that are exact; a tie goes to the larger
    magnitude. Non-finite elements get their own indices (see the module's docstring).

    With ``salt`` (a stochastic role's, :func:`code_salt`), the magnitude is rounded stochastically
    instead, with ``random_bits(salt, the block's absmax's fp32 bits, the element's position in its
    block)``: lo, the largest magnitude ≤ t, goes up to the next, hi, where
    ``u < (t − lo) / (hi − lo)``, u the top ``RANDOM_BITS`` bits as a fraction of 1. The fraction is
    exact in fp32 (t − lo and hi − lo are: hi − lo is a power of two, the codes being fp16 numbers),
    so up is taken with probability exactly the fraction in fp16's normal range, where it is a
    multiple of 2^-20, and within 2^-20 of it below; the kernels find lo, and the fraction's bits,
    from t's fp32 bits."""
    blocks = blocks_of(tensor.float(), block)
    finite = blocks.isfinite()
    magnitudes = torch.where(finite, blocks.abs(), 0)
    absmax = magnitudes.amax(dim=1)
    scale = absmax.new_tensor(codes.top) / absmax  # a division: torch takes number / tensor as reciprocal · number
    stored = scale.isfinite()  # the other blocks are stored as zeros
    absmax, scale = torch.where(stored, absmax, 0), torch.where(stored, scale, 0)
    t = magnitudes * scale[:, None]
    if salt is None:
        magnitude = torch.bucketize(t, codes.midpoints.to(tensor.device), right=True)
    else:
        table = codes.magnitudes.to(tensor.device)
        lo = torch.bucketize(t, table, right=True) - 1  # t ≥ 0 = table[0]
        hi = (lo + 1).clamp(max=len(table) - 1)  # t at or past top (a rounding above it) stays at top
        step = table[hi] - table[lo]
        fraction = torch.where(step > 0, (t - table[lo]) / torch.where(step > 0, step, 1), 0)
        index = torch.arange(block, device=tensor.device)  # in the block: a shard's blocks are the whole's
        bits = random_bits(salt, absmax.view(torch.int32).long()[:, None] & MASK32, index)
        u = (bits >> (32 - RANDOM_BITS)).float() * 2.0**-RANDOM_BITS
        magnitude = lo + (u < fraction).long()
    indices = codes.zero + torch.where(blocks < 0, -magnitude, magnitude)
    indices = torch.where(finite, indices, torch.where(blocks == float("inf"), codes.inf_index, NAN_INDEX))
    return indices.to(torch.uint8).view(-1)[:tensor.numel()].view(tensor.shape), absmax


def dequantize(indices, absmax, codes, block=BLOCK):
    """The fp32 tensor that ``indices`` and ``absmax`` stand for (see :func:`quantize`)."""
    decoded = blocks_of(codes.decoded.to(indices.device)[indices.long()], block)
    values = torch.where(decoded.isfinite(), decoded * absmax[:, None], decoded)
    return values.view(-1)[:indices.numel()].view(indices.shape)
