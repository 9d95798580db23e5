"""Generates ``fused_cpu_specs.h``, the C kernel's view of the kernel specs (fastoptim.specs): for
each spec, its pointer-table rows, its scalars, its flag bits and its states' properties, as enums
and macros named after it. ``scripts/c_header.py`` rewrites the header; a test fails
when the committed one differs, so a reordered spec cannot compile silently into the old layout."""
from pathlib import Path

from ..specs import CODE_TABLES, COMMON_SCALARS, ELEMENT_FORMATS, STOCHASTIC_ROUNDING, declared_specs

PATH = Path(__file__).with_name("fused_cpu_specs.h")


def _enum(names, first=None):
    names = [name.upper() for name in names]
    if first is not None:
        names[0] += f" = {first}"
    return "enum { " + ", ".join(names) + " };"


def _spec(spec):
    prefix = spec.name.upper() + "_"
    states = [prefix + name for name in spec.states]
    tables = ["BF16_VALUES" if role.half else role.codes.upper() for role in spec.roles]
    needs = [f"{prefix}{role.when.upper()}" if role.when else "0" for role in spec.roles]
    lines = [
        f"/* {spec.name}: rows param, grad, {''.join(name + ', ' for name in spec.states)}each state's block maxima, "
        "the remainders */",
        _enum(states + [prefix + "states_end"], "FIRST_STATE"),
        f"enum {{ {prefix}REMAINDER = {len(spec.rows) - 1} }};",
        _enum([prefix + name for name in spec.scalars], "COMMON_SCALARS"),
        f"enum {{ {prefix}GRAD = {spec.grad.upper() if spec.grad else -1} }};"
        "  /* the grad row's format (-1: the param's) */",
    ]
    if spec.flags:
        lines.append("enum { " + ", ".join(f"{prefix}{flag.upper()} = {1 << (i + 1)}"
                                           for i, flag in enumerate(spec.flags)) + " };")
    lines += [
        "/* per state, in row order: its 8-bit code table, whether it is per subset under sn, the flag it needs */",
        f"#define {prefix}TABLES {{{', '.join(tables) or '0'}}}",  # {0}: no state, a row never read
        f"#define {prefix}REDUCED {{{', '.join(str(int(role.reduced)) for role in spec.roles) or '0'}}}",
        f"#define {prefix}NEEDS {{{', '.join(needs) or '0'}}}",
    ]
    return "\n".join(lines)


def c_header(specs):
    kernels = " ".join(f"X({spec.name}, {spec.name.upper()})" for spec in specs)
    return "\n\n".join([
        "/* Generated from the kernel specs (fastoptim/specs.py, each optimizer's SPEC) by\n"
        "   `python -m fastoptim.kernels.header`: do not edit. tests/test_specs.py checks it. */",
        "enum { PARAM, GRAD, FIRST_STATE };  /* the first rows of every pointer table */",
        _enum(ELEMENT_FORMATS) + "  /* the element formats of params and states */",
        _enum(COMMON_SCALARS + ("common_scalars",)) + "  /* every kernel's first scalars */",
        _enum(CODE_TABLES + ("code_tables",)) + "  /* the 8-bit code tables (fastoptim/states/blockwise8.py) */",
        f"enum {{ STOCHASTIC_ROUNDING = {STOCHASTIC_ROUNDING} }};  /* every kernel's first flag bit */",
        f"enum {{ MAX_STATES = {max(len(spec.states) for spec in specs)} }};  /* the most states of any kernel */",
        *map(_spec, specs),
        f"/* X(name, NAME) for every kernel spec */\n#define FOR_EACH_KERNEL(X) {kernels}",
    ]) + "\n"

