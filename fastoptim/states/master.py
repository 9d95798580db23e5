"""Compressed master weights for bf16 params (``master_bits``): the fp32 value an optimizer updates
is the bf16 param plus a remainder kept in the param's state under ``master_remainder``.

- 16: no remainder; the fp32 result is rounded into the param (to nearest even, or stochastically).
- 32: a 16-bit remainder, the exact fp32 master. The param holds the master's bits rounded to nearest
  (ties away from zero) into their top half; the signed difference of the two bit patterns lies in
  [-2^15, 2^15) and is the remainder.
- 24: an 8-bit remainder, that difference rounded to its top 8 bits: the master within 2^-8 of the
  param's unit in the last place.

Params of other dtypes keep no remainder: fp32 params are their own master, and fp16's bits do not
split this way (the optimizers refuse fp16 params with ``master_bits`` above 16).
"""
import torch

from ..specs import REMAINDER

KEY = REMAINDER  # the state-dict key, and the role of the kernels' table row
DTYPES = {32: torch.int16, 24: torch.int8}
BITS = (16, 24, 32)
_HALF = 1 << 15  # added to the bits before their top half is taken: rounds to nearest, ties away from zero
_TOP = -(1 << 16)  # the top 16 bits of an int32
_DROPPED = 8  # low bits of the difference that an 8-bit remainder drops


def dtype(param, master_bits):
    """The dtype of ``param``'s remainder under ``master_bits``, or None where it keeps none."""
    return DTYPES.get(master_bits) if param.dtype == torch.bfloat16 else None


def zeros(param, master_bits):
    """The remainder of a bf16 param that is its own master so far, laid out as the param (a
    channels_last param's too: the fused kernels walk them as one)."""
    return torch.zeros_like(param, dtype=DTYPES[master_bits])


def widen(param, remainder):
    """The fp32 master of the bf16 ``param`` and its ``remainder``."""
    low = remainder.to(torch.int32)
    if remainder.dtype == torch.int8:
        low = low << _DROPPED
    return ((param.view(torch.int16).to(torch.int32) << 16) + low).view(torch.float32)


def store(param, remainder, master):
    """Write the fp32 ``master`` into the bf16 ``param`` and its ``remainder``. A NaN goes to the
    param as NaN, with a zero remainder."""
    bits = master.view(torch.int32)
    top = (bits + _HALF) & _TOP
    difference = bits - top
    if remainder.dtype == torch.int8:
        difference = ((difference + (1 << (_DROPPED - 1))) >> _DROPPED).clamp_(max=127)
    nan = master.isnan()
    remainder.copy_(difference.masked_fill_(nan, 0))
    param.copy_(torch.where(nan, master, (top >> 16).to(torch.int16).view(torch.bfloat16)))


def convert(remainder, master_bits):
    """``remainder`` in the format ``master_bits`` keeps (a new tensor), or None for 16."""
    if master_bits == 16:
        return None
    target = DTYPES[master_bits]
    if remainder.dtype == target:
        return remainder.clone()
    if target == torch.int8:  # 16 bits to 8: rounded to the top 8
        return ((remainder.to(torch.int32) + (1 << (_DROPPED - 1))) >> _DROPPED).clamp_(max=127).to(torch.int8)
    return remainder.to(torch.int16) << _DROPPED
