"""Scale-out on torch.distributed: ZeroRedundancyOptimizer, DDP and FSDP2 on 2 CPU ranks (gloo) give
the parameters of one process on the same data, and DCP checkpoints resume exactly, on 2 ranks and in
one process.

Two worker processes are started once for the module (``python -m tests.test_distributed RANK DIR``,
file rendezvous, no ports). They run every case, with a single-process run of the same case beside
it, and write what they measure to JSON files that the tests read. Each rank feeds its half of
every batch; DDP and FSDP2 average the halves' gradients into the whole batch's. 8-bit codes round,
so a gradient one ulp off may take the neighbouring code, and so may Muon's bf16 iterations: those
cases feed every rank the whole batch, whose averaged gradient is exactly one process's.

Four more workers run the cases on 4 ranks: FSDP2 (FOUR_RANKS), the 2 workers' checkpoints resumed,
and HSDP on a 2 x 2 mesh (replicate x shard: each replica group of 2 ranks holds the whole model once),
whose ranks all feed the whole batch, so that every case's result is one process's bit for bit (but
where a sum spans the shards: see exact).
"""
import json
import math
import os
import re
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
# w2 and w5: columns over uneven shards (3 and 2 rows), one shape (a Muon shape group of two); w3:
# rows, and w6 its twin (a shape group of tall matrices); w4: one row, so rank 1's shard is empty (on
# 4 ranks, ranks 1-3's; and w2's on rank 3).
SHAPES = {"w1": (64, 96), "b1": (64,), "w2": (5, 64), "w5": (5, 64), "w3": (70, 5), "w6": (70, 5), "w4": (1, 70)}
EXPERTS = (3, 6, 64)  # 3 experts of 6 x 64, a matrix shape of their own (see Net)
MUON_SHAPE_GROUPS = 4
FLATTENED = ("w1", "b1", "w3")  # subsets of 32 (25 for w3) fall within their shards; w2's and w4's do not
CLIP = 0.05
ENGINES = {"foreach": dict(foreach=True, fused=False), "fused": dict(fused=True)}
OPTIONS = {"adan": ("Adan", dict(lr=0.01, weight_decay=0.02, max_grad_norm=CLIP)),
           "adamw": ("AdamW", dict(lr=0.01, weight_decay=0.01)),
           "adamwsn": ("AdamWSN", dict(lr=0.01, weight_decay=0.01)),
           "muon": ("Muon", dict(lr=0.02, weight_decay=0.01, max_grad_norm=CLIP)),
           "rmspropsn": ("RMSPropSN", dict(lr=0.01, weight_decay=0.01)),
           "lion": ("Lion", dict(lr=0.001, weight_decay=0.01))}


def case(mode, optimizer, engine, sn=None, **options):
    """A case's name and its settings: ``sn`` None (dense), "rows-columns" (subset_size None) or
    "flattened" (subset_size 32); Muon's cases always group the matrices apart from b1, with ``sn``
    "heads" w1 apart from the other matrices, as 4 heads, and with ``sn`` "experts" the model has
    expert weights besides (see Net)."""
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
    case("fsdp", "muon", "fused", "heads"),
    *(case("fsdp", "muon", engine, "experts") for engine in ENGINES),
])
# on 4 ranks, every rank feeding the whole batch: uneven and empty shards of every Muon shape and of
# each optimizer's params, w1 as 4 heads, e1's experts (none on rank 3), 8-bit states
FOUR_RANKS = ("fsdp-muon-foreach", "fsdp-muon-fused", "fsdp-muon-fused-heads", "fsdp-muon-fused-experts",
              "fsdp-adan-fused", "fsdp-adamw-foreach", "fsdp-adan-fused-state_bits=8", "fsdp-muon-fused-state_bits=8",
              "fsdp-adamwsn-fused-rows-columns", "fsdp-lion-fused", "fsdp-rmspropsn-fused")
# HSDP on 4 ranks, 2 x 2, clipping on: w1..w3 are cut in 2 (w1's rows in 48 and w2's in 3 + 2), w4's
# second shard is empty; subset norms by rows and columns (w1's column sums span the shards) and by
# flattened subsets; 8-bit states; Muon's 5 matrices in 4 shape groups, with its AdamW companion (b1)
HSDP_MESH = (2, 2)  # (replicate, shard)
HSDP = dict([
    case("hsdp", "adamw", "fused", max_grad_norm=CLIP),
    case("hsdp", "adamw", "foreach", max_grad_norm=CLIP),
    case("hsdp", "adan", "fused"),
    case("hsdp", "adan", "fused", "rows-columns"),
    case("hsdp", "adamwsn", "fused", "flattened", max_grad_norm=CLIP),
    case("hsdp", "adan", "fused", state_bits=8),
    case("hsdp", "muon", "fused"),
    case("hsdp", "muon", "foreach"),
    case("hsdp", "muon", "fused", state_bits=8),
    case("hsdp", "muon", "fused", "experts"),
])
HSDP_CHECKPOINTS = dict([case("hsdp", "adan", "fused", "rows-columns"), case("hsdp", "adan", "fused", state_bits=8),
                         case("hsdp", "muon", "fused")])
CHECKPOINTS = dict([case("fsdp", "adan", "fused", "rows-columns"), case("fsdp", "adan", "fused", state_bits=8),
                    case("fsdp", "muon", "fused")])


class Net(torch.nn.Module):
    """The SHAPES' params; for a case with ``sn`` "experts", also EXPERTS: 3-D expert weights, which
    FSDP2 cuts on their expert dim (2 + 1 experts on 2 ranks; 1, 1, 1 and none on 4)."""

    def __init__(self, settings=None):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        experts = {"e1": EXPERTS} if settings is not None and settings["sn"] == "experts" else {}
        for name, shape in (SHAPES | experts).items():
            initial = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
            self.register_parameter(name, torch.nn.Parameter(initial))

    def forward(self, x):
        first = h = torch.tanh(x @ self.w1.T + self.b1)
        h = torch.tanh(h @ self.w2.T) + torch.tanh(h @ self.w5.T)
        h = torch.tanh(h @ self.w3.T) + torch.tanh(h @ self.w6.T)
        out = h @ self.w4.T
        if hasattr(self, "e1"):  # every expert on every token, their outputs summed
            out = out + torch.tanh(torch.einsum("bi,eoi->beo", first, self.e1)).sum((1, 2)).unsqueeze(1)
        return out


def batch(step, rank=None):
    """Step ``step``'s batch: all of it, or rank ``rank``'s half (of ``WORLD`` ranks)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x, target = torch.randn(BATCH, 96, generator=generator), torch.randn(BATCH, 1, generator=generator)
    if rank is None:
        return x, target
    half = BATCH // WORLD
    return x[rank * half:(rank + 1) * half], target[rank * half:(rank + 1) * half]


def param_groups(model, sn, optimizer=None):
    named = dict(model.named_parameters())
    if optimizer == "muon":
        heads = [{"params": [named["w1"]], "num_heads": 4}] if sn == "heads" else []
        return heads + [{"params": [p for n, p in named.items() if n != "b1" and not (heads and n == "w1")]},
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
    and Muon's bf16 iterations round a gradient one ulp off to their neighbouring values. Under HSDP
    every rank feeds the whole batch: FSDP2 divides each rank's gradient by 4 and sums them in pairs
    (reduce-scatter over the shard dim, all-reduce over the replicate dim), all exact, so each shard of
    the averaged gradient is one process's gradient, and the comparison is bit for bit. So do the
    ranks of a world other than WORLD's (4 ranks under FSDP2), for which there are no halves."""
    if (settings["mode"] == "hsdp" or settings["options"].get("state_bits") == 8 or settings["optimizer"] == "muon"
            or torch.distributed.is_initialized() and torch.distributed.get_world_size() != WORLD):
        return None
    return rank


def exact(settings):
    """Whether a sharded run of the case is one process's bit for bit: every rank feeds the whole
    batch (see fed), and no sum spans the shards (subset norms by columns add the ranks' partial sums
    of w1's columns, another order of fp32 additions than one process's: about 2e-7 apart here)."""
    return fed(settings, 0) is None and settings["sn"] != "rows-columns"


def mesh_of(settings):
    """fully_shard's ``mesh`` for the case: HSDP's 2-D mesh (of any dim names: fastoptim finds the
    shard dim from the placements), or None (FSDP2's default, a 1-D mesh over the world)."""
    if settings["mode"] != "hsdp":
        return None
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", HSDP_MESH, mesh_dim_names=("across", "within"))


def one_process(settings, steps=STEPS):
    model = Net(settings)
    train(model, make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"])), steps)
    return full_params(model)


# --- the workers --------------------------------------------------------------------------------

def distributed_run(settings, rank):
    """The case's model after ``STEPS`` steps on ``WORLD`` ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = Net(settings)
    if settings["mode"] in ("fsdp", "hsdp"):
        fully_shard(model, mesh=mesh_of(settings))
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
    return model.module if settings["mode"] not in ("fsdp", "hsdp") else model, optimizer


def checkpointed(model, optimizer, flatten=False):
    """What a DCP checkpoint holds of them (states created if missing), in the layout to save or fill; with
    ``flatten``, the optimizer's state dict flattened (``flatten_optimizer_state_dict``, torchtitan's)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=options)}


def restore(model, optimizer, checkpoint, flatten=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state
    state = checkpointed(model, optimizer, flatten)
    dcp.load(state, checkpoint_id=checkpoint)
    dcp_state.set_model_state_dict(model, state["model"])
    dcp_state.set_optimizer_state_dict(model, optimizer, state["optim"],
                                       options=dcp_state.StateDictOptions(flatten_optimizer_state_dict=flatten))


def checkpoint_run(settings, rank, directory, flatten=False):
    """Save after half the steps, go on; load into a new model and optimizer, go on: the two must
    agree exactly. The checkpoint is left for the single-process test. ``flatten``: see :func:`checkpointed`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def build():
        model = Net(settings)
        fully_shard(model, mesh=mesh_of(settings))
        return model, make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]))

    model, optimizer = build()
    rank = fed(settings, rank)
    train(model, optimizer, STEPS // 2, rank)
    dcp.save(checkpointed(model, optimizer, flatten), checkpoint_id=directory)
    train(model, optimizer, STEPS // 2, rank, first=STEPS // 2)
    resumed, resumed_optimizer = build()
    restore(resumed, resumed_optimizer, directory, flatten)
    train(resumed, resumed_optimizer, STEPS // 2, rank, first=STEPS // 2)
    return max(float((a - b).abs().max()) for a, b in zip(full_params(model), full_params(resumed)))


def zero_checkpoint_run(settings, rank, directory):
    """ZeRO's consolidated state dict saved and loaded as docs/distributed.md says, after half the steps,
    into a new model and optimizer: the rest of the steps must equal the run that went on. The
    optimizer's groups hold its shard_group, a process group (helper-28: consolidating raised on rank
    1, pickling it, and rank 0 waited)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    cls_name, options = OPTIONS[settings["optimizer"]]

    def build():
        model = DistributedDataParallel(Net(settings))
        return model, ZeroRedundancyOptimizer(
            param_groups(model.module, settings["sn"], settings["optimizer"]), optimizer_class=getattr(fastoptim, cls_name),
            shard_group=dist.group.WORLD, **options, **ENGINES[settings["engine"]], **settings["options"])

    rank = fed(settings, rank)
    model, opt = build()
    train(model, opt, STEPS // 2, rank)
    path = f"{directory}/zero-optimizer.pt"
    exec(docs_snippet("consolidate_state_dict(to=0)"), {"opt": opt, "dist": dist, "torch": torch, "path": path})
    resumed, resumed_opt = build()
    resumed.module.load_state_dict(model.module.state_dict())
    resumed_opt.load_state_dict(torch.load(path, weights_only=True))
    train(resumed, resumed_opt, STEPS // 2, rank, first=STEPS // 2)
    uninterrupted, uninterrupted_opt = build()
    train(uninterrupted, uninterrupted_opt, STEPS, rank)
    return max(float((a - b).abs().max())
               for a, b in zip(full_params(uninterrupted.module), full_params(resumed.module)))


COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "all_reduce", "broadcast", "gather", "scatter", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "send", "recv", "isend", "irecv", "barrier")


def patched_in_step(optimizer, patches):
    """``optimizer`` whose step() runs with ``patches`` ((owner, name, value) each) in place."""
    step = optimizer.step

    def patched_step(*args, **kwargs):
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, value in patches:
            setattr(owner, name, value)
        try:
            return step(*args, **kwargs)
        finally:
            for owner, name, value in originals:
                setattr(owner, name, value)
    optimizer.step = patched_step
    return optimizer


def fsdp_model_and_optimizer(settings, **extra):
    from torch.distributed.fsdp import fully_shard
    model = Net(settings)
    fully_shard(model, mesh=mesh_of(settings))
    return model, make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]), **extra)


def collectives_per_step(settings, rank, steps=2, sizes=None):
    """The torch.distributed functions that a step() of the case calls, by name, per step (after a
    first step, which makes the states); ``sizes``, a list, gets the size of the group of each call."""
    import torch.distributed as dist
    model, optimizer = fsdp_model_and_optimizer(settings)
    train(model, optimizer, 1, fed(settings, rank))
    calls = {}

    def counting(name, function):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if sizes is not None:
                sizes.append(dist.get_world_size(kwargs.get("group")))
            return function(*args, **kwargs)
        return counted
    patched_in_step(optimizer, [(dist, name, counting(name, getattr(dist, name))) for name in COLLECTIVES])
    train(model, optimizer, steps, fed(settings, rank), first=1)
    return {name: count / steps for name, count in calls.items()}


# The host syncs that no sharded step may make. Reads: a tensor's value on the host. Collectives: any
# blocking one (async_op=False) on tensors that are not data, and any wait() on the Work of one; the
# object collectives and the barrier carry no data at all. Data are floating-point tensors, the
# values that the step's math computes from the grads (rows of matrices, norms, column sums); an
# integer or bool tensor (row counts, sizes, offsets, flags) or no tensor at all is metadata, which
# fastoptim decides when the plan is made. DTensor's own collectives (a redistribution) wait in the
# functional collectives' wait_tensor, recorded whatever they carry: a step works on local shards.
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "scatter_object_list", "gather_object",
                      "barrier", "monitored_barrier")
# every optimizer, each engine, clipping on; "lean": 8-bit states, and subset norms by rows and columns
# (whose column sums are all-reduced) where it keeps a second moment, or Muon's heads
SYNC_OPTIMIZERS = ("adan", "adamw", "adamwsn", "rmspropsn", "lion", "muon")
SYNC_VARIANTS = {"dense": lambda name: (None, {}),
                 "lean": lambda name: ("heads" if name == "muon" else None if name == "lion" else "rows-columns",
                                       dict(state_bits=8))}


def tensors_in(values):
    """The tensors among ``values``, and in the lists and tuples among them (a collective's arguments)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from tensors_in(value)


class WatchedWork:
    """A collective's Work, whose wait() calls ``on_wait`` first; all else is the Work's."""

    def __init__(self, work, on_wait):
        self._work, self._on_wait = work, on_wait

    def wait(self, *args, **kwargs):
        self._on_wait()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def sync_watches(syncs, exempt):
    """(owner, name, value) patches that append to ``syncs`` a description of each host sync (see
    HOST_READS) made while they are in place; ``exempt()`` holds the tensors whose reads are allowed."""
    import inspect

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def reading(name, function):
        def read(tensor, *args, **kwargs):
            if not any(tensor is allowed for allowed in exempt()):
                syncs.append(f"Tensor.{name} of a {tuple(tensor.shape)} {tensor.dtype} tensor")
            return function(tensor, *args, **kwargs)
        return read

    def collective(name, function):
        signature = inspect.signature(function)

        def watched(*args, **kwargs):
            tensors = list(tensors_in([*args, *kwargs.values()]))
            if name in OBJECT_COLLECTIVES or not all(tensor.is_floating_point() for tensor in tensors):
                what = f"{name} of {sorted({str(tensor.dtype) for tensor in tensors}) or 'no tensor'}"
            else:
                what = None  # data
            work = function(*args, **kwargs)
            if not signature.bind(*args, **kwargs).arguments.get("async_op", False):
                if what is not None:
                    syncs.append(f"blocking {what}")
                return work
            return work if work is None or what is None else WatchedWork(
                work, lambda: syncs.append(f"Work.wait() of {what}"))
        return watched

    def functional_wait(tensor):
        syncs.append(f"a functional collective's wait_tensor of a {tensor.dtype} tensor (a DTensor collective)")
        return original_wait(tensor)
    original_wait = funcol.wait_tensor
    names = [name for name in (*COLLECTIVES, *OBJECT_COLLECTIVES) if hasattr(dist, name)]
    return ([(torch.Tensor, name, reading(name, getattr(torch.Tensor, name))) for name in HOST_READS]
            + [(dist, name, collective(name, getattr(dist, name))) for name in dict.fromkeys(names)]
            + [(funcol, "wait_tensor", functional_wait)])


def host_syncs_in_step(rank, mode="fsdp"):
    """Sharded steps (FSDP2, or HSDP with ``mode='hsdp'``; clipping on) of every optimizer on each
    engine, dense and lean (SYNC_VARIANTS), with each host sync (see HOST_READS) recorded in step():
    which ones, by case, or nothing. The step counts are exempt: they live on the host by design, as
    torch.optim's, and a GPU step reads none (optimizers.scalars)."""
    failures = []
    for optimizer_name in SYNC_OPTIMIZERS:
        for engine in ENGINES:
            for variant, options_of in SYNC_VARIANTS.items():
                sn, options = options_of(optimizer_name)
                clip = {} if "max_grad_norm" in OPTIONS[optimizer_name][1] else dict(max_grad_norm=CLIP)
                _, settings = case(mode, optimizer_name, engine, sn, **options, **clip)
                model, optimizer = fsdp_model_and_optimizer(settings)
                syncs = []

                def counts():
                    return [group.get("step") for group in optimizer.param_groups] + [
                        state.get("step") for state in optimizer.state.values()]
                patched_in_step(optimizer, sync_watches(syncs, counts))
                train(model, optimizer, 3, fed(settings, rank))
                failures += [f"{optimizer_name} {engine} {variant}: {sync}" for sync in dict.fromkeys(syncs)]
    return failures


def joined(rank, directory, world):
    """Join this rank to the gloo group of ``world`` ranks that meet in ``directory``, on one thread
    (several ranks on a 2-core machine); returns ``record(name, measure)``, which keeps ``measure()``,
    or its traceback, in this rank's results file."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # a case that fails on one rank fails, not hangs
    results = {}

    def record(name, measure):
        try:
            results[name] = measure()
        except Exception:
            results[name] = traceback.format_exc()
        Path(directory, f"rank{rank}.json").write_text(json.dumps(results))
    return record


def resumed_on_another_world(settings, rank, checkpoint):
    """A run resumed on this world from ``checkpoint``, saved after half the steps on another world
    size, and taken to the end: its relative error to one process."""
    model, optimizer = fsdp_model_and_optimizer(settings)
    restore(model, optimizer, checkpoint)
    train(model, optimizer, STEPS // 2, fed(settings, rank), first=STEPS // 2)
    return oracle.relative_error(full_params(model), one_process(settings))


DOCS = Path(__file__).parents[1] / "docs" / "distributed.md"


def docs_snippet(containing):
    """The python block of docs/distributed.md that holds ``containing``, as a test runs it."""
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if containing in block]
    return block


class AuxAdamNet(torch.nn.Module):
    """A model as Keller Jordan's MuonWithAuxAdam examples name its parts: ``embed``, ``body`` (blocks
    of matrices and biases) and ``head``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 32))
        self.head = torch.nn.Linear(32, 8, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.body:
            h = torch.tanh(block(h))
        return self.head(h)


def ported_muon_with_aux_adam():
    """docs/distributed.md's port of a MuonWithAuxAdam script, run as written under FSDP2 and in one
    process (fully_shard a no-op), every rank feeding the whole batch: the relative error of the
    first's params after 4 steps to the second's."""
    from torch.distributed.fsdp import fully_shard
    snippet = docs_snippet("MuonWithAuxAdam(param_groups)")
    runs = []
    for shard in (fully_shard, lambda module: module):
        namespace = dict(fastoptim=fastoptim, fully_shard=shard, model=AuxAdamNet())
        exec(snippet, namespace)
        model, optimizer = namespace["model"], namespace["optimizer"]
        for step in range(4):
            generator = torch.Generator().manual_seed(step)
            tokens, target = torch.randint(50, (16,), generator=generator), torch.randn(16, 8, generator=generator)
            torch.nn.functional.mse_loss(model(tokens), target).backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(full_params(model))
    return oracle.relative_error(*runs)


def worker(rank, directory, world=WORLD, checkpoints=None):
    """The cases of ``world`` ranks (2 or 4); on 4, each 2-rank checkpoint in ``checkpoints`` (the
    2-rank workers' directory) resumes."""
    import torch.distributed as dist

    record = joined(rank, directory, world)

    if world != WORLD:
        for name, settings in CHECKPOINTS.items():
            record("resumed on 4 ranks-" + name,
                   lambda: resumed_on_another_world(settings, rank, f"{checkpoints}/{name}"))
        for name in FOUR_RANKS:
            record(name, lambda: oracle.relative_error(full_params(distributed_run(CASES[name], rank)[0]),
                                                       one_process(CASES[name])))
        record("collectives", lambda: collectives_per_step(CASES["fsdp-muon-fused"], rank))
        record("experts collectives", lambda: collectives_per_step(CASES["fsdp-muon-fused-experts"], rank))
        hsdp_worker(rank, directory, record)
        dist.destroy_process_group()
        os._exit(0)
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
    record("zero checkpoint", lambda: zero_checkpoint_run(CASES["zero-adan-foreach"], rank, directory))
    record("zero checkpoint 8-bit", lambda: zero_checkpoint_run(CASES["zero-adan-fused-state_bits=8"], rank, directory))
    record("flattened checkpoint 8-bit", lambda: checkpoint_run(CHECKPOINTS["fsdp-adan-fused-state_bits=8"], rank,
                                                                 f"{directory}/flattened-8-bit", flatten=True))

    def straddling():
        model = Net()
        torch.distributed.fsdp.fully_shard(model)
        optimizer = fastoptim.AdamWSN(model.parameters(), sn=True, subset_size=32)
        train(model, optimizer, 1, rank)
    record("flattened-straddling", straddling)

    def orthogonalized():
        """How many matrices this rank orthogonalized in an FSDP2 Muon run: each once, on its owner."""
        from fastoptim.optimizers import muon_parts
        calls, original = [], muon_parts.orthogonalize
        muon_parts.orthogonalize = lambda matrices, *args: calls.append(len(matrices)) or original(matrices, *args)
        try:
            distributed_run(CASES["fsdp-muon-foreach"], rank)
        finally:
            muon_parts.orthogonalize = original
        return sum(calls)
    record("orthogonalized", orthogonalized)
    record("collectives", lambda: collectives_per_step(CASES["fsdp-muon-fused"], rank))
    record("experts collectives", lambda: collectives_per_step(CASES["fsdp-muon-fused-experts"], rank))
    record("host syncs", lambda: host_syncs_in_step(rank))
    record("docs muon port", ported_muon_with_aux_adam)

    def refusals():
        """The messages of the params that DTensor params cannot go with."""
        model = Net()
        torch.distributed.fsdp.fully_shard(model)
        messages = []
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = next(model.parameters()).device_mesh
        by_columns = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))
        for params, options in (([*model.parameters()], dict(shard_group=dist.group.WORLD)),
                                ([*model.parameters(), torch.nn.Parameter(torch.zeros(3))], {}),
                                ([*model.parameters(), by_columns], {})):
            try:
                fastoptim.Adan(params, **options)
            except ValueError as error:
                messages.append(str(error))
        # appended to a group between steps: refused at step(), which changes nothing (helper-108: the step took
        # them with the reductions found at construction, a Shard(1) param after Muon's momentum had run)
        for cls, appended in ((fastoptim.Muon, by_columns), (fastoptim.AdamW, torch.nn.Parameter(torch.zeros(3)))):
            optimizer = cls([param for param in model.parameters() if param.dim() == 2 or cls is not fastoptim.Muon],
                            max_grad_norm=0.5)
            for param in (*model.parameters(), appended):
                param.grad = torch.ones_like(param)
            optimizer.step()
            optimizer.param_groups[0]["params"].append(appended)
            before = [[t.to_local().clone() if hasattr(t, "to_local") else t.clone() for t in (param, *state.values())]
                      for param, state in optimizer.state.items()] + [[p.to_local().clone() for p in model.parameters()]]
            try:
                optimizer.step()
            except ValueError as error:
                after = [[t.to_local() if hasattr(t, "to_local") else t for t in (param, *state.values())]
                         for param, state in optimizer.state.items()] + [[p.to_local() for p in model.parameters()]]
                unchanged = all(torch.equal(a, b) for rows in zip(before, after) for a, b in zip(*rows))
                messages.append(f"{unchanged} {error}")
        return messages
    record("refusals", refusals)
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort at interpreter exit


def hsdp_worker(rank, directory, record):
    """The HSDP cases, on 4 ranks: their relative error to one process, and how many params' shards
    differ between the replicas. Every rank's torch RNG is seeded alike first (the cases before drew
    unlike numbers on ranks whose shards differ); "hsdp rank seeds" seeds them apart."""
    def compare(settings, seed=0):
        torch.manual_seed(seed)
        model, _ = distributed_run(settings, rank)
        return {"error": oracle.relative_error(full_params(model), one_process(settings)),
                "replicas differ": replicas_differ(model)}
    for name, settings in HSDP.items():
        record(name, lambda settings=settings: compare(settings))
    # each rank's torch RNG seeded apart, as training scripts seed their data order and dropout
    record("hsdp rank seeds", lambda: compare(HSDP["hsdp-muon-fused-state_bits=8"], seed=rank))
    for name, settings in HSDP_CHECKPOINTS.items():
        record("checkpoint-" + name, lambda: checkpoint_run(settings, rank, f"{directory}/{name}"))

    def collectives():
        sizes = []
        calls = collectives_per_step(HSDP["hsdp-muon-fused"], rank, sizes=sizes)
        return {"calls": calls, "group sizes": sorted(set(sizes))}
    record("hsdp collectives", collectives)

    def orthogonalized():
        """How many matrices this rank orthogonalized in an HSDP Muon run, and its replica group."""
        from fastoptim.optimizers import muon_parts
        calls, original = [], muon_parts.orthogonalize
        muon_parts.orthogonalize = lambda matrices, *args: calls.append(len(matrices)) or original(matrices, *args)
        try:
            model, _ = distributed_run(HSDP["hsdp-muon-foreach"], rank)
        finally:
            muon_parts.orthogonalize = original
        return [sum(calls), next(model.parameters()).device_mesh.get_local_rank(0)]
    record("hsdp orthogonalized", orthogonalized)
    record("hsdp host syncs", lambda: host_syncs_in_step(rank, "hsdp"))
    record("hsdp refusals", lambda: hsdp_refusals(rank))


def replicas_differ(model):
    """How many params' local shards differ (not bit for bit) between this rank's and the other
    replicas' (the ranks of its replicate dim, mesh dim 0)."""
    import torch.distributed as dist
    differ = 0
    for param in model.parameters():
        shard = param.to_local().detach()
        shards = [torch.empty_like(shard) for _ in range(HSDP_MESH[0])]
        dist.all_gather(shards, shard, group=param.device_mesh.get_group(0))
        differ += not all(torch.equal(shard, other) for other in shards)
    return differ


def hsdp_refusals(rank):
    """The messages of the DTensor params that cannot go with an HSDP model's: each refused by the
    constructor, and by add_param_group, which leaves the optimizer as it was (it steps on)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    model, optimizer = fsdp_model_and_optimizer(HSDP["hsdp-adan-fused"])
    mesh = next(model.parameters()).device_mesh
    cube = init_device_mesh("cpu", (1, *HSDP_MESH), mesh_dim_names=("a", "b", "c"))
    line = init_device_mesh("cpu", (4,))
    placed = {"another dim": (mesh, [Replicate(), Shard(1)]),
              "a 3-D mesh": (cube, [Replicate(), Replicate(), Shard(0)]),
              "sharded twice": (mesh, [Shard(0), Shard(0)]),
              "replicated": (mesh, [Replicate(), Replicate()]),
              "another mesh": (line, [Shard(0)]),
              "another mesh dim": (mesh, [Shard(0), Replicate()])}
    messages, groups = {}, len(optimizer.param_groups)
    for name, (on, placements) in placed.items():
        param = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), on, placements))
        try:
            fastoptim.Adan([*model.parameters(), param])
            messages[name] = "built"
        except ValueError as error:
            messages[name] = str(error)
        try:
            optimizer.add_param_group({"params": [param]})
            messages[name] += "; add_param_group took it"
        except ValueError:
            assert len(optimizer.param_groups) == groups
    train(model, optimizer, 1, fed(HSDP["hsdp-adan-fused"], rank))
    return messages


def run_workers(directory, world, timeout, module="tests.test_distributed", args=()):
    """Start ``world`` workers (``module`` run as ``python -m module rank directory world *args``), and
    return their results by case and rank, their directory and their outputs."""
    root = Path(__file__).parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, "-m", module, str(rank), str(directory), str(world), *map(str, args)],
                                cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for rank in range(world)]
    outputs = []
    for process in workers:
        try:
            outputs.append(process.communicate(timeout=timeout)[0].decode())
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            outputs.append(process.communicate()[0].decode())
    files = [directory / f"rank{rank}.json" for rank in range(world)]
    results = [json.loads(file.read_text()) if file.exists() else {} for file in files]
    return results, directory, outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The workers' results by case and rank, and their directory (checkpoints)."""
    return run_workers(tmp_path_factory.mktemp("distributed"), WORLD, 200)


@pytest.fixture(scope="module")
def runs_on_four(runs, tmp_path_factory):
    """The results of 4 workers (the FOUR_RANKS cases, the collectives, HSDP, and the 2 workers'
    checkpoints resumed)."""
    return run_workers(tmp_path_factory.mktemp("four-ranks"), 4, 300, args=[runs[1]])


def result(runs, name):
    results, _, outputs = runs
    values = [ranks.get(name, f"no result; the worker's output:\n{output[-3000:]}")
              for ranks, output in zip(results, outputs)]
    for value in values:
        assert not isinstance(value, str), value
    return values


@pytest.mark.parametrize("name", CASES)
def test_a_distributed_run_gives_the_parameters_of_one_process(runs, name):
    """Bit for bit where every rank feeds the whole batch (8-bit states, Muon: see fed), whose averaged
    gradient is one process's; within 1e-5 where each rank feeds its half, whose gradients the ranks
    add in another order than one process."""
    for error in result(runs, name):
        assert error == 0.0 if exact(CASES[name]) else error < 1e-5


def test_under_fsdp2_each_matrix_is_orthogonalized_once_by_one_rank(runs):
    per_rank = result(runs, "orthogonalized")
    assert sum(per_rank) == 6 * STEPS and min(per_rank) > 0  # w1..w6 each step, spread over both ranks


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_on_four_ranks_a_sharded_run_gives_the_parameters_of_one_process_bit_for_bit(runs_on_four, name):
    """Every rank feeds the whole batch; shards cut unevenly (w2: 2, 2, 1, 0 rows; w3: 18, 18, 18, 16),
    ranks 1-3 holding none of w4, and rank 3 none of e1's experts. Bit for bit, but where w1's column
    sums (subset norms by columns) add the ranks' partial sums, another order than one process's."""
    for error in result(runs_on_four, name):
        assert error == 0.0 if exact(CASES[name]) else error < 1e-6


@pytest.mark.parametrize("ranks", ["runs", "runs_on_four"])
def test_expert_weights_are_orthogonalized_where_they_live(ranks, request):
    """e1's experts, a matrix shape of their own, add no collective to a step: each rank
    orthogonalizes its whole experts (the runs with them equal one process bit for bit, above)."""
    for calls in result(request.getfixturevalue(ranks), "experts collectives"):
        assert calls == {"all_to_all_single": 2 * MUON_SHAPE_GROUPS, "all_reduce": 1}


@pytest.mark.parametrize("ranks", ["runs", "runs_on_four"])
def test_a_sharded_muon_step_takes_two_collectives_per_shape_group(ranks, request):
    """One all-to-all to the owners and one back per shape group (before: an all-gather of row counts,
    then a gather and a scatter per matrix); with clipping, one all-reduce of the norm besides."""
    for calls in result(request.getfixturevalue(ranks), "collectives"):
        assert calls == {"all_to_all_single": 2 * MUON_SHAPE_GROUPS, "all_reduce": 1}


def test_a_sharded_step_makes_no_host_sync(runs):
    """Every optimizer, each engine, dense and lean, clipping on (see host_syncs_in_step)."""
    assert result(runs, "host syncs") == [[]] * WORLD


def test_a_zero_checkpoint_saved_as_the_docs_say_resumes_bit_for_bit(runs):
    assert result(runs, "zero checkpoint") == [0.0] * WORLD


def test_a_zero_checkpoint_of_8_bit_states_resumes_bit_for_bit(runs):
    """ZeRO's load assigns each param's saved state whole, past load_state_dict (helper-95: saved codes under
    a key of their own restarted the states silently)."""
    assert result(runs, "zero checkpoint 8-bit") == [0.0] * WORLD


def test_an_8_bit_dcp_checkpoint_of_a_flattened_optimizer_state_dict_resumes_exactly(runs):
    """torch rebuilds a flattened state dict's states from the keys the optimizer holds, {} for those the
    checkpoint lacks: the block maxima, which a sharded state dict saves dequantized (helper-95: refused)."""
    assert result(runs, "flattened checkpoint 8-bit") == [0.0] * WORLD


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
    """With both splits named: the rows' and the second moment's, which torch.chunk cuts (the message said
    the subsets straddle the shards where they split unevenly instead, and advised what the param did:
    helper-82)."""
    results, _, _ = runs
    for ranks in results:
        assert "ValueError" in ranks["flattened-straddling"] and "where its second moment" in ranks["flattened-straddling"]


def test_dtensor_params_with_shard_group_plain_params_or_another_placement_are_refused(runs):
    for messages in result(runs, "refusals"):
        assert len(messages) == 5, messages
        assert "leave shard_group unset" in messages[0] and "not a mix" in messages[1]
        assert f"param {len(SHAPES)} (shape (4, 6))" in messages[2] and "Shard(dim=1)" in messages[2]
        # appended to a group between steps: refused at step(), nothing changed
        assert messages[3].startswith("True ") and "Shard(dim=1)" in messages[3]
        assert messages[4].startswith("True ") and "not a mix" in messages[4]


def test_the_docs_port_of_a_muon_with_aux_adam_script_runs_as_one_process_bit_for_bit(runs):
    """docs/distributed.md's block, run as written under FSDP2 on 2 ranks: the embedding, head and
    biases with AdamW (eps 1e-10), the body's matrices with sharded Muon."""
    assert result(runs, "docs muon port") == [0.0] * WORLD


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_dcp_checkpoint_resumes_exactly_on_two_ranks(runs, name):
    assert result(runs, "checkpoint-" + name) == [0.0] * WORLD


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_dcp_checkpoint_of_two_ranks_resumes_on_four(runs_on_four, name):
    """Resharding to more ranks: the 2 ranks' shards (w2's 3 + 2 rows, w4's 1 + 0) cut again into
    4 (2, 2, 1, 0 and 1, 0, 0, 0; 8-bit states quantized again in w1's 6 blocks per shard), and the
    run goes on to one process's result, bit for bit where the run was (see exact)."""
    for error in result(runs_on_four, "resumed on 4 ranks-" + name):
        assert error == 0.0 if exact(CHECKPOINTS[name]) else error < 1e-5


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_dcp_checkpoint_of_two_ranks_resumes_in_one_process(runs, name):
    """Resharding: the checkpoint loads into a plain model and optimizer. 8-bit states were saved
    dequantized (their blocks are per shard), so an fp32 optimizer takes them, and the 8-bit one
    quantizes them on load: here w1's shards are whole blocks, so the codes are those of one process.
    Bit for bit where the run was (see exact)."""
    _, directory, _ = runs
    settings = CHECKPOINTS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the matmuls' rounding, and so the 8-bit codes, depend on it
    try:
        resume_in_one_process(settings, directory / name)
    finally:
        torch.set_num_threads(threads)


def resume_in_one_process(settings, checkpoint):
    model = Net(settings)
    optimizer = make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]))
    template = make_optimizer(settings, param_groups(model, settings["sn"], settings["optimizer"]), state_bits=32)
    restore(model, template, checkpoint)
    optimizer.load_state_dict(template.state_dict())
    train(model, optimizer, STEPS // 2, first=STEPS // 2)
    error = oracle.relative_error(full_params(model), one_process(settings))
    assert error == 0.0 if exact(settings) else error < 1e-5


@pytest.mark.parametrize("cls", [fastoptim.Adan, fastoptim.AdamW, fastoptim.AdamWSN, fastoptim.RMSPropSN,
                                 fastoptim.Muon])
def test_shard_group_without_a_process_group_is_a_clear_error(cls):
    with pytest.raises(ValueError, match="shard_group is given, but torch.distributed is not initialised"):
        cls(oracle.make_params(), shard_group=object())


# --- HSDP: 4 ranks, a 2 x 2 mesh (replicate x shard) -----------------------------------------------

@pytest.mark.parametrize("name", HSDP)
def test_hsdp_gives_the_parameters_of_one_process_bit_for_bit(runs_on_four, name):
    """Bit for bit, but where w1's column sums (subset norms by columns) span the shards: each rank
    sums its rows of a column, and the all-reduce adds the partial sums, another order of fp32
    additions than one process's (a relative error of about 2e-7 here), as under FSDP2."""
    for measured in result(runs_on_four, name):
        assert measured["error"] == 0.0 if exact(HSDP[name]) else measured["error"] < 1e-6


@pytest.mark.parametrize("name", HSDP)
def test_hsdp_replicas_stay_equal_bit_for_bit(runs_on_four, name):
    for measured in result(runs_on_four, name):
        assert measured["replicas differ"] == 0


def test_hsdp_replicas_stay_equal_whatever_each_ranks_torch_seed(runs_on_four):
    """No step draws from the ranks' torch RNG (8-bit codes round to nearest): ranks seeded apart keep
    their replicas equal."""
    for measured in result(runs_on_four, "hsdp rank seeds"):
        assert measured["replicas differ"] == 0


@pytest.mark.parametrize("name", HSDP_CHECKPOINTS)
def test_an_hsdp_dcp_checkpoint_resumes_exactly(runs_on_four, name):
    assert result(runs_on_four, "checkpoint-" + name) == [0.0] * 4


@pytest.mark.parametrize("name", HSDP_CHECKPOINTS)
def test_an_hsdp_dcp_checkpoint_resumes_in_one_process(runs_on_four, name):
    """The states saved from the 2-D mesh (each replica group's shards, written once; 8-bit ones
    dequantized) reshard into one process's, bit for bit where the run was (see exact)."""
    _, directory, _ = runs_on_four
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resume_in_one_process(HSDP_CHECKPOINTS[name], directory / name)
    finally:
        torch.set_num_threads(threads)


def test_an_hsdp_muon_step_exchanges_over_the_shard_dim_only(runs_on_four):
    """Two all-to-alls per shape group and clipping's all-reduce, each over the 2 ranks of this
    rank's replica group: the replicas take no part."""
    for measured in result(runs_on_four, "hsdp collectives"):
        assert measured == {"calls": {"all_to_all_single": 2 * MUON_SHAPE_GROUPS, "all_reduce": 1},
                            "group sizes": [HSDP_MESH[1]]}


def test_under_hsdp_each_replica_group_orthogonalizes_each_matrix_once(runs_on_four):
    per_rank = result(runs_on_four, "hsdp orthogonalized")
    for replica in range(HSDP_MESH[0]):
        counts = [count for count, group in per_rank if group == replica]
        assert len(counts) == HSDP_MESH[1] and sum(counts) == 6 * STEPS and min(counts) > 0


def test_an_hsdp_step_makes_no_host_sync(runs_on_four):
    assert result(runs_on_four, "hsdp host syncs") == [[]] * 4


def test_dtensor_params_placed_otherwise_than_fsdp2_or_hsdp_are_refused(runs_on_four):
    """Refused when the optimizer is built, and by add_param_group, naming the param and its placement."""
    shape = f"param {len(SHAPES)} (shape (4, 6))"
    for messages in result(runs_on_four, "hsdp refusals"):
        assert all(message.startswith(shape) for message in messages.values()), messages
        assert "(Replicate(), Shard(dim=1))" in messages["another dim"]
        assert "3-D device mesh of shape (1, 2, 2)" in messages["a 3-D mesh"]
        assert "(Shard(dim=0), Shard(dim=0))" in messages["sharded twice"]
        assert "(Replicate(), Replicate())" in messages["replicated"]
        for name in ("another mesh", "another mesh dim"):
            assert "must share one device mesh and be sharded over the same mesh dim" in messages[name]
        assert "1-D device mesh of shape (4,)" in messages["another mesh"]
        assert "(Shard(dim=0), Replicate())" in messages["another mesh dim"]


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
