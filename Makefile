# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
OUT ?= runs/demo

.PHONY: setup demo test test-isa

# Installs the pinned CPU torch only when no torch is importable (a GPU user's torch is left alone).
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) -m fivefold train examples/demo.yaml --out $(OUT)

test: setup
	$(PYTHON) -m pytest --durations=15

# The tolerance-sensitive tests under three other CPU kernel settings and this machine's own, one file
# at a time, then the worst case of every tolerance (docs/tolerances.md). 35-45 min on 2 shared cores.
test-isa: setup
	$(PYTHON) scripts/tolerances.py run
	$(PYTHON) scripts/tolerances.py report
