"""The fused CPU engine against the other engines, torch, timm and a bandwidth probe.

Prints, for GPT-2 124M shapes and for 2000 tensors of 1,000-5,000 elements (fp32), the median step
time of every engine of Adan and AdamW, of torch's AdamW foreach and fused and of timm's Adan, all
measured in one run with interleaved repeats. The probe is a C loop with Adan's traffic (6 fp32
reads and 5 writes per element) and trivial math; each fused engine's bandwidth is reported as a
fraction of the probe's. Usage: python benchmarks/fused_cpu.py [--threads 2] [--repeats 5]
"""
import argparse

import torch

import fastoptim
from fastoptim.bench import run
from fastoptim.bench.peers import timm_adan_class
from fastoptim.bench.shapes import MODELS
from fastoptim.kernels import fused_cpu
from fastoptim.multi_tensor import PointerTable

ADAN_BYTES = 44  # per fp32 element: 6 reads + 5 writes
PEERS = ["torch-adamw-foreach", "torch-adamw-fused"]


def candidates(model):
    """Step functions of every engine and peer over one shared set of params (see bench.run.steppers)."""
    params, linear = run.model_params(model)
    names = [name for name in run.optimizers() if name not in PEERS] + PEERS
    table, _ = run.steppers(params, linear, names)
    timm = timm_adan_class()(params, lr=1e-4, weight_decay=0.02, foreach=True)
    timm.step()
    table["timm-adan"] = timm.step
    return table, params


def probe_stepper(params):
    """One call of the C probe over six fp32 buffers per param (the params, grads and four more),
    in the fused engine's chunk plan."""
    roles = fused_cpu.ROLES["adan"]
    tensors = {"param": params, "grad": [p.grad for p in params]}
    tensors |= {role: [torch.zeros_like(p) for p in params] for role in roles[2:]}
    table = PointerTable(tensors, roles)

    def step():  # its use of ``tensors`` keeps the buffers the table points into alive
        fused_cpu.probe(table.pointers, len(tensors["param"]), table.chunks, torch.get_num_threads())
    return step


def report(model, repeats, steps):
    shapes = MODELS[model]()
    numel = sum(torch.Size(s).numel() for s, _ in shapes)
    table, params = candidates(model)
    table["probe (Adan traffic)"] = probe_stepper(params)
    seconds = run.time_steps(table, steps, repeats)
    probe = seconds["probe (Adan traffic)"]
    print(f"\n{model}: {len(shapes)} tensors, {numel / 1e6:.1f}M elements, "
          f"probe {ADAN_BYTES * numel / probe / 1e9:.1f} GB/s")
    print("| step | ms | vs adan-foreach | vs torch-adamw-fused | of probe bandwidth |")
    print("|---|---|---|---|---|")
    for name, s in seconds.items():
        bandwidth = f"{probe / s:.2f}" if name.startswith(("adan-fused", "probe")) else ""
        print(f"| {name} | {s * 1e3:.1f} | {seconds['adan-foreach'] / s:.2f}x | "
              f"{seconds['torch-adamw-fused'] / s:.2f}x | {bandwidth} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "small-tensors"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"fastoptim {fastoptim.__version__}, torch {torch.__version__}, {args.threads} threads, fp32, "
          f"median of {args.repeats} interleaved repeats of {args.steps} steps")
    for model in args.models:
        report(model, args.repeats, args.steps)


if __name__ == "__main__":
    main()
