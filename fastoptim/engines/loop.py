"""The loop engine (``foreach=False, fused=False``): the readable reference, one tensor at a time."""
import torch

from .ops import LOW_PRECISION, TENSOR_OPS, round_into


def run(algorithm, plan):
    for i in range(len(plan)):
        tensors = {role: tensors[i] for role, tensors in plan.tensors.items()}
        param = tensors["param"]
        if param.dtype in LOW_PRECISION:  # the math is fp32; the write-back rounds to nearest even
            tensors["param"], tensors["grad"] = param.float(), tensors["grad"].float()
        args = {name: value[i] if name in plan.per_tensor else value for name, value in plan.args.items()}
        algorithm.update(TENSOR_OPS, scratch=torch.empty_like(tensors["param"]), **tensors, **args)
        if tensors["param"] is not param:
            round_into(param, tensors["param"], plan.stochastic_rounding)
