"""Subset-norm second moments, as the seed's AdamwSN defines them: one entry per subset of a
param's elements, fed with the sum of the subset's squared gradients, instead of one per element.
A d-element matrix then keeps O(√d) second-moment entries.

A partition views the param as an (a, b, c) array whose subsets are the b elements ``[i, :, k]``;
the second moment has shape (a, c) and is read as (a, 1, c), broadcast over its subset.

- ``subset_size=None``, the seed's simple partition: a 2-D (m, n) param is summed over its smaller
  dimension, so the state has one entry per row when m >= n (shape (m, 1); ``reduce_dim = 0`` in the
  seed's terms) and one per column otherwise (shape (1, n); ``reduce_dim = 1``). Other shapes keep
  one entry per element.
- ``subset_size=k > 0``, the seed's general version: the param, flattened, is cut into consecutive
  subsets of s elements, s the largest divisor of its element count that is at most k. The state
  has shape (numel/s, 1).
- ``subset_size=-k``: the same with k' = max(1, int(√numel / k)): ``-1`` gives subsets of about
  √numel elements, so about √numel entries. (The seed's README says -1 means half the hidden
  size, while its code takes √numel; we follow the code.)

A flattened partition cuts the param in its row-major order, so it needs a contiguous param. Under
FSDP2's dim-0 sharding (see fastoptim.distributed), the partition is the one of the whole param,
as in one process. A row partition (m >= n) never straddles a shard; a column partition does, and
its sums are all-reduced; flattened subsets must fall within shards.

The state records the partition (``reduce_dim`` or ``subset_size``, Python ints), so a resumed run
keeps it whatever the group's options are then. A param with no record has a dense second moment.
"""
import math
from dataclasses import dataclass

import torch

RECORDS = ("reduce_dim", "subset_size")


@dataclass(frozen=True)
class Partition:
    a: int
    b: int
    c: int
    record: dict  # what the state keeps of it: {"reduce_dim": r} or {"subset_size": s}

    @property
    def state_shape(self):
        return torch.Size((self.a, self.c))

    def view_param(self, tensor):
        """A param-shaped tensor, or its local shard, as (a, b, c): a row or column partition keeps any
        strides."""
        if "reduce_dim" in self.record:
            return tensor.unsqueeze(2 if self.record["reduce_dim"] == 0 else 0)
        return tensor.view(-1, self.b, self.c)

    def view_grad(self, grad):
        """A grad as :meth:`view_param` takes its param; a copy where its strides allow no such view (a
        transposed grad of a flattened partition): the step only reads it."""
        if "reduce_dim" in self.record:
            return self.view_param(grad)
        return grad.reshape(-1, self.b, self.c)

    @staticmethod
    def view_state(tensor):
        """The second moment, (a, c), as (a, 1, c): broadcast over each subset."""
        return tensor.unsqueeze(1)


def largest_divisor(n, limit):
    """The largest divisor of n that is at most ``limit`` (n > 0, limit >= 1)."""
    return max(x for d in range(1, math.isqrt(n) + 1) if n % d == 0 for x in (d, n // d) if x <= limit)


def check_subset_size(subset_size):
    if subset_size is not None and (isinstance(subset_size, bool) or not isinstance(subset_size, int)
                                    or subset_size == 0):
        raise ValueError(f"Invalid subset_size: {subset_size!r} (must be None, k > 0 for subsets of at most k "
                         "elements, or -k for subsets of about √numel/k)")


def from_options(shape, subset_size):
    """The partition of a new param of ``shape`` under a group's ``subset_size``; None: dense."""
    numel = shape.numel()
    if numel == 0:
        return None
    if subset_size is None:
        if len(shape) != 2:
            return None
        return from_record(shape, {"reduce_dim": 0 if shape[0] >= shape[1] else 1})
    limit = subset_size if subset_size > 0 else max(1, int(math.sqrt(numel) / -subset_size))
    return from_record(shape, {"subset_size": largest_divisor(numel, limit)})


def from_record(shape, state):
    """The partition a state records; None when it records none, or subsets of one element (a
    dense second moment, as for an (m, 1) param's rows)."""
    if "reduce_dim" in state:
        m, n = shape
        partition = Partition(m, n, 1, {"reduce_dim": 0}) if state["reduce_dim"] == 0 else Partition(
            1, m, n, {"reduce_dim": 1})
    elif "subset_size" in state:
        size = state["subset_size"]
        partition = Partition(shape.numel() // size, size, 1, {"subset_size": size})
    else:
        return None
    return partition if partition.b > 1 else None


def check_record(shape, state):
    """Raise a ValueError unless the state's record is a partition of a param of ``shape``."""
    if "reduce_dim" in state and "subset_size" in state:
        raise ValueError("a state records both reduce_dim and subset_size")
    if "reduce_dim" in state and (len(shape) != 2 or state["reduce_dim"] not in (0, 1)):
        raise ValueError(f"reduce_dim {state['reduce_dim']!r} does not partition a param of shape {tuple(shape)}")
    if "subset_size" in state:
        size = state["subset_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or shape.numel() % size:
            raise ValueError(f"subset_size {size!r} does not divide a param of shape {tuple(shape)}")


def needs_contiguous(partition):
    return partition is not None and "subset_size" in partition.record
