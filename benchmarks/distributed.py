"""Optimizer state bytes and step time per rank under ZeroRedundancyOptimizer and FSDP2, on N CPU
processes (gloo), for Adam (torch.optim.AdamW) and fastoptim's Adan, 8-bit Adan, AdamWSN and Muon.

    .venv/bin/python -m benchmarks.distributed --world-size 2 [--model gpt2-124m] [--steps 3]

The model is the param shapes of ``--model`` (see fastoptim.bench.models), with fixed random grads:
the step, not forward and backward, is measured. A ZeRO step includes its broadcast of the updated
params. "state" is the rank's optimizer state (local shards, 8-bit block maxima included); "params +
grads + state" adds the rank's params and grads: all of them under ZeRO, its shards under FSDP2.
Each rank runs one torch thread; with more ranks than cores, the times include waiting for a core.

Muon takes the hidden matrices (the params that get subset-norm states elsewhere), AdamW the rest.
Under FSDP2 a second table gives, per Muon step, the collectives each rank calls and the bytes it
sends to other ranks, against the target 2 × (its share of the Muon params' bytes) × (world − 1)/world
+ 1%: each rank's rows of a matrix go to its owner and the rows of the result come back.
"""
import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fastoptim
from fastoptim.bench import models

OPTIMIZERS = {
    "adam": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    "adan": (fastoptim.Adan, dict(lr=1e-3, weight_decay=0.02, max_grad_norm=1.0)),
    "adan-8bit": (fastoptim.Adan, dict(lr=1e-3, weight_decay=0.02, max_grad_norm=1.0, state_bits=8)),
    "adamwsn": (fastoptim.AdamWSN, dict(lr=1e-2, weight_decay=0.01)),
    "muon": (fastoptim.Muon, dict(lr=0.02, weight_decay=0.01, max_grad_norm=1.0)),
}
MODES = ("zero", "fsdp")
MIB = 1 << 20


def local_bytes(tensor):
    tensor = tensor.to_local() if isinstance(tensor, torch.distributed.tensor.DTensor) else tensor
    return tensor.numel() * tensor.element_size()


def state_bytes(optimizer):
    return sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def build(shapes, mode, name):
    """The params (with grads) and the optimizer of one measurement."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(torch.randn(shape) * 0.02 for shape, _ in shapes)
    if mode == "fsdp":
        fully_shard(module)
    params = list(module.parameters())
    for param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        grad = torch.randn(local.shape) * 1e-3
        param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, shape=param.shape,
                                        stride=param.stride()) if isinstance(param, DTensor) else grad
    cls, options = OPTIMIZERS[name]
    hidden = [{"params": [p for p, (_, sn) in zip(params, shapes) if sn]} | (
        {"sn": name == "adamwsn"} if name != "muon" else {})]
    groups = hidden + [{"params": [p for p, (_, sn) in zip(params, shapes) if not sn]} | (
        {"use_muon": False} if name == "muon" else {})]
    groups = [group for group in groups if group["params"]]
    if mode == "zero":
        extra = {} if cls is torch.optim.AdamW else dict(shard_group=dist.group.WORLD)
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **options, **extra)
        return params, optimizer, optimizer.optim
    optimizer = cls(groups, **options)
    return params, optimizer, optimizer


class Traffic:
    """Counts the torch.distributed calls, and the bytes that all-to-alls send to other ranks, while on."""
    COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
                   "broadcast", "gather", "scatter", "reduce_scatter_tensor")

    def __init__(self):
        self.calls, self.sent, self.originals = 0, 0, {name: getattr(dist, name) for name in self.COLLECTIVES}

    def __enter__(self):
        for name, function in self.originals.items():
            setattr(dist, name, self._counting(name, function))
        return self

    def __exit__(self, *exc):
        for name, function in self.originals.items():
            setattr(dist, name, function)

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            self.calls += 1
            if name == "all_to_all_single":
                output, data, output_sizes, input_sizes = args[:4]
                rank, row = dist.get_rank(kwargs.get("group")), data.element_size() * math.prod(data.shape[1:])
                self.sent += (sum(input_sizes) - input_sizes[rank]) * row
            return function(*args, **kwargs)
        return counted


def measure(shapes, mode, name, steps):
    params, optimizer, local_optimizer = build(shapes, mode, name)
    optimizer.step()  # creates the states
    times = []
    with Traffic() as traffic:
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
    model_bytes = sum(local_bytes(p) + local_bytes(p.grad) for p in params)
    state = state_bytes(local_optimizer)
    measured = dict(state=state / MIB, total=(state + model_bytes) / MIB, ms=statistics.median(times) * 1e3,
                    calls=traffic.calls / steps, sent=traffic.sent / steps)  # (the barrier is not counted)
    if name == "muon":
        muon = local_optimizer.param_groups[0]["params"]
        measured["muon bytes"] = sum(p.numel() * p.element_size() for p in muon)  # global: the whole matrices
    return measured


def worker(rank, world, rendezvous, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    shapes = models.shapes(args.model)
    rows = [(mode, name, measure(shapes, mode, name, args.steps)) for mode in args.modes for name in args.optimizers]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        report(gathered, args, sum(torch.Size(shape).numel() for shape, _ in shapes))
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort at interpreter exit


def report(gathered, args, numel):
    world = len(gathered)
    print(f"{args.model} ({numel / 1e6:.1f}M params), {world} ranks (gloo, 1 thread each), "
          f"median of {args.steps} steps; MiB and ms per rank, as min-max over ranks")
    print("| mode | optimizer | state MiB | params + grads + state MiB | ms/step | state / Adam's |")
    print("|---|---|---|---|---|---|")
    for i, (mode, name, _) in enumerate(gathered[0]):
        per_rank = [rows[i][2] for rows in gathered]
        adam = next(j for j, (m, n, _) in enumerate(gathered[0]) if m == mode and n == "adam")
        adam_state = sum(rows[adam][2]["state"] for rows in gathered)
        span = {key: f"{min(r[key] for r in per_rank):.1f}-{max(r[key] for r in per_rank):.1f}"
                for key in ("state", "total")}
        ms = f"{min(r['ms'] for r in per_rank):.0f}-{max(r['ms'] for r in per_rank):.0f}"
        print(f"| {mode} | {name} | {span['state']} | {span['total']} | {ms} | "
              f"{sum(r['state'] for r in per_rank) / adam_state:.2f} |")
    for i, (mode, name, _) in enumerate(gathered[0]):
        if mode == "fsdp" and name == "muon":
            per_rank = [rows[i][2] for rows in gathered]
            target = 2 * per_rank[0]["muon bytes"] / world * (world - 1) / world * 1.01
            print(f"\nFSDP2 Muon, per step and rank: collectives {min(r['calls'] for r in per_rank):.0f}-"
                  f"{max(r['calls'] for r in per_rank):.0f} (one of them clipping's all-reduce); bytes sent to other "
                  f"ranks {min(r['sent'] for r in per_rank) / MIB:.2f}-{max(r['sent'] for r in per_rank) / MIB:.2f} "
                  f"MiB, target <= {target / MIB:.2f} MiB (2 x its share of the Muon params' "
                  f"{per_rank[0]['muon bytes'] / MIB:.1f} MiB x (world-1)/world + 1%)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="gpt2-tiny", choices=sorted(models.MODELS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(worker, args=(args.world_size, f"{directory}/rendezvous", args),
                                    nprocs=args.world_size)


if __name__ == "__main__":
    main()
