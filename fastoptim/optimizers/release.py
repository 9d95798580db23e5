"""Gradient release: each bucket of params is stepped from a post-accumulate-grad hook as soon as all
its grads are ready in backward, and its grads are freed there, so that a model's grads are never
all held at once. ``step()`` then steps only what backward left (params whose bucket did not fill)
and advances the per-group step counts; ``zero_grad()`` finds nothing to clear."""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..clip import RELEASED

BUCKET_NUMEL = 1 << 22  # elements per released bucket (16 MiB of fp32 grads): DDP's default is 25 MiB


def refusal(optimizer: Optimizer) -> str | None:
    """Why ``optimizer``'s steps cannot be released exactly, or None."""
    if optimizer.defaults["max_grad_norm"] > 0:
        return "max_grad_norm clips by the norm of all grads, which release never holds at once"
    if optimizer.shard_group is not None or optimizer._sharded or (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        return ("its grads would be stepped before DDP or FSDP reduce them over the ranks: gradient release runs "
                "in one process")
    if getattr(optimizer, "_release", None) is not None:
        return "it is on already: call remove() on the handle enable_gradient_release() returned"
    return None


class GradientRelease:
    """The handle that ``optimizer.enable_gradient_release()`` returns; ``remove()`` turns it off.

    The buckets: each param group's params that require grads, in reverse order (backward reaches
    the last layers first), cut every ``bucket_numel`` elements; a group whose math needs its
    tensors together (Muon's batches of matrices) is one bucket, so its batches stay as a normal
    step makes them.
    """

    def __init__(self, optimizer: Optimizer, bucket_numel: int):
        self.optimizer = optimizer
        self.buckets, self.bucket_of = [], {}
        for index, group in enumerate(optimizer.param_groups):
            whole = not optimizer._algorithm(group).spec.elementwise
            params, numel = [], 0
            for param in reversed([p for p in group["params"] if p.requires_grad]):
                if params and not whole and numel + param.numel() > bucket_numel:
                    self._add(index, params)
                    params, numel = [], 0
                params.append(param)
                numel += param.numel()
            if params:
                self._add(index, params)
        self.ready = [set() for _ in self.buckets]  # ids of the params whose grads arrived this step
        self.stepped = set()  # buckets stepped since the last step()
        self.hooks = [param.register_post_accumulate_grad_hook(self._grad_ready) for param in self.bucket_of]
        RELEASED.update({id(param): param for param in self.bucket_of})

    def _add(self, group_index, params):
        for param in params:
            self.bucket_of[param] = len(self.buckets)
        self.buckets.append((group_index, params))

    def _grad_ready(self, param: torch.Tensor) -> None:
        bucket = self.bucket_of[param]
        if bucket in self.stepped:
            raise RuntimeError(
                "fastoptim: gradient release stepped these params in an earlier backward since the last "
                "optimizer.step(): a second backward (gradient accumulation) cannot add to their grads. Call "
                "optimizer.step() after each backward, or remove the release handle to accumulate")
        ready = self.ready[bucket]
        ready.add(id(param))
        if len(ready) == len(self.buckets[bucket][1]):
            self._step(bucket)

    def _step(self, bucket: int) -> None:
        group_index, params = self.buckets[bucket]
        self.optimizer._step_released(bucket, group_index, params)
        self.stepped.add(bucket)
        self.ready[bucket].clear()
        for param in params:
            param.grad = None

    def step(self) -> None:
        """``optimizer.step()`` under release: the buckets that backward did not step (some of their
        params got no grad), on the grads they have, then the per-group step counts."""
        if getattr(self.optimizer, "grad_scale", None) is not None:
            raise RuntimeError("fastoptim: GradScaler scales the loss, and gradient release has already stepped "
                               "the params with the scaled grads in backward: remove the release handle to use "
                               "GradScaler")
        for bucket in range(len(self.buckets)):
            if bucket not in self.stepped and any(param.grad is not None for param in self.buckets[bucket][1]):
                self._step(bucket)
        for group in self.optimizer.param_groups:  # the per-group counts, once
            self.optimizer._count_step(group, None, 1)
        self.stepped.clear()
        for ready in self.ready:
            ready.clear()

    def remove(self) -> None:
        """Turn release off: the hooks go, and ``step()`` steps the grads as usual again."""
        for hook in self.hooks:
            hook.remove()
        for param in self.bucket_of:
            RELEASED.pop(id(param), None)
        self.hooks = []
        if self.optimizer._release is self:
            self.optimizer._release = None
