"""The foreach engine (``foreach=True, fused=False``): ``torch._foreach_*`` over slices of a bucket.

A slice holds at most ``SLICE_NUMEL`` elements: a larger contiguous tensor is cut into flat views
of that size first. So the one scratch buffer the math needs (and, for bf16 or fp16 params, the fp32
copies of param and grad) never exceeds it, however large the model: official Adan's foreach path
holds two temporaries the size of all parameters. Math that needs each tensor whole (Muon's
matrices, batched by shape) takes slices of ``MATRIX_SLICE_NUMEL``: on a GPU, each batch of
iterations costs a few launches whatever its size, so a slice must hold many matrices.
"""
import torch

from ..states import formats, master
from . import lowbit
from .ops import FOREACH_OPS, LOW_PRECISION, widened, write_back

SLICE_NUMEL = 1 << 22
MATRIX_SLICE_NUMEL = 1 << 24


def slice_numel(spec):
    """The elements a slice of ``spec``'s math holds at most."""
    return SLICE_NUMEL if spec.elementwise else MATRIX_SLICE_NUMEL


def slices(tensors, limit=SLICE_NUMEL):
    """Consecutive ``slice`` objects over ``tensors`` whose element counts sum to at most ``limit``."""
    start, total = 0, 0
    for i, tensor in enumerate(tensors):
        if i > start and total + tensor.numel() > limit:
            yield slice(start, i)
            start, total = i, 0
        total += tensor.numel()
    if start < len(tensors):
        yield slice(start, len(tensors))


def pieces(plan, limit=SLICE_NUMEL):
    """``plan`` with every tensor above ``limit`` elements cut into views of at most about
    ``limit``: flat ones when all its roles are contiguous tensors of its size, else runs along
    the first dimension when all its roles share it (a subset-norm view and its second moment).
    Others stay whole, and all do where the math needs each tensor whole (not ``elementwise``)."""
    if not plan.spec.elementwise:
        return plan
    owners, cut, cut_absmax = [], {role: [] for role in plan.tensors}, {role: [] for role in plan.absmax}
    for i, param in enumerate(plan.tensors["param"]):
        group = [tensors[i] for tensors in plan.tensors.values()]
        eight_bit = any(values[i] is not None for values in plan.absmax.values())
        n = -(-param.numel() // limit)
        if n > 1 and all(t.is_contiguous() and t.numel() == param.numel() for t in group):
            for role, tensors in plan.tensors.items():
                cut[role] += tensors[i].view(-1).split(limit)
            for role, values in plan.absmax.items():  # limit is a whole number of 8-bit blocks
                cut_absmax[role] += [None] * n if values[i] is None else values[i].split(limit // formats.Q8.block)
        elif (n > 1 and not eight_bit and param.dim() and param.shape[0] > 1
              and all(t.shape[:1] == param.shape[:1] for t in group)):
            rows = max(1, param.shape[0] * limit // param.numel())
            for role, tensors in plan.tensors.items():
                cut[role] += tensors[i].split(rows)
            n = -(-param.shape[0] // rows)
            for role, values in plan.absmax.items():
                cut_absmax[role] += [None] * n
        else:
            n = 1
            for role, tensors in plan.tensors.items():
                cut[role].append(tensors[i])
            for role, values in plan.absmax.items():
                cut_absmax[role].append(values[i])
        owners += [i] * n
    if len(owners) == len(plan):
        return plan
    return plan.cut(owners, cut, cut_absmax)


def run(plan):
    limit = slice_numel(plan.spec)
    plan = pieces(plan, limit)
    for part in slices(plan.tensors["param"], limit):
        tensors = {role: tensors[part] for role, tensors in plan.tensors.items()}
        params, remainders = tensors["param"], tensors.pop(master.KEY, None)
        low_precision = params[0].dtype in LOW_PRECISION
        if low_precision:  # buckets share one dtype; the math is fp32
            tensors["param"] = widened(params, remainders)
            tensors["grad"] = [g.float() for g in tensors["grad"]]
        stored = lowbit.widen(plan.spec, tensors, {role: values[part] for role, values in plan.absmax.items()})
        args = {
            name: list(value[part].unbind()) if name in plan.per_tensor else value
            for name, value in plan.args.items()
        }
        scratch = [torch.empty_like(p) for p in tensors["param"]]
        plan.update(FOREACH_OPS, scratch=scratch, **tensors, **args)
        lowbit.store(plan.spec, tensors, stored)
        if low_precision:
            write_back(params, tensors["param"], remainders, plan.stochastic_rounding)
