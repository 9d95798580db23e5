"""Compressed master weights for bf16 params (``master_bits``): the fp32 value an optimizer updates
is the bf16 param plus a remainder kept in the param's state under ``master_remainder``.

- 16: no remainder; the fp32 result is rounded into the param (to nearest even, or stochastically).
- 32: a 16-bit remainder, the exact fp32 master. The param holds the master's bits rounded to nearest
  (ties away from zero) into their top half; the signed difference of the two bit patterns lies in
  [-2^15, 2^15) and is the remainder.
- 24: an 8-bit remainder, that difference rounded to its top 8 bits: the master within 2^-8 of the
  param's unit in the last place.

Params of other dtypes keep no remainder: fp32 params are their own master, and fp16's bits do not
split this way (the optimizers refuse fp16 params with ``master_bits`` above 16).

A remainder belongs to the value the optimizer wrote into its param: a param written by anyone else
starts again from the value written, with a zero remainder (:class:`Writes`).
"""
from operator import attrgetter

import torch

from ..specs import REMAINDER

KEY = REMAINDER  # the state-dict key, and the role of the kernels' table row
DTYPES = {32: torch.int16, 24: torch.int8}
BITS = (16, 24, 32)
_HALF = 1 << 15  # added to the bits before their top half is taken: rounds to nearest, ties away from zero
_TOP = -(1 << 16)  # the top 16 bits of an int32
_DROPPED = 8  # low bits of the difference that an 8-bit remainder drops
_VERSION = attrgetter("_version")


def dtype(param, master_bits):
    """The dtype of ``param``'s remainder under ``master_bits``, or None where it keeps none."""
    return DTYPES.get(master_bits) if param.dtype == torch.bfloat16 else None


def zeros(param, master_bits):
    """The remainder of a bf16 param that is its own master so far, laid out as the param (a
    channels_last param's too: the fused kernels walk them as one)."""
    return torch.zeros_like(param, dtype=DTYPES[master_bits])


def widen(param, remainder):
    """The fp32 master of the bf16 ``param`` and its ``remainder``; the param alone where the two
    make a NaN. A NaN param makes one with any remainder; of a number, ``store`` never pairs one
    (a zero's remainder is never negative, an infinity's never positive): it was left beside a
    value written where no version counter saw it (see :class:`Writes`)."""
    low = remainder.to(torch.int32)
    if remainder.dtype == torch.int8:
        low = low << _DROPPED
    master = ((param.view(torch.int16).to(torch.int32) << 16) + low).view(torch.float32)
    return torch.where(master.isnan(), param.float(), master)


def store(param, remainder, master):
    """Write the fp32 ``master`` into the bf16 ``param`` and its ``remainder``. A NaN goes to the
    param as NaN, with a zero remainder."""
    bits = master.view(torch.int32)
    top = (bits + _HALF) & _TOP
    difference = bits - top
    if remainder.dtype == torch.int8:
        difference = ((difference + (1 << (_DROPPED - 1))) >> _DROPPED).clamp_(max=127)
    nan = master.isnan()
    remainder.copy_(difference.masked_fill_(nan, 0))
    param.copy_(torch.where(nan, master, (top >> 16).to(torch.int16).view(torch.bfloat16)))


def convert(remainder, master_bits):
    """``remainder`` in the format ``master_bits`` keeps (a new tensor), or None for 16."""
    if master_bits == 16:
        return None
    target = DTYPES[master_bits]
    if remainder.dtype == target:
        return remainder.clone()
    if target == torch.int8:  # 16 bits to 8: rounded to the top 8
        return ((remainder.to(torch.int32) + (1 << (_DROPPED - 1))) >> _DROPPED).clamp_(max=127).to(torch.int8)
    return remainder.to(torch.int16) << _DROPPED


class Versions:
    """The version counters of the params of one step's work that keep remainders (its bf16 ones):
    ``base``, as read after a step (None before one), and ``counted``, the steps since whose writes
    were counted instead of read. ``owner``: the :class:`Writes` under which no other work's step
    wrote one of them since (else None). ``once``: its last step whose counters were read bumped
    each exactly once, as every engine's step does (not where params share a counter: views of one
    tensor), so the next are counted: each adds one."""

    def __init__(self, params):
        self.params = [param for param in params if param.dtype == torch.bfloat16]
        self.base, self.counted, self.total, self.owner, self.once = None, 0, None, None, False
        self.before = None  # the counters read before this step, or None where their sum was checked

    def version(self, index: int) -> int:
        """The version counter of param ``index`` as this work's last step left it."""
        return self.base[index] + self.counted


class Writes:
    """Which params anyone but the optimizer wrote since its step last did: torch bumps a tensor's
    version counter at every in-place write through it (``copy_``, ``mul_``, ``nn.init``,
    ``module.load_state_dict``), and the optimizer notes each counter after its own write. Such a
    param's remainder belongs to the value it replaced, so the step zeroes it first. A write that
    no counter sees (through ``param.data``, a numpy view, another process) keeps the remainder: its
    master is then within half a unit of the value written, never NaN (see :func:`widen`).

    A step's work checks its :class:`Versions` before the step (:meth:`written`) and notes them
    after it (:meth:`note`). Where its own steps were the last to write its params, each adding one,
    the check is one sum of their counters (counters never go back, so an equal sum means no other
    write), and the note reads nothing. The works that step some of the same params (other patterns
    of grads, released buckets) find each other's notes through ``last``."""

    def __init__(self):
        self.last = {}  # id(param): (the Versions of the work whose step wrote it last, its index there)

    def written(self, versions: Versions) -> list:
        """The params of ``versions`` written since the optimizer's step last wrote them."""
        if versions.owner is self and versions.once and sum(map(_VERSION, versions.params)) == versions.total:
            versions.before = None
            return []
        versions.before = list(map(_VERSION, versions.params))
        return [param for param, version in zip(versions.params, versions.before) if self.moved(param, version)]

    def moved(self, param: torch.Tensor, version: int) -> bool:
        """Whether ``param``'s version counter, at ``version``, moved since a noted step wrote it."""
        last = self.last.get(id(param))
        return last is not None and last[0].version(last[1]) != version

    def note(self, versions: Versions) -> None:
        """Note the version counters of ``versions``' params after its step wrote them."""
        if versions.before is None:  # checked by their sum: the step added one to each
            versions.counted += 1
            versions.total += len(versions.params)
            return
        after = list(map(_VERSION, versions.params))
        versions.once = after == [version + 1 for version in versions.before]
        versions.base, versions.counted, versions.total = after, 0, sum(after)
        if versions.owner is not self:
            for index, param in enumerate(versions.params):
                previous = self.last.get(id(param))
                if previous is not None and previous[0] is not versions:
                    previous[0].owner = None
                self.last[id(param)] = (versions, index)
            versions.owner = self

    def forget_assigned(self, assigned) -> None:
        """Take as they are, whatever was written to them since, the remainders of the params in ``assigned``
        (``OptimizerState.assigned``, emptied here): their state dicts were assigned whole since, a checkpoint's,
        as ZeroRedundancyOptimizer loads one, which goes with the param's value as loaded."""
        if not assigned:  # the common case: nothing to look at
            return
        for param in list(assigned.values()):
            last = self.last.pop(id(param), None)
            if last is not None:
                last[0].owner = None  # its next note notes them all again
        assigned.clear()

    def all_written(self) -> list:
        """Every param written since the optimizer's step last wrote it."""
        return [versions.params[index] for versions, index in self.last.values()
                if self.moved(versions.params[index], versions.params[index]._version)]


def keeps_none(tensors: dict) -> bool:
    """Whether a bucket's ``tensors`` (role to one tensor per param) hold the remainders' role with none in
    it: a group with master_bits keeps them for its bf16 params, and a bucket has one dtype."""
    return KEY in tensors and tensors[KEY][0] is None
