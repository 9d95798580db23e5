"""How a step executes. Every engine runs an optimizer's math (its ``update``, written once in
``fastoptim/optimizers``, or the fused kernel that restates it) over a :class:`Plan`; engines differ
only in how they walk the tensors."""
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from ..multi_tensor import pick, sent_to
from ..specs import KernelSpec
from ..step_cache import BucketPlan
from . import amp, backends, foreach, fused, loop


@dataclass
class Plan:
    """One bucket (one device and dtype) of one group's step.

    ``tensors`` maps a role (``param``, ``grad``, ``exp_avg``, ...) to one tensor per parameter.
    ``update``, ``spec`` and ``flags`` are the algorithm's (see ``FastOptimizer``): an engine runs the
    math of the plan, and never sees the optimizer or calls into it.
    ``args`` holds the rest of ``update``'s keyword arguments: Python numbers and bools, 0-d tensors
    shared by every parameter, or 1-d tensors with one entry per parameter (named in ``per_tensor``).
    The fused engines also read ``found_inf`` (GradScaler's, or None), ``stochastic_rounding``,
    ``warn_fallback`` (fused was asked for, not picked) and ``bucket`` (the
    :class:`~fastoptim.step_cache.BucketPlan` they keep their tables in, the group's plan's, made
    anew when a param or state changes).
    A state role may hold bf16 or 8-bit (uint8 codes) tensors under ``state_bits``; ``absmax`` holds
    the block maxima of the 8-bit ones. ``sum_group``: the process group over which the loop engine
    all-reduces subset sums (subsets that span FSDP2 shards), or None.
    ``watched`` and ``originals``: per tensor, what a backend that checks natively checks besides the
    tensors, and by role the tensors that ``tensors`` are views of, which it binds in their place;
    ``rule`` (the algorithm's) and ``counts`` (per
    tensor, the step count it reads): what a bound step's native call computes the kernel's scalars
    from (see :class:`tables.Tables`); None or "": nothing.
    ``traced``: the plan is of a step that torch.compile traces (decided once, at ``step()``): the fused
    engines call their ops, and found_inf is not read on the host.
    ``kernel_values``: the fused kernel's scalars by name (the algorithm's ``kernel_scalars`` of
    ``args``), which the fused engine completes with found_inf and the rounding's seed at launch; where an
    op made them, those too (a traced CPU step's, ``fastoptim::step_scalars``, for a plan the kernel takes
    whole, whose ``args`` are then empty). None: the algorithm has no fused kernel, and the fused engines
    leave the plan to foreach.
    """

    tensors: dict[str, list[Tensor]]
    update: Callable  # the algorithm's math, ``update(ops, scratch=..., **tensors, **args)``
    spec: KernelSpec  # what its fused kernels take
    flags: dict = field(default_factory=dict)  # the spec's feature flags
    args: dict = field(default_factory=dict)
    per_tensor: frozenset = frozenset()
    found_inf: Tensor | None = None
    stochastic_rounding: bool = False
    warn_fallback: bool = False
    bucket: BucketPlan | None = None  # None: one of its own (made in __post_init__: dynamo traces no default_factory)
    absmax: dict = field(default_factory=dict)  # role: the block maxima of each 8-bit state (None for others)
    sum_group: object = None
    kernel_values: dict | None = None  # see above: made by the algorithm's side, never by an engine
    watched: list | None = None
    originals: dict | None = None
    rule: str = ""
    counts: list | None = None
    traced: bool = False

    def __post_init__(self):
        if self.bucket is None:
            self.bucket = BucketPlan()

    def __len__(self):
        return len(self.tensors["param"])

    def without(self, role):
        """The plan without the tensors of ``role``."""
        return replace(self, tensors={name: values for name, values in self.tensors.items() if name != role})

    def subset(self, indices):
        """The plan restricted to tensors ``indices`` (with a bucket plan of its own)."""
        return self.cut(indices)

    def cut(self, owners, tensors=None, absmax=None, owners_bucket=None):
        """A plan (with a bucket plan of its own) whose i-th tensor is tensor ``owners[i]`` of this one,
        or a piece of it: ``tensors`` and ``absmax`` then hold the pieces by role. ``owners_bucket``: see
        :func:`args_of`."""
        if tensors is None:
            tensors, absmax = pick(self.tensors, owners), pick(self.absmax, owners)
        device = self.tensors["param"][0].device
        args = args_of(self.args, self.per_tensor, owners, device, owners_bucket, self.traced)
        kernel_values = self.kernel_values and args_of(  # those with a value per tensor: theirs
            self.kernel_values, [name for name, value in self.kernel_values.items()
                                 if isinstance(value, Tensor) and value.dim() == 1], owners, device, owners_bucket,
            self.traced)
        return replace(self, tensors=tensors, absmax=absmax, bucket=BucketPlan(), sum_group=None, args=args,
                       kernel_values=kernel_values,
                       watched=None if self.watched is None else [self.watched[i] for i in owners],
                       originals=None if self.originals is None else pick(self.originals, owners),
                       counts=None if self.counts is None else [self.counts[i] for i in owners])


def args_of(args, per_tensor, owners, device, bucket=None, traced=False):
    """A step's ``args`` for tensors ``owners`` of its plan: those named in ``per_tensor`` (one value
    per tensor, on ``device``) cut to theirs. ``bucket``: the :class:`BucketPlan` that keeps the owners'
    index on the device for the next step (a GPU step would send it every time); ``traced``: of a step
    that torch.compile traces."""
    if not any(key in args for key in per_tensor):  # not `&` with dict keys: dynamo before torch 2.13
        return args
    index = None if bucket is None else bucket.owners
    if index is None:
        # a traced step makes it in the graph, a constant: numpy there would need dynamo's trace_numpy
        index = torch.tensor(owners, dtype=torch.int64, device=device) if traced else sent_to(
            np.array(owners, dtype=np.int64), device)
        if bucket is not None:
            bucket.owners = index
    return {k: v[index] if k in per_tensor else v for k, v in args.items()}


ENGINES = {"loop": loop.run, "foreach": foreach.run} | fused.ENGINES
FUSED = frozenset(fused.ENGINES)


def run(engine, plan):
    """Run ``plan`` on the engine named ``engine``; the fused kernels skip a step GradScaler found an
    inf in on the device, and the other engines through :func:`amp.run_unless_inf`."""
    if engine in FUSED:
        ENGINES[engine](plan)
    else:
        amp.run_unless_inf(ENGINES[engine], plan)


def run_bucket(engine, plan, reduce_group=None):
    """Run one bucket's ``plan`` on ``engine``; over ``reduce_group`` (not None) where its math needs
    other ranks' shards (see :func:`run_summing_over`)."""
    if reduce_group is None:
        run(engine, plan)
    else:
        run_summing_over(plan, reduce_group)


def run_summing_over(plan, group):
    """Params whose subsets span FSDP2 shards (columns of a matrix with fewer rows than columns): the
    loop engine, which all-reduces each param's subset sums over ``group`` before they enter the
    second moment. One update per param, so every rank makes the same all-reduces in the same order;
    the fused kernels sum subsets inside themselves, and foreach may cut a param into pieces."""
    if plan.warn_fallback:
        fused.warn("fastoptim: fused=True, but subset-norm sums that span FSDP2 shards are all-reduced between ranks, "
                   "which the kernel cannot do; those tensors take the loop engine", plan.traced, stacklevel=4)
    plan.sum_group = group
    loop.run(plan)


def engine_name(foreach, fused):
    """The engine that a group's ``foreach``/``fused`` flags select, as the seeds choose them:
    ``fused=True`` is multi-tensor unless ``foreach=False``; with both None, the fastest there is.
    Raises a ValueError for a FASTOPTIM_FUSED_BACKEND that names no backend, before any step."""
    if fused or fused is None and foreach is None:
        backends.forced()
    if fused:
        return "fused-single" if foreach is False else "fused-multi"
    if fused is None and foreach is None:
        return "fused-multi" if backends.any_available() else "foreach"
    return "loop" if foreach is False else "foreach"
