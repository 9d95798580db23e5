"""Where a Muon step's time goes: the Newton–Schulz iterations against the elementwise rest, on a
model's hidden matrices, for torch.optim.Muon (one matrix at a time) and fastoptim.Muon's loop,
batched (foreach) and fused engines, with fp32 params and with bf16 ones (stochastic rounding, or
8-bit master remainders). With ``--elementwise`` the iterations are left out (each direction only
rounded to bf16, as their output is): what remains is the momentum and the update each engine runs.
Interleaved repeats in one process; medians with their spread.
Usage, from the repository root:
.venv/bin/python -m benchmarks.muon [--model gpt2-h12-l6-d768] [--device cuda] [--elementwise]
"""
import argparse
import statistics
import time
import warnings

import torch

import fastoptim
from fastoptim.bench.models import with_gradients
from fastoptim.measure import cpu_features, machine
from fastoptim.optimizers import muon, muon_parts
from fastoptim.engines.ops import FOREACH_OPS, TENSOR_OPS


def timed(function, device):
    start = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-h12-l6-d768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--elementwise", action="store_true", help="leave the Newton–Schulz iterations out")
    args = parser.parse_args()
    device = torch.device(args.device)
    params, matrices = with_gradients(args.model, device=device)
    params = [p for p, m in zip(params, matrices) if m]
    bf16 = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    for param, twin in zip(params, bf16):
        twin.grad = param.grad.bfloat16()
    if args.elementwise:  # the whole update's and the fused run's iterations: the direction in bf16
        muon.iterations = muon_parts.iterations = lambda step_args: (lambda batch: batch.bfloat16())
    updates = [p.grad.clone() for p in params]
    coefficients = [muon.DEFAULT_COEFFICIENTS] * 5
    shape = muon_parts.matrix_shape

    def iterations(ops):
        return lambda: ops.per_matrix(lambda x: muon_parts.orthogonalize(x, coefficients, 1e-7), updates,
                                      lambda s: shape(s, False)) if ops is FOREACH_OPS else [
            TENSOR_OPS.per_matrix(lambda x: muon_parts.orthogonalize(x, coefficients, 1e-7), u, lambda s: shape(s, False))
            for u in updates]

    steps = {"torch.optim.Muon": torch.optim.Muon(params, lr=1e-4).step,
             "fastoptim.Muon loop": fastoptim.Muon(params, lr=1e-4, foreach=False, fused=False).step,
             "fastoptim.Muon foreach (batched)": fastoptim.Muon(params, lr=1e-4, foreach=True, fused=False).step,
             "fastoptim.Muon fused": fastoptim.Muon(params, lr=1e-4, fused=True).step,
             "fastoptim.Muon fused, 8-bit momentum": fastoptim.Muon(params, lr=1e-4, fused=True, state_bits=8).step}
    for name, options in (("stochastic rounding", dict(stochastic_rounding=True)), ("master_bits=24",
                                                                                    dict(master_bits=24))):
        for engine, flags in (("foreach", dict(foreach=True, fused=False)), ("fused", dict(fused=True))):
            steps[f"fastoptim.Muon {engine}, bf16 params, {name}"] = fastoptim.Muon(bf16, lr=1e-4, **flags,
                                                                                    **options).step
    if args.elementwise:
        del steps["torch.optim.Muon"]  # whose iterations stay
    else:
        steps |= {"Newton–Schulz alone, one matrix at a time": iterations(TENSOR_OPS),
                  "Newton–Schulz alone, batched by shape": iterations(FOREACH_OPS)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps.values():
            step()  # states, and the first call's allocations
        samples = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                samples[name].append(timed(step, device))
    numel = sum(p.numel() for p in params)
    print(f"{args.model}: {len(params)} hidden matrices, {numel / 1e6:.1f}M elements; {machine()['cpu']}; "
          f"CPU features: {cpu_features()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.repeats} interleaved repeats{'; without the iterations' if args.elementwise else ''}"
          f"{'; ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''}\n")
    print("| step | ms (median) | spread |\n|---|---|---|")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} | {(max(values) - min(values)) / median:.0%} |")


if __name__ == "__main__":
    main()
