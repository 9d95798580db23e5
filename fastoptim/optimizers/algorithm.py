"""What an algorithm is, declared as one record beside its math (each optimizer's module): the
base class (fastoptim.optimizers.base) reads it to create the states, count the steps, compute each
step's arguments and hand the engines their plan. An optimizer class adds its signature, its
defaults and the checks of its own options."""
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch import Tensor

from .. import engines
from ..specs import KernelSpec

PER_PARAM = "param"  # a 0-d fp32 ``step`` in each param's state, as torch.optim keeps it
PER_GROUP = "group"  # the group's ``step``, advanced on every step, grads or not, as official Adan keeps it


def decays(weight_decay: float | Tensor) -> bool:
    """Whether an update applies ``weight_decay``: a number other than 0, or a tensor, whose value no step
    reads on the host (a truth test would sync, and a traced one branch on data: helper-79); one of 0
    multiplies by 1 − lr·0 = 1, which leaves the param as it is.

    Args:
        weight_decay: the group's option, as the update function is handed it.
    """
    return isinstance(weight_decay, Tensor) or bool(weight_decay)


class StepInputs(NamedTuple):
    """What a step's arguments are computed from, besides the group's options.

    ``lr``: the group's lr (a number, or a 0-d view of its tensor lr). ``grad_scale``: what the
    gradient is multiplied by (clip coefficient, GradScaler's 1/scale, −1 to maximize; None: 1).
    ``count``: this step's count, in float64: a 1-d tensor of one per param (``PER_PARAM``; a float
    where every param has the same count on the host), the group's (a float or 0-d tensor,
    ``PER_GROUP``), or None (the algorithm counts no steps).
    ``wide``: the dtype of scalars that hold one value per param (float64 where a param's math is).
    ``first_reads``: per param, 0.0 where this step is the first to read the algorithm's optional
    states (``Role.optional``: they were just created) and 1.0 elsewhere; None where no param is.
    ``factors``: the algorithm's ``param_factors``, one float64 per param (None without them).
    ``counts_per_param``: whether the count-derived arguments hold one value per param; by default,
    where ``count`` is a 1-d tensor (a traced step's op sets it from the counts it was given).
    """

    lr: float | Tensor
    grad_scale: float | Tensor | None
    count: float | Tensor | None
    wide: torch.dtype
    first_reads: Tensor | None
    factors: Tensor | None
    counts_per_param: bool | None = None

    def per_param(self, names: set[str]) -> set[str]:
        """``names`` (arguments computed from ``count``) where the count is one per param, else none."""
        if self.counts_per_param is not None:
            return names if self.counts_per_param else set()
        return names if isinstance(self.count, Tensor) and self.count.dim() == 1 else set()


def no_flags(group: dict) -> dict:
    """The feature flags that the options of an algorithm's groups set where they set none."""
    return {}


class Algorithm(NamedTuple):
    """An algorithm, declared once.

    ``spec``: its :class:`fastoptim.specs.KernelSpec` (state roles, kernel scalars, flags).
    ``update(ops, *, param, grad, scratch, <states>, <args>)``: its math, written once in the ``ops``
    vocabulary (fastoptim.engines.ops), which the loop and foreach engines run.
    ``arguments(group, inputs)``: ``update``'s arguments for this step from the group's options and
    a :class:`StepInputs`, and the names of those that hold one value per param.
    ``kernel_scalars(args)``: those arguments as its fused kernels take them (by the spec's scalar
    names); None: its fused engines run it on foreach.
    ``fixed_flags``: the spec's feature flags (name: bool) that no option of its groups sets;
    ``option_flags(group)``: the others, as a group's options set them (see :meth:`flags`).
    ``counts``: where it counts steps: ``PER_PARAM``, ``PER_GROUP`` or None.
    ``param_factors(group, param)``: a number per param that its arguments read, computed when the
    params' states change rather than every step (Muon's lr factor of a matrix's shape); None.
    ``factor_options``: the group's options that ``param_factors`` reads: a change of one makes them again.
    ``n_betas``: how many betas its groups take.
    ``run(engine, plan, reduce_group)``: how a bucket's plan runs, where the engines' own way does
    not fit (Muon's, whose math needs whole matrices between two elementwise halves).
    ``rule``: (name, option keys): the native rule that computes ``kernel_scalars(arguments(...))``
    in a bound CPU step (native.cpp's Rule of that name restates them, tests/test_native_layer.py
    holds the two equal), and the group's options it takes, in its order (a sequence's values, the
    betas, each); None: Python computes them.
    ``bound_part(tensors, bucket, plan, engine)``: where it ``run``s its own way, its part of a bound step
    for a bucket (``bucket``: its params' positions in the group, ``tensors``: the group's by role,
    ``plan``: what the engines made of the bucket, its ``BucketPlan``, ``engine``: its fused engine): an
    object with the ``tables`` of its elementwise kernel, the ``positions`` of the grads they take, their
    ``spec``, ``launch_values(group, grad_scale, found_inf, device)`` (their scalars and flags) and
    ``finish(group, args, per_tensor)``, run after the step's native call with ``arguments``' values;
    None where the bucket cannot run bound (Muon's: muon_parts.BoundMomentum).
    """

    spec: KernelSpec
    update: Callable
    arguments: Callable[[dict, StepInputs], tuple[dict, Collection[str]]]
    kernel_scalars: Callable[[dict], dict] | None = None
    fixed_flags: Mapping = MappingProxyType({})
    option_flags: Callable[[dict], dict] = no_flags
    counts: str | None = None
    param_factors: Callable[[dict, Tensor], float] | None = None
    factor_options: tuple[str, ...] = ()
    n_betas: int = 2
    run: Callable = engines.run_bucket
    rule: tuple[str, tuple[str, ...]] | None = None
    bound_part: Callable | None = None

    def flags(self, group: dict) -> dict:
        """The spec's feature flags (name: bool) under ``group``'s options: the fixed ones and the options'.

        Args:
            group: the param group whose options set them.
        """
        return {**self.fixed_flags, **self.option_flags(group)}
