"""A small benchmark of optimizer steps: time per step (interleaved repeats, medians) and peak memory."""
import statistics
import time

import torch

import fastoptim

from . import memory
from .shapes import MODELS

ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}


def optimizers():
    """Every optimizer the benchmark knows, by name, as (class, engine flags, subset-norm states on
    the Linear weights): fastoptim's engines, then torch's peers."""
    table = {}
    for prefix, cls, sn in (("adan", fastoptim.Adan, False), ("adamw", fastoptim.AdamW, False),
                            ("adan-sn", fastoptim.Adan, True), ("adamwsn", fastoptim.AdamWSN, True)):
        for engine, flags in ENGINES.items():
            table[f"{prefix}-{engine}"] = (cls, flags, sn)
    table["torch-adamw-foreach"] = (torch.optim.AdamW, dict(foreach=True, fused=None), False)
    table["torch-adamw-fused"] = (torch.optim.AdamW, dict(foreach=None, fused=True), False)
    return table


def model_params(model, dtype=torch.float32, seed=0):
    """Params with random grads in ``model``'s shapes, and whether each is a Linear weight."""
    generator = torch.Generator().manual_seed(seed)
    params, linear = [], []
    for shape, is_linear in MODELS[model]():
        param = torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype) * 0.02)
        param.grad = torch.randn(shape, generator=generator, dtype=dtype) * 1e-3
        params.append(param)
        linear.append(is_linear)
    return params, linear


def build(params, linear, cls, flags, sn):
    if not sn:
        return cls(params, lr=1e-4, weight_decay=0.02, **flags)
    groups = [{"params": [p for p, is_linear in zip(params, linear) if is_linear], "sn": True},
              {"params": [p for p, is_linear in zip(params, linear) if not is_linear]}]
    return cls(groups, lr=1e-4, weight_decay=0.02, **flags)


def state_bytes(optimizer):
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


def steppers(params, linear, names):
    """A step function per optimizer name, and the state bytes of each. To fit in memory, all share
    ``params`` and their grads, and the engines of one optimizer share its states: each step sets
    its engine flags."""
    table, sizes, shared = {}, {}, {}
    for name in names:
        cls, flags, sn = optimizers()[name]
        if (cls, sn) not in shared:
            shared[cls, sn] = build(params, linear, cls, {}, sn)
        table[name] = with_flags(shared[cls, sn], flags)
    for name, step in table.items():
        step()  # allocate states outside the timing
        sizes[name] = state_bytes(shared[optimizers()[name][0], optimizers()[name][2]])
    return table, sizes


def with_flags(optimizer, flags):
    def step():
        for group in optimizer.param_groups:
            group.update(flags)
        optimizer.step()
    return step


def step_in_subprocess(spec):
    """In a measuring subprocess: warm up (state allocation), then the peak extra bytes of one step."""
    torch.set_num_threads(spec["threads"])
    cls, flags, sn = optimizers()[spec["optimizer"]]
    optimizer = build(*model_params(spec["model"]), cls, flags, sn)
    optimizer.step()
    return memory.measure_step(optimizer.step)


def time_steps(steps_by_name, steps, repeats):
    """Median seconds per step of each step function; repeats are interleaved so drift hits all
    alike, and each starts with an untimed step (the first after switching engines rebuilds caches)."""
    samples = {name: [] for name in steps_by_name}
    for _ in range(repeats):
        for name, step in steps_by_name.items():
            step()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(times) for name, times in samples.items()}


def main(models, names, steps, repeats, threads, measure_memory):
    torch.set_num_threads(threads)
    print(f"fastoptim {fastoptim.__version__}, torch {torch.__version__}, {threads} threads, "
          f"{steps} steps x {repeats} interleaved repeats, fp32")
    for model in models:
        numel = sum(torch.Size(shape).numel() for shape, _ in MODELS[model]())
        print(f"\n{model}: {len(MODELS[model]())} tensors, {numel / 1e6:.1f}M params")
        table, sizes = steppers(*model_params(model), names)
        seconds = time_steps(table, steps, repeats)
        base = seconds[names[0]]
        print(f"| optimizer | ms/step | vs {names[0]} | state MiB |" + (" peak extra MiB |" if measure_memory else ""))
        print("|---|---|---|---|" + ("---|" if measure_memory else ""))
        for name in names:
            row = f"| {name} | {seconds[name] * 1e3:.1f} | {base / seconds[name]:.2f}x | {sizes[name] / 2**20:.1f} |"
            if measure_memory:
                extra = memory.peak_extra_bytes(dict(model=model, optimizer=name, threads=threads))
                row += f" {extra / 2**20:.1f} |"
            print(row, flush=True)
