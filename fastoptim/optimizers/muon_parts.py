"""Muon's three parts (Jordan et al., 2024), as :func:`muon_update <fastoptim.optimizers.muon.muon_update>`
composes them: the momentum and the direction it gives (elementwise, a kernel spec of its own that the
fused kernels restate), the Newton–Schulz iterations over batches of same-shape matrices, and the
update. A fused or sharded Muon bucket runs them apart (:func:`run_muon_bucket`): its directions
planned once per bucket (:class:`Directions`), its momentum kernel's tables bound once, in a bound step
beside its AdamW companions' (:class:`BoundMomentum`), and over FSDP2 shards each matrix on one owner
rank (:func:`orthogonalize_shards`)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import groupby, repeat
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .. import distributed, engines
from ..engines import foreach
from ..engines.ops import FOREACH_OPS
from ..multi_tensor import aligned_offset
from ..specs import KernelSpec, Role
from ..states import master
from ..step_cache import BucketPlan
from .algorithm import decays

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Linear 8-bit codes: Newton–Schulz sees the momentum's largest entries most, which they keep to 1/254 of
# their block's absmax (docs/results/muon-8bit-linear-2026-11-28.md)
MOMENTUM = Role("momentum_buffer", codes="linear")
SPEC = KernelSpec("muon", roles=(MOMENTUM,), scalars=(), elementwise=False)
# Its elementwise first half (muon_momentum), which the fused kernels restate: the param row holds the
# direction it writes, in the param's dtype.
MOMENTUM_SPEC = KernelSpec("muon_momentum", roles=(MOMENTUM,),
                           scalars=("momentum", "one_minus_momentum"), flags=("nesterov",))
# Its elementwise second half (muon_apply), which the fused kernels restate: the grad row holds the
# orthogonalized direction, bf16 whatever the param's dtype.
APPLY_SPEC = KernelSpec("muon_apply", roles=(), scalars=("decay_mul", "step_size"), grad="bf16")


def orthogonalize(matrices, coefficients, eps):
    """The Newton–Schulz iterations of torch.optim.Muon, in bf16, on a batch of matrices
    ``(n, ..., rows, cols)``: each matrix X, transposed to be wide, is scaled to a Frobenius norm
    of at most 1, then each step's coefficients (a, b, c) take it to::

        X ← a·X + (b·A + c·A²)·X,   A = X·Xᵀ

    which drives its singular values towards 1 (to about 0.7–1.2 with the default quintic)."""
    x = matrices.reshape(math.prod(matrices.shape[:-2]), *matrices.shape[-2:]).bfloat16()  # (n, 0, k) too
    if len(x) == 1:  # one matrix: torch's 2-D kernels, as torch.optim.Muon's (a batch of one is slower)
        x = x[0]
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in coefficients:
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(matrices.shape)


def row_blocks(rows: int, split_sizes: Sequence[int] | None, num_heads: int | None) -> tuple[int, ...] | None:
    """The row blocks that a matrix of ``rows`` rows is orthogonalized as: ``split_sizes`` (fused
    projections, such as QKV), or ``num_heads`` equal blocks (heads); None: the whole matrix."""
    if split_sizes is not None:
        return tuple(split_sizes)
    if num_heads is not None:
        return (rows // num_heads,) * num_heads
    return None


def orthogonalize_blocks(matrices, coefficients, eps, split_sizes=None, num_heads=None):
    """:func:`orthogonalize` of each matrix of the batch ``matrices`` as its row blocks (see
    :func:`row_blocks`), each block as a matrix of its own: the blocks of one size make one batch."""
    blocks = row_blocks(matrices.size(-2), split_sizes, num_heads)
    if blocks is None:
        return orthogonalize(matrices, coefficients, eps)
    sizes = sorted(set(blocks))
    if len(sizes) == 1:  # equal blocks are a view: (..., blocks, rows of one, cols)
        return orthogonalize(matrices.unflatten(-2, (len(blocks), sizes[0])), coefficients, eps).flatten(-3, -2)
    parts, results = matrices.split(blocks, dim=-2), [None] * len(blocks)
    for size in sizes:
        same = [i for i, block in enumerate(blocks) if block == size]
        for i, result in zip(same, orthogonalize(torch.stack([parts[i] for i in same], dim=-3), coefficients,
                                                 eps).unbind(-3)):
            results[i] = result
    return torch.cat(results, dim=-2)


def iterations(args: dict) -> Callable[[Tensor], Tensor]:
    """The Newton–Schulz iterations that a step with ``muon_update``'s ``args`` runs on a batch of
    matrices (see :func:`orthogonalize_blocks`)."""
    return partial(orthogonalize_blocks, coefficients=args["coefficients"], eps=args["eps"],
                   split_sizes=args["split_sizes"], num_heads=args["num_heads"])


def matrix_shape(shape, flatten):
    """The matrices Muon orthogonalizes in a param of ``shape``: the param (2-D), a batch of matrices
    over its last two dims (3-D: expert weights), or with ``flatten`` its first dim by the rest
    (convolution weights)."""
    return (shape[0], math.prod(shape[1:])) if flatten else tuple(shape)


def muon_momentum(ops, *, param, grad, scratch, momentum_buffer, momentum, nesterov, grad_scale):
    """Muon's elementwise first half, which the fused kernels restate: the momentum, and the
    direction to orthogonalize, written into ``param`` (a buffer of the param's shape, not the
    param)::

        g = grad · grad_scale           (the clip coefficient, −1 to maximize; None: 1)
        B = B + (1−μ)·(g − B)           momentum_buffer (μ·B + (1−μ)·g, as torch's lerp)
        U = g + μ·(B − g)               with nesterov, else U = B
    """
    if grad_scale is not None:
        ops.copy_(scratch, grad)
        ops.mul_(scratch, grad_scale)
        grad = scratch
    ops.lerp_(momentum_buffer, grad, 1 - momentum)
    if nesterov:
        ops.copy_(param, grad)
        ops.lerp_(param, momentum_buffer, momentum)
    else:
        ops.copy_(param, momentum_buffer)


def muon_apply(ops, *, param, grad, scratch, lr, weight_decay, step_size):
    """Muon's second half, with ``grad`` the orthogonalized direction O (bf16)::

        p = p·(1 − lr·wd)               decoupled weight decay
        p = p − step_size·O             step_size = lr · adjust_lr_fn(rows, cols)
    """
    ops.copy_(scratch, grad)  # in fp32: a traced addcmul would round bf16 · step_size to bf16
    if decays(weight_decay):
        ops.mul_(param, 1 - lr * weight_decay)
    ops.addcmul_(param, scratch, step_size, value=-1)


def momentum_inputs(options: dict, grad_scale: float | Tensor | None) -> tuple[dict, dict]:
    """``muon_momentum``'s arguments and the momentum kernel's flags, from ``options`` (a group, or
    ``muon_arguments``' arguments) and the grad's scale (None: 1)."""
    return (dict(momentum=options["momentum"], nesterov=options["nesterov"], grad_scale=grad_scale),
            dict(nesterov=options["nesterov"]))


def momentum_kernel_scalars(args):
    """``muon_momentum``'s arguments as the fused kernels take them."""
    return dict(momentum=args["momentum"], one_minus_momentum=1 - args["momentum"],
                grad_scale=1.0 if args["grad_scale"] is None else args["grad_scale"])


def apply_kernel_scalars(args):
    """``muon_apply``'s arguments as the fused kernels take them (no weight decay: a factor of 1, exact)."""
    return dict(decay_mul=1 - args["lr"] * args["weight_decay"], step_size=args["step_size"], grad_scale=1.0)


def by_matrix_shape(part: engines.Plan) -> engines.Plan:
    """``part`` with the params of one matrix shape next to each other (else in their order), so that a
    slice's matrices make few batches. Not over shards: each rank's shards have shapes of their own."""
    shapes = [matrix_shape(param.shape, part.args["flatten"]) for param in part.tensors["param"]]
    order = sorted(range(len(shapes)), key=shapes.__getitem__)
    return part if order == list(range(len(shapes))) else part.subset(order)


@dataclass(frozen=True)
class DirectionSlice:
    """One slice of a fused Muon bucket (see :class:`Directions`)."""

    indices: list[int]  # the bucket's params in this slice, by matrix shape
    directions: list[Tensor]  # theirs, views of the bucket's buffer, each its grad's shape
    # per matrix shape: its directions as one batch, their positions, whether each is a matrix of the batch
    # (not a param of another shape whose matrices these are: see matrix_shape)
    batches: list[tuple[Tensor, int, int, bool]]
    momentum: BucketPlan = field(default_factory=BucketPlan)  # the momentum kernel's plan: tables bound once
    update: BucketPlan = field(default_factory=BucketPlan)  # the update kernel's plan: tables bound once
    cut: BucketPlan = field(default_factory=BucketPlan)  # the slice's own: its index on the device (engines.args_of)

    def orthogonalized(self, function: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """``function`` (the iterations, of a batch of matrices) of each batch of this slice's directions,
        per param in its shape, contiguous (a batch of tall matrices ends transposed: one copy of it, not
        one per matrix, for the update kernel, which reads each direction laid out as its param)."""
        orthogonal = [None] * len(self.directions)
        for batch, start, stop, matrices in self.batches:
            results = function(batch).contiguous().unbind()
            orthogonal[start:stop] = results if matrices else [
                result.reshape(direction.shape) for result, direction in zip(results, self.directions[start:stop])]
        return orthogonal


@dataclass(frozen=True)
class Directions:
    """Where a fused Muon bucket writes its directions, made once per bucket and direction ``dtype`` (the
    grads', or fp32 where a clip or GradScaler coefficient scales them first: :func:`scaled_first`) and
    kept in the bucket's plan (``BucketPlan.directions``), made anew when a param or state changes. Its
    params, in matrix-shape order, are cut into slices of at most ``MATRIX_SLICE_NUMEL`` elements (the
    directions' memory is one slice's: the slices share the one buffer, each using it in turn); in a
    slice the directions of
    one matrix shape are consecutive in the buffer, so their batch is a view of it, not a copy, and the
    momentum kernel's tables, bound to views that stay, are bound once."""

    dtype: torch.dtype
    slices: list[DirectionSlice]

    @classmethod
    def of(cls, part: engines.Plan, dtype: torch.dtype) -> Directions:
        """The directions of bucket ``part`` (a fused Muon bucket's plan) in ``dtype``."""
        grads = part.tensors["grad"]
        shapes = [matrix_shape(grad.shape, part.args["flatten"]) for grad in grads]
        order = sorted(range(len(grads)), key=shapes.__getitem__)
        layouts, need = [], 0
        for cut in foreach.slices([grads[i] for i in order], foreach.slice_numel(part.spec)):
            runs = [list(run) for _, run in groupby(order[cut], key=shapes.__getitem__)]
            starts, end = [], 0
            for run in runs:  # each batch starts aligned, its matrices packed
                starts.append(aligned_offset(end, (1,), dtype))
                end = starts[-1] + sum(grads[i].numel() for i in run)
            layouts.append((runs, starts))
            need = max(need, end)
        buffer = torch.empty(need, dtype=dtype, device=grads[0].device)
        slices = []
        for runs, starts in layouts:
            directions, batches = [], []
            for run, start in zip(runs, starts):
                batch = buffer[start:start + len(run) * grads[run[0]].numel()].view(len(run), *shapes[run[0]])
                batches.append((batch, len(directions), len(directions) + len(run),
                                 all(grads[i].shape == batch.shape[1:] for i in run)))
                directions += [matrix.view(grads[i].shape) for matrix, i in zip(batch.unbind(), run)]
            slices.append(DirectionSlice([i for run in runs for i in run], directions, batches))
        return cls(dtype, slices)


def scaled_first(part: engines.Plan) -> bool:
    """Whether fused bucket ``part``'s grads are scaled before its momentum kernel runs: by a clip or
    GradScaler coefficient (a tensor), where the backend's kernel would not round their product as the
    reference does, into fp32 (float64 for float64 grads)."""
    return (isinstance(part.args["grad_scale"], Tensor)
            and not engines.backends.for_device(part.tensors["grad"][0].device).ROUNDS_SCALED_GRADS)


def widened(dtype: torch.dtype) -> bool:
    """Whether grads of ``dtype`` go to Muon's momentum in fp32 on every engine: fp16 ones, whose directions
    in fp16 the iterations would round to bf16 a second time (the reference rounds the fp32 direction once,
    to bf16: fp16's rounding of it can land on a bf16 tie, and its subnormals drop bits that bf16 keeps)."""
    return dtype == torch.float16


def widened_first(part: engines.Plan, engine: str) -> bool:
    """Whether bucket ``part``'s grads go to its momentum, run on ``engine``, in fp32 (float64 for float64
    ones): :func:`widened` ones, and on a fused engine grads scaled first (:func:`scaled_first`)."""
    return widened(part.tensors["grad"][0].dtype) or engine in engines.FUSED and scaled_first(part)


def direction_dtype(part: engines.Plan, engine: str) -> torch.dtype:
    """The dtype of bucket ``part``'s directions, its momentum run on ``engine``: its grads' as that takes them."""
    dtype = part.tensors["grad"][0].dtype
    return torch.promote_types(dtype, torch.float32) if widened_first(part, engine) else dtype


def directions_of(part: engines.Plan, engine: str) -> Directions:
    """The :class:`Directions` of fused bucket ``part`` (on fused ``engine``), kept in its bucket plan for
    their dtype."""
    dtype = direction_dtype(part, engine)
    kept = part.bucket.directions
    if kept is None or kept.dtype != dtype:
        kept = part.bucket.directions = Directions.of(part, dtype)
    return kept


def run_muon_bucket(engine: str, part: engines.Plan, reduce_group=None) -> None:
    """A Muon bucket on a fused engine or over FSDP2 shards runs in three parts (see
    :func:`run_in_three_parts`), slice by slice on a fused engine (see :class:`Directions`); over
    shards, whole (ranks whose shards differ in size would cut it otherwise, and their collectives
    must pair up). The loop and foreach engines, and fused ones in a step that torch.compile
    traces, run ``muon_update`` whole."""
    kernel = engine in engines.FUSED and not part.traced
    if reduce_group is not None:
        run_in_three_parts(engine if kernel else "foreach", part, reduce_group)  # whole: fresh directions
    elif not kernel:  # a traced fused step runs muon_update on foreach, as documented (no fallback warning)
        engines.run_bucket("foreach" if engine in engines.FUSED else engine, by_matrix_shape(part))
    else:
        for piece in directions_of(part, engine).slices:
            whole = piece.indices == list(range(len(part)))
            run_in_three_parts(engine, part if whole else part.cut(piece.indices, owners_bucket=piece.cut),
                               None, piece)


def run_in_three_parts(momentum_engine: str, part: engines.Plan, reduce_group=None,
                       piece: DirectionSlice | None = None) -> None:
    """``muon_momentum`` into the directions of ``piece`` (fresh buffers without it) on ``momentum_engine``
    (the kernel's work on a fused one, its tables kept in ``piece``), the iterations (the matrices of
    one shape as a batch; over shards, each matrix on one owner rank, see distributed.by_owners), then
    ``muon_apply`` on ``momentum_engine`` (the update kernel's tables kept in ``piece``)."""
    grads, args = part.tensors["grad"], part.args
    grad_scale = args["grad_scale"]
    if widened_first(part, momentum_engine):
        grads = [grad.to(torch.promote_types(grad.dtype, torch.float32)) for grad in grads]
        if momentum_engine in engines.FUSED and scaled_first(part):
            grads, grad_scale = torch._foreach_mul(grads, grad_scale), None
    directions = [torch.empty_like(grad) for grad in grads] if piece is None else piece.directions
    momentum = BucketPlan() if piece is None else piece.momentum
    # the params and their master remainders too are watched by native code, though the kernel does not walk
    # them: a bound step updates them after its native call (see BoundMomentum), which must refuse one given
    # other storage (or dtype) before anything runs
    remainders = part.tensors.get(master.KEY) or repeat(None)
    watched = [[param, *(() if remainder is None else (remainder,)), *others] for param, remainder, others
               in zip(part.tensors["param"], remainders, part.watched or repeat(()))]
    momentum_args, flags = momentum_inputs(args, grad_scale)
    engines.run(momentum_engine, replace(
        part, tensors={"param": directions, "grad": grads, "momentum_buffer": part.tensors["momentum_buffer"]},
        watched=watched, update=muon_momentum, spec=MOMENTUM_SPEC, flags=flags,
        kernel_values=momentum_kernel_scalars(momentum_args) if momentum_engine in engines.FUSED else None,
        per_tensor=frozenset(), stochastic_rounding=False, args=momentum_args, bucket=momentum))
    if piece is None:
        orthogonal = orthogonalize_shards(iterations(args), directions, part.bucket.sharded_params, args["flatten"],
                                          reduce_group, part.bucket)
    else:
        orthogonal = piece.orthogonalized(iterations(args))
    warned = momentum.kernel_split is not None and bool(momentum.kernel_split.left)  # of this step's fallback
    apply_update(momentum_engine, replace(part, tensors={role: tensors for role, tensors in part.tensors.items()
                                                         if role not in ("grad", "momentum_buffer")},
                                          warn_fallback=part.warn_fallback and not warned),
                 orthogonal, BucketPlan() if piece is None else piece.update)


def apply_update(engine: str, part: engines.Plan, orthogonal: list[Tensor], bucket: BucketPlan) -> None:
    """``muon_apply`` of the ``orthogonal`` directions to the params of ``part`` (and their master
    remainders), with the params' rounding, on ``engine``: a fused one's kernel (its tables kept in
    ``bucket``) reads them laid out as their params, in bf16 (a tall matrix's iterations end transposed),
    and warns of what it leaves to foreach where ``part.warn_fallback``."""
    args = {name: part.args[name] for name in ("lr", "weight_decay", "step_size")}
    if engine in engines.FUSED and orthogonal:
        orthogonal = [o.contiguous() for o in orthogonal]  # itself where it is
    # the fused engine draws the rounding's seed where its kernel takes tensors: a seed drawn here, for a kernel
    # that took none, moved the generator of the foreach fallback's rounding (helper-102)
    engines.run(engine, replace(part, tensors=part.tensors | {"grad": orthogonal}, update=muon_apply, spec=APPLY_SPEC,
                                kernel_values=apply_kernel_scalars(args) if engine in engines.FUSED else None,
                                flags={}, args=args, absmax={}, bucket=bucket, watched=None, originals=None,
                                rule="", counts=None))


class BoundMomentum(NamedTuple):
    """A fused Muon bucket's part of a bound step (see fastoptim.bound_step): its momentum's tables (those
    of its one slice: see :class:`Directions`), launched in the step's one native call, then its
    iterations and update (:meth:`finish`)."""

    tables: engines.tables.Tables
    positions: list[int]  # of the group's params, the slice's, in its order
    piece: DirectionSlice
    params: dict  # role to the slice's tensors that muon_apply updates: its params (and master remainders)
    engine: str  # the fused engine its update kernel runs on
    # where engines.args_of keeps the index of ``positions`` among the group's: not the slice's own cut,
    # whose index counts from its bucket's first param (a group of two dtypes has two buckets)
    group_cut: BucketPlan
    spec: KernelSpec = MOMENTUM_SPEC
    widen: bool = False  # whether its tables take the grads in fp32 (:func:`widened`), which the step converts

    def launch_values(self, group: dict, grad_scale: float | None, found_inf: Tensor | None,
                      device: torch.device) -> tuple[list, dict]:
        """The momentum kernel's scalars (in its spec's order) and flags for a step of ``group``."""
        args, flags = momentum_inputs(group, grad_scale)
        values = engines.fused.with_common(momentum_kernel_scalars(args), found_inf, False, device)
        return [values[name] for name in MOMENTUM_SPEC.all_scalars], flags

    def finish(self, group: dict, args: dict, per_tensor: set[str]) -> None:
        """The iterations and update of a step whose ``args`` (``muon_arguments``'s, of the whole group)
        the momentum kernel's launch has written its directions for."""
        device = self.params["param"][0].device
        apply_update(self.engine, engines.Plan(self.params, muon_apply, APPLY_SPEC, per_tensor=frozenset(per_tensor),
                                               stochastic_rounding=group["stochastic_rounding"],
                                               args=engines.args_of(args, per_tensor, self.positions, device,
                                                                    self.group_cut)),
                     self.piece.orthogonalized(iterations(args)), self.piece.update)


def bound_momentum(tensors: dict, bucket: list[int], plan: BucketPlan, engine: str) -> BoundMomentum | None:
    """The :class:`BoundMomentum` of a fused Muon bucket (``bucket``: its params' positions in the group,
    ``tensors``: the group's by role, ``plan``: what the engines made of the bucket, ``engine``: its fused
    engine) whose last step made its directions in one slice and ran their momentum and update wholly on
    natively checked tables (a param the update kernel leaves to foreach takes the checked way, which
    warns of it); else None."""
    directions = plan.directions
    if directions is None or len(directions.slices) != 1:
        return None
    # directions wider than the grads: of fp16 ones, which the bound step converts as the checked one does, or
    # of grads scaled first, which it does not scale
    dtype = tensors["param"][bucket[0]].dtype
    widen = directions.dtype != dtype
    if widen and not widened(dtype):
        return None
    piece = directions.slices[0]
    if not (engines.fused.natively_checked(piece.momentum) and engines.fused.natively_checked(piece.update)):
        return None
    positions = [bucket[i] for i in piece.indices]
    params = {role: [tensors[role][i] for i in positions] for role in ("param", master.KEY) if role in tensors}
    if master.keeps_none(params):
        del params[master.KEY]
    return BoundMomentum(piece.momentum.kernel_split.tables, positions, piece, params, engine, BucketPlan(),
                         widen=widen)


def orthogonalize_shards(function, directions: list[Tensor], params: list[Tensor], flatten: bool,
                         group: ProcessGroup, kept: BucketPlan) -> list[Tensor]:
    """``function`` (the iterations, of a batch of matrices) of the matrices of DTensor ``params``
    sharded on dim 0 over ``group``, whose local rows of the direction are ``directions``. A 3-D
    param's matrices are whole on each rank (its experts are cut apart, not its rows): they are
    orthogonalized where they live. The others go whole to one owner each, batched by shape, and
    their rows come back (see distributed.by_owners, whose exchange ``kept`` keeps); they travel in
    bf16, the iterations' first rounding, so the owner computes on the numbers it would have made."""
    shape_of = partial(matrix_shape, flatten=flatten)
    whole = [i for i, param in enumerate(params) if len(shape_of(param.shape)) == 3]
    spread = [i for i, param in enumerate(params) if len(shape_of(param.shape)) == 2]
    results = [None] * len(directions)
    for i, result in zip(whole, FOREACH_OPS.per_matrix(function, [directions[i] for i in whole], shape_of)):
        results[i] = result
    shapes = [shape_of(params[i].shape) for i in spread]
    pieces = [directions[i].reshape(len(directions[i]), cols) for i, (_, cols) in zip(spread, shapes)]
    for i, result in zip(spread, distributed.by_owners(function, pieces, shapes, group, kept, torch.bfloat16)):
        results[i] = result.view(directions[i].shape)
    return results
