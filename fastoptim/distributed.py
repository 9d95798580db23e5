"""Scale-out on torch.distributed (DESIGN.md, "Scale-out"): the optimizers run under torch's own
engines, and what needs the other ranks goes through a process group, so the result equals one process.

- ZeroRedundancyOptimizer gives each rank a partition of whole params; the optimizer is told the
  group they partition (``shard_group``), and the squared gradient norm is summed over it.
- FSDP2 (``fully_shard``) makes every param a DTensor sharded on dim 0 over a 1-D device mesh. The
  engines run on the local shards, and the mesh's group is the reduction group. A subset-norm matrix
  with fewer rows than columns sums each column over rows that several ranks hold: those partial
  sums are all-reduced. Rows never straddle a shard, and flattened subsets must not (checked).
- HSDP (``fully_shard`` on a 2-D mesh) shards each param on dim 0 over one mesh dim and replicates
  it over the other: each replica group holds the whole model once, and FSDP2 has averaged the
  grads over the replicas before the step. The reduction group is the shard dim's group (the ranks
  that hold this rank's replica); everything else is as under FSDP2.

States of a DTensor param are DTensors, so torch.distributed.checkpoint sees their global shapes and
can reshard them, as it does torch.optim's under FSDP2: param-shaped states take the param's
placement, a subset-norm second moment is placed as its param (rows, flattened subsets) or
replicated over the whole mesh (columns: every rank holds, and updates alike, all the column sums). The
block maxima of 8-bit states are plain tensors over the local shard's blocks, which other world
sizes cut elsewhere; so ``state_dict()`` hands out the 8-bit states of DTensor params dequantized.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# torch.distributed.tensor is imported where a DTensor is at hand, never before: it adds about a
# second to `import fastoptim`, and until it is loaded no DTensor can exist.


def is_dtensor(tensor):
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def check_shard_group(shard_group):
    if shard_group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_group is given, but torch.distributed is not initialised: call "
                         "torch.distributed.init_process_group first")


def reduction_group(params, shard_group):
    """The group that the global reductions of an optimizer over ``params`` run over: ``shard_group``
    for plain params, for DTensor params the group of the mesh dim that they are sharded over (under
    FSDP2 the whole 1-D mesh; under HSDP the shard dim's group, the ranks that together hold one
    replica of the model); None: no other rank takes part. A DTensor param placed otherwise, or on
    another mesh or mesh dim than the others, is a ValueError naming it and its placement."""
    sharded = [param for param in params if is_dtensor(param)]
    if not sharded:
        return shard_group
    if len(sharded) != len(params):
        raise ValueError("an optimizer's params must be all DTensors (FSDP2) or all plain tensors, not a mix")
    if shard_group is not None:
        raise ValueError("shard_group names the group that plain params partition (ZeroRedundancyOptimizer); "
                         "DTensor params reduce over their device mesh: leave shard_group unset")
    first, dim = sharded[0], None
    for index, param in enumerate(sharded):
        dim = sharded_dim(param)
        if dim is None:
            raise ValueError(f"param {index} (shape {tuple(param.shape)}) is a DTensor placed {param.placements} "
                             f"on {describe(param.device_mesh)}; fastoptim takes DTensor params sharded on dim 0 "
                             "over a 1-D mesh, (Shard(dim=0),), as FSDP2's fully_shard makes them, or over one "
                             "dim of a 2-D mesh and replicated over the other, (Replicate(), Shard(dim=0)), as "
                             "HSDP's makes them")
        if param.device_mesh != first.device_mesh or dim != sharded_dim(first):
            raise ValueError(f"param {index} (shape {tuple(param.shape)}) is a DTensor placed {param.placements} "
                             f"on {describe(param.device_mesh)}, but param 0 (shape {tuple(first.shape)}) is "
                             f"placed {first.placements} on {describe(first.device_mesh)}: an optimizer's "
                             "DTensor params must share one device mesh and be sharded over the same mesh dim")
    return first.device_mesh.get_group(dim)


def sharded_dim(param):
    """The mesh dim over which DTensor ``param``'s dim 0 is cut, when it is placed as fastoptim shards
    (see :func:`reduction_group`): (Shard(0),) on a 1-D mesh, or Shard(0) over one dim of a 2-D mesh
    and Replicate() over the other (HSDP). None for any other placement."""
    from torch.distributed.tensor import Replicate, Shard
    placements = param.placements
    shards = [dim for dim, placement in enumerate(placements) if type(placement) is Shard and placement.dim == 0]
    replicated = [placement for placement in placements if type(placement) is Replicate]
    if param.device_mesh.ndim in (1, 2) and len(shards) == 1 and len(replicated) == len(placements) - 1:
        return shards[0]
    return None


def describe(mesh):
    """A device mesh in words, for messages."""
    names = f" ({', '.join(mesh.mesh_dim_names)})" if mesh.mesh_dim_names else ""
    return f"a {mesh.ndim}-D device mesh of shape {tuple(mesh.shape)}{names}"


def shard_world(param):
    """How many shards DTensor ``param``'s dim 0 is cut into: the size of its sharded mesh dim."""
    return param.device_mesh.size(sharded_dim(param))


def local(tensor):
    """The local shard of a DTensor (a view, under no_grad); any other tensor, or None, as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def like(local_tensor, dtensor):
    """``local_tensor`` as this rank's shard of a DTensor placed as ``dtensor``, of its global shape."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local_tensor, dtensor.device_mesh, dtensor.placements, shape=dtensor.shape,
                              stride=dtensor.stride())


def spans_shards(param, partition):
    """Whether a subset of ``partition`` holds elements of several ranks: columns of a DTensor param."""
    return is_dtensor(param) and partition.record.get("reduce_dim") == 1


def reduced_zeros(param, partition, dtype):
    """A zero subset-norm second moment of ``param``: for a DTensor param, a DTensor replicated over
    the whole mesh when its subsets span the shards, else placed as the param is (sharded on dim 0)."""
    if not is_dtensor(param):
        return torch.zeros(partition.state_shape, dtype=dtype, device=param.device)
    from torch.distributed.tensor import Replicate, zeros
    spans = spans_shards(param, partition)
    placements = [Replicate() if spans else placement for placement in param.placements]
    return zeros(*partition.state_shape, dtype=dtype, device_mesh=param.device_mesh, placements=placements)


def shard_sizes(n, world):
    """The lengths of the ``world`` pieces that DTensor's Shard cuts a dim of ``n`` into (torch.chunk's)."""
    size = -(-n // world)
    return [max(0, min(n, (rank + 1) * size) - rank * size) for rank in range(world)]


def check_flattened(param, partition):
    """Raise unless each rank's shard of a DTensor ``param`` holds whole flattened subsets, exactly
    those of its shard of the second moment: then no subset needs another rank."""
    world, rows = shard_world(param), param.shape[0]
    row, size = param.numel() // rows, partition.b
    held = [n * row for n in shard_sizes(rows, world)]  # the elements each rank's rows hold
    chunks = [n * size for n in shard_sizes(param.numel() // size, world)]  # its second moment's shards'
    if held != chunks:
        raise ValueError(f"subset_size cuts a DTensor param of shape {tuple(param.shape)} into subsets of {size} "
                         f"elements, but its {world} dim-0 shards hold {' + '.join(f'{n / size:g}' for n in held)} "
                         f"subsets, where its second moment, a DTensor cut as torch.chunk cuts its "
                         f"{param.numel() // size} subsets, holds {' + '.join(str(n // size) for n in chunks)}; use "
                         "subset_size=None (rows or columns), or a subset size whose subsets split over the ranks "
                         "as the rows do")


class OwnerExchange:
    """How the ranks of ``group`` hand whole matrices to one owner each and the results back, decided
    once from the matrices' global shapes (``shapes``: (rows, cols) each, rows cut by DTensor's
    Shard(0) over the group, see :func:`shard_sizes`): no rank asks another for a row count. The
    matrices go to the ranks by size, the largest first to the least loaded. Matrices of one shape
    make one shape group; per step and per shape group, one all-to-all carries each rank's rows of
    them to their owners, and one carries the owners' results back (see :meth:`run`)."""

    def __init__(self, shapes: list[tuple[int, int]], group: ProcessGroup) -> None:
        self.key = (tuple(shapes), group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        counts = [shard_sizes(rows, world) for rows, _ in shapes]  # per matrix, the rows each rank holds
        self.local_rows = [rows[rank] for rows in counts]
        owners, load = [0] * len(shapes), [0] * world
        for i in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i])):
            owners[i] = min(range(world), key=load.__getitem__)
            load[owners[i]] += math.prod(shapes[i])
        members = {}
        for i, shape in enumerate(shapes):
            members.setdefault(shape, []).append(i)
        self.groups = [ShapeGroup(shape, indices, [owners[i] for i in indices], [counts[i] for i in indices], group)
                       for shape, indices in members.items()]

    def run(self, function: Callable[[Tensor], Tensor], pieces: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
        """``function`` (of a batch ``(n, rows, cols)`` of whole matrices of one shape) of each matrix
        whose rows ``pieces`` holds of this rank (``(local rows, cols)`` each), computed once, on its
        owner. The rows travel in ``dtype``, and this rank's rows of each result come back in it.
        The next shape group's rows are on their way while the owners compute the current one's; a
        step waits only on the collectives that carry them."""
        for piece, rows in zip(pieces, self.local_rows):
            if len(piece) != rows:
                raise ValueError(f"a sharded matrix has {len(piece)} rows on this rank, where Shard(0) of its "
                                 f"global shape puts {rows}: fastoptim shards as DTensor's Shard(0) does")
        results, returning = [None] * len(pieces), []
        sending = self.groups[0].send(pieces, dtype) if self.groups else None
        for index, shape_group in enumerate(self.groups):
            received, work = sending
            if index + 1 < len(self.groups):
                sending = self.groups[index + 1].send(pieces, dtype)
            work.wait()
            returning.append((shape_group, *shape_group.compute(function, received)))
        for shape_group, back, work in returning:
            work.wait()
            for i, rows in zip(shape_group.sent, back.split(shape_group.sent_sizes)):
                results[i] = rows.view(self.local_rows[i], shape_group.cols)
        return results


class ShapeGroup:
    """The matrices of one shape in an :class:`OwnerExchange`, from this rank's side: what it sends
    each rank (its rows of the matrices that rank owns, by owner then index), what it receives (each
    rank's rows of the matrices it owns, by sender then index), and the order of the received rows
    that makes them whole matrices."""

    def __init__(self, shape, indices, owners, counts, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, (self.rows, self.cols) = group, shape
        self.sent = [i for owner in range(world) for i, o in zip(indices, owners) if o == owner]
        local = dict(zip(indices, (rows[rank] for rows in counts)))
        self.sent_sizes = [local[i] * self.cols for i in self.sent]
        self.sends = [sum(rows[rank] for rows, o in zip(counts, owners) if o == to) * self.cols for to in range(world)]
        owned = [rows for rows, o in zip(counts, owners) if o == rank]
        self.owned = len(owned)
        self.receives = [sum(rows[sender] for rows in owned) * self.cols for sender in range(world)]
        # the received rows: by sender, then matrix; a matrix's rows: by sender (its row order)
        at, received_at = 0, [[None] * world for _ in owned]
        for sender in range(world):
            for j, rows in enumerate(owned):
                received_at[j][sender] = range(at, at + rows[sender])
                at += rows[sender]
        self.received_rows = at
        self.order = torch.tensor([row for ranges in received_at for span in ranges for row in span],
                                  dtype=torch.long)

    def send(self, pieces: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, dist.Work]:
        """Start the all-to-all that carries this rank's rows of the group's matrices to their owners."""
        device = pieces[0].device if pieces else None
        buffer = torch.empty(sum(self.sends), dtype=dtype, device=device)
        if self.sent:
            views = list(buffer.split(self.sent_sizes))
            torch._foreach_copy_(views, [pieces[i].reshape(-1) for i in self.sent])
        received = torch.empty(sum(self.receives), dtype=dtype, device=device)
        return received, self._all_to_all(received, buffer, self.receives, self.sends)

    def compute(self, function: Callable[[Tensor], Tensor], received: Tensor) -> tuple[Tensor, dist.Work]:
        """``function`` of the matrices this rank owns, and the started all-to-all of their rows back."""
        rows = received.view(self.received_rows, self.cols)
        back = torch.empty_like(received)
        if self.owned:
            if self.order.device != received.device:
                self.order = self.order.to(received.device)
            matrices = rows.index_select(0, self.order).view(self.owned, self.rows, self.cols)
            back.view(self.received_rows, self.cols).index_copy_(
                0, self.order, function(matrices).to(received.dtype).reshape(-1, self.cols))  # (tall results are transposed views)
        returned = torch.empty(sum(self.sends), dtype=received.dtype, device=received.device)
        return returned, self._all_to_all(returned, back, self.sends, self.receives)

    def _all_to_all(self, output, input, output_sizes, input_sizes):
        return dist.all_to_all_single(output, input, output_sizes, input_sizes, group=self.group, async_op=True)


def by_owners(function: Callable[[Tensor], Tensor], pieces: list[Tensor], shapes: list[tuple[int, int]],
              group: ProcessGroup, kept, dtype: torch.dtype | None = None) -> list[Tensor]:
    """``function`` of each whole matrix (global ``shapes``) whose rows the ranks of ``group`` hold,
    as DTensor's Shard(0) cuts them (``pieces``: this rank's, ``(local rows, cols)``), each computed
    once, on its owner, the matrices of one shape as one batch (see :class:`OwnerExchange`). The
    exchange is made once and kept in ``kept.owner_exchange`` (a bucket's plan, kept between steps)
    while the shapes and the group stay. Returns this rank's rows of each result, in ``dtype`` (None:
    the pieces'), in which the rows travel."""
    exchange = kept.owner_exchange
    if exchange is None or exchange.key != (tuple(shapes), group):
        exchange = kept.owner_exchange = OwnerExchange(shapes, group)
    return exchange.run(function, pieces, dtype or pieces[0].dtype)


def sum_over(tensor, group, op="sum"):
    """All-reduce ``tensor`` in place over ``group`` (its sum, or its maximum with ``op='max'``)."""
    dist.all_reduce(tensor, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return tensor
