"""Host time of a step compiled by ``torch.compile`` (inductor, ``fullgraph=True``) against the eager
step: 148 params of 16 elements, so that the kernels' work is negligible and a step costs its host
side. fastoptim's AdamW and Adan (fused multi-tensor, the default engine), each with a float lr and a
tensor lr (the one a scheduler changes in place without recompiling), eager and compiled, and torch's
eager fused AdamW for scale, timed interleaved in one run. Each sample is the mean of ``--steps``
back-to-back steps; the table gives the median over ``--repeats`` samples and min..max. With
``--profile``, cProfile's largest entries of the compiled AdamW step (tensor lr) follow: the shares of
dynamo's guards, inductor's checks of its inputs and fastoptim's ops (cProfile inflates every Python
call, so its times are above the table's).
Usage, from the repository root: .venv/bin/python -m benchmarks.compiled_host_time [--threads N]
[--steps N] [--repeats N] [--profile]
"""
import argparse
import cProfile
import pstats
import statistics
import time
import warnings

import torch

import fastoptim
from fastoptim.measure import cpu_features

N_PARAMS, NUMEL = 148, 16


def optimizer(cls, lr, **options):
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(N_PARAMS)]
    for param in params:
        param.grad = torch.randn_like(param)
    return cls(params, lr=lr, **options)


def steps():
    """Each row's step function, warmed up (compiled ones traced)."""
    rows = {}
    for cls in (fastoptim.AdamW, fastoptim.Adan):
        for lr_name, lr in (("float lr", lambda: 1e-3), ("tensor lr", lambda: torch.tensor(1e-3))):
            rows[f"{cls.__name__} eager, {lr_name}"] = optimizer(cls, lr()).step
            rows[f"{cls.__name__} compiled, {lr_name}"] = torch.compile(optimizer(cls, lr()).step, backend="inductor",
                                                                      fullgraph=True)
    rows["torch AdamW fused, eager"] = optimizer(torch.optim.AdamW, 1e-3, fused=True).step
    for step in rows.values():
        for _ in range(3):
            step()
    return rows


def sample(step, n):
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--steps", type=int, default=100, help="steps per sample (default 100)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved samples (default 7)")
    parser.add_argument("--profile", action="store_true", help="cProfile the compiled AdamW step (tensor lr)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = steps()
    samples = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, step in rows.items():
            samples[name].append(sample(step, args.steps))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU features: {' '.join(cpu_features())}")
    print(f"{N_PARAMS} params of {NUMEL} elements; median of {args.repeats} interleaved samples of {args.steps} steps\n")
    print("| step | µs | min..max |\n|---|---|---|")
    for name, times in samples.items():
        print(f"| {name} | {statistics.median(times) * 1e6:.0f} | {min(times) * 1e6:.0f}..{max(times) * 1e6:.0f} |")
    if args.profile:
        profile = cProfile.Profile()
        step = rows["AdamW compiled, tensor lr"]
        profile.runcall(lambda: [step() for _ in range(300)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
