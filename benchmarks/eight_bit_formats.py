"""Two 8-bit formats for AdamW's states, on error (issue 33): fastoptim's blockwise format
(fastoptim.states.blockwise8: blocks of 256 with an fp32 absmax, codes from a table of fp16-derived
values) against a companded one without a table, restated here as a readable reference of the format
FlashOptim describes: groups of 32 (and, to separate the codes from the group size, 256) with an
fp16 scale, the first moment stored as the softsign of
m / its group's absmax, the second as √v / its group's max, each rounded to 8 bits.

Each format runs as fp32 AdamW (fastoptim's loop engine) whose states are stored in the format after
every step, so that storing compounds over the run as in an 8-bit kernel, on the character model of
fastoptim.train.character, with the same batches as fp32 AdamW. States of tensors below blockwise8's
MIN_NUMEL stay fp32 in both. Reported: the relative error of each state against fp32 AdamW's at the
same step (mean over the run, and at the end), of the update direction m / (√v + eps), and the final
loss (mean of the last 50 steps). Errors are deterministic; no timing here.
Usage, from the repository root: .venv/bin/python -m benchmarks.eight_bit_formats [--steps N]
"""
import argparse
import statistics

import torch

import fastoptim
from fastoptim.states import blockwise8, formats
from fastoptim.train import character

EPS = 1e-8


def _grouped(x, group):
    """``x`` flattened into rows of ``group`` (zero-padded), and a function back to ``x``'s shape."""
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % group)).reshape(-1, group)
    return padded, lambda rows: rows.reshape(-1)[:flat.numel()].reshape(x.shape)


def _fp16_scale(rows):
    """Each group's scale, rounded to fp16 as the format stores it (0 where it underflows)."""
    return rows.amax(dim=1, keepdim=True).to(torch.float16).float()


def companded_first_moment(m, group):
    """m stored and read back: 8-bit codes of softsign(m / absmax), which spend their steps near 0."""
    rows, back = _grouped(m, group)
    scale = _fp16_scale(rows.abs())
    x = torch.where(scale > 0, rows / scale, 0.0).clamp(-1, 1)
    codes = torch.round(x / (1 + x.abs()) * 254)  # softsign(x) in [-1/2, 1/2]: -127..127
    y = codes / 254
    return back(y / (1 - y.abs()) * scale)


def companded_second_moment(v, group):
    """v stored and read back: 8-bit codes of √v / its group's max."""
    rows, back = _grouped(v.sqrt(), group)
    scale = _fp16_scale(rows)
    codes = torch.round(torch.where(scale > 0, rows / scale, 0.0).clamp(0, 1) * 255)
    return back((codes / 255 * scale).square())


def blockwise(role):
    """fastoptim's 8-bit blockwise format for AdamW's state ``role``: stored and read back."""
    codes = formats.Q8.codes(fastoptim.AdamW.algorithm.spec.role(role))
    return lambda x: blockwise8.dequantize(*blockwise8.quantize(x.reshape(-1), codes), codes).reshape(x.shape)


def companded(group):
    """The companded format with ``group`` elements per fp16 scale, per AdamW state."""
    return {"exp_avg": lambda m: companded_first_moment(m, group),
            "exp_avg_sq": lambda v: companded_second_moment(v, group)}


# name: (store-and-read per state, bytes per element). Companded with groups of 256 tells its codes'
# share of the difference from its groups' (blockwise's blocks are 256).
FORMATS = {
    "blockwise 256, fp32 absmax, table": ({"exp_avg": blockwise("exp_avg"), "exp_avg_sq": blockwise("exp_avg_sq")},
                                          1 + 4 / blockwise8.BLOCK),
    "companded 256, fp16 scale": (companded(256), 1 + 2 / 256),
    "companded 32, fp16 scale": (companded(32), 1 + 2 / 32),
}


def run(steps, stored=None):
    """Losses and each step's states (param index: (exp_avg, exp_avg_sq)) of fp32 AdamW whose
    large states are ``stored`` (role: store-and-read function) after every step, or not (None)."""
    snapshots = []

    def after_step(optimizer):
        states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
        if stored:
            for state in states:
                for role, store in stored.items():
                    if state[role].numel() >= blockwise8.MIN_NUMEL:
                        state[role].copy_(store(state[role]))
        snapshots.append([(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in states])

    make = lambda params, **options: fastoptim.AdamW(params, foreach=False, fused=False, **options)
    losses, _ = character.train(make, 32, steps, after_step)
    return losses, snapshots


def relative(a, b):
    return float((a - b).norm() / b.norm())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    reference_losses, reference = run(args.steps)
    print(f"fp32 AdamW on fastoptim.train.character, {args.steps} steps: final loss "
          f"{character.final_loss(reference_losses):.4f}")
    print("| format | bytes per element | m error, mean (end) | v error, mean (end) | update error, mean (end) "
          "| final loss |")
    print("|---|---|---|---|---|---|")
    for name, (stored, nbytes) in FORMATS.items():
        losses, snapshots = run(args.steps, stored)
        errors = {"m": [], "v": [], "update": []}
        for step, ref in zip(snapshots, reference):
            large = [(s, r) for s, r in zip(step, ref) if r[0].numel() >= blockwise8.MIN_NUMEL]
            m, v = (torch.cat([s[k].reshape(-1) for s, _ in large]) for k in (0, 1))
            m_ref, v_ref = (torch.cat([r[k].reshape(-1) for _, r in large]) for k in (0, 1))
            errors["m"].append(relative(m, m_ref))
            errors["v"].append(relative(v, v_ref))
            errors["update"].append(relative(m / (v.sqrt() + EPS), m_ref / (v_ref.sqrt() + EPS)))
        cells = [f"{statistics.mean(e):.4f} ({e[-1]:.4f})" for e in errors.values()]
        print(f"| {name} | {nbytes:.4f} | {' | '.join(cells)} | {character.final_loss(losses):.4f} |")


if __name__ == "__main__":
    main()
