"""State formats as types: how one state tensor of a param is kept.

A state is created in the format :func:`for_state` picks for its param, role and the group's
``state_bits``, and is recognised later by its dtype (:func:`of`). A format owns its dtype, its
zeros, its companions (tensors kept beside the state under ``{role}{companion}`` keys), the fp32
working copy the loop and foreach engines compute on (``widen``, ``store``), the conversion of a
saved state into it (``encode``, from any format's ``decode``), its code for the fused kernels
(None: no kernel takes it) and the block of elements its chunks must keep whole. The rule for
non-finite values is each format's own: fp32, bf16 and float64 hold them as they are, and 8-bit
blocks contain them (see fastoptim.states.blockwise8).

Roles are :class:`fastoptim.specs.Role`: a role's ``codes`` picks its 8-bit code table, ``half``
keeps it in bf16 under 8-bit states, and ``reduced`` keeps it per subset under ``sn``, in the
:class:`SubsetNorm` format (fp32, or float64 for a float64 param).

A saved 8-bit state names its code table under ``{role}_codes`` (:func:`named_codes`) where a state
that names none would be read in another table: state dicts from before the linear table name none,
and their codes are the float-like table of the role's sign (``UNNAMED``).
"""
import torch

from .. import distributed
from ..specs import ABSMAX, CODES, ELEMENT_FORMATS
from . import blockwise8

# The code table of a saved 8-bit state that names none, by its role's table: Muon's momentum was
# saved in the signed float-like codes before it took linear ones.
UNNAMED = {"signed": "signed", "unsigned": "unsigned", "linear": "signed"}


class Dense:
    """Values of the param's shape in ``dtype``; ``kernel_code``: the fused kernels' name for it."""

    companions = ()
    block = 1

    def __init__(self, name, dtype, kernel_code):
        self.name, self.dtype, self.kernel_code = name, dtype, kernel_code
        self.low_bit = dtype == torch.bfloat16  # the math runs on an fp32 working copy

    def __repr__(self):
        return self.name

    def shape(self, param, partition):
        return param.shape

    def expected(self, param, role, partition):
        """The (shape, dtype) of each tensor this format keeps for ``param``'s ``role``, by key."""
        return {role.name: (self.shape(param, partition), self.dtype)}

    def zeros(self, param, role, partition):
        return {role.name: torch.zeros_like(param, dtype=self.dtype)}

    def fill(self, role, key):
        """The value that tensor ``key`` of a new ``role`` state holds in every element (``zeros``'s)."""
        return 0

    def widen(self, role, state, companions):
        """An fp32 working copy of ``state`` (``companions``: suffix to tensor)."""
        return state.float()

    def store(self, role, state, companions, value):
        """Write the fp32 working copy ``value`` back into ``state`` (to nearest even)."""
        state.copy_(value)

    def decode(self, role, saved):
        """The values a saved state (key to tensor, companions included) holds."""
        return torch.as_tensor(saved[role.name])

    def encode(self, role, value):
        """The tensors that keep ``value`` in this format, by key."""
        return {role.name: value}


class SubsetNorm(Dense):
    """A second moment kept per subset of the param's elements (fastoptim.states.subset_norm), in
    the partition's state shape: small, so fp32 (float64 for a float64 param) in every ``state_bits``."""

    def shape(self, param, partition):
        return partition.state_shape

    def zeros(self, param, role, partition):
        return {role.name: distributed.reduced_zeros(param, partition, self.dtype)}


class Blockwise8(Dense):
    """8-bit blockwise codes (fastoptim.states.blockwise8), with each block's absmax beside them."""

    companions = (ABSMAX,)
    block = blockwise8.BLOCK

    def __init__(self):
        super().__init__("8-bit", torch.uint8, ELEMENT_FORMATS.index("q8"))
        self.low_bit = True

    @staticmethod
    def codes(role):
        """The code table of a role (``role.codes``)."""
        return blockwise8.TABLES[role.codes]

    def expected(self, param, role, partition):  # its blocks are the local shard's
        blocks = torch.Size([blockwise8.n_blocks(distributed.local(param).numel())])
        return {role.name: (param.shape, self.dtype), role.name + ABSMAX: (blocks, torch.float32)}

    def zeros(self, param, role, partition):
        blocks = blockwise8.n_blocks(distributed.local(param).numel())
        return {role.name: torch.full_like(param, self.fill(role, role.name), dtype=torch.uint8),
                role.name + ABSMAX: torch.zeros(blocks, device=param.device)}

    def fill(self, role, key):
        return self.codes(role).zero if key == role.name else 0  # the code of zero, without the work

    def widen(self, role, state, companions):
        return blockwise8.dequantize(state, companions[ABSMAX], self.codes(role))

    def store(self, role, state, companions, value):
        codes, absmax = blockwise8.quantize(value, self.codes(role))
        state.copy_(codes)
        companions[ABSMAX].copy_(absmax)

    def decode(self, role, saved):
        absmax = saved.get(role.name + ABSMAX)
        if absmax is None:
            raise ValueError(f"state '{role.name}' holds 8-bit codes without its '{role.name}{ABSMAX}'")
        name = saved.get(role.name + CODES, UNNAMED[role.codes])  # the table they were written in
        if not isinstance(name, str) or name not in blockwise8.TABLES:
            raise ValueError(f"state '{role.name}' names 8-bit code table {name!r}; there are "
                             f"{sorted(blockwise8.TABLES)}")
        codes, absmax = torch.as_tensor(saved[role.name]), torch.as_tensor(absmax)
        blocks = (blockwise8.n_blocks(codes.numel()),)
        if absmax.shape != blocks:  # a maximum that would broadcast over every block (helper-85)
            raise ValueError(f"state '{role.name}{ABSMAX}' has shape {tuple(absmax.shape)}: the maxima of "
                             f"'{role.name}''s {blocks[0]} blocks of 8-bit codes must have shape {blocks}")
        return blockwise8.dequantize(codes, absmax.float(), blockwise8.TABLES[name])

    def encode(self, role, value):
        codes, absmax = blockwise8.quantize(value.float(), self.codes(role))
        return {role.name: codes, role.name + ABSMAX: absmax}


FP32 = Dense("fp32", torch.float32, ELEMENT_FORMATS.index("fp32"))
BF16 = Dense("bf16", torch.bfloat16, ELEMENT_FORMATS.index("bf16"))
FLOAT64 = Dense("float64", torch.float64, None)
Q8 = Blockwise8()
REDUCED = SubsetNorm("subset-norm fp32", torch.float32, FP32.kernel_code)
REDUCED64 = SubsetNorm("subset-norm float64", torch.float64, None)
COMPLEX64 = Dense("complex64", torch.complex64, None)
COMPLEX128 = Dense("complex128", torch.complex128, None)
FORMATS = {fmt.dtype: fmt for fmt in (FP32, BF16, FLOAT64, Q8, COMPLEX64, COMPLEX128)}


def of(state):
    """The format a param-shaped state tensor is kept in (by its dtype), or None for one no format
    has (an edited state: the optimizer's checks name it)."""
    return FORMATS.get(state.dtype)


def for_state(param, role, state_bits, partition):
    """The format a state of ``param`` is created in. States are fp32 whatever the param's dtype,
    except: a float64 param keeps float64 states and math (rounding it through fp32 would change
    it); ``state_bits=16`` keeps bf16 states; ``state_bits=8`` keeps 8-bit ones, and bf16 ones for
    ``half`` roles, for params of at least ``blockwise8.MIN_NUMEL`` elements. A ``reduced`` role
    under a subset-norm ``partition`` (not None) is kept per subset. A complex param keeps states
    of its own dtype, as torch.optim's (the engines update their real views), whatever
    ``state_bits``."""
    if param.is_complex():
        return FORMATS[param.dtype]
    wide = param.dtype == torch.float64
    if partition is not None and role.reduced:
        return REDUCED64 if wide else REDUCED
    if wide:
        return FLOAT64
    if state_bits == 32 or state_bits == 8 and param.numel() < blockwise8.MIN_NUMEL:
        return FP32
    if state_bits == 16 or role.half:
        return BF16
    return Q8


def named_codes(role):
    """The entries that name ``role``'s code table in a saved state of its 8-bit codes: none where
    a state naming none is read in that table (``UNNAMED``), so that those state dicts are as before."""
    return {} if UNNAMED[role.codes] == role.codes else {role.name + CODES: role.codes}


def convert(saved, role, target):
    """``saved`` (a state dict of one param) with ``role`` converted into format ``target``, from
    whatever format it was saved in (8-bit codes in the table it names); a DTensor's local shard is
    converted (8-bit blocks are the shard's)."""
    value = torch.as_tensor(saved[role.name])
    if distributed.is_dtensor(value):
        local = saved | {role.name: value.to_local()}
        converted = convert(local, role, target)
        return converted | {role.name: distributed.like(converted[role.name], value)}
    source = of(value) or FP32
    if role.name + ABSMAX in saved and source is not Q8:  # codes cast by a tool would load as values (helper-85)
        raise ValueError(f"state '{role.name}' is {value.dtype} beside its block maxima '{role.name}{ABSMAX}': "
                         f"8-bit codes are {Q8.dtype}")
    rest = {key: v for key, v in saved.items() if key not in {role.name + c for c in (*source.companions, CODES)}}
    return rest | target.encode(role, source.decode(role, saved))
