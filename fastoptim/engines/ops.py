"""The in-place vocabulary an optimizer's math is written in.

The same ``update`` function runs on one tensor at a time (``TENSOR_OPS``: Tensor methods) or on
lists of tensors (``FOREACH_OPS``: ``torch._foreach_*``), so the math is stated once.
"""
import torch

NAMES = ("add_", "addcdiv_", "addcmul_", "copy_", "div_", "lerp_", "mul_", "reciprocal_", "sqrt_", "sub_")


class Ops:
    def __init__(self, functions):
        self.__dict__.update(functions)


def _tensor_maximum_(tensor, other):
    torch.maximum(tensor, other, out=tensor)


TENSOR_OPS = Ops({name: getattr(torch.Tensor, name) for name in NAMES} | {"maximum_": _tensor_maximum_})
FOREACH_OPS = Ops({name: getattr(torch, "_foreach_" + name) for name in NAMES + ("maximum_",)})
