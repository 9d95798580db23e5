"""Low-bit states on the loop and foreach engines: the math runs on fp32 working copies of one
piece of the states at a time, which are then stored back. bf16 is rounded to nearest even, and
8-bit is requantized block by block (see fastoptim.states.blockwise8)."""
import torch

from ..states import blockwise8

LOW_BIT = (torch.bfloat16, torch.uint8)


def widen(role, state, absmax):
    """An fp32 working copy of a low-bit state (``absmax``: its block maxima when it is 8-bit)."""
    if state.dtype == torch.uint8:
        return blockwise8.dequantize(state, absmax, blockwise8.codes_for(role))
    return state.float()


def store(role, state, absmax, value):
    """Write the working copy ``value`` back into the low-bit ``state`` (and its block maxima)."""
    if state.dtype == torch.uint8:
        codes, block_max = blockwise8.quantize(value, blockwise8.codes_for(role))
        state.copy_(codes)
        absmax.copy_(block_max)
    else:
        state.copy_(value)


def low_bit_roles(tensors):
    """The state roles among ``tensors`` (role: list of tensors) where some tensor is low-bit."""
    return [role for role, ts in tensors.items()
            if role not in ("param", "grad") and any(t.dtype in LOW_BIT for t in ts)]
