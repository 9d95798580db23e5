VENV := .venv
READY := $(VENV)/.ready

.PHONY: bench test

bench: $(READY)
	$(VENV)/bin/fastoptim bench

test: $(READY)
	$(VENV)/bin/python -m pytest -q

$(READY): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@
