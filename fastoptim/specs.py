"""What a fused kernel of an algorithm takes, declared once, beside the algorithm's math (each
optimizer's ``SPEC``). The engines, the C binding, the Triton kernels and the state-dict code read a
:class:`KernelSpec`; the C kernel's enums are generated from the specs (``fastoptim.kernels.header``),
and a test fails when the committed header differs from what they generate.

A kernel takes one pointer table: a row of data pointers per role, in :attr:`KernelSpec.rows`
order (param, grad, each state, each state's block maxima under 8-bit states, then the master
remainders of bf16 params under ``master_bits``: fastoptim.states.master), and one row of
fp32 scalars per tensor (or one shared row) in :attr:`KernelSpec.all_scalars` order. Its feature
flags are compile-time switches: bit 0 is stochastic rounding, bit i + 1 the spec's i-th flag.
"""
from dataclasses import dataclass

COMMON_SCALARS = ("found_inf", "seed", "grad_scale")  # every kernel's first scalars, in this order
ABSMAX = "_absmax"  # the suffix of an 8-bit state's block maxima, as a role and as a state-dict key
REMAINDER = "master_remainder"  # the role and state-dict key of a bf16 param's master remainder
# The 8-bit code tables (fastoptim/states/blockwise8.py) by name; a table's position is its number in the kernels
CODE_TABLES = ("unsigned", "signed", "linear")
CODES = "_codes"  # the suffix of the key naming a saved 8-bit state's code table (fastoptim/states/formats.py)
STOCHASTIC_ROUNDING = 1  # the flag bit every kernel has
# The fused kernels' element formats, by their code (the position): of params fp32, bf16, fp16, and a
# bf16 param beside its 8- or 16-bit master remainder (fastoptim/states/master.py); of states fp32,
# bf16 and q8 (8-bit codes, fastoptim/states/formats.py)
ELEMENT_FORMATS = ("fp32", "bf16", "fp16", "q8", "bf16_r8", "bf16_r16")
_DECLARED = {}  # every kernel spec, by name, in the order they were declared


@dataclass(frozen=True)
class Role:
    """A state of an algorithm.

    ``codes``: its 8-bit code table (fastoptim.states.blockwise8): ``"signed"`` for a moment of
    either sign, ``"unsigned"`` for a second moment (both float-like: even relative precision), or
    ``"linear"`` (evenly spaced, fine near the block's largest elements: Muon's momentum).
    ``reduced``: kept per subset under ``sn`` (fastoptim.states.subset_norm), so fp32 and small.
    ``half``: kept in bf16, not 8-bit codes, under ``state_bits=8``.
    ``when``: the feature flag without which the algorithm keeps no such state (None: always kept).
    ``optional``: a saved state may lack it (the first step does not read it).
    """

    name: str
    codes: str = "signed"
    reduced: bool = False
    half: bool = False
    when: str | None = None
    optional: bool = False

    def __post_init__(self):
        if self.codes not in CODE_TABLES:
            raise ValueError(f"role {self.name!r}: no 8-bit code table {self.codes!r} (tables: {CODE_TABLES})")


@dataclass(frozen=True)
class KernelSpec:
    """A kernel family: its state roles, its own scalars (after ``COMMON_SCALARS``) and its feature
    flags. Several optimizers may share one (AdamW, AdamWSN and RMSPropSN). ``elementwise``: False
    for math that needs each tensor whole (Muon's matrices): no fused kernel restates it, so it
    declares no scalars, and the foreach engine does not cut its tensors into pieces. ``grad``: the
    element format of the grad row where it is not the param's: ``"bf16"`` for Muon's update, whose
    "grad" is the orthogonalized direction, bf16 whatever the param's dtype."""

    name: str
    roles: tuple[Role, ...]
    scalars: tuple[str, ...]
    flags: tuple[str, ...] = ()
    elementwise: bool = True
    grad: str | None = None

    def __post_init__(self):
        if self.grad not in (None, "bf16"):
            raise ValueError(f"kernel spec {self.name!r}: no grad format {self.grad!r} (None: the param's, or 'bf16')")
        names = [role.name for role in self.roles]
        if len(set(names)) != len(names) or len(set(self.all_scalars)) != len(self.all_scalars):
            raise ValueError(f"kernel spec {self.name!r}: a role or scalar is declared twice")
        for role in self.roles:
            if role.when is not None and role.when not in self.flags:
                raise ValueError(f"kernel spec {self.name!r}: role {role.name!r} depends on an undeclared flag")
        if _DECLARED.setdefault(self.name, self) != self:
            raise ValueError(f"kernel spec {self.name!r} is declared twice, differently")

    @property
    def states(self):
        """The state roles' names, in row order."""
        return tuple(role.name for role in self.roles)

    @property
    def rows(self):
        return ("param", "grad") + self.states + tuple(name + ABSMAX for name in self.states) + (REMAINDER,)

    @property
    def all_scalars(self):
        return COMMON_SCALARS + self.scalars

    @property
    def reduced(self):
        return tuple(role.name for role in self.roles if role.reduced)

    @property
    def half(self):
        return tuple(role.name for role in self.roles if role.half)

    @property
    def optional(self):
        return frozenset(role.name for role in self.roles if role.optional)

    def role(self, name):
        return self.roles[self.states.index(name)]

    def kept(self, flags):
        """The state roles an algorithm keeps with feature ``flags`` (flag name: bool)."""
        return tuple(role.name for role in self.roles if role.when is None or flags[role.when])

    def flag_bits(self, flags, stochastic_rounding=False):
        """``flags`` as the kernels take them (see the module docstring)."""
        bits = STOCHASTIC_ROUNDING if stochastic_rounding else 0
        for i, flag in enumerate(self.flags):  # a loop, not sum() of a generator: read at every step
            if flags[flag]:
                bits |= 2 << i
        return bits

    def unpack_flags(self, bits):
        """The inverse of :meth:`flag_bits`: (flags, stochastic_rounding)."""
        return {flag: bool(bits >> (i + 1) & 1) for i, flag in enumerate(self.flags)}, bool(bits & STOCHASTIC_ROUNDING)


def declared_specs():
    """Every elementwise kernel spec declared so far (those the fused kernels restate), each once, in
    the order of their declarations: importing fastoptim declares its optimizers' (each beside its
    algorithm, in fastoptim/optimizers)."""
    return tuple(spec for spec in _DECLARED.values() if spec.elementwise)
