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

Rounding is to the nearest code (a tie goes to the smaller one). Its error on an element x of a
block whose absolute maximum is A is at most the larger of:
- |x| / 16, in the codes' normal range;
- half the table's smallest step times A, below it: A * 2^-18 for signed, A * 2^-34 for unsigned.

A block's largest element comes back exact. Non-finite values are not representable.
"""
import torch

BLOCK = 256
MIN_NUMEL = 4096  # smaller tensors keep 32-bit states: their absmax and bookkeeping would outweigh them


def minifloat_magnitudes(exponent_bits, mantissa_bits):
    """The non-negative values of a mini-float with these field widths (subnormals included, no
    infinities), divided by the largest so that they end at 1, ascending."""
    steps, bias = 1 << mantissa_bits, (1 << exponent_bits) - 1
    values = [fraction / steps * 2.0 ** (1 - bias) for fraction in range(steps)]  # subnormals, and 0
    values += [(1 + fraction / steps) * 2.0 ** (exponent - bias)
               for exponent in range(1, 1 << exponent_bits) for fraction in range(steps)]
    return torch.tensor(values, dtype=torch.float64) / values[-1]


def signed_codes():
    magnitudes = minifloat_magnitudes(4, 3)
    return torch.cat([-magnitudes[1:].flip(0), magnitudes]).float()


SIGNED = signed_codes()
UNSIGNED = minifloat_magnitudes(5, 3).float()


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
    absolute maximum of each block."""
    blocks = blocks_of(tensor.float(), block)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / torch.where(absmax > 0, absmax, 1)[:, None]
    codes = codes.to(tensor.device)
    midpoints = (codes[1:] + codes[:-1]) / 2
    indices = torch.bucketize(scaled, midpoints).to(torch.uint8)
    return indices.view(-1)[:tensor.numel()].view(tensor.shape), absmax


def dequantize(indices, absmax, codes, block=BLOCK):
    """The fp32 tensor that ``indices`` and ``absmax`` stand for (see :func:`quantize`)."""
    values = blocks_of(codes.to(indices.device)[indices.long()], block) * absmax[:, None]
    return values.view(-1)[:indices.numel()].view(indices.shape)
