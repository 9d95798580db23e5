"""8-bit blockwise states: the readable reference for quantizing an optimizer state to one byte per
element.

A state tensor is cut, in its row-major order, into blocks of ``BLOCK`` elements. Each block keeps
its absolute maximum A as one fp32 number, and each element keeps the index (uint8) of the code
nearest to ``element / A`` in a fixed table of codes. The index stands for ``code * A``. A role picks
its table (``fastoptim.specs.Role.codes``; ``TABLES`` by name).

Two tables are float-like: the fp16 numbers with 3 mantissa bits (the low 7 of fp16's 10 are zero),
divided by the largest of their table (``top``). So their relative precision is the same across
their range, and magnitude k is the fp16 number whose bits are ``k << 7``: the kernels convert with
fp16 instructions.
- ``SIGNED`` (momenta, differences): magnitudes k = 0..127, fp16's exponents up to 2^0 (top 1.875),
  with a sign, centred on index 127. That is 255 values in [-1, 1]: 0, and magnitudes from about
  2^-18 to 1.
- ``UNSIGNED`` (second moments, which square the gradient's range): all 248 finite ones, k = 0..247
  (top 61440). That is 248 values in [0, 1]: 0, and about 2^-33 to 1. Indices 248..255 are unused.

One is linear: ``LINEAR`` (Muon's momentum) has the magnitudes k = 0..127 themselves (top 127), with
a sign, centred on index 127: 255 values k/127 in [-1, 1], q = round(127·x/A) as in the 8-bit Muon
paper (arXiv 2509.23106). Its step is A/127 everywhere: finer than the float-like tables' |x|/8 for
the block's elements above A/16, which are what Muon's Newton–Schulz iteration sees most, coarser
below, where it flushes |x| < A/254 to 0.

Quantizing multiplies by the block's ``scale = top / A`` (fp32), and rounds ``t = |x| * scale`` to the
nearest magnitude; a tie goes to the larger. Its error on an element x is at most:
- float-like tables: the larger of |x| / 16, in the codes' normal range, and half the table's
  smallest step times A below it: A * 2^-18 for signed, A * 2^-33 for unsigned;
- ``LINEAR``: A / 254.

A block whose scale is not finite (A is 0, or below top / 3.4e38: 5.5e-39 signed, 1.8e-34 unsigned,
3.7e-37 linear) is stored as zeros, with absmax 0. A block's largest element comes back exact, and so
do zeros.

Non-finite values stay inside their element, as they do in an fp32 state. A block's absmax is that of
its finite elements, which are stored as above, and a non-finite element gets an index of its own that
is not a code and decodes to itself, with no absmax: ``UNSIGNED`` keeps +inf at index 248 (fp16's
+inf, 248 << 7) and NaN at 255; ``SIGNED`` and ``LINEAR`` keep NaN at 255, which ±inf is stored as
too. A second moment reaches +inf from a finite gradient (g² overflows), where the fp32 step then
freezes the element (m / √inf = 0), and so does the 8-bit step. A momentum or a difference overflows
only where the second moment does too (Muon's: where the fp32 step's Newton–Schulz input is
non-finite, so its whole matrix turns NaN), and the fp32 step makes the param NaN (inf / inf): so
does NaN.
"""
from dataclasses import dataclass

import torch

from ..specs import CODE_TABLES

BLOCK = 256
MIN_NUMEL = 4096  # smaller tensors keep 32-bit states: their absmax and bookkeeping would outweigh them


def fp16_codes(count):
    """The first ``count`` non-negative fp16 numbers with 3 mantissa bits, ascending, as fp32 (exact)."""
    return (torch.arange(count, dtype=torch.int16, device="cpu") << 7).view(torch.float16).float()


NAN_INDEX = 255  # the index of NaN in every table (and of ±inf in the signed ones)


@dataclass(frozen=True)
class Codes:
    """A code table, number ``table`` in the kernels (``fastoptim.specs.CODE_TABLES``). Index i stands
    for ``values[i] * absmax``; ``values`` are the magnitudes divided by their largest (``top``), so
    they end at 1, and mirrored around index ``zero`` when ``signed``.
    ``midpoints`` lie between consecutive magnitudes (exact in fp32). ``decoded`` maps every index to
    its value before the absmax: ``values``, then the non-finite ones (NaN but at ``inf_index``)."""
    table: int
    values: torch.Tensor
    midpoints: torch.Tensor
    top: float
    zero: int
    signed: bool
    inf_index: int
    decoded: torch.Tensor


def code_table(name, magnitudes, signed):
    """The table ``name`` of ``magnitudes`` (fp32, ascending from 0, with exact midpoints)."""
    top, count = magnitudes[-1], len(magnitudes)
    values = magnitudes * (1 / top)  # by a reciprocal, as the kernels dequantize: it ends at 1 exactly
    if signed:
        values = torch.cat([-values[1:].flip(0), values])
    inf_index = NAN_INDEX if signed else count
    decoded = torch.cat([values, torch.full((256 - len(values),), float("nan"), device="cpu")])
    if not signed:
        decoded[inf_index] = float("inf")
    return Codes(CODE_TABLES.index(name), values, (magnitudes[1:] + magnitudes[:-1]) / 2, top.item(),
                 count - 1 if signed else 0, signed, inf_index, decoded)


SIGNED = code_table("signed", fp16_codes(128), signed=True)
UNSIGNED = code_table("unsigned", fp16_codes(248), signed=False)
LINEAR = code_table("linear", torch.arange(128, dtype=torch.float32), signed=True)
TABLES = {"signed": SIGNED, "unsigned": UNSIGNED, "linear": LINEAR}


def blocks_of(tensor, block=BLOCK):
    """The tensor's elements in row-major order as (blocks, block), the last block padded with zeros."""
    flat = tensor.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)


def n_blocks(numel):
    return -(-numel // BLOCK)


def quantize(tensor, codes, block=BLOCK):
    """(indices, absmax): uint8 indices of the nearest codes in ``tensor``'s shape, and the fp32
    absolute maximum of each block's finite elements. The nearest magnitude is found for
    ``t = |x| * (top / absmax)``, against midpoints that are exact; a tie goes to the larger
    magnitude. Non-finite elements get their own indices (see the module's docstring)."""
    blocks = blocks_of(tensor.float(), block)
    finite = blocks.isfinite()
    magnitudes = torch.where(finite, blocks.abs(), 0)
    absmax = magnitudes.amax(dim=1)
    scale = absmax.new_tensor(codes.top) / absmax  # a division: torch takes number / tensor as reciprocal · number
    stored = scale.isfinite()  # the other blocks are stored as zeros
    absmax, scale = torch.where(stored, absmax, 0), torch.where(stored, scale, 0)
    t = magnitudes * scale[:, None]
    magnitude = torch.bucketize(t, codes.midpoints.to(tensor.device), right=True)
    indices = codes.zero + torch.where(blocks < 0, -magnitude, magnitude)
    indices = torch.where(finite, indices, torch.where(blocks == float("inf"), codes.inf_index, NAN_INDEX))
    return indices.to(torch.uint8).view(-1)[:tensor.numel()].view(tensor.shape), absmax


def dequantize(indices, absmax, codes, block=BLOCK):
    """The fp32 tensor that ``indices`` and ``absmax`` stand for (see :func:`quantize`)."""
    decoded = blocks_of(codes.decoded.to(indices.device)[indices.long()], block)
    values = torch.where(decoded.isfinite(), decoded * absmax[:, None], decoded)
    return values.view(-1)[:indices.numel()].view(indices.shape)
