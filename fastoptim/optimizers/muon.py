"""Muon (Jordan et al., 2024): momentum orthogonalized by Newton–Schulz iterations, with the same
signature and results as torch.optim.Muon, and AdamW companions for the params that are not matrices."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import groupby, repeat
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from .. import distributed, engines
from ..engines import foreach
from ..engines.ops import FOREACH_OPS
from ..multi_tensor import aligned_offset
from ..specs import KernelSpec, Role
from ..states import master
from .adamw import ADAMW
from .algorithm import Algorithm, StepInputs
from .base import FastOptimizer
from .checks import check_number
from .step_path import keeps_no_remainders

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
DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's
# adjust_lr_fn: the factor of lr for a matrix of rows × cols, as torch.optim.Muon's (an empty one: no update)
ADJUST_LR = {
    "original": lambda rows, cols: math.sqrt(max(1, rows / cols)) if cols else 1.0,
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    "spectral_unclamped": lambda rows, cols: math.sqrt(rows / cols) if cols else 1.0,  # torch 2.15's
}


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
    if weight_decay:
        ops.mul_(param, 1 - lr * weight_decay)
    ops.addcmul_(param, scratch, step_size, value=-1)


def muon_update(ops, *, param, grad, scratch, momentum_buffer, momentum, nesterov, lr, weight_decay, grad_scale,
                step_size, coefficients, eps, flatten, split_sizes, num_heads):
    """One Muon step, as torch.optim.Muon computes it: :func:`muon_momentum`, then O = NS(U) per
    matrix (see :func:`orthogonalize` and :func:`matrix_shape`, in bf16; per row block with
    ``split_sizes`` or ``num_heads``, see :func:`orthogonalize_blocks`), then :func:`muon_apply`."""
    direction = ops.empty_like(param)
    muon_momentum(ops, param=direction, grad=grad, scratch=scratch, momentum_buffer=momentum_buffer,
                  momentum=momentum, nesterov=nesterov, grad_scale=grad_scale)
    orthogonal = ops.per_matrix(iterations(dict(coefficients=coefficients, eps=eps, split_sizes=split_sizes,
                                                num_heads=num_heads)), direction, partial(matrix_shape, flatten=flatten))
    muon_apply(ops, param=param, grad=orthogonal, scratch=scratch, lr=lr, weight_decay=weight_decay,
               step_size=step_size)


def momentum_inputs(options: dict, grad_scale: float | Tensor | None) -> tuple[dict, dict]:
    """``muon_momentum``'s arguments and the momentum kernel's flags, from ``options`` (a group, or
    ``muon_arguments``' arguments) and the grad's scale (None: 1)."""
    return (dict(momentum=options["momentum"], nesterov=options["nesterov"], grad_scale=grad_scale),
            dict(nesterov=options["nesterov"]))


def momentum_kernel_scalars(args):
    """``muon_momentum``'s arguments as the fused kernels take them."""
    return dict(momentum=args["momentum"], one_minus_momentum=1 - args["momentum"],
                grad_scale=1.0 if args["grad_scale"] is None else args["grad_scale"])


def coefficients(group: dict) -> tuple[tuple[float, float, float], ...]:
    """The group's Newton–Schulz coefficients, one (a, b, c) per step; a ValueError if they are not."""
    given, steps = group["ns_coefficients"], group["ns_steps"]

    def triple(value):
        return (isinstance(value, Sequence) and len(value) == 3 and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) for x in value))

    if triple(given):
        return (tuple(map(float, given)),) * steps
    if isinstance(given, Sequence) and len(given) == steps and all(map(triple, given)):
        return tuple(tuple(map(float, value)) for value in given)
    raise ValueError(f"Invalid ns_coefficients: {given!r} (must be three finite numbers (a, b, c), or "
                     f"ns_steps={steps} such triples, one per step)")


def block_factors(group: dict, param: Tensor) -> list[float]:
    """``adjust_lr_fn``'s factor of lr for each row block of the matrices of ``param`` (one: whole
    matrices): a block steps as a matrix of its own, as dion's and torchtitan's per-head Muon take it."""
    rows, cols = matrix_shape(param.shape, group["flatten"])[-2:]
    adjust = ADJUST_LR[group["adjust_lr_fn"] or "original"]
    return [adjust(block, cols) for block in row_blocks(rows, group["split_sizes"], group["num_heads"]) or (rows,)]


def lr_factor(group: dict, param: Tensor) -> float:
    """``adjust_lr_fn``'s factor of lr for the matrices of ``param``: their blocks' (see
    :func:`block_factors`; blocks whose factors differ are refused when the param is checked)."""
    return block_factors(group, param)[0]


def muon_arguments(group: dict, inputs: StepInputs) -> tuple[dict, set[str]]:
    """``muon_update``'s arguments for a step of Muon: each matrix's step size is lr times its factor,
    rounded where torch.optim.Muon rounds it: a number lr times the factor in float64, a tensor lr
    times it in the lr's dtype (a tensor times a Python number)."""
    factors = inputs.factors.to(inputs.lr.dtype) if isinstance(inputs.lr, Tensor) else inputs.factors
    args = dict(momentum=group["momentum"], nesterov=group["nesterov"], lr=inputs.lr,
                weight_decay=group["weight_decay"], grad_scale=inputs.grad_scale,
                step_size=(inputs.lr * factors).to(inputs.wide), coefficients=coefficients(group),
                eps=group["eps"], flatten=group["flatten"], split_sizes=group["split_sizes"],
                num_heads=group["num_heads"])
    return args, {"step_size"}


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
    tables: dict = field(default_factory=dict)  # the momentum kernel's engine cache: tables bound once
    owners: dict = field(default_factory=dict)  # the slice's index on the device (see engines.args_of)

    def orthogonalized(self, function: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """``function`` (the iterations, of a batch of matrices) of each batch of this slice's directions,
        per param in its shape."""
        orthogonal = [None] * len(self.directions)
        for batch, start, stop, matrices in self.batches:
            results = function(batch).unbind()
            orthogonal[start:stop] = results if matrices else [
                result.reshape(direction.shape) for result, direction in zip(results, self.directions[start:stop])]
        return orthogonal


@dataclass(frozen=True)
class Directions:
    """Where a fused Muon bucket writes its directions, made once per bucket and direction ``dtype`` (the
    grads', or :func:`scaled_dtype` where a clip or GradScaler coefficient scales them first) and kept
    with the bucket's tables, which its user empties when a param or state changes. Its params, in matrix-shape
    order, are cut into slices of at most ``MATRIX_SLICE_NUMEL`` elements (the directions' memory is
    one slice's: the slices share the one buffer, each using it in turn); in a slice the directions of
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


DIRECTIONS = "muon directions"  # a fused bucket's cache: its Directions


def scaled_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of grads of ``dtype`` scaled by a clip or GradScaler coefficient before a fused momentum
    step, as the reference scales them: fp32, or float64 for float64 grads."""
    return torch.promote_types(dtype, torch.float32)


def directions_of(part: engines.Plan) -> Directions:
    """The :class:`Directions` of fused bucket ``part``, kept in its cache for their dtype."""
    dtype = part.tensors["grad"][0].dtype
    dtype = scaled_dtype(dtype) if isinstance(part.args["grad_scale"], Tensor) else dtype
    kept = part.cache.get(DIRECTIONS)
    if kept is None or kept.dtype != dtype:
        kept = part.cache[DIRECTIONS] = Directions.of(part, dtype)
    return kept


def run_muon_bucket(engine: str, part: engines.Plan, reduce_group=None) -> None:
    """A Muon bucket on a fused engine or over FSDP2 shards runs in three parts (see
    :func:`run_in_three_parts`), slice by slice on a fused engine (see :class:`Directions`); over
    shards, whole (ranks whose shards differ in size would cut it otherwise, and their collectives
    must pair up). The loop and foreach engines, and fused ones in a step that torch.compile
    traces, run ``muon_update`` whole."""
    kernel = engine in engines.FUSED and not torch.compiler.is_compiling()
    if reduce_group is not None:
        run_in_three_parts(engine if kernel else "foreach", part, reduce_group)  # whole: fresh directions
    elif not kernel:  # a traced fused step runs muon_update on foreach, as documented (no fallback warning)
        engines.run_bucket("foreach" if engine in engines.FUSED else engine, by_matrix_shape(part))
    else:
        for piece in directions_of(part).slices:
            whole = piece.indices == list(range(len(part)))
            run_in_three_parts(engine, part if whole else part.cut(piece.indices, owners_cache=piece.owners),
                               None, piece)


def run_in_three_parts(momentum_engine: str, part: engines.Plan, reduce_group=None,
                       piece: DirectionSlice | None = None) -> None:
    """``muon_momentum`` into the directions of ``piece`` (fresh buffers without it) on ``momentum_engine``
    (the kernel's work on a fused one, its tables kept in ``piece``), the iterations (the matrices of
    one shape as a batch; over shards, each matrix on one owner rank, see distributed.by_owners), then
    ``muon_apply`` on the foreach engine (with the params' rounding or master remainders)."""
    kernel = momentum_engine in engines.FUSED
    grads, args = part.tensors["grad"], part.args
    grad_scale = args["grad_scale"]
    if kernel and isinstance(grad_scale, Tensor):  # a clip or GradScaler coefficient: the kernel would fuse
        grads = torch._foreach_mul([grad.to(scaled_dtype(grad.dtype)) for grad in grads], grad_scale)  # the product
        grad_scale = None  # into the lerp; the reference rounds it first, in fp32 (float64 for float64 grads)
    directions = [torch.empty_like(grad) for grad in grads] if piece is None else piece.directions
    # the params too are watched by native code, though the kernel does not walk them: a bound step updates
    # them after its native call (see BoundMomentum), which must refuse a param given other storage
    watched = [[param, *others] for param, others in zip(part.tensors["param"], part.watched or repeat(()))]
    momentum_args, flags = momentum_inputs(args, grad_scale)
    engines.run(momentum_engine, replace(
        part, tensors={"param": directions, "grad": grads, "momentum_buffer": part.tensors["momentum_buffer"]},
        watched=watched, update=muon_momentum, spec=MOMENTUM_SPEC, kernel_scalars=momentum_kernel_scalars,
        flags=flags, per_tensor=frozenset(), stochastic_rounding=False, args=momentum_args,
        cache={} if piece is None else piece.tables))
    if piece is None:
        orthogonal = orthogonalize_shards(iterations(args), directions, part.cache[SHARDED_PARAMS], args["flatten"],
                                          reduce_group, part.cache)
    else:
        orthogonal = piece.orthogonalized(iterations(args))
    apply_update(replace(part, tensors={role: tensors for role, tensors in part.tensors.items()
                                        if role not in ("grad", "momentum_buffer")}), orthogonal)


def apply_update(part: engines.Plan, orthogonal: list[Tensor]) -> None:
    """``muon_apply`` of the ``orthogonal`` directions to the params of ``part`` (and their master
    remainders), on the foreach engine, with the params' rounding."""
    engines.run("foreach", replace(part, tensors=part.tensors | {"grad": orthogonal}, update=muon_apply, absmax={},
                                   args={name: part.args[name] for name in ("lr", "weight_decay", "step_size")}))


class BoundMomentum(NamedTuple):
    """A fused Muon bucket's part of a bound step (see fastoptim.bound_step): its momentum's tables (those
    of its one slice: see :class:`Directions`), launched in the step's one native call, then its
    iterations and update (:meth:`finish`)."""

    tables: engines.tables.Tables
    positions: list[int]  # of the group's params, the slice's, in its order
    piece: DirectionSlice
    params: dict  # role to the slice's tensors that muon_apply updates: its params (and master remainders)
    spec: KernelSpec = MOMENTUM_SPEC

    def launch_values(self, group: dict, grad_scale: float | None, found_inf: Tensor | None,
                      device: torch.device) -> tuple[list, dict]:
        """The momentum kernel's scalars (in its spec's order) and flags for a step of ``group``."""
        args, flags = momentum_inputs(group, grad_scale)
        return engines.fused.ordered_scalars(MOMENTUM_SPEC, momentum_kernel_scalars, args, found_inf, False,
                                             device), flags

    def finish(self, group: dict, args: dict, per_tensor: set[str]) -> None:
        """The iterations and update of a step whose ``args`` (``muon_arguments``'s, of the whole group)
        the momentum kernel's launch has written its directions for."""
        device = self.params["param"][0].device
        apply_update(engines.Plan(self.params, muon_apply, SPEC, per_tensor=frozenset(per_tensor),
                                  stochastic_rounding=group["stochastic_rounding"],
                                  args=engines.args_of(args, per_tensor, self.positions, device, self.piece.owners)),
                     self.piece.orthogonalized(iterations(args)))


def bound_momentum(tensors: dict, bucket: list[int], cache: dict) -> BoundMomentum | None:
    """The :class:`BoundMomentum` of a fused Muon bucket (``bucket``: its params' positions in the group,
    ``tensors``: the group's by role, ``cache``: the bucket's engine cache) whose last step made its
    directions in one slice and ran their momentum wholly on natively checked tables; else None."""
    directions = cache.get(DIRECTIONS)
    if directions is None or len(directions.slices) != 1:
        return None
    piece = directions.slices[0]
    if not engines.fused.natively_checked(piece.tables):
        return None
    positions = [bucket[i] for i in piece.indices]
    params = {role: [tensors[role][i] for i in positions] for role in ("param", master.KEY) if role in tensors}
    if keeps_no_remainders(params):
        del params[master.KEY]
    return BoundMomentum(piece.tables["prepared"].tables, positions, piece, params)


SHARDED_PARAMS = "sharded params"  # a sharded bucket's cache: its DTensor params (see Muon._use_new_states)


def orthogonalize_shards(function, directions: list[Tensor], params: list[Tensor], flatten: bool,
                         group: ProcessGroup, cache: dict) -> list[Tensor]:
    """``function`` (the iterations, of a batch of matrices) of the matrices of DTensor ``params``
    sharded on dim 0 over ``group``, whose local rows of the direction are ``directions``. A 3-D
    param's matrices are whole on each rank (its experts are cut apart, not its rows): they are
    orthogonalized where they live. The others go whole to one owner each, batched by shape, and
    their rows come back (see distributed.by_owners, whose exchange ``cache`` keeps); they travel in
    bf16, the iterations' first rounding, so the owner computes on the numbers it would have made."""
    shape_of = partial(matrix_shape, flatten=flatten)
    whole = [i for i, param in enumerate(params) if len(shape_of(param.shape)) == 3]
    spread = [i for i, param in enumerate(params) if len(shape_of(param.shape)) == 2]
    results = [None] * len(directions)
    for i, result in zip(whole, FOREACH_OPS.per_matrix(function, [directions[i] for i in whole], shape_of)):
        results[i] = result
    shapes = [shape_of(params[i].shape) for i in spread]
    pieces = [directions[i].reshape(len(directions[i]), cols) for i, (_, cols) in zip(spread, shapes)]
    for i, result in zip(spread, distributed.by_owners(function, pieces, shapes, group, cache, torch.bfloat16)):
        results[i] = result.view(directions[i].shape)
    return results


MUON = Algorithm(SPEC, muon_update, muon_arguments, param_factors=lr_factor,
                 factor_options=("adjust_lr_fn", "flatten", "split_sizes", "num_heads"),
                 run=run_muon_bucket, bound_part=bound_momentum)
COMPANIONS = ADAMW._replace(flags=lambda group: dict(amsgrad=False, first_moment=True))  # use_muon=False groups


def with_companion_eps(group: dict, eps: float) -> dict:
    """``group`` with AdamW's ``eps``, and ``adamw_eps``, its alias in a ``use_muon=False`` group, kept equal."""
    return group | {"eps": eps, "adamw_eps": eps}


class Muon(FastOptimizer):
    """Muon with torch.optim.Muon's signature and results (see
    [muon_update][fastoptim.optimizers.muon.muon_update]), and AdamW for the params that are not
    hidden matrices, in the same optimizer: a param group with ``use_muon=False`` runs fastoptim's
    AdamW with the group's ``lr``, ``betas``, ``eps`` and ``weight_decay``, as Keller Jordan's
    MuonWithAuxAdam takes such groups (there is no Newton–Schulz floor in them).

    Args:
        params: parameters or param groups (dicts with per-group options). A Muon group takes
            matrices: 2-D params, 3-D params as batches of matrices over their last two dims (expert
            weights), and with ``flatten`` any param of 2+ dims as its first dim by the rest.
            Embeddings, the output head and 1-D params belong in a ``use_muon=False`` group.
        lr: learning rate, a float or a one-element tensor.
        weight_decay: decoupled: ``p·(1 − lr·wd)`` before the update.
        momentum: μ, the momentum buffer's decay, in [0, 1).
        nesterov: orthogonalize the Nesterov blend ``g + μ·(B − g)`` instead of the buffer.
        ns_coefficients: the Newton–Schulz step's (a, b, c), for every step; or a sequence of
            ``ns_steps`` such triples, one per step (schedules such as Polar Express's).
        eps: the floor of the norm each matrix is divided by before the iterations.
        ns_steps: the number of Newton–Schulz steps, 1 to 99.
        adjust_lr_fn: the lr's factor for a matrix of rows × cols: ``"original"`` (None):
            √max(1, rows/cols); ``"match_rms_adamw"``: 0.2·√max(rows, cols), so that AdamW's lr
            and weight decay carry over; ``"spectral_unclamped"`` (torch 2.15's): √(rows/cols),
            the original without its clamp, so a wide matrix steps by less than lr.
        flatten: orthogonalize a param of 3+ dims as its first dim by the rest (convolution
            weights) instead of as a batch of matrices.
        split_sizes: orthogonalize each matrix as row blocks of these sizes (a fused QKV
            projection), which sum to its rows, each block as a matrix of its own, the lr scaled by
            ``adjust_lr_fn`` of the block's shape (as dion's and torchtitan's per-head Muon); blocks
            whose factors differ are refused. None: whole matrices.
        num_heads: the same with this many equal row blocks (attention heads), which divide the rows.
        use_muon: False for a group of AdamW companions (usually set per group).
        betas: the AdamW companions' (β1, β2).
        adamw_eps: the eps of the AdamW companion groups that set none (``eps`` here is the
            Newton–Schulz floor; in a ``use_muon=False`` group, ``eps`` is AdamW's, and
            ``adamw_eps`` its alias: a group giving both, apart, is refused).
        (the arguments of every fastoptim optimizer)

    The loop engine (``foreach=False, fused=False``) orthogonalizes one matrix at a time; every
    other engine stacks the matrices of one shape into a batch. The fused engines run the momentum
    (``muon_momentum``, the elementwise half, with 8-bit states inside the kernel) in the C or Triton
    kernel, and the AdamW companions on theirs; a step that torch.compile traces runs the Muon
    groups as foreach. ``sn`` and ``state_bits`` apply to the
    companions' states; ``state_bits`` to the momentum buffer too. State per parameter: Muon's
    ``momentum_buffer``, as torch.optim.Muon's, whose state dicts load; the companions' are
    AdamW's. Under ZeRO (``shard_group``) each rank steps whole params. Under FSDP2, each matrix goes
    whole to one owner rank (the matrices spread over the ranks by size, decided once from their
    global shapes), which orthogonalizes its matrices of one shape as one batch, and its rows come
    back: one all-to-all each way per shape group and step, with no host sync; the results are one
    process's (see :func:`orthogonalize_shards`).
    """

    algorithm = MUON

    def __init__(self, params: ParamsT, lr: float | Tensor = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: Sequence[float] | Sequence[Sequence[float]] = DEFAULT_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *, flatten: bool = False,
                 split_sizes: Sequence[int] | None = None, num_heads: int | None = None,
                 use_muon: bool = True, betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None,
                 max_grad_norm: float = 0.0, stochastic_rounding: bool = False, master_bits: int = 16,
                 sn: bool = False, subset_size: int | None = None, state_bits: int = 32,
                 shard_group: ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        flatten=flatten, split_sizes=split_sizes, num_heads=num_heads, use_muon=use_muon, betas=betas, adamw_eps=adamw_eps, maximize=maximize,
                        foreach=foreach, fused=fused, max_grad_norm=max_grad_norm,
                        stochastic_rounding=stochastic_rounding, master_bits=master_bits, sn=sn,
                        subset_size=subset_size, state_bits=state_bits)
        super().__init__(params, defaults, shard_group)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group; in a ``use_muon=False`` one, ``eps`` (or ``adamw_eps``, its alias) is
        AdamW's, the constructor's ``adamw_eps`` where it gives neither."""
        if param_group.get("use_muon", self.defaults["use_muon"]) is False:
            given = {name: param_group[name] for name in ("eps", "adamw_eps") if name in param_group}
            if len(given) == 2 and given["eps"] != given["adamw_eps"]:
                raise ValueError(f"Invalid eps: {given['eps']!r} and adamw_eps {given['adamw_eps']!r} in a "
                                 "use_muon=False group, where adamw_eps is an alias of eps (AdamW's): give one")
            param_group = with_companion_eps(param_group, next(iter(given.values()), self.defaults["adamw_eps"]))
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict (see :class:`FastOptimizer`), its ``use_muon=False`` groups' eps taken from
        their ``adamw_eps`` where saved: saved before eps was AdamW's in such a group, ``eps`` holds the
        Newton–Schulz floor there (later saves keep the two equal). A group that saved neither (another
        optimizer's) gets this optimizer's ``adamw_eps``."""
        groups = [with_companion_eps(group, group.get("adamw_eps", group.get("eps", self.defaults["adamw_eps"])))
                  if group.get("use_muon", self.defaults["use_muon"]) is False else group
                  for group in state_dict["param_groups"]]
        super().load_state_dict(state_dict | {"param_groups": groups})

    def _check_between_steps(self, group, params):
        super()._check_between_steps(group, params)
        check_row_blocks(group)  # set since it was added (a change makes the factors and checks the params again)
        if not group["use_muon"] and group["eps"] != group["adamw_eps"]:  # one of them set since it was added
            raise ValueError(f"Invalid eps: {group['eps']!r} and adamw_eps {group['adamw_eps']!r} in a use_muon=False "
                             "group, where adamw_eps is an alias of eps (AdamW's): set both")

    def _algorithm(self, group):
        return MUON if group["use_muon"] else COMPANIONS

    def _use_new_states(self, group, entry, traced):
        # a sharded bucket's exchange is planned from its params' global shapes, which its plan's local
        # shards do not tell: its cache (kept between steps, made anew with the buckets) holds them
        super()._use_new_states(group, entry, traced)
        for index, (bucket, reduce_group) in enumerate(entry.buckets):
            if reduce_group is not None:
                entry.bucket_caches.setdefault(index, {})[SHARDED_PARAMS] = [entry.params[i] for i in bucket]

    def _check_group(self, group, max_grad_norm=None):
        super()._check_group(group, max_grad_norm)
        if not isinstance(group["use_muon"], bool):
            raise ValueError(f"Invalid use_muon: {group['use_muon']!r} (must be True or False)")
        for name in ("nesterov", "flatten"):
            if not isinstance(group[name], bool):
                raise ValueError(f"Invalid {name}: {group[name]!r} (must be True or False)")
        check_number("adamw_eps", group["adamw_eps"])
        check_number("momentum", group["momentum"], below=1.0)
        steps = group["ns_steps"]
        if type(steps) is not int or not 1 <= steps < 100:
            raise ValueError(f"Invalid ns_steps: {steps!r} (must be an int from 1 to 99)")
        coefficients(group)
        if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR:
            *others, last = map(repr, ADJUST_LR)
            raise ValueError(f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (must be None, {', '.join(others)} "
                             f"or {last})")
        check_row_blocks(group)
        if group["use_muon"]:
            for param in group.get("params", ()):
                self._check_matrix(param, group)

    def _check_state(self, param, state, group):
        # a param reshaped (.data =) or appended to the group since it was checked, or flatten turned off
        if group["use_muon"]:
            self._check_matrix(param, group)
        super()._check_state(param, state, group)

    @staticmethod
    def _check_matrix(param, group):
        """Refuse a param that a Muon group cannot orthogonalize, saying where it belongs, or cannot
        cut into its row blocks."""
        flatten = group["flatten"]
        if param.dim() < 2 or param.dim() > 3 and not flatten:
            raise ValueError(
                f"Muon orthogonalizes matrices, and a param of shape {tuple(param.shape)} is not one: put 1-D params "
                "(and embeddings and the output head) in a param group with use_muon=False, which runs AdamW"
                + ("" if param.dim() < 2 else ", or set flatten=True to take it as its first dim by the rest"))
        if param.is_complex():
            raise ValueError("Muon does not support complex params: put them in a use_muon=False group (AdamW)")
        rows = matrix_shape(param.shape, flatten)[-2]
        if group["split_sizes"] is not None and sum(group["split_sizes"]) != rows:
            raise ValueError(f"Invalid split_sizes: {group['split_sizes']!r} sum to {sum(group['split_sizes'])}, and a "
                             f"param of shape {tuple(param.shape)} has matrices of {rows} rows: they must sum to its rows")
        if group["num_heads"] is not None and rows % group["num_heads"]:
            raise ValueError(f"Invalid num_heads: {group['num_heads']!r} does not divide the {rows} rows of the "
                             f"matrices of a param of shape {tuple(param.shape)}")
        if len(set(block_factors(group, param))) > 1:
            raise ValueError(f"Invalid split_sizes: {group['split_sizes']!r} cut the matrices of a param of shape "
                             f"{tuple(param.shape)} into blocks whose adjust_lr_fn={group['adjust_lr_fn']!r} factors "
                             "differ, and a param steps by one factor: put the blocks in params of their own, or use "
                             "an adjust_lr_fn that gives them one factor")


def check_row_blocks(group: dict) -> None:
    """Raise unless the group's ``split_sizes`` (positive ints, kept as a tuple) and ``num_heads`` (a
    positive int) are valid, and at most one is set, in a Muon group."""
    sizes, heads = group["split_sizes"], group["num_heads"]
    if sizes is not None:
        if (not isinstance(sizes, Sequence) or isinstance(sizes, str) or not sizes
                or not all(type(size) is int and size > 0 for size in sizes)):
            raise ValueError(f"Invalid split_sizes: {sizes!r} (must be None or a non-empty sequence of positive ints, "
                             "the row blocks' sizes)")
        group["split_sizes"] = tuple(sizes)
    if heads is not None and (type(heads) is not int or heads < 1):
        raise ValueError(f"Invalid num_heads: {heads!r} (must be None or a positive int)")
    if sizes is not None and heads is not None:
        raise ValueError("split_sizes and num_heads both cut a matrix into row blocks: give one")
    if not group["use_muon"] and (sizes is not None or heads is not None):
        raise ValueError("split_sizes and num_heads cut Muon's matrices, and a use_muon=False group (AdamW) has none")
