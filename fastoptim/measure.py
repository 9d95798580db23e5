"""What ``fastoptim bench`` and ``fastoptim train`` share: the machine a figure was measured on and how
busy other processes kept it, byte
counts and number formatting, and how a model's params are grouped (which get subset-norm states,
as the seed's usage picks them). Both import it; neither imports the other."""
import argparse
import os
import platform
import time
from pathlib import Path

import torch

MIB = 2**20
BUSY_CORES = 0.25  # other processes using this many cores on average make the machine busy


def machine():
    """The machine a figure was measured on: system, CPU model, cores, memory, GPU, Python."""
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


def cpu_seconds():
    """Busy CPU seconds so far: of the whole machine (/proc/stat, all but idle and iowait), and of this
    process with its finished children."""
    with open("/proc/stat") as f:
        ticks = [int(value) for value in f.readline().split()[1:9]]  # user .. steal (guest is inside user)
    own = os.times()
    machine = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return machine, own.user + own.system + own.children_user + own.children_system


def load_snapshot():
    return dict(load=os.getloadavg(), cpu=cpu_seconds(), time=time.perf_counter())


def load_between(before, after):
    """The machine's load over a stretch: load averages (1, 5, 15 min) at both ends, and the cores that
    other processes kept busy on average, which is what slows the figures."""
    wall = after["time"] - before["time"]
    others = (after["cpu"][0] - before["cpu"][0]) - (after["cpu"][1] - before["cpu"][1])
    others_cores = max(0.0, others / wall) if wall > 0 else 0.0
    return dict(cpus=os.cpu_count(), load_before=list(before["load"]), load_after=list(after["load"]),
                others_cores=others_cores, busy=others_cores >= BUSY_CORES)


def machine_busy_now(seconds=1.0):
    """The load over a short idle wait, for the warning before anything is measured."""
    before = load_snapshot()
    time.sleep(seconds)
    return load_between(before, load_snapshot())


def cpu_features():
    """The x86 features the kernels choose between, of those this CPU has (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16") if f in flags]


def number(value, digits=1, scale=1.0):
    """``value / scale`` with ``digits`` decimals; an empty string for None (not measured)."""
    return "" if value is None else f"{value / scale:.{digits}f}"


def tensor_bytes(tensors):
    """Bytes held, counting a tensor subclass (torchao's 8-bit states) by the tensors it wraps."""
    total = 0
    for tensor in tensors:
        if hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            total += tensor_bytes(getattr(tensor, name) for name in names)
        else:
            total += tensor.nbytes
    return total


def state_bytes(optimizer):
    """Bytes of every state tensor an optimizer holds."""
    return tensor_bytes(value for state in optimizer.state.values() if isinstance(state, dict)
                        for value in state.values() if isinstance(value, torch.Tensor))


def quiet_transformers():
    """transformers, its logging turned down, and its model code loaded with the noise kept off the
    output: that code imports torchao where it is installed (see fastoptim.extras.quiet_import)."""
    from .extras import output_discarded, quiet_import
    transformers = quiet_import("transformers")
    transformers.logging.set_verbosity_error()
    with output_discarded():
        transformers.PreTrainedModel  # a lazy attribute: its first access loads the model code


def params_and_sn(module):
    """The module's params, and for each whether it gets subset-norm states: the weights of Linear
    layers (GPT-2's Conv1D included) that are not also an embedding, as in the seed's usage."""
    linear, embedding = set(), set()
    for child in module.modules():
        weight = getattr(child, "weight", None)
        if isinstance(child, torch.nn.Embedding):
            embedding.add(id(weight))
        elif isinstance(child, torch.nn.Linear) or type(child).__name__ == "Conv1D":
            linear.add(id(weight))
    params = list(module.parameters())
    return params, [id(p) in linear and id(p) not in embedding for p in params]


def two_groups(params, chosen, options, others=None):
    """Two param groups: the params ``chosen`` marks (a flag per param) with ``options``, the rest
    with ``others``; an empty one is left out."""
    groups = [{"params": [p for p, c in zip(params, chosen) if c]} | options,
              {"params": [p for p, c in zip(params, chosen) if not c]} | (others or {})]
    return [group for group in groups if group["params"]]


def muon_groups(params, matrices):
    """Param groups as Muon takes a model: its hidden matrices (``matrices``: a flag per param, the
    Linear weights of ``params_and_sn``) in a Muon group, the rest in an AdamW one."""
    return two_groups(params, matrices, {}, {"use_muon": False})


def sn_groups(params, sn):
    """Param groups as the seed's usage makes them: ``'sn': True`` on the chosen params."""
    return two_groups(params, sn, {"sn": True})


def at_least(lowest):
    """An argparse type: an int of at least ``lowest``, refused with the bound named otherwise."""
    def parse(text):
        value = int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest}, not {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in its messages: "invalid int value"
    return parse


positive = at_least(1)
non_negative = at_least(0)


def named(text):
    """An argparse type: a non-empty name or path (an empty shell variable would otherwise read as the
    option left out, and ``--resume ""`` start a new run over the last one's checkpoints)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def check_names(kind, names, valid):
    """Stop the command with one line where ``names`` (of ``kind``: "model", "optimizer") holds one not in
    ``valid`` (which it lists), or one twice (a second run would go under the same name: one row, one
    checkpoint)."""
    unknown = [name for name in dict.fromkeys(names) if name not in valid]
    if unknown:
        raise SystemExit(f"unknown {kind} {', '.join(unknown)}; valid: {', '.join(valid)}")
    twice = [name for name in dict.fromkeys(names) if names.count(name) > 1]
    if twice:
        raise SystemExit(f"{kind} named more than once: {', '.join(twice)}")


def output_folder(text):
    """An argparse type: a folder a command can write its results into, checked before it measures
    anything: a folder, or a path whose nearest existing parent is a writable folder."""
    path = Path(named(text))
    existing = next(folder for folder in (path, *path.absolute().parents) if folder.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{existing} is not writable")
    return text
