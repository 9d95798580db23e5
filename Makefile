VENV := .venv
# Each command sets up what it needs: `make bench` no test tools and (without a GPU) no Triton.
SETUP_INPUTS := pyproject.toml setup.py scripts/setup.sh scripts/install_torch.py \
	fastoptim/kernels/fused_cpu.c fastoptim/kernels/fused_cpu_specs.h

.PHONY: bench test

bench: $(VENV)/.ready-bench
	$(VENV)/bin/fastoptim bench

test: $(VENV)/.ready-test
	$(VENV)/bin/python -m pytest -q

$(VENV)/.ready-bench: $(SETUP_INPUTS)
	bash scripts/setup.sh bench
	touch $@

# the test set-up holds the bench's too
$(VENV)/.ready-test: $(SETUP_INPUTS)
	bash scripts/setup.sh test
	touch $@ $(VENV)/.ready-bench
