"""Rewrite ``fastoptim/kernels/fused_cpu_specs.h``, the C kernel's view of the kernel specs, from the
specs the optimizers declare (see fastoptim.kernels.header): ``.venv/bin/python scripts/c_header.py``,
then rebuild the native library. tests/test_specs.py fails while the committed header differs."""
import fastoptim.optimizers  # noqa: F401  (importing the optimizers declares their specs)
from fastoptim.kernels import header
from fastoptim.specs import declared_specs

if __name__ == "__main__":
    header.PATH.write_text(header.c_header(declared_specs()))
