"""What `fastoptim bench` writes: markdown tables (per model, and the seeds' layout), results.json,
PNG plots, and a side-by-side view of two runs."""
import json
import os
import platform
from pathlib import Path

import torch

import fastoptim

SCHEMA = 1
MIB = 2**20


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return dict(system=platform.platform(), cpu=cpu, cpus=os.cpu_count(), memory_bytes=total,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                python=platform.python_version())


def header(settings):
    return dict(schema=SCHEMA, fastoptim=fastoptim.__version__, torch=torch.__version__, machine=machine(),
                **{key: settings[key] for key in ("device", "dtype", "threads", "steps", "repeats", "baseline",
                                                  "gradients")},
                interrupted=False, models=[])


def number(value, digits=1, scale=1.0):
    return "" if value is None else f"{value / scale:.{digits}f}"


def model_table(entry, settings):
    """One model's table: a row per optimizer, every figure."""
    base, steps = settings["baseline"], settings["steps"]
    columns = ["optimizer", "ms/step", f"{steps} steps (ms)", f"time vs {base}", "first step (ms)", "state MiB",
               "step extra MiB", "peak MiB", f"peak vs {base}", "GB/s", "of probe", "status"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in entry["optimizers"]:
        status = r["status"] if not r["message"] else f"{r['status']}: {r['message'][:80]}"
        lines.append(f"| {r['optimizer']} | {number(r['ms_per_step'])} | {number(r['total_ms'], 0)} | "
                     f"{number(r['time_vs_baseline'], 2)} | {number(r['first_step_ms'], 0)} | "
                     f"{number(r['state_bytes'], 1, MIB)} | "
                     f"{number(r['peak_extra_bytes'], 1, MIB)} | {number(r['peak_bytes'], 0, MIB)} | "
                     f"{number(r['peak_vs_baseline'], 3)} | {number(r['gbps'])} | {number(r['of_probe'], 2)} | "
                     f"{status} |")
    return "\n".join(lines)


def model_heading(entry):
    if entry["status"] != "ok":
        return f"### {entry['model']}: {entry['status']}: {entry.get('message')}"
    probe = f", probe {entry['probe_gbps']:.1f} GB/s" if entry.get("probe_gbps") else ""
    return (f"### {entry['model']}: {entry['params'] / 1e6:.1f}M params in {entry['tensors']} tensors, "
            f"{entry['param_bytes'] / MIB:.0f} MiB{probe}")


def seeds_tables(results):
    """The seeds' layout: a row per model; per optimizer its peak and its total time, each with its
    ratio to the baseline in percent, as the seeds' "Δ (%)" and "FusedAdan/Adam (%)" columns."""
    entries = [e for e in results["models"] if e["status"] == "ok"]
    if not entries:
        return ""
    names = [r["optimizer"] for r in entries[0]["optimizers"]]
    base, steps = results["baseline"], results["steps"]

    def table(title, value, ratio, scale, digits):
        lines = [f"{title}", "", "| Model | Model Size (M params) | " + " | ".join(names) + " |",
                 "|---|---|" + "---|" * len(names)]
        for entry in entries:
            cells = []
            for r in entry["optimizers"]:
                share = f" ({100 * r[ratio]:.1f}%)" if r[ratio] is not None else ""
                cells.append(number(r[value], digits, scale) + share if r[value] is not None else r["status"])
            lines.append(f"| {entry['model']} | {entry['params'] / 1e6:.3g} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    return "\n\n".join([
        table(f"Peak memory (MiB: params, grads, states and the step's peak extra; % of {base})",
              "peak_bytes", "peak_vs_baseline", MIB, 0),
        table(f"Time of {steps} steps (ms; % of {base})", "total_ms", "time_vs_baseline", 1, 1)])


def title(results):
    return (f"fastoptim {results['fastoptim']}, torch {results['torch']}, {results['machine']['cpu']}, "
            f"{results['threads']} threads, {results['device']}, {results['dtype']}, gradients from "
            f"{results['gradients']}; {results['steps']} steps x {results['repeats']} interleaved repeats (medians)")


def markdown(results):
    parts = [title(results)]
    if results["interrupted"]:
        parts.append("**Interrupted: the figures below are what was measured before Ctrl-C.**")
    for entry in results["models"]:
        parts.append(model_heading(entry))
        if entry["status"] == "ok" or entry.get("optimizers"):
            parts.append(model_table(entry, results))
    parts.append(seeds_tables(results))
    return "\n\n".join(parts) + "\n"


def plot(results, path):
    """Per model, ms per step and peak memory of every optimizer, as horizontal bars."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    entries = [e for e in results["models"] if e.get("optimizers")]
    if not entries:
        return None
    height = 0.25 * max(len(e["optimizers"]) for e in entries) + 1
    figure, axes = pyplot.subplots(len(entries), 2, figsize=(12, height * len(entries)), squeeze=False)
    for row, entry in zip(axes, entries):
        names = [r["optimizer"] for r in entry["optimizers"]]
        for axis, key, scale, label in ((row[0], "ms_per_step", 1, "ms per step"),
                                        (row[1], "peak_bytes", MIB, "peak MiB (params, grads, states, step)")):
            values = [(r[key] or 0) / scale for r in entry["optimizers"]]
            axis.barh(names, values, color=["C0" if n.startswith(("adan", "adamw")) else "C7" for n in names])
            axis.invert_yaxis()
            axis.set_xlabel(label)
            axis.set_title(f"{entry['model']}: {label}", fontsize=9)
            axis.tick_params(labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


def write(results, out):
    """results.json, results.md and bench.png in ``out``; returns the markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "results.md").write_text(text)
    plot(results, out / "bench.png")
    return text


def compare(path_a, path_b):
    """Two runs side by side: each (model, optimizer) both have, with the ratio B/A."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    rows = {(e["model"], r["optimizer"]): r for e in b["models"] for r in e.get("optimizers", [])}
    lines = [f"A: {path_a} (torch {a['torch']}, {a['threads']} threads, {a['dtype']})",
             f"B: {path_b} (torch {b['torch']}, {b['threads']} threads, {b['dtype']})", "",
             "| model | optimizer | A ms/step | B ms/step | B/A time | A peak MiB | B peak MiB | B/A peak |",
             "|---|---|---|---|---|---|---|---|"]
    for entry in a["models"]:
        for ra in entry.get("optimizers", []):
            rb = rows.get((entry["model"], ra["optimizer"]))
            if rb is None:
                continue
            time_ratio = rb["ms_per_step"] / ra["ms_per_step"] if ra["ms_per_step"] and rb["ms_per_step"] else None
            peak_ratio = rb["peak_bytes"] / ra["peak_bytes"] if ra["peak_bytes"] and rb["peak_bytes"] else None
            lines.append(f"| {entry['model']} | {ra['optimizer']} | {number(ra['ms_per_step'])} | "
                         f"{number(rb['ms_per_step'])} | {number(time_ratio, 2)} | "
                         f"{number(ra['peak_bytes'], 0, MIB)} | {number(rb['peak_bytes'], 0, MIB)} | "
                         f"{number(peak_ratio, 3)} |")
    return "\n".join(lines)
