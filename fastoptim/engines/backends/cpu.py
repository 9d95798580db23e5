"""The fused CPU backend: the C kernels of ``fastoptim/kernels/fused_cpu.c``, through the native
library's torch ops (``fastoptim/kernels/native.cpp``, built on the LibTorch stable ABI into
``fastoptim/_C``), one call per table (or per tensor, single-tensor), on torch's threads.

A kernel walks a table: one row of tensors per role (in its spec's ``rows`` order), a chunk plan
over them (``fastoptim.multi_tensor.chunk_plan``) and each tensor's layout (its subset-norm (b, c)
and its states' ``kernel_code``, see fastoptim.states.formats). :class:`BoundTable` hands a table's
params and states to native code once; each step passes the grads and the scalars (in the spec's
``all_scalars`` order, numbers or tensors; a :class:`StepCall` runs any number of tables in one call), and
native code checks every held tensor and grad before any kernel runs, so Python checks no layout
per step. The kernels' 8-bit codes restate fastoptim.states.blockwise8's; ``quantize`` and
``dequantize`` expose them to the tests. The kernels run on the threads of the OpenMP runtime
torch has loaded, when there is one (``openmp()`` is its path), else on pthreads. The environment
variable ``FASTOPTIM_NATIVE_LIBRARY`` names a build to load instead of the packaged one (the
sanitizer test's). The backend's declarations are described in ``fastoptim.engines.backends``.
"""
import importlib.machinery
import os
import warnings
import weakref
from itertools import accumulate
from pathlib import Path
from typing import NamedTuple

import torch

from ...multi_tensor import CPU_COLUMN_CHUNK_NUMEL, bump_versions, in_flat_buffer
from ...states import blockwise8

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels take of params and grads
STEPPED, STALE, GRADS_UNFIT = 0, 1, 2  # what a bound step answers (native.cpp's bound_step)
TAKEN, NOT_TAKEN = 0, 2  # what the clip kernels answer (native.cpp's dense_grad_norm_total)
_EMPTY = torch.empty(0, device="cpu")  # a table's entry for a tensor that has none in its role (no block maxima)


def _load():
    """The path of the native library, loaded; None when there is none, or with a warning when it
    cannot be loaded (built for a torch with a newer stable ABI than the one installed, say)."""
    paths = [Path(__file__).parents[2] / f"_C{suffix}"
             for suffix in (".abi3.so", *importlib.machinery.EXTENSION_SUFFIXES)]
    override = os.environ.get("FASTOPTIM_NATIVE_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"FASTOPTIM_NATIVE_LIBRARY names no file: {override}")
        paths = [Path(override).absolute()]  # dlopen would search the library path for a bare name
    path = next((p for p in paths if p.exists()), None)
    if path is None:
        # said once, at import, whatever engine is asked for: the default engine would otherwise be
        # foreach in silence (a pip install with build isolation builds no library: torch is not there)
        warnings.warn(f"fastoptim: no native library ({paths[0].parent}/_C*.so) was built, so the fused CPU engine "
                      "is unavailable and CPU steps take the foreach engine. Build it where torch and a C compiler "
                      "are installed: pip install --no-build-isolation . (see `fastoptim info`)")
        return None
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        warnings.warn(f"fastoptim: the native library {path} cannot be loaded with torch {torch.__version__} "
                      f"({error}); the fused CPU engine is unavailable and its steps take the foreach engine. "
                      "Reinstall fastoptim against this torch (pip install --no-build-isolation).")
        return None
    if not hasattr(torch.ops.fastoptim, "bind_call"):  # the newest op: a library without it is older
        warnings.warn(f"fastoptim: the native library {path} was built from older sources than this fastoptim "
                      "(it binds no step calls, which this one's steps make); the fused CPU engine is "
                      "unavailable and its steps take the foreach engine. Rebuild it: pip install "
                      "--no-build-isolation -e . (or python setup.py build_ext --inplace).")
        return None
    return path


PATH = _load()
AVAILABLE = PATH is not None
_openmp = None


def use_threads(openmp):
    """Run the kernels on the threads of the OpenMP runtime at path ``openmp`` (it must be loaded
    already), or on pthreads with None. Returns the path in use."""
    global _openmp
    _openmp = openmp if openmp and torch.ops.fastoptim.use_openmp(openmp) == 0 else None
    if _openmp is None:
        torch.ops.fastoptim.use_openmp("")
    return _openmp


def openmp():
    """The path of the OpenMP runtime whose threads run the kernels, or None (pthreads)."""
    return _openmp


def use_f16c(enable):
    """Convert 8-bit codes with AVX2 and F16C where the CPU has them (the default), or, with False, in
    portable C, as CPUs without them do. Returns whether F16C is in use."""
    return bool(torch.ops.fastoptim.use_f16c(bool(enable)))


def _torch_openmp():
    """The path of the OpenMP runtime that torch has loaded (read from /proc/self/maps), or None."""
    torch.ones(1 << 16, device="cpu").sum()  # make sure torch has started its runtime
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return None
    runtimes = [p for p in paths if Path(p).name.startswith(("libgomp", "libiomp", "libomp"))]
    torch_lib = str(Path(torch.__file__).parent)  # prefer torch's own over another package's vendored copy
    return min(runtimes, key=lambda p: (not p.startswith(torch_lib), p), default=None)


if AVAILABLE:
    use_threads(_torch_openmp())


def flat_buffers(states):
    """The flat buffers that ``states`` are views of (see ``multi_tensor.FlatStates``), each once:
    native code holds and checks a buffer in place of the states in it."""
    bases = {id(state._base): state._base for state in states if in_flat_buffer(state) and state._base.numel()}
    return list(bases.values())


def _in_place_of(tensor, original):
    """What native code holds in place of a plan's ``tensor``: its ``original`` (the user's tensor, of
    which it is a view) where the two have the same memory, else the tensor itself. A plan derived from
    another (Muon's momentum part, whose params are direction buffers; a bucket without remainders)
    may keep originals that its tensors are not views of."""
    same = (tensor is not None and original is not None and tensor.data_ptr() == original.data_ptr()
            and tensor.numel() == original.numel())
    return original if same else tensor


class BoundTable:
    """``spec``'s kernel bound to a table's tensors (``tensors``: role to one tensor per param, None
    where a tensor has none in a role; ``table``: their :class:`~fastoptim.multi_tensor.PointerTable`,
    whose chunk plan and layouts it takes). Native code holds the params, states and block maxima
    until this object and every :class:`StepCall` over it (its own, and a bound step's) are collected;
    each step passes the grads. ``watched``, ``originals`` (by role, the tensors it holds in place of
    those of ``tensors`` that are views of them; a checked step's grad may come laid out as either),
    ``rule`` and ``counts``: see :class:`fastoptim.engines.tables.Tables`. With ``runs`` False the
    table runs nothing and may hold tensors of any device: a GPU kernel's, which :func:`check` checks
    before Python launches it."""

    def __init__(self, spec, tensors, table, runs=True, watched=(), originals=None, rule="", counts=()):
        grads_like = ()
        if originals is not None:  # a grad may come laid out as the plan's param (a view) or as the original
            grads_like = tensors["param"]
            tensors = {role: ts if role not in originals else list(map(_in_place_of, ts, originals[role]))
                       for role, ts in tensors.items()}
        held, rows = [], []
        for row, role in enumerate(spec.rows):
            if role != "grad" and role in tensors:
                rows.append(row)
                held.extend(_EMPTY if t is None else t for t in tensors[role])
        layouts = None if table.layouts is None else torch.from_numpy(table.layouts)
        self.params = tensors["param"]  # whose version counters a step bumps
        self.n_scalars = len(spec.all_scalars)  # of its kernel, in each step's scalars
        self.handle = torch.ops.fastoptim.bind(spec.name, held, rows, len(tensors["param"]),
                                               len(spec.rows), len(spec.all_scalars), torch.from_numpy(table.chunks),
                                               layouts, flat_buffers(held[len(self.params):]), list(watched),
                                               list(grads_like), rule, list(counts), runs)
        weakref.finalize(self, torch.ops.fastoptim.unbind, self.handle).atexit = False
        self._calls = {}

    def call(self, per_tensor, ruled):
        """The :class:`StepCall` of this table alone, made once: a checked step's, whose grads may be views."""
        key = per_tensor, ruled
        if key not in self._calls:
            self._calls[key] = StepCall([self], [per_tensor], [ruled], views=True)
        return self._calls[key]


class Launch(NamedTuple):
    """One bound table's part of a :func:`run_launches` call: its grads, its scalar ``values`` in the
    spec's ``all_scalars`` order (see :meth:`StepCall.arguments`), the spec's flag bits, whether it runs once
    per tensor (the single-tensor engine) or in one kernel call, and the ``options`` its table's rule
    computes the scalars past the first three from (None: ``values`` holds them all; see native.cpp's
    Rule)."""
    table: BoundTable
    grads: list
    values: list
    flags: int
    per_tensor: bool
    options: list | None


_FLOATS = (torch.float32, torch.float64)  # the scalar tensors native code reads as they are


class StepCall:
    """One native step over bound ``tables``, bound to native code once (a bound step's plan holds one):
    per table whether it runs once per tensor (``per_tensor``) and whether its rule computes its
    scalars past the first three (``ruled``), and where its scalars begin among all. With ``views``, a
    grad may come laid out as the plan's view of its param (a checked step's, of a subset-norm param);
    else only as its param (a bound step hands the user's grads). ``norm_order``: the order in which a clip
    adds the squares of the tables' tensors (numbered in the tables' order; empty: that order). Native
    code holds the tables while
    the call lives (not the :class:`BoundTable` objects, which may go first), and checks every one
    before any runs."""

    def __init__(self, tables, per_tensor, ruled, views=False, norm_order=()):
        self.per_tensor, self.ruled = list(per_tensor), list(ruled)
        n_scalars = [table.n_scalars for table in tables]
        self.firsts = list(accumulate(n_scalars, initial=0))[:-1]
        self.zeros = [0.0] * sum(n_scalars)
        self.params = [param for table in tables for param in table.params]  # whose version counters a step bumps
        self.handle = torch.ops.fastoptim.bind_call([table.handle for table in tables], self.per_tensor, self.ruled,
                                                    views, list(norm_order))
        weakref.finalize(self, torch.ops.fastoptim.unbind, self.handle).atexit = False

    def arguments(self, grads, values, flag_bits, options, clip=None, amp_scale=None):
        """The native op's arguments for a call: table k takes the next of ``grads`` (its tensors' count),
        ``values[k]`` (its first scalars, in its spec's ``all_scalars`` order: numbers, or tensors, 0-d or
        with one value per tensor, read where they are, fp32 and float64 as they are, others as fp32: no
        host sync; a ruled table's rule computes the rest, which are zeros here, and any other table's
        ``values[k]`` holds them all), ``flag_bits[k]`` (the spec's flags and stochastic rounding, as
        ``KernelSpec.flag_bits`` packs them), and its rule the next of ``options``. ``clip``: (max_norm,
        eps), to clip the grads of all tables together first; ``amp_scale``: GradScaler's scale, whose
        inverse native code computes and scales every table's grads by (and unscales the clip's norm by)."""
        numbers, tensors, slots = self.zeros.copy(), [], []
        for first, leading in zip(self.firsts, values):
            for slot, value in enumerate(leading, first):
                if isinstance(value, torch.Tensor):
                    slots.append(slot)
                    tensors.append(value if value.dtype in _FLOATS else value.float())
                else:
                    numbers[slot] = float(value)
        if amp_scale is not None and amp_scale.dtype not in _FLOATS:
            amp_scale = amp_scale.float()
        return self.handle, grads, numbers, tensors, slots, flag_bits, options, list(clip or ()), amp_scale

    def run(self, grads, values, flag_bits, options, clip=None, amp_scale=None):
        """Run every table's kernel (the arguments: see :meth:`arguments`), then bump the params' version
        counters (as torch's in-place ops do, so autograd notices a param it saved being changed).
        Returns STEPPED, or, having changed nothing, STALE (a held tensor moved or changed its layout)
        or GRADS_UNFIT (a grad is not walked as its param)."""
        status = torch.ops.fastoptim.bound_step(*self.arguments(grads, values, flag_bits, options, clip, amp_scale))
        if status == STEPPED:
            bump_versions(self.params)
        return status


def check(tables, grads):
    """Check bound ``tables`` (each taking the next of ``grads``, as a :class:`StepCall` does) without running
    them: STEPPED and the grads' data pointers (an int64 array), or STALE (any table's tensor moved) or GRADS_UNFIT
    (they all hold; a grad does not fit) and None."""
    pointers = torch.empty(len(grads), dtype=torch.int64, device="cpu")  # host memory whatever the default device
    status = torch.ops.fastoptim.check_bound([table.handle for table in tables], grads, pointers)
    return status, pointers.numpy() if status == STEPPED else None


def holds(tables):
    """Whether the tensors that bound ``tables`` hold and watch are where and as they were bound (their
    grads aside): native code checks them, running nothing."""
    return torch.ops.fastoptim.holds_bound([table.handle for table in tables]) == STEPPED


def probe(tensors, chunks):
    """The bandwidth probe: Adan's traffic (6 fp32 reads, 5 writes per element) with trivial math,
    over ``tensors`` (Adan's rows param, grad and its four states, each a list) and their chunk plan."""
    torch.ops.fastoptim.probe([t for row in tensors for t in row], torch.from_numpy(chunks))


def grad_norm_total(grads, inf):
    """The sum of squares of ``grads``' elements (each chunk's in float64, the chunks added in the
    grads' order), or with ``inf`` their largest magnitude, as a 0-d float64 tensor, and TAKEN; or
    None and NOT_TAKEN (a grad is not a dense CPU tensor of a kernel dtype)."""
    total = torch.empty((), dtype=torch.float64, device="cpu")
    status = torch.ops.fastoptim.dense_grad_norm_total(grads, inf, total)
    return status, total if status == TAKEN else None


def scale_grads(grads, factor):
    """Multiplies ``grads`` by ``factor`` (a 0-d fp32 tensor, read in C: no host sync): TAKEN, or
    NOT_TAKEN, having changed nothing, where a grad is not a dense CPU tensor of a kernel dtype or
    two share memory."""
    return torch.ops.fastoptim.scale_dense_grads(grads, factor)


def quantize(values, codes):
    """The kernels' quantizer on a contiguous fp32 CPU tensor: (uint8 codes, absmax), as
    ``blockwise8.quantize(values, codes)`` computes them."""
    indices = torch.empty(values.shape, dtype=torch.uint8, device="cpu")
    absmax = torch.empty(blockwise8.n_blocks(values.numel()), device="cpu")
    torch.ops.fastoptim.quantize(values, codes.table, indices, absmax)
    return indices, absmax


def dequantize(indices, absmax, codes):
    """The kernels' dequantizer, as ``blockwise8.dequantize(indices, absmax, codes)`` computes it."""
    values = torch.empty(indices.shape, device="cpu")
    torch.ops.fastoptim.dequantize(indices, absmax, codes.table, values)
    return values


# --- the backend (see fastoptim.engines.backends) ------------------------------------------------

NAME = "cpu"
DEVICE_TYPES = ("cpu",)
SPLITS_FORMATS = False  # the C kernel reads each tensor's state format from its layout row
CLIPS = True  # it has the clip's kernels, which check the grads themselves: grad_norm_total, scale_grads
STEP_SCALARS = True  # its bound step computes the clip coefficient and its rules' scalars, and advances the counts
CHECKS_NATIVELY = True  # a call refuses a moved tensor or an unfit grad: Python checks no layout per step
REMAINDERS = True  # it reads and writes bf16 params' master remainders (master_bits 24 and 32)
ROUNDS_SCALED_GRADS = True  # Muon's momentum kernel rounds grad · grad scale to fp32, as the reference's scaled grad
COLUMN_NUMEL = CPU_COLUMN_CHUNK_NUMEL  # a column-subset chunk: whole rows, which stream best from DRAM
BLOCK_COLUMNS = False  # its walk reads an 8-bit column-subset tensor whole, all its columns in one chunk


def available():
    return AVAILABLE


def refusal(param):
    if not available():
        return "the native library is not built or not loaded (see `fastoptim info`)"
    if param.device.type != "cpu":
        return f"no fused kernel for {param.device.type} tensors yet"
    if param.dtype not in DTYPES:
        return f"no fused kernel for {param.dtype}"
    return None


def bind(spec, tensors, table, watched=(), originals=None, rule="", counts=()):
    """Hand the table's params and states to native code (see :class:`BoundTable`)."""
    return BoundTable(spec, tensors, table, watched=watched, originals=originals, rule=rule, counts=counts)


def launch(spec, bound, grads, per_tensor, state_format, values, flag_bits, options=None):
    """One table's part of a native step call, which ``run_launches`` runs with others (``values``: see
    :meth:`StepCall.arguments`). The kernel reads each tensor's state format from its layout row, not from
    ``state_format``."""
    return Launch(bound, grads, values, flag_bits, per_tensor, options)


def run_launches(launches):
    """Run ``launches`` in one native call; False, having changed nothing, when one did not fit."""
    if len(launches) == 1:  # a table's own launch, whose call it keeps
        call, grads = launches[0].table.call(launches[0].per_tensor, launches[0].options is not None), launches[0].grads
    else:
        call = StepCall([launch.table for launch in launches], [launch.per_tensor for launch in launches],
                        [launch.options is not None for launch in launches], views=True)
        grads = [grad for launch in launches for grad in launch.grads]
    return call.run(grads, [launch.values for launch in launches], [launch.flags for launch in launches],
                    [x for launch in launches for x in launch.options or ()]) == STEPPED
