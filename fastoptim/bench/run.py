"""Optimizer steps on real model shapes: time (interleaved repeats, medians), persistent state, peak
extra memory of a step, and achieved bandwidth against a probe measured in the same process; with
each figure its spread over the repeats, and the machine's load while it was taken.

Optimizers of one family (the engines of one fastoptim class) share one
instance and its states: each step sets its engine flags first. Families are timed in rounds whose
states fit in ROUND_STATE_BYTES (and in free memory), each round's optimizers interleaved so that
the machine's drift hits all of them alike, and the probe timed in every round.
"""
import ctypes
import functools
import gc
import math
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fastoptim

from ..measure import load_between, load_snapshot, machine_busy_now, muon_groups, state_bytes, tensor_bytes
from . import memory, peers, report
from .models import shapes, with_gradients

HYPERPARAMETERS = dict(lr=1e-4, weight_decay=0.02)
ENGINES = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
           "fused-single": dict(foreach=False, fused=True), "fused-multi": dict(foreach=True, fused=True)}
# family: class, subset-norm states on the Linear weights, state_bits, master_bits (bf16 params: --dtype bf16)
FASTOPTIM = {"adan": (fastoptim.Adan, False, 32, 16), "adamw": (fastoptim.AdamW, False, 32, 16),
             "adan-sn": (fastoptim.Adan, True, 32, 16), "adamwsn": (fastoptim.AdamWSN, True, 32, 16),
             "adan-8bit": (fastoptim.Adan, False, 8, 16), "adamw-8bit": (fastoptim.AdamW, False, 8, 16),
             "adamw-master24": (fastoptim.AdamW, False, 32, 24), "adamw-master32": (fastoptim.AdamW, False, 32, 32),
             # issue 33's lean AdamW: with bf16 params, 4 bytes per parameter of params and states
             "adamwsn-8bit-master24": (fastoptim.AdamW, True, 8, 24)}
PROBE_NUMEL = 1 << 24  # per role: 64 MiB of fp32, far beyond the caches; 6 such fit beside a large model
# The states a round holds at once, beyond the first family: with a large model's params and grads and
# the probe, the quick default then peaks under 4 GiB of resident memory.
ROUND_STATE_BYTES = 2 << 30
FAMILY_BYTES_PER_ELEMENT = 16  # the most a family keeps: Adan's four fp32 states


@dataclass(frozen=True)
class Optimizer:
    family: str  # the optimizers of a family share one instance
    make: Callable  # (params, sn) -> a torch.optim.Optimizer; sn marks the params that get subset-norm states
    flags: dict = field(default_factory=dict)  # set on every group before each step
    compiled: bool = False  # its step runs through torch.compile
    library: str = "fastoptim"


def fastoptim_family(cls, sn, state_bits=32, master_bits=16):
    def make(params, sn_mask):
        return cls(peers.sn_groups(params, sn_mask) if sn else params, state_bits=state_bits,
                   master_bits=master_bits, **HYPERPARAMETERS)
    return make


def muon_family(state_bits):
    """fastoptim.Muon on the hidden matrices (the params the subset-norm mask marks), with AdamW companions."""
    def make(params, matrices):
        return fastoptim.Muon(muon_groups(params, matrices), state_bits=state_bits, **HYPERPARAMETERS)
    return make


def optimizers():
    """Every optimizer the benchmark knows, by name: fastoptim's engines, then the peers."""
    table = {}
    for family, options in FASTOPTIM.items():
        for engine, flags in ENGINES.items():
            table[f"{family}-{engine}"] = Optimizer(family, fastoptim_family(*options), flags)
    for family, state_bits in (("muon", 32), ("muon-8bit", 8)):
        for engine, flags in ENGINES.items():
            table[f"{family}-{engine}"] = Optimizer(family, muon_family(state_bits), flags)
    table["adan-foreach-compiled"] = Optimizer("adan-compiled", fastoptim_family(fastoptim.Adan, False),
                                               ENGINES["foreach"], compiled=True)
    for name, make, options in (("torch-adam", peers.torch_adam, dict(lr=1e-4)),
                                ("torch-adamw", peers.torch_adamw, HYPERPARAMETERS)):
        # each its own instance: on CUDA, foreach keeps its step counts on the CPU, where fused refuses them
        for engine, flags in (("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
            table[f"{name}-{engine}"] = Optimizer(f"{name}-{engine}", lambda p, s, m=make, o=options, f=flags:
                                                  m(p, s, **o, **f), library="torch")
    table["torch-muon"] = Optimizer("torch-muon", lambda p, matrices: peers.TorchMuonWithAdamW(
        p, matrices, **HYPERPARAMETERS), library="torch")
    for name, make, library in (("timm-adan", peers.timm_adan, "timm"),
                                ("po-adan", peers.pytorch_optimizer_adan, "pytorch-optimizer"),
                                ("po-adamwsn", peers.pytorch_optimizer_adamwsn, "pytorch-optimizer"),
                                ("bnb-adamw8bit", peers.bitsandbytes_adamw8bit, "bitsandbytes"),
                                ("torchao-adamw8bit", peers.torchao_adamw8bit, "torchao")):
        table[name] = Optimizer(name, lambda p, s, m=make: m(p, s, **HYPERPARAMETERS), library=library)
    return table


def stepper(optimizer, spec):
    """A step function that sets ``spec``'s engine flags, then steps (compiled if asked)."""
    step = torch.compile(optimizer.step) if spec.compiled else optimizer.step

    def run():
        for group in optimizer.param_groups:
            group.update(spec.flags)
        step()
    return run


def release_memory():
    """Free what is unreachable and hand freed heap memory back to the system. glibc keeps freed
    blocks under 32 MiB in its heap, where MemAvailable does not count them: without the trim, the
    states of earlier models looked like used memory, and later models were skipped or starved."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_bytes(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def probe(params, device):
    """A step function with a known traffic and trivial math, and its bytes per call, over buffers
    shaped like the first params (up to PROBE_NUMEL elements): the C probe (Adan's 6 reads and 5
    writes of fp32) on the CPU when the kernel is built, else a copy. One flat buffer is not the
    same: its streams alias in the caches and it measured 20-30% slower here."""
    from fastoptim.engines.backends import cpu as cpu_backend
    from fastoptim.multi_tensor import chunk_plan
    from fastoptim.optimizers.adan import SPEC as ADAN

    shapes, numel = [], 0
    for param in params:  # a param beyond what is left of PROBE_NUMEL (an embedding) is passed over
        if numel + param.numel() <= PROBE_NUMEL:
            shapes.append(param.shape)
            numel += param.numel()
    if not shapes:
        shapes, numel = [(PROBE_NUMEL,)], PROBE_NUMEL
    if torch.device(device).type == "cpu" and cpu_backend.AVAILABLE:
        buffers = [[torch.zeros(shape) for shape in shapes] for _ in ("param", "grad") + ADAN.states]
        chunks = chunk_plan([buffer.numel() for buffer in buffers[0]])[0]

        def step():
            cpu_backend.probe(buffers, chunks)
        return step, 11 * 4 * numel
    sources = [torch.zeros(shape, device=device) for shape in shapes]
    targets = [torch.empty_like(source) for source in sources]
    return lambda: torch._foreach_copy_(targets, sources), 2 * 4 * numel


FALLBACK_WARNING = "fastoptim: fused=True, but "  # how a fused engine's fallback to foreach begins


def first_step(step):
    """``step()``, and the reason a fused engine gave for leaving tensors to foreach in it, or None. Its
    other warnings go their usual way, under the filters in force (helper-107: warned again after the
    step, they were lost where it raised); leaving the filters set for its own, though, makes a warning
    shown once before show once more."""
    reasons = []

    def show(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(FALLBACK_WARNING):
            reasons.append(str(message)[len(FALLBACK_WARNING):].rsplit("; those tensors take", 1)[0])
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        shown, warnings.showwarning = warnings.showwarning, show
        warnings.filterwarnings("always", message=re.escape(FALLBACK_WARNING))  # whether shown before or not
        step()
    return "; ".join(dict.fromkeys(reasons)) or None


def time_steps(steps_by_name, steps, repeats, device="cpu", on_sample=None, fused=()):
    """Seconds per step of each step function, in ``repeats`` interleaved samples of ``steps`` steps,
    each after an untimed step (the first after switching engines rebuilds caches), and the reasons that
    the step functions named in ``fused`` (fastoptim's fused engines) gave in their first untimed step for
    leaving tensors to foreach (name to reason). A step function that raises is dropped from later
    repeats, and its error kept."""
    samples = {name: [] for name in steps_by_name}
    errors, fallbacks = {}, {}
    for repeat in range(repeats):
        for name, step in steps_by_name.items():
            if name not in errors:
                try:
                    if repeat or name not in fused:
                        step()
                    elif (reason := first_step(step)) is not None:
                        fallbacks[name] = reason
                    synchronize(device)
                    start = time.perf_counter()
                    for _ in range(steps):
                        step()
                    synchronize(device)
                    samples[name].append((time.perf_counter() - start) / steps)
                except Exception as error:  # a peer that fails is reported, not fatal
                    errors[name] = f"{type(error).__name__}: {error}"
            if on_sample:
                on_sample(name)
    return samples, errors, fallbacks


def new_result(name):
    return dict(optimizer=name, library=optimizers()[name].library, status="not run", message=None,
                ms_per_step=None, min_ms=None, max_ms=None, spread=None, noisy=None, total_ms=None, samples_ms=[],
                first_step_ms=None, state_bytes=None, peak_extra_bytes=None, peak_bytes=None, traffic_bytes=None,
                gbps=None, of_probe=None, time_vs_baseline=None, peak_vs_baseline=None, kept_bytes_per_param=None,
                kept_vs_baseline=None)


def build_family(spec, params, sn, device):
    """An optimizer of ``spec``'s family and its first step's seconds (state allocation, compile)."""
    optimizer = spec.make(params, sn)
    step = stepper(optimizer, spec)
    start = time.perf_counter()
    with warnings.catch_warnings():
        if spec.library != "fastoptim":  # a peer's advice to its developers (torchao's on compile caching)
            warnings.simplefilter("ignore")
        step()
    synchronize(device)
    return optimizer, time.perf_counter() - start


def next_round(pending, unbuilt, params, sn, results, settings, advance):
    """Step functions for the next optimizers of ``pending`` (taken from it) whose families fit in
    memory together, and their state bytes. A family whose build fails is recorded in ``unbuilt``
    (family: status, message) and its optimizers' results say so."""
    known, device = optimizers(), settings["device"]
    family_bytes = FAMILY_BYTES_PER_ELEMENT * sum(p.numel() for p in params)
    built, table, sizes = {}, {}, {}
    while pending:
        spec = known[pending[0]]
        if spec.family not in built and spec.family not in unbuilt:
            held = sum(state_bytes(optimizer) for optimizer, _ in built.values())
            if built and (held + family_bytes > ROUND_STATE_BYTES or free_bytes(device) < 1.2 * family_bytes):
                break  # the rest go in a later round, once this one's states are freed
            try:
                built[spec.family] = build_family(spec, params, sn, device)
            except ImportError as error:
                extra = "peers-gpu" if spec.library in peers.GPU_LIBRARIES else "peers"
                unbuilt[spec.family] = ("missing", f'{error} (pip install "fastoptim[{extra}]")')
            except Exception as error:  # a peer that fails is reported, not fatal
                unbuilt[spec.family] = ("failed", f"{type(error).__name__}: {error}")
        name = pending.pop(0)
        if spec.family in unbuilt:
            results[name] |= dict(zip(("status", "message"), unbuilt[spec.family]))
            advance(name, settings["repeats"])
            continue
        optimizer, first = built[spec.family]
        if first is not None:  # the family's first step: state allocation, compilation
            results[name]["first_step_ms"] = first * 1e3
            built[spec.family] = optimizer, None
        table[name] = stepper(optimizer, spec)
        sizes[name] = state_bytes(optimizer)
    return table, sizes


def measure_model(entry, names, settings, progress):
    """Everything the benchmark measures of model ``entry['model']``, filled into ``entry`` as it
    goes, so that an interrupted run still reports what it has."""
    model, device = entry["model"], settings["device"]
    start = load_snapshot()
    params, sn = with_gradients(model, DTYPES[settings["dtype"]], device, settings["gradients"] == "backward")
    progress.advance(model, "built")
    numel = sum(p.numel() for p in params)
    results = {name: new_result(name) for name in names}
    entry |= dict(status="ok", params=numel, tensors=len(params), param_bytes=tensor_bytes(params),
                  grad_bytes=tensor_bytes(p.grad for p in params), optimizers=list(results.values()))
    probe_step, probe_bytes = probe(params, device)
    probe_samples = []
    pending, unbuilt, advance = list(names), {}, functools.partial(progress.advance, model)
    known = optimizers()
    while pending:
        table, sizes = next_round(pending, unbuilt, params, sn, results, settings, advance)
        table["probe"] = probe_step
        fused = [name for name in table if name in known and known[name].library == "fastoptim"
                 and known[name].flags.get("fused")]
        samples, errors, fallbacks = time_steps(table, settings["steps"], settings["repeats"], device,
                                                on_sample=lambda name: name == "probe" or advance(name), fused=fused)
        probe_samples += samples.pop("probe")
        for name, times in samples.items():
            results[name] |= dict(samples_ms=[t * 1e3 for t in times], state_bytes=sizes[name])
            results[name] |= dict(status="failed", message=errors[name]) if name in errors else dict(status="ok")
            if name in fallbacks and name not in errors:  # its figures are foreach's, in part or in whole
                results[name]["message"] = f"its fused engine left tensors to foreach: {fallbacks[name]}"
        del table  # and with it this round's optimizers and states
        release_memory()
    if probe_samples:
        entry["probe_gbps"] = probe_bytes / statistics.median(probe_samples) / 1e9
        entry["probe_spread"] = spread(probe_samples)
        entry["probe_range_gbps"] = [probe_bytes / max(probe_samples) / 1e9, probe_bytes / min(probe_samples) / 1e9]
    measured = [name for name in names if results[name]["status"] == "ok"]
    for name in names:
        if settings["memory"] and name in measured:
            continue
        advance(f"memory of {name}" if settings["memory"] else "no memory phase")
    if settings["memory"]:
        for name, extra in peak_extra(model, measured, settings, params, sn):
            results[name]["peak_extra_bytes" if isinstance(extra, int) else "message"] = extra
            advance(f"memory of {name}")
    entry["load"] = load_between(start, load_snapshot())
    summarize(entry, settings)


def peak_extra(model, names, settings, params, sn):
    """(optimizer, peak extra bytes of one step, or an error message), one pair per optimizer as each is
    measured. On the CPU, in a fresh process per model (see fastoptim.bench.memory); on CUDA, from the
    allocator's peak counter."""
    if not names:
        return
    if torch.device(settings["device"]).type == "cpu":
        spec = dict(model=model, names=names, dtype=settings["dtype"], threads=settings["threads"])
        done = set()
        try:
            for name, extra in memory.streamed("fastoptim.bench.run:peak_extra_of_steps", spec):
                done.add(name)
                yield name, extra
        except RuntimeError as error:
            yield from ((name, str(error)) for name in names if name not in done)
        return
    for name in names:
        yield name, cuda_peak_extra(known_step(name, params, sn, settings["device"]))


def known_step(name, params, sn, device):
    spec = optimizers()[name]
    optimizer, _ = build_family(spec, params, sn, device)
    return stepper(optimizer, spec)


def cuda_peak_extra(step):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def peak_extra_of_steps(spec):
    """In a measuring subprocess: for each optimizer in turn, a fresh instance, one step to allocate
    its states, then the peak extra bytes of one more step. Params are built from the model's
    shapes with random grads: the bytes a step adds do not depend on the values."""
    torch.set_num_threads(spec["threads"])
    dtype = DTYPES[spec["dtype"]]
    params, sn = [], []
    for shape, is_sn in shapes(spec["model"]):
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype).uniform_(-0.02, 0.02))
        param.grad = torch.empty(shape, dtype=dtype).uniform_(-1e-3, 1e-3)
        params.append(param)
        sn.append(is_sn)
    for name in spec["names"]:
        try:
            extra = memory.measure_step(known_step(name, params, sn, "cpu"))
        except Exception as error:
            extra = f"{type(error).__name__}: {error}"
        gc.collect()
        yield name, extra


def summarize(entry, settings):
    """Medians, totals, peaks, bandwidth and the ratios to the baseline, from the raw figures."""
    steps, baseline = settings["steps"], settings["baseline"]
    for result in entry["optimizers"]:
        if result["samples_ms"]:
            samples = result["samples_ms"]
            result |= dict(ms_per_step=statistics.median(samples), min_ms=min(samples), max_ms=max(samples),
                           spread=spread(samples), noisy=spread(samples) > report.SPREAD_LIMIT)
            result["total_ms"] = result["ms_per_step"] * steps
        if result["state_bytes"] is not None:
            result["traffic_bytes"] = 2 * entry["param_bytes"] + entry["grad_bytes"] + 2 * result["state_bytes"]
            # what a run holds between steps, per parameter: params, grads (kept for the next step) and states
            result["kept_bytes_per_param"] = (entry["param_bytes"] + entry["grad_bytes"]
                                              + result["state_bytes"]) / entry["params"]
            if result["peak_extra_bytes"] is not None:
                result["peak_bytes"] = (entry["param_bytes"] + entry["grad_bytes"] + result["state_bytes"]
                                        + result["peak_extra_bytes"])
        if result["ms_per_step"] and result["traffic_bytes"]:
            result["gbps"] = result["traffic_bytes"] / result["ms_per_step"] / 1e6
            if entry.get("probe_gbps"):
                result["of_probe"] = result["gbps"] / entry["probe_gbps"]
    base = next((r for r in entry["optimizers"] if r["optimizer"] == baseline), None)
    for result in entry["optimizers"]:
        for key, ratio in (("ms_per_step", "time_vs_baseline"), ("peak_bytes", "peak_vs_baseline"),
                           ("kept_bytes_per_param", "kept_vs_baseline")):
            if base and base[key] and result[key]:
                result[ratio] = result[key] / base[key]


def spread(samples):
    """(max - min) / median: how far apart the repeats of one figure fell."""
    return (max(samples) - min(samples)) / statistics.median(samples)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Progress:
    """A progress bar over every model's build, (optimizer, repeat) samples and per-optimizer memory
    measurements, on stderr. Its estimate is the run's average rate so far (smoothing=0): the units
    differ in cost, and a recent rate would swing with them."""

    def __init__(self, total):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, smoothing=0)

    def advance(self, model, what, n=1):
        self.bar.set_description(f"{model}: {what}", refresh=False)
        self.bar.update(n)

    def write(self, text):
        self.bar.write(text)


def memory_needed(model, settings):
    """Bytes a model needs here: params and grads, the largest family's states (4 fp32 per
    element), and the probe's buffers."""
    numel = sum(math.prod(shape) for shape, _ in shapes(model))
    element = DTYPES[settings["dtype"]].itemsize
    return numel * (2 * element + 16) + 6 * 4 * min(numel, PROBE_NUMEL)


def main(models, names, settings, out):
    """Measure every model in turn, print its table, and write the reports to ``out``. Ctrl-C stops
    the run and still writes what was measured."""
    try:  # before anything is measured: a folder that cannot be made would lose the whole run at its end
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"--out {out}: {error.strerror or error}") from None
    torch.set_num_threads(settings["threads"])
    results = report.header(settings)
    results["load_at_start"] = machine_busy_now()
    units = 1 + (settings["repeats"] + 1) * len(names)  # build, samples, memory of each
    print(report.title(results), flush=True)
    if results["load_at_start"]["busy"]:
        print(report.busy_warning(results), flush=True)
    print(report.legend(results), flush=True)
    progress = Progress(units * len(models))
    try:
        for model in models:
            entry = dict(model=model, status="not run", message=None)
            results["models"].append(entry)
            need, free = memory_needed(model, settings), free_bytes(settings["device"])
            if need > free:
                entry |= dict(status="skipped", message=f"needs about {need / 2**30:.1f} GiB (params, grads, "
                              f"the largest states, probe) and {free / 2**30:.1f} GiB is free")
                progress.advance(model, "skipped", units)
            else:
                measure_model(entry, names, settings, progress)
                release_memory()  # the model's params and grads
            progress.write(report.model_heading(entry))
            if entry.get("optimizers"):
                progress.write(report.model_tables(entry, results) + "\n")
    except KeyboardInterrupt:
        results["interrupted"] = True
        entry["status"] = "interrupted"
        if entry.get("optimizers"):
            summarize(entry, settings)
    finally:
        progress.bar.close()
    results["busy"] = results["load_at_start"]["busy"] or any(e.get("load", {}).get("busy") for e in results["models"])
    text = report.write(results, out)
    print(report.summary_tables(results))
    if results["busy"]:
        print("\n" + report.busy_warning(results))
    print(f"\nwrote {out}/results.json, results.md and bench.png")
    if results["interrupted"]:
        raise SystemExit(130)
    return text
