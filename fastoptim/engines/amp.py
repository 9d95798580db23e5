"""GradScaler's ``found_inf`` on the engines whose kernels cannot skip a step themselves (loop,
foreach, and the fused engines' fallback): a step with an inf or NaN in the scaled grads must leave
params and states as they were."""
from dataclasses import replace

import torch

from . import foreach


def run_unless_inf(run, plan):
    """Run engine ``run`` over ``plan`` unless ``plan.found_inf`` (a tensor; None: no GradScaler) is
    nonzero. Eagerly, found_inf is read on the host, one sync. A step that torch.compile traces
    cannot read it (``fullgraph=True`` would fail), so it updates piece by piece and keeps each
    updated tensor's old values where found_inf is set: one copy of a slice of at most
    ``foreach.SLICE_NUMEL`` elements per updated role at a time."""
    if plan.found_inf is None:
        run(plan)
        return
    if not plan.traced:
        if not plan.found_inf.item():
            run(replace(plan, found_inf=None))
        return
    skip = plan.found_inf != 0
    cut = foreach.pieces(plan)
    for part in foreach.slices(cut.tensors["param"]):
        piece = replace(cut.subset(range(part.start, part.stop)), found_inf=None)
        updated = [t for role, ts in piece.tensors.items() if role != "grad" for t in ts] + [
            t for ts in piece.absmax.values() for t in ts if t is not None]
        before = [t.clone() for t in updated]
        run(piece)
        for tensor, old in zip(updated, before):
            tensor.copy_(torch.where(skip, old, tensor))
