"""Which reductions gradient release follows, and what it refuses: a step is released where a grad is
known to be final (see ``release.py``), in one process, under DDP (through release's comm hook, which
averages and all-reduces a bucket as DDP does without one) or under FSDP2 (whose reduce-scatter hands
each sharded param its grad), and where a grad is not final yet: in a reentrant backward."""
from __future__ import annotations

import sys
import weakref

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.optim import Optimizer

# The frame of an autograd Function's backward: a backward run from inside it is reentrant.
FUNCTION_BACKWARD = BackwardCFunction.apply.__code__


def refusal(optimizer: Optimizer, model: torch.nn.Module | None = None) -> str | None:
    """Why ``optimizer``'s steps cannot be released exactly, following the reduction of ``model`` (a
    DDP or ``fully_shard`` model; None: one process), or None."""
    if optimizer.defaults["max_grad_norm"] > 0:
        return "max_grad_norm clips by the norm of all grads, which release never holds at once"
    if model is None and (optimizer.shard_group is not None or optimizer._sharded or (
            torch.distributed.is_available() and torch.distributed.is_initialized())):
        return ("its grads would be stepped before DDP or FSDP reduce them over the ranks: pass the model, "
                "enable_gradient_release(model=model), where it is a DistributedDataParallel or fully_shard "
                "(FSDP2) model, whose reductions release then follows")
    if model is not None:
        reason = _model_refusal(optimizer, model)
        if reason is not None:
            return reason
    if getattr(optimizer, "_release", None) is not None:
        return "it is on already: call remove() on the handle enable_gradient_release() returned"
    return None


def reduction_mode(model: torch.nn.Module | None) -> str:
    """"ddp", "fsdp" (FSDP2: a ``fully_shard`` module, or one holding some) or "local" (None); "" for
    another model."""
    if model is None:
        return "local"
    if not torch.distributed.is_available():
        return ""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, torch.nn.Module) and any(isinstance(module, FSDPModule) for module in model.modules()):
        return "fsdp"
    return ""


def fsdp_managed(model: torch.nn.Module) -> dict[int, Tensor]:
    """The sharded params of the ``fully_shard`` modules in ``model``, by id: those whose reduced grads
    FSDP2 hands to their post-accumulate-grad hooks."""
    from torch.distributed.fsdp import FSDPModule
    managed = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch before per-param meshes: one group per state
                groups = [state._fsdp_param_group]
            for group in groups:
                for fsdp_param in [] if group is None else group.fsdp_params:
                    managed[id(fsdp_param.sharded_param)] = fsdp_param.sharded_param
    return managed


def _model_refusal(optimizer: Optimizer, model) -> str | None:
    mode = reduction_mode(model)
    if not mode:
        fsdp1 = False
        if torch.distributed.is_available():
            from torch.distributed.fsdp import FullyShardedDataParallel
            fsdp1 = isinstance(model, torch.nn.Module) and any(
                isinstance(module, FullyShardedDataParallel) for module in model.modules())
        if fsdp1:
            return ("FullyShardedDataParallel (FSDP1) reduces grads in flat handles with no hook that hands a "
                    "param its reduced grad: use fully_shard (FSDP2), which does")
        return (f"model= is a {type(model).__name__}: release follows the reductions of a DistributedDataParallel "
                "model or of a fully_shard (FSDP2) model, and nothing else")
    if optimizer.shard_group is not None:
        return ("shard_group: each rank steps its partition of a ZeroRedundancyOptimizer after DDP's reduction, "
                "which release does not follow")
    if mode == "ddp":
        if optimizer._sharded:
            return "its params are DTensors, which DDP does not reduce"
        if model.find_unused_parameters:
            return ("DDP's find_unused_parameters=True leaves a param that no rank used its old grad, which only "
                    "DDP's end of backward knows, after the buckets were reduced: release cannot step at a "
                    "bucket's reduction then; build DDP without it")
        if getattr(model, "_use_python_reducer", False) or getattr(model, "_delay_all_reduce_all_params", False):
            return "this DDP reduces its grads without buckets, so no comm hook sees them"
        others = [hook for hook, state in getattr(model, "_comm_hooks", []) if not isinstance(state, DDPState)]
        if others:
            return (f"this DDP has a comm hook already ({getattr(others[0], '__qualname__', others[0])}): release "
                    "registers its own, which averages and all-reduces as DDP does without one, and DDP takes "
                    "only one")
        return None
    try:
        managed = fsdp_managed(model)
    except AttributeError as error:  # FSDP2's state as torch 2.13 keeps it
        return f"this torch's fully_shard keeps its params where release does not find them ({error})"
    for index, group in enumerate(optimizer.param_groups):
        for position, param in enumerate(group["params"]):
            if param.requires_grad and managed.get(id(param)) is not param:
                return (f"param {position} of param group {index} ({tuple(param.shape)}) is not a param of a "
                        "fully_shard module of model=, so no reduce-scatter hands it its grad")
    return None


class DDPState:
    """The state of release's DDP comm hook: DDP's process group and the releases it tells of each
    reduced bucket (those of the optimizers that step the model's params), held weakly (none once
    removed: the hook then only averages, as DDP does without it). DDP takes one comm hook, for good, so
    a later release on the same model joins this one."""

    def __init__(self, process_group):
        self.process_group = process_group
        self.releases = weakref.WeakSet()


def ddp_comm_hook(state, bucket):  # unannotated: DDP checks the annotation's object, not its string
    """Average ``bucket`` over DDP's ranks as DDP does without a comm hook (each grad times 1 / world, then
    an all-reduce of the sum), and once it has landed, tell the releases on it of its params' reduced grads."""
    group = state.process_group
    buffer = bucket.buffer()
    buffer.mul_(1 / group.size())
    future = torch.distributed.all_reduce(buffer, group=group, async_op=True).get_future()

    def reduced(future):
        tensor = future.value()[0]
        for release in list(state.releases):
            release._ddp_reduced(bucket.parameters(), bucket.gradients())
        return tensor
    return future.then(reduced)


def hook_ddp(model, release) -> None:
    """Add ``release`` to those that ``model``'s release comm hook tells, registering it the first time."""
    for _, state in getattr(model, "_comm_hooks", []):
        if isinstance(state, DDPState):
            break
    else:
        state = DDPState(model.process_group)
        model.register_comm_hook(state, ddp_comm_hook)
    state.releases.add(release)


def in_reentrant_backward() -> bool:
    """Whether the backward running now was started by the backward of an autograd Function, as
    ``torch.utils.checkpoint(use_reentrant=True)`` runs its block's: that Function's frame is then on
    this thread's stack (also on a GPU's autograd thread, where the reentrant backward runs too). Its
    accumulations are not the last of the backward around it: a block used twice accumulates again."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False
