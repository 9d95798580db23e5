"""The loop engine (``foreach=False, fused=False``): the readable reference, one tensor at a time."""
import torch

from ..states import master
from . import lowbit
from .ops import LOW_PRECISION, TENSOR_OPS, summing_over, widened, write_back


def run(plan):
    ops = TENSOR_OPS if plan.sum_group is None else summing_over(plan.sum_group)
    for i in range(len(plan)):
        tensors = {role: tensors[i:i + 1] for role, tensors in plan.tensors.items()}
        param, remainders = tensors["param"][0], tensors.pop(master.KEY, None)
        low_precision = param.dtype in LOW_PRECISION
        if low_precision:  # the math is fp32
            tensors["param"], tensors["grad"] = widened([param], remainders), [tensors["grad"][0].float()]
        stored = lowbit.widen(plan.spec, tensors, {role: values[i:i + 1] for role, values in plan.absmax.items()})
        args = {name: value[i] if name in plan.per_tensor else value for name, value in plan.args.items()}
        plan.update(ops, scratch=torch.empty_like(tensors["param"][0]),
                    **{role: values[0] for role, values in tensors.items()}, **args)
        lowbit.store(plan.spec, tensors, stored)
        if low_precision:
            write_back([param], tensors["param"], remainders, plan.stochastic_rounding)
