"""8-bit blockwise states: the readable reference for quantizing an optimizer state to one byte per
element.

A state tensor is cut, in its row-major order, into blocks of ``BLOCK`` elements. Each block keeps
its absolute maximum as one fp32 number, and each element keeps the index (uint8) of the code nearest
to ``element / absmax`` in a fixed table of non-linear codes. The index stands for ``code * absmax``.

The code tables are 8-bit mini-floats, so their relative precision is the same across their range:
- ``SIGNED`` (momenta, differences): a sign bit and a mini-float with 4 exponent and 3 mantissa
  bits. That is 255 values in [-1, 1]: 0, and magnitudes from about 2^-18 to 1.
- ``UNSIGNED`` (second moments, which square the gradient's range): 5 exponent and 3 mantissa bits.
  That is 256 values in [0, 1]: 0, and about 2^-34 to 1.

Rounding is to the nearest code (a tie goes to the smaller magnitude). Its error on an element x of a
block whose absolute maximum is A is at most the larger of:
- |x| / 16, in the codes' normal range;
- half the table's smallest step times A, below it: A * 2^-18 for signed, A * 2^-34 for unsigned.

A block's largest element comes back exact. Non-finite values are not representable.
"""
from dataclasses import dataclass

import torch

BLOCK = 256
MIN_NUMEL = 4096  # smaller tensors keep 32-bit states: their absmax and bookkeeping would outweigh them


def minifloats(exponent_bits, mantissa_bits=3):
    """The non-negative values of a mini-float with these field widths (subnormals included, no
    infinities), ascending, as fp32 (they are exact in it). Its largest is 2 - 2^-mantissa_bits."""
    steps, bias = 1 << mantissa_bits, (1 << exponent_bits) - 1
    values = [fraction / steps * 2.0 ** (1 - bias) for fraction in range(steps)]  # subnormals, and 0
    values += [(1 + fraction / steps) * 2.0 ** (exponent - bias)
               for exponent in range(1, 1 << exponent_bits) for fraction in range(steps)]
    return torch.tensor(values, dtype=torch.float32)


@dataclass(frozen=True)
class Codes:
    """A code table. Index i stands for ``values[i] * absmax``; ``values`` are the mini-float's values
    divided by its largest (``top``), so they end at 1, and mirrored around index ``zero`` when
    ``signed``. ``midpoints`` lie between consecutive mini-float magnitudes (exact in fp32)."""
    values: torch.Tensor
    midpoints: torch.Tensor
    top: float
    zero: int
    signed: bool


def code_table(exponent_bits, signed):
    magnitudes = minifloats(exponent_bits)
    top = magnitudes[-1]
    values = magnitudes * (1 / top)  # by a reciprocal, as the C kernels dequantize: it ends at 1 exactly
    if signed:
        values = torch.cat([-values[1:].flip(0), values])
    return Codes(values, (magnitudes[1:] + magnitudes[:-1]) / 2, top.item(), len(magnitudes) - 1 if signed else 0,
                 signed)


SIGNED_EXPONENT_BITS, UNSIGNED_EXPONENT_BITS = 4, 5  # both with 3 mantissa bits, as fused_cpu.c assumes
SIGNED = code_table(SIGNED_EXPONENT_BITS, signed=True)
UNSIGNED = code_table(UNSIGNED_EXPONENT_BITS, signed=False)


def codes_for(role):
    """The table of a state role: unsigned for second moments (``exp_avg_sq``, ``max_exp_avg_sq``),
    signed for the rest."""
    return UNSIGNED if role.endswith("exp_avg_sq") else SIGNED


def blocks_of(tensor, block=BLOCK):
    """The tensor's elements in row-major order as (blocks, block), the last block padded with zeros."""
    flat = tensor.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)


def n_blocks(numel):
    return -(-numel // BLOCK)


def quantize(tensor, codes, block=BLOCK):
    """(indices, absmax): uint8 indices of the nearest codes in ``tensor``'s shape, and the fp32
    absolute maximum of each block. The nearest code to ``x / absmax`` is found on the mini-float's
    own scale, ``|x / absmax| * top``, whose midpoints are exact; a tie goes to the smaller magnitude."""
    blocks = blocks_of(tensor.float(), block)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / torch.where(absmax > 0, absmax, 1)[:, None]
    magnitude = torch.bucketize(scaled.abs() * codes.top, codes.midpoints.to(tensor.device))
    indices = codes.zero + torch.where(scaled < 0, -magnitude, magnitude)
    return indices.to(torch.uint8).view(-1)[:tensor.numel()].view(tensor.shape), absmax


def dequantize(indices, absmax, codes, block=BLOCK):
    """The fp32 tensor that ``indices`` and ``absmax`` stand for (see :func:`quantize`)."""
    values = blocks_of(codes.values.to(indices.device)[indices.long()], block) * absmax[:, None]
    return values.view(-1)[:indices.numel()].view(indices.shape)
