"""What `fastoptim train` writes: results.json, results.md (also printed) and curves.png."""
import json
import math
from pathlib import Path

import torch

import fastoptim
from fastoptim.measure import MIB, machine, number

from .model import SIZES

SCHEMA = 3  # 2: each row names its optimizer's class; 3: the machine's load over the runs


def final_loss(run):
    """A run's last validation loss; a diverged run (nan) counts as infinitely bad."""
    loss = run["val_loss"][-1]
    return math.inf if math.isnan(loss) else loss


def first_step_at_or_below(run, target):
    return next((step for step, loss in zip(run["eval_steps"], run["val_loss"]) if loss <= target), None)


def results(settings, params, corpus, runs, classes, load):
    """The JSON document: settings, every run with its curves, and a row per optimizer from its best run
    (the lowest final validation loss over its learning rates), with its class (``classes``: name to
    "library.Class"), and the machine's ``load`` over the runs (``measure.load_between``). The first
    optimizer is the reference whose final validation loss the others race to."""
    for run in runs:
        run |= {"final_val_loss": run["val_loss"][-1], "ms_per_step": 1e3 * run["step_seconds"] / run["step"],
                "optimizer_share": None if run["optimizer_seconds"] is None  # stepped in backward: not apart
                else run["optimizer_seconds"] / run["step_seconds"]}
    best = {name: min((run for run in runs if run["optimizer"] == name), key=final_loss)
            for name in settings["optimizers"]}
    reference = settings["optimizers"][0]
    target = best[reference]["final_val_loss"]
    rows = [{"optimizer": name, "lr": run["lr"], "final_val_loss": run["final_val_loss"],
             "step_reaching_reference": first_step_at_or_below(run, target),
             "optimizer_share": run["optimizer_share"], "ms_per_step": run["ms_per_step"],
             "state_bytes": run["state_bytes"],
             "val_loss_by_lr": {f"{r['lr']:g}": r["final_val_loss"] for r in runs if r["optimizer"] == name},
             "class": classes[name]}
            for name, run in best.items()]
    return {"schema": SCHEMA, "fastoptim": fastoptim.__version__, "torch": torch.__version__, "machine": machine(),
            "settings": settings, "model": SIZES[settings["model_size"]] | {"params": params}, "data": corpus,
            "reference": reference, "rows": rows, "runs": runs, "load": load}


def title(results):
    settings, shape, corpus = results["settings"], results["model"], results["data"]
    sweep = ", the best lr of each" if settings["lr_sweep"] else ""
    return (f"fastoptim train: GPT-2 {settings['model_size']} (n_layer {shape['n_layer']}, n_head {shape['n_head']}, "
            f"n_embd {shape['n_embd']}: {shape['params'] / 1e6:.2f}M params), context {shape['context']}, "
            f"batch {settings['batch_size']}, "
            f"{settings['steps']} steps{sweep}, seed {settings['seed']}; {corpus['train_files']} train files "
            f"({corpus['train_bytes'] / 1e6:.1f} MB) and {corpus['validation_files']} validation files "
            f"({corpus['validation_bytes'] / 1e6:.2f} MB) of Python's standard library "
            f"({Path(corpus['stdlib']).name}); torch {results['torch']} on "
            f"{results['machine']['cpu']}, torch threads: {settings['threads']}")


def busy_warning(results):
    """A warning that other processes kept the machine busy during the runs, or None."""
    load = results["load"]
    if not load["busy"]:
        return None
    return (f"WARNING: the machine was busy: other processes kept {load['others_cores']:.2f} cores busy on average "
            f"during the runs (load average up to {max(load['load_after'][0], load['load_before'][0]):.1f} on "
            f"{load['cpus']} CPUs); ms/step are slower and noisier than on an idle machine, the losses are not.")


def markdown(results):
    reference = results["reference"]
    target = next(row for row in results["rows"] if row["optimizer"] == reference)["final_val_loss"]
    columns = ["optimizer", "lr", "final val loss", f"step reaching {reference}'s {target:.3f}",
               "optimizer share of step", "ms/step", "state MiB"]
    if results["settings"]["lr_sweep"]:
        columns.append("final val loss by lr")
    warning = busy_warning(results)
    lines = [title(results), *(["", warning] if warning else []), "", "| " + " | ".join(columns) + " |",
             "|---" * len(columns) + "|"]
    for row in results["rows"]:
        step = row["step_reaching_reference"]
        cells = [row["optimizer"], f"{row['lr']:g}", number(row["final_val_loss"], 3),
                 "—" if step is None else str(step),
                 "in backward" if row["optimizer_share"] is None else f"{100 * row['optimizer_share']:.1f}%",
                 number(row["ms_per_step"]), number(row["state_bytes"], 2, MIB)]
        if results["settings"]["lr_sweep"]:
            cells.append(", ".join(f"{lr}: {loss:.3f}" for lr, loss in row["val_loss_by_lr"].items()))
        lines.append("| " + " | ".join(cells) + " |")
    classes = [f"{row['optimizer']} is {row['class'].split('.')[0]}'s {row['class'].split('.')[-1]}"
               for row in results["rows"]]
    lines += ["", "; ".join(classes) + ", each with fused=True."]
    return "\n".join(lines) + "\n"


def plot(results, path):
    """Validation loss against step, a line per optimizer (its best run): all steps, and the second half."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    best = [next(run for run in results["runs"] if run["optimizer"] == row["optimizer"] and run["lr"] == row["lr"])
            for row in results["rows"]]
    half = results["settings"]["steps"] / 2
    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for axis, start in zip(axes, (0, half)):
        for run in best:
            points = [(step, loss) for step, loss in zip(run["eval_steps"], run["val_loss"]) if step >= start]
            axis.plot(*zip(*points), marker=".", label=f"{run['optimizer']} (lr {run['lr']:g})")
        axis.set_xlabel("step")
        axis.set_ylabel("validation loss (nats per byte)")
        axis.grid(alpha=0.3)
    axes[0].set_title("all steps", fontsize=9)
    axes[1].set_title("second half", fontsize=9)
    axes[0].legend(fontsize=8)
    warning = busy_warning(results)
    figure.suptitle(title(results) + (f"\n{warning}" if warning else ""), fontsize=7, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def write(results, out):
    """results.json, results.md and curves.png in ``out``; returns the markdown."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "results.md").write_text(text)
    plot(results, out / "curves.png")
    return text
