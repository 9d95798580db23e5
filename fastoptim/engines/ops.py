"""The in-place vocabulary an optimizer's math is written in.

The same ``update`` function runs on one tensor at a time (``TENSOR_OPS``: Tensor methods) or on
lists of tensors (``FOREACH_OPS``: ``torch._foreach_*``), so the math is stated once.
"""
import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)  # params whose math runs in an fp32 copy
NAMES = ("add_", "addcdiv_", "addcmul_", "copy_", "div_", "lerp_", "mul_", "reciprocal_", "sqrt_", "sub_")


class Ops:
    def __init__(self, functions):
        self.__dict__.update(functions)


def _tensor_maximum_(tensor, other):
    torch.maximum(tensor, other, out=tensor)


TENSOR_OPS = Ops({name: getattr(torch.Tensor, name) for name in NAMES} | {"maximum_": _tensor_maximum_})
FOREACH_OPS = Ops({name: getattr(torch, "_foreach_" + name) for name in NAMES + ("maximum_",)})


def round_into(dst, src, stochastic):
    """Write the fp32 result ``src`` into the low-precision param ``dst``: rounded to nearest even,
    or, for bf16 with ``stochastic``, up with probability equal to the fraction the rounding drops
    (add 16 random low bits, then truncate)."""
    if stochastic and dst.dtype == torch.bfloat16:
        noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device)
        truncated = ((src.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32)
        src = torch.where(src.isnan(), src, truncated)
    dst.copy_(src)
