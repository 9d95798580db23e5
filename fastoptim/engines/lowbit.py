"""Low-bit states on the loop and foreach engines: the math runs on fp32 working copies of one
piece of the states at a time, which their formats then store back (bf16 to nearest even, 8-bit
requantized block by block; see fastoptim.states.formats)."""
from ..specs import ABSMAX
from ..states import formats


def widen(spec, tensors, absmax):
    """Replace the low-bit states among ``tensors`` (role: list of tensors; ``absmax``: role: the
    8-bit ones' block maxima) by fp32 working copies, in place; returns what :func:`store` needs."""
    stored = []
    for role in spec.states:
        if role not in tensors:
            continue
        copies = list(tensors[role])
        for k, state in enumerate(tensors[role]):
            state_format = formats.of(state)
            if state_format is not None and state_format.low_bit:  # small tensors keep fp32 under state_bits=8
                companions = {ABSMAX: absmax[role][k]} if role in absmax else {}
                copies[k] = state_format.widen(spec.role(role), state, companions)
                stored.append((role, k, state_format, state, companions))
        tensors[role] = copies
    return stored


def store(spec, tensors, stored):
    """Write the working copies in ``tensors`` back into the states :func:`widen` replaced."""
    for role, k, state_format, state, companions in stored:
        state_format.store(spec.role(role), state, companions, tensors[role][k])
