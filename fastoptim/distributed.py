"""Scale-out on torch.distributed (DESIGN.md, "Scale-out"): the optimizers run under torch's own
engines, and what needs the other ranks goes through a process group, so the result equals one process.

- ZeroRedundancyOptimizer gives each rank a partition of whole params; the optimizer is told the
  group they partition (``shard_group``), and the squared gradient norm is summed over it.
- FSDP2 (``fully_shard``) makes every param a DTensor sharded on dim 0 over a 1-D device mesh. The
  engines run on the local shards, and the mesh's group is the reduction group. A subset-norm matrix
  with fewer rows than columns sums each column over rows that several ranks hold: those partial
  sums are all-reduced. Rows never straddle a shard, and flattened subsets must not (checked).

States of a DTensor param are DTensors, so torch.distributed.checkpoint sees their global shapes and
can reshard them, as it does torch.optim's under FSDP2: param-shaped states take the param's
placement, a subset-norm second moment is sharded on dim 0 like its param (rows, flattened
subsets) or replicated (columns: every rank holds, and updates alike, all the column sums). The
block maxima of 8-bit states are plain tensors over the local shard's blocks, which other world
sizes cut elsewhere; so ``state_dict()`` hands out the 8-bit states of DTensor params dequantized.
"""
import math
import sys

import torch
import torch.distributed as dist

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
    for plain params, the device mesh's group for DTensor params; None: no other rank takes part."""
    sharded = [param for param in params if is_dtensor(param)]
    if not sharded:
        return shard_group
    from torch.distributed.tensor import Shard
    if len(sharded) != len(params):
        raise ValueError("an optimizer's params must be all DTensors (FSDP2) or all plain tensors, not a mix")
    if shard_group is not None:
        raise ValueError("shard_group names the group that plain params partition (ZeroRedundancyOptimizer); "
                         "DTensor params reduce over their device mesh: leave shard_group unset")
    meshes = {param.device_mesh for param in sharded}
    placements = {param.placements for param in sharded}
    if len(meshes) > 1 or sharded[0].device_mesh.ndim != 1 or placements != {(Shard(0),)}:
        raise ValueError("DTensor params must be sharded on dim 0 over one 1-D device mesh, as FSDP2's fully_shard "
                         f"makes them; got placements {sorted(map(str, placements))} on {len(meshes)} mesh(es)")
    return sharded[0].device_mesh.get_group()


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
    """A zero subset-norm second moment of ``param``: for a DTensor param, a DTensor replicated when
    its subsets span the shards, else sharded on dim 0 as the param is."""
    if not is_dtensor(param):
        return torch.zeros(partition.state_shape, dtype=dtype, device=param.device)
    from torch.distributed.tensor import Replicate, Shard, zeros
    placement = Replicate() if spans_shards(param, partition) else Shard(0)
    return zeros(*partition.state_shape, dtype=dtype, device_mesh=param.device_mesh, placements=[placement])


def shard_sizes(n, world):
    """The lengths of the ``world`` pieces that DTensor's Shard cuts a dim of ``n`` into (torch.chunk's)."""
    size = -(-n // world)
    return [max(0, min(n, (rank + 1) * size) - rank * size) for rank in range(world)]


def check_flattened(param, partition):
    """Raise unless each rank's shard of a DTensor ``param`` holds whole flattened subsets, exactly
    those of its shard of the second moment: then no subset needs another rank."""
    world, rows = param.device_mesh.size(), param.shape[0]
    row, size = param.numel() // rows, partition.b
    if [n * row for n in shard_sizes(rows, world)] != [n * size for n in shard_sizes(param.numel() // size, world)]:
        raise ValueError(f"subset_size cuts a DTensor param of shape {tuple(param.shape)} into subsets of {size} "
                         f"elements, which straddle its {world} dim-0 shards; use subset_size=None (rows or "
                         "columns) or a subset size that divides its rows")


def by_owners(function, pieces, group):
    """``function`` of each whole tensor whose dim-0 pieces the ranks of ``group`` hold (``pieces``:
    this rank's, as DTensor's Shard(0) cuts them), each computed once, on its owner: the tensors go
    to the ranks by size, the largest first to the least loaded. Each piece is sent to its owner
    and its rows of the result come back (padded to the largest piece, asynchronously, so that the
    owners compute at once). Returns this rank's rows of each result, in its pieces' dtype."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = pieces[0].device
    local_rows = torch.tensor([len(piece) for piece in pieces], device=device)
    every_rows = [torch.empty_like(local_rows) for _ in range(world)]
    dist.all_gather(every_rows, local_rows, group=group)
    counts = torch.stack(every_rows).T.tolist()  # per tensor, the rows of each rank
    sizes = [sum(rows) * math.prod(piece.shape[1:]) for rows, piece in zip(counts, pieces)]
    owners, load = [0] * len(pieces), [0] * world
    for i in sorted(range(len(pieces)), key=lambda i: -sizes[i]):
        owners[i] = min(range(world), key=load.__getitem__)
        load[owners[i]] += sizes[i]
    padded = [_padded(piece, max(rows)) for piece, rows in zip(pieces, counts)]
    gathered = {i: [torch.empty_like(block) for _ in range(world)] for i, block in enumerate(padded)
                if owners[i] == rank}
    _wait([dist.gather(block, gathered.get(i), dst=dist.get_global_rank(group, owners[i]), group=group,
                       async_op=True) for i, block in enumerate(padded)])
    results = {}
    for i, blocks in gathered.items():
        result = function(torch.cat([block[:rows] for block, rows in zip(blocks, counts[i])])).to(pieces[i].dtype)
        results[i] = [_padded(rows, len(padded[i])) for rows in result.split(counts[i])]
    received = [torch.empty_like(block) for block in padded]
    _wait([dist.scatter(block, results.get(i), src=dist.get_global_rank(group, owners[i]), group=group,
                        async_op=True) for i, block in enumerate(received)])
    return [block[:len(piece)] for block, piece in zip(received, pieces)]


def _padded(piece, rows):
    """``piece`` with zero rows after it, ``rows`` in all."""
    block = piece.new_zeros((rows, *piece.shape[1:]))
    block[:len(piece)] = piece
    return block


def _wait(works):
    for work in works:
        work.wait()


def sum_over(tensor, group, op="sum"):
    """All-reduce ``tensor`` in place over ``group`` (its sum, or its maximum with ``op='max'``)."""
    dist.all_reduce(tensor, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return tensor
