"""The loop engine (``foreach=False, fused=False``): the readable reference, one tensor at a time."""
import torch

from . import lowbit
from .ops import LOW_PRECISION, TENSOR_OPS, round_into, summing_over


def run(plan):
    ops = TENSOR_OPS if plan.sum_group is None else summing_over(plan.sum_group)
    for i in range(len(plan)):
        tensors = {role: tensors[i] for role, tensors in plan.tensors.items()}
        param = tensors["param"]
        if param.dtype in LOW_PRECISION:  # the math is fp32; the write-back rounds to nearest even
            tensors["param"], tensors["grad"] = param.float(), tensors["grad"].float()
        absmax = {role: values[i] for role, values in plan.absmax.items()}
        stored = {role: tensors[role] for role in lowbit.low_bit_roles({r: [t] for r, t in tensors.items()})}
        for role, state in stored.items():
            tensors[role] = lowbit.widen(role, state, absmax.get(role))
        args = {name: value[i] if name in plan.per_tensor else value for name, value in plan.args.items()}
        plan.update(ops, scratch=torch.empty_like(tensors["param"]), **tensors, **args)
        for role, state in stored.items():
            lowbit.store(role, state, absmax.get(role), tensors[role])
        if tensors["param"] is not param:
            round_into(param, tensors["param"], plan.stochastic_rounding)
