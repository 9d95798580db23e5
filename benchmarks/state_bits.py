"""The choices behind 8-bit states (fastoptim.states.blockwise8), measured.

1. Block size: the error that quantization adds to an AdamW update direction m/√v, on the states of a
   GPT-2 (gpt2-tiny's shapes scaled up: real gradients of one backward pass, then 20 AdamW steps),
   against the bytes of the block maxima.
2. Adan's previous gradient: the final loss of the character model of tests/test_state_bits.py
   when g_prev is 8-bit, bf16 (the default) or when all states are fp32.
3. Training parity: that model's loss curves with 32-bit and 8-bit states, for Adan and AdamW, in
   bench-out/state_bits_parity.png.
Usage, from the repository root: .venv/bin/python -m benchmarks.state_bits
"""
from dataclasses import replace
from pathlib import Path

import torch

import fastoptim
from fastoptim.bench.models import with_gradients
from fastoptim.states import blockwise8
from fastoptim.train.character import final_loss, train


def adamw_states(model="gpt2-124m", steps=5):
    params, _ = with_gradients(model)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(steps):
        optimizer.step()
        for p in params:
            p.grad.mul_(0.9).add_(torch.randn_like(p.grad), alpha=p.grad.std().item() * 0.5)
    large = [p for p in params if p.numel() >= blockwise8.MIN_NUMEL]
    return [(optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in large]


def direction_error(states, block):
    """Relative error of m/(√v + eps), over all elements, with both states quantized."""
    num = den = 0.0
    for m, v in states:
        m8 = blockwise8.dequantize(*blockwise8.quantize(m, blockwise8.SIGNED, block), blockwise8.SIGNED, block)
        v8 = blockwise8.dequantize(*blockwise8.quantize(v, blockwise8.UNSIGNED, block), blockwise8.UNSIGNED, block)
        exact, rounded = m / (v.sqrt() + 1e-8), m8 / (v8.sqrt() + 1e-8)
        num += (rounded - exact).square().sum().item()
        den += exact.square().sum().item()
    return (num / den) ** 0.5


class AdanAll8Bit(fastoptim.Adan):
    spec = replace(fastoptim.Adan.algorithm.spec, roles=tuple(replace(role, half=False) for role in fastoptim.Adan.algorithm.spec.roles))


def main():
    states = adamw_states()
    print("| block | rel. error of m/√v | absmax bytes per element |\n|---|---|---|")
    for block in (32, 64, 128, 256, 512, 1024, 4096):
        print(f"| {block} | {direction_error(states, block):.4f} | {4 / block:.4f} |", flush=True)
    curves = {}
    print("\n| states | final loss (mean of last 50 steps) |\n|---|---|")
    for name, cls, bits in (("Adan fp32", fastoptim.Adan, 32), ("Adan 8-bit, g_prev bf16", fastoptim.Adan, 8),
                            ("Adan 8-bit, g_prev 8-bit", AdanAll8Bit, 8), ("AdamW fp32", fastoptim.AdamW, 32),
                            ("AdamW 8-bit", fastoptim.AdamW, 8)):
        curves[name] = train(cls, bits, steps=300)[0]
        print(f"| {name} | {final_loss(curves[name]):.4f} |", flush=True)
    plot(curves, Path("bench-out") / "state_bits_parity.png")


def plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axis = pyplot.subplots(figsize=(8, 5))
    for name, losses in curves.items():
        smooth = torch.tensor(losses).unfold(0, 20, 1).mean(dim=1)  # a running mean over 20 steps
        axis.plot(range(20, len(losses) + 1), smooth, label=name, linestyle="--" if "8-bit" in name else "-")
    axis.set_xlabel("step")
    axis.set_ylabel("training loss (running mean of 20 steps)")
    axis.set_title("Character model on the standard library's sources: 32-bit and 8-bit states")
    axis.legend()
    path.parent.mkdir(exist_ok=True)
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
