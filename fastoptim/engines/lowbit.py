"""Low-bit states on the loop and foreach engines: the math runs on fp32 working copies of one
piece of the states at a time, which their formats then store back (bf16 to nearest even, 8-bit
requantized block by block; see fastoptim.states.formats). A role whose 8-bit codes round
stochastically (``Role.stochastic``) draws them from one seed per run, as the fused kernels draw
one per launch (fastoptim.engines.fused.kernel_values), with the kernels' bits (fastoptim.states.
blockwise8.quantize)."""
import torch

from ..specs import ABSMAX
from ..states import formats


def draws_seed(spec, absmax):
    """Whether states with block maxima ``absmax`` (role: one per tensor, None where not 8-bit) of
    ``spec`` have codes that round stochastically (so their step needs a seed)."""
    return any(values is not None for role in spec.stochastic for values in absmax.get(role, ()))


def seed(spec, absmax, device):
    """The run's seed of stochastic codes, drawn as the fused kernels' (0-d, no host sync), or None."""
    return torch.randint(1 << 24, (), device=device) if draws_seed(spec, absmax) else None


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


def store(spec, tensors, stored, step_seed=None):
    """Write the working copies in ``tensors`` back into the states :func:`widen` replaced; the codes
    of stochastic roles with the bits of ``step_seed`` (see :func:`seed`)."""
    for role, k, state_format, state, companions in stored:
        if step_seed is not None and state_format is formats.Q8 and spec.role(role).stochastic:
            state_format.store(spec.role(role), state, companions, tensors[role][k],
                               (step_seed, spec.rows.index(role)))
        else:
            state_format.store(spec.role(role), state, companions, tensors[role][k])
