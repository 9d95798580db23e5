"""Host time of an optimizer step: params of 16 elements each, 148 and 2000 of them, so that the
kernels' work is negligible and a step costs its Python, dispatch, checks and thread wake-ups.
fastoptim's Adan and AdamW (fused multi-tensor, the default engine) and torch's fused AdamW, timed
interleaved in one run, at 1 thread and at torch's default, optionally while another process keeps
one core busy (``--busy``). Each sample is the mean of ``--steps`` back-to-back steps; the table
gives the median over ``--repeats`` samples, min..max, and the median ratio to torch's fused AdamW.
Usage, from the repository root: .venv/bin/python -m benchmarks.host_time [--steps N] [--repeats N] [--busy]
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch

import fastoptim
from fastoptim.measure import cpu_features

OPTIMIZERS = {
    "torch AdamW fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "fastoptim Adan": lambda params: fastoptim.Adan(params, lr=1e-3),
    "fastoptim AdamW": lambda params: fastoptim.AdamW(params, lr=1e-3),
}
BASELINE = "torch AdamW fused"


def sample(optimizer, steps):
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def measure(n_params, threads, steps, repeats):
    """Rows of the table for ``n_params`` tiny params on ``threads`` threads."""
    torch.set_num_threads(threads)
    optimizers = {}
    for name, make in OPTIMIZERS.items():
        params = [torch.nn.Parameter(torch.randn(16)) for _ in range(n_params)]
        for param in params:
            param.grad = torch.randn(16)
        optimizers[name] = make(params)
        sample(optimizers[name], 3)  # states created, tables built
    samples = {name: [] for name in optimizers}
    for repeat in range(repeats):
        names = list(optimizers)
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # a rotating order
            samples[name].append(sample(optimizers[name], steps))
    rows = []
    for name, times in samples.items():
        ratios = [a / b for a, b in zip(times, samples[BASELINE])]
        rows.append(f"| {n_params} | {threads} | {name} | {statistics.median(times) * 1e6:.0f} | "
                    f"{min(times) * 1e6:.0f}..{max(times) * 1e6:.0f} | {statistics.median(ratios):.2f} |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps per sample (default 50)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved samples (default 7)")
    parser.add_argument("--busy", action="store_true", help="keep one core busy with another process")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        print(f"{time.strftime('%Y-%m-%d')}; torch {torch.__version__}; {default_threads} threads by default; "
              f"CPU features: {' '.join(cpu_features())}; {'one core busy' if args.busy else 'no load of ours'}")
        print("| params | threads | optimizer | µs per step | min..max | / torch's fused AdamW |")
        print("|---|---|---|---|---|---|")
        for n_params in (148, 2000):
            for threads in sorted({1, default_threads}):
                print("\n".join(measure(n_params, threads, args.steps, args.repeats)), flush=True)
    finally:
        if spinner:
            spinner.kill()


if __name__ == "__main__":
    main()
