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
    """Every optimizer the benchmark knows, by name: fastoptim's engines, then torch's peers."""
    table = {}
    for cls in (fastoptim.Adan, fastoptim.AdamW):
        for engine, flags in ENGINES.items():
            table[f"{cls.__name__.lower()}-{engine}"] = (cls, flags)
    table["torch-adamw-foreach"] = (torch.optim.AdamW, dict(foreach=True, fused=None))
    table["torch-adamw-fused"] = (torch.optim.AdamW, dict(foreach=None, fused=True))
    return table


def model_params(model, dtype=torch.float32, seed=0):
    """Params with random grads in ``model``'s shapes."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in MODELS[model]():
        param = torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype) * 0.02)
        param.grad = torch.randn(shape, generator=generator, dtype=dtype) * 1e-3
        params.append(param)
    return params


def build(params, cls, flags):
    return cls(params, lr=1e-4, weight_decay=0.02, **flags)


def steppers(params, names):
    """A step function per optimizer name. To fit in memory, all share ``params`` and their grads,
    and the engines of one optimizer class share its states: each step sets its engine flags."""
    table, shared = {}, {}
    for name in names:
        cls, flags = optimizers()[name]
        if cls not in shared:
            shared[cls] = build(params, cls, {})
        table[name] = with_flags(shared[cls], flags)
    for step in table.values():
        step()  # allocate states outside the timing
    return table


def with_flags(optimizer, flags):
    def step():
        optimizer.param_groups[0].update(flags)
        optimizer.step()
    return step


def step_in_subprocess(spec):
    """In a measuring subprocess: warm up (state allocation), then the peak extra bytes of one step."""
    torch.set_num_threads(spec["threads"])
    cls, flags = optimizers()[spec["optimizer"]]
    optimizer = build(model_params(spec["model"]), cls, flags)
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
        numel = sum(torch.Size(shape).numel() for shape in MODELS[model]())
        print(f"\n{model}: {len(MODELS[model]())} tensors, {numel / 1e6:.1f}M params")
        seconds = time_steps(steppers(model_params(model), names), steps, repeats)
        base = seconds[names[0]]
        print(f"| optimizer | ms/step | vs {names[0]} |" + (" peak extra MB |" if measure_memory else ""))
        print("|---|---|---|" + ("---|" if measure_memory else ""))
        for name in names:
            row = f"| {name} | {seconds[name] * 1e3:.1f} | {base / seconds[name]:.2f}x |"
            if measure_memory:
                extra = memory.peak_extra_bytes(dict(model=model, optimizer=name, threads=threads))
                row += f" {extra / 2**20:.1f} |"
            print(row, flush=True)
