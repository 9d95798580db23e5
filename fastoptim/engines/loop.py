"""The loop engine (``foreach=False, fused=False``): the readable reference, one tensor at a time."""
import torch

from ..states import master
from . import lowbit
from .ops import LOW_PRECISION, TENSOR_OPS, round_into, summing_over


def run(plan):
    ops = TENSOR_OPS if plan.sum_group is None else summing_over(plan.sum_group)
    for i in range(len(plan)):
        tensors = {role: tensors[i:i + 1] for role, tensors in plan.tensors.items()}
        param, remainder = tensors["param"][0], tensors.pop(master.KEY, [None])[0]
        if param.dtype in LOW_PRECISION:  # the math is fp32; the write-back rounds to nearest even
            tensors["param"] = [param.float() if remainder is None else master.widen(param, remainder)]
            tensors["grad"] = [tensors["grad"][0].float()]
        stored = lowbit.widen(plan.spec, tensors, {role: values[i:i + 1] for role, values in plan.absmax.items()})
        args = {name: value[i] if name in plan.per_tensor else value for name, value in plan.args.items()}
        plan.update(ops, scratch=torch.empty_like(tensors["param"][0]),
                    **{role: values[0] for role, values in tensors.items()}, **args)
        lowbit.store(plan.spec, tensors, stored)
        if remainder is not None:
            master.store(param, remainder, tensors["param"][0])
        elif tensors["param"][0] is not param:
            round_into(param, tensors["param"][0], plan.stochastic_rounding)
