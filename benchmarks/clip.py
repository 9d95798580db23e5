"""fastoptim.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ (foreach), on GPT-2 124M's grads,
on 2000 small tensors and on 148 of 16 elements (where a call costs its host time): the median of
interleaved repeats, and their ratio.

    .venv/bin/python -m benchmarks.clip
"""
import statistics
import time

import torch

import fastoptim
from fastoptim.bench import models

REPEATS = 15


def grads_of(shapes):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in shapes]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    return params


def median_seconds(functions):
    samples = {name: [] for name in functions}
    for _ in range(REPEATS):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def main():
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {REPEATS} interleaved calls")
    print("| grads | norm | torch (ms) | fastoptim (ms) | speed-up |\n|---|---|---|---|---|")
    cases = {"gpt2-124m": [shape for shape, _ in models.shapes("gpt2-124m")],
             "2000 small tensors": [(i % 97 + 1, 64) for i in range(2000)],
             "148 tiny tensors (host time)": [(16,)] * 148}
    for name, shapes in cases.items():
        params = grads_of(shapes)
        for norm_type in (2.0, float("inf")):
            times = median_seconds({
                "torch": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=True),
                "fastoptim": lambda: fastoptim.clip_grad_norm_(params, 1.0, norm_type)})
            print(f"| {name} | {norm_type:g} | {times['torch'] * 1e3:.2f} | {times['fastoptim'] * 1e3:.2f} | "
                  f"{times['torch'] / times['fastoptim']:.2f}x |")


if __name__ == "__main__":
    main()
