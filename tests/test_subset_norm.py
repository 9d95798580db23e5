"""Subset-norm second moments: AdamWSN and RMSPropSN against a float64 re-statement of the seed's
AdamwSN, ``sn`` on Adan and AdamW against their float64 equations, on every engine; state sizes,
state dicts, and the inputs the partitions refuse."""
import copy
import math
import warnings

import pytest
import torch

import fastoptim

from fastoptim.engines.backends import cpu, triton
from fastoptim.multi_tensor import CHUNK_NUMEL, CPU_COLUMN_CHUNK_NUMEL, MIN_COLUMNS, PointerTable

from . import oracle
from .test_bad_input import assert_unchanged, snapshot

ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}
# 2-D both ways round, sizes that 7 and 100 do not divide (91, 97 is prime), a 3-D tensor, a 1-D one.
SHAPES = [(13, 7), (10, 30), (97,), (4, 5, 6), (64, 3), (1, 9)]
SUBSET_SIZES = [None, -2, 100, 7]
STEPS = 20

def expected_entries(shape, subset_size):
    """Second-moment entries of a param of ``shape`` under the seed's partitions."""
    numel = math.prod(shape)
    if subset_size is None:
        return max(shape) if len(shape) == 2 and min(shape) > 1 else numel
    k = subset_size if subset_size > 0 else max(1, int(math.sqrt(numel) / -subset_size))
    return numel // max(d for d in range(1, min(k, numel) + 1) if numel % d == 0)


def sn_groups(params, sn=True):
    return [{"params": params, "sn": sn}]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("subset_size", SUBSET_SIZES)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.99)])
def test_adamwsn_matches_the_seeds_equations(engine, subset_size, betas):
    params = oracle.make_params(SHAPES)
    grads = oracle.grad_sequence(SHAPES, STEPS)
    options = dict(lr=0.01, betas=betas, weight_decay=0.1, subset_size=subset_size)
    expected = oracle.adamw_sn(params, grads, **options)
    optimizer = fastoptim.AdamWSN(sn_groups(params), **options, **ENGINES[engine])
    oracle.run(optimizer, params, grads)
    assert oracle.relative_error(params, expected) < 2e-5
    for param, shape in zip(params, SHAPES):
        assert optimizer.state[param]["exp_avg_sq"].numel() == expected_entries(shape, subset_size)
        assert ("exp_avg" in optimizer.state[param]) == (betas[0] != 0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("options", [dict(correct_bias=False), dict(maximize=True, max_grad_norm=1.0)])
def test_adamwsn_options_match_the_seeds_equations(engine, options):
    params = oracle.make_params(SHAPES)
    grads = oracle.grad_sequence(SHAPES, STEPS)
    expected = oracle.adamw_sn(params, grads, lr=0.01, subset_size=7, **options)
    oracle.run(fastoptim.AdamWSN(sn_groups(params), lr=0.01, subset_size=7, **options, **ENGINES[engine]),
               params, grads)
    assert oracle.relative_error(params, expected) < 2e-5


def test_groups_without_sn_get_the_same_adamw_per_element():
    params = oracle.make_params(SHAPES)
    grads = oracle.grad_sequence(SHAPES, STEPS)
    expected = oracle.adamw_sn(params[:3], [g[:3] for g in grads], lr=0.01) + oracle.adamw_sn(
        params[3:], [g[3:] for g in grads], lr=0.01, sn=False)
    optimizer = fastoptim.AdamWSN([{"params": params[:3], "sn": True}, {"params": params[3:]}], lr=0.01)
    oracle.run(optimizer, params, grads)
    assert oracle.relative_error(params, expected) < 2e-5
    assert all(optimizer.state[p]["exp_avg_sq"].shape == p.shape for p in params[3:])


def test_rmspropsn_keeps_no_first_moment():
    params = oracle.make_params(SHAPES)
    grads = oracle.grad_sequence(SHAPES, STEPS)
    expected = oracle.adamw_sn(params, grads, lr=0.01, betas=(0.0, 0.99))
    optimizer = fastoptim.RMSPropSN(sn_groups(params), lr=0.01, beta2=0.99)
    oracle.run(optimizer, params, grads)
    assert oracle.relative_error(params, expected) < 2e-5
    assert all(set(state) <= {"step", "exp_avg_sq", "reduce_dim"} for state in optimizer.state.values())
    state_bytes = sum(v.numel() for s in optimizer.state.values() for k, v in s.items() if k == "exp_avg_sq")
    assert state_bytes == sum(expected_entries(shape, None) for shape in SHAPES)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("subset_size", SUBSET_SIZES)
@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW])
def test_sn_on_adan_and_adamw_matches_their_equations_with_subset_sums(cls, engine, subset_size):
    params = oracle.make_params(SHAPES)
    grads = oracle.grad_sequence(SHAPES, STEPS)
    options = dict(lr=0.01, weight_decay=0.02)
    reference = {fastoptim.Adan: oracle.adan, fastoptim.AdamW: oracle.adamw}[cls]
    expected = reference(params, grads, sn=True, subset_size=subset_size, **options)
    optimizer = cls(sn_groups(params), subset_size=subset_size, **options, **ENGINES[engine])
    oracle.run(optimizer, params, grads)
    assert oracle.relative_error(params, expected) < 2e-5
    for param, shape in zip(params, SHAPES):
        assert optimizer.state[param]["exp_avg_sq"].numel() == expected_entries(shape, subset_size)


@pytest.mark.parametrize("engine", ENGINES)
def test_amsgrad_keeps_its_maximum_per_subset(engine):
    params = oracle.make_params(SHAPES)
    grads = oracle.grad_sequence(SHAPES, STEPS)
    expected = oracle.adamw(params, grads, lr=0.01, amsgrad=True, sn=True, subset_size=None)
    optimizer = fastoptim.AdamW(params, lr=0.01, amsgrad=True, sn=True, **ENGINES[engine])
    oracle.run(optimizer, params, grads)
    assert oracle.relative_error(params, expected) < 2e-5
    assert optimizer.state[params[0]]["max_exp_avg_sq"].shape == (13, 1)


def regression_loss(sn, steps=300):
    """A two-layer regression on fixed random data (noisy targets, more samples than the model can
    fit); the loss after ``steps`` Adan steps, the optimizer and its two weight matrices."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2048, 32, generator=generator)
    targets = torch.sin(inputs @ torch.randn(32, 4, generator=generator)) + 0.1 * torch.randn(2048, 4, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    weights = [model[0].weight, model[2].weight]
    others = [p for p in model.parameters() if all(p is not w for w in weights)]
    optimizer = fastoptim.Adan([{"params": weights, "sn": sn}, {"params": others}], lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
    return loss.item(), optimizer, weights


def test_adan_sn_trains_a_regression_to_within_three_times_dense_adan():
    dense_loss, _, _ = regression_loss(sn=False)
    sn_loss, optimizer, weights = regression_loss(sn=True)
    initial, _, _ = regression_loss(sn=False, steps=1)
    assert sn_loss < initial / 2, "subset-norm Adan did not train"
    assert sn_loss < 3 * dense_loss
    for weight in weights:  # one entry per row of the larger dimension
        assert optimizer.state[weight]["exp_avg_sq"].numel() == max(weight.shape)


@pytest.mark.parametrize("cls, options", [(fastoptim.AdamWSN, dict(subset_size=7)),
                                          (fastoptim.Adan, dict(subset_size=None)),
                                          (fastoptim.AdamW, dict(subset_size=-1))])
@pytest.mark.parametrize("source", ENGINES)
@pytest.mark.parametrize("target", ENGINES)
def test_state_dicts_move_between_engines_and_resume_exactly(cls, options, source, target):
    grads = oracle.grad_sequence(SHAPES, 6)
    params = oracle.make_params(SHAPES)
    straight = cls(sn_groups(params), lr=0.01, **options, **ENGINES[target])
    oracle.run(straight, params, grads)
    resumed_params = oracle.make_params(SHAPES)
    first = cls(sn_groups(resumed_params), lr=0.01, **options, **ENGINES[source])
    oracle.run(first, resumed_params, grads[:3])
    second = cls(sn_groups(resumed_params), lr=0.01, subset_size=3, **ENGINES[target])  # the saved partition wins
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    oracle.run(second, resumed_params, grads[3:])
    assert oracle.relative_error(resumed_params, params) < 1e-6
    for a, b in zip(resumed_params, params):
        assert second.state[a]["exp_avg_sq"].shape == straight.state[b]["exp_avg_sq"].shape


def test_the_seeds_state_dict_loads():
    """The seed's AdamwSN keeps an integer step and ``reduce_dim`` for 2-D params."""
    params = oracle.make_params([(6, 4), (3, 8)])
    seed_state = {"state": {0: {"step": 3, "reduce_dim": 0, "exp_avg": torch.ones(6, 4), "exp_avg_sq": torch.ones(6, 1)},
                            1: {"step": 3, "reduce_dim": 1, "exp_avg": torch.ones(3, 8), "exp_avg_sq": torch.ones(1, 8)}},
                  "param_groups": [{"params": [0, 1], "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-6,
                                    "weight_decay": 0.0, "correct_bias": True, "sn": True}]}
    optimizer = fastoptim.AdamWSN(sn_groups(params), lr=0.01)
    optimizer.load_state_dict(seed_state)
    assert float(optimizer.state[params[0]]["step"]) == 3
    assert optimizer.state[params[1]]["reduce_dim"] == 1
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert float(optimizer.state[params[0]]["step"]) == 4


@pytest.mark.parametrize("engine", ["fused-single", "fused-multi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls, options", [
    (fastoptim.AdamWSN, dict(subset_size=None)), (fastoptim.RMSPropSN, dict(subset_size=7, max_grad_norm=0.5)),
    (fastoptim.Adan, dict(subset_size=None, no_prox=True)), (fastoptim.Adan, dict(subset_size=-1)),
    (fastoptim.AdamW, dict(subset_size=100, amsgrad=True, maximize=True))])
def test_the_fused_kernel_takes_subset_norm_states_and_matches_the_loop_engine(cls, options, dtype, engine):
    """Rows, columns (one chunk of whole rows each; in fp32 multi-tensor also one past
    CPU_COLUMN_CHUNK_NUMEL, cut into two column strips) and flattened subsets, one of them longer than a
    kernel chunk, all in one kernel call with dense params."""
    wide = [(2, CPU_COLUMN_CHUNK_NUMEL // 2 + 3)] if dtype == torch.float32 and engine == "fused-multi" else []
    shapes = SHAPES + [(3, 40000), (70000, 2)] + wide
    runs = []
    for flags in (ENGINES["loop"], ENGINES[engine]):
        params = oracle.make_params(shapes, dtype)
        optimizer = cls([{"params": params[:-1], "sn": True}, {"params": params[-1:]}], lr=0.01, weight_decay=0.02,
                        **options, **flags)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warns
            oracle.run(optimizer, params, oracle.grad_sequence(shapes, 4))
        runs.append((params, optimizer))
    (loop_params, loop), (params, fused) = runs
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(params, loop_params):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), **tolerance)
        for key, value in loop.state[b].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(fused.state[a][key], value, rtol=1e-4, atol=1e-6 * float(value.abs().max()))


@pytest.mark.parametrize("backend, blocks, columns", [
    (cpu, 1, 3072), (triton, 1, max(CHUNK_NUMEL // 768, MIN_COLUMNS)), (cpu, 256, 3072), (triton, 256, 256)])
def test_the_cpu_plan_cuts_column_subsets_in_whole_rows_and_a_gpu_plan_in_chunk_sized_strips(backend, blocks, columns):
    """A (768, 3072) column-subset param (GPT-2's c_fc): one CPU chunk of all its rows and columns; for
    the Triton kernels (a chunk is one program) strips of CHUNK_NUMEL // 768 columns, at least
    MIN_COLUMNS, and with 8-bit states (blocks of 256) strips of whole blocks of columns."""
    param, state = torch.zeros(1, 768, 3072, device="meta"), torch.zeros(1, 1, 3072, device="meta")
    table = PointerTable({"param": [param], "exp_avg_sq": [state]}, ("param", "exp_avg_sq"), blocks=[blocks],
                         column_numel=backend.COLUMN_NUMEL, block_columns=backend.BLOCK_COLUMNS)
    assert table.chunks[:, 2].tolist() == [768 * columns] * (3072 // columns)
    assert table.chunks[:, 1].tolist() == [768 * columns * k for k in range(3072 // columns)]


# --- what the partitions refuse ---------------------------------------------------------------------

@pytest.mark.parametrize("cls", [fastoptim.AdamWSN, fastoptim.Adan, fastoptim.AdamW])
@pytest.mark.parametrize("name, value", [("subset_size", 0), ("subset_size", 2.5), ("subset_size", True),
                                         ("sn", "yes")])
def test_invalid_partition_options_are_refused(cls, name, value):
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        cls(oracle.make_params(), **{name: value})
    optimizer = cls(oracle.make_params(), lr=0.01)
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        optimizer.add_param_group({"params": oracle.make_params(seed=3), name: value})
    assert len(optimizer.param_groups) == 1


def test_invalid_correct_bias_is_refused():
    with pytest.raises(ValueError, match="Invalid correct_bias"):
        fastoptim.AdamWSN(oracle.make_params(), correct_bias="no")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("subset_size", [None, 4])
def test_an_empty_param_in_an_sn_group_keeps_an_empty_dense_state(engine, subset_size):
    params = oracle.make_params([(0, 5), (6, 4)])
    optimizer = fastoptim.AdamWSN(sn_groups(params), lr=0.01, subset_size=subset_size, **ENGINES[engine])
    oracle.run(optimizer, params, oracle.grad_sequence([(0, 5), (6, 4)], 2))
    state = optimizer.state[params[0]]
    assert state["exp_avg_sq"].shape == (0, 5) and "reduce_dim" not in state and "subset_size" not in state


@pytest.mark.filterwarnings("ignore:fastoptim. fused=True, but a subset-norm param")
@pytest.mark.parametrize("engine", ENGINES)
def test_a_non_contiguous_param_on_a_flattened_partition_is_refused_before_anything_changes(engine):
    params = oracle.make_params(SHAPES)
    transposed = torch.nn.Parameter(torch.randn(8, 6).t())
    optimizer = fastoptim.AdamWSN(sn_groups(params + [transposed]), lr=0.01, subset_size=4, **ENGINES[engine])
    for param in params + [transposed]:
        param.grad = torch.ones_like(param)
    before = snapshot(params + [transposed], optimizer)
    with pytest.raises(ValueError, match="needs a contiguous param"):
        optimizer.step()
    assert_unchanged(params + [transposed], optimizer, before)
    rows = fastoptim.AdamWSN(sn_groups([transposed]), lr=0.01, **ENGINES[engine])  # columns keep any strides
    rows.step()
    assert rows.state[transposed]["exp_avg_sq"].shape == (1, 8)


def test_a_state_dict_whose_partition_does_not_fit_is_refused():
    params = oracle.make_params([(6, 4)])
    optimizer = fastoptim.AdamWSN(sn_groups(params), lr=0.01, subset_size=8)
    oracle.run(optimizer, params, oracle.grad_sequence([(6, 4)], 1))
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"][0]["subset_size"] = 5
    other = fastoptim.AdamWSN(sn_groups(oracle.make_params([(6, 4)])), lr=0.01)
    with pytest.raises(ValueError, match="subset_size 5 does not divide"):
        other.load_state_dict(saved)
    assert not other.state


def _lane_sum(values):
    """fused_cpu.c's ``sum_of_squares`` of at most 64 fp32 ``values``, restated: lane j holds values[j]²
    (rounded once, as fmaf(q, q, 0)), the 64 lanes (zeros past the values) then add pairwise, lane j and
    lane j + width for width 32, 16, .., 1, in fp32."""
    import numpy as np

    lanes = np.zeros(64, dtype=np.float32)
    lanes[:len(values)] = (values.astype(np.float64) ** 2).astype(np.float32)
    width = 32
    while width:
        lanes[:width] = lanes[:width] + lanes[width:2 * width]
        width //= 2
    return lanes[0]


@pytest.mark.skipif(not cpu.available(), reason="the native library is not built")
def test_a_subset_shorter_than_the_kernel_s_lanes_sums_as_64_lanes_do():
    """A subset of fewer than 64 elements fills only the first lanes of the kernel's sum, and starts its
    pairwise adds at the lanes it filled (a 4x4 matrix's rows spent most of their step adding zeros):
    the same number as 64 lanes give, bit for bit, for every length. One step from zero states with
    β2 = 0.5, so the second moment of a row is exactly half its sum of g²."""
    for length in range(1, 65):
        param = torch.nn.Parameter(torch.zeros(70, length))
        param.grad = torch.randn(70, length, generator=torch.Generator().manual_seed(length))
        opt = fastoptim.AdamWSN([param], lr=1e-3, betas=(0.9, 0.5), sn=True, fused=True)
        opt.step()
        moments = opt.state[param]["exp_avg_sq"]
        assert moments.shape == (70, 1), moments.shape
        expected = torch.tensor([0.5 * _lane_sum(row) for row in param.grad.numpy()]).view(70, 1)
        assert torch.equal(moments, expected), length


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("make_grad", [lambda g: g.t().contiguous().t(), lambda g: g[:, :1].expand_as(g)],
                         ids=["transposed", "expanded"])
def test_a_flattened_partition_takes_a_grad_of_any_layout_as_its_contiguous_copy(engine, make_grad):
    """A flattened partition (``subset_size``) views each grad as (a, b, c) of its param's layout; a
    grad whose strides allow no such view (transposed, expanded) is read through a copy, as torch's
    optimizers take any layout. It raised torch's view error on every engine."""
    def run(layout):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 64 * 80).reshape(64, 80))
        opt = fastoptim.AdamWSN([param], lr=1e-2, subset_size=16, sn=True, **ENGINES[engine])
        for step in range(3):
            grad = make_grad(torch.linspace(-1, 1, 64 * 80).reshape(64, 80).mul(step + 1).sin())
            param.grad = layout(grad)
            opt.step()
        return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]

    for ours, expected in zip(run(lambda g: g), run(torch.Tensor.contiguous)):
        assert torch.equal(ours, expected)
