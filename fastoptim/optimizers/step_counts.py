"""A group's step counts, in one place: where they live (torch's per-param ``state["step"]``, official
Adan's per-group ``group["step"]``), what a step reads of them and how it advances them, once per
step, after its update. Each count stays where the user sees it, so a count set by hand is the one
the next step reads: a per-group count is read from the group at every step, and per-param counts
that moved to storage of their own are seen (:meth:`StepCounts.in_place`) and the plan made again."""
import torch
from torch import Tensor

from .algorithm import PER_GROUP, PER_PARAM
from .checks import check_whole_count, is_step_count, step_count, whole_counts

_LIBRARY = torch.library.Library("fastoptim", "FRAGMENT")
_LIBRARY.define("count_up(Tensor(a!)[] counts, Tensor? increment) -> ()")


def _count_up(counts, increment):
    torch._foreach_add_(counts, 1 if increment is None else increment)


_LIBRARY.impl("count_up", _count_up, "CompositeExplicitAutograd")
torch.library.register_fake("fastoptim::count_up", lambda counts, increment: None, lib=_LIBRARY)


def group_count(group: dict) -> Tensor:
    """A ``PER_GROUP`` algorithm's step count: ``group["step"]``, a 0-d fp32 tensor on the group's
    device (created at 0). One that the user set as a number (official Adan keeps an int) or as
    another tensor is taken as such a tensor, as a loaded one is, or refused with a ValueError (see
    ``checks.step_count``).

    Args:
        group: the param group, whose ``"step"`` is replaced by the tensor returned where it was not one.
    """
    count = group.get("step", 0)
    device = group["params"][0].device if group["params"] else getattr(count, "device", None)
    if not is_step_count(count, device):
        # a count every later step advances in place, whatever its mode; inline, not outside_inference_mode's
        # check of the mode, which dynamo cannot trace (a traced step reads the count here)
        with torch.inference_mode(False):
            group["step"] = count = step_count(count, device)
    return count


def check_group_count(group: dict, groups: list[dict]) -> None:
    """:func:`group_count`, given a tensor of its own where another of ``groups`` holds the same one
    (``group["step"] = other["step"]``: official Adan keeps an int, so there that write gives the group
    the other's value, each then advanced once a step, where a shared tensor would be advanced once per
    group), and its value refused by name unless it is a whole number >= 0 where it is on the CPU
    (another device's is not read: that would wait for it): a count assigned as a tensor, or written in
    place. Eagerly only: a traced step reads no value.

    Args:
        group: the param group (see :func:`group_count`).
        groups: every param group of the optimizer.
    """
    count = group_count(group)
    if count.is_inference():  # the step would advance it in place midway, its params already written (helper-99)
        raise ValueError("Invalid step: the group's count is an inference tensor (made under torch.inference_mode()), "
                         "which a step cannot advance in place: give it one made outside inference mode")
    if any(other is not group and isinstance(held := other.get("step"), Tensor) and held.data_ptr() == count.data_ptr()
           for other in groups):
        group["step"] = count = count.clone()
    if count.device.type == "cpu":
        check_whole_count(count.item())


def slot_pointers(counts: Tensor) -> list[int]:
    """The data pointers of the elements of ``counts``, a contiguous 1-d tensor."""
    start, size = counts.data_ptr(), counts.element_size()
    return list(range(start, start + size * len(counts), size))


def are_slots(counts: Tensor, tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` are the elements of ``counts``, a 1-d tensor, in order, in its storage now.
    ``set_`` or ``.data =`` on one of them gives it storage of its own (its ``_base`` stays): their
    data pointers tell."""
    return (counts.dim() == 1 and counts.is_contiguous() and len(counts) == len(tensors)
            and list(map(Tensor.data_ptr, tensors)) == slot_pointers(counts))


def own_counts(states) -> None:
    """Give each param its own count where several share one tensor (set for all by hand, in one
    group or across groups), as a step that packs them does: a traced step, which leaves counts apart
    (see :meth:`StepCounts.of_states`), would advance a shared one once per param.

    Args:
        states: every param's state dict (an optimizer's ``state.values()``), changed in place.
    """
    held = set()
    for state in states:
        count = state.get("step")
        if isinstance(count, Tensor):
            if count.data_ptr() in held:
                state["step"] = count = count.clone()
            held.add(count.data_ptr())


class StepCounts:
    """The step counts of a group's params with grads, under its algorithm's ``kind`` of count
    (``PER_PARAM``, ``PER_GROUP`` or None: it counts none).

    ``PER_PARAM``: ``slots``, each param's ``state["step"]`` (a 0-d fp32 tensor), which are the
    elements of one 1-d tensor (``packed``, see :meth:`of_states`), so a step reads and advances
    them as one tensor (2000 separate 0-d tensors cost milliseconds of dispatch); a traced step may
    leave them apart (``packed`` None). ``PER_GROUP``: the group's, read from it at every step.
    """

    def __init__(self, kind: str | None, slots: list[Tensor] | None = None, packed: Tensor | None = None):
        self.kind, self.slots, self.packed = kind, slots, packed
        self._owners = None if packed is None else [packed, *slots]
        self._pointers = None if packed is None else [packed.data_ptr(), *slot_pointers(packed)]

    @classmethod
    def of_states(cls, kind: str | None, params: list[Tensor], states: list[dict], traced: bool) -> "StepCounts":
        """The counts of ``params`` (those of a group with grads) in their ``states``, a ``PER_PARAM``
        count converted where one was set by hand (a number, another dtype: ``_check_state`` has checked
        it) and the counts made slots of one tensor where they are not, in the state dicts; a
        ``traced`` step leaves counts it finds apart as they are (they are then stacked in the graph:
        the step traced for another pattern of grads, a GAN's halves, guards the state dicts, which
        packing changes; see :func:`own_counts`)."""
        if kind != PER_PARAM:
            return cls(kind)
        for param, state in zip(params, states):
            if not is_step_count(state["step"], param.device):
                state["step"] = step_count(state["step"], param.device)
        slots = [state["step"] for state in states]
        packed = slots[0]._base
        if packed is None or not are_slots(packed, slots):
            packed = None if traced else torch.stack(slots)
            for i, state in enumerate(states if packed is not None else ()):
                state["step"] = packed[i]
            slots = [state["step"] for state in states]
        return cls(kind, slots, packed)

    def read(self, group: dict) -> list[Tensor]:
        """The counts a step of ``group`` reads (see ``scalars.one_count``): the group's, the params'
        as one tensor, or one each; none where it counts none (or has no params with grads)."""
        if self.kind == PER_GROUP:
            return [group_count(group)]
        if self.slots:
            return self.slots if self.packed is None else [self.packed]
        return []

    def per_param(self, group: dict, n: int) -> list[Tensor] | None:
        """Per param of the ``n`` with grads, the count its step reads (the group's for each), or None
        where none is counted."""
        if self.kind == PER_GROUP:
            return [group_count(group)] * n
        return self.slots if self.kind == PER_PARAM else None

    def in_place(self) -> bool:
        """Whether the params' counts are still the elements of ``packed``, and it is where it was: a
        count given storage of its own (``set_``, ``.data =``; see :func:`are_slots`), or ``packed``
        given new storage without them, is seen by no version counter (``.data =`` bumps none) and by
        no native check (native code holds the params and states, not the counts). ~50 ns a param."""
        return self._owners is None or list(map(Tensor.data_ptr, self._owners)) == self._pointers

    def whole(self) -> bool:
        """Whether each param's count on the host is a whole number >= 0, as a step takes one: a count written
        in place may be 2.5, -1 (its bias corrections divide by zero) or NaN, which a step refuses by name
        (``_check_state``). A count on another device is not read: that would wait for it."""
        for count in [self.packed] if self.packed is not None else self.slots or []:
            if count.device.type == "cpu":
                if not whole_counts(count.numpy().tolist() if count.dim() else [count.item()]):
                    return False
        return True

    def watched(self) -> list[list[Tensor]] | None:
        """Per param, what native code checks of its count beside the tensors the engines take: its
        slot and the tensor it is a slot of; None where the counts are not packed."""
        return None if self.packed is None else [[slot, self.packed] for slot in self.slots]

    def advance(self, group: dict, increment: int | Tensor, by_op: bool = False, whole_step: bool = True) -> None:
        """Add ``increment`` (1, or a tensor: 0 on a step GradScaler skipped) to the counts, after the
        update: a ``PER_GROUP`` count whether or not its params had grads, on a ``whole_step`` (not for
        each released bucket: the group's count advances at ``step()``); ``by_op``: in a traced CPU step,
        through ``fastoptim::count_up``, where no kernel of the graph reads them (inductor may run an op
        that mutates a graph input before a kernel that reads it)."""
        if not whole_step and self.kind == PER_GROUP:
            return
        counts = self.read(group)
        if not counts:
            return
        if by_op and counts[0].device.type == "cpu":
            torch.ops.fastoptim.count_up(counts, increment if isinstance(increment, Tensor) else None)
        elif len(counts) == 1:
            counts[0].add_(increment)
        else:
            torch._foreach_add_(counts, increment)
