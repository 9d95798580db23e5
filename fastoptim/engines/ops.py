"""The in-place vocabulary an optimizer's math is written in.

The same ``update`` function runs on one tensor at a time (``TENSOR_OPS``: Tensor methods) or on
lists of tensors (``FOREACH_OPS``: ``torch._foreach_*``), so the math is stated once.
``per_matrix`` runs a function of matrices (Muon's orthogonalization) on each tensor, or on a list
with the tensors of one shape stacked into one batch.
"""
import math
import operator
from collections import defaultdict
from itertools import compress
from operator import attrgetter

import numpy as np
import torch

from .. import distributed
from ..states import master

LOW_PRECISION = (torch.bfloat16, torch.float16)  # params whose math runs in an fp32 copy
NAMES = ("add_", "addcdiv_", "addcmul_", "copy_", "div_", "lerp_", "mul_", "reciprocal_", "sign_", "sqrt_", "sub_")


class Ops:
    def __init__(self, functions):
        self.__dict__.update(functions)


def _tensor_maximum_(tensor, other):
    torch.maximum(tensor, other, out=tensor)


def _tensor_add_squares_(moment, x, value):
    """moment += value · the sum of x² over each subset. Under a subset-norm partition x is viewed
    as (a, b, c) and moment as (a, 1, c) (see ``fastoptim.states.subset_norm``); a moment of x's
    own shape has one subset per element."""
    if moment.shape == x.shape:
        moment.addcmul_(x, x, value=value)
        return
    squares = torch.linalg.vector_norm(x, dim=1, keepdim=True).square_()  # one pass, no x-sized temporary
    if isinstance(value, torch.Tensor):  # a tensor β's: multiplied apart, as a traced add with its alpha is
        moment.add_(squares.mul_(value))
    else:
        moment.add_(squares, alpha=value)


def _foreach_add_squares_(moments, xs, value):
    dense = list(map(operator.eq, map(attrgetter("shape"), moments), map(attrgetter("shape"), xs)))
    if all(dense):
        torch._foreach_addcmul_(moments, xs, xs, value=value)
        return
    # the dense moments in one foreach op too: a traced Tensor.addcmul_ is decomposed into a product and
    # an FMA, which rounds otherwise than the eager kernel (helper-79), where the foreach op stays itself
    if any(dense):
        dense_xs = list(compress(xs, dense))
        torch._foreach_addcmul_(list(compress(moments, dense)), dense_xs, dense_xs, value=value)
    for moment, x, whole in zip(moments, xs, dense):  # the subset norms, one reduction per tensor
        if not whole:
            _tensor_add_squares_(moment, x, value)


def _tensor_per_matrix(function, x, shape_of):
    """``function`` (of a batch of matrices, ``(n, ..., rows, cols)``) of ``x`` taken as the
    matrices ``shape_of(x.shape)``, as a batch of one; the result in ``x``'s shape. Reshaped, not
    viewed: a channels_last conv weight is the same matrix, in a copy."""
    return function(x.reshape(1, *shape_of(x.shape)))[0].reshape(x.shape)


def _foreach_per_matrix(function, xs, shape_of):
    """The same for a list: the tensors of one matrix shape are stacked into one batch."""
    results, by_shape = [None] * len(xs), defaultdict(list)
    for i, x in enumerate(xs):
        by_shape[tuple(shape_of(x.shape))].append(i)
    for shape, indices in by_shape.items():
        batch = function(torch.stack([xs[i].reshape(shape) for i in indices]))
        for i, result in zip(indices, batch.unbind()):
            results[i] = result.reshape(xs[i].shape)
    return results


def _tensor_method(name):
    """``Tensor.<name>`` as a plain function: dynamo before torch 2.13 cannot trace a method
    descriptor kept in an object's ``__dict__``."""
    def method(tensor, *args, **kwargs):
        return getattr(tensor, name)(*args, **kwargs)
    method.__name__ = name
    return method


TENSOR_OPS = Ops({name: _tensor_method(name) for name in NAMES}
                 | {"maximum_": _tensor_maximum_, "add_squares_": _tensor_add_squares_, "empty_like": torch.empty_like,
                    "per_matrix": _tensor_per_matrix})
FOREACH_OPS = Ops({name: getattr(torch, "_foreach_" + name) for name in NAMES + ("maximum_",)}
                  | {"add_squares_": _foreach_add_squares_, "per_matrix": _foreach_per_matrix,
                     "empty_like": lambda tensors: [torch.empty_like(t) for t in tensors]})


def summing_over(group):
    """``TENSOR_OPS`` whose subset sums are all-reduced over ``group`` before they are added: for
    subsets whose elements several ranks hold (each adds its part of the sum)."""
    def add_squares_(moment, x, value):
        sums = torch.linalg.vector_norm(x, dim=1, keepdim=True).square_()
        moment.add_(distributed.sum_over(sums, group), alpha=value)
    return Ops(vars(TENSOR_OPS) | {"add_squares_": add_squares_})


def round_into(dst, src, stochastic):
    """Write the fp32 result ``src`` into the low-precision param ``dst``: rounded to nearest even,
    or, for bf16 with ``stochastic``, up with probability equal to the fraction the rounding drops
    (add 16 random low bits, then truncate)."""
    if stochastic and dst.dtype == torch.bfloat16:
        noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device)
        truncated = ((src.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32)
        src = torch.where(src.isnan(), src, truncated)
    dst.copy_(src)


def widened(params, remainders):
    """fp32 working copies of low-precision ``params``, with their master remainders where they keep
    them (``remainders``: one per param, or None; see fastoptim.states.master)."""
    return [p.float() for p in params] if remainders is None else list(map(master.widen, params, remainders))


def write_back(params, results, remainders, stochastic):
    """The fp32 ``results`` into their low-precision ``params``: split between each param and its
    remainder where they keep them, else rounded as :func:`round_into` rounds."""
    if remainders is not None:
        for param, remainder, result in zip(params, remainders, results):
            master.store(param, remainder, result)
    elif stochastic:
        for param, result in zip(params, results):
            round_into(param, result, stochastic=True)
    else:
        torch._foreach_copy_(params, results)


def sqrt(x):
    """The square root of a tensor or a Python float (``math.sqrt``), correctly rounded, as the native
    rules' C ``sqrt`` rounds it. A CPU tensor of several elements goes through numpy, in an op
    (``fastoptim::host_sqrt``, the same on eager and traced steps, whose graph then does not depend on
    dynamo's numpy tracing): torch's CPU sqrt hands it to MKL's vector sqrt, which is not correctly
    rounded (on an AVX-512 Xeon, 0.9% of 100,000 float64 elements and 0.7% of fp32 ones an ulp off;
    tensors of 17 elements exact there), and which wakes MKL's OpenMP threads even for a hundred
    elements, milliseconds a step on a shared machine (AdamW's per-param bias corrections took 2-5 ms
    instead of 10 µs with one of two cores busy)."""
    if not isinstance(x, torch.Tensor):
        return math.sqrt(x)
    if x.device.type != "cpu" or x.dim() == 0:
        return x.sqrt()
    return torch.ops.fastoptim.host_sqrt(x)


def _host_sqrt(x):
    if x.dtype not in (torch.float16, torch.float32, torch.float64) or x.requires_grad:
        raise ValueError(f"fastoptim::host_sqrt: x must be an fp16, fp32 or float64 CPU tensor that does not "
                         f"require grad (numpy's dtypes, in which its sqrt rounds as torch's); got {x.dtype}"
                         + (" requiring grad" if x.requires_grad else ""))
    return torch.from_numpy(np.sqrt(x.numpy()))


_LIBRARY = torch.library.Library("fastoptim", "FRAGMENT")
_LIBRARY.define("host_sqrt(Tensor x) -> Tensor")
_LIBRARY.impl("host_sqrt", _host_sqrt, "CPU")
torch.library.register_fake("fastoptim::host_sqrt", lambda x: x.new_empty(x.shape), lib=_LIBRARY)
