"""The step's dispatch: eager against ``torch.compile(opt.step, fullgraph=True)``, the time of the
first two compiled calls (the first traces and compiles, with an empty inductor cache, after inductor's
one-time start in the process, which a trivial function pays first and is printed apart), and the
eager step's Python time per tensor (the step with the C kernel call replaced by a no-op), for
fastoptim's Adan, AdamW and 8-bit Adan (fused multi-tensor, a tensor lr) and torch's fused AdamW,
on GPT-2 124M shapes and on 2000 tensors of 1,000-5,000 elements; and eager against compiled whole
training steps of an 8.4M-param MLP, with each optimizer. One optimizer at a time (so that
the others' states do not crowd the memory), its eager and compiled steps and the bandwidth probe
are timed interleaved (medians, and min..max of the per-sample ratio compiled/eager). With
``--device cuda`` params, grads and the model are CUDA tensors (fastoptim's fused engine is Triton's),
the probe is a copy of the same bytes, and there is no Python-time column.
Usage, from the repository root: .venv/bin/python -m benchmarks.dispatch [--steps N] [--repeats N]
[--device cuda]
"""
import argparse
import os
import statistics
import tempfile
import time
from unittest import mock

import torch
from torch._dynamo.utils import counters

import fastoptim
from benchmarks.scaling import gpt2_params, materialize
from fastoptim.bench import run
from fastoptim.measure import cpu_features
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.optimizers.base import FastOptimizer


def lr(params):
    """A tensor lr on the params' device (fastoptim refuses one elsewhere)."""
    return torch.tensor(1e-4, device=params[0].device)


OPTIMIZERS = {
    "fastoptim Adan": lambda params: fastoptim.Adan(params, lr=lr(params), weight_decay=0.02),
    "fastoptim AdamW": lambda params: fastoptim.AdamW(params, lr=lr(params), weight_decay=0.02),
    "fastoptim Adan 8-bit": lambda params: fastoptim.Adan(params, lr=lr(params), weight_decay=0.02, state_bits=8),
    "torch AdamW fused": lambda params: torch.optim.AdamW(params, lr=lr(params), weight_decay=0.02, fused=True),
}


def small_tensors(count=2000):
    sizes = torch.randint(1000, 5001, (count,), generator=torch.Generator().manual_seed(0)).tolist()
    return materialize([(n,) for n in sizes])


MODELS = {"GPT-2 124M": lambda: gpt2_params(12, 768)[0], "2000 small tensors": small_tensors}
TRAINING = "training step of an 8.4M-param MLP"  # the other --models choice: measure_training


def compiled(function, fullgraph=False):
    """``torch.compile(function)``, and the seconds of its first and second calls."""
    compiled_function, seconds = torch.compile(function, fullgraph=fullgraph), []
    for _ in range(2):
        start = time.perf_counter()
        compiled_function()
        seconds.append(time.perf_counter() - start)
    return compiled_function, seconds


def time_cells(eager, compiled_samples):
    """Table cells of eager and compiled samples: their medians (ms), and the median and range of
    the per-sample ratio compiled / eager."""
    ratios = [b / a for a, b in zip(eager, compiled_samples)]
    return (f"{statistics.median(eager) * 1e3:.1f} | {statistics.median(compiled_samples) * 1e3:.1f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})")


def python_seconds(optimizer, steps):
    """The eager step's seconds with the native kernel call (and the version bumps after it) replaced
    by a no-op: its arguments are still made."""
    def arguments_only(call, *args):
        call.arguments(*args)
        return cpu_backend.STEPPED

    with mock.patch.object(cpu_backend.StepCall, "run", arguments_only):
        optimizer.step()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        return (time.perf_counter() - start) / steps


def with_grads(params):
    """Copies of ``params``, with copies of their grads."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for copy, original in zip(copies, params):
        copy.grad = original.grad.clone()
    return copies


def on_device(params, device):
    """``params`` moved to ``device``, with their grads."""
    moved = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    for copy, original in zip(moved, params):
        copy.grad = original.grad.to(device)
    return moved


def measure_one(make, params, probe_step, steps, repeats, device):
    """One optimizer's eager and compiled steps, interleaved with the probe; each optimizer is timed
    on its own, so that the others' params and states do not crowd the memory."""
    eager = make(with_grads(params))
    torch._dynamo.reset()
    counters.clear()
    optimizer = make(with_grads(params))
    # torch's fused step is compiler.disable'd, a graph break: fullgraph for ours only
    step, first_calls = compiled(optimizer.step, fullgraph=isinstance(optimizer, FastOptimizer))
    graphs = counters["stats"]["unique_graphs"]
    counters.clear()
    samples, errors, _ = run.time_steps({"probe": probe_step, "eager": eager.step, "compiled": step}, steps, repeats,
                                     device)
    recompiles = counters["stats"]["unique_graphs"]
    python = python_seconds(eager, steps) if isinstance(eager, FastOptimizer) and device == "cpu" else None
    torch._dynamo.reset()
    return samples, errors, first_calls, graphs, recompiles, python


def measure(model_name, steps, repeats, device):
    params = on_device(MODELS[model_name](), device)
    numel = sum(p.numel() for p in params)
    probe_step, probe_bytes = run.probe(params, device)
    rows = []
    for name, make in OPTIMIZERS.items():
        samples, errors, (first, second), graphs, recompiles, python = measure_one(make, params, probe_step, steps,
                                                                                  repeats, device)
        if errors:
            rows.append(f"| {name} | {errors} |")
            continue
        probe = probe_bytes / statistics.median(samples["probe"]) / 1e9
        py = "—" if python is None else f"{python * 1e6 / len(params):.2f}"
        rows.append(f"| {name} | {time_cells(samples['eager'], samples['compiled'])} | {first:.1f} | "
                    f"{second:.1f} | {graphs} | {recompiles} | {py} | {probe:.1f} |")
    print(f"\n### {model_name}: {len(params)} tensors, {numel / 1e6:.1f}M params")
    print("| optimizer | eager ms | compiled ms | compiled / eager | 1st call s | 2nd call s | graphs | "
          "recompiles while timed | eager Python µs/tensor | probe GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def mlp():
    """A model of 8 layers of 1024 x 1024 (8.4M params), always the same."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())])


def training_step(make, clip, device):
    """A training step (forward, backward, clipping, the optimizer's step, zero_grad) of its own model."""
    model = mlp().to(device)
    optimizer = make(list(model.parameters()))
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        model(x).square().mean().backward()
        clip(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return step


def measure_training(steps, repeats, device):
    """Eager against ``torch.compile`` of the whole training step (no fullgraph: the backward breaks
    the graph), one optimizer at a time; fastoptim's steps clip with ``fastoptim.clip_grad_norm_``."""
    rows = []
    for name, make in OPTIMIZERS.items():
        clip = fastoptim.clip_grad_norm_ if name.startswith("fastoptim") else torch.nn.utils.clip_grad_norm_
        eager = training_step(make, clip, device)
        torch._dynamo.reset()
        step, (first, second) = compiled(training_step(make, clip, device))
        samples, errors, _ = run.time_steps({"eager": eager, "compiled": step}, steps, repeats, device)
        torch._dynamo.reset()
        if errors:
            rows.append(f"| {name} | {errors} |")
            continue
        rows.append(f"| {name} | {time_cells(samples['eager'], samples['compiled'])} | {first:.1f} | {second:.1f} |")
    print(f"\n### {TRAINING}: forward, backward, clip_grad_norm_, step, zero_grad; batch 32. The first "
          "optimizer's first call also compiles the model's forward and backward, which the others find in "
          "inductor's cache")
    print("| optimizer | eager ms | compiled ms | compiled / eager | 1st call s | 2nd call s |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


def main():
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # a first compile, as a user's is: no cached code
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="steps per sample (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved samples (default 5)")
    parser.add_argument("--models", nargs="+", default=[*MODELS, TRAINING], choices=[*MODELS, TRAINING])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    args = parser.parse_args()
    gpu = f"; GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(f"torch {torch.__version__}{gpu}; threads {torch.get_num_threads()}; CPU features: {' '.join(cpu_features())}")
    _, (first, _) = compiled(lambda: torch.ones(8).mul(2).add(1))
    print(f"inductor's one-time start in this process (its probe of the CPU's vector instructions), paid by the first "
          f"compile of any function and kept out of the rows below: {first:.1f} s")
    for model_name in args.models:
        if model_name == TRAINING:
            measure_training(args.steps, args.repeats, args.device)
        else:
            measure(model_name, args.steps, args.repeats, args.device)


if __name__ == "__main__":
    main()
