# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
OUT ?= runs/demo

.PHONY: setup demo test

# Installs the pinned CPU torch only when no torch is importable (a GPU user's torch is left alone).
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) -m fivefold train examples/demo.yaml --out $(OUT)

test: setup
	$(PYTHON) -m pytest --durations=15
