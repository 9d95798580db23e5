"""The foreach engine (``foreach=True, fused=False``): ``torch._foreach_*`` over slices of a bucket.

A slice holds at most ``CHUNK_NUMEL`` elements (or one larger tensor), so the one scratch buffer the
math needs never exceeds that, however large the model: official Adan's foreach path holds two
temporaries the size of all parameters.
"""
import torch

from .ops import FOREACH_OPS, round_into

CHUNK_NUMEL = 1 << 22


def slices(tensors, limit=CHUNK_NUMEL):
    """Consecutive ``slice`` objects over ``tensors`` whose element counts sum to at most ``limit``."""
    start, total = 0, 0
    for i, tensor in enumerate(tensors):
        if i > start and total + tensor.numel() > limit:
            yield slice(start, i)
            start, total = i, 0
        total += tensor.numel()
    if start < len(tensors):
        yield slice(start, len(tensors))


def run(algorithm, plan):
    for part in slices(plan.tensors["param"]):
        tensors = {role: tensors[part] for role, tensors in plan.tensors.items()}
        params = tensors["param"]
        low_precision = params[0].dtype != torch.float32
        if low_precision:  # buckets share one dtype; the math is fp32
            tensors["param"] = [p.float() for p in params]
            tensors["grad"] = [g.float() for g in tensors["grad"]]
        args = {
            name: list(value[part].unbind()) if name in plan.per_tensor else value
            for name, value in plan.args.items()
        }
        scratch = [torch.empty_like(p) for p in tensors["param"]]
        algorithm.update(FOREACH_OPS, scratch=scratch, **tensors, **args)
        if low_precision and plan.stochastic_rounding:
            for param, result in zip(params, tensors["param"]):
                round_into(param, result, stochastic=True)
        elif low_precision:
            torch._foreach_copy_(params, tensors["param"])
