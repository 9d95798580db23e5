"""What `fastoptim bench` writes: markdown tables (per model, and a summary per figure), results.json,
PNG plots, and a side-by-side view of two runs."""
import datetime
import json
import os
import textwrap
from pathlib import Path

import torch

import fastoptim

from ..measure import MIB, machine, number

# 2: spread of each figure, the machine's load, the peers' library; 3: bytes kept per parameter; 4: the run's date
# and each model's probe range
SCHEMA = 4
# Bytes per parameter of AdamW's training state (params, grads, states) that peers publish, for lean
# configurations this benchmark does not build: (who, configuration, bytes, with gradient release).
PUBLISHED_BYTES_PER_PARAM = (
    ("FlashOptim (Databricks, 2026)", "bf16 params + int8 correction, companded 8-bit states", 7.1, 5.1),
)
WIDTH = 120  # of every printed line
NOT_MEASURED = "—"
SHARED_INSTANCE = "·"
SPREAD_LIMIT = 0.10  # a figure whose (max - min) / median over the repeats exceeds this is flagged


def header(settings):
    return dict(schema=SCHEMA, fastoptim=fastoptim.__version__, torch=torch.__version__, machine=machine(),
                date=datetime.date.today().isoformat(),
                **{key: settings[key] for key in ("device", "dtype", "threads", "steps", "repeats", "baseline",
                                                  "gradients")},
                spread_limit=SPREAD_LIMIT, load_at_start=None, busy=False, interrupted=False, models=[])


def cell(value, digits=1, scale=1.0):
    return NOT_MEASURED if value is None else number(value, digits, scale)


def grid(columns, rows):
    """A markdown table padded into columns, readable as it prints."""
    widths = [max(len(str(row[i])) for row in [columns, *rows]) for i in range(len(columns))]
    line = lambda row: "| " + " | ".join(str(text).ljust(width) for text, width in zip(row, widths)) + " |"
    return "\n".join([line(columns), "|" + "|".join("-" * (width + 2) for width in widths) + "|",
                      *map(line, rows)])


def spread_cell(result):
    if result["spread"] is None:
        return NOT_MEASURED
    return f"{100 * result['spread']:.0f}%" + ("!" if result["noisy"] else "")


def model_tables(entry, results):
    """One model's figures: a time table and a memory table, a row per optimizer each, then a note per
    optimizer that did not run."""
    time_rows, memory_rows, notes = [], [], []
    for r in entry["optimizers"]:
        name = r["optimizer"] + peer_mark(r)
        first = SHARED_INSTANCE if r["first_step_ms"] is None and r["status"] == "ok" else cell(r["first_step_ms"], 0)
        range_ms = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}" if r["min_ms"] is not None else NOT_MEASURED
        time_rows.append([name, cell(r["ms_per_step"]), range_ms, spread_cell(r), cell(r["time_vs_baseline"], 2),
                          first, cell(r["gbps"]), cell(r["of_probe"], 2), r["status"]])
        memory_rows.append([name, cell(r["state_bytes"], 1, MIB), cell(r["peak_extra_bytes"], 1, MIB),
                            cell(r["peak_bytes"], 0, MIB), cell(r["peak_vs_baseline"], 3)])
        if r["message"]:
            notes.append(f"- {r['optimizer']}: {r['status']}: {r['message']}"[:WIDTH])
    time = grid(["optimizer", "ms/step", "min-max ms", "spread", "vs base", "1st step ms", "GB/s", "of probe",
                 "status"], time_rows)
    memory = grid(["optimizer", "state MiB", "step extra MiB", "peak MiB", "peak vs base"], memory_rows)
    return "\n\n".join([time, memory, *(["\n".join(notes)] if notes else [])])


def load_text(load):
    return (f"load average (1 min) {load['load_before'][0]:.1f} before, {load['load_after'][0]:.1f} after on "
            f"{load['cpus']} CPUs; other processes used {load['others_cores']:.2f} cores"
            + (" (busy)" if load["busy"] else ""))


def model_heading(entry):
    if entry["status"] != "ok":
        return f"### {entry['model']}: {entry['status']}: {entry.get('message')}"
    probe = ""
    if entry.get("probe_gbps"):
        probe = f", probe {entry['probe_gbps']:.1f} GB/s (spread {100 * entry['probe_spread']:.0f}%)"
    load = f"\n{wrap(load_text(entry['load']))}" if entry.get("load") else ""
    return (f"### {entry['model']}: {entry['params'] / 1e6:.1f}M params in {entry['tensors']} tensors, "
            f"{entry['param_bytes'] / MIB:.0f} MiB{probe}{load}")


def legend(results):
    return wrap(f"base: {results['baseline']}; * a peer (not fastoptim); {NOT_MEASURED} not measured (the status "
                f"or a note says why); {SHARED_INSTANCE} shares its family's instance, whose first step (state "
                f"allocation, compilation) is on the family's first row; spread: (max - min) / median over the "
                f"repeats, ! above {100 * results['spread_limit']:.0f}%.")


def summary_tables(results):
    """A table per figure, the optimizers as rows and the models as columns (in groups that fit the
    width), each cell the figure with its ratio to the base."""
    entries = [e for e in results["models"] if e.get("optimizers")]
    if not entries:
        return ""
    libraries = {r["optimizer"]: peer_mark(r) for e in entries for r in e["optimizers"]}
    names = list(libraries)
    by_model = [{r["optimizer"]: r for r in e["optimizers"]} for e in entries]

    def figure(result, key, ratio, scale, digits):
        if result is None:
            return NOT_MEASURED
        if result[key] is None:
            return result["status"] if result["status"] != "ok" else NOT_MEASURED
        share = f" ({result[ratio]:.2f}x)" if result[ratio] is not None else ""
        return f"{result[key] / scale:.{digits}f}{share}"

    tables = []
    for title, key, ratio, scale, digits in (
            (f"ms per step (median; x {results['baseline']})", "ms_per_step", "time_vs_baseline", 1, 1),
            (f"peak MiB: params, grads, states and the step's extra (x {results['baseline']})", "peak_bytes",
             "peak_vs_baseline", MIB, 0),
            (f"bytes per parameter kept between steps: params, grads, states (x {results['baseline']})",
             "kept_bytes_per_param", "kept_vs_baseline", 1, 2)):
        rows = [[name + libraries[name]] + [figure(rows.get(name), key, ratio, scale, digits) for rows in by_model]
                for name in names]
        name_width = max(map(len, names)) + 4
        per_group = max(1, (WIDTH - name_width) // (max(len(e["model"]) for e in entries) + 3 + 2))
        for first in range(0, len(entries), per_group):
            group = slice(first, first + per_group)
            tables.append(f"{title}\n\n" + grid(["optimizer", *(e["model"] for e in entries[group])],
                                                 [[row[0], *row[1:][group]] for row in rows]))
    return "\n\n".join(tables)


def published():
    """The bytes per parameter that peers publish for configurations not built here."""
    return "Published, not measured here (bytes per parameter, params + grads + states):\n\n" + grid(
        ["who", "configuration", "bytes", "with grad release"],
        [[who, what, f"{full:.1f}", f"{released:.1f}"] for who, what, full, released in PUBLISHED_BYTES_PER_PARAM])


def busy_warning(results):
    """One warning that the machine was busy: at the start, and (once measured) per model."""
    loads = [("at the start", results["load_at_start"])] if results["load_at_start"] else []
    loads += [(f"during {e['model']}", e["load"]) for e in results["models"] if e.get("load")]
    busy = [f"{load['others_cores']:.2f} {where}" for where, load in loads if load["busy"]]
    most = max(load["load_after"][0] for _, load in loads) if loads else 0
    return wrap(f"WARNING: the machine was busy: other processes kept cores busy ({', '.join(busy)}; load "
                f"average up to {most:.1f} on {os.cpu_count()} CPUs). The times are slower and noisier than "
                f"on an idle machine.")


def wrap(text):
    return textwrap.fill(text, WIDTH, break_on_hyphens=False)


def peer_mark(result):
    return "" if result["library"] == "fastoptim" else " *"


def title(results):
    return wrap(f"fastoptim {results['fastoptim']}, torch {results['torch']}, {results['machine']['cpu']}, "
            f"{results['threads']} threads, {results['device']}, {results['dtype']}, gradients from "
            f"{results['gradients']}; {results['steps']} step(s) x {results['repeats']} interleaved repeats (medians)")


def markdown(results):
    warning = [busy_warning(results)] if results["busy"] else []
    parts = [title(results), *warning, legend(results)]
    if results["interrupted"]:
        parts.append("**Interrupted: the figures below are what was measured before Ctrl-C.**")
    for entry in results["models"]:
        parts.append(model_heading(entry))
        if entry.get("optimizers"):
            parts.append(model_tables(entry, results))
    parts += ["## Summary", summary_tables(results), published(), *warning]
    return "\n\n".join(parts) + "\n"


def plot(results, path):
    """Per model, ms per step (log axis) and peak memory of every optimizer, as bars: fastoptim's and
    the peers' in two colours, each time bar with the min..max of its repeats, and on the time axis
    the time each step's traffic takes at the copy probe's bandwidth, as the band of the probe's own
    repeats. The figure's title carries the machine, torch, date and the busy warning, so it reads
    without results.md."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    entries = [e for e in results["models"] if e.get("optimizers")]
    if not entries:
        return None
    height = 0.25 * max(len(e["optimizers"]) for e in entries) + 1.2
    heading = [title(results) + f"; {results.get('date', '')}"] + ([busy_warning(results)] if results["busy"] else [])
    heading_inches = 0.14 * sum(text.count("\n") + 1 for text in heading) + 0.1
    figure, axes = pyplot.subplots(len(entries), 2, figsize=(13, height * len(entries) + heading_inches),
                                   squeeze=False)
    colours = {True: "C0", False: "C7"}
    for row, entry in zip(axes, entries):
        rows = entry["optimizers"]
        names = [r["optimizer"] for r in rows]
        times = [r["ms_per_step"] or float("nan") for r in rows]
        spread = [[t - (r["min_ms"] or t) for t, r in zip(times, rows)],
                  [(r["max_ms"] or t) - t for t, r in zip(times, rows)]]
        row[0].barh(names, times, xerr=spread, error_kw=dict(capsize=2, lw=0.8),
                    color=[colours[r["library"] == "fastoptim"] for r in rows])
        row[0].set_xscale("log")  # times span orders of magnitude; ticks at 1, 2, 5 of each decade, as plain numbers
        row[0].xaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        row[0].xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        row[0].xaxis.set_minor_formatter(ticker.NullFormatter())
        peaks = [r["peak_bytes"] / MIB if r["peak_bytes"] else float("nan") for r in rows]
        row[1].barh(names, peaks, color=[colours[r["library"] == "fastoptim"] for r in rows])  # from 0: by length
        if all(peak != peak for peak in peaks):
            row[1].text(0.5, 0.5, "not measured", transform=row[1].transAxes, ha="center", va="center")
            row[1].set_xticks([]), row[1].set_yticks([])
        for axis, label in ((row[0], "ms per step (log), min..max of the repeats"),
                            (row[1], "peak MiB: params, grads, states, step")):
            axis.invert_yaxis()
            axis.set_xlabel(label)
            axis.set_title(f"{entry['model']}: {label}", fontsize=9)
            axis.tick_params(labelsize=7)
        if entry.get("probe_gbps"):
            slowest, fastest = sorted(entry.get("probe_range_gbps") or [entry["probe_gbps"]] * 2)
            for y, r in enumerate(rows):
                if r["traffic_bytes"]:
                    row[0].plot([r["traffic_bytes"] / fastest / 1e6, r["traffic_bytes"] / slowest / 1e6], [y, y],
                                color="black", lw=5, alpha=0.45, solid_capstyle="butt", zorder=3,
                                marker="|", markersize=10)  # a band too narrow to see still shows its ends
    handles = [Patch(color=colours[True], label="fastoptim"), Patch(color=colours[False], label="peers"),
               Line2D([], [], lw=5, alpha=0.45, color="black", marker="|", markersize=10,
                      label="its traffic at the copy probe's bandwidth (probe's min..max); caches can beat it")]
    figure.legend(handles=handles, loc="lower center", ncol=3, fontsize=8)
    figure.suptitle("\n".join(heading), fontsize=8, color="black", y=0.995, va="top")
    figure.tight_layout(rect=(0, 0.35 / figure.get_figheight(), 1, 1))  # it makes room for the title itself
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
    a, b = map(read_results, (path_a, path_b))
    rows = {(e["model"], r["optimizer"]): r for e in b["models"] for r in e.get("optimizers", [])}
    lines = [f"A: {path_a} (torch {a['torch']}, {a['threads']} threads, {a['dtype']})",
             f"B: {path_b} (torch {b['torch']}, {b['threads']} threads, {b['dtype']})", "",
             "| model | optimizer | A ms/step | B ms/step | B/A time | A peak MiB | B peak MiB | B/A peak |",
             "|---|---|---|---|---|---|---|---|"]
    header = len(lines)
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
    if len(lines) == header:
        lines.append("\nThe two runs have no (model, optimizer) pair in common.")
    return "\n".join(lines)


def read_results(path):
    """The results a ``fastoptim bench`` run wrote to ``path`` (its results.json); a one-line SystemExit
    where it cannot be read or is no bench run's."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise SystemExit(f"--compare {path}: {getattr(error, 'strerror', None) or error}") from None
    if not (isinstance(results, dict) and {"torch", "threads", "dtype", "models"} <= results.keys()
            and all("model" in entry for entry in results["models"])):
        raise SystemExit(f"--compare {path}: not the results.json of a fastoptim bench run")
    return results
