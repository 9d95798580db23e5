"""Gradient norms and clipping with no host sync: the norm and the clip factor stay tensors.

On tensors that a fused backend's clip kernels take (``CLIPS``; the C kernel's: fp32, bf16 or fp16
CPU tensors, dense), the norm is one call per dtype that reads every grad once, parallel over chunks
across all of them, and the scaling is one more. Elsewhere ``torch._foreach_norm`` and ``torch._foreach_mul_`` do the same work.
"""
import math
import operator
import weakref
from collections.abc import Iterable
from itertools import repeat

import torch

from . import distributed
from .engines import backends
from .multi_tensor import buckets


# Params whose grads an optimizer releases (steps and frees in backward: enable_gradient_release), by id,
# which clip_grad_norm_ refuses: after backward they have no grads to clip. (A WeakSet would compare
# tensors with ==.)
RELEASED = weakref.WeakValueDictionary()


def clip_backend(grads):
    """The fused backend whose clip kernels may take ``grads``: plain tensors on a device it runs (its
    kernels check each grad's dtype, device and layout themselves), or None (foreach then)."""
    if not grads or not all(map(operator.is_, map(type, grads), repeat(torch.Tensor))):
        return None
    backend = backends.for_device(grads[0].device)
    return backend if backend.CLIPS and backend.available() else None


def _total(grads, inf, kernel):
    """The sum of squares (or with ``inf`` the largest magnitude) of ``grads``, float64 from the
    kernel where it takes them (``kernel``: the backend whose kernels may, or None): each chunk's
    partial, then the partials added in the grads' order, the one order in which fastoptim sums a
    norm (a bound step's native call sums its grads so); else in the grads' widest dtype from
    ``torch._foreach_norm``, per device."""
    if kernel:
        status, total = kernel.grad_norm_total(grads, inf)
        if status == kernel.TAKEN:
            return total
    wide = widest(grads)
    device, parts = grads[0].device, []
    for bucket in buckets(grads):
        # an empty grad has no largest element: torch's inf norm refuses it, the kernel's maximum skips it (helper-102)
        part = [grads[i] for i in bucket if not inf or grads[i].numel()]
        if not part:
            continue
        # a complex grad's norm is of its magnitudes (as torch's), in its own precision: no real dtype is asked
        norms = torch.stack(torch._foreach_norm(part, math.inf if inf else 2.0,
                                                **({} if part[0].is_complex() else {"dtype": wide}))).to(wide)
        parts.append((norms.max() if inf else norms.square().sum()).to(device, wide, non_blocking=True))
    if not parts:  # every grad empty
        return torch.zeros((), dtype=wide, device=device)
    parts = torch.stack(parts)
    return parts.max() if inf else parts.sum()


def _scale(grads, factor, kernel):
    """Multiply ``grads`` by ``factor`` (a one-element tensor) in place: by the kernel where it takes
    them (no two sharing memory: its threads would race), else by ``torch._foreach_mul_`` per bucket."""
    if (kernel and factor.device.type == "cpu"  # the kernel reads it on the host: the grads are on no other device
            and kernel.scale_grads(grads, factor.to(torch.float32).reshape(())) == kernel.TAKEN):
        return
    for bucket in buckets(grads):
        part = [grads[i] for i in bucket]
        torch._foreach_mul_(part, factor.to(part[0].device))


def _check_grads(op, grads):
    for i, grad in enumerate(grads):
        if grad.layout != torch.strided or not (grad.is_floating_point() or grad.is_complex()):
            raise ValueError(f"fastoptim::{op}: grads[{i}] must be a strided floating-point or complex tensor, got "
                             f"{grad.layout} {grad.dtype}")


def _op_grad_norm_total(grads, inf):
    _check_grads("grad_norm_total", grads)
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return _total(grads, inf, clip_backend(grads)).double()


def _op_scale_grads(grads, factor):
    _check_grads("scale_grads", grads)
    if factor.numel() != 1 or not factor.is_floating_point():
        raise ValueError(f"fastoptim::scale_grads: factor must be a one-element floating-point tensor, got "
                         f"{factor.dtype} of shape {tuple(factor.shape)}")
    if grads:
        _scale(grads, factor, clip_backend(grads))


# The kernels as custom ops, which torch.compile keeps in a traced step (the native ops return status
# codes and write into their arguments, which a trace cannot follow). Called with grads the kernel
# cannot take, they do what torch's foreach ops do.
_LIBRARY = torch.library.Library("fastoptim", "FRAGMENT")
_LIBRARY.define("grad_norm_total(Tensor[] grads, bool inf) -> Tensor")
_LIBRARY.define("scale_grads(Tensor(a!)[] grads, Tensor factor) -> ()")
# the norm and the factor from the sum of squares (or largest magnitude): arithmetic left in a traced
# graph would be a kernel that inductor compiles
_LIBRARY.define("clip_factor(Tensor total, float max_norm, bool inf, ScalarType wide) -> Tensor[]")
def _op_clip_factor(total, max_norm, inf, wide):
    norm = norm_of(total, inf, wide)
    norm = norm.clone() if norm is total else norm  # an op's output may not be its input
    return [norm, coefficient_of(norm, max_norm, CLIP_EPS)]


_LIBRARY.impl("grad_norm_total", _op_grad_norm_total, "CompositeExplicitAutograd")
_LIBRARY.impl("clip_factor", _op_clip_factor, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::clip_factor", _op_clip_factor, lib=_LIBRARY)  # tensor math: fakes run it
_LIBRARY.impl("scale_grads", _op_scale_grads, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::grad_norm_total", lambda grads, inf: torch.empty(
    (), dtype=torch.float64, device=grads[0].device if grads else None), lib=_LIBRARY)
torch.library.register_fake("fastoptim::scale_grads", lambda grads, factor: None, lib=_LIBRARY)


def grad_norm(grads, norm_type=2.0, group=None, kernel=None, wide=None, traced=False):
    """The ``norm_type``-norm (2 or inf) over every tensor in ``grads``, as a 0-d tensor on the first
    grad's device: float64 where a grad is float64 (as torch's), else fp32 (``wide``: that dtype,
    where the caller knows it: reading every grad's dtype costs 0.1 µs each), by the kernel where it
    takes the grads (``kernel``: the backend, ``clip_backend(grads)``; None: decided here) in
    fastoptim's one order of a norm's sum (see ``_total``). ``group``: a process group whose ranks hold the rest of
    the grads (each exactly once); the norm is then theirs all together, and every rank of it must
    call this, with grads or none. ``traced``: in a step that torch.compile traces, where the kernel's
    sum is its op."""
    inf, wide = norm_type == math.inf, widest(grads) if wide is None else wide
    # not bool(grads): dynamo before torch 2.13 cannot trace bool() of a list
    kernel = (clip_backend(grads) if kernel is None else kernel) if len(grads) > 0 else None
    if kernel and traced:
        total = torch.ops.fastoptim.grad_norm_total(grads, inf)
    elif grads:
        total = _total(grads, inf, kernel)
    else:
        total = torch.zeros((), dtype=torch.float64)
    if group is not None:  # one dtype on every rank, whichever way each one reduced
        total = distributed.sum_over(total.double(), group, "max" if inf else "sum")
    return norm_of(total, inf, wide)


def widest(grads):
    """The dtype of a norm of ``grads``: float64 where a grad is float64 or complex128 (as torch's), else fp32."""
    return torch.float64 if any(g.dtype in (torch.float64, torch.complex128) for g in grads) else torch.float32


def norm_of(total, inf, wide):
    """The norm, in dtype ``wide``, whose sum of squares (or with ``inf`` largest magnitude) is ``total``."""
    return (total if inf else total.sqrt()).to(wide)


CLIP_EPS = 1e-6  # torch's clip_grad_norm_ divides by norm + 1e-6


def clip_coefficient(grads, max_norm, eps, inv_scale=None, group=None, wide=None, traced=False):
    """``min(1, max_norm / (norm + eps))``, the factor official Adan scales every gradient by.
    ``inv_scale`` (GradScaler's 1/scale, a tensor) unscales the norm of still-scaled grads; ``group``
    (see :func:`grad_norm`) makes the norm global; ``wide`` and ``traced``: see :func:`grad_norm`."""
    return coefficient_of(grad_norm(grads, group=group, wide=wide, traced=traced), max_norm, eps, inv_scale)


def coefficient_of(norm, max_norm, eps, inv_scale=None):
    """:func:`clip_coefficient` of grads whose 2-norm is ``norm``. A bound step's native call computes
    it too (native.cpp's clip_coefficient): the same fp32 operations in the same order."""
    if inv_scale is not None:
        norm = norm * inv_scale
    return (max_norm / (norm + eps)).clamp(max=1.0)


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, with the same arguments and results: scales the grads of
    ``parameters`` in place by ``min(1, max_norm / (norm + 1e-6))`` and returns the total norm.

    Norm types 2 and inf on plain tensors take the fused kernel (CPU) or foreach; ``foreach=False``,
    other norm types and DTensors (FSDP2, where torch's norm is global over the mesh) take torch's own.
    There is no host sync, unless ``error_if_nonfinite`` asks for one.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped (those without
            one are skipped).
        max_norm: the largest total norm left after clipping, a number >= 0.
        norm_type: 2 or inf on the fast paths; any other goes to torch's function.
        error_if_nonfinite: raise if the total norm is NaN or infinite (one host sync, as torch's).
        foreach: False takes torch's function; None or True the kernel or foreach ops.

    Returns:
        The total norm of the grads before clipping, as a 0-d tensor (float64 where a grad is
        float64, else fp32; torch's, in the grads' dtype, where torch's function takes them).
    """
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if RELEASED and any(RELEASED.get(id(param)) is param for param in parameters):
        raise RuntimeError("fastoptim: gradient release stepped these params and freed their grads in backward, "
                           "so there are none to clip; remove the release handle to clip")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be a non-negative number, not {max_norm}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if norm_type not in (2.0, math.inf) or foreach is False or any(type(g) is not torch.Tensor for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return torch.tensor(0.0)
    kernel = clip_backend(grads)
    traced = kernel and torch.compiler.is_compiling()
    if traced:
        inf = norm_type == math.inf
        norm, factor = torch.ops.fastoptim.clip_factor(torch.ops.fastoptim.grad_norm_total(grads, inf), max_norm,
                                                       inf, widest(grads))
    else:
        norm = grad_norm(grads, norm_type, kernel=kernel)
        factor = coefficient_of(norm, max_norm, CLIP_EPS)
    if error_if_nonfinite and not torch.isfinite(norm):  # a host sync, as in torch: only when asked for
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {norm.item()}, so it "
                           "cannot be clipped; with error_if_nonfinite=False the grads are scaled by it anyway")
    if traced:
        torch.ops.fastoptim.scale_grads(grads, factor)
    else:
        _scale(grads, factor, kernel)
    return norm
