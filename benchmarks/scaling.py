"""Fused multi-tensor Adan and AdamW in each state format (fp32, sn on the Linear weights, 8-bit) as
the model grows and as its params are cut into more tensors: ns per param per step, which should
stay flat (a cliff is a cache, page-fault or chunking defect), and the share of the bandwidth probe
(fastoptim.bench.run.probe) that the step's traffic reaches.

Also each format's two limits, in ns per param per step on this machine's threads:
- bytes: the step's traffic (params and grads, its states read and written) at the probe's bandwidth;
- instructions: the kernel on tensors that stay in cache, one thread, from the slope of its CPU time
  between two in-cache sizes (so the per-step overhead drops out), over the thread count.
A step can be no faster than the higher of the two.

The formats of one algorithm are timed interleaved with the probe in one process, in repeated
samples (medians, and the spread of the ratio to fp32 as min..max of the per-sample ratios).
Usage, from the repository root: .venv/bin/python -m benchmarks.scaling [--quick]
"""
import argparse
import statistics
import time

import torch

from fastoptim.bench import models, run

FORMATS = {"adan": ("adan", "adan-sn", "adan-8bit"), "adamw": ("adamw", "adamwsn", "adamw-8bit")}
# GPT-2 shaped (GPT-2's vocabulary and positions), (layers, width): about 11M, 30M, 124M and 354M params
SIZES = [(4, 192), (6, 384), (12, 768), (24, 1024)]
TENSOR_COUNTS = [100, 1000, 10000]
TENSORS_NUMEL = 24_000_000  # the params of the tensor-count rows, as (r, 3r) and (3r, r) matrices: sn's two walks
# Two in-cache sizes, two tensors each (the step's Python time is per tensor: the same in both): the
# larger's fp32 Adan step moves 11.5 MB, within L3.
IN_CACHE = ((128, 128), (256, 512))


def gpt2_shapes(layers, width):
    """GPT-2's param shapes at this size (built on the meta device), and which get sn (its Linear weights)."""
    models.quiet_transformers()
    with torch.device("meta"):
        module = models.gpt2(max(1, width // 64), layers, width, vocab=50257, positions=1024).build()
    params, sn = models.params_and_sn(module)
    return [p.shape for p in params], sn


def gpt2_params(layers, width):
    """Random params and grads in GPT-2's shapes, and which get sn."""
    shapes, sn = gpt2_shapes(layers, width)
    return materialize(shapes), sn


def matrices(count, numel=TENSORS_NUMEL):
    """``count`` matrices of about numel / count params, half wider than tall, all with sn."""
    r = max(1, round((numel / count / 3) ** 0.5))
    return materialize([(r, 3 * r) if i % 2 else (3 * r, r) for i in range(count)]), [True] * count


def materialize(shapes):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    return params


def formats_steps(params, sn, names):
    """A fused multi-tensor step function per format name, after its first step, and its traffic in bytes."""
    steps, traffic = {}, {}
    param_bytes = sum(p.nbytes for p in params)
    for name in names:
        spec = run.Optimizer(name, run.fastoptim_family(*run.FASTOPTIM[name]), run.ENGINES["fused-multi"])
        optimizer = spec.make(params, sn)
        steps[name] = run.stepper(optimizer, spec)
        steps[name]()
        traffic[name] = 3 * param_bytes + 2 * run.state_bytes(optimizer)  # p read and written, g read, states
    return steps, traffic


def fits(numel, names):
    """Whether params, grads, the probe and the states of ``names`` (Adan's four fp32 at most) fit."""
    state_bytes = 4 * numel * sum(4 if name == "adan" else 2 if name == "adamw" else 1 for name in names)
    return run.free_bytes("cpu") > 1.3 * (8 * numel + 6 * 4 * min(numel, run.PROBE_NUMEL) + state_bytes)


def time_formats(params, sn, names, steps, repeats):
    """ms per step (median) of the probe and each format, interleaved; the probe's GB/s; traffic."""
    probe_step, probe_bytes = run.probe(params, "cpu")
    format_steps, traffic = formats_steps(params, sn, names)
    samples, errors, _ = run.time_steps({"probe": probe_step, **format_steps}, steps, repeats)
    if errors:
        raise RuntimeError(errors)
    return samples, probe_bytes / statistics.median(samples["probe"]) / 1e9, traffic


def rows(label, params, sn, names, steps, repeats):
    numel = sum(p.numel() for p in params)
    samples, probe_gbps, traffic = time_formats(params, sn, names, steps, repeats)
    out = []
    for name in names:
        seconds = statistics.median(samples[name])
        ratios = [a / b for a, b in zip(samples[name], samples[names[0]])]
        out.append(f"| {label} | {len(params)} | {numel / 1e6:.1f}M | {name} | {seconds * 1e9 / numel:.3f} | "
                   f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) | "
                   f"{traffic[name] / seconds / 1e9 / probe_gbps:.2f} |")
    return out


def cpu_seconds(step, steps):
    """The calling thread's CPU seconds per step: unlike the wall clock, it leaves out the time other
    processes held the core."""
    step()
    start = time.thread_time()
    for _ in range(steps):
        step()
    return (time.thread_time() - start) / steps


def limits(names, steps, repeats):
    """Per format: ns per param of the bytes limit (traffic at the probe's bandwidth, on 124M GPT-2
    shapes) and of the instructions limit (the in-cache slope, one thread, over the thread count)."""
    threads = torch.get_num_threads()
    params, sn = gpt2_params(12, 768)
    numel = sum(p.numel() for p in params)
    samples, probe_gbps, traffic = time_formats(params, sn, names, steps, repeats)
    del params
    run.release_memory()
    torch.set_num_threads(1)  # the kernel runs on the calling thread, so its CPU time is the step's
    try:
        small, large = (materialize([shape] * 2) for shape in IN_CACHE)
        small_steps, _ = formats_steps(small, [True] * 2, names)
        large_steps, _ = formats_steps(large, [True] * 2, names)
        cached = {(size, name): [] for size in ("small", "large") for name in names}
        for _ in range(repeats):
            for name in names:
                for size, step in (("small", small_steps[name]), ("large", large_steps[name])):
                    cached[(size, name)].append(cpu_seconds(step, 20 * steps))
    finally:
        torch.set_num_threads(threads)
    slope_numel = 2 * (IN_CACHE[1][0] * IN_CACHE[1][1] - IN_CACHE[0][0] * IN_CACHE[0][1])
    out = []
    for name in names:
        measured = statistics.median(samples[name]) * 1e9 / numel
        by_bytes = traffic[name] / probe_gbps / numel
        # the least CPU time of each size: other work on the core (cache, frequency) disturbed it least
        by_instructions = (min(cached[("large", name)]) - min(cached[("small", name)])) * 1e9 / slope_numel / threads
        higher = max(by_bytes, by_instructions)
        out.append(f"| {name} | {measured:.3f} | {by_bytes:.3f} | {by_instructions:.3f} | {higher / measured:.2f} |")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the two smallest models, 100 and 1000 tensors")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-limits", action="store_true")
    args = parser.parse_args()
    sizes, counts = (SIZES[:2], TENSOR_COUNTS[:2]) if args.quick else (SIZES, TENSOR_COUNTS)
    print(f"threads {torch.get_num_threads()}; ratio: time against the fp32 format's, median (min..max) of "
          f"{args.repeats} interleaved samples")
    print("\n| model | tensors | params | format | ns/param/step | time vs fp32 | of probe |")
    print("|---|---|---|---|---|---|---|")
    for names in FORMATS.values():
        for layers, width in sizes:
            numel = sum(shape.numel() for shape in gpt2_shapes(layers, width)[0])
            if not fits(numel, names):
                print(f"| gpt2 {layers}x{width} | | {numel / 1e6:.0f}M | skipped: does not fit in free memory | | | |")
                continue
            params, sn = gpt2_params(layers, width)
            print("\n".join(rows(f"gpt2 {layers}x{width}", params, sn, names, args.steps, args.repeats)), flush=True)
            del params
            run.release_memory()
        for count in counts:
            params, sn = matrices(count)
            print("\n".join(rows("matrices", params, sn, names, args.steps, args.repeats)), flush=True)
            del params
            run.release_memory()
    if not args.no_limits:
        print("\nLimits, ns/param/step (GPT-2 124M shapes; instructions: in cache, one thread, over the thread count)")
        print("\n| format | measured | bytes limit | instructions limit | higher limit / measured |")
        print("|---|---|---|---|---|")
        for names in FORMATS.values():
            print("\n".join(limits(names, args.steps, args.repeats)), flush=True)
            run.release_memory()


if __name__ == "__main__":
    main()
