VENV := .venv
# Each command sets up what it needs: `make bench` no test tools and (without a GPU) no Triton.
SETUP_INPUTS := pyproject.toml setup.py scripts/setup.sh scripts/install_torch.py \
	$(shell find fastoptim/kernels -name '*.c' -o -name '*.cpp' -o -name '*.h')

.PHONY: bench test docs explore

bench: $(VENV)/.ready-bench
	$(VENV)/bin/fastoptim bench

# Two worker processes, one per core of the CI machine, each taking whole files (a file's tests keep
# their order); the sanitizer job goes first (tests/conftest.py). OpenMP's idle threads sleep instead of
# spinning: the kernels' and torch's would burn the core the other worker needs (measured here: the
# suite's wall time 447 s -> 356 s, with every test's thread count as it was).
test: $(VENV)/.ready-test
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20

# The property tests with examples drawn afresh (the gate's are the same on every run: tests/conftest.py).
explore: $(VENV)/.ready-test
	FASTOPTIM_HYPOTHESIS=explore OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile \
		$$(grep -l "from hypothesis import" tests/test_*.py)

# The site's home page is the README, its links made relative to docs/; warnings are errors.
docs: $(VENV)/.ready-docs
	sed 's#](docs/#](#g' README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

$(VENV)/.ready-docs: $(SETUP_INPUTS)
	bash scripts/setup.sh docs
	touch $@

$(VENV)/.ready-bench: $(SETUP_INPUTS)
	bash scripts/setup.sh bench
	touch $@

# the test set-up holds the bench's too
$(VENV)/.ready-test: $(SETUP_INPUTS)
	bash scripts/setup.sh test
	touch $@ $(VENV)/.ready-bench
