"""The 8-bit Muon momentum's speed in two builds (issue 52, item 3: the linear codes against the
float-like ones they replaced). Each round runs one process per source tree (each with its own built
library), in alternating order; a process steps ``fastoptim.Muon(fused=True, state_bits=8)`` and
takes the least time of its momentum kernel over its steps (the ``fastoptim::bound_step`` op, from
torch's profiler: the Newton–Schulz iterations around it are the same in both builds and would drown
it; the least, since on a shared machine interference only adds time). The params
are wide matrices of few rows, so that the iterations cost little. Also, in this process (whose
fastoptim must have the linear table), the codecs alone: dequantizing and requantizing the same
elements in each table, interleaved.
Reports per tree the median of the rounds' times with their min..max, and the median and range of
the rounds' ratios (second tree / first).
Usage, from the repository root: .venv/bin/python -m benchmarks.muon_8bit_speed OLD_TREE NEW_TREE [--rounds N]
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

SHAPES = [(16, 1 << 18)] * 4  # 16.8M elements: 8-bit states far beyond the caches


def kernel_ms(steps: int) -> float:
    """The least time (ms) of the momentum kernel over ``steps`` profiled Muon steps, in this
    process's fastoptim, at 1 thread."""
    import fastoptim
    from torch.profiler import profile

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = fastoptim.Muon(params, lr=0.02, fused=True, state_bits=8, ns_steps=1)
    times = []
    for step in range(steps + 2):  # two to warm up: states, tables
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        with profile() as prof:
            optimizer.step()
        kernel = [event for event in prof.events() if event.name == "fastoptim::bound_step"]
        assert len(kernel) == 1, [event.name for event in prof.events()]
        times.append(kernel[0].cpu_time_total / 1e3)
    return min(times[2:])


def codec_ms(table: int, values: torch.Tensor, rounds: int) -> list[float]:
    """Times (ms) of dequantizing and requantizing ``values``' codes in code table ``table``."""
    codes = torch.empty(values.shape, dtype=torch.uint8)
    absmax = torch.empty(-(-values.numel() // 256))
    torch.ops.fastoptim.quantize(values, table, codes, absmax)
    out, times = torch.empty_like(values), []
    for _ in range(rounds):
        start = time.perf_counter()
        torch.ops.fastoptim.dequantize(codes, absmax, table, out)
        torch.ops.fastoptim.quantize(out, table, codes, absmax)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def spread(values):
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="two source trees, each with its built library")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(kernel_ms(args.steps))
        return
    from fastoptim.engines.backends import cpu as cpu_backend  # loads the library and its ops
    from fastoptim.measure import cpu_features, machine
    from fastoptim.states import blockwise8

    assert cpu_backend.AVAILABLE, "the fused CPU kernel is not built"

    trees = [str(pathlib.Path(tree).resolve()) for tree in args.trees]
    samples = {tree: [] for tree in trees}
    for round_ in range(args.rounds):
        for tree in trees if round_ % 2 == 0 else trees[::-1]:
            result = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)], check=True,
                                    capture_output=True, text=True, env=os.environ | {"PYTHONPATH": tree})
            samples[tree].append(float(result.stdout.split()[-1]))
    torch.set_num_threads(1)
    values = torch.randn(sum(rows * cols for rows, cols in SHAPES), generator=torch.Generator().manual_seed(0))
    codecs = {name: [] for name in ("signed", "linear")}
    for _ in range(args.rounds):  # interleaved
        for name in codecs:
            codecs[name] += codec_ms(blockwise8.TABLES[name].table, values, 1)
    print(f"{machine()['cpu']}; CPU features: {cpu_features()}; torch {torch.__version__}, 1 thread; "
          f"params {SHAPES[0]} x {len(SHAPES)}; {args.rounds} rounds of {args.steps} profiled steps\n")
    print("| momentum kernel, ms | " + " | ".join(trees) + " | ratio (second / first) |\n|---|---|---|---|")
    ratios = [b / a for a, b in zip(*samples.values())]
    print("| median (min..max) | " + " | ".join(spread(samples[tree]) for tree in trees)
          + f" | {spread(ratios)} |\n")
    print("| codec alone (this library), ms | signed | linear | ratio (linear / signed) |\n|---|---|---|---|")
    codec_ratios = [b / a for a, b in zip(codecs["signed"], codecs["linear"])]
    print(f"| median (min..max) | {spread(codecs['signed'])} | {spread(codecs['linear'])} | {spread(codec_ratios)} |")


if __name__ == "__main__":
    main()
