VENV := .venv
READY := $(VENV)/.ready

.PHONY: bench test

bench: $(READY)
	$(VENV)/bin/fastoptim bench

test: $(READY)
	$(VENV)/bin/python -m pytest -q

$(READY): pyproject.toml setup.py scripts/setup.sh fastoptim/kernels/fused_cpu.c fastoptim/kernels/fused_cpu_specs.h
	bash scripts/setup.sh
	touch $@
