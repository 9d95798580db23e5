"""Host time of an optimizer step: params of 16 elements each, 148 and 2000 of them, so that the
kernels' work is negligible and a step costs its Python, dispatch, checks and thread wake-ups.
fastoptim's Adan and AdamW (fused multi-tensor, the default engine) and torch's fused AdamW, timed
interleaved in one run, at 1 thread and at torch's default, optionally while another process keeps
one core busy (``--busy``); and 148 params alternating fp32 and bf16 (a group of two buckets) at the
default threads. Each sample is the mean of ``--steps`` back-to-back steps; the table
gives the median over ``--repeats`` samples, min..max, and the median ratio to torch's fused AdamW.
A second table times the options that must cost little beyond the plain step, each against its twin
without it on the same params: clipping (``max_grad_norm``), subset-norm second moments (``sn``, on 148
8x8 matrices), 8-bit states (on 148 params of 4096 elements, the smallest that keep 8-bit states);
and a step checked in Python every time (its bound step dropped first) and its bound step planned again
after it, against the bound step: the checked part is what each released bucket's step and every step of
an optimizer that reduces over ranks cost (they plan no bound step).
A third table times each optimizer on 2000 params of 1,000-5,000 elements, as tensors of their own
and moved into one buffer by ``fastoptim.flatten_parameters``, against one param of the same numel,
interleaved: what many tensors cost beyond their elements. With ``--device cuda`` the
params are CUDA tensors (fastoptim's fused engine is then Triton's) and each sample ends with a sync.
Usage, from the repository root: .venv/bin/python -m benchmarks.host_time [--steps N] [--repeats N] [--busy]
[--device cuda]
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch

import fastoptim
from fastoptim.bench.run import synchronize
from fastoptim.measure import cpu_features

OPTIMIZERS = {
    "torch AdamW fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "fastoptim Adan": lambda params: fastoptim.Adan(params, lr=1e-3),
    "fastoptim AdamW": lambda params: fastoptim.AdamW(params, lr=1e-3),
}
BASELINE = "torch AdamW fused"


def sample(optimizer, steps, device):
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def with_grads(numels, device, dtypes=(torch.float32,)):
    """Params of ``numels`` elements with grads, their dtypes taken from ``dtypes`` in turn."""
    params = [torch.nn.Parameter(torch.randn(n, device=device, dtype=dtypes[i % len(dtypes)]))
              for i, n in enumerate(numels)]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def measure(n_params, threads, steps, repeats, device, dtypes=(torch.float32,)):
    """Rows of the table for ``n_params`` tiny params on ``threads`` threads, of ``dtypes`` in turn."""
    torch.set_num_threads(threads)
    optimizers = {}
    for name, make in OPTIMIZERS.items():
        optimizers[name] = make(with_grads([16] * n_params, device, dtypes))
        sample(optimizers[name], 3, device)  # states created, tables built
    samples = {name: [] for name in optimizers}
    for repeat in range(repeats):
        names = list(optimizers)
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # a rotating order
            samples[name].append(sample(optimizers[name], steps, device))
    rows = []
    for name, times in samples.items():
        ratios = [a / b for a, b in zip(times, samples[BASELINE])]
        label = f"{n_params}" if len(dtypes) == 1 else f"{n_params}, " + " and ".join(str(d).removeprefix("torch.")
                                                                                  for d in dtypes)
        rows.append(f"| {label} | {threads} | {name} | {statistics.median(times) * 1e6:.0f} | "
                    f"{min(times) * 1e6:.0f}..{max(times) * 1e6:.0f} | {statistics.median(ratios):.2f} |")
    return rows


def flattened(params):
    """``params`` moved into one buffer, their grads views of another (fastoptim.flatten_parameters)."""
    fastoptim.flatten_parameters(torch.nn.ParameterList(params))
    return params


class Checked:
    """An optimizer whose every step is checked in Python (its bound step dropped first), as each released
    bucket's step and every step of an optimizer that reduces over ranks is."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer._plans.bound = None
        self.optimizer.step()


# (row, its twin, make(params), shape of each of the 148 params)
VARIANTS = [
    ("AdamW, every step checked and planned again", "AdamW", lambda p: Checked(fastoptim.AdamW(p, lr=1e-3)), (16,)),
    ("AdamW max_grad_norm=1", "AdamW", lambda p: fastoptim.AdamW(p, lr=1e-3, max_grad_norm=1.0), (16,)),
    ("AdamW", None, lambda p: fastoptim.AdamW(p, lr=1e-3), (16,)),
    ("Adan max_grad_norm=1", "Adan", lambda p: fastoptim.Adan(p, lr=1e-3, max_grad_norm=1.0), (16,)),
    ("Adan", None, lambda p: fastoptim.Adan(p, lr=1e-3), (16,)),
    ("AdamWSN sn, 8x8", "AdamWSN, 8x8", lambda p: fastoptim.AdamWSN(p, lr=1e-3, sn=True), (8, 8)),
    ("AdamWSN, 8x8", None, lambda p: fastoptim.AdamWSN(p, lr=1e-3), (8, 8)),
    ("AdamW state_bits=8, 4096", "AdamW, 4096", lambda p: fastoptim.AdamW(p, lr=1e-3, state_bits=8), (4096,)),
    ("AdamW, 4096", None, lambda p: fastoptim.AdamW(p, lr=1e-3), (4096,)),
]


def variants(steps, repeats, device):
    """Rows of the options' table: each variant's µs per step and its ratio to its twin, interleaved."""
    optimizers = {}
    for name, _, make, shape in VARIANTS:
        params = [torch.nn.Parameter(torch.randn(shape, device=device)) for _ in range(148)]
        for param in params:
            param.grad = torch.randn_like(param)
        optimizers[name] = make(params)
        sample(optimizers[name], 3, device)
    samples = {name: [] for name in optimizers}
    for repeat in range(repeats):
        names = list(optimizers)
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            samples[name].append(sample(optimizers[name], steps, device))
    rows = []
    for name, twin, _, _ in VARIANTS:
        times, ratio = samples[name], ""
        if twin is not None:
            ratios = [a / b for a, b in zip(times, samples[twin])]
            ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
        rows.append(f"| {name} | {statistics.median(times) * 1e6:.0f} | {min(times) * 1e6:.0f}..{max(times) * 1e6:.0f} "
                    f"| {ratio} |")
    return rows


def many_against_one(steps, repeats, device):
    """Rows of the second table: each optimizer's step on 2000 params of 1,000-5,000 elements, each
    its own tensor or all in one buffer (fastoptim.flatten_parameters), and on one param of the same
    numel, at torch's default threads."""
    sizes = torch.randint(1000, 5001, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    layouts = {"2000 params": lambda: with_grads(sizes, device),
               "2000 flat": lambda: flattened(with_grads(sizes, device)),
               "1 param": lambda: with_grads([sum(sizes)], device)}
    optimizers = {}
    for name, make in OPTIMIZERS.items():
        for layout, params in layouts.items():
            optimizers[name, layout] = make(params())
            sample(optimizers[name, layout], 2, device)
    samples = {key: [] for key in optimizers}
    for repeat in range(repeats):
        keys = list(optimizers)
        for key in keys[repeat % len(keys):] + keys[:repeat % len(keys)]:
            samples[key].append(sample(optimizers[key], steps, device))
    rows = []
    for name in OPTIMIZERS:
        one, cells = samples[name, "1 param"], []
        for layout in ("2000 params", "2000 flat"):
            ratios = [a / b for a, b in zip(samples[name, layout], one)]
            cells += [f"{statistics.median(samples[name, layout]) * 1e3:.2f}",
                      f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"]
        rows.append(f"| {name} | {' | '.join(cells)} | {statistics.median(one) * 1e3:.2f} |")
    return rows, sum(sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps per sample (default 50)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved samples (default 7)")
    parser.add_argument("--busy", action="store_true", help="keep one core busy with another process")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="of the params (default cpu)")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        gpu = f"; GPU {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
        print(f"{time.strftime('%Y-%m-%d')}; torch {torch.__version__}{gpu}; {default_threads} threads by default; "
              f"CPU features: {' '.join(cpu_features())}; {'one core busy' if args.busy else 'no load of ours'}")
        print("| params | threads | optimizer | µs per step | min..max | / torch's fused AdamW |")
        print("|---|---|---|---|---|---|")
        for n_params in (148, 2000):
            for threads in sorted({1, default_threads}):
                print("\n".join(measure(n_params, threads, args.steps, args.repeats, args.device)), flush=True)
        mixed = (torch.float32, torch.bfloat16)  # a group of two buckets
        print("\n".join(measure(148, default_threads, args.steps, args.repeats, args.device, mixed)), flush=True)
        torch.set_num_threads(default_threads)
        print(f"\nOptions, 148 params, {default_threads} threads: each against its twin without the option")
        print("| optimizer | µs per step | min..max | / its twin (min..max) |")
        print("|---|---|---|---|")
        print("\n".join(variants(args.steps, args.repeats, args.device)), flush=True)
        rows, numel = many_against_one(max(args.steps // 10, 3), args.repeats, args.device)
        print(f"\n2000 params of 1,000-5,000 elements ({numel / 1e6:.1f}M) against one param of that numel, "
              f"{default_threads} threads")
        print("| optimizer | ms per step, 2000 params | ratio to 1 param (min..max) | ms, 2000 flattened | ratio "
              "(min..max) | ms, 1 param |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
    finally:
        if spinner:
            spinner.kill()


if __name__ == "__main__":
    main()
