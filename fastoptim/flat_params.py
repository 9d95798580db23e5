"""Flat parameters, an opt-in: a model's params moved into one buffer per device and dtype, and their
grads views of one grad buffer each, at the same offsets (as DDP's ``gradient_as_bucket_view`` keeps
its grads). A fused step over many small tensors then streams through a few long runs of memory
instead of thousands of short ones, which the CPU's prefetchers cannot follow from one to the next
(measured in docs/results/flat-params-2026-11-26.md)."""
import warnings
import weakref
from contextlib import contextmanager
from operator import attrgetter

import torch
from torch import Tensor

from .multi_tensor import aligned_offset, disjoint, is_dense

# Where a param begins in its buffer: on a 16-byte boundary, which GPU kernels' widest loads need. Not
# on the state buffers' 64 (multi_tensor.ALIGNMENT): each param would then lie at its states' offsets,
# and the step measured slower (docs/results/flat-params-2026-11-26.md).
PARAM_ALIGNMENT = 16

# The grad buffers flatten_parameters made, by id (a WeakSet would compare tensors with ==); each
# records how many grads view it, so that a zero_grad over all of them fills it in one call.
GRAD_BUFFERS = weakref.WeakValueDictionary()
REQUIRES_GRAD = attrgetter("requires_grad")


def _refusal(name, param):
    """Why ``param`` (or its grad) cannot live in a flat buffer, or None."""
    if type(param.data) is not Tensor or param.layout != torch.strided or param.is_quantized:
        return f"{name} is a {type(param.data).__name__} of layout {param.layout}, not a plain strided tensor"
    if param.is_meta:
        return f"{name} is on the meta device: it has no values to move"
    if not is_dense(param):
        return f"{name} has strides {param.stride()} that leave gaps or overlap: it cannot be one run of a buffer"
    if param.grad is not None and (type(param.grad) is not Tensor or param.grad.layout != torch.strided):
        return f"{name} has a {param.grad.layout} grad, which a dense view cannot hold: clear it first"
    return None


def flatten_parameters(module: torch.nn.Module, grads: bool = True) -> list[Tensor]:
    """Move the params of ``module`` into one flat buffer per device and dtype, in place.

    Each param keeps its identity (optimizers, hooks and references that hold it still do), its
    values, shape, strides and ``requires_grad``; its data becomes a view of its buffer
    (``param.data = view``), at an offset aligned to 16 bytes (a 0-d param's: anywhere), in the
    order of ``module.parameters()`` (a param shared by several modules once), those that get a
    grad first. With ``grads``, each param that requires grad gets a grad that is a view of one
    grad buffer per device and dtype at the same offset (zeros, or its grad until now), which
    backward then accumulates into in place; the grad buffer spans those params alone.
    fastoptim's ``zero_grad()`` zeroes those grads in place instead of setting them to None, one
    fill per buffer where the optimizer holds all of its grads; ``module.zero_grad()`` (torch's)
    drops them, after which backward makes grads of their own again (correct, without the flat
    layout's speed). A param whose data is later replaced (``param.data = ...``) leaves its buffer;
    a copy of the model (``copy.deepcopy``, a state dict) is not flat. A conversion of the module
    (``module.to(device, dtype)``, ``.double()``, ``.half()``, ``.to(memory_format=...)``) gives the
    params it changes and their grads data of their own: they are then no longer flat, and
    fastoptim's ``zero_grad()`` drops those grads as torch's does, with a warning; flatten after
    converting (or again). A param frozen since (``requires_grad_(False)``) loses its flat grad at
    the next ``step()`` or ``zero_grad()`` (not to a step that raises), so that it is not stepped, as
    torch's ``zero_grad`` leaves an unflattened model's.

    So, with ``grads``, every param that requires grad always has one, zeros where a backward gave
    it none, as after torch's ``zero_grad(set_to_none=False)``: an optimizer steps it (its weight
    decay and momentum apply). For a model whose steps leave some params out (unused branches,
    mixture-of-experts layers), pass ``grads=False``: the params are still flat, and their grads
    come and go as without this.

    Args:
        module: the model; every param must be a plain strided tensor whose elements fill its span
            (contiguous, channels_last, a transpose): nothing changes if one is not.
        grads: also give the params that require grad flat grads (default True).

    Returns:
        The param buffers (1-d), one per device and dtype, in the order of their first params.

    Raises:
        TypeError: ``module`` is no ``torch.nn.Module`` (a list of params, say).
        ValueError: a param is a DTensor, sparse, quantized, on the meta device, or not dense; a
            grad is not a plain strided tensor; or two params share memory.
    """
    if not isinstance(module, torch.nn.Module):  # its params alone cannot be moved: the module holds them
        raise TypeError(f"flatten_parameters takes the model (a torch.nn.Module), not {type(module).__name__}")
    names = {id(param): name for name, param in module.named_parameters()}
    params = list(module.parameters())
    for param in params:
        reason = _refusal(names[id(param)], param)
        if reason:
            raise ValueError(f"fastoptim.flatten_parameters: {reason}")
    if not disjoint(params):  # moved apart, they would no longer be tied
        raise ValueError("fastoptim.flatten_parameters: two params of the module share memory (views of one "
                         "tensor); tie them as one Parameter object instead")
    kinds = {}
    for param in params:  # those with grads first, so that the grad buffer spans them alone
        kinds.setdefault((param.device, param.dtype), []).append(param)
    buffers = []
    with torch.no_grad():
        for (device, dtype), members in kinds.items():
            members.sort(key=lambda param: not (grads and param.requires_grad))  # a stable sort
            offsets, size, grad_size = [], 0, 0
            for param in members:
                offsets.append(aligned_offset(size, param.shape, dtype, PARAM_ALIGNMENT))
                size = offsets[-1] + param.numel()
                grad_size = size if grads and param.requires_grad else grad_size
            buffer = torch.zeros(size, dtype=dtype, device=device)
            grad_buffer = torch.zeros(grad_size, dtype=dtype, device=device) if grad_size else None
            for param, offset in zip(members, offsets):
                view = buffer.as_strided(param.shape, param.stride(), offset)
                view.copy_(param)
                param.data = view
                if grad_buffer is not None and param.requires_grad:
                    grad = grad_buffer.as_strided(param.shape, param.stride(), offset)
                    if param.grad is not None:
                        grad.copy_(param.grad)
                    param.grad = grad
            if grad_buffer is not None:
                grad_buffer.views = sum(param.requires_grad for param in members)
                GRAD_BUFFERS[id(grad_buffer)] = grad_buffer
            buffers.append(buffer)
    return buffers


def grad_buffer(grad: Tensor) -> Tensor | None:
    """The grad buffer of flatten_parameters that ``grad`` was made a view of, or None. (A conversion of
    the module since, ``module.double()`` or ``.to(...)``, gave the grad data of its own, outside it:
    see :func:`span`.)"""
    base = grad._base
    return base if base is not None and GRAD_BUFFERS.get(id(base)) is base else None


def span(buffer: Tensor) -> tuple[int, int]:
    """The addresses of ``buffer``'s first byte and of the byte past its last: a grad made a view of it
    still is one while its data pointer lies in there. torch's ``Module._apply`` (``.to()``,
    ``.double()``, ``.half()``, a memory format) sets a grad's ``.data`` to a converted copy, which keeps
    the tensor and its ``_base`` but moves its data out of the buffer."""
    start = buffer.data_ptr()
    return start, start + buffer.nbytes


def flat_grad(param: Tensor) -> bool:
    """Whether ``param``'s grad is a view of a flat grad buffer."""
    grad = param.grad
    buffer = None if grad is None else grad_buffer(grad)
    if buffer is None:
        return False
    start, end = span(buffer)
    return start <= grad.data_ptr() <= end


def frozen_grad(param: Tensor, frozen: list) -> Tensor | None:
    """The grad that a step takes of ``param``, which no longer requires grad: none where it is a flat
    grad, whose param is listed in ``frozen``, for the step to drop once it has run (see
    :func:`drop_frozen_grads`), else its own."""
    grad = param.grad
    if grad is not None and flat_grad(param):
        frozen.append(param)
        return None
    return grad


def drop_frozen_grads(groups, dropped: list) -> None:
    """Drop the flat grads of the params of ``groups`` (param groups) that no longer require grad:
    frozen since they were flattened (``requires_grad_(False)``), they get no grad from backward, and a
    step would take the zeros that zero_grad left there for their weight decay and momentum, where
    torch's zero_grad leaves an unflattened model's frozen params no grad to step. Each is listed in
    ``dropped`` with its grad (see :func:`frozen_grads_dropped`). (A bound step reads each param's grad
    with :func:`frozen_grad` instead: one pass over the params, not two.)"""
    for group in groups:
        params = group["params"]
        if not all(map(REQUIRES_GRAD, params)):
            for param in params:
                if not param.requires_grad and param.grad is not None and flat_grad(param):
                    dropped.append((param, param.grad))
                    param.grad = None


@contextmanager
def frozen_grads_dropped(groups):
    """Within the block, the flat grads of the params of ``groups`` (param groups) that no longer require
    grad are dropped (:func:`drop_frozen_grads`); where it raises, each is given back: a step that raises
    changes nothing (helper-105: it lost a frozen param's grad, which unfrozen again went unstepped)."""
    dropped = []
    if GRAD_BUFFERS:
        drop_frozen_grads(groups, dropped)
    try:
        yield
    except BaseException:
        for param, grad in dropped:
            param.grad = grad
        raise


def zero_grads(params) -> None:
    """Set the grads of ``params`` to None, but zero those that are views of a flat grad buffer in place
    (the whole buffer in one fill where ``params`` hold all of its grads), of params that still require
    grad (see :func:`drop_frozen_grads`). A grad that a conversion of its module moved out of its buffer
    (see :func:`span`) is the param's own: it is set to None too, with a warning that the model is no
    longer flat (zeroing the buffer instead would leave it to accumulate over steps)."""
    kept, moved = {}, 0
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        buffer = grad_buffer(grad) if param.requires_grad else None
        if buffer is None:
            param.grad = None
            continue
        _, (start, end), grads = kept.get(id(buffer)) or kept.setdefault(id(buffer), (buffer, span(buffer), []))
        if start <= grad.data_ptr() <= end:
            grads.append(grad)
        else:
            param.grad = None
            moved += 1
    if moved:
        warnings.warn(f"fastoptim: {moved} params were converted after flatten_parameters (module.to(), .double(), "
                      ".half(), a memory format), which gave them and their grads data of their own: the model is "
                      "no longer flat there, and zero_grad drops those grads as torch does. Convert the model "
                      "first, or call fastoptim.flatten_parameters(model) again", stacklevel=3)
    for buffer, _, grads in kept.values():
        if len(grads) == buffer.views:
            buffer.zero_()
        elif grads:
            torch._foreach_zero_(grads)
