"""The fused engines (``fused=True``): a backend's kernel (``engines/backends``: the C kernel for CPU
tensors, the Triton kernels for CUDA ones) over the tensors it takes; this module splits a plan
between the kernel and the foreach fallback, and caches the pointer tables.

Multi-tensor (``foreach=True``, the default with ``fused=True``): one call per bucket updates every
tensor, parallel over fixed-size chunks across all of them. Single-tensor (``foreach=False``): one
kernel call (or launch) per tensor, as the seeds' FusedAdan does. Both read the tables (``tables.py``)
kept in ``plan.bucket`` (the group's plan's): the params and states bound to native code, which
checks them and the grads at every call (a bound step launches its tables without a plan:
``bound_step.BoundStep``); on the GPU also the pointer table, whose gradients' row is refreshed each
step (and sent to the device only when a grad moved). A step that torch.compile traces calls each
bucket's op (``step_op.py``).

States may be fp32, bf16 or 8-bit (``state_bits``): the C kernel dequantizes, updates and
requantizes each 256-element block in one pass, and so do the Triton kernels.

Tensors the kernel cannot take run on the foreach engine instead, with one warning when fused was
asked for: no build (or no Triton), a dtype other than fp32/bf16/fp16, a device the backend does not
run on, a layout where param, grad and states are not dense with the same strides, or 8-bit states
of a param that is not contiguous (the codes are in row-major order).
"""
import warnings

import torch

from . import amp, backends, foreach
from .step_op import OPS
from .tables import Tables, split_taken


def _warn_at_tracing(ctx):
    warnings.warn(ctx.get_local("message").as_python_constant())


def warn(message, traced, stacklevel):
    """``warnings.warn``, also in a step that torch.compile ``traced``, where it warns once, at tracing
    (a traced ``warnings.warn`` would break the graph)."""
    if traced:
        from torch._dynamo.comptime import comptime  # loaded by now: dynamo is tracing
        comptime(_warn_at_tracing)  # reads ``message``, the one local it may see
    else:
        warnings.warn(message, stacklevel=stacklevel + 1)


def _fallback(plan, reason):
    if plan.warn_fallback:
        warn(f"fastoptim: fused=True, but {reason}; those tensors take the foreach engine", plan.traced, stacklevel=4)
    amp.run_unless_inf(foreach.run, plan)


def draw_seed(device):
    """A stochastic rounding's seed for one launch, drawn on ``device`` (no host sync)."""
    return torch.randint(1 << 24, (), device=device)


def rng_state(device):
    """The state of the generator that a seed drawn on ``device`` advances. A refused native call or launch
    gives it back (:func:`set_rng_states`): the step, or launch, that follows draws the seeds again, as one
    that was not refused draws them once."""
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def set_rng_states(states):
    """Set each device's generator to its state in ``states`` (device to :func:`rng_state`)."""
    for device, state in states.items():
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)


def with_common(values, found_inf, stochastic, device):
    """A kernel's scalars by name (``values``: its algorithm's) with GradScaler's ``found_inf`` (None: 0)
    and, with ``stochastic`` rounding, its seed, drawn on ``device``."""
    return values | dict(found_inf=0.0 if found_inf is None else found_inf, seed=draw_seed(device) if stochastic else 0)


def ordered_scalars(spec, values, found_inf, stochastic, device):
    """The kernel's scalars in ``spec.all_scalars`` order: ``values`` (by name: Python numbers, 0-d
    tensors, or 1-d tensors with one value per tensor), :func:`with_common` ones where an op did not
    make those."""
    if "seed" not in values:
        values = with_common(values, found_inf, stochastic, device)
    return [values[name] for name in spec.all_scalars]


def _scalar_values(plan, device):
    """The kernel's scalars of ``plan`` in its spec's order (see :func:`ordered_scalars`)."""
    return ordered_scalars(plan.spec, plan.kernel_values, plan.found_inf, plan.stochastic_rounding, device)


class KernelSplit:
    """What ``backend``'s kernel takes of a plan (``taken``), what it leaves to foreach and why, and
    the :class:`Tables` of what it takes."""

    def __init__(self, plan, backend):
        self.backend = backend
        self.taken, taken_formats, self.left, self.reason = split_taken(plan.tensors, plan.absmax, plan.spec, backend)
        taken = plan if not self.left else plan.subset(self.taken)
        self.tables = Tables(taken.tensors, taken.absmax, plan.spec, backend, taken_formats, taken.watched,
                             taken.originals, plan.rule, taken.counts) if self.taken else None


def _kernel_split(plan, backend, again=False):
    """What ``backend``'s kernel takes of ``plan``, kept in ``plan.bucket``, which is made anew with its work's
    buckets (whenever a param, state, count or the forced backend changes: ``step_cache.PlanStore``), built
    ``again`` when a launch found a tensor moved or a grad it cannot walk, when the kernel would now take a
    tensor it left (its grad, transposed or expanded at one step, is walkable again), and, for a backend
    that does not check natively, when the grads changed their layouts."""
    split = plan.bucket.kernel_split
    if again or split is None or split.left and split_taken(
            (left := plan.subset(split.left)).tensors, left.absmax, plan.spec, backend)[0] or (
            not backend.CHECKS_NATIVELY and split.tables is not None and not split.tables.fit(
                plan.tensors["grad"] if not split.left else [plan.tensors["grad"][i] for i in split.taken])):
        split = plan.bucket.kernel_split = KernelSplit(plan, backend)
    return split


def _launch(plan, split, per_tensor_calls):
    """Launch the kernel over what it takes of ``plan``; False when the backend changed nothing."""
    taken = plan if not split.left else plan.subset(split.taken)
    scalars = _scalar_values(taken, taken.tensors["param"][0].device)
    return split.tables.launch(plan.spec, taken.tensors["grad"], scalars, plan.flags, plan.stochastic_rounding,
                               per_tensor_calls)


def natively_checked(bucket):
    """Whether the bucket whose plan is ``bucket`` (a ``BucketPlan``) runs wholly on tables that a backend which
    ``CHECKS_NATIVELY`` built, and so can join a bound step (see ``bound_step.BoundStep``)."""
    split = bucket.kernel_split
    return split is not None and split.backend.CHECKS_NATIVELY and split.tables is not None and not split.left


def held_natively(work, grads=None):
    """What native code finds, in one check of them all, of the tables of ``work`` (a group's ``GroupWork``)
    and ``grads`` (one per param of the work, in its order): None where a param, state or count they hold
    moved or changed its layout since they were bound, or they are not all of one backend that
    ``CHECKS_NATIVELY``, bound to the user's own tensors (not to views of them that the work made: a
    DTensor's local shard, a complex param's real view); else whether every grad fits its param as the
    kernel walks it (its dtype, sizes and strides, and not its param's memory: see ``check_grads``), or
    True without ``grads`` (the tables alone checked: before backward has made them)."""
    if (not work.params or grads is not None and len(grads) != len(work.params) or work.states is None
            or work.viewed_states or work.local_params is not work.params
            or not all(map(natively_checked, work.buckets))):
        return None
    splits = [bucket.kernel_split for bucket in work.buckets]
    backend = splits[0].backend
    if any(split.backend is not backend for split in splits):
        return None
    tables, taken = [], []  # the grads each table takes, in the tables' order
    for bucket, split in zip(work.buckets, splits):
        for indices, _, bound, _ in split.tables.tables:
            tables.append(bound)
            if grads is not None:
                taken += [grads[bucket.indices[i]] for i in indices]
    if grads is None:
        return True if backend.holds(tables) else None
    status, _ = backend.check(tables, taken)  # STALE where any table's tensors moved, before any grad is read
    # a subset-norm param's table also takes a grad laid out as the engines' (a, b, c) view of it, which is
    # no grad of the param's: Python checks those
    return None if status == backends.cpu.STALE else status == backends.cpu.STEPPED and work.partitions is None


def _run(plan, per_tensor_calls):
    if plan.kernel_values is None:
        _fallback(plan, f"no fused kernel for {plan.spec.name} yet")
        return
    if plan.traced:
        _run_traced(plan, per_tensor_calls)
        return
    device = plan.tensors["param"][0].device
    backend = backends.for_device(device)
    split = _kernel_split(plan, backend)
    drawn = {device: rng_state(device)} if plan.stochastic_rounding and split.tables is not None else {}
    if split.tables is not None and not _launch(plan, split, per_tensor_calls):
        set_rng_states(drawn)  # the refused launch's seed: the next draws the one a launch of a new split draws
        split = _kernel_split(plan, backend, again=True)  # what moved or no longer fits is split again
        if split.tables is not None and not _launch(plan, split, per_tensor_calls):
            raise RuntimeError("fastoptim: the fused kernel refused tables built from the tensors just now")
    if split.left:
        _fallback(plan.subset(split.left), split.reason)


def run_multi(plan):
    _run(plan, per_tensor_calls=False)


def run_single(plan):
    _run(plan, per_tensor_calls=True)


SINGLE, MULTI = "fused-single", "fused-multi"  # the fused engines' names
ENGINES = {SINGLE: run_single, MULTI: run_multi}


def _run_traced(plan, per_tensor_calls):
    """A step that torch.compile traces: the split was decided before tracing (``split``, called by
    the optimizer's ``_init_group``), and the kernel's tensors go to ``spec``'s op, which the graph
    keeps."""
    traced = plan.bucket.traced_split
    if traced.left:
        _fallback(plan.subset(traced.left), traced.reason)
    if not traced.taken:
        return
    part = plan if not traced.left else plan.subset(traced.taken)
    device = part.tensors["param"][0].device
    scalars = [value if isinstance(value, torch.Tensor) else torch.tensor(float(value), device=device)
               for value in _scalar_values(part, device)]
    OPS[plan.spec.name](part.tensors["param"], part.tensors["grad"], traced.call.holders, traced.call.layout, scalars,
                        plan.spec.flag_bits(part.flags, part.stochastic_rounding), per_tensor_calls)
