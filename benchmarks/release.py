"""What a training run holds per parameter, with and without gradient release: a bf16 GPT-2 (6
layers, width 512, byte tokens) and each lean configuration, one training step (forward, backward,
step) measured in a fresh process: the bytes kept between steps (params, states, and the grads that
are alive when ``step()`` runs), and the peak a step adds over them (activations, grads, temporaries),
read from /proc (see fastoptim.bench.memory). Against torch's fp32 AdamW.
Usage, from the repository root: .venv/bin/python -m benchmarks.release
"""
import argparse

import torch

import fastoptim
from fastoptim.bench.memory import in_subprocess, measure_step
from fastoptim.measure import cpu_features, machine, params_and_sn, sn_groups, state_bytes, tensor_bytes

LEAN = dict(master_bits=24, state_bits=8, fused=True)
CONFIGS = {  # name: (optimizer, options, bf16 params, release)
    "torch AdamW, fp32": ("torch.AdamW", {}, False, False),
    "AdamW bf16, master 24, 8-bit, sn": ("AdamW", LEAN | dict(sn=True), True, False),
    "AdamW bf16, master 24, 8-bit, sn, release": ("AdamW", LEAN | dict(sn=True), True, True),
    "AdamW bf16, stochastic rounding, 8-bit, sn, release": (
        "AdamW", dict(state_bits=8, sn=True, stochastic_rounding=True, fused=True), True, True),
    "Lion bf16, master 24, 8-bit": ("Lion", LEAN, True, False),
    "Lion bf16, master 24, 8-bit, release": ("Lion", LEAN, True, True),
    "Adan bf16, master 24, 8-bit, sn, release": ("Adan", LEAN | dict(sn=True), True, True),
}


def build():
    import transformers
    from fastoptim.measure import quiet_transformers
    quiet_transformers()
    config = transformers.GPT2Config(vocab_size=256, n_positions=128, n_layer=6, n_head=8, n_embd=512,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def measure(spec):
    """One configuration, in this (fresh) process: bytes per parameter kept and added at the peak."""
    name, options, bf16, release = CONFIGS[spec["config"]]
    torch.set_num_threads(spec["threads"])
    model = build().to(torch.bfloat16 if bf16 else torch.float32)
    params, linear = params_and_sn(model)
    if name == "torch.AdamW":
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        groups = sn_groups(params, linear) if options.get("sn") else params
        options = {key: value for key, value in options.items() if key != "sn"}
        optimizer = getattr(fastoptim, name)(groups, lr=1e-4, **options)
    if release:
        optimizer.enable_gradient_release()
    tokens = torch.randint(256, (2, 128), generator=torch.Generator().manual_seed(0))
    held = {}

    def train_step():
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        held["grads"] = tensor_bytes(p.grad for p in params if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # the states exist, and the allocator has seen a step
        train_step()
    peak = measure_step(train_step)
    n = sum(p.numel() for p in params)
    kept = tensor_bytes(params) + state_bytes(optimizer) + held["grads"]
    return dict(config=spec["config"], params=n, kept_per_param=kept / n, grads_per_param=held["grads"] / n,
                peak_per_param=peak / n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    print(f"{machine()}; CPU features {' '.join(cpu_features())}; torch {torch.__version__}, {args.threads} threads")
    print("| configuration | bytes/param kept (params + states + grads at step()) | of them grads | "
          "peak a training step adds, bytes/param |")
    print("|---|---|---|---|")
    for config in CONFIGS:
        result = in_subprocess("benchmarks.release:measure", dict(config=config, threads=args.threads))
        print(f"| {config} | {result['kept_per_param']:.2f} | {result['grads_per_param']:.2f} | "
              f"{result['peak_per_param']:.2f} |", flush=True)
    print(f"({result['params'] / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
