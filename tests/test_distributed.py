"""Scale-out on torch.distributed: ZeroRedundancyOptimizer, DDP and FSDP2 on 2 CPU ranks (gloo) give
the parameters of one process on the same data, and DCP checkpoints resume exactly, on 2 ranks and in
one process.

Two worker processes are started once for the module (``python -m tests.test_distributed RANK DIR``,
file rendezvous, no ports). They run every case, with a single-process run of the same case beside
it, and write what they measure to JSON files that the tests read. Each rank feeds its half of
every batch; DDP and FSDP2 average the halves' gradients into the whole batch's. 8-bit codes round,
so a gradient one ulp off may take the neighbouring code, and so may Muon's bf16 iterations: those
cases feed every rank the whole batch, whose averaged gradient is exactly one process's.
"""
import json
import math
import os
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import fastoptim

from . import oracle

pytestmark = pytest.mark.distributed

WORLD, STEPS, BATCH = 2, 8, 8
# w1: columns (64 < 96 rows) over even shards, 8-bit states (6144 elements, 12 blocks per shard);
# w2: columns over uneven shards (3 and 2 rows); w3: rows; w4: one row, so rank 1's shard is empty.
SHAPES = {"w1": (64, 96), "b1": (64,), "w2": (5, 64), "w3": (70, 5), "w4": (1, 70)}
FLATTENED = ("w1", "b1", "w3")  # subsets of 32 (25 for w3) fall within their shards; w2's and w4's do not
CLIP = 0.05
ENGINES = {"foreach": dict(foreach=True, fused=False), "fused": dict(fused=True)}
OPTIONS = {"adan": ("Adan", dict(lr=0.01, weight_decay=0.02, max_grad_norm=CLIP)),
           "adamw": ("AdamW", dict(lr=0.01, weight_decay=0.01)),
           "adamwsn": ("AdamWSN", dict(lr=0.01, weight_decay=0.01)),
           "muon": ("Muon", dict(lr=0.02, weight_decay=0.01, max_grad_norm=CLIP))}


def case(mode, optimizer, engine, sn=None, **options):
    """A case's name and its settings: ``sn`` None (dense), "rows-columns" (subset_size None) or
    "flattened" (subset_size 32); Muon's cases always group the matrices apart from b1."""
    name = "-".join([mode, optimizer, engine] + ([sn] if sn else []) + [f"{k}={v}" for k, v in options.items()])
    return name, dict(mode=mode, optimizer=optimizer, engine=engine, sn=sn, options=options)


CASES = dict([
    *(case("zero", optimizer, engine) for optimizer in OPTIONS for engine in ENGINES),
    *(case("zero", "adan", engine, state_bits=8) for engine in ENGINES),
    case("zero", "adamwsn", "fused", "rows-columns"),
    case("ddp", "adan", "fused"),
    *(case("fsdp", optimizer, engine) for optimizer in OPTIONS for engine in ENGINES),
    *(case("fsdp", optimizer, engine, "rows-columns") for optimizer in ("adan", "adamwsn") for engine in ENGINES),
    *(case("fsdp", "adamwsn", engine, "flattened") for engine in ENGINES),
    *(case("fsdp", "adan", engine, state_bits=8) for engine in ENGINES),
    # Muon: w4 is one row, so rank 1 holds none of it; w2's rows split unevenly
    *(case(mode, "muon", engine) for mode in ("zero", "fsdp") for engine in ENGINES),
    case("fsdp", "muon", "fused", state_bits=8),
])
CHECKPOINTS = dict([case("fsdp", "adan", "fused", "rows-columns"), case("fsdp", "adan", "fused", state_bits=8),
                    case("fsdp", "muon", "fused")])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            initial = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
            self.register_parameter(name, torch.nn.Parameter(initial))

    def forward(self, x):
        h = torch.tanh(x @ self.w1.T + self.b1)
        h = torch.tanh(h @ self.w2.T)
        h = torch.tanh(h @ self.w3.T)
        return h @ self.w4.T


def batch(step, rank=None):
    """Step ``step``'s batch: all of it, or rank ``rank``'s half."""
    generator = torch.Generator().manual_seed(1000 + step)
    x, target = torch.randn(BATCH, 96, generator=generator), torch.randn(BATCH, 1, generator=generator)
    if rank is None:
        return x, target
    half = BATCH // WORLD
    return x[rank * half:(rank + 1) * half], target[rank * half:(rank + 1) * half]


def param_groups(model, sn, optimizer=None):
    named = dict(model.named_parameters())
    if optimizer == "muon":
        return [{"params": [p for n, p in named.items() if n != "b1"]},
                {"params": [named["b1"]], "use_muon": False, "lr": 0.01}]
    if sn is None:
        return [{"params": list(named.values())}]
    if sn == "rows-columns":
        return [{"params": list(named.values()), "sn": True}]
    return [{"params": [named[n] for n in FLATTENED], "sn": True, "subset_size": 32},
            {"params": [p for n, p in named.items() if n not in FLATTENED]}]


def make_optimizer(settings, params, **extra):
    cls_name, options = OPTIONS[settings["optimizer"]]
    return getattr(fastoptim, cls_name)(params, **options, **ENGINES[settings["engine"]], **settings["options"] | extra)


def train(model, optimizer, steps, rank=None, first=0):
    for step in range(first, first + steps):
        x, target = batch(step, rank)
        torch.nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def full_params(model):
    return [p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p.detach().clone()
            for p in model.parameters()]


def fed(settings, rank):
    """The rank whose half of each batch this case's rank feeds (None: the whole batch): 8-bit codes
    and Muon's bf16 iterations round a gradient one ulp off to their neighbouring values."""
    return None if settings["options"].get("state_bits") == 8 or settings["optimizer"] == "muon" else rank


def one_process(settings, steps=STEPS):
    model = Net()
    train(model, make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"])), steps)
    return full_params(model)


# --- the workers --------------------------------------------------------------------------------

def distributed_run(settings, rank):
    """The case's model after ``STEPS`` steps on ``WORLD`` ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = Net()
    if settings["mode"] == "fsdp":
        fully_shard(model)
        optimizer = make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]))
    elif settings["mode"] == "zero":
        model = DistributedDataParallel(model)
        cls_name, options = OPTIONS[settings["optimizer"]]
        optimizer = ZeroRedundancyOptimizer(
            param_groups(model.module, settings["sn"], settings["optimizer"]),
            optimizer_class=getattr(fastoptim, cls_name),
            shard_group=settings.get("shard_group", dist.group.WORLD), **options, **ENGINES[settings["engine"]],
            **settings["options"])
    else:
        model = DistributedDataParallel(model)
        optimizer = make_optimizer(settings, param_groups(model.module, settings["sn"], settings["optimizer"]))
    train(model, optimizer, STEPS, fed(settings, rank))
    return model.module if settings["mode"] != "fsdp" else model, optimizer


def checkpointed(model, optimizer):
    """What a DCP checkpoint holds of them (states created if missing), in the layout to save or fill."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def restore(model, optimizer, checkpoint):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state
    state = checkpointed(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint)
    dcp_state.set_model_state_dict(model, state["model"])
    dcp_state.set_optimizer_state_dict(model, optimizer, state["optim"])


def checkpoint_run(settings, rank, directory):
    """Save after half the steps, go on; load into a new model and optimizer, go on: the two must
    agree exactly. The checkpoint is left for the single-process test."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def build():
        model = Net()
        fully_shard(model)
        return model, make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]))

    model, optimizer = build()
    rank = fed(settings, rank)
    train(model, optimizer, STEPS // 2, rank)
    dcp.save(checkpointed(model, optimizer), checkpoint_id=directory)
    train(model, optimizer, STEPS // 2, rank, first=STEPS // 2)
    resumed, resumed_optimizer = build()
    restore(resumed, resumed_optimizer, directory)
    train(resumed, resumed_optimizer, STEPS // 2, rank, first=STEPS // 2)
    return max(float((a - b).abs().max()) for a, b in zip(full_params(model), full_params(resumed)))


def worker(rank, directory):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # a case that fails on one rank fails, not hangs
    results = {}

    def record(name, measure):
        try:
            results[name] = measure()
        except Exception:
            results[name] = traceback.format_exc()
        Path(directory, f"rank{rank}.json").write_text(json.dumps(results))

    for name, settings in CASES.items():
        def compare(settings=settings):
            model, _ = distributed_run(settings, rank)
            return oracle.relative_error(full_params(model), one_process(settings))
        record(name, compare)
    # ZeRO without shard_group clips each rank's partition by its own norm, as official Adan does
    local_norm = dict(CASES["zero-adan-foreach"], shard_group=None)
    record("zero-adan-local-norm", lambda: oracle.relative_error(full_params(distributed_run(local_norm, rank)[0]),
                                                                   one_process(local_norm)))
    for name, settings in CHECKPOINTS.items():
        record("checkpoint-" + name, lambda: checkpoint_run(settings, rank, f"{directory}/{name}"))

    def straddling():
        model = Net()
        torch.distributed.fsdp.fully_shard(model)
        optimizer = fastoptim.AdamWSN(model.parameters(), sn=True, subset_size=32)
        train(model, optimizer, 1, rank)
    record("flattened-straddling", straddling)

    def orthogonalized():
        """How many matrices this rank orthogonalized in an FSDP2 Muon run: each once, on its owner."""
        from fastoptim.optimizers import muon
        calls, original = [], muon.orthogonalize
        muon.orthogonalize = lambda matrices, **kwargs: calls.append(len(matrices)) or original(matrices, **kwargs)
        try:
            distributed_run(CASES["fsdp-muon-foreach"], rank)
        finally:
            muon.orthogonalize = original
        return sum(calls)
    record("orthogonalized", orthogonalized)

    def refusals():
        """The messages of the params that DTensor params cannot go with."""
        model = Net()
        torch.distributed.fsdp.fully_shard(model)
        messages = []
        for params, options in (([*model.parameters()], dict(shard_group=dist.group.WORLD)),
                                ([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], {})):
            try:
                fastoptim.Adan(params, **options)
            except ValueError as error:
                messages.append(str(error))
        return messages
    record("refusals", refusals)
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort at interpreter exit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The workers' results by case and rank, and their directory (checkpoints)."""
    directory = tmp_path_factory.mktemp("distributed")
    root = Path(__file__).parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, "-m", "tests.test_distributed", str(rank), str(directory)], cwd=root,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for rank in range(WORLD)]
    outputs = []
    for process in workers:
        try:
            outputs.append(process.communicate(timeout=170)[0].decode())
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            outputs.append(process.communicate()[0].decode())
    files = [directory / f"rank{rank}.json" for rank in range(WORLD)]
    results = [json.loads(file.read_text()) if file.exists() else {} for file in files]
    return results, directory, outputs


def result(runs, name):
    results, _, outputs = runs
    values = [ranks.get(name, f"no result; the worker's output:\n{output[-3000:]}")
              for ranks, output in zip(results, outputs)]
    for value in values:
        assert not isinstance(value, str), value
    return values


@pytest.mark.parametrize("name", CASES)
def test_a_distributed_run_gives_the_parameters_of_one_process(runs, name):
    for error in result(runs, name):
        assert error < 1e-5


def test_under_fsdp2_each_matrix_is_orthogonalized_once_by_one_rank(runs):
    per_rank = result(runs, "orthogonalized")
    assert sum(per_rank) == 4 * STEPS and min(per_rank) > 0  # w1..w4 each step, spread over both ranks


def test_the_clipping_norm_is_global_under_zero(runs):
    """Without shard_group each rank clips by its own partition's norm, and the result differs: the
    clip really acts in these cases."""
    grads = [p.grad for p in _first_grads()]
    assert math.sqrt(sum(float(g.square().sum()) for g in grads)) > 2 * CLIP
    for error in result(runs, "zero-adan-local-norm"):
        assert error > 1e-3


def _first_grads():
    model = Net()
    x, target = batch(0)
    torch.nn.functional.mse_loss(model(x), target).backward()
    return list(model.parameters())


def test_flattened_subsets_that_straddle_shards_are_refused(runs):
    results, _, _ = runs
    for ranks in results:
        assert "ValueError" in ranks["flattened-straddling"] and "straddle" in ranks["flattened-straddling"]


def test_dtensor_params_with_shard_group_or_plain_params_are_refused(runs):
    for messages in result(runs, "refusals"):
        assert len(messages) == 2
        assert "leave shard_group unset" in messages[0] and "not a mix" in messages[1]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_dcp_checkpoint_resumes_exactly_on_two_ranks(runs, name):
    assert result(runs, "checkpoint-" + name) == [0.0] * WORLD


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_dcp_checkpoint_of_two_ranks_resumes_in_one_process(runs, name):
    """Resharding: the checkpoint loads into a plain model and optimizer. 8-bit states were saved
    dequantized (their blocks are per shard), so an fp32 optimizer takes them, and the 8-bit one
    quantizes them on load: here w1's shards are whole blocks, so the codes are those of one process."""
    _, directory, _ = runs
    settings = CHECKPOINTS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the matmuls' rounding, and so the 8-bit codes, depend on it
    try:
        resume_in_one_process(settings, directory / name)
    finally:
        torch.set_num_threads(threads)


def resume_in_one_process(settings, checkpoint):
    model = Net()
    optimizer = make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]))
    template = make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]), state_bits=32)
    restore(model, template, checkpoint)
    optimizer.load_state_dict(template.state_dict())
    train(model, optimizer, STEPS // 2, first=STEPS // 2)
    assert oracle.relative_error(full_params(model), one_process(settings)) < 1e-5


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.RMSPropSN,
                                 fastoptim.Muon])
def test_shard_group_without_a_process_group_is_a_clear_error(cls):
    with pytest.raises(ValueError, match="shard_group is given, but torch.distributed is not initialised"):
        cls(oracle.make_params(), shard_group=object())


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2])
