"""The runs of `fastoptim train`: each optimizer trains the same GPT-2 from the same initial weights on
the same batches in the same order, with warmup, cosine decay and gradient clipping (but for the recipes that
release their grads in backward, and their baselines); validation loss
every few steps, and checkpoints from which a run resumes bit-identically."""
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fastoptim
from fastoptim.measure import load_between, load_snapshot, muon_groups, params_and_sn, sn_groups, state_bytes

from . import data, model, report


@dataclass(frozen=True)
class Recipe:
    cls: type
    lr: float  # the recommended peak learning rate
    weight_decay: float
    sn: bool = False  # subset-norm second moments on the Linear (GPT-2's Conv1D) weights
    options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32  # of the model's params (and so its grads and forward pass)
    companions: dict | None = None  # Muon: the options of the AdamW group of the params that are not hidden matrices
    clip: bool = True  # clip the grads' norm to MAX_GRAD_NORM before each step
    release: bool = False  # step each bucket in backward and free its grads (enable_gradient_release), unclipped

    def __post_init__(self):
        if self.release and self.clip:
            raise ValueError("a recipe with gradient release cannot clip: release refuses the norm of all grads")

    def make(self, module, lr):
        params, linear = params_and_sn(module)
        if self.companions is not None:
            groups = [group | self.companions if group.get("use_muon") is False else group
                      for group in muon_groups(params, linear)]
        else:
            groups = sn_groups(params, linear) if self.sn else params
        optimizer = self.cls(groups, lr=lr, weight_decay=self.weight_decay, fused=True, **self.options)
        if self.release:
            optimizer.enable_gradient_release()
        return optimizer


MUON_COMPANIONS = {"use_muon": False, "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.99)}
RECIPES = {
    # nanoGPT's baby character-level GPT (config/train_shakespeare_char.py): lr 1e-3, weight decay 0.1
    "adamw": Recipe(torch.optim.AdamW, 1e-3, 0.1),
    # Adan's README: a peak lr 5-10x Adam's (the low end here), and weight decay 0.02 in all its experiments
    "adan": Recipe(fastoptim.Adan, 5e-3, 0.02),
    # the subset-norm seed: an lr about 10x Adam's; its LLaMA runs use no weight decay
    "adamwsn": Recipe(fastoptim.AdamWSN, 1e-2, 0.0, sn=True),
    # no published recipe: Adan's, with the subset-norm seed's 10x for a subset-norm second moment
    "adan-sn": Recipe(fastoptim.Adan, 5e-2, 0.02, sn=True),
    # Adan's recipe: 8-bit states are meant to change nothing else
    "adan-8bit": Recipe(fastoptim.Adan, 5e-3, 0.02, options={"state_bits": 8}),
    # nanoGPT's recipe on a bf16 model: the params alone, and with a 16-bit remainder (the exact fp32 master)
    "adamw-bf16": Recipe(fastoptim.AdamW, 1e-3, 0.1, dtype=torch.bfloat16),
    "adamw-bf16-master32": Recipe(fastoptim.AdamW, 1e-3, 0.1, options={"master_bits": 32}, dtype=torch.bfloat16),
    # the lean states on that bf16 model: an 8-bit remainder (master_bits=24) or stochastic rounding, with 8-bit
    # moments (clipped; gradient release, which refuses clipping, below)
    "adamw-bf16-m24-8bit": Recipe(fastoptim.AdamW, 1e-3, 0.1, options={"master_bits": 24, "state_bits": 8},
                                  dtype=torch.bfloat16),
    "adamw-bf16-sr-8bit": Recipe(fastoptim.AdamW, 1e-3, 0.1, options={"stochastic_rounding": True, "state_bits": 8},
                                 dtype=torch.bfloat16),
    # Lion's paper: an lr 3-10x below AdamW's and a weight decay as much above (the low end: 3x); and its lean states
    "lion": Recipe(fastoptim.Lion, 3e-4, 0.3),
    "lion-bf16-m24-8bit": Recipe(fastoptim.Lion, 3e-4, 0.3, options={"master_bits": 24, "state_bits": 8},
                                 dtype=torch.bfloat16),
    # Adan's lean states: its previous gradient stays bf16 beside the 8-bit moments
    "adan-bf16-m24-8bit": Recipe(fastoptim.Adan, 5e-3, 0.02, options={"master_bits": 24, "state_bits": 8},
                                 dtype=torch.bfloat16),
    # The lean states with gradient release (which refuses clipping), AdamW's with sn on the seed's recipe, and
    # the fp32 runs they are held against, unclipped too: params, states and remainders in about 4 bytes per param
    "adamw-noclip": Recipe(torch.optim.AdamW, 1e-3, 0.1, clip=False),
    "adamwsn-noclip": Recipe(fastoptim.AdamWSN, 1e-2, 0.0, sn=True, clip=False),
    "lion-noclip": Recipe(fastoptim.Lion, 3e-4, 0.3, clip=False),
    "adamwsn-bf16-m24-8bit-release": Recipe(fastoptim.AdamWSN, 1e-2, 0.0, sn=True, dtype=torch.bfloat16, clip=False,
                                            release=True, options={"master_bits": 24, "state_bits": 8}),
    "lion-bf16-m24-8bit-release": Recipe(fastoptim.Lion, 3e-4, 0.3, dtype=torch.bfloat16, clip=False, release=True,
                                         options={"master_bits": 24, "state_bits": 8}),
    "adan-noclip": Recipe(fastoptim.Adan, 5e-3, 0.02, clip=False),
    "adan-bf16-m24-8bit-release": Recipe(fastoptim.Adan, 5e-3, 0.02, dtype=torch.bfloat16, clip=False, release=True,
                                         options={"master_bits": 24, "state_bits": 8}),
    # Keller Jordan's Muon (lr 0.02, momentum 0.95, Nesterov) on the hidden matrices; the embeddings, head,
    # biases and norms on nanoGPT's AdamW recipe (its char model's betas), as his MuonWithAuxAdam pairs them
    "muon": Recipe(fastoptim.Muon, 0.02, 0.0, companions=MUON_COMPANIONS),
    # the momentum in 8 bits; the companions' AdamW states stay fp32
    "muon-8bit": Recipe(fastoptim.Muon, 0.02, 0.0, options={"state_bits": 8},
                        companions=MUON_COMPANIONS | {"state_bits": 32}),
}
DEFAULT_RECIPES = ["adamw", "adan", "adamwsn", "adan-sn", "adan-8bit"]  # the bf16 ones when named
# The default sweep: each optimizer at these multiples of its recommended lr, reported at its best, so the
# comparison ranks optimizers, not the recipes' learning rates (which span 30x across the published ones)
LR_SWEEP = (0.5, 1.0, 2.0)
WARMUP = 0.1  # linear warmup over this share of the steps, as the subset-norm seed's runs
MIN_LR = 0.1  # the cosine decays to this share of the peak lr, as nanoGPT's
MAX_GRAD_NORM = 1.0  # the subset-norm seed's --grad_clipping and nanoGPT's grad_clip
VALIDATION_BATCH = 64  # windows per forward pass of validation: few calls, small activations
# The settings of a run; they are saved in its folder, and --resume takes them from there.
DEFAULTS = {"optimizers": DEFAULT_RECIPES, "steps": 400, "lr_sweep": True, "model_size": "small", "batch_size": 16,
            "eval_every": 25, "checkpoint_every": 100, "seed": 0, "threads": torch.get_num_threads()}


def lr_factor(step, warmup, steps):
    """The share of the peak lr at ``step``: linear warmup, then cosine decay to MIN_LR at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def learning_rates(name, sweep):
    return [RECIPES[name].lr * factor for factor in LR_SWEEP] if sweep else [RECIPES[name].lr]


@torch.no_grad()
def validation_loss(module, windows):
    module.eval()
    losses = [module(input_ids=batch, labels=batch).loss for batch in windows.split(VALIDATION_BATCH)]
    module.train()
    return torch.stack(losses).mean().item()


def save(path, module, optimizer, scheduler, generator, run):
    checkpoint = {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "generator": generator.get_state(),
                  "rng": torch.get_rng_state(), "run": run}
    partial = path.with_suffix(".partial")
    torch.save(checkpoint, partial)
    partial.replace(path)  # an interrupted save leaves the previous checkpoint whole


def train_run(name, lr, settings, corpus, path, resume, stop_after, bar):
    """One optimizer at one lr, from its checkpoint at ``path`` if ``resume``, up to ``settings['steps']``
    or to step ``stop_after``: its losses, timings and state bytes."""
    steps, batch_size = settings["steps"], settings["batch_size"]
    context = model.SIZES[settings["model_size"]]["context"]
    module = model.build(settings["model_size"], settings["seed"]).to(RECIPES[name].dtype)
    optimizer = RECIPES[name].make(module, lr)
    warmup = max(1, round(WARMUP * steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, steps))
    generator = torch.Generator().manual_seed(settings["seed"])  # every run sees the same batches
    if resume and path.exists():
        checkpoint = torch.load(path)
        module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        generator.set_state(checkpoint["generator"])
        torch.set_rng_state(checkpoint["rng"])
        run = checkpoint["run"]
    else:
        run = {"optimizer": name, "lr": lr, "step": 0, "train_loss": [], "eval_steps": [0],
               "val_loss": [validation_loss(module, corpus.validation)], "step_seconds": 0.0,
               "optimizer_seconds": None if RECIPES[name].release else 0.0}  # released steps run in backward
    bar.set_description(f"{name} lr {lr:g}", refresh=False)
    bar.update(run["step"])
    last = steps if stop_after is None else min(stop_after, steps)
    while run["step"] < last:
        batch = data.train_batch(corpus.train, batch_size, context, generator)
        start = time.perf_counter()
        loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        if RECIPES[name].clip:
            fastoptim.clip_grad_norm_(module.parameters(), MAX_GRAD_NORM)
        optimizer_start = time.perf_counter()
        optimizer.step()
        if run["optimizer_seconds"] is not None:
            run["optimizer_seconds"] += time.perf_counter() - optimizer_start
        optimizer.zero_grad()
        scheduler.step()
        run["step_seconds"] += time.perf_counter() - start
        run["step"] += 1
        run["train_loss"].append(loss.item())
        if run["step"] % settings["eval_every"] == 0 or run["step"] == steps:
            run["eval_steps"].append(run["step"])
            run["val_loss"].append(validation_loss(module, corpus.validation))
        if run["step"] % settings["checkpoint_every"] == 0 or run["step"] == last:
            save(path, module, optimizer, scheduler, generator, run)
        bar.set_postfix(loss=f"{run['train_loss'][-1]:.3f}", refresh=False)
        bar.update()
    run["state_bytes"] = state_bytes(optimizer)
    return run


def main(settings, out, stop_after=None, resume=False):
    """Every run of ``settings`` into folder ``out`` (continuing its checkpoints if ``resume``), then the
    reports; returns the markdown, or None when ``stop_after`` stopped the runs first."""
    from tqdm import tqdm

    out = Path(out)
    checkpoints = out / "checkpoints"
    if not resume:  # a new run: no checkpoint of an earlier one may be taken for its own
        shutil.rmtree(checkpoints, ignore_errors=True)
        checkpoints.mkdir(parents=True)
        (out / "settings.json").write_text(json.dumps(settings, indent=1))
    torch.set_num_threads(settings["threads"])
    corpus = data.load(model.SIZES[settings["model_size"]]["context"])
    plan = [(name, lr) for name in settings["optimizers"] for lr in learning_rates(name, settings["lr_sweep"])]
    start = load_snapshot()
    try:
        with tqdm(total=len(plan) * settings["steps"], unit="step", dynamic_ncols=True) as bar:
            runs = [train_run(name, lr, settings, corpus, checkpoints / f"{name}-lr{lr:g}.pt", resume, stop_after,
                              bar) for name, lr in plan]
    except KeyboardInterrupt:  # each run's last checkpoint is whole (see save): the runs go on from there
        raise SystemExit(f"interrupted; continue from the last checkpoints with: fastoptim train --resume {out}"
                         ) from None
    load = load_between(start, load_snapshot())
    if any(run["step"] < settings["steps"] for run in runs):
        print(f"stopped after step {stop_after}; continue with: fastoptim train --resume {out}")
        return None
    params = sum(p.numel() for p in model.build(settings["model_size"], settings["seed"]).parameters())
    classes = {name: f"{RECIPES[name].cls.__module__.split('.')[0]}.{RECIPES[name].cls.__name__}"
               for name in settings["optimizers"]}
    text = report.write(report.results(settings, params, corpus.summary, runs, classes, load), out)
    print(text)
    print(f"wrote {out}/results.json, results.md and curves.png")
    return text


def resume(out, stop_after=None):
    """Continue the runs in folder ``out`` with the settings they were started with."""
    path = Path(out) / "settings.json"
    if not path.exists() or not (Path(out) / "checkpoints").is_dir():
        raise SystemExit(f"--resume {out}: no settings.json and checkpoints/ there, so no `fastoptim train` run to "
                         "continue")
    try:
        settings = json.loads(path.read_text())
    except (ValueError, OSError) as error:  # no JSON, or not a readable file (a folder)
        raise SystemExit(f"--resume {out}: settings.json cannot be read as JSON ({error})") from None
    if not isinstance(settings, dict) or settings.keys() != DEFAULTS.keys():
        found = sorted(settings) if isinstance(settings, dict) else type(settings).__name__
        raise SystemExit(f"--resume {out}: settings.json holds {found}, not a run's settings {sorted(DEFAULTS)} "
                         "(of another version of fastoptim?)")
    wrong = [key for key, fits in SETTINGS.items() if not fits(settings[key])]
    if wrong:
        raise SystemExit(f"--resume {out}: settings.json holds values `fastoptim train` does not take: "
                         + ", ".join(f"{key} {settings[key]!r}" for key in wrong))
    return main(settings, out, stop_after, resume=True)


def _whole(least):
    return lambda value: type(value) is int and value >= least


# What `fastoptim train`'s arguments take of each setting (train/command.py), which a resumed settings.json must hold
SETTINGS = {"optimizers": lambda names: type(names) is list and names != [] and len(set(map(str, names))) == len(names)
            and all(type(name) is str and name in RECIPES for name in names),
            "steps": _whole(1), "lr_sweep": lambda value: type(value) is bool,
            "model_size": lambda size: type(size) is str and size in model.SIZES, "batch_size": _whole(1),
            "eval_every": _whole(1), "checkpoint_every": _whole(1), "seed": _whole(0), "threads": _whole(1)}
