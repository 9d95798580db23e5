"""Two 8-bit state formats on speed (issue 33; their error: benchmarks/eight_bit_formats.py). One AdamW
step over fp32 params on a prototype walk (benchmarks/eight_bit_speed.c, compiled here with the fused
kernel's flags) whose states are fp32, fastoptim's blockwise 8-bit format through the library's own
codecs, or the companded format (groups of 32, fp16 scales, no table), each block of 256 decoded,
updated and encoded as the fused kernel's walk does. The prototype's companded codec is first held to
the readable reference in eight_bit_formats.py. For calibration, the library's fused AdamW step
(fp32 and ``state_bits=8``) on the same numel. Timed interleaved in one run, at 1 thread and 2: the
median of ``--repeats`` samples per row, min..max, and the median of each repeat's ratio to the fp32
walk (the library's rows: to its fp32 step) and, for the walk's rows, to its blockwise step.
Usage, from the repository root: .venv/bin/python -m benchmarks.eight_bit_speed [--numel N] [--repeats N]
"""
import argparse
import ast
import ctypes
import pathlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch

import fastoptim
from fastoptim.engines.backends import cpu as cpu_backend
from fastoptim.measure import cpu_features
from .eight_bit_formats import companded_first_moment, companded_second_moment

SOURCE = pathlib.Path(__file__).with_suffix(".c")
FORMATS = {"fp32": 0, "blockwise": 1, "companded": 2}
# The scalars of AdamW's first step (lr 1e-3, weight decay 0.01, betas 0.9 and 0.999, eps 1e-8).
STEP_SCALARS = {"beta1": 0.9, "beta2": 0.999, "lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8,
                "bias_correction1": 1 - 0.9, "bias_correction2_sqrt": (1 - 0.999) ** 0.5}
GROUPS = (32, 256)  # elements per fp16 scale: the format's, and the blockwise format's block


class Step(ctypes.Structure):
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("m", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("m_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
                *((name, ctypes.c_float) for name in STEP_SCALARS),
                ("format", ctypes.c_int), ("quantize", ctypes.c_void_p), ("dequantize", ctypes.c_void_p),
                ("begin", ctypes.c_int64), ("end", ctypes.c_int64)]


def kernel_flags():
    """The fused kernel's C flags, as setup.py states them (read, not imported: importing it builds)."""
    tree = ast.parse((pathlib.Path(__file__).parent.parent / "setup.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(target, "id", None) == "KERNEL_FLAGS" for target in node.targets))


def build(folder, group):
    """The prototype with ``group`` elements per companded scale, compiled with the fused kernel's
    flags (without link-time optimisation)."""
    library = pathlib.Path(folder) / f"eight_bit_speed_{group}{sysconfig.get_config_var('SHLIB_SUFFIX')}"
    flags = [flag for flag in kernel_flags() if flag != "-flto"]
    subprocess.run(["gcc", *flags, f"-DGROUP={group}", "-shared", str(SOURCE), "-o", str(library), "-lm"], check=True)
    prototype = ctypes.CDLL(str(library))
    prototype.adamw_step.argtypes = [ctypes.POINTER(Step), ctypes.c_int64, ctypes.c_int]
    prototype.companded_roundtrip.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    prototype.group = group
    return prototype


def check_codec(prototype):
    """Raise unless the prototype's companded codec decodes what the reference does, to one code step
    (it multiplies by a reciprocal where the reference divides)."""
    generator, group, numel = torch.Generator().manual_seed(0), prototype.group, 1 << 15
    x = torch.randn(numel, generator=generator) * torch.logspace(-6, 0, numel)[torch.randperm(numel, generator=generator)]
    for second, reference in ((0, companded_first_moment), (1, companded_second_moment)):
        values = x.square() if second else x
        out = torch.empty_like(values)
        prototype.companded_roundtrip(values.data_ptr(), values.numel(), second, out.data_ptr())
        expected = reference(values, group)
        scale = values.view(-1, group).abs().amax(1, keepdim=True)
        step = (scale.sqrt() / 255).square() * 2 * 255 if second else scale * 4 / 254  # a code step's reach, loosely
        if not ((out.view(-1, group) - expected.view(-1, group)).abs() <= step).all():
            sys.exit(f"the prototype's companded codec ({'v' if second else 'm'}) departs from the reference")


def library_codecs():
    """The addresses of the library's blockwise quantizer and dequantizer (fastoptim/kernels/cpu/formats.h)."""
    library = ctypes.CDLL(str(cpu_backend.PATH))
    return [ctypes.cast(getattr(library, name), ctypes.c_void_p).value
            for name in ("fastoptim_quantize", "fastoptim_dequantize")]


def states(numel, format_name, group):
    """The prototype's (m, v, m_scales, v_scales) in ``format_name``, as a first step leaves them."""
    if format_name == "fp32":
        return torch.zeros(numel), torch.zeros(numel), None, None
    m, v = torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel, dtype=torch.uint8)
    if format_name == "blockwise":
        m += 127  # the signed table's 0
        return m, v, torch.zeros(numel // 256), torch.zeros(numel // 256)
    return m, v, torch.zeros(numel // group, dtype=torch.float16), torch.zeros(numel // group, dtype=torch.float16)


def prototype_step(prototype, numel, format_name, codecs):
    """A function of ``threads`` that runs the prototype's first step on fresh states (``format_name``)
    of ``numel`` random params and grads, which it holds (``run.held``: param, grad, states)."""
    param, grad = torch.randn(numel), torch.randn(numel)
    m, v, m_scales, v_scales = held = states(numel, format_name, prototype.group)
    pointer = lambda t: None if t is None else t.data_ptr()
    step = Step(param.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), pointer(m_scales), pointer(v_scales),
                *STEP_SCALARS.values(), FORMATS[format_name], *codecs, 0, numel)

    def run(threads):
        if prototype.adamw_step(ctypes.byref(step), numel, threads):
            raise RuntimeError("pthread_create failed")
    run.held = (param, grad, held)
    return run


def library_step(numel, state_bits):
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = fastoptim.AdamW([param], lr=1e-3, state_bits=state_bits, fused=True, foreach=False)
    optimizer.step()
    return lambda threads: optimizer.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    numel = args.numel // 256 * 256
    codecs = library_codecs()
    with tempfile.TemporaryDirectory() as folder:
        prototypes = [build(folder, group) for group in GROUPS]
        for prototype in prototypes:
            check_codec(prototype)
        rows = {f"walk, {name}": prototype_step(prototypes[0], numel, name, codecs) for name in ("fp32", "blockwise")}
        rows |= {f"walk, companded {p.group}": prototype_step(p, numel, "companded", codecs) for p in prototypes}
        rows |= {"fastoptim AdamW fused, fp32 states": library_step(numel, 32),
                 "fastoptim AdamW fused, state_bits=8": library_step(numel, 8)}
        print(f"{numel} elements, {cpu_features()}, torch {torch.__version__}")
        print("| threads | step | ms | min..max | to fp32 | to blockwise |")
        print("|---|---|---|---|---|---|")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            samples = {name: [] for name in rows}
            for repeat in range(args.repeats):
                names = list(rows)
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    start = time.perf_counter()
                    rows[name](threads)
                    samples[name].append(time.perf_counter() - start)
            for name, times in samples.items():
                library = name.startswith("fastoptim")
                ratio = lambda baseline: f"{statistics.median(a / b for a, b in zip(times, samples[baseline])):.2f}"
                print(f"| {threads} | {name} | {statistics.median(times) * 1e3:.2f} | {min(times) * 1e3:.2f}.."
                      f"{max(times) * 1e3:.2f} | {ratio('fastoptim AdamW fused, fp32 states' if library else 'walk, fp32')} "
                      f"| {'' if library else ratio('walk, blockwise')} |")


if __name__ == "__main__":
    main()
