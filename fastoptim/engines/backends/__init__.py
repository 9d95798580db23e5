"""The fused engines' backends, one module each, chosen by the params' device type. A backend
declares ``NAME``, ``DEVICE_TYPES`` (the device types it is picked for), ``SPLITS_FORMATS`` (its
kernels are compiled for one state format, so each format gets a table of its own),
``CHECKS_NATIVELY`` (its calls check every tensor's pointer and layout, so Python need not),
``REMAINDERS`` (its kernels read and write bf16 params' master remainders; else those take foreach),
``ROUNDS_SCALED_GRADS`` (its Muon momentum kernel rounds a grad times its scale to fp32 before the
lerps, as the reference does; else a Muon bucket scales its grads by a clip or GradScaler
coefficient first),
``COLUMN_NUMEL`` (the elements of a chunk of a column-subset tensor), ``BLOCK_COLUMNS`` (its kernels
take a column-subset tensor with 8-bit states in runs of whole blocks of columns, where its rows are
whole blocks; else all its columns in one chunk),
``CLIPS`` (it has the clip's kernels, ``grad_norm_total(grads, inf)`` (status and the float64 sum
of squares or largest magnitude, in fastoptim's one order of a norm's sum) and
``scale_grads(grads, factor)``, which answer ``TAKEN``, or ``NOT_TAKEN`` when they cannot take
the grads and changed nothing), ``STEP_SCALARS`` (its bound step computes the step's scalars:
``StepCall(tables, per_tensor, ruled)`` makes the one call of a bound step's tables once, whose
``run(grads, values, flag_bits, options, clip, amp_scale)`` each step hands the grads, each table's
first scalars, flags and options (a table's rule computes the rest from them and its counts, which
it advances: see native.cpp's Rule), what to clip the grads of all its tables together by, as
``clip.clip_coefficient`` would, and GradScaler's scale, which it inverts and unscales by; it
answers ``STEPPED``, or, having changed nothing, another status; a launch with ``options`` has
its table's rule compute its scalars too),
``available()``, ``refusal(param)`` (why it cannot run a tensor at all, its device or dtype
included, or None), ``bind(spec, tensors, table, watched, originals, rule, counts)`` (what its
launches read of a cached pointer table and its tensors, by role; see ``tables.Tables``),
``launch(spec, bound, grads, per_tensor, state_format, values, flag_bits, options)`` (one
run of its kernel over what ``bind`` made, with the grads, the scalar
``values`` (in ``spec.all_scalars`` order: a number, a 0-d tensor or a 1-d tensor with one value per
tensor) and the spec's flags and stochastic rounding as ``KernelSpec.flag_bits`` packs them, once or
once per tensor) and
``run_launches(launches)`` (run them all, checked before any runs; False, having changed nothing,
when a tensor moved or a grad does not fit: the caller builds the tables again). A step whose
every table a backend that ``CHECKS_NATIVELY`` holds runs its launches together, unchecked in
Python. A new backend is one more module in ``BACKENDS``.
``FASTOPTIM_FUSED_BACKEND=<name>`` forces one, for debugging and tests."""
import os

from . import cpu, triton

BACKENDS = {backend.NAME: backend for backend in (cpu, triton)}
# each device type's backend: the first in BACKENDS that runs it
BY_DEVICE_TYPE = {kind: backend for backend in reversed(BACKENDS.values()) for kind in backend.DEVICE_TYPES}


FORCING_VARIABLE = "FASTOPTIM_FUSED_BACKEND"


def forced():
    """The backend ``FASTOPTIM_FUSED_BACKEND`` forces, or None; a ValueError for an unknown name."""
    name = os.environ.get(FORCING_VARIABLE) or None
    if name not in (None, *BACKENDS):
        raise ValueError(f"FASTOPTIM_FUSED_BACKEND={name!r}: expected one of {tuple(BACKENDS)}")
    return name and BACKENDS[name]


def for_device(device):
    """The backend for tensors on ``device``: the forced one, else the first that runs its type
    (the C kernel takes what no other does, and refuses it with its reason)."""
    return forced() or BY_DEVICE_TYPE.get(device.type, cpu)


def any_available():
    """Whether some backend can run at all here (fused=None then picks the fused engines)."""
    return any(backend.available() for backend in BACKENDS.values())
