"""ctypes binding of the fused CPU kernels in ``fused_cpu.c``.

Each kernel (``fastoptim_<spec name>``) takes a pointer table (one row of data pointers per role,
in its spec's ``rows`` order), a chunk table, a layout table (each tensor's subset-norm (b, c) and
its states' ``kernel_code``, see fastoptim.states.formats), its scalars in its spec's
``all_scalars`` order and its flag bits (see fastoptim.specs; the C enums are generated from the
specs). ctypes releases the GIL for the call. The kernels' 8-bit codes restate
fastoptim.states.blockwise8's; ``quantize`` and ``dequantize`` expose them to the tests. The
kernels run on the threads of the OpenMP runtime torch has loaded, when there is one
(``LIBRARY.openmp`` is its path), else on pthreads. The environment variable
``FASTOPTIM_FUSED_CPU_LIBRARY`` names a build to load instead of the packaged one (the sanitizer
test's).
"""
import ctypes
import importlib.machinery
import os
from pathlib import Path

import torch

from ..states import blockwise8

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# pointers, tensor count, chunks, first chunk, end chunk: every kernel's first arguments
TABLE_ARGUMENTS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]


class Scalar(ctypes.Structure):
    """A pointer to fp32 values: one shared value (stride 0) or one per tensor (stride 1)."""
    _fields_ = [("values", ctypes.c_void_p), ("stride", ctypes.c_int64)]


def _load():
    paths = [Path(__file__).parent / f"_fused_cpu{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    override = os.environ.get("FASTOPTIM_FUSED_CPU_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"FASTOPTIM_FUSED_CPU_LIBRARY names no file: {override}")
        paths = [Path(override).absolute()]  # dlopen would search the library path for a bare name
    for path in paths:
        if path.exists():
            library = ctypes.CDLL(str(path))
            break
    else:
        return None
    library.fastoptim_probe.argtypes = TABLE_ARGUMENTS + [ctypes.c_int32]
    library.fastoptim_probe.restype = ctypes.c_int
    library.fastoptim_use_openmp.argtypes = [ctypes.c_char_p]
    library.fastoptim_grad_norm.argtypes = TABLE_ARGUMENTS[:4] + [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                                                         ctypes.c_int32]
    library.fastoptim_scale_grads.argtypes = TABLE_ARGUMENTS[:4] + [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32]
    library.fastoptim_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                                           ctypes.c_void_p]
    library.fastoptim_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
                                             ctypes.c_void_p]
    library.fastoptim_use_f16c.argtypes = [ctypes.c_int32]
    library.openmp = None
    return library


def use_threads(openmp):
    """Run the kernels on the threads of the OpenMP runtime at path ``openmp`` (it must be loaded
    already), or on pthreads with None. Returns the path in use."""
    LIBRARY.openmp = openmp if openmp and LIBRARY.fastoptim_use_openmp(openmp.encode()) == 0 else None
    if LIBRARY.openmp is None:
        LIBRARY.fastoptim_use_openmp(None)
    return LIBRARY.openmp


def use_f16c(enable):
    """Convert 8-bit codes with AVX2 and F16C where the CPU has them (the default), or, with False, in
    portable C, as CPUs without them do. Returns whether F16C is in use."""
    return bool(LIBRARY.fastoptim_use_f16c(int(enable)))


def _torch_openmp():
    """The path of the OpenMP runtime that torch has loaded (read from /proc/self/maps), or None."""
    torch.ones(1 << 16).sum()  # make sure torch has started its runtime
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return None
    runtimes = [p for p in paths if Path(p).name.startswith(("libgomp", "libiomp", "libomp"))]
    torch_lib = str(Path(torch.__file__).parent)  # prefer torch's own over another package's vendored copy
    return min(runtimes, key=lambda p: (not p.startswith(torch_lib), p), default=None)


LIBRARY = _load()
AVAILABLE = LIBRARY is not None
if AVAILABLE:
    use_threads(_torch_openmp())


def kernel(spec):
    """The C entry point of a kernel spec's family, ``fastoptim_<spec.name>``."""
    function = getattr(LIBRARY, f"fastoptim_{spec.name}")
    if function.argtypes is None:  # first use: declare its arguments
        function.argtypes = TABLE_ARGUMENTS + [ctypes.c_void_p, ctypes.POINTER(Scalar), ctypes.c_int32,
                                               ctypes.c_int32, ctypes.c_int32]
        function.restype = ctypes.c_int
    return function


def run(spec, pointers, n_tensors, chunks, chunk_range, layouts, scalars, dtype, flags, n_threads):
    """Run ``spec``'s kernel over chunks ``chunk_range`` of the tables (numpy int64; ``layouts``,
    each tensor's subset-norm (b, c) and state format, may be None when all are dense with fp32
    states); ``flags``: ``spec.flag_bits(...)``."""
    status = kernel(spec)(
        pointers.ctypes.data, n_tensors, chunks.ctypes.data, chunk_range[0], chunk_range[1],
        None if layouts is None else layouts.ctypes.data, scalars, DTYPES[dtype], flags, n_threads)
    if status:
        raise RuntimeError(f"fused CPU kernel {spec.name} has no variant for dtype {dtype} with flags {flags}")


def probe(pointers, n_tensors, chunks, n_threads):
    """The bandwidth probe: Adan's traffic (6 fp32 reads, 5 writes per element) with trivial math."""
    LIBRARY.fastoptim_probe(pointers.ctypes.data, n_tensors, chunks.ctypes.data, 0, len(chunks), n_threads)


def _table(codes):
    return int(codes.signed)  # the C enum's UNSIGNED and SIGNED


def grad_norm_partials(table, dtype, inf, n_threads):
    """Per chunk of ``table`` (a PointerTable with the grads in its first row): the sum of squares,
    or with ``inf`` the largest magnitude, as a float64 tensor."""
    partials = torch.empty(len(table.chunks), dtype=torch.float64)
    LIBRARY.fastoptim_grad_norm(table.pointers.ctypes.data, table.pointers.shape[1], table.chunks.ctypes.data,
                                len(table.chunks), DTYPES[dtype], int(inf), partials.data_ptr(), n_threads)
    return partials


def scale_grads(table, dtype, factor, n_threads):
    """Multiplies the grads of ``table`` by ``factor`` (a 0-d fp32 tensor, read in C: no host sync)."""
    LIBRARY.fastoptim_scale_grads(table.pointers.ctypes.data, table.pointers.shape[1], table.chunks.ctypes.data,
                                  len(table.chunks), DTYPES[dtype], factor.data_ptr(), n_threads)


def quantize(values, codes):
    """The kernels' quantizer on a contiguous fp32 CPU tensor: (uint8 codes, absmax), as
    ``blockwise8.quantize(values, codes)`` computes them."""
    indices = torch.empty(values.shape, dtype=torch.uint8)
    absmax = torch.empty(blockwise8.n_blocks(values.numel()))
    LIBRARY.fastoptim_quantize(values.data_ptr(), values.numel(), _table(codes), indices.data_ptr(), absmax.data_ptr())
    return indices, absmax


def dequantize(indices, absmax, codes):
    """The kernels' dequantizer, as ``blockwise8.dequantize(indices, absmax, codes)`` computes it."""
    values = torch.empty(indices.shape)
    LIBRARY.fastoptim_dequantize(indices.data_ptr(), absmax.data_ptr(), indices.numel(), _table(codes),
                                 values.data_ptr())
    return values
