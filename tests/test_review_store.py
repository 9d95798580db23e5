"""Review of the plan store (helper-21, at e24592d): a compiled step whose grads pattern alternates, and a
param's state changed (cleared, a key deleted, a tensor replaced, a new dict) while that param has no
grad. Each pattern's graph must be traced again, and see the change, as an eager step does. The guard
that makes dynamo trace again compared the state dict's change count with the one a trace recorded;
once dynamo made the two ints dynamic, it was the relation between them, and the other pattern's trace
rewrote the one recorded, so the old graph passed it and stepped on the states it had traced. Each
pattern now records its own (``PlanStore.traced_states``). Some cases failed before 3bd8c85 too (a
tensor replaced, a new dict, Adan's), the others since (the traced step then read each count from the
state dicts, which dynamo guarded)."""
import warnings

import pytest
import torch

import fastoptim


def _make(kind, params):
    if kind == "AdamW":
        return fastoptim.AdamW(params, lr=1e-2)
    if kind == "AdamWSN":
        return fastoptim.AdamWSN([{"params": params, "sn": True}], lr=1e-2)
    if kind == "MuonCompanion":  # a use_muon=False group (AdamW's math, per-param counts)
        return fastoptim.Muon([{"params": params, "use_muon": False}], lr=1e-2)
    return fastoptim.Adan(params, lr=1e-2)


def _change(opt, param, change):
    state = opt.state[param]
    if change == "clear":
        state.clear()
    elif change.startswith("del_"):
        del state[change[4:]]
    elif change == "replace":
        for key in list(state):
            if key != "step" and isinstance(state[key], torch.Tensor):
                state[key] = torch.zeros_like(state[key])
    elif change == "new_dict":
        opt.state[param] = {}


def _run(kind, change, compiled):
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(5, 7, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    opt = _make(kind, params)
    step = torch.compile(opt.step, backend="eager", fullgraph=True) if compiled else opt.step
    for s in range(6):
        for i, p in enumerate(params):  # alternating grads: p0 on even steps, p1 on odd ones
            p.grad = torch.full_like(p, 0.5 + s) if (s + i) % 2 == 0 else None
        if s == 3:  # p0 has no grad on this step
            with torch.no_grad():
                _change(opt, params[0], change)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
    return params, opt


CASES = [("AdamW", "clear"), ("AdamW", "del_step"), ("AdamWSN", "del_exp_avg"), ("MuonCompanion", "clear"),
         ("AdamW", "replace"), ("AdamW", "new_dict"), ("Adan", "clear"), ("Adan", "replace")]


@pytest.mark.parametrize("kind,change", CASES)
def test_compiled_alternating_grads_sees_state_change(kind, change):
    eager, eager_opt = _run(kind, change, compiled=False)
    compiled, compiled_opt = _run(kind, change, compiled=True)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert set(compiled_opt.state[compiled[0]]) == set(eager_opt.state[eager[0]])


def test_step_with_no_param_groups_left():
    """torch.optim steps an optimizer whose groups were all removed, changing nothing; fastoptim raised
    IndexError (the clip's eps read from the last group)."""
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = fastoptim.AdamW(params)
    params[0].grad = torch.ones(3)
    opt.step()
    opt.param_groups.clear()
    opt.step()
